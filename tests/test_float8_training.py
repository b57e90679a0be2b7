"""FP8 training with torchao's Float8Linear: the trace runs torchao's own code on the emulated
GPU, and agrees with a real CPU run of the same conversion (tests/float8_probe.py, in a child
process with ``.quant-deps`` — torchao — on its path: the test venv does not import torchao)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from vramplan import estimate
from vramplan.errors import TraceError, WorkloadError
from vramplan.workload import Workload

ROOT = Path(__file__).resolve().parents[1]
DEPS = ROOT / ".quant-deps"


@pytest.fixture(scope="module")
def probe() -> dict:
    if not DEPS.is_dir():
        pytest.skip(".quant-deps is not installed (make test installs it from requirements/quant.txt)")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(DEPS), *sys.path]))
    out = subprocess.run([sys.executable, str(Path(__file__).parent / "float8_probe.py"),
                          "tensorwise", "rowwise", "rowwise-gw-hp", "fsdp", "fsdp-fp8-gather",
                          "mxfp8-emulated", "mxfp8-bytes"],
                         env=env, capture_output=True, text=True, timeout=900)
    line = [ln for ln in out.stdout.splitlines() if ln.startswith("FLOAT8-PROBE ")]
    assert line, out.stderr[-3000:]
    return json.loads(line[0].removeprefix("FLOAT8-PROBE "))


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "rowwise-gw-hp"])
def test_float8_recipes_trace_as_torchao_runs_on_the_cpu(probe, recipe: str) -> None:
    r = probe[recipe]
    assert abs(r["traced"] - r["real"]) <= 0.001 * r["real"], r


@pytest.mark.parametrize("case", ["fsdp", "fsdp-fp8-gather"])
def test_float8_under_fsdp2_traces_as_a_real_gloo_run(probe, case: str) -> None:
    # fsdp-fp8-gather: torchao's WeightWithDynamicFloat8CastTensor parameters, all-gathered in fp8
    # (a 1-byte unsharded weight per rank where the plain all-gather holds fp32, and the amax
    # all-reduce of each cast); both sides count a wrapper subclass by its inner tensors
    r = probe[case]
    for traced, real in zip(r["traced"], r["real"], strict=True):
        assert abs(traced - real) <= 0.0001 * real, r


def test_the_float8_all_gather_holds_less_than_the_plain_one(probe) -> None:
    # the same model and step, the unsharded weights held in fp8 (1 byte) instead of fp32: the fp8
    # all-gather's peak is the lower one, in the real run and in the trace
    plain, fp8 = probe["fsdp"], probe["fsdp-fp8-gather"]
    assert fp8["real"][0] < plain["real"][0] and fp8["traced"][0] < plain["traced"][0], (plain, fp8)


def test_float8_is_refused_where_it_is_not_modelled() -> None:
    with pytest.raises(WorkloadError, match="training recipe"):
        Workload(task="infer", float8="tensorwise")
    with pytest.raises(WorkloadError, match="tensorwise recipe only"):
        Workload(task="train", float8="rowwise", float8_fsdp_all_gather=True)
    with pytest.raises(WorkloadError, match="tensor parallelism"):
        Workload(task="train", float8="rowwise").replace(tp=2)
    with pytest.raises(WorkloadError, match="method=trace"):
        estimate("llama-3.2-1b", task="train", float8="tensorwise", method="analytic")
    with pytest.raises(TraceError, match="sm89"):  # an A100 has no fp8 tensor cores
        estimate("llama-3.2-1b", task="train", precision="bf16", float8="tensorwise", method="trace",
                 gpu="a100-sxm4-80gb", seq=64)


def test_mxfp8_emulated_traces_as_torchao_runs_on_the_cpu(probe) -> None:
    # torchao's MXFP8Linear on every linear (the head too), KernelPreference.EMULATED: its to_mx
    # casts and dequantise-then-mm are pure torch, so the same converted model runs on the CPU
    r = probe["mxfp8-emulated"]
    assert abs(r["traced"] - r["real"]) <= 0.001 * r["real"], r


def test_mxfp8_casts_allocate_the_hand_computed_bytes(probe) -> None:
    # torchtitan's recipe (AUTO: Triton dim-0 and CUDA dim-1 casts, cuBLAS block-scaled mm) on one
    # linear [M, K] -> [M, N] (mxfp8_linear.py:84-269): each cast allocates 1 byte per value plus one
    # e8m0 scale per 32 values; to_blocked copies each mm operand's scales twice (two reshapes of a
    # permuted view, utils.py:67-70); nothing more is saved for backward than bf16 saves
    r = probe["mxfp8-bytes"]
    m, k, n = r["shape"]
    forward = m * k + n * k  # input and weight, dim 0 (mxfp8_linear.py:123-138)
    backward = m * n + n * k + m * n + m * k  # grad_out dim 0, weight dim 1, grad_out dim 1, input dim 1
    got = r["mxfp8"]["bytes"]
    assert got["forward:fp8"] == forward and got["backward:fp8"] == backward, got
    assert got["forward:scale"] == forward // 32 and got["backward:scale"] == backward // 32, got
    assert got["forward:blocked"] == 2 * forward // 32 and got["backward:blocked"] == 2 * backward // 32, got
    assert r["none"]["bytes"] == {}, r
    assert r["mxfp8"]["live_at_backward"] == r["none"]["live_at_backward"], r  # saved: the bf16 input and weight
    assert r["restored"], r  # the kernel stand-ins are gone after the step


def test_mxfp8_is_refused_where_it_does_not_run() -> None:
    # torchtitan 0.3.0's converter refuses below sm100 (mx.py:70); torchao's Triton dim-0 cast takes bf16 only
    with pytest.raises(TraceError, match="sm100"):
        estimate("llama-3.2-1b", task="train", precision="bf16", float8="mxfp8", method="trace", gpu="h100-sxm", seq=64)
    with pytest.raises(TraceError, match="bf16 only"):
        estimate("llama-3.2-1b", task="train", precision="fp32", float8="mxfp8", method="trace", gpu="b200", seq=64)
    with pytest.raises(TraceError, match="with `compile` is not traced"):
        estimate("llama-3.2-1b", task="train", precision="bf16", float8="mxfp8", method="trace", gpu="b200", seq=64,
                 compile=True)


def test_float8_needs_torchao_and_says_so() -> None:
    import importlib.util

    if importlib.util.find_spec("torchao") is not None:
        pytest.skip("torchao is importable in this venv")
    with pytest.raises(TraceError, match="pip install torchao"):
        estimate("llama-3.2-1b", task="train", precision="bf16", float8="tensorwise", method="trace",
                 gpu="h100-sxm", seq=64)


def test_float8_under_emulated_autocast_is_refused_with_the_fix() -> None:
    with pytest.raises(TraceError, match="autocast"):
        estimate("llama-3.2-1b", task="train", precision="bf16-mixed", float8="tensorwise", method="trace",
                 gpu="h100-sxm", seq=64)


def test_auto_reports_the_traces_reason_when_the_analytic_method_refuses_too() -> None:
    # method=auto: the trace refuses float8 under autocast, the analytic method refuses float8: the
    # user is told the trace's reason (with its fix), not the analytic method's
    with pytest.raises(TraceError, match="autocast"):
        estimate("llama-3.2-1b", task="train", precision="bf16-mixed", float8="tensorwise", gpu="h100-sxm", seq=64)
