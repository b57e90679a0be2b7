"""The estimate pipeline end to end: method choice, allocator replay, overhead, verdict."""

import json

import pytest
import torch

import vramplan
from vramplan.cli.main import main
from vramplan.engine import estimate
from vramplan.errors import TraceError, VramplanError, WorkloadError
from vramplan.trace.testing import tiny_spec
from vramplan.workload import Workload

PSI_8B = 8_030_261_248


def _json(capsys, argv):
    assert main(argv) == 0
    return json.loads(capsys.readouterr().out)


def _table(capsys, argv):
    assert main(argv) == 0
    return capsys.readouterr().out


def _invariants(r):
    assert r.breakdown.total == r.peak.allocated
    assert r.peak.reserved >= r.peak.allocated
    assert r.peak.device_used == r.peak.reserved + r.overhead_total
    assert all(o.source for o in r.overhead)
    assert r.peak_phase in {p.phase for p in r.phases}


def test_issue_done_when_16_bytes_per_param(capsys):
    d = _json(capsys, ["estimate", "llama-3.1-8b", "--task", "train", "--precision", "bf16-mixed",
                       "--optimizer", "adamw", "--method", "analytic", "--json"])
    b = d["breakdown"]
    states = b["weights"] + b["gradients"] + b["optimizer"]
    assert abs(states / (16 * PSI_8B) - 1) < 1e-3
    assert d["model_states"]["total"] == states
    assert set(b) == {"weights", "gradients", "optimizer", "activations", "temporaries", "kv_cache", "overhead"}
    assert d["peak"]["allocated"] <= d["peak"]["reserved"] <= d["peak"]["device_used"]
    assert d["method"] == "analytic" and d["peak_phase"] in ("forward", "backward", "optimizer")


def test_zero3_per_rank_states_are_an_eighth(capsys):
    d = _json(capsys, ["estimate", "llama-3.1-8b", "--task", "train", "--dp", "8", "--zero", "3", "--method",
                       "analytic", "--json"])
    assert abs(d["model_states"]["total"] / (2 * PSI_8B) - 1) < 1e-3


def test_untraced_layout_falls_back_to_analytic(capsys):
    # DeepSpeed's ZeRO-1 (the default engine for stage 1) is not traced: auto says it fell back
    d = _json(capsys, ["estimate", "llama-3.1-8b", "--task", "train", "--dp", "8", "--zero", "1", "--json"])
    assert d["method"] == "analytic"
    fb = d["fallback"]  # typed data, not a note
    assert fb["requested"] == "trace" and fb["used"] == "analytic" and fb["reason"]
    assert not any("estimate instead" in n for n in d["notes"])
    # the table shows it among the notes
    out = _table(capsys, ["estimate", "llama-3.1-8b", "--task", "train", "--dp", "8", "--zero", "1"])
    assert "trace method failed (" in out and "analytic estimate instead" in out


def test_cli_says_it_fell_back_from_the_typed_field(capsys):
    from vramplan.cli.main import main

    assert main(["estimate", "llama-3.1-8b", "--dp", "2", "--zero", "1", "--json"]) == 0
    assert "could not be traced; showing the analytic estimate" in capsys.readouterr().err
    assert main(["estimate", "llama-3.1-8b", "--dp", "2", "--zero", "1", "--method", "analytic", "--json"]) == 0
    assert "could not be traced" not in capsys.readouterr().err
    assert estimate("gpt2", seq=512, method="analytic").fallback is None


def test_gpu_verdict_and_max_batch_is_the_boundary():
    w = Workload(task="train", seq=1024, precision="bf16", optimizer="adamw-8bit", checkpointing="full")
    r = estimate("qwen2.5-0.5b", w, gpu="rtx-4060", method="analytic")
    _invariants(r)
    v = r.verdict
    assert v is not None and v.max_batch and v.max_batch > 1
    assert v.fits == (r.peak.device_used <= v.usable)
    at = estimate("qwen2.5-0.5b", w.replace(batch=v.max_batch), gpu="rtx-4060", method="analytic")
    above = estimate("qwen2.5-0.5b", w.replace(batch=v.max_batch + 1), gpu="rtx-4060", method="analytic")
    assert at.verdict.fits and not above.verdict.fits
    assert at.verdict.headroom >= 0 > above.verdict.headroom


