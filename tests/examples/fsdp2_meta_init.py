"""torchrun --nproc-per-node N fsdp2_meta_init.py: FSDP2 on a model built on meta, sharded, then
materialised with to_empty (torchtitan's and accelerate's cpu_ram_efficient_loading order)."""
import os

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

dist.init_process_group("nccl")
rank = int(os.environ["LOCAL_RANK"])
torch.cuda.set_device(rank)
mesh = init_device_mesh("cuda", (dist.get_world_size(),))
with torch.device("meta"):
    model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024, bias=False) for _ in range(4)])
for layer in model:
    fully_shard(layer, mesh=mesh)
fully_shard(model, mesh=mesh)
model.to_empty(device="cuda")
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
for _ in range(3):
    x = torch.randn(8, 1024, device="cuda")
    model(x).sum().backward()
    opt.step()
    opt.zero_grad()
dist.destroy_process_group()
