"""The same script run for real on the CPU: the reference ``vramplan run`` is compared with.

:func:`cpu_truth` runs an unmodified script in this process (``runpy``, its own ``sys.argv``),
on the CPU as the script runs there (its own CPU switch: ``device=cpu``, ``--use_cpu``), and
records the live bytes of every CPU tensor storage as ops make and free them (a dispatch-mode
tracker, as ``trace.testing.real_peak`` does for a step), and of every parameter and buffer of a
model called (a dispatch mode sees one thread: transformers 5 reads a checkpoint's weights in a
thread pool, so no op the tracker saw made them). It stops where ``vramplan run`` stops:
after ``steps`` optimizer steps (PyTorch's global optimizer step hooks), or, for a script that
builds no optimizer, once ``steps`` top-level forward calls in a row have raised neither the peak
nor the most memory held after a call. The peak is taken from the first
top-level forward of a model on: what the script held on the host before it (a checkpoint being
loaded) is host memory in a GPU run.

What it sees is every storage made while the script runs: the step's (weights, gradients,
optimizer states, activations, temporaries) and the host's (a batch before it is copied to the
device). The peak's composition (:attr:`Truth.at_peak`) itemises the comparison with the
emulated GPU's figure.
"""

from __future__ import annotations

import contextlib
import gc
import runpy
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..errors import TraceError
from ..events import Action, EventLog
from ..results import MemoryReport
from ..trace.flex import eager_hop_calls
from ..trace.recorder import describe
from .runner import caused_by


class _Enough(BaseException):
    pass


@dataclass
class Truth:
    """A real CPU run's storage peak."""

    peak: int = 0
    at_peak: list[tuple[str, int]] = field(default_factory=list)
    """(description, bytes) of every storage live at the peak, largest first."""
    steps: int = 0
    forwards: int = 0


def _tracker() -> Any:
    """The model zoo's storage tracker (``trace.testing``'s: live bytes of CPU storages as ops
    make and free them), with each storage's description and the step's peak composition."""
    from ..trace.testing import _storage_peak_mode

    class Tracker(_storage_peak_mode()):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            self.desc: dict[int, str] = {}
            self.skip_wrappers = True  # (functional collectives' AsyncCollectiveTensor holds no memory)
            self.await_collectives = True
            """A functional collective's wait returns once gloo's worker thread has let its work go
            (``_await_release``): torchtitan's expert-parallel all-to-all output otherwise stayed
            allocated into the next part of the step on a loaded machine (a ``[2048, 64]`` fp32
            buffer in tests/test_torchtitan.py's EP run), where a GPU frees it at once."""
            self.stepping = False
            """Set at the first top-level forward: the peak is the step's (a host-side checkpoint
            being loaded, which a GPU run keeps on the host, is not the step's memory)."""
            self.step_peak = 0
            self._peak_sizes: dict[int, int] = {}
            self._peak_desc: dict[int, str] = {}

        def add(self, t: torch.Tensor) -> None:
            before = len(self.live)
            super().add(t)
            if len(self.live) != before:
                self.desc[t.untyped_storage()._cdata] = describe(t)
            self.mark_peak()

        def mark_peak(self) -> None:
            if self.stepping and self.current > self.step_peak:  # (dict copies: cheap)
                self.step_peak = self.current
                self._peak_sizes = dict(self.sizes)
                self._peak_desc = {k: self.desc.get(k, "?") for k in self._peak_sizes}

        def composition(self) -> list[tuple[str, int]]:
            """(description, bytes) of the storages live at the peak, largest first."""
            return sorted(((self._peak_desc[k], n) for k, n in self._peak_sizes.items()), key=lambda x: -x[1])

    from ..trace.flex import register_dense_rules

    register_dense_rules(Tracker)  # (higher-order operators are dispatched by the mode's exact class)
    return Tracker()


