"""torchrun --nproc-per-node N ddp_loop.py: DistributedDataParallel training loop (model.to(rank))."""
import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

dist.init_process_group("nccl")
rank = int(os.environ["LOCAL_RANK"])
model = DDP(torch.nn.Sequential(*[torch.nn.Linear(1024, 1024, bias=False) for _ in range(4)]).to(rank), device_ids=[rank])
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
for _ in range(3):
    x = torch.randn(8, 1024, device="cuda")
    model(x).sum().backward()
    opt.step()
    opt.zero_grad()
