"""resolve / list_models: catalog aliases, Hub ids, local config files, errors, normalisation."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from vramplan.errors import ConfigError, UnknownNameError
from vramplan.models import Family, list_models, resolve
from vramplan.models.catalog import catalog_entries

CONFIGS = Path(__file__).resolve().parents[1] / "src" / "vramplan" / "models" / "configs"


# --- catalog ------------------------------------------------------------------------------

def test_catalog_has_the_required_models() -> None:
    required = {
        "llama-2-7b", "llama-2-13b", "llama-2-70b", "llama-3-8b", "llama-3-70b", "llama-3.1-8b",
        "llama-3.1-70b", "llama-3.1-405b", "llama-3.2-1b", "llama-3.2-3b", "llama-3.3-70b",
        "mistral-7b", "mixtral-8x7b", "mixtral-8x22b", "qwen2.5-0.5b", "qwen2.5-1.5b",
        "qwen2.5-3b", "qwen2.5-7b", "qwen2.5-14b", "qwen2.5-32b", "qwen2.5-72b", "qwen3-30b-a3b",
        "gemma-2-2b", "gemma-2-9b", "gemma-2-27b", "gemma-3-1b", "phi-3-mini", "phi-4",
        "deepseek-v2-lite", "deepseek-v3", "gpt2", "bert-base", "bert-large", "vit-base",
        "vit-large", "resnet-50", "sd15-unet",
    }
    assert required <= set(catalog_entries())
    assert len(catalog_entries()) >= 30


def test_every_config_file_is_indexed_and_every_entry_has_a_file() -> None:
    files = {p.stem for p in CONFIGS.glob("*.json")} - {"index"}
    assert files == set(catalog_entries())


@pytest.mark.parametrize("alias", list(catalog_entries()))
def test_entry_family_matches_detected_family(alias: str) -> None:
    entry = catalog_entries()[alias]
    spec = resolve(alias)
    assert spec.family is entry.family
    assert spec.name == alias and spec.hub_id == entry.hub_id
    assert entry.hub_id in spec.source and "embedded catalog" in spec.source
    assert spec.published_params == entry.published_params
    assert spec.params > 0 and 0 < spec.active_params <= spec.params
    assert entry.published_source  # every published figure names where it is stated


def test_list_models_in_catalog_order_and_filter() -> None:
    names = [s.name for s in list_models()]
    assert names == list(catalog_entries())
    moe = list_models("moe")
    assert {s.name for s in moe} == {"mixtral-8x7b", "mixtral-8x22b", "qwen3-30b-a3b",
                                     "gpt-oss-20b", "gpt-oss-120b", "llama-4-scout", "llama-4-maverick"}
    assert all(s.family is Family.MLA for s in list_models(Family.MLA))


@pytest.mark.parametrize("name", [
    "llama-3.1-8b", "LLAMA-3.1-8B", "meta-llama/Llama-3.1-8B", "META-LLAMA/llama-3.1-8b",
    "meta-llama/Meta-Llama-3.1-8B", "  llama-3.1-8b ",
])
def test_alias_and_hub_id_resolve_case_insensitively(name: str) -> None:
    assert resolve(name).name == "llama-3.1-8b"


def test_resolve_is_cached() -> None:
    assert resolve("qwen2.5-7b") is resolve("Qwen/Qwen2.5-7B")


def test_spec_config_is_read_only() -> None:
    with pytest.raises(TypeError):
        resolve("gpt2").config["n_layer"] = 1  # type: ignore[index]


# --- normalisation --------------------------------------------------------------------------

def test_llama_fields() -> None:
    s = resolve("llama-3.1-8b")
    assert (s.hidden, s.layers, s.heads, s.kv_heads, s.head_dim) == (4096, 32, 32, 8, 128)
    assert (s.intermediate, s.vocab, s.max_positions) == (14336, 128256, 131072)
    assert (s.mlp_kind, s.norm_kind, s.tie_embeddings, s.dtype) == ("gated", "rmsnorm", False, "bfloat16")
    assert s.sliding_window is None and s.sliding_layers == 0 and not s.is_moe and s.is_decoder


def test_explicit_head_dim_wins() -> None:
    g = resolve("gemma-2-27b")  # 4608 / 32 = 144, but head_dim is 128
    assert g.head_dim == 128 == g.config["head_dim"] != g.hidden // g.heads


@pytest.mark.parametrize(("alias", "window", "layers"), [
    ("mistral-7b", 4096, 32),        # v0.1: every layer
    ("mistral-7b-v0.3", None, 0),    # window removed
    ("gemma-2-9b", 4096, 21),        # alternating local/global over 42 layers
    ("gemma-3-1b", 512, 22),         # 5 local : 1 global over 26 layers
    ("qwen2.5-7b", None, 0),         # use_sliding_window false
    ("phi-3-mini", 2047, 32),
    ("llama-3.1-8b", None, 0),
])
def test_sliding_window_layers(alias: str, window: int | None, layers: int) -> None:
    s = resolve(alias)
    assert (s.sliding_window, s.sliding_layers) == (window, layers)


def test_qwen_sliding_window_when_enabled(tmp_path: Path) -> None:
    cfg = {**resolve("qwen2.5-7b").config, "use_sliding_window": True, "sliding_window": 4096,
           "max_window_layers": 20}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    s = resolve(str(path))
    assert (s.sliding_window, s.sliding_layers) == (4096, 28 - 20)


def test_moe_and_mla_fields() -> None:
    m = resolve("mixtral-8x7b")
    assert (m.n_experts, m.experts_per_token, m.moe_intermediate, m.shared_experts, m.dense_layers) == (
        8, 2, 14336, 0, 0)
    q = resolve("qwen3-30b-a3b")
    assert (q.n_experts, q.experts_per_token, q.moe_intermediate, q.head_dim) == (128, 8, 768, 128)
    d = resolve("deepseek-v3")
    assert (d.n_experts, d.experts_per_token, d.shared_experts, d.dense_layers) == (256, 8, 1, 3)
    assert (d.q_lora_rank, d.kv_lora_rank, d.qk_rope_head_dim, d.qk_nope_head_dim, d.v_head_dim) == (
        1536, 512, 64, 128, 128)
    assert d.head_dim == 192
    lite = resolve("deepseek-v2-lite")
    assert (lite.q_lora_rank, lite.shared_experts, lite.dense_layers) == (0, 2, 1)


def test_encoder_vision_and_other_fields() -> None:
    b = resolve("bert-base")
    assert (b.family, b.mlp_kind, b.norm_kind, b.max_positions, b.tie_embeddings) == (
        Family.ENCODER, "plain", "layernorm", 512, True)
    v = resolve("vit-base")
    assert (v.image_size, v.patch_size, v.num_channels, v.max_positions, v.vocab) == (224, 16, 3, 197, 0)
    g = resolve("gpt2")
    assert (g.hidden, g.layers, g.heads, g.intermediate, g.max_positions) == (768, 12, 12, 3072, 1024)
    assert resolve("resnet-50").family is Family.OTHER
    unet = resolve("sd15-unet")
    assert (unet.family, unet.image_size, unet.num_channels) == (Family.OTHER, 512, 4)


# --- local files ------------------------------------------------------------------------------

def _write(tmp_path: Path, config: object, name: str = "config.json") -> Path:
    path = tmp_path / name
    path.write_text(json.dumps(config))
    return path


def test_local_file_and_folder(tmp_path: Path) -> None:
    cfg = dict(resolve("llama-3.2-1b").config)
    path = _write(tmp_path, cfg)
    from_file = resolve(str(path))
    from_dir = resolve(str(tmp_path))
    assert from_file.params == from_dir.params == resolve("llama-3.2-1b").params
    assert from_file.hub_id is None and str(path.resolve()) in from_file.source


def test_local_file_reloaded_when_changed(tmp_path: Path) -> None:
    cfg = dict(resolve("gpt2").config)
    path = _write(tmp_path, cfg)
    first = resolve(str(path)).layers
    path.write_text(json.dumps({**cfg, "n_layer": 2, "_pad": "x" * 10}))
    assert (first, resolve(str(path)).layers) == (12, 2)


def test_malformed_json_names_file_and_position(tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    path.write_text('{"model_type": "llama",\n  "hidden_size": }')
    with pytest.raises(ConfigError) as e:
        resolve(str(path))
    msg = str(e.value)
    assert "config.json" in msg and "malformed JSON at line 2" in msg and "\n" not in msg


def test_missing_key_names_file_and_key(tmp_path: Path) -> None:
    cfg = dict(resolve("mistral-7b").config)
    del cfg["num_hidden_layers"]
    path = _write(tmp_path, cfg)
    with pytest.raises(ConfigError, match=r"config\.json: missing required key 'num_hidden_layers'"):
        resolve(str(path))


def test_missing_model_type(tmp_path: Path) -> None:
    path = _write(tmp_path, {"hidden_size": 8})
    with pytest.raises(ConfigError, match="missing required key 'model_type'"):
        resolve(str(path))


def test_not_an_object(tmp_path: Path) -> None:
    path = _write(tmp_path, [1, 2])
    with pytest.raises(ConfigError, match="must hold a JSON object"):
        resolve(str(path))


def test_folder_without_config(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no config.json in this folder"):
        resolve(str(tmp_path))


def test_missing_json_path(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no such file"):
        resolve(str(tmp_path / "nope.json"))


def test_unknown_architecture_is_trace_only(tmp_path: Path) -> None:
    path = _write(tmp_path, {"model_type": "mamba", "architectures": ["MambaForCausalLM"],
                             "hidden_size": 768, "num_hidden_layers": 24, "vocab_size": 50280})
    s = resolve(str(path))
    assert (s.family, s.params, s.hidden, s.layers, s.vocab) == (Family.OTHER, 0, 768, 24, 50280)


# --- unknown names and the Hub ------------------------------------------------------------

def test_unknown_alias_suggests_nearest() -> None:
    with pytest.raises(UnknownNameError) as e:
        resolve("lama-3.1-8b")
    assert "unknown model 'lama-3.1-8b'" in str(e.value) and "llama-3.1-8b" in str(e.value)


def test_unknown_alias_without_neighbour_points_to_listing() -> None:
    with pytest.raises(UnknownNameError, match="vramplan models"):
        resolve("zzzzqqqq")


def test_empty_name() -> None:
    with pytest.raises(ConfigError, match="empty model name"):
        resolve("  ")


def _run(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    full_env = {**os.environ, **env}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=full_env,
                          timeout=120)


def test_hub_id_offline_is_one_line_error(tmp_path: Path) -> None:
    code = (
        "from vramplan.models import resolve\n"
        "from vramplan.errors import ConfigError\n"
        "try:\n    resolve('some-org/not-in-catalog-7b')\n"
        "except ConfigError as e:\n    print(e)\n"
    )
    out = _run(code, HF_HUB_OFFLINE="1", HF_HOME=str(tmp_path))
    assert out.stdout.strip() == (
        "cannot fetch config for some-org/not-in-catalog-7b offline; pass a local config.json path"
    ), out.stderr


def test_resolve_and_list_do_not_import_torch() -> None:
    code = (
        "import sys\n"
        "from vramplan.models import resolve, list_models, count_params\n"
        "s = resolve('llama-3.1-8b'); list_models(); count_params(s.config)\n"
        "print('torch' in sys.modules, 'transformers' in sys.modules)\n"
    )
    out = _run(code)
    assert out.stdout.strip() == "False False", out.stderr
