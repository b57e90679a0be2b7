"""Serving plans: each engine's KV-pool arithmetic pinned against hand computations from
its code, and against published start-up logs (sources cited per test)."""

from __future__ import annotations

import math

import pytest

from vllm_pinned import cheapest, largest_max_model_len, serve_plan, sweep  # noqa: E402
from vramplan.errors import WorkloadError
from vramplan.hardware.catalog import get_gpu, usable_capacity
from vramplan.models.catalog import resolve
from vramplan.pools import vllm
from vramplan.pools.base import outside
from vramplan.pools.kvspec import LayerKV, bytes_per_token, kv_heads_per_rank, layer_specs
from vramplan.pools.vllm_release import cuda_sort_scratch
from vramplan.serving import sglang, tgi, trtllm
from vramplan.units import GiB

FULL_8B = tuple(LayerKV("full", 8, 128, 2) for _ in range(32))  # Llama-3.1-8B, one rank


# --- KV layout per layer type -----------------------------------------------------------
def test_full_attention_page_bytes_llama_8b() -> None:
    layers = layer_specs(resolve("llama-3.1-8b"))
    assert len(layers) == 32 and {x.kind for x in layers} == {"full"}
    # 2 (K and V) × 8 KV heads × 128 head size × 2 B (bf16) per token per layer
    assert layers[0].bytes_per_token == 2 * 8 * 128 * 2 == 4096
    assert layers[0].page_bytes(16) == 16 * 4096  # vLLM page_size_bytes at block_size 16
    assert bytes_per_token(layers) == 32 * 4096  # 128 KiB per token


def test_tp_splits_kv_heads_and_fp8_halves() -> None:
    spec = resolve("llama-3.1-8b")
    assert layer_specs(spec, tp=2)[0].bytes_per_token == 2 * 4 * 128 * 2
    assert layer_specs(spec, tp=2, kv_cache_dtype="fp8")[0].bytes_per_token == 2 * 4 * 128 * 1


def test_kv_head_replication_rules_per_engine() -> None:
    # tp 16 > 8 KV heads: vLLM/SGLang keep max(1, 8 // 16) = 1, TensorRT-LLM ceil(8/16) = 1,
    # TGI keeps all 8 (num_kv_heads // world_size if > 0 else num_kv_heads)
    assert kv_heads_per_rank(8, 16, "vllm") == 1
    assert kv_heads_per_rank(8, 16, "sglang") == 1
    assert kv_heads_per_rank(8, 16, "trtllm") == 1
    assert kv_heads_per_rank(8, 16, "tgi") == 8
    assert kv_heads_per_rank(8, 4, "tgi") == 2


def test_tp_not_dividing_kv_heads_is_refused() -> None:
    with pytest.raises(WorkloadError, match="does not divide the model's 8 KV heads"):
        layer_specs(resolve("qwen2.5-14b"), tp=5)  # 40 heads divide by 5, 8 KV heads do not
    with pytest.raises(WorkloadError, match="attention heads"):
        layer_specs(resolve("llama-3.1-8b"), tp=3)


def test_mla_caches_latent_once_per_token_unsplit_by_tp() -> None:
    spec = resolve("deepseek-v3")
    one, eight = layer_specs(spec, tp=1), layer_specs(spec, tp=8)
    assert one[0].kind == "mla"
    # kv_lora_rank 512 + qk_rope_head_dim 64, one "head", coef 1, bf16
    assert one[0].bytes_per_token == (spec.kv_lora_rank + spec.qk_rope_head_dim) * 2 == 1152
    assert eight[0].bytes_per_token == one[0].bytes_per_token


def test_sliding_window_layers_of_gemma_2() -> None:
    layers = layer_specs(resolve("gemma-2-9b"))
    kinds = [x.kind for x in layers]
    assert kinds.count("sliding") == 21 and kinds.count("full") == 21
    assert {x.window for x in layers if x.kind == "sliding"} == {4096}


