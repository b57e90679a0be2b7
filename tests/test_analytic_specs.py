"""Hand-built ModelSpecs for the analytic tests (published shapes), and their structure checks.

The other tests/test_analytic_*.py import the builders from here.
"""

from __future__ import annotations

from typing import Any

import pytest

from vramplan.analytic.estimate import build_arch
from vramplan.models.spec import Family, ModelSpec


def _mk(**kw: Any) -> ModelSpec:
    base: dict[str, Any] = {"hub_id": None, "source": "test (published config)", "config": {}}
    base.update(kw)
    return ModelSpec(**base)


LLAMA_8B_PARAMS = 8_030_261_248


def llama_8b(**kw: Any) -> ModelSpec:
    d: dict[str, Any] = dict(
        name="llama-3.1-8b", family=Family.DENSE, model_type="llama", hidden=4096, layers=32,
        heads=32, kv_heads=8, head_dim=128, intermediate=14336, vocab=128256, max_positions=131072,
        params=LLAMA_8B_PARAMS, active_params=LLAMA_8B_PARAMS, config={"hidden_act": "silu"},
    )
    d.update(kw)
    return _mk(**d)


def llama_70b() -> ModelSpec:
    return _mk(name="llama-3.1-70b", family=Family.DENSE, model_type="llama", hidden=8192, layers=80,
               heads=64, kv_heads=8, head_dim=128, intermediate=28672, vocab=128256,
               max_positions=131072, params=70_553_706_496)


def mistral_7b() -> ModelSpec:
    return _mk(name="mistral-7b-v0.1", family=Family.DENSE, model_type="mistral", hidden=4096, layers=32,
               heads=32, kv_heads=8, head_dim=128, intermediate=14336, vocab=32000, max_positions=32768,
               sliding_window=4096, sliding_layers=32, params=7_241_732_096)


def gpt2() -> ModelSpec:
    return _mk(name="gpt2", family=Family.DENSE, model_type="gpt2", hidden=768, layers=12, heads=12,
               kv_heads=12, head_dim=64, intermediate=3072, vocab=50257, max_positions=1024,
               tie_embeddings=True, mlp_kind="plain", norm_kind="layernorm", params=124_439_808,
               config={"activation_function": "gelu_new", "attn_pdrop": 0.1, "resid_pdrop": 0.1,
                       "embd_pdrop": 0.1})


def gpt3_175b() -> ModelSpec:
    """GPT-3 175B as in Korthikanti et al. (fused GELU, dropout), GPT-2 module layout."""
    return _mk(name="gpt3-175b", family=Family.DENSE, model_type="gpt2", hidden=12288, layers=96,
               heads=96, kv_heads=96, head_dim=128, intermediate=4 * 12288, vocab=51200,
               max_positions=2048, tie_embeddings=True, mlp_kind="plain", norm_kind="layernorm",
               config={"activation_function": "gelu", "attn_pdrop": 0.1, "resid_pdrop": 0.1,
                       "embd_pdrop": 0.1})


def bert_base() -> ModelSpec:
    return _mk(name="bert-base", family=Family.ENCODER, model_type="bert", hidden=768, layers=12,
               heads=12, kv_heads=12, head_dim=64, intermediate=3072, vocab=30522, max_positions=512,
               tie_embeddings=True, mlp_kind="plain", norm_kind="layernorm", params=109_514_298,
               config={"hidden_act": "gelu", "hidden_dropout_prob": 0.1,
                       "attention_probs_dropout_prob": 0.1, "type_vocab_size": 2})


def vit_base() -> ModelSpec:
    return _mk(name="vit-base", family=Family.VIT, model_type="vit", hidden=768, layers=12, heads=12,
               kv_heads=12, head_dim=64, intermediate=3072, mlp_kind="plain", norm_kind="layernorm",
               image_size=224, patch_size=16, params=86_567_656,
               config={"hidden_act": "gelu", "num_labels": 1000})


def mixtral_8x7b() -> ModelSpec:
    return _mk(name="mixtral-8x7b", family=Family.MOE, model_type="mixtral", hidden=4096, layers=32,
               heads=32, kv_heads=8, head_dim=128, intermediate=14336, vocab=32000, max_positions=32768,
               n_experts=8, experts_per_token=2, params=46_702_792_704, active_params=12_879_925_248)


def deepseek_v3() -> ModelSpec:
    return _mk(name="deepseek-v3", family=Family.MLA, model_type="deepseek_v3", hidden=7168, layers=61,
               heads=128, kv_heads=128, head_dim=192, intermediate=18432, moe_intermediate=2048,
               vocab=129280, max_positions=163840, n_experts=256, experts_per_token=8, shared_experts=1,
               dense_layers=3, q_lora_rank=1536, kv_lora_rank=512, qk_rope_head_dim=64,
               qk_nope_head_dim=128, v_head_dim=128, params=671_026_404_352)


def resnet_50() -> ModelSpec:
    return _mk(name="resnet-50", family=Family.OTHER, model_type="resnet", params=25_557_032)


ALL_TRANSFORMERS = (llama_8b, llama_70b, mistral_7b, gpt2, bert_base, vit_base, mixtral_8x7b, deepseek_v3)


@pytest.mark.parametrize("make", ALL_TRANSFORMERS, ids=lambda f: f.__name__)
def test_structure_reproduces_the_published_parameter_count(make):
    spec = make()
    arch = build_arch(spec)
    assert arch.structured_params == spec.params
    assert arch.extra_params == 0


def test_catalog_models_match_their_structure():
    """Every transformer in the embedded catalog decomposes into the analytic structure."""
    catalog = pytest.importorskip("vramplan.models.catalog")
    specs = [s for s in catalog.list_models() if s.family is not Family.OTHER]
    assert specs
    for spec in specs:
        arch = build_arch(spec)
        assert abs(arch.structured_params - spec.params) <= 1e-4 * spec.params, spec.name
