"""``changes_from`` (every plan's "what changed" line) compares fields as they are and converts
only the changed ones; it says what comparing the two whole ``Workload.to_dict`` says."""

from __future__ import annotations

from vramplan.hardware.catalog import get_gpu
from vramplan.planner.space import candidates, changes_from
from vramplan.workload import Workload


def _by_dicts(base: Workload, w: Workload) -> tuple[str, ...]:
    a, b = base.to_dict(), w.to_dict()
    out = []
    for k, v in b.items():
        if k == "parallel":
            out += [f"{pk}: {a[k][pk]} → {pv}" for pk, pv in v.items() if a[k][pk] != pv]
        elif a[k] != v:
            out.append(f"{k}: {a[k]} → {v}")
    return tuple(out)


def test_changes_are_the_whole_dicts_differences() -> None:
    base = Workload(task="train", batch=2, seq=512, precision="fp32")
    found = candidates(base, get_gpu("h100"), max_gpus=8, allow_peft=True,
                       knobs=("checkpointing", "optimizer", "precision"))
    assert len(found) > 100
    seen = set()
    for c in found:
        assert changes_from(base, c.workload) == _by_dicts(base, c.workload)
        seen.update(line.split(":")[0] for line in changes_from(base, c.workload))
    assert {"dp", "zero", "peft", "checkpointing"} <= seen  # (parallel and top-level fields both moved)
    lora = base.replace(peft="lora", lora_targets=("q_proj", "v_proj"))
    assert changes_from(base, lora) == _by_dicts(base, lora) == (
        "peft: none → lora", "lora_targets: ['q_proj', 'k_proj', 'v_proj', 'o_proj'] → ['q_proj', 'v_proj']")
