"""One precision model read by the analytic formulas, the trace's set-up and the step-time
model (issue 9: under PEFT the time model saw 4-byte weights while the memory model saw 2)."""

import itertools

import pytest

from vramplan.analytic.regime import regime
from vramplan.errors import VramplanError
from vramplan.precision import precision_model
from vramplan.runtime import traffic
from vramplan.trace import features
from vramplan.workload import Peft, Precision, Quant, Workload


def _combos():
    for prec, peft, quant, zero, task in itertools.product(Precision, Peft, Quant, (0, 1, 3), ("train", "infer")):
        try:
            w = Workload(task=task, precision=prec, peft=peft if task == "train" else "none", quant=quant)
            if zero:
                w = w.replace(dp=2, zero=zero)
        except VramplanError:
            continue
        yield w


COMBOS = list(dict.fromkeys(_combos()))


def test_there_are_many_combinations():
    assert len(COMBOS) >= 40


@pytest.mark.parametrize("w", COMBOS, ids=lambda w: f"{w.task}-{w.precision}-{w.peft}-{w.quant}-z{w.parallel.zero}")
def test_analytic_trace_and_runtime_read_the_same_precision(w):
    pm = precision_model(w)
    assert regime(w) == pm  # the analytic formulas
    assert features.param_dtype(w).itemsize == pm.weight  # the trace's stored weights
    assert features.compute_dtype(w).itemsize == pm.compute
    ac = features.autocast_dtype(w)
    assert (ac is not None) is pm.autocast and (ac is None or ac.itemsize == pm.compute)
    if w.quant is Quant.NONE:
        assert traffic.weight_storage_bytes(w) == pm.weight  # the step-time model
        assert traffic.cast_bytes(w) == (pm.weight + pm.compute if pm.autocast and pm.weight != pm.compute else 0)
    if traffic.reads_packed(w):  # fused quantised kernels (Marlin, int4 mm, _scaled_mm) read what is stored
        assert traffic.matmul_weight_bytes(w) == traffic.weight_storage_bytes(w) < pm.compute
    else:
        assert traffic.matmul_weight_bytes(w) == pm.compute


def test_peft_base_is_16_bit_everywhere():
    w = Workload(task="train", precision="bf16-mixed", peft="lora")
    pm = precision_model(w)
    assert pm.weight == 2 and pm.trainable_bytes == 4  # fp32 adapters
    assert traffic.weight_storage_bytes(w) == 2.0  # was 4 in the time model
    assert traffic.cast_bytes(w) == 0.0  # autocast does not copy weights already in bf16
    amp = Workload(task="train", precision="bf16-mixed")
    assert traffic.weight_storage_bytes(amp) == 4.0 and traffic.cast_bytes(amp) == 6.0
