"""The on-disk store (``engine/store.py``): keys, atomic writes, corrupt and planted files, the size
bound, concurrent writers, the CLI (``vramplan cache``, ``--no-cache``), and a repeated estimate
answered from it — the same figures as a fresh trace, without importing torch."""

from __future__ import annotations

import json
import multiprocessing
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest

from vramplan.engine import store
from vramplan.engine.store import Store
from vramplan.results import Breakdown

KEY = "k|one"
GROUP = store.digest("group")


@pytest.fixture()
def disk(tmp_path: Path) -> Store:
    return Store(tmp_path / "store", limit=10**9)


def test_a_value_reads_back_under_its_own_key_only(disk: Store) -> None:
    v = Breakdown(weights=1, gradients=2)
    assert disk.put("trace", GROUP, "b1-s8", KEY, v)
    assert disk.get("trace", GROUP, "b1-s8", KEY) == v
    assert disk.get("trace", GROUP, "b1-s8", KEY + "x") is None  # same file, another key: no answer
    assert disk.get("trace", GROUP, "b2-s8", KEY) is None
    assert disk.names("trace", GROUP) == ["b1-s8"]


def test_a_corrupt_or_truncated_file_is_a_miss_and_goes(disk: Store) -> None:
    disk.put("trace", GROUP, "b1-s8", KEY, Breakdown(weights=1))
    path = next(disk.root.rglob("*.vps"))
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 5])
    assert disk.get("trace", GROUP, "b1-s8", KEY) is None
    assert not path.exists()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"garbage")
    assert disk.get("trace", GROUP, "b1-s8", KEY) is None
    assert not path.exists()


class _Planted:
    def __reduce__(self):  # what a malicious file would run on an unrestricted load
        return (os.system, ("touch PLANTED",))


def test_a_planted_pickle_is_refused_without_running(disk: Store, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    disk.put("trace", GROUP, "b1-s8", KEY, Breakdown(weights=1))
    path = next(disk.root.rglob("*.vps"))
    raw = KEY.encode()
    path.write_bytes(store.MAGIC + store._HEADER.pack(store.FORMAT, len(raw)) + raw + pickle.dumps(_Planted()))
    assert disk.get("trace", GROUP, "b1-s8", KEY) is None
    assert not (tmp_path / "PLANTED").exists()
    with pytest.raises(store.Refused):
        store._decode(store.MAGIC + store._HEADER.pack(store.FORMAT, len(raw)) + raw + pickle.dumps(_Planted()), KEY)


def test_the_bound_deletes_the_least_recently_used(tmp_path: Path) -> None:
    disk = Store(tmp_path / "s", limit=10**9)
    blob = b"x" * 4000
    for i in range(5):
        disk.put("replay", GROUP, f"r{i}", f"key{i}", blob)
        p = next(disk.root.rglob(f"r{i}.vps"))
        os.utime(p, (1000 + i, 1000 + i))
    disk.get("replay", GROUP, "r0", "key0")  # read: now the most recent
    one = next(disk.root.rglob("r0.vps")).stat().st_size
    disk.trim(limit=3 * one)
    assert disk.names("replay", GROUP) == ["r0", "r3", "r4"]
    assert not disk.put("replay", GROUP, "big", "big", b"y" * 10**6) or disk.limit >= 10**6


def _writer(root: str, n: int) -> None:
    disk = Store(Path(root), limit=10**9)
    for i in range(n):
        disk.put("trace", GROUP, "b1-s8", KEY, list(range(5000 + i % 3)))
        got = disk.get("trace", GROUP, "b1-s8", KEY)
        assert got is None or got[:5000] == list(range(5000))


def test_concurrent_writers_leave_one_whole_file(tmp_path: Path) -> None:
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_writer, args=(str(tmp_path / "s"), 25)) for _ in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    disk = Store(tmp_path / "s")
    got = disk.get("trace", GROUP, "b1-s8", KEY)
    assert got is not None and got[:5000] == list(range(5000))
    assert [e.path.name for e in disk.entries()] == ["b1-s8.vps"]  # no temporary file left


