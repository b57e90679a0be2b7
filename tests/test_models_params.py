"""Parameter formulas against the real transformers/diffusers models built on ``meta``.

Three kinds of evidence:
1. every embedded config: formula == ``sum(p.numel())`` of the model transformers builds;
2. random small configs of every architecture (hypothesis): the same equality, across heads,
   biases, tying, GQA, MoE layouts and MLA ranks;
3. regression anchors: exact counts the Hub publishes for well-known checkpoints, and the
   model cards' own (rounded) figures.
"""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vramplan.errors import ConfigError
from vramplan.models.arch import ARCHS, SEQ_CLS
from vramplan.models.build import build_model
from vramplan.models.catalog import catalog_entries, list_models, resolve
from vramplan.models.normalize import spec_from_config
from vramplan.models.params import count_params

ALIASES = list(catalog_entries())


def meta_count(config: dict[str, Any], head: str | None = None) -> int:
    spec = spec_from_config(config, name="test", source="test")
    model = build_model(spec, head=head, device="meta")
    return sum(p.numel() for p in model.parameters())


# --- 1. the embedded catalog ---------------------------------------------------------------

@pytest.mark.parametrize("alias", ALIASES)
def test_catalog_count_equals_meta_built_model(alias: str) -> None:
    spec = resolve(alias)
    model = build_model(spec, device="meta")
    assert sum(p.numel() for p in model.parameters()) == spec.params


OTHER_HEADS = [(a, h) for a in ("bert-base", "bert-large", "vit-base", "gpt2", "llama-3.2-1b")
               for h in ARCHS[resolve(a).model_type].heads[1:]]


@pytest.mark.parametrize(("alias", "head"), OTHER_HEADS)
def test_catalog_other_heads_equal_meta(alias: str, head: str) -> None:
    spec = resolve(alias)
    total, active = count_params(spec.config, head=head)
    assert total == active == meta_count(dict(spec.config), head)


# --- 2. random small configs of every architecture ----------------------------------------

def _base(model_type: str) -> dict[str, Any]:
    """A published config of this architecture, or transformers' defaults for it."""
    for spec in list_models():
        if spec.model_type == model_type:
            cfg = copy.deepcopy(dict(spec.config))
            cfg.pop("id2label", None)
            cfg.pop("label2id", None)
            return cfg
    from transformers import AutoConfig

    cfg = AutoConfig.for_model(model_type).to_dict()
    cfg["model_type"] = model_type
    return {k: v for k, v in cfg.items() if k not in ("id2label", "label2id", "layer_types")}