# --- vLLM 0.10.1.1 arithmetic (kv_cache_utils.py) -------------------------------------------
def test_vllm_uniform_blocks_tokens_concurrency() -> None:
    avail = 10 * GiB
    cfg = vllm.kv_cache_config(FULL_8B, avail, 16)
    blocks = avail // (16 * 4096) // 32  # get_num_blocks: available // page_size // num_layers
    assert cfg.num_blocks == blocks and cfg.tokens == blocks * 16
    assert cfg.pool_bytes == blocks * 16 * 4096 * 32
    # one group: blocks / cdiv(max_model_len, block_size)
    assert vllm.max_concurrency(cfg, 32768, 16, 8192) == pytest.approx(blocks / math.ceil(32768 / 16))


def test_vllm_hybrid_sliding_window_groups() -> None:
    layers = layer_specs(resolve("gemma-2-9b"))
    page = layers[0].page_bytes(16)
    avail = 6 * GiB
    cfg = vllm.kv_cache_config(layers, avail, 16)
    # group_size = min(21, 21); 2 groups share 21 tensors of page × num_blocks
    blocks = avail // page // 21
    assert cfg.num_blocks == blocks and len(cfg.groups) == 2
    assert cfg.tokens == blocks // 2 * 16  # logged tokens divide by the number of groups
    L, mnbt = 8192, 2048
    full_blocks = math.ceil(L / 16)
    sliding_blocks = math.ceil(min(4096 - 1 + mnbt, L) / 16) + 1  # SlidingWindowSpec
    assert vllm.max_concurrency(cfg, L, 16, mnbt) == pytest.approx(blocks / (full_blocks + sliding_blocks))


def test_vllm_check_enough_wording_and_estimated_length() -> None:
    avail = 2 * GiB
    msg = vllm.check_enough(FULL_8B, avail, 131072, 16, 8192)
    assert msg is not None
    assert msg.startswith("To serve at least one request with the models's max seq len (131072), (16.00 GiB KV cache")
    est = avail // (16 * 4096 * 32) * 16  # whole blocks of 16 tokens
    assert f"the estimated maximum model length is {est}." in msg
    assert vllm.check_enough(FULL_8B, 0, 1024, 16, 8192).startswith("No available memory for the cache blocks.")
    assert vllm.check_enough(FULL_8B, avail, 1024, 16, 8192) is None


def test_vllm_plan_budget_identity_and_defaults() -> None:
    p = serve_plan("llama-3.1-8b", "h100-sxm", max_model_len=32768)
    total, _ = usable_capacity(get_gpu("h100-sxm"))
    assert p.total_memory == total and p.budget == int(total * 0.9)
    available = p.budget - p.weights - p.profile_peak - p.non_torch
    assert p.blocks == available // (16 * 4096) // 32
    assert p.tokens == p.blocks * 16 and p.kv_pool == p.blocks * 16 * 4096 * 32
    # H100 (≥ 70 GiB, not an A100): vllm serve defaults 8192 batched tokens, 1024 sequences
    assert p.settings["max_num_batched_tokens"] == 8192 and p.settings["max_num_seqs"] == 1024
    assert p.settings["cuda_graph_capture_sizes"] == len([1, 2, 4] + list(range(8, 513, 8)))
    assert f"GPU KV cache size: {p.tokens:,} tokens" in p.log
    a100 = serve_plan("llama-3.1-8b", "a100-sxm4-80gb", max_model_len=32768)
    assert a100.settings["max_num_batched_tokens"] == 2048 and a100.settings["max_num_seqs"] == 256


def test_vllm_profile_peak_is_sampler_or_forward() -> None:
    p = serve_plan("llama-3.1-8b", "h100-sxm", max_model_len=8192, max_num_seqs=1024)
    sampler = 1024 * 128256 * (2 + 4 + 4 + 8 + cuda_sort_scratch(1024))  # the CUDA sort's instant
    assert p.profile_peak == sampler  # 1024 logit rows dominate an 8192-token forward
    small = serve_plan("llama-3.1-8b", "h100-sxm", max_model_len=8192, max_num_seqs=8)
    assert small.profile_peak < sampler and small.profile_peak > 0


def test_vllm_tp_halves_weights_and_kv_per_rank() -> None:
    one = serve_plan("llama-3.1-70b", "h100-sxm", tp=4, max_model_len=8192)
    two = serve_plan("llama-3.1-70b", "h100-sxm", tp=8, max_model_len=8192)
    assert one.bytes_per_token == 80 * 2 * 2 * 128 * 2 and two.bytes_per_token == 80 * 2 * 1 * 128 * 2
    assert two.weights < one.weights and two.non_torch > 0


