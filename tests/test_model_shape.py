"""The one model shape (vramplan.models.shape): the analytic layout is built on it, token counts
are derived from it once, and no second shape class exists."""

from __future__ import annotations

import ast
from collections import Counter
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vramplan.analytic.estimate import build_arch
from vramplan.analytic.parallel import tokens_per_rank
from vramplan.models.catalog import list_models, resolve
from vramplan.models.shape import SEQUENCE_FAMILIES, model_shape, samples_per_rank, tokens
from vramplan.models.spec import Family
from vramplan.workload import Workload

SRC = Path(__file__).resolve().parents[1] / "src" / "vramplan"


def _transformers() -> list[str]:
    return [m.name for m in list_models() if resolve(m.name).family in SEQUENCE_FAMILIES]


@pytest.mark.parametrize("name", _transformers())
def test_the_analytic_layout_reads_the_one_shape(name: str) -> None:
    spec = resolve(name)
    shape = model_shape(spec)
    arch = build_arch(spec)
    assert arch.shape == shape
    assert arch.layers == shape.layers and arch.hidden == shape.hidden
    for g in arch.groups:
        assert g.attn.heads == shape.heads
        assert (g.attn.head_dim, g.attn.v_head_dim) == (shape.qk_dim, shape.v_dim)
        if g.attn.kind == "mha":
            assert g.attn.kv_heads == shape.kv_heads
        if g.ffn.kind == "moe":
            assert (g.ffn.experts, g.ffn.top_k, g.ffn.intermediate) == (
                shape.n_experts, shape.experts_per_token, shape.moe_intermediate)
    sliding = sum(g.count for g in arch.groups if g.attn.window)
    assert sliding == (min(shape.sliding_layers, shape.layers) if shape.sliding_window else 0)
    if shape.causal:  # the head the FLOPs model counts is the analytic method's logits matrix
        assert shape.head_params == shape.vocab * shape.hidden == arch.head.classes * arch.hidden


def test_vit_positions_are_patches_plus_the_class_token() -> None:
    shape = model_shape(resolve("vit-base"))
    assert shape.family is Family.VIT and shape.vocab == 0 and shape.lm_vocab == 0
    assert shape.tokens_per_sample(Workload(image_size=384)) == (384 // shape.patch_size) ** 2 + 1
    assert model_shape(resolve("llama-3.1-8b")).tokens_per_sample(Workload(seq=777)) == 777


@settings(max_examples=100, deadline=None)
@given(batch=st.integers(1, 64), seq=st.integers(1, 4096), cp=st.sampled_from([1, 2, 4]),
       dp=st.sampled_from([1, 2, 8]), accum=st.integers(1, 8))
def test_token_counts(batch: int, seq: int, cp: int, dp: int, accum: int) -> None:
    seq -= seq % cp or 0
    w = Workload().replace(batch=batch, seq=max(seq, cp), cp=cp, dp=dp, grad_accum=accum)
    t = tokens(w)
    assert t.micro_batch == batch * w.seq
    assert t.per_rank * cp == t.micro_batch == tokens_per_rank(w) * cp
    assert t.samples_per_step == batch * accum and t.global_batch == batch * accum * dp
    assert t.global_tokens == t.micro_batch * accum * dp
    assert samples_per_rank(t.global_batch, dp) == t.samples_per_step
    assert samples_per_rank(t.global_batch + 1, dp) is None or dp == 1


def test_no_duplicate_class_names() -> None:
    """One class per name across the package (issue 9: ``Arch``, ``Shape``, ``Verdict``, ``Recorder``
    were each defined twice)."""
    names: Counter[str] = Counter()
    for path in SRC.rglob("*.py"):
        tree = ast.parse(path.read_text())
        names.update(node.name for node in tree.body if isinstance(node, ast.ClassDef))
    assert [n for n, c in names.items() if c > 1] == []
    assert "Shape" not in names  # the one shape is models.shape.ModelShape


def test_dimension_defaults_are_decided_only_in_the_shape() -> None:
    """`head_dim or hidden // heads`, `kv_heads or heads`, … live in models/shape.py; a method that
    re-derives them would drift from the others."""
    import re

    pattern = re.compile(r"\b(head_dim|kv_heads|moe_intermediate|patch_size) or ")
    offenders = [f"{path.relative_to(SRC)}:{i}" for path in SRC.rglob("*.py") if path.parent.name != "models"
                 for i, line in enumerate(path.read_text().splitlines(), 1) if pattern.search(line)]
    assert offenders == []