def test_trace_method_on_a_tiny_model_replays_the_allocator():
    spec = tiny_spec("llama-3.1-8b")
    r = estimate(spec, Workload(task="train", batch=2, seq=64), gpu="a100-sxm4-80gb", method="trace")
    _invariants(r)
    assert r.method.value == "trace"
    assert r.allocator is not None and r.allocator.backend == "native" and r.allocator.segments > 0
    assert r.events is not None and len(r.events) > 0
    assert r.timeline is not None and len(r.timeline.reserved) == len(r.timeline.index)
    assert max(r.timeline.reserved) == r.peak.reserved
    # the reserved curve equals a full per-event replay timeline at every plotted point
    from vramplan.allocator import replay

    full = replay(r.events, record_timeline=True, full_timeline=True).timeline
    assert r.timeline.reserved == tuple(full.reserved[i] for i in r.timeline.index)
    assert [i.iteration for i in r.iterations][:2] == [1, 2]
    # the allocator conf changes reserved, never allocated
    r2 = estimate(spec, Workload(task="train", batch=2, seq=64), method="trace",
                  alloc_conf="expandable_segments:True")
    assert r2.peak.allocated == r.peak.allocated and r2.peak.reserved <= r.peak.reserved


def test_trace_and_analytic_agree_on_model_states():
    spec = tiny_spec("qwen2.5-0.5b")
    w = Workload(task="train", batch=2, seq=64)
    t = estimate(spec, w, method="trace")
    a = estimate(spec, w, method="analytic")
    # buffers (rotary inv_freq) exist only in the real model: at most a few KiB apart
    assert abs(t.model_states.total - a.model_states.total) <= 4096
    assert t.model_states.gradients == a.model_states.gradients
    assert t.model_states.optimizer == a.model_states.optimizer


def test_method_trace_does_not_fall_back():
    with pytest.raises(TraceError):
        estimate("llama-3.1-8b", Workload(task="train", parallel=vramplan.Parallel(dp=8, zero=1)), method="trace")


def test_cnn_has_no_analytic_fallback():
    with pytest.raises(VramplanError, match="trace"):
        estimate("resnet-50", Workload(task="train", batch=2), method="analytic")


def test_root_api_names_are_plain_functions_even_after_importing_the_subpackages():
    import inspect
    import subprocess
    import sys

    code = ("import inspect, vramplan, vramplan.trace.run, vramplan.measure.step\n"
            "from vramplan.trace import run\n"
            "assert run.trace_model and inspect.isfunction(vramplan.trace) and inspect.isfunction(vramplan.measure)\n"
            "assert inspect.isfunction(vramplan.estimate) and vramplan.trace.__module__ == 'vramplan.engine.user_model'\n"
            "assert not callable(sys.modules['vramplan.trace']) and not callable(sys.modules['vramplan.measure'])\n"
            "assert 'vramplan.planner' not in sys.modules\n")
    subprocess.run([sys.executable, "-c", "import sys\n" + code], check=True)
    assert inspect.isfunction(vramplan.trace) and inspect.isfunction(vramplan.measure)


def test_user_module_api_is_a_function():
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    r = vramplan.trace(model, torch.randn(16, 32), task="train", precision="fp32",
                       optimizer=lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9), gpu="l4")
    _invariants(r)
    params = sum(p.numel() for p in model.parameters())
    assert r.params == params
    assert r.model_states.weights == 4 * params and r.model_states.optimizer == 4 * params
    assert r.verdict is not None and r.verdict.fits