def test_vllm_does_not_start_with_its_own_error() -> None:
    p = serve_plan("gemma-2-9b", "l4", max_model_len=8192)
    assert not p.starts and "is larger than the available KV cache memory" in p.error
    assert any(line.startswith("ValueError: To serve at least one request") for line in p.log)
    assert largest_max_model_len("gemma-2-9b", "l4") < 8192
    assert serve_plan("gemma-2-9b", "l4", max_model_len=largest_max_model_len("gemma-2-9b", "l4")).starts


def test_vllm_full_utilisation_fails_on_free_memory_check() -> None:
    p = serve_plan("llama-3.2-1b", "h100-sxm", memory_fraction=1.0, max_model_len=8192)
    assert not p.starts and p.error.startswith("Free memory on device (")


def test_vllm_bf16_refused_before_ampere() -> None:
    p = serve_plan("llama-3.1-8b", "v100-sxm2-32gb", max_model_len=8192)
    assert not p.starts and p.error.startswith("Bfloat16 is only supported on GPUs with compute capability")
    assert serve_plan("llama-3.1-8b", "v100-sxm2-32gb", max_model_len=8192, dtype="fp16").starts


def test_quantised_weights() -> None:
    base = serve_plan("llama-3.1-8b", "l40s", max_model_len=8192)
    fp8 = serve_plan("llama-3.1-8b", "l40s", max_model_len=8192, quantization="fp8")
    awq = serve_plan("llama-3.1-8b", "l40s", max_model_len=8192, quantization="awq")
    assert awq.weights < fp8.weights < base.weights
    assert fp8.tokens > base.tokens and "--quantization awq" in awq.command


# --- published vLLM logs -----------------------------------------------------------------
def test_log_qwen3_14b_lmcache_1739() -> None:
    """LMCache/LMCache#1739 (vLLM V1): Qwen3-14B (40 layers, 8 KV heads, head_dim 128),
    "Available KV cache memory: 6.51 GiB", "GPU KV cache size: 42,656 tokens",
    "Maximum concurrency for 32,768 tokens per request: 1.30x"."""
    layers = tuple(LayerKV("full", 8, 128, 2) for _ in range(40))
    cfg = vllm.kv_cache_config(layers, int(6.51 * GiB), 16)
    assert cfg.tokens == pytest.approx(42656, rel=0.05)
    assert vllm.max_concurrency(cfg, 32768, 16, 8192) == pytest.approx(1.30, rel=0.05)


def test_log_qwen3_30b_a3b_fp8_kv_vllm_25350() -> None:
    """vllm-project/vllm#25350: kv-cache-dtype fp8, "Available KV cache memory: 10.55 GiB",
    "GPU KV cache size: 230,528 tokens", "Maximum concurrency for 100,000 tokens per request:
    2.31x"; with max-model-len 221000 and 5.59 GiB available: "(10.12 GiB KV cache is needed…
    the estimated maximum model length is 122080". 230,528 tokens / 10.55 GiB = 48 layers ×
    2 × 4 KV heads × 128 × 1 B: Qwen3-30B-A3B."""
    layers = layer_specs(resolve("qwen3-30b-a3b"), kv_cache_dtype="fp8")
    cfg = vllm.kv_cache_config(layers, int(10.55 * GiB), 16)
    assert cfg.tokens == pytest.approx(230528, rel=0.05)
    assert vllm.max_concurrency(cfg, 100000, 16, 8192) == pytest.approx(2.31, rel=0.05)
    needed = vllm.needed_memory(layers, 221000, 16, 8192)
    assert needed / GiB == pytest.approx(10.12, rel=0.05)
    est = vllm.estimate_max_model_len(layers, int(5.59 * GiB), 221000, 16, 8192)
    assert est == pytest.approx(122080, rel=0.05)


