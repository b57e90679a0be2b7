"""`vramplan gpus` and `vramplan gpu NAME` end to end (in process)."""

from __future__ import annotations

import json

import pytest

from vramplan.cli.main import main
from vramplan.units import GB


@pytest.fixture(autouse=True)
def _wide(monkeypatch):
    """Rich sizes tables to the terminal; keep keys unabbreviated in captured output."""
    monkeypatch.setenv("COLUMNS", "200")


def _json(capsys, argv):
    assert main(argv) == 0
    return json.loads(capsys.readouterr().out)


def test_gpus_lists_the_catalog(capsys):
    rows = _json(capsys, ["gpus", "--json"])["gpus"]
    assert len(rows) >= 30
    assert all(isinstance(r["capacity"], int) and isinstance(r["usable"], int) for r in rows)
    assert all(r["sources"] for r in rows)


def test_gpus_filters(capsys):
    rows = _json(capsys, ["gpus", "--min-memory", "24GB", "--vendor", "nvidia", "--json"])["gpus"]
    assert rows and all(r["capacity"] >= 24 * GB and r["vendor"] == "nvidia" for r in rows)
    assert "rtx-4080" not in {r["key"] for r in rows}


@pytest.mark.parametrize("fmt", ["table", "markdown"])
def test_gpus_table_and_markdown(capsys, fmt):
    assert main(["gpus", "--format", fmt]) == 0
    out = capsys.readouterr().out
    assert "h100-sxm" in out and "GiB" in out


def test_gpu_shows_sources_and_the_bandwidth_derivation(capsys):
    assert main(["gpu", "4090"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "384 bit × 21 Gbps ÷ 8 = 1,008 GB/s; stated 1,008 GB/s" in out
    assert "Epoch AI" in out and "usable capacity" in out


def test_gpu_json(capsys):
    d = _json(capsys, ["gpu", "h100", "--json", "--world-size", "8"])
    assert d["key"] == "h100-sxm" and d["usable"] == d["cuda_total"]
    assert d["bandwidth_derivation"]["derived"] == pytest.approx(5120 * 5.24 / 8 * 1e9)
    assert any(o["name"].startswith("NCCL") for o in d["overhead"])
    assert d["cublas_workspace"] == 32 * 2**20
    assert any(i["name"] == "p5.48xlarge" for i in d["instances"])


def test_gpu_markdown_mentions_back_computed_rates(capsys):
    assert main(["gpu", "h200", "--format", "markdown"]) == 0
    assert "back-computed" in capsys.readouterr().out


def test_unknown_gpu_exits_2_with_one_line(capsys):
    assert main(["gpu", "h10"]) == 2
    err = capsys.readouterr().err.strip()
    assert "did you mean" in err and "\n" not in err


def test_bad_min_memory_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as e:
        main(["gpus", "--min-memory", "lots"])
    assert e.value.code == 2
