"""torchrun --nproc-per-node N fsdp2_loop.py: FSDP2 (fully_shard per layer, default mesh) training loop."""
import os

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

dist.init_process_group("nccl")
rank = int(os.environ["LOCAL_RANK"])
torch.cuda.set_device(rank)
model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024, bias=False) for _ in range(4)]).cuda()
for layer in model:
    fully_shard(layer)
fully_shard(model)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
for _ in range(3):
    x = torch.randn(8, 1024, device="cuda")
    model(x).sum().backward()
    opt.step()
    opt.zero_grad()
dist.destroy_process_group()