def test_log_qwen3_235b_tp4_vllm_and_sglang_21348() -> None:
    """vllm-project/vllm#21348, Qwen3-235B-A22B-FP8 on 4× H100 (94 layers, 4 KV heads,
    head_dim 128; TP 4 leaves 1 KV head per rank): vLLM "Available KV cache memory: 8.11 GiB",
    "GPU KV cache size: 178,880 tokens"; SGLang "KV Cache is allocated. #tokens: 367404,
    K size: 8.23 GB, V size: 8.23 GB"."""
    heads = kv_heads_per_rank(4, 4, "vllm")
    layers = tuple(LayerKV("full", heads, 128, 2) for _ in range(94))
    assert vllm.kv_cache_config(layers, int(8.11 * GiB), 16).tokens == pytest.approx(178880, rel=0.05)
    cell = bytes_per_token(tuple(LayerKV("full", kv_heads_per_rank(4, 4, "sglang"), 128, 2) for _ in range(94)))
    assert 367404 * cell / 2 / GiB == pytest.approx(8.23, rel=0.05)


def test_log_weights_llama_3_1_8b_and_70b_w8a8() -> None:
    """"Loading model weights took 14.9888 GB" (vllm-project/vllm#10517, Llama-3.1-8B bf16;
    vLLM's "GB" there is GiB) and "Loading model weights took 67.7229 GB" (vllm-project/vllm
    PR #12569, Llama-3.1-70B w8a8 on one GPU, 8-bit linear weights)."""
    assert serve_plan("llama-3.1-8b", "rtx-3090", max_model_len=4096).weights / GiB == pytest.approx(14.9888, rel=0.05)
    w8 = serve_plan("llama-3.1-70b", "h100-sxm", quantization="fp8", max_model_len=2048, memory_fraction=0.98)
    assert w8.weights / GiB == pytest.approx(67.7229, rel=0.05)


def test_log_rtx3090_blocks_vllm_10517() -> None:
    """vllm-project/vllm#10517: Llama-3.1-8B on an RTX 3090, "kv_cache_size=2.89GiB",
    "# GPU blocks: 1478" and "maximum number of tokens that can be stored in KV cache (23648)"."""
    cfg = vllm.kv_cache_config(FULL_8B, int(2.89 * GiB), 16)
    assert cfg.num_blocks == pytest.approx(1478, rel=0.05)
    assert cfg.tokens == pytest.approx(23648, rel=0.05)


