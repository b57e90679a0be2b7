"""Reduced traces side by side in forked children (trace.forked): the results are a serial run's."""

from __future__ import annotations

import os
import sys
import threading

import pytest

from vramplan.trace import forked
from vramplan.trace.replicate import _same_log
from vramplan.trace.run import trace_workload
from vramplan.trace.testing import tiny_spec
from vramplan.workload import Workload

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="forks on Linux only")


def _square_and_pid(x: int) -> tuple[int, int]:
    return x * x, os.getpid()


def test_results_in_order_and_the_last_items_in_children() -> None:
    got = forked.map_forked(_square_and_pid, [1, 2, 3, 4, 5], processes=3)
    assert [v for v, _ in got] == [1, 4, 9, 16, 25]
    pids = [p for _, p in got]
    assert pids[:3] == [os.getpid()] * 3  # (here: the first items)
    assert len({*pids[3:]} - {os.getpid()}) == 2  # one child each


def test_short_items_all_run_here() -> None:
    got = forked.map_forked(_square_and_pid, [1, 2, 3], processes=3, fork_from=60.0)
    assert got == [(1, os.getpid()), (4, os.getpid()), (9, os.getpid())]


def _fails_in_child(x: int) -> int:
    if forked._in_child:
        raise RuntimeError("only in the child")
    return x + 1


def _crashes_in_child(x: int) -> int:
    if forked._in_child:
        os._exit(3)
    return x + 1


@pytest.mark.parametrize("fn", [_fails_in_child, _crashes_in_child])
def test_a_failed_child_item_is_run_here(fn) -> None:  # type: ignore[no-untyped-def]
    assert forked.map_forked(fn, [1, 2], processes=2) == [2, 3]


def _raises(x: int) -> int:
    raise ValueError(f"bad item {x}")


def test_an_error_is_raised_as_in_a_serial_run() -> None:
    with pytest.raises(ValueError, match="bad item 1"):
        forked.map_forked(_raises, [1, 2], processes=2)


def _workers_inside(x: int) -> int:
    return forked.workers()


def test_no_fork_inside_a_child() -> None:
    assert forked.map_forked(_workers_inside, [0, 0], processes=2)[1] == 1


def test_workers_follow_the_environment_and_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    threads = [1]  # (Python threads alive: an earlier test may have left one running)
    monkeypatch.setattr(forked.threading, "active_count", lambda: threads[0])
    monkeypatch.setenv(forked.WORKERS_ENV, "1")
    assert forked.workers() == 1
    monkeypatch.setenv(forked.WORKERS_ENV, "3")
    assert forked.workers() == 3
    monkeypatch.delenv(forked.WORKERS_ENV)
    assert forked.workers() == len(os.sched_getaffinity(0))
    threads[0] = 2
    assert forked.workers() == 1  # (a thread could hold a lock the child would wait on)


