"""DeepSpeed ZeRO (engine=deepspeed): DeepSpeed's defaults, buffers and estimators, checked
against the installed deepspeed's own code."""

from __future__ import annotations

import pytest

from vramplan.analytic import deepspeed as ds
from vramplan.analytic import estimate
from vramplan.errors import WorkloadError
from vramplan.models.catalog import resolve
from vramplan.workload import Parallel, Workload

deepspeed = pytest.importorskip("deepspeed")


def _w(**par) -> Workload:
    return Workload(parallel=Parallel(**par))


def test_defaults_are_deepspeeds():
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    c = DeepSpeedZeroConfig()
    s = ds.DEFAULTS
    assert (s.reduce_bucket_size, s.allgather_bucket_size, s.prefetch_bucket_size, s.max_live_parameters,
            s.param_persistence_threshold, s.sub_group_size, s.contiguous_gradients) == (
        c.reduce_bucket_size, c.allgather_bucket_size, c.prefetch_bucket_size, c.max_live_parameters,
        c.param_persistence_threshold, c.sub_group_size, c.contiguous_gradients)
    for stage in (1, 2, 3):
        assert s.overlap(stage) == DeepSpeedZeroConfig(stage=stage).overlap_comm


@pytest.mark.parametrize("gpus", [1, 4, 8, 16, 64])
@pytest.mark.parametrize("zero, opt, par", [(1, False, False), (2, False, False), (2, True, False),
                                            (3, False, False), (3, True, False), (3, True, True)])
def test_host_ram_is_deepspeeds_estimate(gpus, zero, opt, par):
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

    total, largest = 8_030_261_248, 525_336_576
    per_node, nodes = min(gpus, 8), max(1, gpus // 8)
    w = _w(dp=gpus, zero=zero, offload_optimizer=opt, offload_params=par)
    if zero == 3:
        expected = estimate_zero3_model_states_mem_needs(total, largest, per_node, nodes, cpu_offload=opt,
                                                         cpu_offload_params=par, zero_init=True)[0]
    else:
        expected = estimate_zero2_model_states_mem_needs(total, per_node, nodes, cpu_offload=opt)[0]
    assert ds.host_ram(w, total, largest) == expected


def test_zero2_model_states_match_deepspeeds_gpu_estimate():
    """2Ψ + 18Ψ/N: 16-bit params, 16-bit grad partition, fp32 master + Adam states, and the
    fp32 gradient partition the step builds (the comment in estimate_zero2_model_states_mem_needs)."""
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

    spec = resolve("llama-3.2-1b")
    e = estimate(spec, _w(dp=8, zero=2, engine="deepspeed"))
    s = e.states
    assert s.weights + s.gradients + s.optimizer + 4 * e.params // 8 == \
        estimate_zero2_model_states_mem_needs(e.params, 8, 1, cpu_offload=False)[1]


def test_reduce_buckets_are_model_sized_independent():
    spec = resolve("llama-3.2-1b")

    def grads_at_peak(**par):
        e = estimate(spec, _w(dp=8, **par))
        return max(p.breakdown.gradients for p in e.phases)

    bucket = ds.DEFAULTS.reduce_bucket_size * 2  # bf16
    assert grads_at_peak(zero=2, engine="deepspeed") - grads_at_peak(zero=2) == bucket
    assert grads_at_peak(zero=1, engine="deepspeed") - grads_at_peak(zero=1) == bucket
    assert ds.reduce_buckets(2, 2, ds.ZeroSettings(overlap_comm=True)) == 2 * bucket
    assert ds.reduce_buckets(2, 2, ds.ZeroSettings(contiguous_gradients=False)) == 0


def test_zero3_gathers_a_submodule_plus_the_prefetch_bucket():
    assert ds.gathered(100, 2) == (100 + 50_000_000) * 2
    assert ds.gathered(2_000_000_000, 2) == 2_000_000_000 * 2  # one parameter beyond max_live: itself
    spec = resolve("llama-3.1-8b")
    fsdp = estimate(spec, _w(dp=8, zero=3))
    dsp = estimate(spec, _w(dp=8, zero=3, engine="deepspeed"))
    # FSDP gathers a whole block (+ the prefetched one); DeepSpeed one Linear + 5e7 elements
    assert max(p.breakdown.weights for p in dsp.phases) < max(p.breakdown.weights for p in fsdp.phases)


def test_engine_validation():
    with pytest.raises(WorkloadError, match="DDP does not shard"):
        Parallel(dp=8, zero=2, engine="ddp")
    with pytest.raises(WorkloadError, match="no ZeRO-1"):
        Parallel(dp=8, zero=1, engine="fsdp")
    with pytest.raises(WorkloadError, match="invalid `engine`"):
        Parallel(engine="horovod")
    with pytest.raises(WorkloadError, match="dp_shard"):
        Parallel(dp=16, zero=3, dp_shard=8, engine="deepspeed")
