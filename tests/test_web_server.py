"""``vramplan web`` as a process: its worker processes (and the fork server they come from)
never outlive it; a request whose client goes away stops its trace."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

pytest.importorskip("uvicorn", reason="the web extra is not installed (pip install 'vramplan[web]')")
if not Path("/proc/self/stat").exists():
    pytest.skip("needs /proc to find the worker processes", allow_module_level=True)


def _children(pid: int) -> set[int]:
    out = set()
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                stat = (d / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                out.add(int(d.name))
    return out


def _alive(pids: set[int]) -> set[int]:
    alive = set()
    for p in pids:
        try:
            state = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z":
            alive.add(p)
    return alive


def _descendants(pid: int) -> set[int]:
    out, todo = set(), [pid]
    while todo:
        kids = _children(todo.pop())
        out |= kids
        todo.extend(kids)
    return out


def _start() -> tuple[subprocess.Popen, set[int]]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "vramplan.cli.main", "web", "--port", str(port), "--workers", "2"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/status", timeout=2) as r:  # noqa: S310
                if json.loads(r.read())["warmed"] >= 2:
                    break
        except OSError:
            time.sleep(0.3)
    else:
        proc.kill()
        raise RuntimeError("vramplan web did not start")
    workers = set()
    for p in _descendants(proc.pid):
        try:
            cmd = Path(f"/proc/{p}/cmdline").read_text()
        except OSError:
            continue
        if "forkserver" in cmd or "spawn_main" in cmd:
            workers.add(p)
    return proc, workers


def _gone_within(pids: set[int], seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if not _alive(pids):
            return True
        time.sleep(0.2)
    for p in _alive(pids):  # do not leave them behind, whatever the result
        os.kill(p, signal.SIGKILL)
    return False


@pytest.mark.parametrize("how", ["terminate", "kill"])
def test_workers_end_with_the_server(how):
    proc, workers = _start()
    assert len(workers) >= 2  # the two workers (and the fork server they are forked from)
    getattr(proc, how)()
    proc.wait(timeout=30)
    assert _gone_within(workers, 15)