def _fork_always(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Tiny models trace in milliseconds, under :data:`run.FORK_FROM`: fork them anyway (unless
    ``VRAMPLAN_TRACE_WORKERS=1``); the list counts the children forked."""
    from vramplan.trace import run

    monkeypatch.setattr(run, "FORK_FROM", 0.0)
    # (even where an earlier test left a thread running)
    monkeypatch.setattr(forked, "workers", lambda: int(os.environ.get(forked.WORKERS_ENV) or 3))
    forks: list[int] = []
    real = forked._Child.__init__

    def counted(self, fn, item):  # type: ignore[no-untyped-def]
        forks.append(1)
        real(self, fn, item)

    monkeypatch.setattr(forked._Child, "__init__", counted)
    return forks


def _serial_and_forked(spec, w: Workload, monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    """``spec`` under ``w`` traced in one process, then with its reduced traces forked."""
    forks = _fork_always(monkeypatch)
    monkeypatch.setenv(forked.WORKERS_ENV, "1")
    serial = trace_workload(spec, w)
    assert not forks
    monkeypatch.setenv(forked.WORKERS_ENV, "3")
    side = trace_workload(spec, w)
    assert forks
    return serial, side


@pytest.mark.parametrize("name, w", [
    ("llama-3.1-8b", Workload(task="train", batch=1, seq=64, precision="bf16-mixed")),
    ("llama-3.1-8b", Workload(task="generate", batch=2, seq=32, new_tokens=12, precision="bf16")),
    ("qwen3-30b-a3b", Workload(task="train", batch=1, seq=32, precision="bf16-mixed")),
])
def test_forked_traces_equal_serial_ones(name: str, w: Workload, monkeypatch: pytest.MonkeyPatch) -> None:
    serial, side = _serial_and_forked(tiny_spec(name, layers=6), w, monkeypatch)
    assert any("identical layers traced once" in n for n in serial.notes)
    assert _same_log(side.events, serial.events)
    assert side == serial


def test_forked_expert_cut_traces_keep_their_note(monkeypatch: pytest.MonkeyPatch) -> None:
    """MoE layers replicated, each reduced model's experts loops cut (:mod:`vramplan.trace.experts`):
    the children's expert notes come back with their traces."""
    import dataclasses

    from vramplan.models.normalize import spec_from_config
    from vramplan.trace import replicate

    monkeypatch.setattr(replicate, "CUT_FROM", 6)  # (cut loops of a tiny expert count)
    tiny = tiny_spec("deepseek-v3", layers=7)
    spec = dataclasses.replace(spec_from_config({**tiny.config, "n_routed_experts": 10, "num_experts_per_tok": 2},
                                                name=tiny.name, source=tiny.source), layers=7)
    w = Workload(task="train", batch=1, seq=32, precision="bf16-mixed", optimizer="adamw", optimizer_impl="foreach")
    serial, side = _serial_and_forked(spec, w, monkeypatch)
    assert any("identical experts traced once" in n for n in serial.notes)
    assert any("identical layers traced once" in n for n in serial.notes)
    assert side == serial


def _stuck_in_child(x: int) -> int:
    if forked._in_child:
        threading.Event().wait()
    return x + 1


def test_a_stuck_child_is_given_up(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(forked, "PATIENCE", (0.5, 0.0))
    assert forked.map_forked(_stuck_in_child, [1, 2], processes=2) == [2, 3]


def _parallel_cpu_op(x: int) -> tuple[float, int]:
    import torch

    return float((torch.ones(1 << 21) * x).sum()), os.getpid()


def test_a_child_runs_parallel_cpu_ops_after_this_process_did(monkeypatch: pytest.MonkeyPatch) -> None:
    """GNU OpenMP's pool, started here, does not exist in a forked child: its parallel ops
    would wait forever (the child runs them on one thread)."""
    import torch

    monkeypatch.setattr(forked, "PATIENCE", (20.0, 0.0))
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        got = forked.map_forked(_parallel_cpu_op, [1, 2], processes=2)  # (item 1 runs here first)
    finally:
        torch.set_num_threads(threads)
    assert [v for v, _ in got] == [float(1 << 21), float(2 << 21)]
    assert got[1][1] != os.getpid()  # (computed by the child, not run again here)


def test_descriptors_from_1024_on(monkeypatch: pytest.MonkeyPatch) -> None:
    """A process holding many files (a server): the wait takes any descriptor."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 1200:
        pytest.skip("the hard limit on open files is under 1,200")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 1200), hard))
    held = []
    try:
        while len(held) < 1100:
            held.append(os.open(os.devnull, os.O_RDONLY))
        got = forked.map_forked(_square_and_pid, [1, 2], processes=2)
    finally:
        for fd in held:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert got[1][0] == 4 and got[1][1] != os.getpid()


def test_no_stdout(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "stdout", None)
    assert [v for v, _ in forked.map_forked(_square_and_pid, [1, 2], processes=2)] == [1, 4]


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.parametrize("fails", ["fork", "pipe"])
def test_no_fork_possible_runs_everything_here(fails: str, monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: object) -> int:
        raise BlockingIOError(11, "Resource temporarily unavailable")

    before = _open_fds()
    monkeypatch.setattr(forked.os, fails, refuse)
    got = forked.map_forked(_square_and_pid, [1, 2, 3], processes=3)
    monkeypatch.undo()
    assert got == [(1, os.getpid()), (4, os.getpid()), (9, os.getpid())]
    assert _open_fds() == before


def test_the_model_store_keeps_the_models_traced_here(monkeypatch: pytest.MonkeyPatch) -> None:
    """A model built in a child stays there: the process's store holds the 2- and 3-layer
    models, and a later trace borrows them and gives what a fresh one gives."""
    from vramplan.engine import cache, estimate

    forks = _fork_always(monkeypatch)
    monkeypatch.setenv(forked.WORKERS_ENV, "2")  # (the 4-layer model traced in a child)
    cache.clear()
    spec = tiny_spec("llama-3.1-8b", layers=6)
    w = Workload(task="train", batch=1, seq=64, precision="bf16-mixed", peft="lora", checkpointing="full")
    try:
        estimate(spec, w, gpu="rtx-4090", method="trace", search_max_batch=False)
        assert len(forks) == 1 and len(cache.MODELS.cache) == 2
        b = estimate(spec, w.replace(batch=2), gpu="rtx-4090", method="trace", search_max_batch=False)
        assert cache.MODELS.cache.hits == 2
        monkeypatch.setenv(forked.WORKERS_ENV, "1")
        cache.MODELS.cache.enabled = False
        try:
            fresh = estimate(spec, w.replace(batch=2), gpu="rtx-4090", method="trace", search_max_batch=False)
        finally:
            cache.MODELS.cache.enabled = True
        assert list(b.events.rows()) == list(fresh.events.rows()) and b.peak == fresh.peak
    finally:
        cache.clear()
