"""Does vramplan work on torch X? Install X into a throwaway venv and run the suite there.

    python bench/compat.py 2.6.0                 # the torch-sensitive subset (trace, estimate, CLI)
    python bench/compat.py 2.6.0 --full          # the whole suite
    python bench/compat.py 2.6.0 --keep          # keep the venv (printed) for a rerun

The venv lives in a temporary folder (``--where``, default /tmp) and is deleted afterwards
(a CUDA torch wheel with its NVIDIA libraries takes 3–6 GB). torch comes from the package
index pip is configured with (PyPI: its default Linux wheels are CUDA builds); the rest of
``.[dev]`` is resolved by pip for that torch. The tests run against this checkout's ``src``.

One JSON line per run is appended to ``bench/results/compat.jsonl``: torch version, the
versions pip picked for transformers/peft/diffusers, install and test seconds, the counts
of passed/failed/errored/skipped tests, the most common failure messages and the ids of the
failing ones. The supported range
in ``pyproject.toml`` and the README is the lowest version with a green record here.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results" / "compat.jsonl"
SUBSET = [
    "tests/test_trace_core.py", "tests/test_trace_features.py", "tests/test_trace_agreement.py",
    "tests/test_trace_cuda.py", "tests/test_trace_errors.py", "tests/test_trace_models.py",
    "tests/test_trace_memtracker.py", "tests/test_estimate_pipeline.py", "tests/test_cli_basic.py",
    "tests/test_analytic_torch.py", "tests/test_models_build.py",
]
"""The tests that exercise torch internals (trace, checkpoint, autocast, SDPA, model builds)."""
PACKAGES = ("torch", "transformers", "peft", "diffusers", "numpy")


def _run(cmd: list[str], **kw: object) -> subprocess.CompletedProcess[str]:
    print("+", " ".join(cmd), flush=True)
    return subprocess.run(cmd, text=True, capture_output=True, **kw)  # type: ignore[call-overload,no-any-return]


def _versions(py: Path) -> dict[str, str | None]:
    code = ("import importlib.metadata as m, json, sys\n"
            "out = {}\n"
            f"for p in {PACKAGES!r}:\n"
            "    try: out[p] = m.version(p)\n"
            "    except m.PackageNotFoundError: out[p] = None\n"
            "print(json.dumps(out))")
    r = _run([str(py), "-c", code])
    return json.loads(r.stdout) if r.returncode == 0 else {}


def _dev_requirements() -> list[str]:
    """The package's dependencies and its ``dev`` extra (expanded), torch left out."""
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    reqs: list[str] = list(project["dependencies"])
    todo = list(extras["dev"])
    while todo:
        r = todo.pop()
        if r.startswith(project["name"] + "["):
            todo += [x for e in r[r.index("[") + 1:r.index("]")].split(",") for x in extras[e.strip()]]
        else:
            reqs.append(r)
    return [r for r in reqs if not r.replace(" ", "").startswith("torch")]


def _junit(path: Path) -> dict[str, object]:
    suites = ET.parse(path).getroot()
    counts = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
    failing: list[str] = []
    for s in suites.iter("testsuite"):
        for k in counts:
            counts[k] += int(s.get(k, 0))
    causes: Counter[str] = Counter()
    for case in suites.iter("testcase"):
        bad = case.find("failure")
        if bad is None:
            bad = case.find("error")
        if bad is not None:
            failing.append(f"{case.get('classname')}::{case.get('name')}")
            causes[(bad.get("message") or "").strip().splitlines()[0][:200] if bad.get("message") else "?"] += 1
    passed = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    return {"passed": passed, "failed": counts["failures"], "errors": counts["errors"],
            "skipped": counts["skipped"], "causes": dict(causes.most_common(8)), "failing": failing}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("torch", help="torch version to install, e.g. 2.6.0")
    ap.add_argument("--full", action="store_true", help="run the whole suite, not the torch-sensitive subset")
    ap.add_argument("--where", default=tempfile.gettempdir(), help="folder for the throwaway venv")
    ap.add_argument("--keep", action="store_true", help="keep the venv afterwards")
    ap.add_argument("--workers", default="2", help="pytest-xdist workers (-n)")
    args = ap.parse_args(argv)

    venv = Path(tempfile.mkdtemp(prefix=f"vramplan-torch{args.torch}-", dir=args.where))
    py, pip = venv / "bin" / "python", venv / "bin" / "pip"
    record: dict[str, object] = {
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "torch_requested": args.torch, "python": platform.python_version(),
        "selection": "full" if args.full else "subset",
    }
    try:
        t0 = time.monotonic()
        pin = f"torch=={args.torch}"
        steps = [
            [sys.executable, "-m", "venv", str(venv)],
            [str(pip), "install", "-q", pin],
            # the dev dependencies with torch held at the version under test (the package's
            # own torch floor would otherwise make pip replace it), then the package itself
            [str(pip), "install", "-q", pin, *_dev_requirements()],
            [str(pip), "install", "-q", "--no-deps", "-e", str(ROOT)],
        ]
        for cmd in steps:
            r = _run(cmd)
            if r.returncode != 0:
                record.update(status="install failed", step=" ".join(cmd[1:4]),
                              error=(r.stderr.strip().splitlines() or [""])[-1][:300])
                return _finish(record, 1)
        record["install_s"] = round(time.monotonic() - t0, 1)
        record["versions"] = versions = _versions(py)
        if not str(versions.get("torch") or "").startswith(args.torch):
            record.update(status="install mismatch", error=f"venv has torch {versions.get('torch')}")
            return _finish(record, 1)

        junit = venv / "junit.xml"
        env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
        t1 = time.monotonic()
        r = _run([str(py), "-m", "pytest", "-n", args.workers, "-p", "no:cacheprovider", "-q",
                  f"--junitxml={junit}", *([] if args.full else SUBSET)], cwd=ROOT, env=env)
        record["tests_s"] = round(time.monotonic() - t1, 1)
        print(r.stdout[-3000:], r.stderr[-2000:], sep="\n")
        if not junit.exists():
            record.update(status="pytest did not run", error=(r.stderr.strip().splitlines() or [""])[-1][:300])
            return _finish(record, 1)
        record.update(_junit(junit))
        record["status"] = "green" if r.returncode == 0 else "red"
        return _finish(record, 0 if r.returncode == 0 else 1)
    finally:
        if args.keep:
            print(f"venv kept: {venv}")
        else:
            shutil.rmtree(venv, ignore_errors=True)


def _finish(record: dict[str, object], rc: int) -> int:
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    with RESULTS.open("a") as f:
        f.write(json.dumps(record) + "\n")
    print(json.dumps(record, indent=1))
    return rc


if __name__ == "__main__":
    raise SystemExit(main())
