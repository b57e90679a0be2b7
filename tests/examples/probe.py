"""Writes what torch.cuda tells a script to the JSON file named by argv[1] (vramplan's tests)."""

import json
import sys

import torch
from torch import nn

p = torch.cuda.get_device_properties(0)
info = {
    "available": torch.cuda.is_available(), "count": torch.cuda.device_count(), "name": torch.cuda.get_device_name(),
    "capability": list(torch.cuda.get_device_capability()), "total": p.total_memory, "bf16": torch.cuda.is_bf16_supported(),
}
model = nn.Linear(1024, 1024).cuda()
opt = torch.optim.SGD(model.parameters(), lr=0.1)
scaler = torch.amp.GradScaler("cuda")
torch.cuda.reset_peak_memory_stats()
with torch.autocast("cuda", dtype=torch.float16):
    loss = model(torch.randn(64, 1024, device="cuda")).float().sum()
scaler.scale(loss).backward()
scaler.step(opt)
scaler.update()
torch.cuda.synchronize()
info["allocated"] = torch.cuda.memory_allocated()
info["max_allocated"] = torch.cuda.max_memory_allocated()
info["reserved"] = torch.cuda.memory_reserved()
info["free"], info["mem_total"] = torch.cuda.mem_get_info()
info["stats_peak"] = torch.cuda.memory_stats()["allocated_bytes.all.peak"]
with open(sys.argv[1], "w") as f:
    json.dump(info, f)
opt.step()
