"""The FSDP1 trace frees a frozen unit's gathered parameters at the end of backward, as a GPU does.

FSDP1's ``_catch_all_reshard`` (torch 2.13 ``fsdp/_runtime_utils.py``, run for every unit by
``_post_backward_final_callback``) skips a unit whose flat parameter's data pointer equals its
local shard's. Every ``meta`` data pointer is 0, so without ``trace.dist._already_resharded`` (the
same test by storage) a frozen unit that no post-backward hook resharded — under LoRA the root,
whose input needs no gradient — stayed gathered through the optimizer step. The real-run check
is ``tests/test_trace_gloo.py::test_fsdp1_gloo_run_agrees_with_trace_by_phase`` (slow tier)."""

from __future__ import annotations

from functools import partial

import pytest

pytest.importorskip("peft")


from vramplan.trace.run import TraceOptions, trace_model  # noqa: E402
from vramplan.trace.testing import block_inputs, block_model  # noqa: E402
from vramplan.workload import Phase, Precision, Task, Workload  # noqa: E402


def test_lora_root_is_not_gathered_at_the_optimizer_step() -> None:
    width = 128
    make = partial(block_model, width)
    w = Workload(task=Task.TRAIN, precision=Precision.FP32, peft="lora", lora_targets=("up", "down")).replace(
        dp=2, zero=3, engine="fsdp1", fsdp1_prefetch="none")
    r = trace_model(make, block_inputs(width), workload=w, options=TraceOptions(workspaces=False, count_flops=False))
    weights = {p.phase: p.breakdown.weights for p in r.phases}
    m = make()
    root = sum(p.numel() for p in [*m.inp.parameters(), *m.out.parameters()]) * 4  # the root unit, gathered (fp32)
    assert weights[Phase.BACKWARD] - weights[Phase.OPTIMIZER] >= root, weights  # it was gathered in backward
    assert weights[Phase.OPTIMIZER] - weights[Phase.SETUP] < root // 2, weights  # and is not at the step