# --- SGLang, TGI, TensorRT-LLM -----------------------------------------------------------
def test_sglang_profile_max_num_token() -> None:
    spec, gpu = resolve("llama-3.1-8b"), get_gpu("h100-sxm")
    p = sglang.plan(spec, gpu, settings=sglang.SglangSettings(engine_version="0.4.6"))
    total, _ = usable_capacity(gpu)
    out = outside(gpu, 1)
    t0 = total - out.context - out.later  # free memory after the distributed init
    rest = (t0 - p.weights) - t0 * (1 - 0.88)  # available after weights − total × (1 − f)
    assert p.settings["mem_fraction_static"] == 0.88
    assert abs(p.tokens - int(rest) // (32 * 2 * 8 * 128 * 2)) <= 1  # (SGLang's GB floats)
    assert p.kv_pool == (p.tokens + 1) * 131072  # + the padding slot 0
    assert "KV Cache is allocated. #tokens: " in p.log[1]
    assert sglang.default_fraction(2) == 0.87 and sglang.default_fraction(4) == 0.85
    assert sglang.default_fraction(8) == 0.81 and sglang.default_fraction(16) == 0.79


def test_sglang_not_enough_memory_wording() -> None:
    p = serve_plan("llama-3.1-8b", "l4", engine="sglang", memory_fraction=0.3)
    assert not p.starts and p.error == "Not enough memory. Please try to increase --mem-fraction-static."


def test_tgi_warmup_blocks_and_replication() -> None:
    spec, gpu = resolve("llama-3.1-8b"), get_gpu("h100-sxm")
    s = tgi.TgiSettings(max_total_tokens=8192, attention="paged")
    p = tgi.plan(spec, gpu, settings=s)
    prefill = p.settings["max_batch_prefill_tokens"]  # the launcher's default (not the 2.x max_input + 50)
    assert prefill == 59870
    batch_blocks = math.ceil(prefill / 8191) * math.ceil(8191 / 16)  # requests of 8191 tokens' blocks
    block_bytes = 16 * 131072
    total, _ = usable_capacity(gpu)
    out = outside(gpu, 1)
    free = total - out.context - out.later - p.weights - p.profile_peak - batch_blocks * block_bytes
    # TGI 3.3: get_free_memory(MEMORY_FRACTION × TGI_WIGGLE_ROOM) = free − (1 − 1.0 × 0.90) × total
    assert p.blocks == int((free - (1 - 0.90) * total) // block_bytes) + batch_blocks
    assert p.log[0] == f"KV-cache blocks: {p.blocks}, size: 16"
    # TP 16 on 8 KV heads: TGI keeps all 8 per rank, vLLM 1
    t16 = serve_plan("llama-3.1-70b", "h100-sxm", engine="tgi", tp=16, max_model_len=4096)
    v16 = serve_plan("llama-3.1-70b", "h100-sxm", engine="vllm", tp=16, max_model_len=4096)
    assert t16.bytes_per_token == 8 * v16.bytes_per_token


def test_trtllm_free_fraction_after_weights() -> None:
    spec, gpu = resolve("llama-3.1-8b"), get_gpu("h100-sxm")
    p = trtllm.plan(spec, gpu)
    total, _ = usable_capacity(gpu)
    out = outside(gpu, 1)
    free = total - out.context - out.later - p.weights - p.profile_peak
    block = 32 * 131072
    assert p.blocks == int(free * 0.9) // block and p.tokens == p.blocks * 32
    assert p.log[0].startswith("[MemUsageChange] Allocated ") and p.log[0].endswith(f"({p.tokens}).")


def test_all_engines_give_commands_and_json() -> None:
    for engine, start in (("vllm", "vllm serve"), ("sglang", "python -m sglang.launch_server"),
                          ("tgi", "text-generation-launcher"), ("trtllm", "trtllm-serve")):
        p = serve_plan("qwen2.5-7b", "a100-sxm4-80gb", engine=engine, tp=2, max_model_len=16384,
                       avg_request_len=2048)
        assert p.command.startswith(start) and p.starts
        d = p.to_dict()
        assert d["gpus"] == 2 and isinstance(d["kv_pool"], int) and d["concurrency_at_avg"] > 0
        assert p.concurrency_at_avg <= p.max_running


# --- bad input ---------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs, text", [
    ({"memory_fraction": 1.5}, "gpu_memory_utilization must be in (0, 1]"),
    ({"memory_fraction": 0.0}, "gpu_memory_utilization must be in (0, 1]"),
    ({"max_model_len": 10**6}, "is greater than the derived max_model_len"),
    ({"engine": "ollama"}, "unknown serving engine"),
    ({"quantization": "gguf"}, "invalid quantization"),
    ({"kv_cache_dtype": "int3"}, "invalid kv_cache_dtype"),
    ({"block_size": 24}, "invalid block_size 24 for vLLM"),
    ({"avg_request_len": 0}, "average request length must be >= 1"),
])
def test_bad_input_raises_one_line(kwargs: dict[str, object], text: str) -> None:
    with pytest.raises(WorkloadError) as e:
        serve_plan("llama-3.1-8b", "h100-sxm", **kwargs)  # type: ignore[arg-type]
    assert text in str(e.value) and "\n" not in str(e.value)


def test_sweep_and_cheapest() -> None:
    pts = sweep("llama-3.1-8b", "l40s", over="utilization", max_model_len=8192)
    pools = [p.kv_pool for _, p in pts if p.starts]
    assert pools == sorted(pools) and len(pools) >= 5
    opts = cheapest("llama-3.1-8b", concurrency=16, context=8192)
    assert opts and all(o.concurrency >= 16 for o in opts)
    prices = [o.usd_per_hour for o in opts]
    assert prices == sorted(prices)


def test_tgi_refuses_mla_models() -> None:
    with pytest.raises(WorkloadError, match="does not model TGI's KV layout"):
        serve_plan("deepseek-v2-lite", "h100-sxm", engine="tgi", max_model_len=4096)


