"""Writes what a script can see of its GPU to the JSON file named by argv[1] (vramplan's tests):
devices, torch.accelerator, tied weights and parameter identity across .to("cuda"), formatting
and host copies of device tensors."""

import json
import sys

import torch
from torch import nn

info: dict = {}
acc = torch.accelerator
info["accelerator"] = [acc.is_available(), str(acc.current_accelerator()), acc.device_count(),
                       acc.current_device_index()]
info["cuda_version"] = torch.version.cuda


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(512, 64)
        self.head = nn.Linear(64, 512, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.emb(x))


model = Tied()
before = model.emb.weight
opt = torch.optim.SGD(model.parameters(), lr=0.1)  # built before the move, as accelerate does
model.to(acc.current_accelerator())
p = model.emb.weight
info["param"] = [str(p.device), p.is_cuda, p.get_device(), p.is_meta, p.type()]
info["tied"] = model.head.weight is model.emb.weight
info["same_object"] = p is before and opt.param_groups[0]["params"][0] is p
info["params"] = sum(q.numel() for q in model.parameters())
x = torch.randint(0, 512, (4, 16)).to("cuda")
info["input"] = [str(x.device), x.is_cuda, x.get_device()]
side = torch.cuda.Stream()
with torch.cuda.stream(stream=side):
    loss = model(x).float().logsumexp(-1).mean()
loss.record_stream(side)  # the caching allocator's cross-stream guard (FSDP1 frees with it)
info["int_device"] = str(torch.device(0))  # the current accelerator's device 0
info["format"] = f"{loss:6.2f}"
info["repr_device"] = "device='cuda:0'" in repr(loss)
host = loss.detach().cpu()
info["host"] = [str(host.device), host.is_cpu]
loss.backward()
opt.step()
torch.set_default_device("cuda")
info["default_device"] = str(torch.get_default_device())
info["factory"] = str(torch.zeros(3).device)
torch.set_default_device("cpu")
with open(sys.argv[1], "w") as f:
    json.dump(info, f)
opt.step()
