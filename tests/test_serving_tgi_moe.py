"""TGI 3.x's fused-MoE buffers from 3.1.1 (the kernel hub's ``kernels-community/moe``) and quantised MoE (Marlin
MoE for AWQ / GPTQ, fp8 w8a8), hand-counted from the source each rule cites (:mod:`vramplan.serving.tgi_moe`;
docs/research/sglang-tgi-public-logs.md § "TGI's MoE from 3.1.1"). No public TGI 3.x Mixtral start-up log was
found, so these check the rule against the code it reads, not against a log."""

from __future__ import annotations

import dataclasses

from vramplan.models.catalog import resolve
from vramplan.pools.tgi_release import TgiRelease
from vramplan.serving import serve_plan, tgi, tgi_moe

M, H, INTER, E, K = 4096, 4096, 14336, 8, 2  # Mixtral-8x7B at 4,096 tokens, one GPU (INTER: expert intermediate)
HELD = 2 * M * 7 * H  # the 7 hidden-sized tensors FlashMixtral keeps through the MoE
LOGITS = 2 * M * E  # router logits [M, E] bf16 / fp16


def _align(rows: int, block: int) -> int:
    padded = rows * K + E * (block - 1)
    return 4 * (padded + -(-padded // block) + 1)


def test_hub_fused_experts_shares_one_cache_for_both_gemm_outputs() -> None:
    """vllm_moe/fused_moe.py ``fused_experts_impl``: ``cache13`` [M·topk·max(2·I, hidden)] (:1306-1314) and
    ``intermediate_cache2`` [M·topk, I] (:1316-1319), bf16; ``topk_weights`` fp32 + ``topk_ids`` int32 [M, 2]
    alive; ``moe_align_block_size`` (BLOCK_SIZE_M 64 for M > E). The hub's ``fused_topk`` (:937-965) keeps the
    fp32 logits and ``token_expert_indicies`` through the renormalization (:914-930)."""
    spec, rel = resolve("mixtral-8x7b"), TgiRelease.of("3.1.1")
    moments = tgi.warmup_moments(spec, M, 1, rel, marlin=False)
    experts = HELD + LOGITS + 8 * M * K + 2 * M * K * (max(2 * INTER, H) + INTER) + _align(M, 64)
    assert moments["fused_experts"] == experts == tgi.warmup_peak(spec, M, 1, rel, marlin=False)
    assert moments["renormalize"] == HELD + LOGITS + 4 * M * E + 16 * M * K + 4 * M
    assert moments["topk_softmax"] == HELD + LOGITS + 4 * M * E + 12 * M * K
    old = tgi.warmup_moments(spec, M, 1, TgiRelease.of("3.1.0"), marlin=False)
    assert old["fused_experts"] - moments["fused_experts"] == 2 * M * K * min(2 * INTER, H)
    assert old["renormalize"] == HELD + LOGITS + 12 * M * K + 4 * M  # moe-kernels: the float copy is a temporary


def test_hub_fp8_experts_add_the_quantised_input_and_activation() -> None:
    """``--quantize fp8`` Mixtral from 3.1.1: ``FP8SparseMoELayer`` → ``fused_moe(use_fp8_w8a8=True)`` with no
    input scale (layers/moe/fp8.py v3.3.7:72-91), so each pass quantises its input and the activated cache
    dynamically (vllm_moe/fp8.py ``scaled_fp8_quant``: an fp8 copy + an fp32 scale [1]), both alive at the w2
    GEMM. TGI 3.1.0 runs the same layer over moe-kernels 0.8.2, whose ``invoke_fused_moe_kernel`` quantises each
    GEMM's input into a temporary (fused_moe.py v0.8.2:284-287): the larger copy, here the activated cache. 3.0.x
    has no fp8 MoE layer: not read."""
    spec, rel = resolve("mixtral-8x7b"), TgiRelease.of("3.2.1")
    plain = tgi.warmup_moments(spec, M, 1, rel, marlin=False)["fused_experts"]
    fp8 = tgi.warmup_moments(spec, M, 1, rel, marlin=False, quant="fp8")["fused_experts"]
    assert fp8 - plain == M * H + M * K * INTER + 8
    old = TgiRelease.of("3.1.0")
    three = tgi.warmup_moments(spec, M, 1, old, marlin=False, quant="fp8")["fused_experts"]
    assert three - tgi.warmup_moments(spec, M, 1, old, marlin=False)["fused_experts"] == M * K * INTER + 4
    assert tgi.warmup_layout(spec, TgiRelease.of("3.0.2"), "fp8") is None


def test_marlin_moe_moments_by_hand() -> None:
    """AWQ / GPTQ Mixtral on compute capability 8.0+: ``GPTQMarlinSparseMoELayer`` → ``fused_marlin_moe``, float16,
    all tokens in one pass (moe_kernels/_fused_marlin_moe.py v0.8.2:145-338; vllm_moe/fused_marlin_moe.py
    :141-330): ``sorted_token_ids`` (Marlin's block 64 for M > 32), the int32 workspace [max(2·I, h) // 64 · 16],
    ``intermediate_cache2`` [2M, I]; the w2 ``marlin_gemm_moe`` allocates ``a_tmp`` [M, 2, I] and its output
    [M, 2, h] (marlin_moe_ops.cu v0.8.2:512-516) while cache 1 [M, 2, 2·I] is still bound — the peak."""
    spec = resolve("mixtral-8x7b")
    base = HELD + LOGITS + 8 * M * K + _align(M, 64) + 4 * (max(2 * INTER, H) // 64 * 16)
    for version in ("3.0.1", "3.3.7"):
        moments = tgi.warmup_moments(spec, M, 1, TgiRelease.of(version), marlin=False, quant="gptq")
        assert moments["marlin_w2"] == base + 2 * M * K * (INTER + 2 * INTER + INTER + H) + 4 * (E + 1)
        assert moments["marlin_w1"] == base + 2 * M * K * (INTER + 2 * INTER) + 2 * M * H + 4 * (E + 1)
        assert moments["marlin_sum"] == base + 2 * M * K * (2 * INTER + INTER + H) + 2 * M * H
        assert max(moments.values()) == moments["marlin_w2"]
    # Marlin's block rule: 16 up to 32 tokens even with more tokens than experts (get_default_config is_marlin)
    assert tgi_moe.moe_align_ints(32, K, E, marlin=True) == _align(32, 16)
    assert tgi_moe.moe_align_ints(32, K, E) == _align(32, 64)


def test_awq_mixtral_plan_per_card_and_release() -> None:
    """On an A100 (8.0) the AWQ experts run Marlin MoE; to 3.1.0 the attention's Marlin GEMMs add their buffers
    too (marlin-kernels, read), from 3.1.1 not (kernels-community/quantization, not read). On a T4 (7.5) TGI takes
    ``DenseMoELayer`` (layers/moe/__init__.py v3.3.7:268-285, ``has_sm_8_0``): not read, generic forward + note."""
    old = serve_plan("mixtral-8x7b", "a100-sxm4-80gb", engine="tgi", engine_version="3.1.0", tp=2, quantization="awq")
    new = serve_plan("mixtral-8x7b", "a100-sxm4-80gb", engine="tgi", engine_version="3.3.7", tp=2, quantization="awq")
    spec, m = resolve("mixtral-8x7b"), old.settings["max_batch_prefill_tokens"]
    for p, version, marlin in ((old, "3.1.0", True), (new, "3.3.7", False)):
        moments = tgi.warmup_moments(spec, m, 2, TgiRelease.of(version), marlin=marlin, quant="awq")
        assert p.profile_peak == max(moments.values()) and "FlashMixtralForCausalLM" in p.notes[0]
        assert ("with Marlin's GEMM buffers" in p.notes[0]) is marlin
    t4 = serve_plan("mixtral-8x7b", "t4", engine="tgi", engine_version="3.3.7", tp=4, quantization="awq")
    said = [n for n in t4.notes if n.startswith("The fused-MoE kernel's per-call buffers")]
    assert len(said) == 1 and "with awq weights was not read" in said[0]
    assert "FlashMixtralForCausalLM" not in t4.notes[0]


def test_mixtral_sliding_window_copy_ends_at_3_2_1() -> None:
    """``prefill_cache_indices`` is always ``None`` from v3.2.1 (#3112), for Mixtral as for Mistral: a config with
    a sliding window copies the new K/V rows through 3.2.0 only."""
    spec = resolve("mixtral-8x7b")
    windowed = dataclasses.replace(spec, config={**spec.config, "sliding_window": 4096})
    for version, copies in (("3.1.1", True), ("3.2.0", True), ("3.2.1", False), ("3.3.7", False)):
        rel = TgiRelease.of(version)
        gap = tgi.warmup_moments(windowed, 2 * M, 1, rel, marlin=False)["o_proj"] \
            - tgi.warmup_moments(spec, 2 * M, 1, rel, marlin=False)["o_proj"]
        assert gap == (2 * 2 * 8 * 128 * 4096 if copies else 0)
