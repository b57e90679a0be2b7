"""``vramplan serve-plan``: output, inverse questions, plot, and one-line errors (exit 2)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from vramplan.cli.main import main


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    rc = main(list(argv))
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_table_shows_engine_log_and_command(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = _run(capsys, "serve-plan", "llama-3.1-8b", "--gpu", "h100-sxm", "--max-model-len", "32768",
                      "--avg-request-len", "4000")
    assert rc == 0
    for text in ("Available KV cache memory:", "GPU KV cache size:", "Maximum concurrency for 32,768 tokens",
                 "vllm serve meta-llama/Llama-3.1-8B", "concurrency at 4,000 tokens"):
        assert text in out


def test_json_is_integer_bytes(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = _run(capsys, "serve-plan", "qwen2.5-7b", "--gpu", "l40s", "--engine", "sglang",
                      "--context-length", "16384", "--json")
    d = json.loads(out)
    assert rc == 0 and d["engine"] == "sglang" and isinstance(d["kv_pool"], int) and d["tokens"] > 0


def test_does_not_start_is_reported_not_an_error(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, err = _run(capsys, "serve-plan", "gemma-2-9b", "--gpu", "l4", "--max-model-len", "8192")
    assert rc == 0 and "DOES NOT START" in out and "would not start" in err


def test_engines_side_by_side(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = _run(capsys, "serve-plan", "qwen2.5-7b", "--gpu", "l40s", "--engine", "all",
                      "--max-model-len", "16384", "--json")
    rows = json.loads(out)
    assert rc == 0 and [r["engine"] for r in rows] == ["vllm", "sglang", "tgi", "trtllm"]
    rc, out, _ = _run(capsys, "serve-plan", "qwen2.5-7b", "--gpu", "l40s", "--engine", "all",
                      "--max-model-len", "16384")
    assert "Serving engines compared" in out and "text-generation-launcher" in out


def test_largest_context(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = _run(capsys, "serve-plan", "gemma-2-9b", "--gpu", "l4", "--largest-context", "--json")
    d = json.loads(out)
    assert rc == 0 and 0 < d["largest_max_model_len"] < 8192 and d["plan"]["starts"]


def test_cheapest(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = _run(capsys, "serve-plan", "llama-3.1-8b", "--cheapest", "--concurrency", "16",
                      "--context", "8192", "--json")
    rows = json.loads(out)
    assert rc == 0 and rows and rows[0]["concurrency"] >= 16


def test_plot(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    png = tmp_path / "pool.png"
    rc, _, err = _run(capsys, "serve-plan", "llama-3.1-8b", "--gpu", "l40s", "--max-model-len", "8192",
                      "--plot", str(png))
    assert rc == 0 and png.stat().st_size > 10_000 and "plot written" in err


@pytest.mark.parametrize("argv, text", [
    (["--gpu", "h100-sxm", "--gpu-memory-utilization", "1.2"], "gpu_memory_utilization must be in (0, 1]"),
    (["--gpu", "h100-sxm", "--engine", "sglang", "--mem-fraction-static", "0"], "mem_fraction_static must be in (0, 1]"),
    (["--gpu", "h100-sxm", "--max-model-len", "500000"], "greater than the derived max_model_len"),
    (["--gpu", "h100-sxm", "--tp", "3"], "must be divisible by tensor parallel size (3)"),
    (["--gpu", "h100-sxm", "--model-len-typo"], "unrecognized arguments"),
    ([], "serve-plan needs a GPU"),
    (["--cheapest"], "--cheapest needs a target"),
])
def test_bad_input_one_line_exit_2(argv: list[str], text: str, capsys: pytest.CaptureFixture[str]) -> None:
    try:
        rc = main(["serve-plan", "llama-3.1-8b", *argv])
    except SystemExit as e:  # argparse usage errors
        rc = int(e.code or 0)
    err = capsys.readouterr().err.strip()
    assert rc == 2 and err.startswith("error:") and "\n" not in err and text in err


def test_kv_heads_not_divided(capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["serve-plan", "qwen2.5-14b", "--gpu", "h100-sxm", "--tp", "5"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and "does not divide the model's 8 KV heads" in err and "\n" not in err