@st.composite
def small_decoder(draw: st.DrawFn, model_type: str) -> tuple[dict[str, Any], str]:
    cfg = _base(model_type)
    heads = draw(st.sampled_from([2, 4]))
    kv = draw(st.sampled_from([k for k in (1, 2, 4) if heads % k == 0]))
    hd = draw(st.sampled_from([8, 16]))
    layers = draw(st.integers(1, 3))
    cfg.update(
        num_attention_heads=heads, num_key_value_heads=kv, num_hidden_layers=layers,
        hidden_size=heads * hd * draw(st.sampled_from([1, 2])) if "head_dim" in cfg else heads * hd,
        intermediate_size=draw(st.integers(8, 48)), vocab_size=draw(st.integers(16, 80)),
        tie_word_embeddings=draw(st.booleans()), max_position_embeddings=64, pad_token_id=0,
    )
    cfg.pop("layer_types", None)
    if "head_dim" in cfg:
        cfg["head_dim"] = hd
    if "attention_bias" in cfg or model_type in ("llama", "qwen3", "gemma", "gemma2", "gemma3_text"):
        cfg["attention_bias"] = draw(st.booleans())
    if model_type == "llama":
        cfg["mlp_bias"] = draw(st.booleans())
    if model_type == "qwen2_moe":
        cfg["qkv_bias"] = draw(st.booleans())
    if model_type in ("mixtral", "gpt_oss"):
        cfg["num_local_experts"] = draw(st.integers(2, 4))
        cfg["num_experts_per_tok"] = draw(st.integers(1, 2))
    if model_type in ("qwen2_moe", "qwen3_moe"):
        cfg["num_experts"] = draw(st.integers(2, 4))
        cfg["num_experts_per_tok"] = draw(st.integers(1, 2))
        cfg["moe_intermediate_size"] = draw(st.integers(4, 24))
        cfg["decoder_sparse_step"] = draw(st.integers(1, 2))
        cfg["mlp_only_layers"] = draw(st.lists(st.integers(0, layers - 1), max_size=1, unique=True))
        if model_type == "qwen2_moe":
            cfg["shared_expert_intermediate_size"] = draw(st.integers(4, 24))
    if model_type == "llama4_text":
        cfg.update(num_local_experts=draw(st.integers(2, 4)), num_experts_per_tok=1,
                   intermediate_size_mlp=draw(st.integers(8, 48)),
                   interleave_moe_layer_step=draw(st.integers(1, 2)), attention_chunk_size=16)
        cfg.pop("moe_layers", None)
        cfg.pop("no_rope_layers", None)
    if model_type.startswith("deepseek"):
        cfg.pop("head_dim", None)
        cfg.update(
            n_routed_experts=draw(st.integers(2, 4)), num_experts_per_tok=draw(st.integers(1, 2)),
            n_shared_experts=draw(st.integers(0, 2)), moe_intermediate_size=draw(st.integers(4, 24)),
            first_k_dense_replace=draw(st.integers(0, layers)), q_lora_rank=draw(st.sampled_from([None, 8])),
            kv_lora_rank=draw(st.sampled_from([4, 8])), qk_rope_head_dim=draw(st.sampled_from([4, 8])),
            qk_nope_head_dim=draw(st.sampled_from([4, 8])), v_head_dim=draw(st.sampled_from([4, 8])),
            n_group=1, topk_group=1, rope_scaling=None,
        )
    head = draw(st.sampled_from(ARCHS[model_type].heads))
    if head == SEQ_CLS:
        cfg["num_labels"] = draw(st.integers(1, 5))
    return cfg, head


DECODER_TYPES = [t for t, a in ARCHS.items() if a.kind in ("decoder", "mla") and t != "gpt2"]
_SETTINGS = settings(max_examples=6, deadline=None, derandomize=True,
                     suppress_health_check=[HealthCheck.too_slow])


@pytest.mark.parametrize("model_type", DECODER_TYPES)
def test_random_decoder_configs_match_meta(model_type: str) -> None:
    @_SETTINGS
    @given(small_decoder(model_type))
    def check(case: tuple[dict[str, Any], str]) -> None:
        cfg, head = case
        total, active = count_params(cfg, head=head)
        assert total == meta_count(cfg, head)
        assert 0 < active <= total
        if not ARCHS[model_type].moe:
            assert active == total

    check()


@_SETTINGS
@given(
    d_head=st.sampled_from([8, 16]), heads=st.integers(1, 4), layers=st.integers(1, 3),
    vocab=st.integers(16, 80), positions=st.integers(8, 64), inner=st.sampled_from([None, 24]),
    tie=st.booleans(), head=st.sampled_from(ARCHS["gpt2"].heads), labels=st.integers(1, 4),
)
def test_random_gpt2_configs_match_meta(d_head: int, heads: int, layers: int, vocab: int, positions: int,
                                        inner: int | None, tie: bool, head: str, labels: int) -> None:
    cfg = _base("gpt2")
    cfg.update(n_embd=d_head * heads, n_head=heads, n_layer=layers, vocab_size=vocab,
               n_positions=positions, n_inner=inner, tie_word_embeddings=tie, num_labels=labels)
    assert count_params(cfg, head=head)[0] == meta_count(cfg, head)


@_SETTINGS
@given(
    heads=st.integers(1, 4), layers=st.integers(1, 3), inter=st.integers(8, 40),
    vocab=st.integers(16, 80), positions=st.integers(8, 64), types=st.integers(1, 3),
    tie=st.booleans(), head=st.sampled_from(ARCHS["bert"].heads), labels=st.integers(1, 4),
)
def test_random_bert_configs_match_meta(heads: int, layers: int, inter: int, vocab: int, positions: int,
                                        types: int, tie: bool, head: str, labels: int) -> None:
    cfg = _base("bert")
    cfg.update(hidden_size=8 * heads, num_attention_heads=heads, num_hidden_layers=layers,
               intermediate_size=inter, vocab_size=vocab, max_position_embeddings=positions,
               type_vocab_size=types, tie_word_embeddings=tie, num_labels=labels)
    assert count_params(cfg, head=head)[0] == meta_count(cfg, head)


