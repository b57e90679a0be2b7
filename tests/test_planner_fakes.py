"""Small fakes shared by the planner tests: a model, GPUs, and an estimator with a known
memory formula (so that the searches can be checked against the exact answer).

The fake "trace" is the fake "analytic" formula distorted (×1.03 + 300 MiB), so that a
search shaped by the analytic curve has to recalibrate to find the traced boundary.
"""

from __future__ import annotations

import dataclasses

from vramplan.hardware.gpu import GPU
from vramplan.models.spec import Family, ModelSpec
from vramplan.precision import precision_model
from vramplan.results import Breakdown, MemoryReport, OverheadItem, Peak, Verdict
from vramplan.workload import Attention, Checkpointing, Method, Optimizer, Peft, Phase, Workload

MiB = 1 << 20
GiB = 1 << 30

LLAMA = ModelSpec(
    name="llama-3.1-8b", hub_id=None, family=Family.DENSE, source="test", config={},
    hidden=4096, layers=32, heads=32, kv_heads=8, head_dim=128, intermediate=14336,
    vocab=128256, max_positions=131072, params=8_030_261_248, active_params=8_030_261_248,
)
SMALL = dataclasses.replace(
    LLAMA, name="small-1b", hidden=2048, layers=16, heads=16, kv_heads=8, head_dim=128,
    intermediate=8192, params=1_235_814_400, active_params=1_235_814_400,
)
CNN = ModelSpec(name="cnn", hub_id=None, family=Family.OTHER, source="test", config={},
                params=25_000_000)


def gpu(key: str, gib: int, *, bf16: float | None = 165, bw: float = 1.0e12, nvlink: float | None = None,
        fp32: float = 80.0) -> GPU:
    return GPU(key=key, name=key.upper(), vendor="nvidia", arch="ada", capacity=gib * GiB, bandwidth=bw,
               bf16_tflops=bf16, fp16_tflops=bf16 or 65, fp32_tflops=fp32,
               interconnect="NVLink" if nvlink else None, interconnect_bw=nvlink, pcie_gen=4)


RTX4090 = gpu("rtx-4090", 24)
RTX4060 = gpu("rtx-4060", 8, bf16=60, bw=0.27e12)
H100 = gpu("h100-sxm", 80, bf16=989, bw=3.35e12, nvlink=900e9)
A100 = gpu("a100-80gb", 80, bf16=312, bw=2.0e12, nvlink=600e9)
GPUS = {g.key: g for g in (RTX4090, RTX4060, H100, A100)}
OVERHEAD = 500 * MiB


def usable(g: GPU) -> int:
    """The catalog's rule (the searches re-derive verdicts with it)."""
    from vramplan.hardware.catalog import usable_capacity

    return usable_capacity(g)[0]


def formula(spec: ModelSpec, w: Workload) -> Breakdown:
    """A plausible per-GPU memory model with the right monotonicities."""
    p = w.parallel
    n_params = spec.params / (p.tp * p.pp)
    if w.peft is Peft.QLORA:
        weights, trainable = 0.56 * n_params, 0.005 * n_params
    elif w.peft is Peft.LORA:
        weights, trainable = 2.0 * n_params, 0.005 * n_params
    else:
        weights, trainable = float(precision_model(w).weight) * n_params, n_params
    pb = 4 if w.peft is not Peft.NONE else precision_model(w).weight
    states = {Optimizer.ADAMW: 2 * pb, Optimizer.ADAM: 2 * pb, Optimizer.ADAMW_8BIT: 2,
              Optimizer.ADAFACTOR: 0.1 * pb, Optimizer.SGD: 0}.get(w.optimizer, 2 * pb)
    grads = trainable * pb
    opt = trainable * states
    if p.zero >= 1:
        opt /= p.dp
    if p.zero >= 2:
        grads /= p.dp
    if p.zero == 3:
        weights /= p.dp
    if p.offload_optimizer:
        opt = 0
    if p.offload_params:
        weights *= 0.1
    if not w.training:
        grads = opt = 0
        weights = float(precision_model(w).compute) * n_params
    per_token = {Checkpointing.NONE: 34, Checkpointing.SELECTIVE: 12, Checkpointing.OP: 10,
                 Checkpointing.FULL: 2}[w.checkpointing]
    if w.checkpointing is not Checkpointing.NONE:
        per_token = per_token * w.checkpoint_fraction + 34 * (1 - w.checkpoint_fraction)
    cb = precision_model(w).compute
    tokens = w.batch * w.seq
    act = tokens * spec.hidden * spec.layers * per_token * cb / 2 / p.tp
    if w.attention is Attention.EAGER:
        act += w.batch * spec.heads * w.seq * w.seq * spec.layers * cb * (1 if w.checkpointing is Checkpointing.NONE else 0.05)
    if not w.training:
        act = tokens * spec.hidden * 8 * cb
    temps = tokens * spec.vocab * 4 * (2 if w.training else 1)
    return Breakdown(weights=int(weights), gradients=int(grads), optimizer=int(opt),
                     activations=int(act), temporaries=int(temps))


