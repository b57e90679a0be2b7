"""Per-family behaviour of the analytic estimator, and the checks that name the fix."""

from __future__ import annotations

import pytest

from test_analytic_specs import (
    bert_base,
    deepseek_v3,
    gpt2,
    llama_8b,
    llama_70b,
    mixtral_8x7b,
    resnet_50,
    vit_base,
)
from vramplan.analytic import check_against_model, estimate
from vramplan.errors import WorkloadError
from vramplan.workload import Parallel, Phase, Workload


def _train(**kw):
    return Workload(task="train", batch=2, seq=1024, **kw)


def test_training_reports_forward_backward_and_optimizer_phases():
    est = estimate(llama_8b(), _train())
    assert [p.phase for p in est.phases] == [Phase.FORWARD, Phase.BACKWARD, Phase.OPTIMIZER]
    assert est.peak.allocated == max(p.allocated for p in est.phases)
    assert est.flops_per_step > 0 and est.notes


def test_generate_reports_prefill_and_decode():
    est = estimate(llama_8b(), Workload(task="generate", precision="bf16", batch=4, seq=512, new_tokens=64))
    assert [p.phase for p in est.phases] == [Phase.PREFILL, Phase.DECODE]
    prefill, decode = est.phases
    assert decode.breakdown.kv_cache > prefill.breakdown.kv_cache
    assert prefill.breakdown.weights == decode.breakdown.weights == est.states.weights


def test_generate_prefill_computes_last_position_logits_only():
    w = Workload(task="generate", precision="bf16", batch=1, seq=8192, new_tokens=1)
    infer = estimate(llama_8b(), w.replace(task="infer"))
    prefill = estimate(llama_8b(), w).phases[0]
    all_logits = 8192 * 128256 * 2  # a plain forward makes bf16 logits for every position
    assert infer.phases[0].breakdown.activations >= all_logits
    assert prefill.breakdown.activations < all_logits / 2  # prefill: the last position only


def test_gpt2_eager_attention_costs_the_score_matrices():
    eager = estimate(gpt2(), _train(attention="eager"))
    sdpa = estimate(gpt2(), _train(attention="sdpa"))
    per_layer = eager.activations_per_layer - sdpa.activations_per_layer
    # fp32 softmax (autocast) + dropout mask + dropped 16-bit probabilities per head and key
    assert per_layer == pytest.approx(2 * 1024 * 1024 * 12 * (4 + 1 + 2), rel=0.01)


def test_gpt2_composite_gelu_saves_four_intermediates():
    plain = gpt2()
    fused = plain.__class__(**{**plain.__dict__, "config": {**plain.config, "activation_function": "gelu"}})
    w = _train(precision="bf16")
    diff = estimate(plain, w).activations_per_layer - estimate(fused, w).activations_per_layer
    assert diff == 3 * 2 * 1024 * 3072 * 2  # three more [tokens, 3072] bf16 tensors


def test_bert_trains_and_infers_but_does_not_generate():
    est = estimate(bert_base(), Workload(task="train", batch=16, seq=512))
    assert est.peak.breakdown.activations > 0
    assert estimate(bert_base(), Workload(task="infer", batch=16, seq=512)).peak.breakdown.kv_cache == 0
    with pytest.raises(WorkloadError, match="does not generate"):
        estimate(bert_base(), Workload(task="generate", seq=128))


def test_bert_rejects_sequences_beyond_its_positions():
    with pytest.raises(WorkloadError, match="512 learned positions"):
        estimate(bert_base(), Workload(task="train", seq=1024))


def test_vit_tokens_follow_the_image_size():
    small = estimate(vit_base(), Workload(task="train", batch=32, image_size=224))
    large = estimate(vit_base(), Workload(task="train", batch=32, image_size=448))
    # 197 vs 785 tokens: activations grow ~4× (attention core is flash, linear in tokens)
    ratio = large.activations_per_layer / small.activations_per_layer
    assert ratio == pytest.approx(785 / 197, rel=0.01)
    with pytest.raises(WorkloadError, match="patch size 16"):
        estimate(vit_base(), Workload(task="train", image_size=230))


def test_non_transformers_are_left_to_the_trace():
    with pytest.raises(WorkloadError, match="`method=trace`"):
        estimate(resnet_50(), Workload(task="train"))