@_SETTINGS
@given(
    heads=st.integers(1, 4), layers=st.integers(1, 3), inter=st.integers(8, 40),
    patch=st.sampled_from([4, 8]), grid=st.integers(1, 4), channels=st.sampled_from([1, 3]),
    qkv_bias=st.booleans(), head=st.sampled_from(ARCHS["vit"].heads), labels=st.integers(1, 7),
    pooler=st.sampled_from([None, 12]),
)
def test_random_vit_configs_match_meta(heads: int, layers: int, inter: int, patch: int, grid: int,
                                       channels: int, qkv_bias: bool, head: str, labels: int,
                                       pooler: int | None) -> None:
    cfg = _base("vit")
    cfg.update(hidden_size=8 * heads, num_attention_heads=heads, num_hidden_layers=layers,
               intermediate_size=inter, patch_size=patch, image_size=patch * grid,
               num_channels=channels, qkv_bias=qkv_bias, num_labels=labels, encoder_stride=patch)
    if pooler:
        cfg["pooler_output_size"] = pooler
    assert count_params(cfg, head=head)[0] == meta_count(cfg, head)


# --- 3. published figures -----------------------------------------------------------------

# Exact parameter counts of the Hub checkpoints (transformers layout; each equals the
# meta-built model above, and the Hub's safetensors metadata of the checkpoint).
HUB_EXACT = {
    "llama-3.1-8b": 8_030_261_248,
    "llama-3.1-70b": 70_553_706_496,
    "llama-3.1-405b": 405_853_388_800,
    "llama-2-7b": 6_738_415_616,
    "llama-3.2-1b": 1_235_814_400,
    "mistral-7b": 7_241_732_096,
    "mixtral-8x7b": 46_702_792_704,
    "qwen2.5-7b": 7_615_616_512,
    "gemma-2-9b": 9_241_705_984,
    "phi-3-mini": 3_821_079_552,
    "gpt2": 124_439_808,
    "resnet-50": 25_557_032,
    "deepseek-r1-distill-llama-8b": 8_030_261_248,  # Llama-3.1-8B layout
    "deepseek-r1-distill-qwen-7b": 7_615_616_512,  # Qwen2.5-7B layout
    "gpt-oss-20b": 20_914_757_184,
    "gpt-oss-120b": 116_829_156_672,
    # the language models (Llama4ForCausalLM) of the Hub's Llama4ForConditionalGeneration checkpoints
    "llama-4-scout": 107_769_861_120,
    "llama-4-maverick": 400_711_848_960,
    # vision-language (closed form, models/_params_vlm.py; the whole Qwen2_5_VLForConditionalGeneration): the 3B's
    # model.safetensors.index.json total_size / 2 (bf16), the 7B's ModelScope model_size
    "qwen2.5-vl-3b": 3_754_622_976,
    "qwen2.5-vl-7b": 8_292_166_656,
    # Gemma3ForConditionalGeneration (vision tower, projector, language model; the head tied):
    # the totals public from_pretrained load checks of google/gemma-3-4b-it assert, and the
    # 27B's (the model pages' "4.3B" / "27.4B" safetensors figures)
    "gemma-3-4b": 4_300_079_472,
    "gemma-3-12b": 12_187_325_040,  # the Hub API's safetensors total of google/gemma-3-12b-it ("12.2B")
    "gemma-3-27b": 27_432_406_640,
    # WanTransformer3DModel: the element counts of Wan-AI/Wan2.1-T2V-1.3B-Diffusers' transformer/*.safetensors
    # headers (hdae/karume@fdd0de08 tools/export-recipes/wan/sources.py)
    "wan2.1-t2v-1.3b-transformer": 1_418_996_800,
}


@pytest.mark.parametrize(("alias", "expected"), sorted(HUB_EXACT.items()))
def test_exact_published_counts(alias: str, expected: int) -> None:
    assert resolve(alias).params == expected


