"""``loss=trl``: TRL's fused LM head (trl 1.16 ``add_fused_lm_head`` + ``ChunkedLogProbFunction``)
as it runs on CUDA, where a Triton kernel folds each logit tile in place.

The emulation (:class:`vramplan.trace.loss.TrlChunkedLogProb`) is compared with TRL's own code
traced on the same model, with the decisions its code takes on a CUDA device with Triton:
``_use_triton`` true (only the labelled positions scored, ``hidden[mask]``), the Triton launches
as no-ops (they allocate nothing: their outputs are the preallocated statistics and the tile
buffer) and ``_addmm_fp32`` in place (``torch.addmm(..., out_dtype=float32, out=acc)``, torch ≥ 2.8).
On the CPU TRL takes another path (tiles upcast with torch ops), so no CPU run can check it.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from vramplan.analytic.estimate import estimate
from vramplan.events import Action
from vramplan.trace.loss import TRL_SFT_OUTPUTS
from vramplan.trace.run import TraceOptions, trace_model, trace_workload
from vramplan.workload import Workload

transformers = pytest.importorskip("transformers")

NO_WS = TraceOptions(workspaces=False)
# two token tiles (2 x 2,100 - 2 = 4,198 > 4,096 scored positions) and two vocabulary tiles
# (40,000 > 32,768): every branch of the tile loops
B, S, V, H = 2, 2100, 40000, 64


def _llama(tied: bool) -> nn.Module:
    cfg = transformers.LlamaConfig(hidden_size=H, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=4, vocab_size=V, max_position_embeddings=4096, use_cache=False,
                                   tie_word_embeddings=tied)
    return transformers.LlamaForCausalLM(cfg)


def _inputs() -> dict[str, torch.Tensor]:
    ids = torch.randint(0, V, (B, S), generator=torch.Generator().manual_seed(0))
    return {"input_ids": ids, "labels": ids.clone()}


def _allocs(r: Any) -> list[tuple[int, str]]:
    log = r.events
    return [(log.size[k], log.strings[log.desc[k]]) for k in range(len(log)) if log.action[k] == int(Action.ALLOC)]


@pytest.mark.parametrize("precision", ["bf16-mixed", "bf16", "fp32"])
@pytest.mark.parametrize("peft", ["none", "lora"])
def test_the_emulated_head_allocates_what_trls_own_code_allocates_on_cuda(trl_on_cuda: Any, precision: str,
                                                                         peft: str) -> None:
    add_fused_lm_head, set_autocast = trl_on_cuda
    set_autocast(torch.bfloat16 if precision.endswith("-mixed") else None)

    def with_trl_head() -> nn.Module:
        m = _llama(tied=False)
        add_fused_lm_head(m, outputs=TRL_SFT_OUTPUTS)  # as SFTTrainer adds it
        return m

    def trl_loss(out: Any) -> torch.Tensor:
        return out.loss

    w = Workload(task="train", optimizer="adamw", precision=precision, peft=peft)
    inputs = {**_inputs(), "fused_lm_head": True}
    theirs = trace_model(with_trl_head, inputs, workload=w, loss_fn=trl_loss, options=NO_WS)
    ours = trace_model(lambda: _llama(tied=False), _inputs(), workload=w.replace(loss="trl"), options=NO_WS)
    assert _allocs(ours) == _allocs(theirs)
    assert ours.peak_allocated == theirs.peak_allocated
    assert [p.allocated for p in ours.phases] == [p.allocated for p in theirs.phases]


def test_the_head_never_materialises_the_logits_and_keeps_one_tile_buffer() -> None:
    w = Workload(task="train", optimizer="adamw", precision="bf16-mixed")
    r = trace_model(lambda: _llama(tied=False), _inputs(), workload=w.replace(loss="trl"), options=NO_WS)
    sizes = _allocs(r)
    assert not any(d.endswith(f",{V}]") for _, d in sizes)  # no [tokens, vocabulary] tensor
    assert sizes.count((4096 * 32768 * 2, "bf16[4096,32768]")) == 2 * 2  # forward and backward, two iterations
    full = trace_model(lambda: _llama(tied=False), _inputs(), workload=w, options=NO_WS)
    assert r.peak_allocated < full.peak_allocated


def test_analytic_agrees_with_the_trace(small_llama: Any) -> None:
    for kw in ({}, {"peft": "lora"}, {"precision": "bf16"}):
        w = Workload(**{"task": "train", "batch": 2, "seq": 2048, "precision": "bf16-mixed", "loss": "trl", **kw})
        a, r = estimate(small_llama, w), trace_workload(small_llama, w)
        assert abs(r.peak_allocated - a.peak.allocated) / a.peak.allocated < 0.05, (kw, r.peak_allocated,
                                                                                   a.peak.allocated)