def test_canonical_text_is_stable_and_refuses_what_it_cannot_name() -> None:
    from vramplan.workload import Workload

    assert store.canonical(Workload(batch=2)) == store.canonical(Workload(batch=2))
    assert store.canonical({"b": 1, "a": {2, 1}}) == "{'a':{1,2},'b':1}"
    with pytest.raises(TypeError):
        store.canonical(object())


def _env(tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != store.OFF_ENV}
    env[store.DIR_ENV] = str(tmp_path / "cache")
    return env


ARGS = ["estimate", "gpt2", "--task", "train", "--seq", "64", "--gpu", "rtx-4090", "--method", "trace", "--format", "json"]
PROBE = ("import json, sys\nfrom vramplan.cli.main import main\ncode = main(sys.argv[1:])\n"
         "sys.stderr.write(json.dumps({'torch': 'torch' in sys.modules, 'transformers': 'transformers' in sys.modules}))\n")


def _estimate(tmp_path: Path, batch: int, *extra: str) -> tuple[dict, dict]:
    p = subprocess.run([sys.executable, "-c", PROBE, *ARGS, "--batch", str(batch), *extra], env=_env(tmp_path),
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout), json.loads(p.stderr.strip().splitlines()[-1])


def _cli_here(monkeypatch, capsys, tmp_path: Path, batch: int, *extra: str) -> dict:
    """The same command as :func:`_estimate` in this process (torch already imported: no start-up
    per call), on the store of ``_env``, the process's own caches emptied first."""
    from vramplan.cli.main import main
    from vramplan.engine import cache

    cache.clear()
    monkeypatch.setenv(store.DIR_ENV, str(tmp_path / "cache"))
    monkeypatch.setenv(store.OFF_ENV, "0")  # on; and put back after the test (`--no-cache` sets it to 1 here)
    capsys.readouterr()
    assert main([*ARGS, "--batch", str(batch), *extra]) in (0, None)
    return json.loads(capsys.readouterr().out)


def _figures(d: dict) -> dict:
    return {k: v for k, v in d.items() if k != "notes"}


def test_a_repeated_estimate_is_answered_from_the_store_without_torch(tmp_path: Path, monkeypatch, capsys) -> None:
    first = _cli_here(monkeypatch, capsys, tmp_path, 4)  # traced here, stored
    again, mods = _estimate(tmp_path, 4)  # a new process: answered from the store
    assert not mods["torch"] and not mods["transformers"]
    assert _figures(again) == _figures(first)
    assert any("stored by an earlier run" in n for n in again["notes"])
    fresh = _cli_here(monkeypatch, capsys, tmp_path, 4, "--no-cache")
    assert _figures(fresh) == _figures(first)
    assert not any("stored by an earlier run" in n for n in fresh["notes"])


def _in_process(monkeypatch, tmp_path: Path, seq: int, batch: int, *, store_on: bool = True) -> dict:
    """``estimate`` in this process (torch already imported: no start-up per call), on the store
    of ``_env``; the process's own caches emptied first, so that the answer comes from disk."""
    from vramplan import estimate
    from vramplan.engine import cache

    cache.clear()
    monkeypatch.setenv(store.DIR_ENV, str(tmp_path / "cache"))
    if store_on:
        monkeypatch.delenv(store.OFF_ENV, raising=False)
    else:
        monkeypatch.setenv(store.OFF_ENV, "1")
    r = estimate("gpt2", task="train", batch=batch, seq=seq, gpu="rtx-4090", method="trace")
    return r.to_dict()


def test_a_nearby_batch_is_written_from_stored_traces_and_equals_a_fresh_one(tmp_path: Path, monkeypatch,
                                                                             capsys) -> None:
    for b in (2, 4, 6):
        _in_process(monkeypatch, tmp_path, 64, b)
    monkeypatch.delenv(store.DIR_ENV)
    written, mods = _estimate(tmp_path, 5)  # (a fresh process: no torch imported for it)
    assert not mods["torch"]
    assert any("written from the traces at batches" in n for n in written["notes"])
    fresh = _cli_here(monkeypatch, capsys, tmp_path, 5, "--no-cache")
    assert not any("written from the traces" in n for n in fresh["notes"])
    assert _figures(written) == _figures(fresh)


