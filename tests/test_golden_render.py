"""Golden files of each command's table output (width 100, no colour), so that a layout change
shows in review as a diff of tests/golden/*.txt.

Regenerate deliberately with ``VRAMPLAN_REGEN_GOLDEN=1 PYTHONPATH=src .venv/bin/pytest
tests/test_golden_render.py`` and read the diff before committing. Only analytic and catalog
commands: fast, deterministic, and the same on every torch version.
"""

from __future__ import annotations

import os
import pickle
from pathlib import Path

import pytest

from show_fixtures import recorded_snapshot
from vramplan.cli.main import main

GOLDEN = Path(__file__).with_name("golden")
REGEN = os.environ.get("VRAMPLAN_REGEN_GOLDEN") == "1"
WIDTH = 100

EVENTS = ('{"action": "alloc", "id": 7, "size": 1048576, "stream": 0}\n'
          '{"action": "alloc", "id": 8, "size": 31457280}\n{"action": "free", "id": 7}\n')

CASES = {
    "estimate-train": ["estimate", "llama-3.1-8b", "--task", "train", "--checkpointing", "full",
                       "--batch", "2", "--gpu", "h100", "--method", "analytic"],
    "estimate-lora-zero": ["estimate", "llama-3.2-1b", "--peft", "lora", "--dp", "4", "--zero", "3",
                           "--gpu", "rtx-4090", "--method", "analytic"],
    "estimate-generate": ["estimate", "qwen2.5-0.5b", "--task", "generate", "--batch", "8", "--seq", "1024",
                          "--new-tokens", "256", "--method", "analytic"],
    "fit": ["fit", "qwen2.5-0.5b", "--gpu", "rtx-4090", "--method", "analytic"],
    "plan": ["plan", "llama-3.2-1b", "--gpu", "rtx-4090", "--method", "analytic", "--top", "5"],
    "plan-rank": ["plan", "llama-3.2-1b", "--rank-gpus", "--gpu", "h100", "--method", "analytic", "--top", "3"],
    "gpu": ["gpu", "h100"],
    "gpus": ["gpus", "--min-memory", "80GiB"],
    "models": ["models", "--family", "moe"],
    "models-one": ["models", "llama-3.1-8b"],
    "replay": ["replay", "events.jsonl", "--capacity", "16MiB"],
    "snapshot": ["snapshot", "recorded.pickle", "--top", "3"],
    "rules-bandwidth": ["rules", "bandwidth", "--bus", "384", "--rate", "21"],
    "rules-render": ["rules", "render", "--width", "3840", "--height", "2160", "--msaa", "4", "--gpu", "rtx-4090"],
    "rules-video": ["rules", "video", "--codec", "hevc", "--gpu", "l4"],
    "rules-array": ["rules", "array", "--shape", "4096,4096,4096", "--gpu", "h100"],
    "serve-plan": ["serve-plan", "llama-3.1-8b", "--gpu", "h100"],
    "cache": ["cache"],
}


@pytest.fixture
def page(tmp_path, monkeypatch):
    """A fixed page: 100 columns, no colour, inputs under fixed relative names."""
    monkeypatch.setenv("VRAMPLAN_COLUMNS", str(WIDTH))
    for var in ("FORCE_COLOR", "TTY_COMPATIBLE", "TTY_INTERACTIVE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("VRAMPLAN_CACHE_DIR", "store")  # (an empty store under a fixed relative name)
    (tmp_path / "events.jsonl").write_text(EVENTS)
    (tmp_path / "recorded.pickle").write_bytes(pickle.dumps(recorded_snapshot()))
    return tmp_path


@pytest.mark.parametrize("name", sorted(CASES))
def test_table_output_matches_golden(name, page, capsys):
    assert main(CASES[name]) == 0
    out = capsys.readouterr().out
    assert "\x1b[" not in out  # no colour codes
    assert max(map(len, out.splitlines())) <= WIDTH
    path = GOLDEN / f"{name}.txt"
    if REGEN:
        path.parent.mkdir(exist_ok=True)
        path.write_text(out)
        return
    assert path.exists(), f"no golden file {path.name}: run with VRAMPLAN_REGEN_GOLDEN=1"
    expected = path.read_text()
    assert out == expected, f"{name}: table output changed; if intended, regenerate with VRAMPLAN_REGEN_GOLDEN=1"


def test_every_command_with_a_table_has_a_golden_file():
    import argparse

    from vramplan.cli.main import build_parser

    # trace and run trace a model or script (torch-version dependent), measure needs a CUDA GPU,
    # web serves a page
    no_table = {"trace", "run", "measure", "web"}
    covered = {argv[0] for argv in CASES.values()}
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    missing = set(sub.choices) - no_table - covered
    assert not missing, f"add a case to CASES for {sorted(missing)} and run with VRAMPLAN_REGEN_GOLDEN=1"
    assert {p.stem for p in GOLDEN.glob("*.txt")} == set(CASES)
