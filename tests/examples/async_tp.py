"""torchrun --nproc-per-node 2 async_tp.py [--no-symm-mem] [--no-async-tp]: a sequence-parallel MLP under tensor
parallelism, compiled with Inductor's micro-pipeline TP switched on as torchtitan's
``_maybe_enable_async_tp`` does (symmetric memory on the TP group, then
``torch._inductor.config._micro_pipeline_tp = True``). With ``--no-symm-mem`` the pass has no
group to fuse on (it fuses nothing: plain TP); with ``--no-async-tp`` the pass stays off."""
import argparse
import os

import torch
import torch._inductor.config
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

p = argparse.ArgumentParser()
p.add_argument("--no-symm-mem", action="store_true")
p.add_argument("--no-async-tp", action="store_true")
args = p.parse_args()

dist.init_process_group("nccl")
torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
mesh = init_device_mesh("cuda", (dist.get_world_size(),))
model = torch.nn.Sequential(torch.nn.Linear(1024, 4096, bias=False), torch.nn.ReLU(),
                            torch.nn.Linear(4096, 1024, bias=False)).cuda()
parallelize_module(model, mesh, {"0": ColwiseParallel(input_layouts=Shard(0)),
                                 "2": RowwiseParallel(output_layouts=Shard(0))})
if not args.no_symm_mem:
    from torch.distributed._symmetric_memory import enable_symm_mem_for_group

    enable_symm_mem_for_group(mesh.get_group().group_name)
torch._inductor.config._micro_pipeline_tp = not args.no_async_tp
model = torch.compile(model)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
for _ in range(2):
    x = torch.randn(256, 1024, device="cuda")  # this rank's rows of the sequence
    model(x).sum().backward()
    opt.step()
    opt.zero_grad()
dist.destroy_process_group()
