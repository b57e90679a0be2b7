"""Issue 14: defects a new user (or an adversary) met at the command line. One regression
test (or a few) per item, run where the user met it: the CLI."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from vramplan.cli.main import main

SRC = Path(__file__).resolve().parents[1] / "src"

_BLOCKER = '''
import sys
class _Block:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {blocked!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
sys.meta_path.insert(0, _Block())
'''


def _cli_without(tmp_path: Path, blocked: set[str], *argv: str) -> subprocess.CompletedProcess[str]:
    """Run the CLI in a fresh interpreter where importing ``blocked`` packages fails, as after a
    plain ``pip install vramplan`` without extras."""
    (tmp_path / "sitecustomize.py").write_text(_BLOCKER.format(blocked=tuple(sorted(blocked))))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(SRC)])}
    code = "import sys; from vramplan.cli.main import main; sys.exit(main(sys.argv[1:]))"
    return subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True,
                          env=env, timeout=600, cwd=tmp_path)


def _one_line_error(err: str) -> str:
    lines = [ln for ln in err.strip().splitlines() if ln.strip()]
    assert "Traceback" not in err
    assert len(lines) == 1 and lines[0].startswith("error:"), err
    return lines[0]


NO_MODELS = {"transformers", "peft", "diffusers", "huggingface_hub"}


# --------------------------------------------------------------------------- item 1
def test_auto_falls_back_to_analytic_without_transformers(tmp_path):
    r = _cli_without(tmp_path, NO_MODELS, "estimate", "llama-3.1-8b", "--json")
    assert r.returncode == 0, r.stderr
    assert "Traceback" not in r.stderr
    assert "vramplan[models]" in r.stderr  # the note says what to install
    doc = json.loads(r.stdout)
    assert doc["method"] == "analytic"
    assert any("needs transformers" in n for n in doc["notes"])


def test_method_trace_without_transformers_is_one_line(tmp_path):
    r = _cli_without(tmp_path, NO_MODELS, "estimate", "llama-3.1-8b", "--method", "trace")
    assert r.returncode == 2
    assert "pip install 'vramplan[models]'" in _one_line_error(r.stderr)
    assert r.stdout == ""


def test_trace_only_model_without_transformers_is_one_line(tmp_path):
    r = _cli_without(tmp_path, NO_MODELS, "estimate", "resnet-50")
    assert r.returncode == 2
    line = _one_line_error(r.stderr)
    assert "needs transformers" in line and "vramplan[models]" in line


def test_lora_without_peft_falls_back_with_a_note(tmp_path):
    r = _cli_without(tmp_path, {"peft"}, "estimate", "gpt2", "--seq", "128", "--peft", "lora", "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["method"] == "analytic"
    assert "needs peft" in r.stderr and "vramplan[models]" in r.stderr


# --------------------------------------------------------------------------- item 12
def test_plot_without_matplotlib_fails_before_the_work(tmp_path):
    r = _cli_without(tmp_path, {"matplotlib"}, "estimate", "llama-3.1-8b", "--method", "analytic",
                     "--plot", str(tmp_path / "x.png"))
    assert r.returncode == 2
    assert r.stdout == ""  # no report printed before the failure
    assert "vramplan[plot]" in _one_line_error(r.stderr)


# --------------------------------------------------------------------------- item 5
def _config(tmp_path: Path, **changes: object) -> str:
    base = json.loads((SRC / "vramplan/models/configs/llama-3.1-8b.json").read_text())
    base.update(changes)
    p = tmp_path / "config.json"
    p.write_text(json.dumps(base, allow_nan=True))
    return str(p)


@pytest.mark.parametrize(("key", "value", "words"), [
    ("num_hidden_layers", 1_000_000_000, "out of range"),
    ("num_hidden_layers", 0, "at least 1"),
    ("hidden_size", float("nan"), "non-negative integer"),
    ("vocab_size", float("inf"), "non-negative integer"),
    ("num_attention_heads", -4, "non-negative integer"),
    ("hidden_size", "4096", "non-negative integer"),
    ("intermediate_size", 14336.5, "non-negative integer"),
    ("num_key_value_heads", 10**6, "out of range"),
    ("max_position_embeddings", 10**12, "out of range"),
])
@pytest.mark.parametrize("command", ["estimate", "models"])
def test_config_values_are_range_checked(tmp_path, capsys, key, value, words, command):
    argv = [command, _config(tmp_path, **{key: value})]
    if command == "estimate":
        argv += ["--method", "analytic"]
    assert main(argv) == 2
    line = _one_line_error(capsys.readouterr().err)
    assert f"'{key}'" in line and words in line


# --------------------------------------------------------------------------- item 7
def test_replay_of_a_folder_says_it_is_a_folder(tmp_path, capsys):
    assert main(["replay", str(tmp_path)]) == 2
    assert "Is a directory" in _one_line_error(capsys.readouterr().err)


@pytest.mark.parametrize("argv", [
    ["gpus", "--min-memory", "-5GB"],
    ["rules", "array", "--shape", "-1,5"],
    ["estimate", "gpt2", "--batch", "-3"],
])
def test_negative_values_get_the_flags_own_message(capsys, argv):
    try:
        rc = main(argv)
    except SystemExit as e:
        rc = int(e.code or 0)
    assert rc == 2
    line = _one_line_error(capsys.readouterr().err)
    assert "expected one argument" not in line
    assert argv[-1] in line
