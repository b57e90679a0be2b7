"""An inference-only script: a model in eval mode under no_grad, several batches."""

import torch
from torch import nn

model = nn.Sequential(nn.Linear(128, 512), nn.ReLU(), nn.Linear(512, 128)).cuda().eval()
with torch.no_grad():
    for _ in range(10):
        out = model(torch.randn(32, 128, device="cuda"))
print("done")
