"""torchtitan's own trainer, unmodified, under ``vramplan run``: torchtitan 0.3.0 as its docs launch it
(``torchrun --nproc-per-node N -m torchtitan.train --module llama3 --config …``), from
``.titan-deps`` (requirements/titan.txt), in a child process with that folder on its path.

It is the launch line of torchtitan's own ``run_train.sh``: a module run with ``-m``, torchrun's
rank variables for one process too, DTensor random initialisation (``run_dtensor_rng_op``),
compiled FlexAttention (torchtitan's default attention), ``clip_grad_norm_(foreach=True)`` and
rank 0's seed sent to the device and read back, and its default CUDA graph (step 1 warms up,
step 2 captures the forward-backward into a private pool). torchtitan has no CPU path (it picks ``cuda``
without an accelerator), so there is no CPU run to compare with: the tests check what the
layout fixes exactly (each rank's shards of the parameters, gradients and AdamW states).

Expert parallelism (issue 34) is checked twice: torchtitan's trainer on its debug MoE model (the
layout's shards, to the byte), and torchtitan's own MoE layer with its all-to-all token
dispatcher, run for real on two gloo processes against the trace of rank 0 (the issue's
standard: within 0.01 %).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DEPS = ROOT / ".titan-deps"
LLAMA3_8B = 8_030_261_248


def _fixtures(tmp: Path) -> Path:
    """A tokenizer (the zoo's word-level one) and a local JSON text set in the place of c4_test."""
    sys.path.insert(0, str(ROOT / "tests"))
    from zoo import fixtures

    root = fixtures(tmp / "zoo")
    assets = tmp / "assets"
    (assets / "c4").mkdir(parents=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (assets / name).write_text((root / "hf" / "model" / name).read_text())
    (assets / "c4" / "train.jsonl").write_text((root / "hf" / "text" / "train.jsonl").read_text())
    return assets


def _run(tmp: Path, nproc: int, config: str, *extra: str, module: str = "llama3") -> dict:
    if not (DEPS / "torchtitan").is_dir():
        pytest.skip(".titan-deps is not installed (make test installs it from requirements/titan.txt)")
    assets = _fixtures(tmp)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(DEPS), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-m", "vramplan.cli.main", "run", "--gpu", "h100-sxm", "--json", "--",
           "torchrun", "--nproc-per-node", str(nproc), "-m", "torchtitan.train", "--module", module,
           "--config", config, "--hf_assets_path", str(assets), "--dataloader.dataset", "c4_test",
           "--dataloader.dataset_path", str(assets / "c4"), "--training.steps", "3",
           "--dump_folder", str(tmp / "out"), *extra]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, cwd=tmp)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout)


def test_torchtitan_debug_model_on_one_gpu(tmp_path: Path) -> None:
    doc = _run(tmp_path, 1, "llama3_debugmodel", "--training.seq_len", "64", "--training.local_batch_size", "2")
    ran = doc["ran"]
    assert (ran["batch"], ran["seq"], ran["steps"]) == (2, 64, 2)
    assert ran["precision"] == "bf16-mixed (fp32 weights, FSDP mixed precision bf16)"
    assert any("fused FlexAttention kernels" in n for n in doc["notes"])
    assert any(n.startswith("CUDA graphs:") for n in doc["notes"])  # (torchtitan 0.3.0's default)
    ms = doc["model_states"]
    assert ms["gradients"] == doc["params"] * 4  # fp32 gradients (FSDP's reduce dtype), one rank: whole
    assert 0 <= ms["weights"] - ms["gradients"] < 2**20  # fp32 parameters, and the RoPE cache buffer
    assert 0 <= ms["optimizer"] - 2 * ms["gradients"] <= 4 * 64  # AdamW's two states, step counters


def test_torchtitan_llama3_8b_on_eight_gpus(tmp_path: Path) -> None:
    # torchtitan 0.3.0's default SPMD backend (spmd_types) wants every parameter a DTensor on the
    # full mesh before FSDP; partial_dtensor (DTensor on the model-parallel axes only) is its
    # other FSDP-only layout. Rank 0 holds an eighth of each state, to the byte
    doc = _run(tmp_path, 8, "llama3_8b", "--parallelism.spmd_backend", "partial_dtensor")
    assert doc["params"] == LLAMA3_8B  # the whole model (not rank 0's shard)
    ms = doc["model_states"]
    assert ms["gradients"] == LLAMA3_8B * 4 // 8
    assert 0 <= ms["optimizer"] - 2 * ms["gradients"] <= 4 * 1024
    assert doc["ran"]["seq"] == 8192 and doc["ran"]["batch"] == 1


