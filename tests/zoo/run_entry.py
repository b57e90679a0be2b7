"""One zoo entry, in its own process: ``python tests/zoo/run_entry.py NAME FIXTURES`` prints one
JSON line (the comparison of ``vramplan run`` with the real CPU run, or ``{"skip": why}``)."""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from zoo import ZOO, fixtures  # noqa: E402


def main() -> int:
    name, root = sys.argv[1], Path(sys.argv[2])
    entry = next(e for e in ZOO if e.name == name)
    why = entry.available()
    if why:
        print(json.dumps({"skip": why}))
        return 0
    import vramplan
    from vramplan.script.truth import compare, cpu_truth, cpu_truth_world

    fixtures(root, torchtune=(entry.needs == "torchtune"))
    path = entry.path()
    assert path is not None
    argv = [a.replace("ROOT", str(root)) for a in entry.args]
    t0 = time.perf_counter()
    r = vramplan.run_script(path, argv, gpu="h100-sxm", workspaces=False, steps=entry.steps, world=entry.world,
                            gpus=entry.world)
    t1 = time.perf_counter()
    if entry.world > 1:  # launched as torchrun would: rank 0 of a real gloo run
        truth = cpu_truth_world(path, [*argv, *entry.cpu], world=entry.world, steps=entry.steps)
    else:
        truth = cpu_truth(path, [*argv, *entry.cpu], steps=entry.steps)
    c = compare(r, truth, entry.known)
    out = dataclasses.asdict(c)
    out.update(residual=c.residual, unexplained=c.unexplained, error=c.error, live=len(truth.at_peak),
               ran=r.ran.line() if r.ran else "", params=r.params, run_s=t1 - t0,
               torch=__import__("torch").__version__)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
