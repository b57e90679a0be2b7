"""Speculative decoding in vLLM's start-up sizing (vLLM 0.10.1.1, ``vramplan.pools.spec``): the
drafter's weights in the loading figure, its KV layers in the pool's division, its buffers
outside the budget, and vLLM's refusals."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from vllm_pinned import serve_plan  # noqa: E402
from vramplan.cli.main import main
from vramplan.errors import VramplanError
from vramplan.models.catalog import resolve

H = 4096
HEAD = {  # an EAGLE-1 head for Llama-3.1-8B: one Llama decoder layer of the target's shape
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": H, "intermediate_size": 14336,
    "num_attention_heads": 32, "num_key_value_heads": 8, "num_hidden_layers": 1, "vocab_size": 128256,
    "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "torch_dtype": "bfloat16",
    "tie_word_embeddings": False,
}
LAYER = 2 * H * H + 2 * H * 1024 + 3 * H * 14336 + 2 * H  # q, o; k, v (8 KV heads of 128); gate/up/down; 2 norms
BASE = dict(max_model_len=32768)


@pytest.fixture
def head(tmp_path: Path) -> str:
    (tmp_path / "config.json").write_text(json.dumps(HEAD))
    return str(tmp_path / "config.json")


def test_an_eagle_head_adds_its_layer_fc_and_one_kv_layer(head: str) -> None:
    plain = serve_plan("llama-3.1-8b", "h100-sxm", **BASE)
    p = serve_plan("llama-3.1-8b", "h100-sxm", speculative_config={"method": "eagle", "model": head,
                                                                   "num_speculative_tokens": 3}, **BASE)
    assert p.draft_weights == 2 * (LAYER + 2 * H * H)  # embedding and lm_head are the target's
    assert p.weights == plain.weights + p.draft_weights
    assert p.draft_layers == 1 and p.bytes_per_token == plain.bytes_per_token * 33 // 32
    assert p.kv_available == plain.kv_available - p.draft_weights
    assert p.draft_buffers == 8192 * (2 * H * 2 + 12) + 1025 * 4 + 1024 * 3 * 4  # outside the budget
    assert p.device_used - plain.device_used == pytest.approx(p.draft_buffers + (p.kv_pool - plain.kv_pool)
                                                              + p.draft_weights, abs=2**21)
    assert "--speculative-config" in p.command and p.settings["speculative_config"]["num_speculative_tokens"] == 3


def test_eagle3_keeps_its_own_head_and_reads_two_hidden_states(head: str, tmp_path: Path) -> None:
    (tmp_path / "e3").mkdir()
    e3 = tmp_path / "e3" / "config.json"
    e3.write_text(json.dumps({**HEAD, "draft_vocab_size": 32000}))
    p = serve_plan("llama-3.1-8b", "h100-sxm", speculative_config={"method": "eagle3", "model": str(e3),
                                                                   "num_speculative_tokens": 3}, **BASE)
    qkv_in = (32 + 2 * 8) * 128 * H
    assert p.draft_weights == 2 * (LAYER + qkv_in + H + 3 * H * H + 32000 * H) + 8 * 32000
    assert p.draft_layers == 1


def test_deepseek_mtp_loads_its_own_layer_and_head() -> None:
    spec = resolve("deepseek-v3")
    p = serve_plan("deepseek-v3", "h200", tp=8, speculative_config={"num_speculative_tokens": 1})
    assert p.settings["speculative_config"]["method"] == "deepseek_mtp"  # vLLM's detection: no model given
    assert p.draft_layers == 1 and p.layer_kinds == {"mla": spec.layers + 1}
    assert p.draft_weights > 2 * spec.vocab * spec.hidden // 8  # a whole MoE layer + a second vocabulary head


def test_ngram_costs_no_gpu_memory() -> None:
    plain = serve_plan("llama-3.1-8b", "h100-sxm", **BASE)
    # 8 draft tokens: 8192 positions of logits (16-bit + fp32) outgrow the profile's 1024-row sampler (38 B per logit)
    p = serve_plan("llama-3.1-8b", "h100-sxm", speculative_config={"method": "ngram", "num_speculative_tokens": 8},
                   **BASE)
    assert (p.weights, p.tokens, p.draft_buffers) == (plain.weights, plain.tokens, 0)
    assert any("At run time a full decode batch's logits" in n for n in p.notes)


@pytest.mark.parametrize(("config", "words"), [
    ({"model": "some/draft-llama-1b", "num_speculative_tokens": 3}, "Speculative decoding with draft model is not"),
    ({"method": "medusa", "num_speculative_tokens": 3}, "not modelled"),
    ({"method": "eagle", "num_speculative_tokens": 0}, "must be >= 1"),
    ({"method": "eagle"}, "needs num_speculative_tokens"),
    ({"method": "eagle", "num_speculative_tokens": 2, "acceptance": 0.5}, "'acceptance' is not modelled"),
])
def test_vllms_refusals(config: dict[str, object], words: str) -> None:
    with pytest.raises(VramplanError, match=words):
        serve_plan("llama-3.1-8b", "h100-sxm", speculative_config=config)


def test_refusals_by_model_engine_and_layout() -> None:
    with pytest.raises(VramplanError, match="Eagle3 is only supported for Llama and Qwen"):
        serve_plan("gemma-2-9b", "h100-sxm", speculative_config={"method": "eagle3", "num_speculative_tokens": 2})
    with pytest.raises(VramplanError, match="no MTP layers"):
        serve_plan("llama-3.1-8b", "h100-sxm", speculative_config={"method": "deepseek_mtp",
                                                                   "num_speculative_tokens": 1})
    with pytest.raises(VramplanError, match="needs the head's config"):
        serve_plan("qwen3-30b-a3b", "h100-sxm", speculative_config={"method": "eagle", "num_speculative_tokens": 2})
    with pytest.raises(VramplanError, match="vLLM only"):
        serve_plan("llama-3.1-8b", "h100-sxm", engine="sglang",
                   speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    with pytest.raises(VramplanError, match="pipeline parallelism"):
        serve_plan("llama-3.1-8b", "h100-sxm", pp=2, speculative_config={"method": "ngram", "num_speculative_tokens": 2})


def test_the_cli_takes_vllms_json(head: str, capsys: pytest.CaptureFixture[str]) -> None:
    conf = json.dumps({"method": "eagle", "model": head, "num_speculative_tokens": 3})
    assert main(["serve-plan", "llama-3.1-8b", "--gpu", "h100-sxm", "--speculative-config", conf, "--format",
                 "json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["draft_layers"] == 1 and d["draft_weights"] > 0
    code = main(["serve-plan", "llama-3.1-8b", "--gpu", "h100-sxm", "--speculative-config", '{"method": "medusa", '
                 '"num_speculative_tokens": 2}'])
    err = capsys.readouterr().err
    assert code == 2 and "not modelled" in err and len(err.strip().splitlines()) == 1
