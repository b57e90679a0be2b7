"""Agreement with PyTorch's own MemTracker (FakeTensorMode) on fp32 steps without SDPA or
autocast, where both see exactly the same tensors.

The inputs are made inside MemTracker's context so that it counts them, as we do. Known
difference (bytes): we leave out the optimizer's ``step`` counters, which live on the host
for foreach optimizers (MemTracker's fake CPU counts them).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from vramplan.trace.run import TraceOptions, trace_model
from vramplan.trace.testing import memtracker_peak
from vramplan.workload import Workload

NO_WS = TraceOptions(workspaces=False)
W = Workload(task="train", precision="fp32", optimizer="adamw", attention="eager")


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(128, 512), nn.GELU(), nn.Linear(512, 512), nn.GELU(), nn.Linear(512, 10))


def _cnn() -> nn.Module:
    from transformers import ResNetConfig, ResNetForImageClassification

    cfg = ResNetConfig(embedding_size=16, hidden_sizes=[16, 32, 64, 128], depths=[1, 1, 1, 1], num_labels=10)
    return ResNetForImageClassification(cfg)


def _bert() -> nn.Module:
    from transformers import BertConfig, BertForMaskedLM

    cfg = BertConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                     vocab_size=256, max_position_embeddings=128, attn_implementation="eager",
                     # dropout differs by device: CUDA's fused kernel keeps a bool mask, the CPU path
                     # (MemTracker's fake CPU) a float one; tests/test_trace_zoo.py checks the CUDA rule
                     hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    return BertForMaskedLM(cfg)


CASES = {
    "mlp": (_mlp, lambda: torch.randn(16, 128)),
    "cnn": (_cnn, lambda: {"pixel_values": torch.randn(4, 3, 32, 32), "labels": torch.zeros(4, dtype=torch.long)}),
    "bert-eager": (_bert, lambda: {"input_ids": torch.zeros(4, 64, dtype=torch.long),
                                   "labels": torch.zeros(4, 64, dtype=torch.long)}),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_peak_matches_memtracker_within_one_percent(name: str) -> None:
    make, inputs = CASES[name]
    ref = memtracker_peak(make, inputs)
    torch.manual_seed(0)
    r = trace_model(make, inputs(), workload=W, options=NO_WS)
    assert abs(r.peak_allocated - ref) / ref < 0.01, (r.peak_allocated, ref)
