"""``vramplan models``: table, markdown and JSON listings; one model's spec; one-line errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from vramplan.cli.main import main
from vramplan.models import list_models, resolve


def _json(capsys: pytest.CaptureFixture[str], *argv: str) -> dict:
    assert main(["models", *argv, "--format", "json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_json_lists_every_model_with_integer_counts(capsys: pytest.CaptureFixture[str]) -> None:
    rows = _json(capsys)["models"]
    assert [r["alias"] for r in rows] == [s.name for s in list_models()]
    for r in rows:
        for key in ("params", "active_params", "published_params", "layers", "hidden", "heads",
                    "kv_heads", "context"):
            assert isinstance(r[key], int) and not isinstance(r[key], bool), (r["alias"], key)
        assert r["published_source"]
    by_alias = {r["alias"]: r for r in rows}
    assert by_alias["llama-3.1-8b"]["params"] == resolve("llama-3.1-8b").params
    assert by_alias["mixtral-8x7b"]["active_params"] < by_alias["mixtral-8x7b"]["params"]


def test_family_filter(capsys: pytest.CaptureFixture[str]) -> None:
    rows = _json(capsys, "--family", "mla")["models"]
    assert {r["alias"] for r in rows} == {"deepseek-v2-lite", "deepseek-v3"}


def test_table_shows_exact_count_and_published(capsys: pytest.CaptureFixture[str],
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "200")
    assert main(["models", "--family", "moe"]) == 0
    out = capsys.readouterr().out
    assert "46,702,792,704" in out and "46.7B" in out and "mistralai/Mixtral-8x7B-v0.1" in out
    assert "llama-3" not in out and "llama-4-scout" in out  # dense Llamas filtered out, Llama 4 is MoE


def test_markdown(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["models", "--family", "encoder", "--format", "markdown"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("### Model catalog")
    assert "| bert-base | google-bert/bert-base-uncased | encoder | 109,514,298 |" in out


def test_one_model_spec(capsys: pytest.CaptureFixture[str]) -> None:
    spec = _json(capsys, "gemma-2-9b")["model"]
    assert (spec["name"], spec["sliding_window"], spec["sliding_layers"], spec["head_dim"]) == (
        "gemma-2-9b", 4096, 21, 256)
    assert spec["published_source"].startswith("Gemma 2 technical report")


def test_local_config_spec(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(dict(resolve("qwen2.5-0.5b").config)))
    spec = _json(capsys, str(path))["model"]
    assert spec["params"] == resolve("qwen2.5-0.5b").params and spec["hub_id"] is None


def test_unknown_model_is_one_line_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["models", "qwen2.5-8b"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: unknown model 'qwen2.5-8b'") and "did you mean" in err
    assert "\n" not in err


def test_malformed_config_is_one_line_exit_2(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    path.write_text("{not json")
    assert main(["models", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert "malformed JSON" in err and str(path) in err and "\n" not in err


def test_the_catalog_lists_the_diffusion_pipelines(capsys: pytest.CaptureFixture[str]) -> None:
    """Whole pipelines (`vramplan estimate PIPELINE`) are listed with each component's exact count;
    a family filter other than `other` leaves them out."""
    from vramplan.models.pipelines import pipeline_entries

    entries = pipeline_entries()
    doc = _json(capsys)
    assert [p["alias"] for p in doc["pipelines"]] == list(entries)
    for p in doc["pipelines"]:
        comps = entries[p["alias"]].components
        assert {k: c["params"] for k, c in p["components"].items()} == {k: c.params for k, c in comps.items()}
        assert p["params"] == sum(c.params for c in comps.values())
    assert doc["pipelines"][0]["params"] == 16_870_599_139  # FLUX.1-dev: CLIP-L + T5-XXL + transformer + VAE
    assert "pipelines" not in _json(capsys, "--family", "dense")
    assert main(["models"]) == 0
    assert "flux.1-dev-pipeline" in capsys.readouterr().out
