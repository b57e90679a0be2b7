"""Both cuBLAS workspaces at the backward's instants: the analytic method against the trace.

On CUDA the autograd engine runs a backward on its own device thread, whose cuBLAS handle (one per
thread, from a thread-local pool window) gets its own workspace, keyed by (handle, stream) and cached
for the process's life; the forward's, made on the main thread's handle, stays cached beside it
(docs/research/pipeline-fsdp.md, session 55). The trace takes one per (thread, stream)
(``trace/dispatch.py`` ``_blas_workspace``). The widths are tiny so that a workspace (8,519,680 B on
the default sm80 profile) is a large part of each peak: one workspace fewer fails these comparisons.
"""

from __future__ import annotations

import re

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from vramplan import estimate  # noqa: E402
from vramplan.events import PHASES, Category  # noqa: E402
from vramplan.models.catalog import resolve  # noqa: E402
from vramplan.models.normalize import spec_from_config  # noqa: E402
from vramplan.trace import analysis  # noqa: E402
from vramplan.trace.run import TraceOptions, trace_workload  # noqa: E402
from vramplan.workload import Parallel, Phase, Workload  # noqa: E402

BOTH = ["cublas workspace (autograd thread)", "cublas workspace (main thread)"]


def _tiny(layers: int, vocab: int):
    """Llama-3.1-8B's layout at a width of 256."""
    c = dict(resolve("llama-3.1-8b").config)
    c.update(num_hidden_layers=layers, hidden_size=256, intermediate_size=768, vocab_size=vocab,
             num_attention_heads=4, num_key_value_heads=2, head_dim=64)
    return spec_from_config(c, name=f"tiny-llama-{layers}-{vocab}", source="test")


def _backward(spec, w: Workload, rank: int = 0):
    """The trace's backward peak (its breakdown and the workspaces live there) and the analytic one's."""
    r = trace_workload(spec, w, options=TraceOptions(rank=rank, count_flops=False))
    a = analysis.arrays(r.events)
    k = analysis.peak_of(a, a.phase == PHASES.index(Phase.BACKWARD.value))
    s = r.events.strings
    spaces = sorted(s[r.events.desc[i]] for i in analysis.live_at(a, k) if a.cat[i] == Category.WORKSPACE)
    traced = analysis.breakdown_at(a, k)
    an = [p for p in estimate(spec, w, method="analytic", search_max_batch=False).phases
          if p.phase is Phase.BACKWARD][0]
    return traced, spaces, an.breakdown


def test_a_single_gpu_layer_backward_holds_both_workspaces() -> None:
    """One GPU, no parallelism: with a 256-token vocabulary the backward peaks at the last layer's
    backward (after the final norm's), not the loss's; the trace holds both threads' workspaces there,
    and the analytic instant counts both (its temporaries 0.985 of the trace's; one workspace: 0.65)."""
    traced, spaces, an = _backward(_tiny(2, 256), Workload(task="train", batch=2, seq=512))
    assert spaces == BOTH
    assert an.temporaries == pytest.approx(traced.temporaries, rel=0.02)
    assert an.total == pytest.approx(traced.total, rel=0.02)


def test_pipeline_fsdp2_end_of_step_holds_both_workspaces() -> None:
    """PP × FSDP2: the end of the step (``perform_reduce_grad``'s reduce-scatters, after every backward)
    peaks on rank 0; the trace holds both workspaces there, and the analytic instant's temporaries are
    the trace's to the byte (with one workspace the backward was 0.946 of the trace's, another instant)."""
    spec = _tiny(2, 32000)
    w = Workload(task="train", batch=1, seq=32, grad_accum=2, precision="bf16-mixed",
                 parallel=Parallel(pp=2, dp=2, zero=3))
    notes = " ".join(estimate(spec, w, method="analytic", search_max_batch=False).notes)
    rank = int(re.search(r"reporting rank (\d+)", notes).group(1))
    traced, spaces, an = _backward(spec, w, rank)
    assert spaces == BOTH
    assert an.temporaries == traced.temporaries
    assert an.total == pytest.approx(traced.total, rel=1e-3)
