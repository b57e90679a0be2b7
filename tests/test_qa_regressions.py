"""Regressions from a QA pass over every command with good and bad input.

Each user mistake must end as exit code 2 with one ``error:`` line naming the fix (never a
traceback, never exit 0 with a silently wrong or empty answer). Fast: analytic method or
tiny models only.
"""

from __future__ import annotations

import io
import json
import pickle
from pathlib import Path

import pytest
import torch
from torch import nn

import vramplan
from vramplan.cli.main import main
from vramplan.errors import ConfigError, PlanError, TraceError, VramplanError, WorkloadError


def _err(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    """Run the CLI expecting a user error: exit 2 and one ``error:`` line, which is returned."""
    try:
        code = main(argv)
    except SystemExit as e:  # argparse's usage errors
        code = e.code
    assert code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error:") and "\n" not in err and "Traceback" not in err, err
    return err


def _write(path: Path, text: str) -> str:
    path.write_text(text)
    return str(path)


# --------------------------------------------------------------------------- models / configs
def test_models_table_keeps_an_exact_published_count_whole(capsys):
    assert main(["models", "--family", "other", "--format", "markdown"]) == 0
    row = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("| resnet-50 "))
    assert row.count("25,557,032") == 2  # exact and published, not "25"


def test_config_hidden_not_a_multiple_of_heads_is_a_config_error(tmp_path, capsys):
    cfg = _write(tmp_path / "config.json", json.dumps({
        "model_type": "llama", "hidden_size": 4096, "num_hidden_layers": 2, "num_attention_heads": 30,
        "intermediate_size": 11008, "vocab_size": 1000}))
    assert "not a multiple of num_attention_heads 30" in _err(capsys, ["estimate", cfg, "--method", "analytic"])
    assert "not a multiple" in _err(capsys, ["estimate", cfg])  # the trace path too (was a traceback)


def test_config_heads_not_a_multiple_of_kv_heads_is_a_config_error(tmp_path):
    cfg = _write(tmp_path / "config.json", json.dumps({
        "model_type": "llama", "hidden_size": 512, "num_hidden_layers": 2, "num_attention_heads": 8,
        "num_key_value_heads": 3, "intermediate_size": 1024, "vocab_size": 1000}))
    with pytest.raises(ConfigError, match="num_key_value_heads 3"):
        vramplan.estimate(cfg, method="analytic")