# --- report -------------------------------------------------------------------------------
def test_doc_and_plot_data(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from vramplan.report.doc import KeyValues, Notes, Table
    from vramplan.report.serving import plot_serving, to_doc

    p = serve_plan("llama-3.1-8b", "l40s", max_model_len=8192, avg_request_len=1000)
    doc = to_doc(p)
    table = next(s for s in doc.sections if isinstance(s, Table))
    assert table.footer == ["predicted device used", f"{p.device_used / GiB:,.2f}", ""]
    assert any(isinstance(s, KeyValues) and s.title == "What it means for users" for s in doc.sections)
    assert any(isinstance(s, Notes) and s.lines == [p.command] for s in doc.sections)
    pts = sweep("llama-3.1-8b", "l40s", over="context", max_model_len=8192)
    data = plot_serving(pts, tmp_path / "ctx.svg", over="context")
    assert data.x == tuple(float(x) for x, _ in pts)
    assert data.stacked["KV-cache pool"] == tuple(pl.kv_pool if pl.starts else 0 for _, pl in pts)
    assert all(pl.kv_pool <= max(pl.kv_available, 0) for _, pl in pts)
    assert data.levels["GPU total"] == p.total_memory
    assert (tmp_path / "ctx.svg").read_text().startswith("<?xml")


def test_sampler_bytes_per_logit_match_a_trace_of_the_sampling_ops() -> None:
    """vLLM 0.10.1.1's dummy sampler run (``vllm/v1/sample/sampler.py`` → fp32 logits;
    ``vllm/v1/sample/ops/topk_topp_sampler.py`` ``apply_top_k_top_p`` then ``forward_native``):
    the same sequence of torch ops, traced by vramplan on fake tensors, peaks at the
    16-bit logits + SAMPLER_BYTES_PER_LOGIT per logit: the ops' own tensors. On CUDA ``torch.sort``
    adds its temporaries at its instant (``vllm_release.cuda_sort_scratch``), which the plan takes
    as the peak (16-bit + 36 B from 128 rows)."""
    torch = pytest.importorskip("torch")
    import vramplan

    rows, vocab = 64, 128256

    def top_k_top_p(logits, k, p):  # type: ignore[no-untyped-def]
        srt, idx = logits.sort(dim=-1)
        cut = srt.gather(1, (srt.size(1) - k.to(torch.long)).unsqueeze(1))
        srt.masked_fill_(srt < cut, -float("inf"))
        probs = srt.softmax(dim=-1)
        cum = torch.cumsum(probs, dim=-1, out=probs)
        mask = cum <= 1 - p.unsqueeze(1)
        mask[:, -1] = False
        srt.masked_fill_(mask, -float("inf"))
        return srt.scatter(dim=-1, index=idx, src=srt)

    class Sampler(torch.nn.Module):
        def forward(self, logits):  # type: ignore[no-untyped-def]
            fp32 = logits.to(torch.float32)
            k = torch.full((rows,), vocab - 1, device=logits.device)
            p = torch.full((rows,), 0.9, device=logits.device)
            probs = top_k_top_p(fp32, k, p).softmax(dim=-1, dtype=torch.float32)
            q = torch.empty_like(probs).exponential_()
            return probs.div_(q).argmax(dim=-1)

    x = torch.zeros(rows, vocab, dtype=torch.bfloat16)
    report = vramplan.trace(Sampler(), inputs=x, task="infer", precision="bf16", iterations=1)
    per_logit = report.peak.allocated / (rows * vocab)
    assert per_logit == pytest.approx(2 + vllm.SAMPLER_BYTES_PER_LOGIT, rel=0.05)


def test_profile_forward_can_be_traced() -> None:
    pytest.importorskip("transformers")
    kw = dict(max_model_len=4096, max_num_batched_tokens=512, max_num_seqs=2)
    traced = serve_plan("llama-3.2-1b", "l4", method="trace", **kw)  # type: ignore[arg-type]
    analytic = serve_plan("llama-3.2-1b", "l4", **kw)  # type: ignore[arg-type]
    assert traced.profile_method == "trace" and analytic.profile_method == "analytic"
    assert traced.profile_peak == pytest.approx(analytic.profile_peak, rel=0.5)
    assert traced.weights == pytest.approx(analytic.weights, rel=0.02)


def test_model_at_its_position_limit_plans() -> None:
    # GPT-2: 1024 learned positions; the profile forward must stay within them
    p = serve_plan("gpt2", "t4", dtype="fp16", max_num_batched_tokens=2048)
    assert p.starts and p.max_model_len == 1024 and p.profile_peak > 0


def test_vllm_multi_lora_slots_are_in_the_weights_line() -> None:
    """vLLM 0.10.1.1 --enable-lora: create_lora_weights per wrapped layer (vllm/lora/layers.py),
    inside load_model's memory profile. Llama-3.1-8B, bf16, tp 1, 4 slots of rank 16: 10 MiB of
    slots per decoder layer (qkv and gate_up lora_a replicated per slice, lora_b per output slice;
    o_proj/down_proj lora_a on the input, lora_b on the hidden size), the embedding and logits
    wrappers (25,362,432 B each), 1,280 extra vocabulary rows and the Punica index tensors."""
    from vramplan.serving.api import serve_plan

    base = serve_plan("llama-3.1-8b", "h100-sxm")
    lora = serve_plan("llama-3.1-8b", "h100-sxm", enable_lora=True, max_loras=4, max_lora_rank=16)
    per_layer = 4 * 16 * (5 * 4096 + (4096 + 1024 + 1024 + 2 * 14336)) + 4 * 16 * (4096 + 14336) + 2 * 4 * 4096 * 16
    assert per_layer * 2 == 10 * 2**20
    wrappers = 2 * 25_362_432 + 1280 * 4096 * 2
    punica = 48 * 8192 + 32 * 1024
    assert lora.weights - base.weights == 32 * per_layer * 2 + wrappers + punica == 397_180_928
    assert lora.kv_pool < base.kv_pool and lora.starts
    assert "--enable-lora --max-loras 4 --max-lora-rank 16" in lora.command
    # Qwen2's vLLM class declares no embedding_modules: its linears only
    q = serve_plan("qwen2.5-7b", "h100-sxm", enable_lora=True, max_loras=2)
    assert not any("embedding and the LM head" in n for n in q.notes)
    # tensor parallel: lora_b of column-parallel layers sharded; fully sharded shards the rest too
    t2 = serve_plan("llama-3.1-8b", "h100-sxm", tp=2, enable_lora=True, max_loras=4)
    fs = serve_plan("llama-3.1-8b", "h100-sxm", tp=2, enable_lora=True, max_loras=4, fully_sharded_loras=True)
    b2 = serve_plan("llama-3.1-8b", "h100-sxm", tp=2)
    assert fs.weights - b2.weights < t2.weights - b2.weights < lora.weights - base.weights


def test_vllm_lora_settings_are_checked_as_vllm_checks_them() -> None:
    from vramplan.errors import WorkloadError
    from vramplan.serving.api import serve_plan

    with pytest.raises(WorkloadError, match="must be one of"):
        serve_plan("llama-3.1-8b", "h100-sxm", enable_lora=True, max_lora_rank=24)
    with pytest.raises(WorkloadError, match="max_cpu_loras"):
        serve_plan("llama-3.1-8b", "h100-sxm", enable_lora=True, max_loras=4, max_cpu_loras=2)
    with pytest.raises(WorkloadError, match="vLLM only"):
        serve_plan("llama-3.1-8b", "h100-sxm", engine="sglang", enable_lora=True)
    with pytest.raises(WorkloadError, match="MoE"):
        serve_plan("mixtral-8x7b", "h100-sxm", tp=2, enable_lora=True)


def test_vllm_lora_under_pipeline_parallelism_counts_the_first_stage() -> None:
    from vramplan.serving.api import serve_plan

    one = serve_plan("llama-3.1-8b", "h100-sxm", enable_lora=True, max_loras=4)
    two = serve_plan("llama-3.1-8b", "h100-sxm", pp=2, enable_lora=True, max_loras=4)
    base1, base2 = serve_plan("llama-3.1-8b", "h100-sxm"), serve_plan("llama-3.1-8b", "h100-sxm", pp=2)
    per_layer = 10 * 2**20
    assert two.weights - base2.weights == 16 * per_layer + 25_362_432 + 1024 * 4096 * 2 + 48 * 8192 + 32 * 1024
    assert two.weights - base2.weights < one.weights - base1.weights