# qwen3_moe_debug (torchtitan/models/qwen3/__init__.py `_debugmodel_moe`): 8 layers, dim 256,
# 64 experts of hidden 768 (w1, w2, w3), top-8, vocabulary 2048
QWEN3_MOE_EXPERTS = 8 * 3 * 64 * 768 * 256  # the routed experts' weights
QWEN3_MOE_PARAMS = 315_758_848  # (torchtitan's log: "size: 315,758,848 total parameters")


def test_torchtitan_expert_parallel_on_two_gpus(tmp_path: Path) -> None:
    """``--parallelism.expert_parallel_degree 2`` on 2 ranks: dp_shard 2 for the dense part
    (FSDP: half of it a rank), ep 2 × efsdp 1 for the experts (half of the experts a rank,
    whole). The router's data-dependent counts go through the routing rule, the count exchange
    through the symmetric all-to-all (both named in the notes)."""
    doc = _run(tmp_path, 2, "qwen3_moe_debug", "--parallelism.expert_parallel_degree", "2",
               "--parallelism.spmd_backend", "partial_dtensor", "--training.disable_cuda_graphs",
               "--training.seq_len", "64", "--training.local_batch_size", "2", module="qwen3")
    assert doc["params"] == QWEN3_MOE_PARAMS
    dense = QWEN3_MOE_PARAMS - QWEN3_MOE_EXPERTS
    ms = doc["model_states"]
    assert ms["gradients"] == (QWEN3_MOE_EXPERTS // 2 + dense // 2) * 4  # fp32 gradients, this rank's shards
    assert 0 <= ms["optimizer"] - 2 * ms["gradients"] <= 4 * 128  # AdamW's two states, step counters
    notes = " ".join(doc["notes"])
    assert "routing_map ×" in notes and "symmetric_exchange ×" in notes


def test_torchtitan_moe_layer_expert_parallel_agrees_with_gloo(monkeypatch: pytest.MonkeyPatch) -> None:
    """torchtitan's ``MoE`` (router, ``AllToAllTokenDispatcher``, grouped-GEMM experts) with its
    experts split over 2 ranks (tests/examples/titan_moe_ep.py): the trace of rank 0 and rank 0
    of a real gloo run hold the same storages at the peak (the all-to-all buffers' step), within
    0.01 %. torchtitan's round-robin routing (``--balanced``) makes the real run's expert choices
    known; the trace of the router's own top-k (routing rule: uniform) gives the same peak."""
    if not (DEPS / "torchtitan").is_dir():
        pytest.skip(".titan-deps is not installed (make test installs it from requirements/titan.txt)")
    import vramplan
    from vramplan.script.truth import compare, cpu_truth_world

    monkeypatch.syspath_prepend(str(DEPS))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(DEPS), str(ROOT / "src")]))
    script = ROOT / "tests" / "examples" / "titan_moe_ep.py"
    argv = ["--balanced", "--seq", "512"]
    r = vramplan.run_script(script, argv, gpu="h100-sxm", workspaces=False, steps=2, world=2, gpus=2)
    c = compare(r, cpu_truth_world(script, argv, world=2, steps=2, forked=True))
    assert r.peak_phase == "forward"
    # the CPU run also holds the optimizer's step counters (host scalars on a GPU too) and 8 bytes
    # of int32 expert offsets at its peak
    assert all(n <= 8 for _, n in c.only_truth) and not c.only_predicted, (c.only_truth, c.only_predicted)
    assert abs(c.requested - c.truth) / c.truth < 1e-4, (c.requested, c.truth)
    routed = vramplan.run_script(script, argv[1:], gpu="h100-sxm", workspaces=False, steps=2, world=2, gpus=2)
    assert routed.peak.allocated == r.peak.allocated
    assert any(n.startswith("data-dependent routing_map") for n in routed.notes)