def test_config_transformers_cannot_build_is_a_trace_error_not_a_traceback(tmp_path):
    cfg = _write(tmp_path / "config.json", json.dumps({
        "model_type": "llama", "hidden_size": 64, "num_hidden_layers": 1, "num_attention_heads": 4,
        "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 100, "hidden_act": "bogus"}))
    with pytest.raises(TraceError, match="KeyError"):
        vramplan.estimate(cfg, method="trace", seq=16)


# --------------------------------------------------------------------------- workload checks
def test_tp_hint_suggests_only_sizes_that_divide_every_split(capsys):
    err = _err(capsys, ["estimate", "llama-3.1-8b", "--tp", "3", "--method", "analytic"])
    assert err.endswith("(use 1, 2, 4, 8)")  # 16 and 32 divide the heads but not the 8 KV heads


def test_ep_error_names_the_fix(capsys):
    assert "use --dp 2" in _err(capsys, ["estimate", "mixtral-8x7b", "--ep", "2", "--method", "analytic"])


def test_generate_with_a_model_that_takes_no_tokens(capsys):
    with pytest.raises(WorkloadError, match="does not generate text"):
        vramplan.estimate("resnet-50", task="generate")  # refused before any trace
    assert "is a vit model" in _err(capsys, ["estimate", "vit-base", "--task", "generate"])


def test_learned_positions_hint_counts_the_new_tokens(capsys):
    err = _err(capsys, ["estimate", "gpt2", "--task", "generate", "--seq", "8", "--new-tokens", "1024",
                        "--method", "analytic"])
    assert "keep --seq + --new-tokens at 1024 or less" in err


def test_seq_beyond_rope_positions_is_noted():
    r = vramplan.estimate("llama-3.1-8b", method="analytic", seq=200_000)
    assert any("exceed the 131,072 positions" in n for n in r.notes)


def test_bf16_on_a_gpu_without_bf16_is_noted():
    r = vramplan.estimate("gpt2", method="analytic", seq=256, gpu="t4")
    assert any("no native bf16" in n and "counts attention as eager" in n for n in r.notes)
    # ... and the figure follows: the math path materialises the scores, as eager does
    eager = vramplan.estimate("gpt2", method="analytic", seq=1024, batch=8, attention="eager")
    on_a100 = vramplan.estimate("gpt2", method="analytic", seq=1024, batch=8, gpu="a100-sxm4-80gb")
    t4 = vramplan.estimate("gpt2", method="analytic", seq=1024, batch=8, gpu="t4")
    assert t4.peak.allocated == eager.peak.allocated > on_a100.peak.allocated
    r = vramplan.estimate("gpt2", method="analytic", seq=256, gpu="t4", precision="fp16-mixed")
    assert not any("no native bf16" in n for n in r.notes)


def test_alloc_conf_with_analytic_is_noted():
    r = vramplan.estimate("gpt2", method="analytic", seq=256, alloc_conf="expandable_segments:True")
    assert any("not simulated by the analytic method" in n for n in r.notes)


# --------------------------------------------------------------------------- fit / plan
def test_fit_new_tokens_leave_too_few_prompt_positions(capsys):
    err = _err(capsys, ["fit", "gpt2", "--gpu", "a100-80gb", "--task", "generate", "--new-tokens", "1000",
                        "--seq", "8", "--method", "analytic"])  # was a ValueError traceback
    assert "leaves 24 for the prompt" in err and "--seq-step 24" in err


def test_fit_seq_step_beyond_positions_names_seq_step(capsys):
    err = _err(capsys, ["fit", "llama-3.2-1b", "--gpu", "a100-80gb", "--seq-step", "100000000",
                        "--method", "analytic"])
    assert "use --seq-step 131072 or less" in err


def test_fit_without_a_sequence_axis_says_image_size(capsys):
    assert main(["fit", "vit-base", "--gpu", "t4", "--method", "analytic"]) == 0
    out = capsys.readouterr().out
    assert "(at image size 224)" in out and "at seq" not in out


def test_emit_training_config_for_inference_is_refused(capsys):
    err = _err(capsys, ["plan", "gpt2", "--seq", "256", "--gpu", "t4", "--task", "infer", "--method", "analytic",
                        "--emit", "deepspeed"])
    assert "training configuration" in err and "--emit alloc-conf" in err
    assert main(["plan", "gpt2", "--seq", "256", "--gpu", "t4", "--task", "infer", "--method", "analytic",
                 "--emit", "alloc-conf"]) == 0


# --------------------------------------------------------------------------- plots / output paths
def test_plot_to_a_folder_or_unwritable_path(tmp_path, capsys, monkeypatch):
    folder = tmp_path / "out.png"
    folder.mkdir()
    assert "it is a folder" in _err(capsys, ["estimate", "gpt2", "--seq", "128", "--method", "analytic",
                                             "--plot", str(folder)])
    from vramplan.report import plot

    def refuse(*a, **k):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(plot, "_write", refuse)
    err = _err(capsys, ["fit", "gpt2", "--gpu", "a100-80gb", "--seq", "256", "--method", "analytic",
                        "--plot", str(tmp_path / "fit.png")])
    assert "Permission denied" in err


def test_snapshot_path_is_checked_before_the_trace(tmp_path, capsys):
    assert "it is a folder" in _err(capsys, ["estimate", "gpt2", "--seq", "128", "--snapshot", str(tmp_path)])
    assert "needs an event trace" in _err(capsys, ["estimate", "gpt2", "--seq", "128", "--method", "analytic",
                                                   "--snapshot", str(tmp_path / "x.pickle")])


def test_closed_pipe_is_not_an_error(monkeypatch):
    class Closed(io.StringIO):
        def write(self, s: str) -> int:
            raise BrokenPipeError

    monkeypatch.setattr("sys.stdout", Closed())
    assert main(["gpus"]) == 0  # rich used to turn the broken pipe into exit status 1


# --------------------------------------------------------------------------- sizes and rules
@pytest.mark.parametrize("argv", [["gpus", "--min-memory", "24"], ["gpus", "--min-memory", "nan"],
                                  ["rules", "render", "--width", "64", "--height", "64", "--textures", "4"]])
def test_size_without_a_unit_is_refused(capsys, argv):
    assert "GiB" in _err(capsys, argv)


def test_size_zero_needs_no_unit(capsys):
    assert main(["gpus", "--min-memory", "0", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["gpus"]


def test_array_shape_with_an_empty_dimension(capsys):
    assert "empty dimension" in _err(capsys, ["rules", "array", "--shape", "5,,5"])
    assert main(["rules", "array", "--shape", "4096, 4096", "--json"]) == 0


def test_one_nvenc_engine_shares(capsys):
    assert main(["rules", "video", "--codec", "h264", "--gpu", "rtx-3090"]) == 0
    assert "1 NVENC engine shares" in capsys.readouterr().out


# --------------------------------------------------------------------------- replay / snapshot
@pytest.mark.parametrize("text,match", [
    ('{"action":"alloc","id":1,"size":1.5}', "got size="),
    ('{"action":"alloc","id":1,"size":true}', "got size="),
    ('{"action":"alloc","id":1,"size":Infinity}', "got size="),
    ('{"action":"alloc","id":1,"size":100,"iteration":"x"}', "got iteration='x'"),
    ('{"action":"alloc","id":1,"size":1e30}', "out of range"),
    ('{"action":"alloc","size":100}', 'needs an "id"'),
    ('{"action":"alloc","id":1}', 'needs a "size"'),
    ("", "no events"),
])
def test_malformed_event_lines(tmp_path, capsys, text, match):
    assert match in _err(capsys, ["replay", _write(tmp_path / "ev.jsonl", text + "\n")])


def test_binary_event_file(tmp_path, capsys):
    f = tmp_path / "ev.jsonl"
    f.write_bytes(bytes(range(128, 256)))
    assert "not a UTF-8 text file" in _err(capsys, ["replay", str(f)])


def test_address_space_exhaustion_is_a_user_error(tmp_path, capsys):
    f = _write(tmp_path / "ev.jsonl", '{"action":"alloc","id":1,"size":9000000000000000000}\n')
    assert "more memory than any GPU has" in _err(capsys, ["replay", f])  # was a MemoryError traceback


def _snapshot(tmp_path: Path, snap: dict) -> str:
    p = tmp_path / "s.pickle"
    p.write_bytes(pickle.dumps(snap))
    return str(p)


def test_replay_of_a_device_the_snapshot_lacks(tmp_path, capsys):
    seg = {"device": 0, "address": 1 << 32, "total_size": 2 << 20, "allocated_size": 0, "active_size": 0,
           "requested_size": 0, "stream": 0, "segment_type": "small", "segment_pool_id": (0, 0),
           "is_expandable": False, "frames": [],
           "blocks": [{"address": 1 << 32, "size": 2 << 20, "requested_size": 0, "state": "inactive", "frames": []}]}
    path = _snapshot(tmp_path, {"segments": [seg], "device_traces": [[]]})
    assert "no data for device 3" in _err(capsys, ["replay", path, "--device", "3"])


def test_empty_snapshot_is_not_an_all_zero_report(tmp_path, capsys):
    path = _snapshot(tmp_path, {"segments": [], "device_traces": []})
    assert "no segments and no allocation history" in _err(capsys, ["snapshot", path])
    assert "no data for device 0" in _err(capsys, ["replay", path])


# --------------------------------------------------------------------------- vramplan trace
_FACTORIES = '''
import sys
import torch
from torch import nn

def make():
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16)), torch.randn(4, 16)

def other():
    return make()
'''


def test_trace_target_mistakes(tmp_path, capsys):
    f = _write(tmp_path / "m.py", _FACTORIES)
    assert "is a directory" in _err(capsys, ["trace", f"{tmp_path}:make"])
    assert "functions defined there: make, other" in _err(capsys, ["trace", f"{f}:nope"])
    exits = _write(tmp_path / "exits.py", "import sys\nsys.exit(3)\n")
    assert "SystemExit: 3" in _err(capsys, ["trace", f"{exits}:make"])  # was a silent exit 3


@pytest.mark.parametrize("flags,match", [(["--batch", "8"], "--batch 8 does not apply"),
                                         (["--seq", "64", "--image-size", "32"], "do not apply"),
                                         (["--method", "analytic"], "always traces")])
def test_trace_refuses_flags_it_would_ignore(tmp_path, capsys, flags, match):
    f = _write(tmp_path / "m.py", _FACTORIES)
    assert match in _err(capsys, ["trace", f"{f}:make", *flags])


def test_trace_lora_without_matching_targets_lists_the_linears(tmp_path, capsys):
    f = _write(tmp_path / "m.py", _FACTORIES)
    assert "some of: 0, 2, or all-linear" in _err(capsys, ["trace", f"{f}:make", "--peft", "lora"])


class _NoCache(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb, self.head = nn.Embedding(50, 8), nn.Linear(8, 50)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.emb(input_ids))


def test_generate_needs_token_ids_and_a_cache_taking_forward():
    with pytest.raises(TraceError, match="token ids"):
        vramplan.trace(nn.Linear(8, 8), torch.randn(2, 8), task="generate", new_tokens=2)
    with pytest.raises(TraceError, match="takes use_cache and past_key_values"):
        vramplan.trace(_NoCache(), torch.randint(0, 50, (1, 4)), task="generate", new_tokens=2)


def test_generate_past_learned_positions_of_a_user_model():
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=16, bos_token_id=0, eos_token_id=0)
    with pytest.raises(TraceError, match="exceed the model's 16 learned positions"):
        vramplan.trace(GPT2LMHeadModel(cfg), {"input_ids": torch.randint(0, 64, (1, 8))}, task="generate",
                       new_tokens=12)


def test_errors_are_vramplan_errors():
    # the classes the CLI turns into exit code 2
    for cls in (ConfigError, PlanError, TraceError, WorkloadError):
        assert issubclass(cls, VramplanError)
