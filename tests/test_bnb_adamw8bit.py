"""bitsandbytes' 8-bit AdamW state layout: the trace's stand-in (:class:`vramplan.trace.optim.AdamW8bit`)
against the real ``bnb.optim.AdamW8bit`` of ``.quant-deps`` (0.50.2, whose optimizers have CPU
kernels) stepped on the CPU in a child process, and the per-version absmax block rule."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from vramplan.analytic.estimate import estimate
from vramplan.errors import WorkloadError
from vramplan.trace.optim import AdamW8bit
from vramplan.trace.run import trace_workload
from vramplan.trace.testing import tiny_spec
from vramplan.workload import BNB_VERSION, Workload, bnb_optim_block

ROOT = Path(__file__).resolve().parents[1]
DEPS = ROOT / ".quant-deps"
SIZES = (100, 4095, 4096, 5000, 300_000, 1_000_003)
"""32-bit below 4,096 elements (``min_8bit_size``); 8-bit from it, with a partial last block."""

_CHILD = """
import json, sys, torch, bitsandbytes as bnb
ps = [torch.nn.Parameter(torch.randn(n)) for n in json.loads(sys.argv[1])]
for p in ps:
    p.grad = torch.randn_like(p)
opt = bnb.optim.AdamW8bit(ps, lr=1e-3)
opt.step()
out, shared = [], {}
for p in ps:
    row = {}
    for k, v in opt.state[p].items():
        if not torch.is_tensor(v):
            continue
        if k.startswith("qmap"):
            shared[v.data_ptr()] = v.numel() * v.element_size()
        else:
            row[k] = [str(v.dtype), v.numel() * v.element_size()]
    out.append(row)
print("ADAM8-PROBE " + json.dumps({"version": bnb.__version__, "states": out, "qmap_bytes": sum(shared.values())}))
"""


def _emulated(block: int) -> tuple[list[dict[str, list]], int]:
    ps = [torch.nn.Parameter(torch.randn(n)) for n in SIZES]
    for p in ps:
        p.grad = torch.randn_like(p)
    opt = AdamW8bit(ps, block=block)
    opt.step()
    rows = [{k: [str(v.dtype), v.numel() * v.element_size()] for k, v in opt.state[p].items()
             if torch.is_tensor(v) and not k.startswith("qmap")}
            for p in ps]
    return rows, sum(q.numel() * q.element_size() for q in opt.qmaps)


def test_the_stand_in_holds_what_bitsandbytes_adamw8bit_holds() -> None:
    if not (DEPS / "bitsandbytes").is_dir():
        pytest.skip(".quant-deps with bitsandbytes is not installed (make test installs it from requirements/quant.txt)")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(DEPS), *sys.path]))
    out = subprocess.run([sys.executable, "-c", _CHILD, json.dumps(SIZES)], env=env, capture_output=True, text=True,
                         timeout=600)
    line = [ln for ln in out.stdout.splitlines() if ln.startswith("ADAM8-PROBE ")]
    assert line, out.stderr[-3000:]
    real = json.loads(line[0].removeprefix("ADAM8-PROBE "))
    rows, qmap_bytes = _emulated(bnb_optim_block(real["version"]))
    assert rows == real["states"]
    assert qmap_bytes == real["qmap_bytes"] == 2 * 256 * 4
    # the 1,000,003-element parameter: ⌈n/256⌉ fp32 absmax per state at 0.50.2
    assert real["states"][-1]["absmax1"] == ["torch.float32", 4 * -(-1_000_003 // 256)]


def test_the_block_follows_the_bitsandbytes_version() -> None:
    assert bnb_optim_block("0.35.0") == bnb_optim_block("0.43.3") == 2048
    assert bnb_optim_block("0.44.0") == bnb_optim_block("0.44") == bnb_optim_block(BNB_VERSION) == 256
    assert bnb_optim_block("1.0") == 256
    with pytest.raises(WorkloadError, match="bnb_version"):
        Workload(task="train", optimizer="adamw-8bit", bnb_version="latest")


def test_estimate_and_trace_count_the_absmax_of_their_version() -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    spec = tiny_spec("llama-3.1-8b")
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**dict(spec.config)))
    # each 8-bit parameter: two fp32 absmax of ⌈n/256⌉ blocks instead of ⌈n/2048⌉
    want = sum(8 * (-(-n // 256) + (n // -2048)) for n in (p.numel() for p in model.parameters()) if n >= 4096)
    assert want > 0
    w = Workload(task="train", batch=1, seq=32, optimizer="adamw-8bit")
    old = w.replace(bnb_version="0.43.3")
    assert estimate(spec, w).states.optimizer - estimate(spec, old).states.optimizer == want
    assert trace_workload(spec, w).breakdown_at_peak.optimizer - trace_workload(spec, old).breakdown_at_peak.optimizer \
        == want
    assert "`bnb_version`" not in " ".join(old.setting_notes())
    assert "`bnb_version`" in " ".join(Workload(task="train", bnb_version="0.43.3").setting_notes())
