"""The console-script entry point: the same output and exit status as ``main``, with garbage
collection paused for vramplan's own commands and the interpreter's teardown skipped."""

from __future__ import annotations

import gc
import subprocess
import sys
import threading

import pytest

from vramplan.cli import main as cli


def _run(*argv: str, code: str = "") -> subprocess.CompletedProcess[str]:
    prog = f"import sys; {code}sys.argv = ['vramplan', *{list(argv)!r}]; from vramplan.cli.main import entry; entry()"
    return subprocess.run([sys.executable, "-c", prog], capture_output=True, text=True, timeout=120)


def test_output_and_status_are_mains(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["estimate", "llama-3.1-8b", "--method", "analytic", "--format", "json"]
    assert cli.main(argv) == 0
    inproc = capsys.readouterr()
    proc = _run(*argv)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == inproc.out and proc.stderr == inproc.err


def test_an_error_keeps_its_exit_code_and_message() -> None:
    proc = _run("estimate", "no-such-model")
    assert proc.returncode == 2
    assert proc.stderr.startswith("error: unknown model 'no-such-model'") and proc.stdout == ""


def test_atexit_handlers_run_and_output_is_flushed() -> None:
    # buffered output (stdout is a pipe here) and atexit handlers survive the fast exit
    proc = _run("gpus", code="import atexit; atexit.register(lambda: print('handler ran')); ")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.rstrip().endswith("handler ran") and "GPU catalog" in proc.stdout


class _Exited(Exception):
    pass


@pytest.fixture
def entry_calls(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, object]]:
    """Run ``entry`` in process: record main's argv and whether collection was on, and what
    ending the process would have done (``os._exit`` / ``sys.exit``)."""
    calls: list[tuple[str, object]] = []

    def fake_main(argv: list[str]) -> int:
        calls.append(("gc enabled in main", gc.isenabled()))
        return 3

    def fake_os_exit(code: int) -> None:
        calls.append(("os._exit", code))
        raise _Exited

    monkeypatch.setattr(cli, "main", fake_main)
    monkeypatch.setattr(cli.os, "_exit", fake_os_exit)
    monkeypatch.setattr(cli.atexit, "_run_exitfuncs", lambda: calls.append(("atexit", None)))
    # (the only thread: threads earlier tests of this process left running, a tqdm monitor or a
    # compile pool's, would take entry's other way out, sys.exit: test_live_threads_get_pythons_normal_exit)
    monkeypatch.setattr(cli.threading, "active_count", lambda: 1)
    was = gc.isenabled()
    yield calls
    if was:
        gc.enable()


@pytest.mark.parametrize(("argv", "paused"), [(["estimate", "x"], True), (["plan", "x"], True), ([], True),
                                              (["--help"], True), (["web"], False), (["run", "s.py"], False),
                                              (["measure", "x"], False)])
def test_collection_is_paused_for_vramplans_own_commands(monkeypatch: pytest.MonkeyPatch, entry_calls: list,
                                                         argv: list[str], paused: bool) -> None:
    monkeypatch.setattr(sys, "argv", ["vramplan", *argv])
    gc.enable()
    with pytest.raises(_Exited):
        cli.entry()
    assert entry_calls == [("gc enabled in main", not paused), ("atexit", None), ("os._exit", 3)]


def test_help_and_usage_errors_end_the_same_way() -> None:
    proc = _run("--help")
    assert proc.returncode == 0 and proc.stdout.startswith("usage: vramplan")
    proc = _run("estimate", "llama-3.1-8b", "--batch", "x")
    assert proc.returncode == 2 and proc.stderr.startswith("error: ") and proc.stdout == ""


def test_live_threads_get_pythons_normal_exit(monkeypatch: pytest.MonkeyPatch, entry_calls: list) -> None:
    monkeypatch.setattr(sys, "argv", ["vramplan", "estimate", "x"])
    monkeypatch.setattr(threading, "active_count", lambda: 2)
    with pytest.raises(SystemExit) as e:
        cli.entry()
    assert e.value.code == 3 and ("os._exit", 3) not in entry_calls