def test_a_nearby_sequence_length_is_written_from_four_stored_traces(tmp_path: Path, monkeypatch) -> None:
    for s in (128, 256, 512, 640):
        _in_process(monkeypatch, tmp_path, s, 2)
    written = _in_process(monkeypatch, tmp_path, 384, 2)
    assert any("written from the traces at sequence lengths 128, 256, 512, 640" in n for n in written["notes"])
    fresh = _in_process(monkeypatch, tmp_path, 384, 2, store_on=False)
    assert _figures(written) == _figures(fresh)


def test_no_cache_writes_nothing_and_cache_command_reports_and_clears(tmp_path: Path, monkeypatch, capsys) -> None:
    env = _env(tmp_path)
    run = [sys.executable, "-m", "vramplan.cli.main"]
    _cli_here(monkeypatch, capsys, tmp_path, 2, "--no-cache")
    info = json.loads(subprocess.run([*run, "cache", "--format", "json"], env=env, check=True, capture_output=True,
                                     text=True).stdout)
    assert info["entries"] == 0 and info["directory"] == str(tmp_path / "cache")
    _cli_here(monkeypatch, capsys, tmp_path, 2)
    info = json.loads(subprocess.run([*run, "cache", "--format", "json"], env=env, check=True, capture_output=True,
                                     text=True).stdout)
    assert info["kinds"]["trace"]["entries"] >= 1 and info["bytes"] > 0
    out = subprocess.run([*run, "cache", "clear"], env=env, check=True, capture_output=True, text=True).stdout
    assert out.startswith("cleared ")
    assert not list((tmp_path / "cache").rglob("*.vps"))


def test_a_bad_bound_is_one_line_naming_the_fix(tmp_path: Path) -> None:
    env = _env(tmp_path)
    env[store.MAX_ENV] = "lots"
    p = subprocess.run([sys.executable, "-m", "vramplan.cli.main", *ARGS, "--batch", "2"], env=env, capture_output=True,
                       text=True, timeout=600)
    assert p.returncode == 2
    assert p.stderr.count("\n") == 1 and "VRAMPLAN_CACHE_MAX" in p.stderr and "2GiB" in p.stderr


def _strip(d: object) -> object:
    if isinstance(d, dict):
        return {k: _strip(v) for k, v in d.items() if k != "notes"}
    if isinstance(d, list):
        return [_strip(x) for x in d]
    return d


@pytest.mark.parametrize("cmd", ["fit", "plan"])
def test_fit_and_plan_run_ahead_in_forked_processes_with_the_serial_answer(tmp_path: Path, monkeypatch, capsys,
                                                                            cmd: str) -> None:
    """``fit`` confirms the step above each point in a forked child while it confirms the point,
    ``plan`` confirms its last finalists in one; the traces come back through the store, so the
    answer is the serial one (``--no-cache`` runs one after another). The run ahead is the CLI in
    a process of its own (its children fork from it); the serial answer is the same command in
    this process (torch already imported: no second start-up), its caches emptied first."""
    from vramplan.cli.main import main
    from vramplan.engine import cache

    env = _env(tmp_path)
    env["VRAMPLAN_TRACE_WORKERS"] = "2"
    argv = [cmd, "gpt2", "--task", "train", "--seq", "256", "--gpu", "rtx-3060", "--method", "trace",
            "--format", "json"]
    if cmd == "plan":
        argv += ["--confirm", "2"]
    ahead = subprocess.run([sys.executable, "-m", "vramplan.cli.main", *argv], env=env, capture_output=True,
                           text=True, timeout=900)
    assert ahead.returncode == 0, ahead.stderr
    cache.clear()
    monkeypatch.setenv(store.DIR_ENV, str(tmp_path / "cache"))
    monkeypatch.setenv(store.OFF_ENV, "0")  # put back after the test (`--no-cache` sets it to 1 here)
    monkeypatch.setenv("VRAMPLAN_TRACE_WORKERS", "2")
    capsys.readouterr()
    assert main([*argv, "--no-cache"]) in (0, None)
    a, s = json.loads(ahead.stdout), json.loads(capsys.readouterr().out)
    assert _strip(a) == _strip(s)
    assert any("forked process" in n for n in a["notes"]), a["notes"]
    assert not any("forked process" in n for n in s["notes"])
