"""torchrun --nproc-per-node N fsdp1_loop.py [OUT]: FSDP1 (``FullyShardedDataParallel``, one flat
parameter per wrapped layer, ``use_orig_params``) training loop, the model built on the host and
moved by FSDP's ``device_id``; ``OUT`` receives ``torch.cuda.memory_allocated()`` right after the
wrap (the sharded flat parameters only)."""
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp.wrap import ModuleWrapPolicy

dist.init_process_group("nccl")
rank = int(os.environ["LOCAL_RANK"])
torch.cuda.set_device(rank)
model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024, bias=False) for _ in range(4)])
model = FSDP(model, device_id=torch.cuda.current_device(), auto_wrap_policy=ModuleWrapPolicy({torch.nn.Linear}),
             use_orig_params=True)
if len(sys.argv) > 1 and rank == 0:
    with open(sys.argv[1], "w") as f:
        f.write(str(torch.cuda.memory_allocated()))
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
for _ in range(3):
    x = torch.randn(8, 1024, device="cuda")
    model(x).sum().backward()
    opt.step()
    opt.zero_grad()
dist.destroy_process_group()
