"""The computations behind the page, as plain functions a worker process can run.

Each returns an :class:`Outcome` instead of raising: a user mistake (a
:class:`~vramplan.errors.VramplanError`) travels back as its one-line message and field,
anything else as a one-line bug report, so nothing depends on exceptions surviving pickling.
The estimate goes through the root API (``vramplan.estimate``, ``vramplan.fit``,
``vramplan.plan``), the same calls the CLI makes.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass
from typing import Any

from vramplan.errors import VramplanError
from vramplan.workload import Method

from .params import Query, field_of, page_message


@dataclass(frozen=True)
class Outcome:
    value: Any = None
    error: str | None = None
    field: str | None = None
    bug: bool = False
    """True when the error is not the user's (an exception that is not a VramplanError)."""
    over_budget: bool = False
    """True when the job was stopped at the page's time budget (:mod:`vramplan.web.jobs`)."""

    @property
    def ok(self) -> bool:
        return self.error is None


def _run(fn: Any, q: Query, *args: Any) -> Outcome:
    try:
        return Outcome(value=fn(q, *args))
    except VramplanError as e:
        return Outcome(error=page_message(e), field=field_of(e, q.explicit))
    except Exception as e:  # a bug: one line, never a traceback on the page
        first = (str(e).strip().splitlines() or [""])[0][:300]
        return Outcome(error=f"internal error ({e.__class__.__name__}: {first})", bug=True)


def estimate(q: Query) -> Outcome:
    """``vramplan estimate MODEL … --method M``: the MemoryReport."""
    return _run(_estimate, q)


def _estimate(q: Query) -> Any:
    import vramplan

    report = vramplan.estimate(q.spec(), q.workload, gpu=q.gpu, method=q.method)
    # the event log (the snapshot download re-traces) would only weigh on the pickling and the cache
    return report.replace(events=None)


def fit(q: Query) -> Outcome:
    """``vramplan fit MODEL --gpu G … --method M``: the FitResult."""
    return _run(_fit, q)


def _fit(q: Query) -> Any:
    import vramplan
    from vramplan.errors import PlanError

    if q.gpu is None:
        raise PlanError("fit needs a GPU", hint="choose a GPU")
    return vramplan.fit(q.spec(), q.workload, gpu=q.gpu, method=q.method)


def plan(q: Query, opts: dict[str, Any]) -> Outcome:
    """``vramplan plan MODEL --gpu G …``: the PlanResult (``opts``: plan's search flags)."""
    return _run(_plan, q, opts)


def _plan(q: Query, opts: dict[str, Any]) -> Any:
    import vramplan
    from vramplan.errors import PlanError

    if q.gpu is None:
        raise PlanError("plan needs a GPU", hint="choose a GPU")
    return vramplan.plan(q.spec(), q.workload, gpu=q.gpu, method=q.method,
                         max_gpus=opts.get("gpus") or q.workload.parallel.world_size,
                         budget=opts.get("budget"), allow_peft=bool(opts.get("allow_peft")),
                         global_batch=opts.get("global_batch"), sort=opts.get("sort") or "speed",
                         confirm=0 if q.method is Method.ANALYTIC else 3)


def rank(q: Query, opts: dict[str, Any]) -> Outcome:
    """``vramplan plan MODEL --rank-gpus …``: the Ranking of catalog GPUs and instances."""
    return _run(_rank, q, opts)


def _rank(q: Query, opts: dict[str, Any]) -> Any:
    from vramplan.planner.rank import rank_gpus

    return rank_gpus(q.spec(), q.workload, max_gpus=opts.get("gpus") or 1,
                     allow_peft=bool(opts.get("allow_peft")), global_batch=opts.get("global_batch"),
                     budget=opts.get("budget"), method=q.method, sort=opts.get("sort") or "cost",
                     confirm=0 if q.method is Method.ANALYTIC else 3)


def snapshot(q: Query) -> Outcome:
    """The predicted memory snapshot (pickle bytes, PyTorch's format) of a traced estimate."""
    return _run(_snapshot, q)


def _snapshot(q: Query) -> bytes:
    import vramplan
    from vramplan.snapshot.export import PROTOCOL, predicted_snapshot

    if q.method is Method.ANALYTIC:
        raise VramplanError("a predicted snapshot needs an event trace", hint="set the method to trace")
    report = vramplan.estimate(q.spec(), q.workload, gpu=q.gpu, method=Method.TRACE)
    events = report.events
    if events is None:  # pragma: no cover - a trace always has events
        raise VramplanError("this estimate has no event trace", hint="set the method to trace")
    return pickle.dumps(predicted_snapshot(events, report=report), protocol=PROTOCOL)


def warm() -> bool:
    """Import what a trace needs, so that the first trace does not pay for it."""
    import importlib

    import vramplan

    vramplan.estimate  # noqa: B018 - the root API resolves its module lazily
    for name in ("vramplan.trace.run", "transformers"):
        try:
            importlib.import_module(name)
        except ImportError:  # pragma: no cover - the models extra is optional
            pass
    return True


def serve(q: Query, opts: dict[str, Any]) -> Outcome:
    """``vramplan serve-plan MODEL --gpu G …``: the ServePlan (``opts``: ``serve_plan``'s keywords;
    TP and PP are the query's layout)."""
    from .params import serve_field

    try:
        return Outcome(value=_serve(q, opts))
    except VramplanError as e:
        return Outcome(error=page_message(e), field=serve_field(e))
    except Exception as e:  # a bug: one line, never a traceback on the page
        first = (str(e).strip().splitlines() or [""])[0][:300]
        return Outcome(error=f"internal error ({e.__class__.__name__}: {first})", bug=True)


def _serve(q: Query, opts: dict[str, Any]) -> Any:
    from vramplan.errors import PlanError
    from vramplan.serving.api import serve_plan

    if q.gpu is None:
        raise PlanError("serve-plan needs a GPU", hint="choose a GPU")
    p = q.workload.parallel
    return serve_plan(q.spec(), q.gpu, tp=p.tp, pp=p.pp, **opts)