def test_bert_base_backbone_is_109_482_240() -> None:
    # BertModel (with pooler), the figure usually quoted for bert-base-uncased.
    assert count_params(resolve("bert-base").config, head="base") == (109_482_240, 109_482_240)


def test_deepseek_v3_count_excludes_mtp_and_router_bias_buffers() -> None:
    spec = resolve("deepseek-v3")
    moe_layers = spec.layers - spec.dense_layers
    # 671,026,419,200 is often quoted: it includes the per-expert score-correction bias of the
    # 58 MoE layers, which transformers registers as a buffer, not a parameter.
    assert spec.params == 671_026_419_200 - moe_layers * spec.n_experts == 671_026_404_352
    assert 37e9 <= spec.active_params < 38e9  # "37B activated" (technical report)


@pytest.mark.parametrize("alias", ALIASES)
def test_published_figure_agrees_with_exact_count(alias: str) -> None:
    """Model cards round (or name a size class); the exact count must agree with them.

    rounded figures (e.g. "46.7B") within 1.5% — the card's precision and what it counts
    (BERT's "340M"); nominal size names ("7B") within 5%; exact figures exactly."""
    e = catalog_entries()[alias]
    exact = resolve(alias).params
    tolerance = {"exact": 0.0, "rounded": 0.015, "nominal": 0.05}[e.published_kind]
    assert abs(exact - e.published_params) <= tolerance * e.published_params
    if e.published_active is not None:
        active = resolve(alias).active_params
        assert abs(active - e.published_active) <= 0.12 * e.published_active


@pytest.mark.parametrize(("alias", "active"), [("gpt-oss-20b", 3_608_307_264),
                                                ("gpt-oss-120b", 5_132_849_472)])
def test_gpt_oss_active_count_matches_openai_without_embedding(alias: str, active: int) -> None:
    # OpenAI's model card: 3.61B / 5.13B active, counting the unembedding but not the
    # embedding; vramplan's active count includes the embedding.
    spec = resolve(alias)
    assert spec.active_params - spec.vocab * spec.hidden == active


def test_moe_active_counts_only_routed_experts() -> None:
    spec = resolve("mixtral-8x7b")
    expert = 3 * spec.hidden * spec.moe_intermediate
    inactive = spec.layers * (spec.n_experts - spec.experts_per_token) * expert
    assert spec.active_params == spec.params - inactive


def test_tied_head_counted_once() -> None:
    cfg = dict(resolve("qwen2.5-0.5b").config)
    tied, _ = count_params(cfg)
    untied, _ = count_params({**cfg, "tie_word_embeddings": False})
    assert untied - tied == cfg["vocab_size"] * cfg["hidden_size"]


def test_unknown_architecture_raises_config_error() -> None:
    with pytest.raises(ConfigError, match="no parameter formula for model_type 'mamba'"):
        count_params({"model_type": "mamba", "hidden_size": 8})


def test_missing_key_names_key() -> None:
    cfg = dict(resolve("llama-3.1-8b").config)
    del cfg["intermediate_size"]
    with pytest.raises(ConfigError, match="missing required key 'intermediate_size'"):
        count_params(cfg, origin="my/config.json")


def test_bad_value_type_is_config_error() -> None:
    cfg = {**resolve("gpt2").config, "n_layer": "twelve"}
    with pytest.raises(ConfigError, match="'n_layer' must be a non-negative integer"):
        count_params(cfg)


def test_unsupported_head_is_config_error() -> None:
    with pytest.raises(ConfigError, match="head 'masked-lm' is not available"):
        count_params(resolve("llama-3.1-8b").config, head="masked-lm")


def test_trace_only_models_have_no_formula() -> None:
    with pytest.raises(ConfigError, match="no closed-form parameter count"):
        count_params(resolve("sd15-unet").config)


def test_count_params_is_json_roundtrip_stable() -> None:
    cfg = resolve("deepseek-v2-lite").config
    assert count_params(json.loads(json.dumps(dict(cfg)))) == count_params(cfg)


def test_meta_build_allocates_nothing() -> None:
    model = build_model(resolve("llama-3.1-70b"))
    assert all(p.device == torch.device("meta") for p in model.parameters())