def test_mixtral_expert_parallel_splits_expert_weights_only():
    w = Workload(task="train", precision="bf16", batch=1, seq=1024)
    one = estimate(mixtral_8x7b(), w.replace(dp=8))
    ep8 = estimate(mixtral_8x7b(), w.replace(dp=8, ep=8))
    experts = 32 * 8 * 3 * 4096 * 14336
    assert one.states.weights - ep8.states.weights == pytest.approx(2 * experts * 7 / 8, rel=1e-6)


def test_moe_activations_scale_with_top_k():
    spec = mixtral_8x7b()
    top1 = spec.__class__(**{**spec.__dict__, "experts_per_token": 1})
    w = Workload(task="train", precision="bf16", batch=1, seq=1024)
    assert estimate(spec, w).activations_per_layer > estimate(top1, w).activations_per_layer


def test_deepseek_v3_generate_fits_tp8_with_compressed_cache():
    w = Workload(task="generate", precision="bf16", batch=1, seq=4096, new_tokens=256, parallel=Parallel(tp=8))
    est = estimate(deepseek_v3(), w)
    assert est.states.weights == pytest.approx(2 * 671e9 / 8, rel=0.02)
    assert est.kv_cache < 2**30  # latent cache; HF's old per-head cache would be ~160× larger
    assert est.phases[-1].breakdown.temporaries > 0  # per-layer re-expansion of the latent


def test_lora_trains_adapters_only():
    w = Workload(task="train", peft="lora", lora_rank=16, batch=1, seq=2048)
    est = estimate(llama_8b(), w)
    r, h, kv = 16, 4096, 1024
    adapters = 32 * r * ((h + h) * 2 + (h + kv) * 2)  # q, o: 4096→4096; k, v: 4096→1024
    assert est.trainable_params == adapters
    assert est.states.gradients == 4 * adapters  # fp32 adapters (PEFT autocast_adapter_dtype)
    assert est.states.optimizer == 8 * adapters
    assert est.states.weights == pytest.approx(2 * 8_030_261_248 + 4 * adapters, rel=1e-6)


def test_all_linear_lora_targets_the_mlp_too():
    w = Workload(task="train", peft="lora", lora_targets=("all-linear",), batch=1, seq=512)
    default = estimate(llama_8b(), w.replace(lora_targets=("q_proj", "k_proj", "v_proj", "o_proj")))
    assert estimate(llama_8b(), w).trainable_params > default.trainable_params


def test_qlora_base_is_about_a_quarter_of_16_bit():
    w = Workload(task="train", peft="lora", batch=1, seq=2048, checkpointing="full")
    lora = estimate(llama_8b(), w)
    qlora = estimate(llama_8b(), w.replace(peft="qlora"))
    linear = 32 * 218_103_808  # the layers' linear weights
    rest = lora.states.weights - 2 * linear  # 16-bit embeddings, head, norms + fp32 adapters
    bits = (qlora.states.weights - rest) * 8 / linear
    assert bits == pytest.approx(4.127, abs=0.01)  # NF4 + double-quantised absmax
    assert qlora.peak.allocated < lora.peak.allocated


def test_lora_with_unknown_targets_names_the_linears():
    w = Workload(task="train", peft="lora", lora_targets=("query_key_value",))
    with pytest.raises(WorkloadError, match="q_proj, k_proj"):
        estimate(llama_8b(), w)


def test_lora_targets_beyond_the_layers_linears_are_refused_not_left_out():
    """peft wraps ``lm_head`` or ``embed_tokens`` when asked (the trace counts their adapters); the
    analytic method models adapters on the layers' linears only, so it refuses rather than leave
    them out. Default targets a model partly lacks are skipped, as peft skips them."""
    for extra in ("lm_head", "embed_tokens", "layers.0.self_attn.q_proj"):
        w = Workload(task="train", peft="lora", lora_targets=("q_proj", extra))
        with pytest.raises(WorkloadError, match=f"LoRA target {extra}: the analytic method") as e:
            estimate(llama_8b(), w)
        assert e.value.field == "lora_targets" and "method=trace" in e.value.hint
    est = estimate(llama_8b(), Workload(task="train", peft="lora", lora_targets=("q_proj", "v_proj"), lora_rank=8))
    assert est.trainable_params == 32 * 8 * ((4096 + 4096) + (4096 + 1024))