class FakeEstimator:
    """Stands in for engine.estimate; counts calls by method."""

    def __init__(self, *, trace_ok: bool = True) -> None:
        self.calls: list[tuple[str, Workload]] = []
        self.trace_ok = trace_ok

    def __call__(self, spec: ModelSpec, w: Workload, *, gpu: GPU | None = None, method: str = "auto",
                 alloc_conf: str | None = None, num_gpus: int = 1, search_max_batch: bool = True) -> MemoryReport:
        m = Method(method)
        if m is not Method.ANALYTIC and not self.trace_ok:
            m = Method.ANALYTIC
        if spec.family is Family.OTHER and m is Method.ANALYTIC:
            from vramplan.errors import WorkloadError

            raise WorkloadError("no analytic formulas for this model", hint="use --method trace")
        self.calls.append((str(Method.TRACE if m is not Method.ANALYTIC else Method.ANALYTIC), w))
        b = formula(spec, w)
        alloc = b.total
        if m is not Method.ANALYTIC:
            extra = int(alloc * 0.03) + 300 * MiB
            b = dataclasses.replace(b, temporaries=b.temporaries + extra)
            alloc = b.total
            m = Method.TRACE
        reserved = int(alloc * 1.05)
        peak = Peak(allocated=alloc, reserved=reserved, device_used=reserved + OVERHEAD)
        verdict = None
        if gpu is not None:
            u = usable(gpu)
            verdict = Verdict(gpu=gpu.key, gpu_name=gpu.name, capacity=gpu.capacity, usable=u,
                              fits=peak.device_used <= u, headroom=u - peak.device_used, max_batch=None,
                              num_gpus=num_gpus)
        return MemoryReport(
            model=spec.name, params=spec.params,
            trainable_params=spec.params if w.peft is Peft.NONE else int(0.005 * spec.params), workload=w, method=m,
            breakdown=b, overhead=(OverheadItem("cuda context", OVERHEAD, "fake"),), peak=peak,
            peak_phase=Phase.BACKWARD, verdict=verdict,
            flops_per_step=None if m is Method.ANALYTIC else 6.0 * spec.params * w.batch * w.seq,
        )

    @property
    def traces(self) -> int:
        return sum(1 for m, _ in self.calls if m == "trace")


def device_used(spec: ModelSpec, w: Workload, *, traced: bool) -> int:
    """The fake estimator's device_used, for computing exact expected answers."""
    b = formula(spec, w)
    alloc = b.total
    if traced:
        alloc += int(alloc * 0.03) + 300 * MiB
    return int(alloc * 1.05) + OVERHEAD


def test_fake_trace_is_above_fake_analytic():
    w = Workload(batch=2, seq=1024)
    est = FakeEstimator()
    a = est(LLAMA, w, gpu=H100, method="analytic")
    t = est(LLAMA, w, gpu=H100, method="trace")
    assert t.peak.device_used > a.peak.device_used
    assert t.peak.device_used == device_used(LLAMA, w, traced=True)
    assert est.traces == 1


@dataclasses.dataclass(frozen=True)
class FakeInstance:
    provider: str
    name: str
    gpu: str
    count: int
    usd_per_hour: float
    region: str = "us-east-1"
    source: str = "test price list"
    date_read: str = "2026-01"


INSTANCES = [
    FakeInstance("cloud", "h100x1", "h100-sxm", 1, 3.0),
    FakeInstance("cloud", "h100x8", "h100-sxm", 8, 20.0),
    FakeInstance("cloud", "a100x8", "a100-80gb", 8, 12.0),
    FakeInstance("cloud", "4090x1", "rtx-4090", 1, 0.5),
]


def screen_for(spec: ModelSpec, est: FakeEstimator | None = None):
    """A Screen over the fake estimator with the fake overhead and usable capacity."""
    from vramplan.planner.evaluator import Evaluator, Screen

    ev = Evaluator(spec, estimator=est or FakeEstimator())
    return Screen(ev, overhead=lambda g, w: OVERHEAD, usable=usable)