@contextlib.contextmanager
def _stops(truth: Truth, steps: int, tracker: Any) -> Iterator[None]:
    import torch.optim.optimizer as oo

    depth = [0]
    optimizers = [0]
    init = oo.Optimizer.__init__

    def counted_init(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        optimizers[0] += 1

    def step_post(opt: Any, args: Any, kwargs: Any) -> None:
        truth.steps += 1
        gc.collect()
        if truth.steps >= steps:
            raise _Enough

    def pre(mod: nn.Module, args: Any) -> None:
        # weights made where the tracker does not see (a loader's worker threads) are the model's
        # all the same: a GPU run holds them on the device. Every module called, at any depth (a
        # teacher or reward model called inside the student's forward, a head used by weight only)
        for t in (*mod.parameters(), *mod.buffers()):
            tracker.add(t)
        if not depth[0]:
            if not tracker.stepping and next(mod.parameters(), None) is not None:
                tracker.stepping = True
                tracker.mark_peak()
        depth[0] += 1

    grown = [-1, -1, 0]  # the peak and the most held after a call so far, calls since either grew

    def post(mod: nn.Module, args: Any, out: Any) -> None:
        depth[0] -= 1
        if depth[0] == 0:
            truth.forwards += 1
            if optimizers[0] or torch.is_grad_enabled():
                return
            # as vramplan run stops an inference script: once `steps` calls in a row have raised
            # neither the peak nor the most memory held after a call
            if tracker.step_peak > grown[0] or tracker.current > grown[1]:
                grown[0], grown[1], grown[2] = tracker.step_peak, max(grown[1], tracker.current), 0
            else:
                grown[2] += 1
            if truth.forwards >= steps and grown[2] >= steps:
                raise _Enough

    handles = [oo.register_optimizer_step_post_hook(step_post),
               nn.modules.module.register_module_forward_pre_hook(pre),
               nn.modules.module.register_module_forward_hook(post, always_call=True)]
    oo.Optimizer.__init__ = counted_init  # type: ignore[method-assign]
    try:
        yield
    finally:
        oo.Optimizer.__init__ = init  # type: ignore[method-assign]
        for h in handles:
            h.remove()


@contextlib.contextmanager
def _foreach_on_the_host() -> Iterator[None]:
    """torch.optim's default implementation as on CUDA: ``foreach`` (every parameter's
    temporaries of a step at once), where on the CPU it would take the single-tensor loop
    (torch 2.13 ``optim/optimizer.py`` ``_default_to_fused_or_foreach``: ``foreach`` only for the
    devices of ``_get_foreach_kernels_supported_devices()``, which leaves out the CPU). The foreach
    ops run on the CPU too; an optimizer the script configures itself (``foreach=False``,
    ``fused=True``) is left as it asks. Without this the two runs' optimizer steps differ by the
    code path, not by vramplan (−17.9 % on a 2-layer MLP's step)."""
    import torch.optim.optimizer as optimizer

    devices = getattr(optimizer, "_get_foreach_kernels_supported_devices", None)
    if devices is None:  # (a torch that decides it elsewhere: the CPU's own default stays)
        yield
        return
    optimizer._get_foreach_kernels_supported_devices = lambda: [*devices(), "cpu"]  # type: ignore[attr-defined]
    try:
        yield
    finally:
        optimizer._get_foreach_kernels_supported_devices = devices  # type: ignore[attr-defined]


def cpu_truth(path: str | Path, argv: Sequence[str] = (), *, steps: int = 2, prelude: str | Path | None = None) -> Truth:
    """Run the script for real on the CPU (see the module docstring). The script's
    ``torch.distributed`` collectives return once gloo has let go of their buffers
    (:func:`~vramplan.trace.testing._c10d_waits_release`), as its functional collectives' waits
    do (the tracker's ``await_collectives``). ``prelude``: a Python file run first, untracked (a
    library call that only works on CUDA answered on the CPU, where the script as written cannot
    run there otherwise; the caller names why)."""
    from ..trace.testing import _c10d_waits_release

    p = Path(path)
    if prelude is not None:
        runpy.run_path(str(prelude), run_name="__vramplan_prelude__")
    truth = Truth()
    tracker = _tracker()
    saved_argv, saved_path = sys.argv, list(sys.path)
    sys.argv = [str(p), *argv]
    sys.path.insert(0, str(p.parent))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with _stops(truth, steps, tracker), eager_hop_calls(), _foreach_on_the_host(), tracker, tracker.resizes(), \
                _c10d_waits_release():
            try:
                runpy.run_path(str(p), run_name="__main__")
            except _Enough:
                pass
            except SystemExit as e:
                if e.code not in (None, 0):
                    raise
            except BaseException as e:
                if not caused_by(e, _Enough):
                    raise
    finally:
        sys.argv = saved_argv
        sys.path[:] = saved_path
        torch.set_num_threads(threads)
    if truth.steps == 0 and truth.forwards == 0:
        raise TraceError(f"{p.name} ran no forward on the CPU (it exited first, e.g. on a GPU-count check): "
                         "there is no real run to compare with", hint="run a script that trains or infers on the CPU")
    truth.peak = tracker.step_peak
    truth.at_peak = tracker.composition()
    return truth



@dataclass(frozen=True)
class Comparison:
    """``vramplan run``'s figure against a real CPU run's, the difference itemised.

    ``predicted`` is the allocated peak (the allocator's 512-byte blocks; CUDA-only workspaces
    left out: ``run_script(..., workspaces=False)``); ``requested`` the bytes the trace's live
    storages asked for at its own peak, so ``rounding = predicted - requested`` is the caching
    allocator's rounding. The storages live at each peak are matched by dtype and shape; the
    unmatched ones on either side (``only_predicted``, ``only_truth``) are the rest of the
    difference: ``requested - truth = sum(only_predicted) - sum(only_truth)``."""

    predicted: int
    truth: int
    requested: int
    rounding: int
    only_predicted: tuple[tuple[str, int], ...]
    only_truth: tuple[tuple[str, int], ...]
    relaid: tuple[tuple[str, str, int], ...] = ()
    """(predicted, truth, bytes): the same bytes in another shape on each side (a CUDA kernel's
    layout, e.g. flash attention's ``[B, H, T, 1]`` log-sum-exp against the CPU's ``[B, H, T]``)."""
    paths: tuple[tuple[str, int, int], ...] = ()
    """(why, predicted bytes, truth bytes) of the storages that exist on one side only because CUDA
    and the CPU run different code (the entry's known code-path differences)."""

    @property
    def error(self) -> float:
        return (self.predicted - self.truth) / self.truth

    @property
    def residual(self) -> int:
        """``requested - truth`` once the code-path differences are set aside: what is neither
        allocator rounding nor a different code path (0 when both peaks hold the same storages)."""
        return self.requested - self.truth - sum(p - t for _, p, t in self.paths)

    @property
    def unexplained(self) -> int:
        """What matching and rounding leave (0 when both peaks hold the same storages)."""
        return self.requested - self.truth - (sum(n for _, n in self.only_predicted)
                                              - sum(n for _, n in self.only_truth)
                                              + sum(p - t for _, p, t in self.paths))


def live_at_peak(log: EventLog) -> tuple[int, list[tuple[str, int]]]:
    """(requested bytes, (desc, bytes) of each storage) live at the log's requested-bytes peak."""
    live: dict[int, tuple[int, int]] = {}
    now = peak = 0
    best: dict[int, tuple[int, int]] = {}
    alloc, free, deferred = int(Action.ALLOC), int(Action.FREE), int(Action.FREE_DEFERRED)
    for k in range(len(log)):
        a = log.action[k]
        if a == alloc:
            live[log.id[k]] = (log.size[k], log.desc[k])
            now += log.size[k]
            if now > peak:
                peak, best = now, dict(live)
        elif a in (free, deferred):
            gone = live.pop(log.id[k], None)
            if gone is not None:
                now -= gone[0]
    return peak, sorted(((log.strings[d], n) for n, d in best.values()), key=lambda x: -x[1])


def _unmatched(left: list[tuple[str, int]], right: list[tuple[str, int]],
               key: Any) -> tuple[list[tuple[str, int]], list[tuple[str, int]], list[tuple[Any, Any]]]:
    """Pair items of ``left`` and ``right`` with equal ``key``; the unpaired ones of each side."""
    pool: dict[Any, list[tuple[str, int]]] = {}
    for item in right:
        pool.setdefault(key(item), []).append(item)
    lonely, pairs = [], []
    for item in left:
        bucket = pool.get(key(item))
        if bucket:
            pairs.append((item, bucket.pop()))
        else:
            lonely.append(item)
    return lonely, [x for b in pool.values() for x in b], pairs


DROPOUT_MASKS = ("dropout masks: CUDA's fused dropout (native_dropout) keeps a 1-byte bool mask per "
                 "element, the CPU's dropout a mask in the input's dtype")


def _without(items: list[tuple[str, int]], gone: list[tuple[str, int]]) -> list[tuple[str, int]]:
    """``items`` less one occurrence of each item of ``gone`` (a multiset difference)."""
    left = list(items)
    for g in gone:
        left.remove(g)
    return left


def _dropout_masks(pred: list[tuple[str, int]],
                   truth: list[tuple[str, int]]) -> tuple[list[tuple[str, int]], list[tuple[str, int]]]:
    """The unmatched ``bool[S]`` storages of the prediction paired with unmatched floating
    ``dtype[S]`` storages of the truth (the same shape): dropout's mask on each side."""
    floats = ("f32", "bf16", "f16", "f64")
    pool: dict[str, list[tuple[str, int]]] = {}
    for item in truth:
        dtype, _, shape = item[0].partition("[")
        if dtype in floats and shape:
            pool.setdefault(shape, []).append(item)
    p, t = [], []
    for item in pred:
        dtype, _, shape = item[0].partition("[")
        if dtype == "bool" and pool.get(shape):
            p.append(item)
            t.append(pool[shape].pop())
    return p, t


def compare(report: MemoryReport, truth: Truth, known: Sequence[tuple[str, str]] = ()) -> Comparison:
    """Itemise ``report`` (a ``vramplan run`` report) against ``truth`` (see :class:`Comparison`);
    ``known``: (regular expression on ``dtype[shape]``, why) of storages that only one side has
    because CUDA and the CPU run different code."""
    import re

    if report.events is None:
        raise ValueError("the report has no event log (trace method only)")
    requested, pred = live_at_peak(report.events)
    only_pred, only_truth, _ = _unmatched(pred, truth.at_peak, key=lambda x: x)
    only_pred, only_truth, relaid = _unmatched(only_pred, only_truth, key=lambda x: x[1])
    paths = []
    masks = _dropout_masks(only_pred, only_truth)
    if masks[0] or masks[1]:
        only_pred, only_truth = _without(only_pred, masks[0]), _without(only_truth, masks[1])
        paths.append((DROPOUT_MASKS, sum(n for _, n in masks[0]), sum(n for _, n in masks[1])))
    for pattern, why in known:
        rx = re.compile(pattern)
        p = [x for x in only_pred if rx.fullmatch(x[0])]
        t = [x for x in only_truth if rx.fullmatch(x[0])]
        only_pred = [x for x in only_pred if x not in p]
        only_truth = [x for x in only_truth if x not in t]
        paths.append((why, sum(n for _, n in p), sum(n for _, n in t)))
    return Comparison(predicted=report.peak.allocated, truth=truth.peak, requested=requested,
                      rounding=report.peak.allocated - requested,
                      only_predicted=tuple(sorted(only_pred, key=lambda x: -x[1])),
                      only_truth=tuple(sorted(only_truth, key=lambda x: -x[1])),
                      relaid=tuple((a[0], b[0], a[1]) for a, b in relaid), paths=tuple(paths))


def cpu_truth_world(path: str | Path, argv: Sequence[str] = (), *, world: int, steps: int = 2,
                    timeout: float = 600.0, forked: bool = False, prelude: str | Path | None = None,
                    ranks: list[Truth] | None = None, env: dict[str, str] | None = None) -> Truth:
    """The script launched as ``world`` processes on the CPU (as ``torchrun --nproc-per-node
    WORLD`` would: ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, a local rendezvous; the script's own
    ``init_process_group`` picks gloo on the CPU), each tracked as :func:`cpu_truth` does; the
    truth of rank 0 (what ``vramplan run -- torchrun …`` emulates).

    ``forked``: the ranks are forked from the fork server of
    :func:`vramplan.trace.testing.fork_context` (its preloaded libraries, one thread each) instead
    of started as new interpreters — the same run, without importing torch and the script's
    libraries once per rank. ``prelude``: as :func:`cpu_truth`'s, in every rank. ``ranks``: a list
    that receives every rank's truth (rank 0 first). ``env``: variables set in every rank
    (over this process's: e.g. a ``PYTHONPATH`` for the script's libraries)."""
    import json
    import os
    import socket
    import subprocess
    import tempfile

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        procs: list[Any] = []
        for rank in range(world):
            rank_env = {**os.environ, **(env or {}), "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world),
                   "LOCAL_WORLD_SIZE": str(world), "GROUP_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                   "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"}
            out = Path(tmp) / f"rank{rank}.json"
            if forked:
                from ..trace.testing import fork_context

                proc = fork_context().Process(target=_forked_rank, args=(str(out), steps, str(path), list(argv), rank_env,
                                                                         None if prelude is None else str(prelude)))
                proc.start()
                procs.append(proc)
                continue
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "vramplan.script.truth", str(out), str(steps), "" if prelude is None else
                 str(prelude), str(path), *argv], env=rank_env,
                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True))
        errors = []
        for p in procs:
            if forked:
                p.join(timeout)
                if p.is_alive():
                    p.kill()
                    p.join()
                err_file = Path(tmp) / f"rank{procs.index(p)}.json.err"
                if p.exitcode:
                    errors.append(err_file.read_text(errors="replace")[-2000:] if err_file.exists() else
                                  f"exit {p.exitcode}")
                continue
            try:
                _, err = p.communicate(timeout=timeout)
            except subprocess.TimeoutExpired:
                p.kill()
                _, err = p.communicate()
            if p.returncode:
                errors.append(err[-2000:])
        if errors:
            raise RuntimeError(f"a rank of the CPU run failed: {errors[0]}")
        found = []
        for rank in range(world):
            d = json.loads((Path(tmp) / f"rank{rank}.json").read_text())
            found.append(Truth(peak=d["peak"], at_peak=[tuple(x) for x in d["at_peak"]],  # type: ignore[misc]
                               steps=d["steps"], forwards=d["forwards"]))
    if ranks is not None:
        ranks[:] = found
    return found[0]


