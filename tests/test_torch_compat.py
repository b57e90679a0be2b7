"""A trace the installed torch cannot run says so: ``--method trace`` exits 2 with one line
naming the torch version, the module and the op; ``auto`` answers analytically and says why."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from vramplan.cli.main import main
from vramplan.trace.testing import tiny_spec


def _config(tmp_path: Path) -> str:
    p = tmp_path / "config.json"
    p.write_text(json.dumps(dict(tiny_spec("llama-3.1-8b").config)))
    return str(p)


def _unsupported(*args: object, **kwargs: object) -> torch.Tensor:
    raise RuntimeError("silu is not implemented for this build")


def test_method_trace_exits_2_naming_the_torch_version_and_the_op(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(F, "silu", _unsupported)
    rc = main(["estimate", _config(tmp_path), "--task", "train", "--seq", "32", "--checkpointing", "full",
               "--method", "trace"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and "\n" not in err and "Traceback" not in err
    assert f"on torch {torch.__version__}" in err and "(last op aten." in err and "mlp" in err


def test_auto_falls_back_and_says_so(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(F, "silu", _unsupported)
    rc = main(["estimate", _config(tmp_path), "--task", "train", "--seq", "32", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0 and out["method"] == "analytic"
    assert f"on torch {torch.__version__}" in out["fallback"]["reason"]  # typed, not a note


def test_checkpoint_without_known_internals_is_refused_by_name(tmp_path, capsys, monkeypatch):
    import torch.utils.checkpoint as ckpt

    for name in ("_checkpoint_without_reentrant_generator", "_checkpoint_without_reentrant_generator_impl"):
        monkeypatch.delattr(ckpt, name, raising=False)
    rc = main(["estimate", _config(tmp_path), "--task", "train", "--seq", "32", "--checkpointing", "full",
               "--method", "trace"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and f"torch {torch.__version__}" in err and "\n" not in err


@pytest.mark.parametrize("checkpointing", ["full", "selective"])
def test_checkpointed_train_is_traced(tmp_path, capsys, checkpointing):
    """The case issue 19 found falling back on torch 2.14: checkpoint recompute must trace."""
    rc = main(["estimate", _config(tmp_path), "--task", "train", "--seq", "32", "--peft", "lora",
               "--checkpointing", checkpointing, "--json"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0 and out["method"] == "trace", out["notes"]