@pytest.mark.parametrize("argv,match", [
    (["estimate", "llama-3.1-8bb"], "did you mean"),
    (["estimate", "llama-3.1-8b", "--gpu", "h1000"], "did you mean"),
    (["estimate", "llama-3.1-8b", "--batch", "0"], "--batch"),
    (["estimate", "llama-3.1-8b", "--tp", "3", "--method", "analytic"], "--tp 3"),
    (["estimate", "llama-3.1-8b", "--peft", "qlora", "--precision", "fp32"], "QLoRA"),
    (["estimate", "llama-3.1-8b", "--alloc-conf", "max_split_size_mb:abc"], "max_split_size_mb"),
    (["estimate", "llama-3.1-8b", "--method", "analytic", "--snapshot", "x.pickle"], "--method trace"),
])
def test_bad_input_is_one_line_exit_2(capsys, argv, match):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error:") and "\n" not in err and "Traceback" not in err
    assert match in err


def test_malformed_config_file(tmp_path, capsys):
    bad = tmp_path / "config.json"
    bad.write_text("{not json")
    assert main(["estimate", str(bad)]) == 2
    assert str(bad) in capsys.readouterr().err


def test_local_config_path_is_accepted(tmp_path, capsys):
    from vramplan.models.catalog import resolve

    cfg = dict(resolve("qwen2.5-0.5b").config)
    p = tmp_path / "config.json"
    p.write_text(json.dumps(cfg))
    d = _json(capsys, ["estimate", str(p), "--method", "analytic", "--json"])
    assert d["params"] == 494_032_768


def test_markdown_and_table_formats(capsys):
    assert main(["estimate", "gpt2", "--seq", "512", "--method", "analytic", "--gpu", "t4", "--format", "markdown"]) == 0
    md = capsys.readouterr().out
    assert md.startswith("### vramplan estimate: gpt2") and "| = device used (nvidia-smi) |" not in md
    assert "**= device used (nvidia-smi)**" in md
    assert main(["estimate", "gpt2", "--seq", "512", "--method", "analytic", "--gpu", "t4"]) == 0
    assert "verdict" in capsys.readouterr().out


def test_snapshot_export_from_estimate(tmp_path, capsys):
    from vramplan.snapshot.reader import load_snapshot

    cfg = tiny_spec("gpt2").config
    p = tmp_path / "config.json"
    p.write_text(json.dumps(dict(cfg)))
    out = tmp_path / "pred.pickle"
    assert main(["estimate", str(p), "--method", "trace", "--seq", "32", "--snapshot", str(out), "--json"]) == 0
    snap = load_snapshot(out)
    actions = {e["action"] for e in snap["device_traces"][0]}
    assert {"alloc", "free_completed", "segment_alloc"} <= actions


def test_workload_error_type():
    with pytest.raises(WorkloadError):
        estimate("llama-3.1-8b", Workload(), tp=3, method="analytic")


@pytest.mark.parametrize("suffix", [".png", ".svg", ".html"])
def test_estimate_and_trace_plot_from_the_cli(tmp_path, capsys, suffix):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(dict(tiny_spec("llama-3.1-8b").config)))
    out = tmp_path / f"est{suffix}"
    assert main(["estimate", str(cfg), "--method", "trace", "--seq", "64", "--gpu", "l4",
                 "--plot", str(out), "--json"]) == 0
    assert out.stat().st_size > 1000
    user = tmp_path / "user.py"
    user.write_text(
        "import torch\n"
        "def make():\n"
        "    m = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 2))\n"
        "    y = torch.randint(0, 2, (8,))\n"
        "    return m, torch.randn(8, 16), lambda out: torch.nn.functional.cross_entropy(out, y)\n"
    )
    out2 = tmp_path / f"trace{suffix}"
    assert main(["trace", f"{user}:make", "--precision", "fp32", "--plot", str(out2), "--json"]) == 0
    assert out2.stat().st_size > 1000


def test_trace_cli_bad_factories(tmp_path, capsys):
    f = tmp_path / "bad.py"
    f.write_text("def boom():\n    raise ValueError('nope')\ndef wrong():\n    return 42\n")
    for target, match in ((f"{f}:boom", "ValueError: nope"), (f"{f}:wrong", "must return"),
                          (f"{f}:missing", "no function"), ("nofile.py:make", "no such file"),
                          ("justaname", "FILE.py:FUNC")):
        assert main(["trace", target]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("error:") and "\n" not in err and match in err, err