def _forked_rank(out: str, steps: int, script: str, argv: list[str], env: dict[str, str],
                 prelude: str | None = None) -> None:
    """One rank of :func:`cpu_truth_world` in a forked process (``forked=True``)."""
    import json
    import os

    import torch

    os.environ.clear()
    os.environ.update(env)
    sys.path[:0] = [d for d in env.get("PYTHONPATH", "").split(os.pathsep) if d and d not in sys.path]
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)  # (as the new interpreters' output: discarded; errors kept beside the result)
    os.dup2(os.open(out + ".err", os.O_WRONLY | os.O_CREAT | os.O_TRUNC), 2)
    torch.set_num_threads(1)  # (OMP_NUM_THREADS=1 is read when torch loads: the server loaded it)
    t = cpu_truth(script, argv, steps=steps, prelude=prelude)
    Path(out).write_text(json.dumps({"peak": t.peak, "at_peak": t.at_peak, "steps": t.steps, "forwards": t.forwards}))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # (no interpreter teardown: a gloo thread still joinable then can abort it)


def _rank_main() -> int:
    """``python -m vramplan.script.truth OUT STEPS PRELUDE SCRIPT ARGS…``: one rank of
    :func:`cpu_truth_world` (``PRELUDE``: empty for none)."""
    import json

    out, steps, prelude, script, *argv = sys.argv[1:]
    t = cpu_truth(script, argv, steps=int(steps), prelude=prelude or None)
    Path(out).write_text(json.dumps({"peak": t.peak, "at_peak": t.at_peak, "steps": t.steps, "forwards": t.forwards}))
    return 0


if __name__ == "__main__":
    raise SystemExit(_rank_main())
