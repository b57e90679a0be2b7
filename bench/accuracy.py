"""Accuracy of vramplan's predictions against real GPU measurements.

    python bench/accuracy.py                      # on a CUDA machine: measure every case, predict, compare
    python bench/accuracy.py --predict-only       # anywhere: predictions only, errors "n/a"
    python bench/accuracy.py --summarize bench/results/*.jsonl   # the README table from committed results
    python bench/accuracy.py --list

On a GPU each case runs ``vramplan measure`` in a fresh process (``--no-predict``, one at a
time, with a timeout), while the predictions (trace and analytic) are computed in parallel
CPU processes; the merged records go to ``bench/results/<gpu>-<date>.jsonl``. The cases are
sized to take about 8 minutes together on one H200 (141 GB): use ``--only``/``--limit`` on
smaller cards. Relative error = (predicted − measured) / measured.

Cases use catalog models; the one MoE is a documented reduction of a catalog config
(Qwen3-30B-A3B with 4 of its 48 layers), written to a temporary config.json at run time.
QLoRA cases need bitsandbytes and are skipped without it.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
METRICS = ("allocated", "reserved", "device_used")
METHODS = ("trace", "analytic")


@dataclass(frozen=True)
class Case:
    id: str
    model: str
    workload: Mapping[str, Any]
    reduce: Mapping[str, Any] = field(default_factory=dict)
    """Changes to the catalog config (a documented reduced model)."""
    needs: tuple[str, ...] = ()
    """Python packages the measurement needs (skipped without them)."""


def _c(id: str, model: str, needs: tuple[str, ...] = (), reduce: Mapping[str, Any] | None = None,
       **w: Any) -> Case:
    return Case(id, model, w, dict(reduce or {}), needs)


CASES: tuple[Case, ...] = (
    # CNN and vision transformers
    _c("resnet50-train-fp32", "resnet-50", task="train", batch=32, precision="fp32", optimizer="sgd-momentum"),
    _c("resnet50-train-amp", "resnet-50", task="train", batch=64, precision="bf16-mixed"),
    _c("vit-base-train-amp", "vit-base", task="train", batch=32, precision="bf16-mixed"),
    _c("vit-base-infer-bf16", "vit-base", task="infer", batch=128, precision="bf16"),
    # encoders and small decoders
    _c("bert-base-train-amp", "bert-base", task="train", batch=16, seq=512, precision="bf16-mixed"),
    _c("bert-base-infer-fp16", "bert-base", task="infer", batch=64, seq=512, precision="fp16"),
    _c("gpt2-train-fp32", "gpt2", task="train", batch=8, seq=1024, precision="fp32"),
    _c("gpt2-train-fp16-amp", "gpt2", task="train", batch=8, seq=1024, precision="fp16-mixed"),
    _c("gpt2-train-amp-ckpt", "gpt2", task="train", batch=16, seq=1024, precision="bf16-mixed",
       checkpointing="full"),
    # Llama family, 0.5B to 8B
    _c("qwen0.5b-train-bf16", "qwen2.5-0.5b", task="train", batch=4, seq=2048, precision="bf16"),
    _c("qwen0.5b-train-amp", "qwen2.5-0.5b", task="train", batch=4, seq=2048, precision="bf16-mixed"),
    _c("qwen0.5b-generate", "qwen2.5-0.5b", task="generate", batch=8, seq=512, new_tokens=128, precision="bf16"),
    _c("llama1b-train-amp", "llama-3.2-1b", task="train", batch=2, seq=2048, precision="bf16-mixed"),
    _c("llama1b-train-amp-ckpt", "llama-3.2-1b", task="train", batch=8, seq=2048, precision="bf16-mixed",
       checkpointing="full"),
    _c("llama1b-lora", "llama-3.2-1b", task="train", batch=4, seq=2048, precision="bf16", peft="lora"),
    _c("llama1b-infer", "llama-3.2-1b", task="infer", batch=8, seq=2048, precision="bf16"),
    _c("qwen1.5b-train-bf16-ckpt", "qwen2.5-1.5b", task="train", batch=4, seq=2048, precision="bf16",
       checkpointing="full"),
    _c("qwen1.5b-lora-all-linear", "qwen2.5-1.5b", task="train", batch=4, seq=2048, precision="bf16",
       peft="lora", lora_targets="all-linear"),
    _c("qwen3b-train-amp-ckpt", "qwen2.5-3b", task="train", batch=2, seq=2048, precision="bf16-mixed",
       checkpointing="full"),
    _c("qwen3b-generate", "qwen2.5-3b", task="generate", batch=4, seq=1024, new_tokens=128, precision="bf16"),
    _c("llama8b-lora-ckpt", "llama-3.1-8b", task="train", batch=2, seq=2048, precision="bf16", peft="lora",
       checkpointing="full"),
    _c("llama8b-qlora", "llama-3.1-8b", ("bitsandbytes",), task="train", batch=2, seq=2048,
       precision="bf16-mixed", peft="qlora", checkpointing="full"),
    _c("llama8b-infer", "llama-3.1-8b", task="infer", batch=4, seq=4096, precision="bf16"),
    _c("llama8b-generate", "llama-3.1-8b", task="generate", batch=8, seq=1024, new_tokens=64, precision="bf16"),
    # mixture of experts: Qwen3-30B-A3B reduced to 4 of its 48 layers (all 128 experts kept)
    _c("qwen3moe-4l-train-bf16", "qwen3-30b-a3b", reduce={"num_hidden_layers": 4}, task="train", batch=2,
       seq=1024, precision="bf16"),
)


# --------------------------------------------------------------------------- cases → inputs
def workload(case: Case) -> Any:
    from vramplan.workload import Workload

    return Workload(**case.workload)


def model_ref(case: Case, tmp: Path) -> str:
    """The catalog alias, or the path of the reduced config.json written under ``tmp``."""
    if not case.reduce:
        return case.model
    from vramplan.models.catalog import resolve

    cfg = {**dict(resolve(case.model).config), **case.reduce}
    path = tmp / case.id / "config.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(cfg, indent=1))
    return str(path)


def cli_flags(case: Case) -> list[str]:
    out: list[str] = []
    for k, v in case.workload.items():
        out += [f"--{k.replace('_', '-')}", str(v)]
    return out


def select(only: str | None, limit: int | None) -> list[Case]:
    cases = list(CASES)
    if only:
        wanted = [x.strip() for x in only.split(",") if x.strip()]
        known = {c.id: c for c in cases}
        missing = [x for x in wanted if x not in known]
        if missing:
            raise SystemExit(f"error: unknown case(s) {', '.join(missing)} (see --list)")
        cases = [known[x] for x in wanted]
    return cases[:limit] if limit else cases


# --------------------------------------------------------------------------- predicting
def predict_case(case: Case, model: str, gpu: str | None, methods: Sequence[str]) -> dict[str, dict[str, Any]]:
    """Predictions of one case as plain dicts (runs in a worker process)."""
    from vramplan.measure.predict import predict

    return {p.method: p.to_dict() for p in predict(model, workload(case), gpu=gpu, methods=methods)}


def _hide_gpu() -> None:
    """Prediction workers must not create CUDA contexts beside a measurement."""
    os.environ["CUDA_VISIBLE_DEVICES"] = ""


def predict_all(cases: Sequence[Case], models: Mapping[str, str], gpu: str | None, methods: Sequence[str],
                jobs: int) -> dict[str, dict[str, dict[str, Any]]]:
    if jobs <= 1:
        return {c.id: predict_case(c, models[c.id], gpu, methods) for c in cases}
    ctx = multiprocessing.get_context("spawn")  # no fork beside threads and an NVML handle
    with ProcessPoolExecutor(max_workers=jobs, mp_context=ctx, initializer=_hide_gpu) as pool:
        futs = {c.id: pool.submit(predict_case, c, models[c.id], gpu, methods) for c in cases}
        return {k: f.result() for k, f in futs.items()}


# --------------------------------------------------------------------------- measuring
def measure_case(case: Case, model: str, out: Path, timeout: float) -> str:
    """Run ``vramplan measure`` for one case in a fresh process; '' or why it failed."""
    for pkg in case.needs:
        try:
            __import__(pkg)
        except ImportError:
            return f"skipped: needs {pkg}"
    cmd = [sys.executable, "-m", "vramplan.cli.main", "measure", model, *cli_flags(case), "--no-predict",
           "--label", case.id, "--out", str(out), "--format", "json"]
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    except subprocess.TimeoutExpired:
        return f"timed out after {timeout:.0f} s"
    if p.returncode != 0:
        lines = (p.stderr or p.stdout).strip().splitlines()
        return lines[-1] if lines else f"exit code {p.returncode}"
    return ""


def run_gpu(cases: Sequence[Case], args: argparse.Namespace) -> Path:
    from vramplan.hardware.nvml import local_gpus
    from vramplan.measure.record import append_jsonl, errors_of_json, read_jsonl

    gpus = local_gpus()
    key = gpus[0].catalog_key or gpus[0].name.lower().replace(" ", "-")
    out = Path(args.out) if args.out else RESULTS / f"{key}-{time.strftime('%Y%m%d')}.jsonl"
    methods = tuple(args.methods.split(","))
    with tempfile.TemporaryDirectory() as tmp:
        models = {c.id: model_ref(c, Path(tmp)) for c in cases}
        raw = Path(tmp) / "measured.jsonl"
        with ThreadPoolExecutor(max_workers=1) as side:  # predictions run beside the GPU work
            fut = side.submit(predict_all, cases, models, gpus[0].catalog_key, methods, max(2, args.jobs))
            failures = {}
            for c in cases:
                t0 = time.perf_counter()
                why = measure_case(c, models[c.id], raw, args.timeout)
                failures[c.id] = why
                print(f"{c.id:28s} {'ok' if not why else why} ({time.perf_counter() - t0:.0f} s)", file=sys.stderr)
            preds = fut.result()
        measured = {r["id"]: r for r in read_jsonl(raw)} if raw.exists() else {}
    for c in cases:
        rec = measured.get(c.id) or {"schema": "vramplan.measure/1", "id": c.id, "model": c.model,
                                     "workload": dict(c.workload), "measured": None,
                                     "failure": failures[c.id] or "no record"}
        rec["model"] = c.model + (f" (reduced: {json.dumps(dict(c.reduce))})" if c.reduce else "")
        rec["predicted"] = preds.get(c.id, {})
        rec["error"] = errors_of_json(rec)
        append_jsonl(rec, out)
    return out


# --------------------------------------------------------------------------- summarising
def summarize(records: Iterable[Mapping[str, Any]]) -> dict[str, dict[str, dict[str, Any]]]:
    """method → metric → {n, median (of |error|), worst (signed, largest |error|)}."""
    errs: dict[str, dict[str, list[float]]] = {m: {k: [] for k in METRICS} for m in METHODS}
    for r in records:
        for method, per in (r.get("error") or {}).items():
            for metric, e in per.items():
                errs.setdefault(method, {k: [] for k in METRICS}).setdefault(metric, []).append(float(e))
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for method, per in errs.items():
        out[method] = {}
        for metric in METRICS:
            xs = per.get(metric, [])
            out[method][metric] = {
                "n": len(xs),
                "median": statistics.median(abs(x) for x in xs) if xs else None,
                "worst": max(xs, key=abs) if xs else None,
            }
    return out


def _pct(x: float | None, signed: bool = False) -> str:
    if x is None:
        return "n/a"
    return f"{x:+.1%}" if signed else f"{x:.1%}"


def summary_table(summary: Mapping[str, Mapping[str, Mapping[str, Any]]], methods: Sequence[str]) -> str:
    head = "| predicted metric | " + " | ".join(f"{m}: median abs. error | {m}: worst" for m in methods) + " | cases |"
    sep = "|:--|" + "--:|--:|" * len(methods) + "--:|"
    rows = [head, sep]
    for metric in METRICS:
        cells = []
        n = 0
        for m in methods:
            s = summary.get(m, {}).get(metric, {"n": 0, "median": None, "worst": None})
            cells += [_pct(s["median"]), _pct(s["worst"], signed=True)]
            n = max(n, s["n"])
        rows.append(f"| {metric} | " + " | ".join(cells) + f" | {n} |")
    return "\n".join(rows)


def _gib(x: Any) -> str:
    return "n/a" if not isinstance(x, (int, float)) or isinstance(x, bool) else f"{x / 2**30:,.2f}"


def case_table(records: Sequence[Mapping[str, Any]], methods: Sequence[str]) -> str:
    head = ["case", "measured alloc / reserved / used (GiB)"]
    for m in methods:
        head += [f"{m} alloc / reserved / used (GiB)", f"{m} errors"]
    rows = ["| " + " | ".join(head) + " |", "|:--|" + "--:|" * (len(head) - 1)]
    for r in records:
        meas = r.get("measured") or {}
        if meas.get("oom"):
            mtxt = "OOM"
        elif meas:
            mtxt = " / ".join(_gib(meas.get(k)) for k in METRICS)
        else:
            mtxt = r.get("failure") or "not measured"
        cells = [r.get("id") or r.get("model", "?"), mtxt]
        for m in methods:
            p = (r.get("predicted") or {}).get(m) or {}
            if p.get("error"):
                cells += ["–", f"no prediction: {p['error'][:60]}"]
                continue
            cells.append(" / ".join(_gib(p.get(k)) for k in METRICS) if p else "–")
            e = (r.get("error") or {}).get(m) or {}
            cells.append(" / ".join(_pct(e.get(k), signed=True) for k in METRICS))
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


def repredict(records: list[dict[str, Any]], methods: Sequence[str], jobs: int) -> list[dict[str, Any]]:
    """Recompute the predictions of measured records with this vramplan (CPU only)."""
    from vramplan.measure.record import errors_of_json

    known = {c.id: c for c in CASES}
    cases = [known[r["id"]] for r in records if r.get("id") in known]
    gpu = next((r.get("extra", {}).get("gpu") for r in records if r.get("extra", {}).get("gpu")), None)
    with tempfile.TemporaryDirectory() as tmp:
        models = {c.id: model_ref(c, Path(tmp)) for c in cases}
        preds = predict_all(cases, models, gpu, methods, jobs)
    for r in records:
        if r.get("id") in preds:
            r["predicted"] = preds[r["id"]]
            r["error"] = errors_of_json(r)
    return records


# --------------------------------------------------------------------------- main
def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="bench/accuracy.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--only", help="comma-separated case ids (see --list)")
    p.add_argument("--limit", type=int, help="the first N cases")
    p.add_argument("--list", action="store_true", help="list the cases and exit")
    p.add_argument("--predict-only", action="store_true", help="predict without measuring (the default without a GPU)")
    p.add_argument("--summarize", nargs="+", metavar="FILE", help="summarise results .jsonl files")
    p.add_argument("--repredict", action="store_true", help="with --summarize: recompute the predictions now")
    p.add_argument("--methods", default=",".join(METHODS), help="prediction methods (default trace,analytic)")
    p.add_argument("--out", help="results file (default bench/results/<gpu>-<date>.jsonl)")
    p.add_argument("--timeout", type=float, default=150.0, help="seconds per measured case (default 150)")
    p.add_argument("--jobs", type=int, default=max(1, min(8, (os.cpu_count() or 2) - 2)),
                   help="parallel prediction processes")
    return p.parse_args(argv)


def _has_gpu() -> bool:
    try:
        from vramplan.hardware.nvml import local_gpus

        return bool(local_gpus())
    except Exception:  # no NVML, no driver, no device
        return False


def main(argv: Sequence[str] | None = None) -> int:
    args = parse(argv)
    methods = tuple(m.strip() for m in args.methods.split(",") if m.strip())
    bad = [m for m in methods if m not in METHODS]
    if bad:
        print(f"error: unknown method(s) {', '.join(bad)} (use trace and/or analytic)", file=sys.stderr)
        return 2
    if args.list:
        for c in CASES:
            extra = f" reduced {dict(c.reduce)}" if c.reduce else ""
            print(f"{c.id:28s} {c.model}{extra} {' '.join(cli_flags(c))}")
        return 0
    if args.summarize:
        from vramplan.measure.record import read_jsonl

        records = [r for f in args.summarize for r in read_jsonl(f)]
        if args.repredict:
            records = repredict(records, methods, args.jobs)
        print(case_table(records, methods) + "\n")
        print(summary_table(summarize(records), methods))
        return 0
    cases = select(args.only, args.limit)
    if not args.predict_only and _has_gpu():
        out = run_gpu(cases, args)
        from vramplan.measure.record import read_jsonl

        records = list(read_jsonl(out))[-len(cases):]
        print(case_table(records, methods) + "\n")
        print(summary_table(summarize(records), methods))
        print(f"\nresults appended to {out}", file=sys.stderr)
        return 0
    print("no CUDA GPU: prediction-only mode (errors are n/a)", file=sys.stderr)
    with tempfile.TemporaryDirectory() as tmp:
        models = {c.id: model_ref(c, Path(tmp)) for c in cases}
        preds = predict_all(cases, models, None, methods, args.jobs)
    records = [{"id": c.id, "model": c.model, "measured": None, "predicted": preds[c.id], "error": {}} for c in cases]
    print(case_table(records, methods) + "\n")
    print(summary_table(summarize(records), methods))
    return 0


if __name__ == "__main__":
    sys.exit(main())
