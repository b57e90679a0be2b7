"""Issue 29: defects a new user (or an adversary) met at the command line. Each test runs where
the user met the defect: ``vramplan.cli.main.main(argv)`` (or the console script in a process),
its exit code, stdout and stderr."""

from __future__ import annotations

import argparse
import ast
import dataclasses
import gzip
import json
import os
import pickle
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from vramplan.cli.main import main

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src"
RECORDED = ROOT / "tests" / "data" / "snapshots" / "decomfl_memory.pickle.gz"


def _run(argv: list[str]) -> int:
    try:
        return main(argv)
    except SystemExit as e:  # argparse
        return int(e.code or 0)


_PROGRESS = re.compile(r"vramplan \w+: .* · \d+ s · ")
"""A progress line (``vramplan trace: runaway.py:grow · 5 s · 1.69 GiB RAM (stops at …)``)."""


def _one_line_error(err: str) -> str:
    # (a trace that runs past 5 s, as on a loaded machine, shows progress lines first: they are not the error)
    lines = [ln for ln in err.strip().splitlines() if ln.strip() and not _PROGRESS.match(ln)]
    assert "Traceback" not in err
    assert len(lines) == 1 and lines[0].startswith("error:"), err
    return lines[0]


def _error(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    """Run ``argv``; it must fail with exit 2, one line on stderr and nothing on stdout."""
    assert _run(argv) == 2
    out = capsys.readouterr()
    assert out.out == ""
    return _one_line_error(out.err)


def _snapshot(entries: list[dict[str, object]]) -> dict[str, object]:
    return {"segments": [], "device_traces": [entries]}


def _write(path: Path, snap: object, form: str) -> Path:
    if form == "json":
        path.write_text(json.dumps(snap))
    elif form == "pickle":
        path.write_bytes(pickle.dumps(snap))
    else:
        path.write_bytes(gzip.compress(pickle.dumps(snap)))
    return path


# --------------------------------------------------------------------------- item 1: tracebacks
@pytest.mark.parametrize("form", ["json", "pickle", "gzip"])
@pytest.mark.parametrize("command", ["snapshot", "replay"])
def test_a_trace_entry_of_10_to_the_30_bytes_is_one_line(tmp_path, capsys, form, command):
    snap = _snapshot([{"action": "segment_alloc", "addr": 0, "size": 2 << 20, "stream": 0},
                      {"action": "alloc", "addr": 0, "size": 10**30, "stream": 0}])
    line = _error(capsys, [command, str(_write(tmp_path / "snap", snap, form))])
    assert "device_traces[0][1]" in line and "out of range" in line


@pytest.mark.parametrize("command", ["snapshot", "replay"])
def test_an_address_beyond_64_bits_is_one_line(tmp_path, capsys, command):
    snap = _snapshot([{"action": "alloc", "addr": 1 << 70, "size": 512, "stream": 0}])
    line = _error(capsys, [command, str(_write(tmp_path / "snap", snap, "json"))])
    assert "'addr' is not a device address" in line


@pytest.mark.parametrize("command", ["snapshot", "replay"])
def test_deeply_nested_json_is_one_line(tmp_path, capsys, command):
    p = tmp_path / "deep.json"
    p.write_text('{"segments":' + "[" * 20_000 + "]" * 20_000 + "}")  # < 64 KiB: replay sniffs it whole
    line = _error(capsys, [command, str(p)])
    assert "RecursionError" in line and "not a readable JSON snapshot" in line


@pytest.mark.parametrize("suffix", [".json", ".yaml", ".toml", ".py"])
def test_a_layout_file_that_is_not_utf8_is_one_line(tmp_path, capsys, suffix):
    p = tmp_path / f"layout{suffix}"
    p.write_bytes(b"\xff\xfe" + "zero_optimization = 3\n".encode("utf-16-le"))
    line = _error(capsys, ["estimate", "gpt2", "--method", "analytic", "--layout", str(p)])
    assert "is not UTF-8 text" in line and "--emit" in line


# --------------------------------------------------------------------------- item 2: negative sizes
def _recorded() -> dict[str, object]:
    return pickle.loads(gzip.decompress(RECORDED.read_bytes()))


@pytest.mark.parametrize("command", ["snapshot", "replay"])
def test_a_negative_size_in_a_recorded_snapshot_is_refused(tmp_path, capsys, command):
    snap = _recorded()
    trace = snap["device_traces"][0]
    k = next(i for i, e in enumerate(trace) if e["action"] == "alloc" and e["size"] > 1 << 20)
    trace[k] = {**trace[k], "size": -trace[k]["size"]}  # lowered the peak when it was accepted
    line = _error(capsys, [command, str(_write(tmp_path / "neg.pickle", snap, "pickle"))])
    assert f"device_traces[0][{k}]" in line and "alloc size must be >= 0" in line


def test_the_recorded_snapshot_still_replays(capsys):
    assert main(["replay", str(RECORDED), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["comparison"]["match"] is True


def test_a_negative_block_size_is_refused(tmp_path, capsys):
    snap = {"segments": [{"total_size": 2 << 20, "address": 0, "blocks": [{"size": -1, "state": "active_allocated"}]}],
            "device_traces": []}
    line = _error(capsys, ["snapshot", str(_write(tmp_path / "s.json", snap, "json"))])
    assert "segments[0].blocks[0]" in line and "not a size in bytes" in line


# --------------------------------------------------------------------------- item 3: gzip bomb
def test_a_gzip_bomb_is_refused_before_it_is_inflated(tmp_path, capsys):
    bomb = tmp_path / "bomb.pickle.gz"
    with gzip.open(bomb, "wb", compresslevel=9) as f:  # 1 GiB of zeros in ~1 MB
        chunk = bytes(1 << 24)
        for _ in range(64):
            f.write(chunk)
    assert bomb.stat().st_size < 2 << 20
    line, peak = _peak_of(capsys, ["snapshot", str(bomb)])
    assert "does not hold a memory snapshot" in line
    assert peak < 64 << 20  # it was inflated to 1 GiB before the error


def _peak_of(capsys: pytest.CaptureFixture[str], argv: list[str]) -> tuple[str, int]:
    import tracemalloc

    tracemalloc.start()
    try:
        line = _error(capsys, argv)
        return line, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_a_gzip_bomb_that_starts_as_a_pickle_stops_at_its_first_bad_byte(tmp_path, capsys):
    bomb = tmp_path / "bomb.gz"
    with gzip.open(bomb, "wb", compresslevel=9) as f:  # a pickle header, then 1 GiB of zeros
        f.write(b"\x80\x04")
        chunk = bytes(1 << 24)
        for _ in range(64):
            f.write(chunk)
    line, peak = _peak_of(capsys, ["replay", str(bomb)])
    assert "not a readable pickle" in line
    assert peak < 16 << 20


def test_a_gzip_bomb_of_valid_json_is_capped(tmp_path, capsys):
    from vramplan.snapshot import reader

    bomb = tmp_path / "bomb.json.gz"
    with gzip.open(bomb, "wb", compresslevel=9) as f:  # a JSON snapshot with a 512 MiB string
        f.write(b'{"segments": [], "pad": "')
        chunk = b"a" * (1 << 24)
        for _ in range(32):
            f.write(chunk)
        f.write(b'"}')
    size = bomb.stat().st_size
    line, peak = _peak_of(capsys, ["snapshot", str(bomb)])
    assert f"inflates more than {reader.MAX_RATIO}×" in line and "gunzip" in line
    assert peak < 2 * reader.MAX_RATIO * size + (16 << 20) < 512 << 20  # not inflated whole


# --------------------------------------------------------------------------- item 4: files that exist
@pytest.mark.parametrize(("argv", "words"), [
    (["replay", "/dev/zero"], "is a character device, not a file"),
    (["snapshot", "/dev/zero"], "is a character device, not a file"),
    (["estimate", "/dev/null"], "not a regular file"),
])
def test_a_device_is_not_called_a_missing_file(capsys, argv, words):
    if not Path(argv[1]).exists():
        pytest.skip(f"no {argv[1]} here")
    line = _error(capsys, argv)
    assert words in line and "no such file" not in line


def test_a_missing_file_is_still_called_missing(tmp_path, capsys):
    assert "no such file" in _error(capsys, ["replay", str(tmp_path / "nope.jsonl")])
    assert "no such file" in _error(capsys, ["estimate", str(tmp_path / "nope.json")])


# --------------------------------------------------------------------------- item 1: Ctrl-C on web
def test_ctrl_c_on_web_prints_no_worker_traceback():
    pytest.importorskip("uvicorn", reason="the web extra is not installed")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    proc = subprocess.Popen([sys.executable, "-m", "vramplan.cli.main", "web", "--port", str(port), "--workers", "2"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)  # its own group, as a terminal's foreground job
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/status", timeout=2) as r:  # noqa: S310
                    if json.loads(r.read())["warmed"] >= 2:
                        break
            except OSError:
                time.sleep(0.3)
        else:
            raise AssertionError("vramplan web did not start")
        os.killpg(proc.pid, signal.SIGINT)  # what Ctrl+C does: the server and its workers
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    assert proc.returncode == 0


# --------------------------------------------------------------------------- item 2: silently wrong figures
@pytest.mark.parametrize("sizes", ["-1", "0", "8,0,16"])
def test_cuda_graph_sizes_must_be_positive(capsys, sizes):
    line = _error(capsys, ["serve-plan", "llama-3.1-8b", "--gpu", "h100", "--cuda-graph-sizes", sizes])
    assert "--cuda-graph-sizes" in line and "each >= 1" in line and "--enforce-eager" in line


@pytest.mark.parametrize("budget", ["nan", "inf", "-inf", "-1", "0"])
@pytest.mark.parametrize("where", [["--gpu", "h100"], ["--rank-gpus"]])
def test_plan_budget_must_be_a_finite_positive_number(capsys, budget, where):
    line = _error(capsys, ["plan", "gpt2", *where, "--budget", budget, "--method", "analytic"])
    assert "--budget must be a positive, finite number" in line


def test_rules_array_working_set_is_exact(capsys):
    from fractions import Fraction
    from math import ceil

    shape = (1_000_000_007, 1_000_000_009, 3)
    assert main(["rules", "array", "--shape", ",".join(map(str, shape)), "--working-set", "2.5",
                 "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    array = shape[0] * shape[1] * shape[2] * 4
    assert doc["array_bytes"] == array
    assert doc["needed_bytes"] == array * 5 // 2 == 30_000_000_480_000_001_890  # float: ...000,000,000
    assert f"× 2.5 = {array * 5 // 2:,} B" in doc["steps"][2]["formula"]
    assert main(["rules", "array", "--shape", ",".join(map(str, shape)), "--working-set", "0.1", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["needed_bytes"] == ceil(array * Fraction(1, 10))


def _serve(capsys, *argv: str) -> tuple[str, dict[str, object]]:
    assert main(["serve-plan", "llama-3.1-8b", *argv]) == 0
    table = capsys.readouterr().out
    assert main(["serve-plan", "llama-3.1-8b", *argv, "--json"]) == 0
    return table, json.loads(capsys.readouterr().out)


def _resident(doc) -> int:
    """The rows held after start-up: the profile's peak stays cached, except under 0.34's extensible
    KV cache (sized after empty_cache(); the peak is then part of what it keeps free)."""
    peak = 0 if doc["kv_reserve"] else doc["profile_peak"]
    return doc["context"] + doc["weights"] + doc["runner_buffers"] + peak + doc["non_torch"]


@pytest.mark.parametrize("version", ["0.10.1.1", "0.34.0"])
def test_a_vllm_pool_that_is_never_allocated_is_not_shown_as_blocks(capsys, version):
    table, doc = _serve(capsys, "--gpu", "l4", "--engine-version", version)
    assert doc["starts"] is False and doc["kv_pool"] == 0
    row = next(ln for ln in table.splitlines() if "KV-cache pool" in ln)
    assert "0.00" not in row and "not allocated: vLLM stops first" in row
    # the rows add up to the footer: no pool and no graphs in the device used
    assert doc["cuda_graph"] == 0 and doc["device_used"] == _resident(doc)
    assert "What it would mean for users, had it started" in table


@pytest.mark.parametrize("version, block", [("0.10.1.1", 16), ("0.34.0", 64)])
def test_a_vllm_pool_that_starts_is_unchanged(capsys, version, block):
    table, doc = _serve(capsys, "--gpu", "h100", "--engine-version", version)
    assert doc["starts"] is True and doc["kv_pool"] > 0 and doc["cuda_graph"] > 0
    row = next(ln for ln in table.splitlines() if "KV-cache pool" in ln)
    assert f"{doc['blocks']:,} blocks × {block} tokens" in row and "not allocated" not in row
    assert doc["device_used"] == _resident(doc) + doc["kv_pool"] + doc["cuda_graph"]


# --------------------------------------------------------------------------- item 4: misleading messages
def test_cheapest_suggests_flags_that_exist(capsys):
    line = _error(capsys, ["serve-plan", "llama-3.1-405b", "--cheapest", "--concurrency", "1000",
                           "--context", "131072"])
    assert "--tps" not in line
    assert "--concurrency" in line and "--quantization fp8" in line and "--kv-cache-dtype fp8" in line


@pytest.mark.parametrize("argv", [
    ["rules", "render", "--width", "64", "--height", "64", "--json", "--format", "markdown"],
    ["rules", "render", "--width", "64", "--height", "64", "--format", "markdown", "--json"],
    ["rules", "array", "--shape", "4,4", "--json", "--format", "markdown"],
    ["rules", "bandwidth", "--bus", "384", "--rate", "21", "--format", "table", "--json"],
    ["estimate", "gpt2", "--json", "--format", "markdown"],  # what the others did already
])
def test_json_and_another_format_contradict_everywhere(capsys, argv):
    assert "contradicts" in _error(capsys, argv)


def test_rules_render_still_takes_a_pixel_format_with_json(capsys):
    assert main(["rules", "render", "--width", "64", "--height", "64", "--format", "rgba16f", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["color_format"] == "rgba16f"


@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_an_optimizer_for_inference_gets_a_note_even_at_its_default(capsys, optimizer):
    assert main(["estimate", "llama-3.2-1b", "--task", "infer", "--optimizer", optimizer,
                 "--method", "analytic"]) == 0
    assert "note: --optimizer applies to training; ignored for --task infer" in capsys.readouterr().err


def test_no_optimizer_note_when_it_is_not_given(capsys):
    assert main(["estimate", "llama-3.2-1b", "--task", "infer", "--method", "analytic"]) == 0
    assert "--optimizer" not in capsys.readouterr().err


# --------------------------------------------------------------------------- item 6: the default seq
@pytest.mark.parametrize(("model", "positions"), [("gpt2", 1024), ("bert-base", 512)])
def test_default_seq_is_the_models_own_maximum(capsys, model, positions):
    assert main(["estimate", model, "--task", "train", "--method", "analytic", "--json"]) == 0
    out = capsys.readouterr()
    assert json.loads(out.out)["workload"]["seq"] == positions
    assert f"note: --seq not given: {positions:,} tokens" in out.err


def test_default_seq_leaves_room_for_new_tokens(capsys):
    assert main(["estimate", "gpt2", "--task", "generate", "--new-tokens", "100", "--method", "analytic",
                 "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["workload"]["seq"] == 924


def test_a_seq_that_is_given_is_kept(capsys):
    line = _error(capsys, ["estimate", "gpt2", "--seq", "2048", "--method", "analytic"])
    assert "1024 learned positions" in line


def test_fit_of_gpt2_runs_without_seq(capsys):
    assert main(["fit", "gpt2", "--gpu", "t4", "--method", "analytic", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["workload"]["seq"] == 1024 and doc["max_batch"] > 0


# --------------------------------------------------------------------------- item 4: every suggested flag parses
def _parsers() -> dict[str, argparse.ArgumentParser]:
    """Each (sub)command's parser by its command words ('plan', 'rules array')."""
    from vramplan.cli.main import build_parser

    out: dict[str, argparse.ArgumentParser] = {}

    def walk(p: argparse.ArgumentParser, name: str) -> None:
        out[name] = p
        for a in p._actions:
            if isinstance(a, argparse._SubParsersAction):
                for k, sp in a.choices.items():
                    walk(sp, f"{name} {k}".strip())

    walk(build_parser([]), "")
    return out


def _options(p: argparse.ArgumentParser) -> set[str]:
    return {o for a in p._actions for o in a.option_strings}


def _text(node: ast.AST) -> str | None:
    """A message's text with each formatted value as '1' (a value every flag type accepts)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        return "".join(v.value if isinstance(v, ast.Constant) else "1" for v in node.values)  # type: ignore[misc]
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        return (_text(node.left) or "") + (_text(node.right) or "")
    if isinstance(node, ast.IfExp):
        return (_text(node.body) or "") + " " + (_text(node.orelse) or "")
    return None


def _messages() -> list[tuple[str, str]]:
    """(where, text) of every error message and hint in vramplan's source: the arguments of
    ``*Error(...)``, ``hint(...)``, ``did_you_mean(...)`` and every ``hint=`` keyword."""
    out = []
    for path in sorted((SRC / "vramplan").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Call):
                continue
            f = node.func
            name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""
            args = list(node.args) if name.endswith("Error") or name in ("hint", "did_you_mean") else []
            args += [k.value for k in node.keywords if k.arg == "hint"]
            for a in args:
                t = _text(a)
                if t:
                    out.append((f"{path.relative_to(SRC)}:{node.lineno}", t))
    return out


_FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")
_COMMAND = re.compile(r"`vramplan ([a-z-]+(?: [a-z]+)?)((?: [^`]*)?)`")
_KNOWN_WRONG: dict[str, str] = {}  # in files a change may not touch (edited elsewhere): fix, then drop the entry


def test_every_flag_a_message_suggests_is_a_flag():
    parsers = _parsers()
    every = set().union(*(_options(p) for p in parsers.values()))
    bad = [f"{where}: {flag} ({text[:80]!r})" for where, text in _messages()
           for flag in _FLAG.findall(text.split("`vramplan run --")[0])  # after `run --`: the user's launcher
           if flag not in every]
    assert not bad, "\n".join(bad)


def test_every_command_a_message_suggests_parses():
    parsers = _parsers()
    bad, wrong = [], set()
    for where, text in _messages():
        for cmd, rest in _COMMAND.findall(text):
            words = cmd.split()
            name = " ".join(words) if " ".join(words) in parsers else words[0]
            if name not in parsers:
                wrong.add(where.split(":")[0])
                bad.append(f"{where}: no command `vramplan {cmd}`")
                continue
            opts = _options(parsers[name])
            flags = _FLAG.findall(rest.split(" -- ")[0])
            bad += [f"{where}: `vramplan {name}` has no {f}" for f in flags if f not in opts]
    unexpected = [b for b in bad if b.split(":")[0] not in _KNOWN_WRONG]
    assert not unexpected, "\n".join(unexpected)
    assert wrong == set(_KNOWN_WRONG), "a known wrong command was fixed: drop it from _KNOWN_WRONG"


@pytest.mark.parametrize("argv", [
    ["fit", "llama-3.1-405b", "--gpu", "rtx-3060", "--method", "analytic"],
    ["estimate", "llama-3.1-405b", "--gpu", "rtx-3060", "--method", "analytic"],
    ["estimate", "llama-3.1-70b", "--gpu", "rtx-4090", "--task", "train", "--method", "analytic"],
    ["serve-plan", "llama-3.1-405b", "--cheapest", "--concurrency", "1000", "--context", "131072"],
    ["plan", "llama-3.1-405b", "--gpu", "rtx-3060", "--method", "analytic"],
    ["plan", "llama-3.1-405b", "--rank-gpus", "--gpus", "1", "--method", "analytic"],
    ["estimate", "gpt2", "--sp", "--method", "analytic"],
    ["fit", "gpt2", "--method", "analytic"],
    ["serve-plan", "llama-3.1-8b", "--gpu", "l4", "--max-model-len", "999999999"],
])
def test_the_hints_users_meet_name_flags_that_parse(capsys, argv):
    """What the command prints: no library name left where a flag belongs (`allow_peft`,
    `max_gpus=N`), and every flag it names is one of the command it names (or its own)."""
    from vramplan.errors import FIELD_REF

    _run(argv)
    out = capsys.readouterr()
    text = out.err + out.out
    parsers = _parsers()
    dests = {a.dest for p in parsers.values() for a in p._actions if a.option_strings}
    leaked = [m.group(0) for m in FIELD_REF.finditer(text) if m.group(1) in dests]
    assert not leaked, text
    for cmd, rest in _COMMAND.findall(text):
        opts = _options(parsers[cmd if cmd in parsers else cmd.split()[0]])
        assert all(f in opts for f in _FLAG.findall(rest)), (cmd, rest)
    quoted = " ".join(rest for _, rest in _COMMAND.findall(text))
    own = _options(parsers[argv[0]])
    for line in text.splitlines():
        if line.startswith(("error:", "note:", "to fit", "hint")):
            for f in _FLAG.findall(_COMMAND.sub("", line)):
                assert f in own or f in quoted, (f, line)


# --------------------------------------------------------------------------- item 5: the demo's answer
_DEMO = ["estimate", "llama-3.1-8b", "--task", "train", "--precision", "bf16-mixed", "--optimizer", "adamw",
         "--batch", "4", "--seq", "2048", "--checkpointing", "full", "--gpu", "h100-sxm"]


def _answer(table: str) -> list[str]:
    lines = table.rstrip().splitlines()
    start = max(i for i, ln in enumerate(lines) if ln.startswith("Answer"))
    return lines[start:]


def test_the_answer_ends_stdout_with_question_verdict_and_fix(capsys):
    assert main([*_DEMO, "--method", "analytic"]) == 0
    out = capsys.readouterr()
    end = " ".join(" ".join(ln.split()) for ln in _answer(out.out))
    assert end.startswith("Answer question does llama-3.1-8b (task train · batch 4 · seq 2048")
    assert "fit on NVIDIA H100 SXM5 80GB?" in end
    assert "answer no:" in end and "GiB short" in end
    assert "to fit --dp 4 --zero 3 makes it fit:" in end and "(analytic;" in end
    assert "to fit" not in out.err  # not lost among the notes on stderr any more


def test_the_largest_batch_note_says_none_as_the_table_does(capsys):
    assert main([*_DEMO, "--method", "analytic"]) == 0
    table = capsys.readouterr().out
    assert "largest batch that fits  none (batch 1 does not fit)" in table
    assert "largest batch none (batch 1 does not fit): the engine's boundary search" in " ".join(table.split())
    assert "largest batch 0" not in table


def test_a_traced_estimate_confirms_its_fix_with_a_trace(capsys, monkeypatch):
    """The screen's first pick is confirmed by the trace; when the trace finds it does not fit,
    the next change down the list is tried (and named with the trace's figure). One test: the
    second half traces the same workload and candidates (gpt2 batch 24 on a T4), which the
    process's trace cache (``vramplan.engine.cache``, emptied before each test) then answers
    instead of tracing them again; the refuting estimator still wraps each of those estimates."""
    argv = ["estimate", "gpt2", "--task", "train", "--batch", "24", "--gpu", "t4", "--method", "trace"]
    assert main([*argv, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["fits"] is False and doc["method"] == "trace"
    fix = doc["to_fit"]
    assert fix["method"] == "trace" and fix["device_used"] <= fix["usable"]
    assert fix["screened"] is not None  # the analytic screen's figure, kept beside the trace's
    assert main(argv) == 0
    end = " ".join(" ".join(ln.split()) for ln in _answer(capsys.readouterr().out))
    assert f"to fit {fix['flags']} makes it fit:" in end and "(trace;" in end

    # a fix the trace refutes gives way to the next
    from vramplan.engine import estimate as real
    from vramplan.planner import evaluator

    def estimator(model, w, **kw):  # the trace finds every smaller batch too large
        r = real(model, w, **kw)
        if kw.get("method") != "analytic" and w.batch < 24:
            return r.replace(verdict=dataclasses.replace(r.verdict, fits=False, headroom=-1))
        return r

    monkeypatch.setattr(evaluator, "default_estimator", lambda: estimator)
    assert main([*argv, "--json"]) == 0
    refuted = json.loads(capsys.readouterr().out)["to_fit"]
    assert refuted["method"] == "trace" and "--batch" not in refuted["flags"], refuted


# --------------------------------------------------------------------------- item 2: fit without [models]
_BLOCKER = '''
import sys
class _Block:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {blocked!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
sys.meta_path.insert(0, _Block())
'''


def _cli_without_models(tmp_path: Path, *argv: str) -> subprocess.CompletedProcess[str]:
    blocked = ("diffusers", "huggingface_hub", "peft", "transformers")
    (tmp_path / "sitecustomize.py").write_text(_BLOCKER.format(blocked=blocked))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(SRC)])}
    code = "import sys; from vramplan.cli.main import main; sys.exit(main(sys.argv[1:]))"
    return subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True,
                          env=env, timeout=600, cwd=tmp_path)


_LORA = ["fit", "llama-3.1-8b", "--gpu", "rtx-4090", "--task", "train", "--peft", "lora"]


def test_fit_says_auto_fell_back_and_keeps_a_margin(tmp_path, capsys):
    r = _cli_without_models(tmp_path, *_LORA, "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["fallback"]["used"] == "analytic" and "needs transformers" in doc["fallback"]["reason"]
    assert "note: the model could not be traced" in r.stderr
    assert any("`method=auto` could not trace" in n and "below the usable memory" in n for n in doc["notes"])
    # the formulas alone answer batch 2 / seq 4,096, where the trace needs 24.4 GiB of 24.0 (batch 1 / 3,840)
    assert main([*_LORA, "--method", "analytic", "--json"]) == 0
    plain = json.loads(capsys.readouterr().out)
    assert (plain["max_batch"], plain["max_seq"]) == (2, 4096)
    assert doc["max_batch"] == 1 and doc["max_seq"] < 3840
    assert doc["boundary"]["batch"]["limited_by"].startswith("memory less ")


def test_fit_table_names_the_fallback(tmp_path):
    r = _cli_without_models(tmp_path, *_LORA)
    assert r.returncode == 0, r.stderr
    assert "auto: fell back to analytic" in r.stdout
    assert "confirmed with the auto method" not in " ".join(r.stdout.split())


# --------------------------------------------------------------------------- item 6: Llama 4
@pytest.mark.parametrize(("alias", "params", "experts"), [
    ("llama-4-scout", 107_769_861_120, 16), ("llama-4-maverick", 400_711_848_960, 128)])
def test_llama4_is_in_the_catalog_with_its_exact_count(capsys, alias, params, experts):
    assert main(["models", alias, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    doc = doc["model"]
    assert doc["params"] == params and doc["n_experts"] == experts


@pytest.mark.parametrize("alias", ["llama-4-scout", "llama-4-maverick"])
def test_llama4_estimates_analytically(capsys, alias):
    assert main(["estimate", alias, "--task", "train", "--peft", "qlora", "--seq", "1024", "--gpu", "h200",
                 "--method", "analytic", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["method"] == "analytic" and doc["peak"]["device_used"] > 0


def test_maverick_alternates_dense_and_expert_layers():
    from vramplan.models.catalog import resolve

    scout, maverick = resolve("llama-4-scout"), resolve("llama-4-maverick")
    assert (scout.dense_layers, maverick.dense_layers) == (0, 24)
    assert maverick.intermediate == 16384 and maverick.moe_intermediate == 8192 and maverick.shared_experts == 1


def test_llama4_scout_traces(capsys):
    pytest.importorskip("transformers.models.llama4", reason="transformers without Llama 4")
    assert main(["estimate", "llama-4-scout", "--task", "infer", "--seq", "256", "--gpu", "h200",
                 "--method", "trace", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    weights = 107_769_861_120 * 2  # bf16 inference
    assert doc["method"] == "trace" and weights <= doc["peak"]["allocated"] < 1.05 * weights


# --------------------------------------------------------------------------- item 3: runaway work
_RUNAWAY = '''
import time

import torch
from torch import nn


class Grow(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        hoard = []
        while True:
            hoard.append(bytearray(32 << 20))  # host memory kept until the loop ends
            x = self.fc(x)


class Spin(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(64, 64)

    def forward(self, x):
        while True:
            x = self.fc(x) * 1.0001  # real tensor ops: the time goes to the trace's dispatch


class Slow(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        time.sleep(6)
        return self.fc(x)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(64, 64)

    def forward(self, x):
        return self.fc(x)


def grow():
    return Grow(), torch.randn(2, 8)


def spin():
    return Spin(), torch.randn(8, 64)


def slow():
    return Slow(), torch.randn(2, 8)


def mismatch():
    return Net(), torch.randn(8, 32)  # the model takes 64 features


def fake_only():
    class Item(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 8)

        def forward(self, x):
            n = int(x.sum().item())  # a value fake tensors do not have
            return self.fc(x) * n
    return Item(), torch.randn(2, 8)
'''


@pytest.fixture
def runaway(tmp_path: Path) -> Path:
    p = tmp_path / "runaway.py"
    p.write_text(_RUNAWAY)
    return p


def test_a_forward_that_hoards_memory_stops_at_the_budget(runaway, capsys):
    from vramplan.trace.deadline import current_rss

    rss = current_rss()
    assert rss is not None
    budget = rss + (1 << 30)  # room for what a first trace imports (torch._dynamo, sympy)
    start = time.monotonic()
    line = _error(capsys, ["trace", f"{runaway}:grow", "--max-memory", f"{budget}B", "--timeout", "120"])
    assert time.monotonic() - start < 60  # long before the timeout
    assert "past its budget of" in line and "--max-memory" in line and "--timeout" in line
    assert "runaway.py:" in line and "in forward" in line
    assert current_rss() < budget + (512 << 20)  # stopped within a few ticks of the budget


def test_a_loop_of_real_ops_in_forward_names_the_users_line(runaway, capsys):
    line = _error(capsys, ["trace", f"{runaway}:spin", "--timeout", "3"])
    assert "did not finish within 3 s" in line
    assert re.search(r"runaway\.py:\d+ in forward", line), line
    assert not re.search(r"recorder\.py|metacache\.py|functions\.py|dispatch\.py", line), line


def test_trace_prints_a_progress_line(runaway, capsys):
    assert main(["trace", f"{runaway}:slow", "--iterations", "1", "--task", "infer", "--json"]) == 0
    out = capsys.readouterr()
    json.loads(out.out)
    progress = [ln for ln in out.err.splitlines() if ln.startswith("vramplan trace:")]
    assert progress, out.err
    assert "runaway.py:slow" in progress[0] and "(stops at --timeout 900 s, --max-memory" in progress[0]


@pytest.mark.parametrize("n", ["100000", "0", "-1"])
def test_iterations_are_bounded(runaway, capsys, n):
    line = _error(capsys, ["trace", f"{runaway}:spin", "--iterations", n])
    assert "--iterations must be 1 to 100" in line


def test_a_plain_shape_mismatch_gets_no_fake_tensor_advice(runaway, capsys):
    line = _error(capsys, ["trace", f"{runaway}:mismatch"])
    assert "same reduction dim" in line or "shapes cannot be multiplied" in line
    assert "fake" not in line and "register a fake kernel" not in line
    assert "shape mismatch between the model and its example inputs" in line


def test_a_fake_tensor_limit_keeps_its_advice(runaway, capsys):
    line = _error(capsys, ["trace", f"{runaway}:fake_only"])
    assert "shape mismatch between the model" not in line
    assert "fake" in line or "item()" in line or "data-dependent" in line.lower(), line


def test_the_library_gives_no_fake_tensor_advice_for_a_shape_mismatch():
    import torch
    from torch import nn

    import vramplan
    from vramplan.errors import TraceError

    with pytest.raises(TraceError) as e:
        vramplan.trace(lambda: nn.Linear(8, 4), inputs=(torch.randn(2, 5),), task="train")
    assert "shape mismatch" in e.value.hint and "fake (meta)" not in e.value.hint
