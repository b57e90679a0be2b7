import torch
from torch import nn

model = nn.Linear(8, 8).cuda()
out = model(torch.randn(2, 8, device="cuda"))
picked = (out * 100).long().tolist()  # integers computed from model data: not on fake tensors
