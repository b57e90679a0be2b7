"""torchrun --nproc-per-node 2 fsdp2_symm_mem.py [--no-symm-mem]: FSDP2 (fully_shard per layer) with its
collectives' buffers on symmetric memory, switched on as torchtitan's ``enable_fsdp_symm_mem`` does
(``set_force_sum_reduction_for_comms(True)`` then ``set_symm_mem_for_comm()`` on every FSDP module)."""
import argparse
import os

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule, fully_shard

p = argparse.ArgumentParser()
p.add_argument("--no-symm-mem", action="store_true")
args = p.parse_args()

dist.init_process_group("nccl")
torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024, bias=False) for _ in range(4)]).cuda()
for layer in model:
    fully_shard(layer)
fully_shard(model)
if not args.no_symm_mem:
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_force_sum_reduction_for_comms(True)
            module.set_symm_mem_for_comm()
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
for _ in range(2):
    x = torch.randn(8, 1024, device="cuda")
    model(x).sum().backward()
    opt.step()
    opt.zero_grad()
dist.destroy_process_group()