def test_modules_to_save_are_refused_by_the_analytic_method():
    with pytest.raises(WorkloadError, match="lora_modules_to_save") as e:
        estimate(llama_8b(), Workload(task="train", peft="lora", lora_modules_to_save="lm_head"))
    assert e.value.field == "lora_modules_to_save"


def test_dora_is_refused_by_the_analytic_method():
    with pytest.raises(WorkloadError, match="DoRA: the analytic method") as e:
        estimate(llama_8b(), Workload(task="train", peft="lora", lora_dora=True))
    assert e.value.field == "lora_dora" and "method=trace" in e.value.hint


def test_default_lora_targets_map_to_bert_attention():
    est = estimate(bert_base(), Workload(task="train", peft="lora", lora_rank=8, batch=2, seq=128))
    assert est.trainable_params > 0


def test_inference_quantisation_shrinks_weights():
    w = Workload(task="infer", precision="bf16", batch=1, seq=1024)
    base = estimate(llama_8b(), w).states.weights
    linear = 32 * 218_103_808  # the layers' linear weights; the rest stays 16-bit
    for quant, per_param in (("int8", 1.0), ("nf4", 0.5 + 4 / 64), ("fp8", 1.0)):
        q = estimate(llama_8b(), w.replace(quant=quant)).states.weights
        assert base - q == pytest.approx(linear * (2 - per_param), rel=0.002), quant


def test_offloading_the_optimizer_frees_its_states():
    w = Workload(task="train", batch=1, seq=1024, parallel=Parallel(dp=8, zero=2, offload_optimizer=True))
    est = estimate(llama_8b(), w)
    assert est.states.optimizer == 0
    assert est.states.gradients == 0


def test_zero3_param_offload_keeps_only_gathered_layers():
    w = Workload(task="train", batch=1, seq=1024,
                 parallel=Parallel(dp=8, zero=3, offload_params=True, offload_optimizer=True))
    est = estimate(llama_8b(), w)
    assert est.states.weights == 0
    assert 0 < est.phases[0].breakdown.weights < 3 * 2**30


def test_pipeline_reports_the_heaviest_stage():
    w = Workload(task="train", precision="bf16", batch=1, seq=4096, grad_accum=8, parallel=Parallel(pp=4))
    est = estimate(llama_70b(), w)
    single = estimate(llama_70b(), w.replace(pp=1))
    assert est.stage in (0, 3)
    assert est.states.total < single.states.total / 3
    assert any("stage" in n for n in est.notes)


def test_grad_accumulation_keeps_gradients_through_the_forward():
    one = estimate(llama_8b(), _train())
    accum = estimate(llama_8b(), _train(grad_accum=4))
    assert one.phases[0].breakdown.gradients == 0
    assert accum.phases[0].breakdown.gradients == accum.states.gradients


@pytest.mark.parametrize("parallel,match", [
    (Parallel(tp=3), r"`tp=3` does not divide 32 attention heads of llama-3\.1-8b.*use 1, 2, 4, 8"),
    (Parallel(pp=40), r"40 pipeline stages cannot be cut from 32 layers"),
    (Parallel(dp=2, ep=2), r"`ep=2` needs a mixture-of-experts model"),
    (Parallel(cp=3), r"`cp=3` does not divide the sequence length 2048"),
    (Parallel(pp=4), r"at least 4 micro-batches.*`grad_accum=4`"),
])
def test_check_against_model_names_the_fix(parallel, match):
    with pytest.raises(WorkloadError, match=match):
        check_against_model(llama_8b(), Workload(task="train", seq=2048, parallel=parallel))


def test_tp_must_divide_kv_heads():
    with pytest.raises(WorkloadError, match="`tp=16` does not divide 8 key/value heads"):
        check_against_model(llama_70b(), Workload(task="infer", parallel=Parallel(tp=16)))


def test_expert_parallel_must_divide_experts():
    with pytest.raises(WorkloadError, match="does not divide 8 experts"):
        check_against_model(mixtral_8x7b(), Workload(task="train", parallel=Parallel(dp=16, ep=16)))


def test_estimate_is_fast():
    import time

    w = Workload(task="train", batch=4, seq=4096, parallel=Parallel(tp=2, dp=4, zero=1), grad_accum=4)
    start = time.perf_counter()
    for _ in range(20):
        estimate(deepseek_v3(), w)
    assert (time.perf_counter() - start) / 20 < 0.05
