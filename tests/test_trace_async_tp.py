"""Async tensor parallelism (Inductor's micro-pipeline TP on symmetric memory) is refused with its
cause, never traced as plain TP in silence (issue 34; docs/research/async-tp.md).

No real run exists to compare with: the pass fuses nothing without NCCL and the fused ops have CUDA
kernels only. So the tests check the refusal (one line, exit 2, under ``vramplan run``, of a small
TP script and of torchtitan's trainer) and that it is no broader than the pass: with
``_micro_pipeline_tp`` on but no group holding symmetric memory, the pass fuses nothing and the
script is traced as plain TP, to the byte of the same script with the flag off."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch._inductor.config as inductor_config

import vramplan

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "examples" / "async_tp.py"
DEPS = ROOT / ".titan-deps"


def _cli(*argv: str, cwd: Path, extra_path: str = "") -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in [extra_path, os.environ.get("PYTHONPATH", "")] if p)}
    return subprocess.run([sys.executable, "-m", "vramplan.cli.main", "run", "--gpu", "h100-sxm", "--", *argv],
                          capture_output=True, text=True, timeout=600, env=env, cwd=cwd)


def _titan(tmp_path: Path, *flags: str) -> subprocess.CompletedProcess[str]:
    """torchtitan 0.3.0's llama3 debug model on 2 ranks under ``vramplan run`` (empty assets and
    data folders: the refusals come before any data is read), with ``flags``."""
    return _cli(
        "torchrun", "--nproc-per-node", "2", "-m", "torchtitan.train", "--module", "llama3", "--config",
        "llama3_debugmodel", "--hf_assets_path", str(tmp_path), "--dataloader.dataset", "c4_test",
        "--dataloader.dataset_path", str(tmp_path), "--dump_folder", str(tmp_path / "out"), *flags,
        cwd=tmp_path, extra_path=str(DEPS))


def _refused(p: subprocess.CompletedProcess[str]) -> str:
    assert p.returncode == 2, p.stderr[-3000:]
    line = p.stderr.strip().splitlines()[-1]
    assert line.startswith("error: ") and "Traceback" not in p.stderr
    assert "async tensor parallelism is not traced" in line
    assert "compile.enable_async_tensor_parallel=false" in line and "outside the caching allocator" in line
    return line


def test_a_tp_script_with_async_tp_is_refused_in_one_line(tmp_path: Path) -> None:
    line = _refused(_cli("torchrun", "--nproc-per-node", "2", str(SCRIPT), cwd=tmp_path))
    assert "async_tp.py:" in line  # the script's line that compiles


def test_without_a_symmetric_memory_group_the_pass_fuses_nothing_and_plain_tp_is_traced(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import torch.distributed._symmetric_memory as symm

    monkeypatch.setattr(symm, "_group_name_to_store", {})  # no group has symmetric memory
    # (the script sets the switch: Inductor's own `patch` restores it; pytest's monkeypatch deletes a
    # config attribute on undo, which torch 2.14's config module takes as "hide it")
    with inductor_config.patch(_micro_pipeline_tp=False):
        off = vramplan.run_script(SCRIPT, ["--no-symm-mem", "--no-async-tp"], gpu="h100-sxm", world=2, gpus=2,
                                  steps=2)
        assert not inductor_config._micro_pipeline_tp
        on = vramplan.run_script(SCRIPT, ["--no-symm-mem"], gpu="h100-sxm", world=2, gpus=2, steps=2)
        assert inductor_config._micro_pipeline_tp  # the script did switch the pass on
    assert not inductor_config._micro_pipeline_tp
    assert on.peak == off.peak and on.peak_phase == off.peak_phase
    assert any("torch.compile ignored" in n for n in on.notes)


def test_torchtitan_async_tp_is_refused_in_one_line(tmp_path: Path) -> None:
    """torchtitan 0.3.0, TP 2 with ``--compile.enable_async_tensor_parallel``: refused where
    ``apply_compile`` compiles the first block, before any data is read (so the assets and data
    folders stay empty). Before, it exited 0 with plain TP's figure."""
    if not (DEPS / "torchtitan").is_dir():
        pytest.skip(".titan-deps is not installed (make test installs it from requirements/titan.txt)")
    line = _refused(_titan(
        tmp_path, "--parallelism.tensor_parallel_degree", "2", "--parallelism.data_parallel_shard_degree", "1",
        "--parallelism.spmd_backend", "partial_dtensor", "--compile.enable", "--compile.enable_async_tensor_parallel"))
    assert "torchtitan/distributed/compile.py:" in line
