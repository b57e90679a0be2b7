"""FSDP2 with its collectives' buffers on symmetric memory (``set_symm_mem_for_comm``; torchtitan's
``--parallelism.enable_fsdp_symm_mem``) is refused with its cause, never traced as plain FSDP2 and
never blamed on the script (issue 34; docs/research/fsdp-symm-mem.md).

No real run exists to compare with: the buffers come from NCCL's symmetric allocator through a
``torch.cuda.MemPool``, which a CPU build of torch does not have (there ``set_symm_mem_for_comm``
raises "SymmetricMemory does not find allocation backend NCCL", which ``vramplan run`` used to
report as the script's own error). So the tests check the refusal (one line, exit 2, under
``vramplan run``, of a small FSDP2 script and of torchtitan's trainer), that it names the script's
line that asked for it, and that the same script without the call is traced."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

import vramplan
from test_trace_async_tp import (  # (vramplan run of a script / torchtitan in a new process)
    _titan,
)
from vramplan.errors import TraceError

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "examples" / "fsdp2_symm_mem.py"
DEPS = ROOT / ".titan-deps"


def _refused(p: subprocess.CompletedProcess[str]) -> str:
    assert p.returncode == 2, p.stderr[-3000:]
    line = p.stderr.strip().splitlines()[-1]
    assert line.startswith("error: ") and "Traceback" not in p.stderr
    assert "FSDP2 on symmetric memory is not traced" in line and "the script's own error" not in line
    assert "parallelism.enable_fsdp_symm_mem=false" in line and "outside the caching allocator" in line
    return line


def test_an_fsdp2_script_on_symmetric_memory_is_refused_and_the_same_script_without_it_is_traced() -> None:
    original = FSDPParamGroup.set_symm_mem
    with pytest.raises(TraceError, match="FSDP2 on symmetric memory is not traced") as e:
        vramplan.run_script(SCRIPT, [], gpu="h100-sxm", world=2, gpus=2, steps=2)
    assert "fsdp2_symm_mem.py:25" in str(e.value)  # the script's `set_symm_mem_for_comm()` line
    assert FSDPParamGroup.set_symm_mem is original  # put back after the trace
    plain = vramplan.run_script(SCRIPT, ["--no-symm-mem"], gpu="h100-sxm", world=2, gpus=2, steps=2)
    shard = 4 * 1024 * 1024 * 4 // 2  # this rank's half of the four fp32 weights
    assert plain.model_states.gradients == shard
    assert 0 <= plain.model_states.optimizer - 2 * shard <= 4 * 64  # AdamW's two states, step counters


def test_torchtitan_fsdp_symm_mem_is_refused_in_one_line(tmp_path: Path) -> None:
    """torchtitan 0.3.0, FSDP over 2 ranks with ``--parallelism.enable_fsdp_symm_mem``: refused where
    ``enable_fsdp_symm_mem`` asks for it, before any data is read. Before, the run stopped with the CPU
    build's "SymmetricMemory does not find allocation backend NCCL", reported as the script's own error."""
    if not (DEPS / "torchtitan").is_dir():
        pytest.skip(".titan-deps is not installed (make test installs it from requirements/titan.txt)")
    line = _refused(_titan(tmp_path, "--parallelism.spmd_backend", "partial_dtensor",
                           "--parallelism.enable_fsdp_symm_mem"))
    assert "torchtitan/distributed/fsdp.py:" in line
