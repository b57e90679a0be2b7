"""QLoRA as bitsandbytes 0.50.2 and peft 0.21.2 run it: the trace's emulated 4-bit layers
(:mod:`vramplan.trace.quant`) against the real library on the CPU (tests/bnb_probe.py, in a child
process with ``.quant-deps`` — bitsandbytes — on its path), and the mechanisms one by one."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from vramplan.events import Action
from vramplan.target import DEFAULT_PROFILE
from vramplan.trace.quant import GEMM_4BIT_FUSED_ROWS, QuantLinear
from vramplan.trace.run import TraceOptions, trace_workload
from vramplan.trace.session import TraceSession
from vramplan.trace.testing import tiny_spec
from vramplan.workload import Quant, Workload

ROOT = Path(__file__).resolve().parents[1]
DEPS = ROOT / ".quant-deps"


def _allocs(rows: int, compute: torch.dtype) -> tuple[list[str], list[str]]:
    """The tensors a double-quantised NF4 ``[256, 128]`` layer (loaded in bf16) allocates in its
    forward and in its backward, for ``rows`` bf16 input rows."""
    q = QuantLinear(128, 256, bias=False, kind=Quant.NF4, compute_dtype=compute, double_quant=True,
                    storage_dtype=torch.bfloat16)
    sess = TraceSession(DEFAULT_PROFILE.without_workspaces())
    log = sess.rec.log

    def descs(start: int) -> list[str]:
        return [log.strings[log.desc[k]] for k in range(start, len(log)) if log.action[k] == int(Action.ALLOC)]

    with sess:
        sess.add_model(q)
        x = torch.empty(rows, 128, dtype=torch.bfloat16, device="meta", requires_grad=True)
        sess.add_inputs([x])
        start = len(log)
        y = q(x)
        fwd = descs(start)
        start = len(log)
        y.float().sum().backward()
        bwd = descs(start)
    return fwd, bwd


def test_the_forward_dequantises_straight_into_the_compute_dtype() -> None:
    # gemm_4bit's fallback: absmax (fp32 [512 blocks]) and absmax + offset, then the weight in
    # the input's dtype; backward: dequantize_4bit in quant_state.dtype (bf16), then .to(fp32)
    fwd, bwd = _allocs(16, torch.float32)
    assert fwd.count("f32[512]") == 2 and "f32[256,128]" in fwd and "bf16[256,128]" not in fwd, fwd
    assert fwd.index("f32[512]") < fwd.index("f32[256,128]")
    assert "bf16[256,128]" in bwd and "f32[256,128]" in bwd and bwd.count("f32[512]") == 1, bwd
    fwd16, _ = _allocs(16, torch.bfloat16)
    assert "bf16[256,128]" in fwd16 and "f32[256,128]" not in fwd16


def test_up_to_four_rows_the_fused_kernel_makes_no_dequantised_weight() -> None:
    fwd, bwd = _allocs(GEMM_4BIT_FUSED_ROWS, torch.bfloat16)
    assert not any(d.endswith("[256,128]") for d in fwd), fwd
    assert "bf16[256,128]" in bwd  # backward always dequantises
    fwd5, _ = _allocs(GEMM_4BIT_FUSED_ROWS + 1, torch.bfloat16)
    assert "bf16[256,128]" in fwd5


def test_qlora_adapters_run_peft_bitsandbytes_forward_and_clone_the_base_output() -> None:
    spec = tiny_spec("llama-3.1-8b")
    w = Workload(task="train", precision="bf16", batch=1, seq=16, peft="qlora", lora_targets=("q_proj", "v_proj"))
    opts = TraceOptions(workspaces=False, count_flops=False)
    r = trace_workload(spec, w, options=opts, iterations=1)
    assert any("4 LoRA layers run peft's bitsandbytes forward" in n for n in r.notes), r.notes
    clones = [row for row in r.events.rows() if row["action"] == "alloc" and row.get("op") == "aten.clone.default"
              and row["phase"] == "forward"]
    assert len(clones) >= 4, clones
    # over 16-bit weights the adapters are peft's plain lora.Linear: no clone
    plain = trace_workload(spec, w.replace(peft="lora", quant="none"), options=opts, iterations=1)
    assert not any("bitsandbytes forward" in n for n in plain.notes)
    assert len([row for row in plain.events.rows() if row["action"] == "alloc" and row["phase"] == "forward"
                and row.get("op") == "aten.clone.default"]) == len(clones) - 4


@pytest.fixture(scope="module")
def probe() -> dict:
    if not DEPS.is_dir():
        pytest.skip(".quant-deps is not installed (make test installs it from requirements/quant.txt)")
    if not (DEPS / "bitsandbytes").is_dir():
        pytest.skip(".quant-deps predates bitsandbytes in requirements/quant.txt: rebuild it (make test)")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(DEPS), *sys.path]))
    out = subprocess.run([sys.executable, str(Path(__file__).parent / "bnb_probe.py"),
                          "bfloat16", "float32", "bfloat16+prepare"],
                         env=env, capture_output=True, text=True, timeout=900)
    line = [ln for ln in out.stdout.splitlines() if ln.startswith("BNB-PROBE ")]
    assert line, out.stderr[-3000:]
    return json.loads(line[0].removeprefix("BNB-PROBE "))


STEPS = 28 * 4
"""The real CPU run's AdamW keeps each parameter's ``step`` as a 4-byte CPU tensor (28 LoRA
matrices); on the GPU it stays on the host, outside the trace."""
SECOND_ABSMAX = 4 * (256 * 1024 // 64)
"""The CUDA kernel's fallback (what the trace models) holds the fp32 absmax and absmax + offset
together while it dequantises; the CPU's default kernel drops the first before it dequantises
the weight: one fp32 ``[blocks]`` of down_proj (4096 blocks), the layer at the forward's peak."""


@pytest.mark.parametrize("case", ["bfloat16", "float32"])
def test_qlora_traces_as_bitsandbytes_runs_on_the_cpu(probe, case: str) -> None:
    real, traced = probe[case]["real"], probe[case]["traced"]
    assert traced["setup"] == real["setup"]  # base weights, quant state, adapters, embeddings, inputs
    assert traced["backward"] == real["backward"] - STEPS
    assert traced["optimizer"] == real["optimizer"] - STEPS
    assert traced["forward"] == real["forward"] - STEPS + SECOND_ABSMAX


def test_prepare_model_for_kbit_training_upcasts_what_is_not_quantised(probe) -> None:
    # peft's prepare_model_for_kbit_training (utils/other.py L205-209) casts every bf16 parameter
    # that is not a Params4bit to fp32: embeddings, LM head, norms. vramplan does not model it
    # (see docs/research/bnb-qlora.md); this pins what it costs in the real run.
    plain, prepared = probe["bfloat16"]["real"], probe["bfloat16+prepare"]["real"]
    vocab, hidden, norms = 256, 256, 2 * 2 + 1
    assert prepared["setup"] - plain["setup"] == 2 * (2 * vocab * hidden + norms * hidden)
    assert prepared["forward"] > plain["forward"]
