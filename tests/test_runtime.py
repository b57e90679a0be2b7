"""Runtime model: FLOP conventions, roofline bound, communication and offload terms."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vramplan.errors import WorkloadError
from vramplan.hardware.gpu import GPU
from vramplan.models.flops import attention_flops, layout_of, train_flops
from vramplan.models.shape import model_shape
from vramplan.models.spec import Family, ModelSpec
from vramplan.runtime import DEFAULT_EFFICIENCY, Bound, Efficiency, step_time
from vramplan.runtime.adapters import adapter_params
from vramplan.runtime.comm import Link, all_gather, all_reduce, link_for
from vramplan.runtime.traffic import optimizer_bytes_per_param
from vramplan.workload import Workload

LLAMA = ModelSpec(
    name="llama-3.1-8b", hub_id=None, family=Family.DENSE, source="test", config={},
    hidden=4096, layers=32, heads=32, kv_heads=8, head_dim=128, intermediate=14336,
    vocab=128256, max_positions=131072, params=8_030_261_248, active_params=8_030_261_248,
)
H100 = GPU(key="h100-sxm", name="H100 SXM", vendor="nvidia", arch="hopper", capacity=80 * 2**30,
           bandwidth=3.35e12, bf16_tflops=989, fp16_tflops=989, fp32_tflops=66.9, tf32_tflops=494,
           interconnect="NVLink 4", interconnect_bw=900e9, pcie_gen=5)
RTX = GPU(key="rtx-4090", name="RTX 4090", vendor="nvidia", arch="ada", capacity=24 * 2**30,
          bandwidth=1.008e12, bf16_tflops=165, fp16_tflops=165, fp32_tflops=82.6, pcie_gen=4)
W = Workload(batch=4, seq=2048)


def test_training_is_six_n_tokens_plus_attention():
    s = model_shape(LLAMA)
    f = train_flops(layout_of(s), W, 4, 2048)
    tokens = 4 * 2048
    attn = attention_flops(layout_of(s), W, 4, 2048)
    assert f.total == pytest.approx(6 * s.matmul_params * tokens + 3 * attn)
    # the embedding lookup is no matmul; the untied head is
    assert s.matmul_params == LLAMA.params - LLAMA.vocab * LLAMA.hidden


def test_causal_flash_attention_does_half_the_eager_work():
    s = layout_of(model_shape(LLAMA))
    sdpa = attention_flops(s, W, 1, 4096)
    eager = attention_flops(s, W.replace(attention="eager"), 1, 4096)
    assert sdpa / eager == pytest.approx(0.5, rel=1e-3)
    assert eager == pytest.approx(4 * 4096 * 4096 * LLAMA.hidden * LLAMA.layers)


def test_lora_backward_skips_weight_grads_and_checkpointing_adds_a_forward():
    s = model_shape(LLAMA)
    f = layout_of(s)
    full = train_flops(f, W, 1, 2048)
    adapters = adapter_params(s, W.replace(peft="lora"))
    lora = train_flops(layout_of(s, adapters=adapters, trains_base=False), W.replace(peft="lora"), 1, 2048)
    assert 0.6 < lora.total / full.total < 0.72  # ≈ 4N/6N plus attention and adapters
    ckpt = train_flops(f, W.replace(checkpointing="full"), 1, 2048)
    head = 2 * s.head_params * 2048
    assert ckpt.recompute == pytest.approx(full.forward - head)
    half = train_flops(f, W.replace(checkpointing="full", checkpoint_fraction=0.5), 1, 2048)
    assert half.recompute == pytest.approx(ckpt.recompute / 2)


def test_lora_adapter_count_matches_rank_times_dims():
    w = W.replace(peft="lora", lora_rank=16)
    per_layer = 16 * ((4096 + 4096) + 2 * (4096 + 1024) + (4096 + 4096))
    assert adapter_params(model_shape(LLAMA), w) == per_layer * 32


def test_large_training_step_is_compute_bound_with_plausible_mfu():
    t = step_time(LLAMA, W, H100)
    assert t.bound is Bound.COMPUTE
    assert 0.3 < t.mfu < 0.5
    assert t.tokens_per_step == 4 * 2048
    assert t.tokens_per_s == pytest.approx(t.tokens_per_step / t.total)
    assert t.total >= t.compute


def test_decode_is_memory_bound_and_scales_with_bandwidth():
    w = Workload(task="generate", batch=1, seq=512, new_tokens=256, precision="bf16")
    fast, slow = step_time(LLAMA, w, H100), step_time(LLAMA, w, RTX)
    assert fast.bound is Bound.MEMORY and slow.bound is Bound.MEMORY
    assert slow.total / fast.total == pytest.approx(3.35 / 1.008, rel=0.15)
    assert fast.tokens_per_step == 256
    # ~16 GB of bf16 weights read per token at 80 % of 3.35 TB/s: ~6 ms/token
    assert 4e-3 < fast.total / 256 < 9e-3


def test_quantised_weights_decode_faster_at_batch_1_only():
    w = Workload(task="generate", batch=1, seq=512, new_tokens=256, precision="bf16")
    assert step_time(LLAMA, w.replace(quant="nf4"), H100).total < 0.5 * step_time(LLAMA, w, H100).total
    # at batch 8 bitsandbytes dequantises to 16-bit first: slower than bf16 weights
    w8 = w.replace(batch=8)
    assert step_time(LLAMA, w8.replace(quant="nf4"), H100).total > step_time(LLAMA, w8, H100).total


def test_autocast_inference_recasts_fp32_weights_every_step():
    w = Workload(task="generate", batch=1, seq=512, new_tokens=256, precision="bf16")
    mixed = step_time(LLAMA, w.replace(precision="bf16-mixed"), H100)
    assert mixed.total / step_time(LLAMA, w, H100).total == pytest.approx(4.0, rel=0.15)  # 8 B vs 2 B per weight


def test_optimizer_offload_is_offload_bound_on_one_gpu():
    t = step_time(LLAMA, W.replace(batch=1, zero=2, offload_optimizer=True), RTX)
    assert t.bound is Bound.OFFLOAD
    assert t.offload > 0 and t.offload <= t.offload_total + 1e-12
    assert any("optimizer offload" in n for n in t.notes)


def test_ring_collectives_follow_the_textbook_volumes():
    link = Link(100e9, "test")
    eff = dataclasses.replace(DEFAULT_EFFICIENCY, collective_latency=0.0)
    assert all_reduce(8e9, 8, link, eff) == pytest.approx(2 * 7 / 8 * 8e9 / 100e9)
    assert all_gather(8e9, 8, link, eff) == pytest.approx(7 / 8 * 8e9 / 100e9)
    assert all_reduce(8e9, 1, link, eff) == 0.0


def test_links_nvlink_pcie_and_infiniband():
    eff = DEFAULT_EFFICIENCY
    assert link_for(H100, 8, False, eff).bandwidth == pytest.approx(450e9 * eff.link)
    assert "PCIe 4.0" in link_for(RTX, 2, False, eff).name
    assert "InfiniBand" in link_for(H100, 16, True, eff).name


def test_catalog_link_strings_bridge_and_lanes():
    eff = DEFAULT_EFFICIENCY
    a100_pcie = dataclasses.replace(H100, key="a100-pcie", interconnect="NVLink bridge (2 GPUs) / PCIe 4.0 x16",
                                    interconnect_bw=600e9, pcie_gen=4)
    assert link_for(a100_pcie, 2, False, eff).name == "NVLink bridge (2 GPUs)"
    assert link_for(a100_pcie, 4, False, eff).name == "PCIe 4.0 x16"
    x8 = dataclasses.replace(RTX, interconnect="PCIe 4.0 x8", interconnect_bw=32e9)
    assert link_for(x8, 2, False, eff).bandwidth == pytest.approx(31.5e9 / 2 * eff.link)


def test_ddp_comm_is_hidden_behind_a_long_backward_but_not_a_short_one():
    big = step_time(LLAMA, W.replace(dp=8), H100)
    assert big.comm_total > 0 and big.comm == pytest.approx(0.0)
    tiny = step_time(LLAMA, W.replace(batch=1, seq=128, dp=8), RTX)
    assert tiny.comm > 0


def test_zero3_moves_1_5x_the_ddp_volume():
    eff = dataclasses.replace(DEFAULT_EFFICIENCY, collective_latency=0.0)
    w = Workload(batch=1, seq=1024, precision="bf16")  # params and grads both 2 B
    ddp = step_time(LLAMA, w.replace(dp=8), H100, eff=eff)
    z3 = step_time(LLAMA, w.replace(dp=8, zero=3), H100, eff=eff)
    assert z3.comm_total / ddp.comm_total == pytest.approx(1.5, rel=1e-6)


def test_tensor_parallel_communication_is_exposed():
    t = step_time(LLAMA, W.replace(tp=8), RTX)
    assert t.comm > 0 and t.comm == pytest.approx(t.comm_total)


def test_pipeline_bubble_is_p_minus_1_over_m_plus_p_minus_1():
    w = W.replace(batch=1, pp=4, grad_accum=8, optimizer_impl="fused")
    t = step_time(LLAMA, w, H100)
    pipelined = t.total - t.comm - t.offload  # includes a small optimizer step
    assert t.bubble / pipelined == pytest.approx(3 / (8 + 3), rel=0.1)
    more = step_time(LLAMA, w.replace(grad_accum=32), H100)
    assert more.bubble / (more.total - more.comm - more.offload) < t.bubble / pipelined


def test_fp32_uses_fp32_rate_unless_tf32():
    w = W.replace(precision="fp32")
    plain = step_time(LLAMA, w, H100)
    tf32 = step_time(LLAMA, w, H100, eff=Efficiency(tf32=True))
    assert "fp32" in plain.rate_name and "tf32" in tf32.rate_name
    assert tf32.total < plain.total


def test_traced_flops_replace_the_formula():
    a = step_time(LLAMA, W.replace(task="infer"), H100, flops=1e15)
    b = step_time(LLAMA, W.replace(task="infer"), H100, flops=2e15)
    assert b.compute == pytest.approx(2 * a.compute)
    assert "trace" in a.flops_source


def test_non_transformer_without_flops_is_a_clear_error():
    # the catalog gives a ResNet a "hidden" and "layers": they must not be read as a transformer's
    cnn = ModelSpec(name="resnet-50", hub_id=None, family=Family.OTHER, source="t", config={},
                    params=25_000_000, hidden=2048, layers=16)
    with pytest.raises(WorkloadError, match="`method=trace`"):
        step_time(cnn, Workload(batch=32), H100)
    step_flops = 3 * 8.2e9 * 32  # fwd + bwd of 32 images
    t = step_time(cnn, Workload(batch=32), H100, flops=step_flops)
    assert t.tokens_per_step == 0 and t.samples_per_s > 0 and t.bound is Bound.COMPUTE
    # traced FLOPs cover the whole step: two micro-batches of 16 are the same work
    t2 = step_time(cnn, Workload(batch=16, grad_accum=2), H100, flops=step_flops)
    assert t2.flops == pytest.approx(t.flops)


def test_vit_reports_samples_and_counts_patches():
    vit = ModelSpec(name="vit-base", hub_id=None, family=Family.VIT, source="t", config={}, hidden=768,
                    layers=12, heads=12, head_dim=64, intermediate=3072, image_size=224, patch_size=16,
                    params=86_000_000, active_params=86_000_000)
    t = step_time(vit, Workload(batch=64, image_size=224), H100)
    assert t.tokens_per_step == 0 and t.samples_per_step == 64
    assert t.flops == pytest.approx(6 * 86e6 * 64 * 197, rel=0.25)


def test_gpu_without_rates_is_a_clear_error():
    bare = GPU(key="x", name="x", vendor="nvidia", arch="?", capacity=2**30, bandwidth=1e11)
    with pytest.raises(WorkloadError, match="no FLOP rates"):
        step_time(LLAMA, W, bare)


def test_optimizer_traffic_of_mixed_adamw_is_28_bytes_fused():
    assert optimizer_bytes_per_param(W.replace(optimizer_impl="fused")) == 28
    assert optimizer_bytes_per_param(W.replace(optimizer="adamw-8bit")) < 28


def test_to_dict_is_json_ready():
    import json

    d = step_time(LLAMA, W, H100).to_dict()
    assert json.loads(json.dumps(d))["bound"] == "compute"


@settings(max_examples=40, deadline=None)
@given(b=st.integers(1, 64), seq=st.sampled_from([128, 512, 2048, 8192]),
       task=st.sampled_from(["train", "infer", "generate"]))
def test_step_time_grows_with_batch_and_components_bound_the_total(b, seq, task):
    w = Workload(task=task, batch=b, seq=seq)
    t1, t2 = step_time(LLAMA, w, RTX), step_time(LLAMA, w.replace(batch=b + 1), RTX)
    assert t2.total >= t1.total
    assert t1.total >= max(t1.comm, t1.offload)
    assert t1.total >= min(t1.compute, t1.memory)
    assert t1.bound in set(Bound)
