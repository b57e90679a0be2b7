"""``serve-plan --engine-version``: each vLLM release's own sizing rules (pools/vllm_release.py),
read in the sdists of 0.9.2 … 0.34.0 (docs/research/vllm-version-history.md,
docs/research/vllm-0.34-startup.md). Each test states the rule and the release it changes in,
and checks the plan's parts against that rule's arithmetic on the same inputs."""

from __future__ import annotations

import math

import pytest

from vramplan.cli.main import main
from vramplan.errors import WorkloadError
from vramplan.hardware.catalog import get_gpu, usable_capacity
from vramplan.models.catalog import resolve
from vramplan.pools import vllm
from vramplan.pools.base import outside
from vramplan.pools.vllm_release import NEWEST, Release, parse
from vramplan.serving.api import serve_plan
from vramplan.units import GiB, MiB

H100 = get_gpu("h100-sxm")
TOTAL = usable_capacity(H100)[0]
V = 128256  # Llama-3.1's vocabulary


def plan(version: str, **kw: object):  # type: ignore[no-untyped-def]
    kw.setdefault("max_model_len", 32768)
    return serve_plan(kw.pop("model", "llama-3.1-8b"), kw.pop("gpu", "h100-sxm"), engine_version=version, **kw)


@pytest.mark.parametrize("text, v", [("0.11", (0, 11, 0)), ("0.10.1.1", (0, 10, 1)), ("v0.20.2rc1", (0, 20, 2)),
                                     ("0.11.0+582e4e37.nv25.11", (0, 11, 0)), ("0.8.5.post1", (0, 8, 5))])
def test_versions_parse_as_users_write_them(text: str, v: tuple[int, int, int]) -> None:
    assert parse(text) == v


@pytest.mark.parametrize("text, says", [("0.8.5", "V0 engine"), ("0.35.0", "newer than the newest"),
                                        ("latest", "invalid vLLM version")])
def test_releases_outside_the_modelled_range_are_refused_in_one_line(text: str, says: str) -> None:
    with pytest.raises(WorkloadError, match=says):
        plan(text)
    with pytest.raises(WorkloadError, match="SGLang 0.34.0 is not modelled"):
        serve_plan("llama-3.1-8b", "h100-sxm", engine="sglang", engine_version="0.34.0")


def test_the_default_is_the_newest_release() -> None:
    p = serve_plan("llama-3.1-8b", "h100-sxm", max_model_len=32768)
    assert p.engine_version == NEWEST == "0.34.0" and p.settings["enable_extensible_kv_cache"] is True


def test_defaults_per_release() -> None:
    """gpu_memory_utilization 0.9 → 0.92 in 0.20.0 → unset = 1.0 with 0.34's extensible cache;
    block_size 16 → 64 in 0.34.0; ≥ 160 GiB GPUs get 16384/1024 from 0.28.0."""
    assert plan("0.19.1").settings["gpu_memory_utilization"] == 0.9
    assert plan("0.20.0").settings["gpu_memory_utilization"] == 0.92
    assert plan("0.34.0").settings["gpu_memory_utilization"] == 1.0
    assert plan("0.34.0", extensible_kv_cache=False).settings["gpu_memory_utilization"] == 0.92
    assert plan("0.33.0").block_size == 16 and plan("0.34.0").block_size == 64
    b200 = get_gpu("b200")
    rel = Release.of("0.28.0")
    assert rel.batch_defaults(usable_capacity(b200)[0], True, b200.compute_capability) == (16384, 1024)
    assert Release.of("0.27.1").batch_defaults(usable_capacity(b200)[0], True, "10.0") == (8192, 1024)
    assert plan("0.34.0", gpu="a100-sxm4-80gb").settings["max_num_batched_tokens"] == 2048


def test_capture_sizes_per_release() -> None:
    """0.10.1.1: [1, 2, 4] + 8…512 step 8 (67 sizes); 0.11.1: step 16 from 256 (51 sizes); 0.20.1
    adds max_num_batched_tokens when ≤ the largest, 0.31.0 max_num_seqs; 0.13.0 scales 2·S by
    1 + speculative tokens."""
    assert len(Release.of("0.10.1.1").capture_sizes(1024, 8192)) == 67
    new = Release.of("0.34.0").capture_sizes(1024, 8192)
    assert len(new) == 51 and new[-3:] == [480, 496, 512] and 248 in new and 264 not in new
    assert 300 not in Release.of("0.20.0").capture_sizes(1024, 300)
    assert Release.of("0.20.1").capture_sizes(1024, 300)[-1] == 300
    assert 100 not in Release.of("0.30.0").capture_sizes(100, 8192)
    assert 100 in Release.of("0.31.0").capture_sizes(100, 8192)
    assert max(Release.of("0.13.0").capture_sizes(64, 8192, spec_tokens=3)) == 512
    assert max(Release.of("0.12.0").capture_sizes(64, 8192, spec_tokens=3)) == 128
    assert plan("0.34.0").settings["cuda_graph_capture_sizes"] == 51


def test_0_10_budget_counts_nccl_and_cublas_after_the_snapshot() -> None:
    """≤ 0.10.2: the snapshot precedes distributed init, so NCCL's buffers and cuBLAS are in
    non_torch_increase; available = ⌊T·u⌋ − (weights + peak + non-torch); graphs outside."""
    p = plan("0.10.1.1", tp=2)
    out = outside(H100, 2)
    assert p.non_torch == out.later > out.cublas > 0
    assert p.budget == int(TOTAL * 0.9)
    assert p.kv_available == p.budget - (p.weights + p.profile_peak + p.non_torch)
    assert not p.cuda_graph_in_budget and p.cuda_graph_estimate == 0


def test_0_11_takes_nccl_out_of_the_budget() -> None:
    """0.11.0 takes the snapshot after distributed init: only cuBLAS is counted."""
    old, new = plan("0.10.2", tp=2), plan("0.11.0", tp=2)
    out = outside(H100, 2)
    assert new.non_torch == out.cublas and old.non_torch == out.later
    assert new.kv_available - old.kv_available == out.later - out.cublas


def test_0_20_takes_the_cuda_graph_estimate_from_the_budget() -> None:
    """0.20.0: VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS on by default; requested = ⌈T·0.92⌉ (from 0.14)."""
    p = plan("0.20.0")
    assert p.budget == math.ceil(TOTAL * 0.92)
    assert p.cuda_graph_in_budget and p.cuda_graph_estimate >= p.cuda_graph > 0
    assert p.kv_available == p.budget - (p.weights + p.profile_peak + p.non_torch) - p.cuda_graph_estimate
    # 51 FULL decode graphs: vLLM extrapolates 50 of them at ≥ 1 MiB each
    assert p.cuda_graph_estimate - p.cuda_graph == 50 * MiB
    assert not plan("0.19.1").cuda_graph_in_budget


def test_sampler_peak_per_release() -> None:
    """1024 dummy rows × the vocabulary: 16-bit + 36 B (the CUDA sort's instant) to 0.16, + 12 B
    (Triton) from 0.17.0; model runner V2 (dense from 0.25.0): + 4 B, + 12 B from 0.33.0 (FlashInfer
    pass). Below 128 rows the sort goes through the whole-batch path: + 48 B."""
    rows = 1024 * V
    assert plan("0.16.0").profile_peak == rows * 38
    rel = Release.of("0.16.0")
    assert (rel.sampler_bytes(False, 1), rel.sampler_bytes(False, 64), rel.sampler_bytes(False, 128)) == (36, 48, 36)
    assert plan("0.17.0").profile_peak == rows * 14
    assert plan("0.33.0", extensible_kv_cache=None).profile_peak == rows * 14
    v2 = plan("0.25.0")
    assert v2.profile_peak < rows * 14 and v2.profile_peak >= rows * 6


def test_model_runner_v2_holds_its_sampler_state_in_the_budget() -> None:
    """V2 (dense models from 0.25.0, all from 0.29.0): penalty bin counts S × V int32 + two
    S × ⌈V/32⌉ int32 masks, allocated after the weights; 0.22–0.28's V2 estimate of graphs is 0."""
    p = plan("0.25.0")
    assert p.runner_buffers == 1024 * V * 4 + 2 * 1024 * math.ceil(V / 32) * 4
    # to 0.26.x the peak's baseline is what is allocated when profiling starts: the state is not counted
    assert p.kv_available == p.budget - (p.weights + p.profile_peak + p.non_torch)
    assert not p.cuda_graph_in_budget
    # from 0.27.0 total_consumed (free memory's drop since start-up) counts it
    q = plan("0.27.0")
    assert q.kv_available == q.budget - (q.weights + q.runner_buffers + q.profile_peak + q.non_torch)
    moe = plan("0.25.0", model="qwen3-30b-a3b")  # the V1 runner still serves MoE models
    assert moe.runner_buffers == 0 and moe.cuda_graph_in_budget
    assert plan("0.29.0", model="qwen3-30b-a3b").runner_buffers > 0


def test_0_34_extensible_cache_is_sized_after_capture_from_free_memory() -> None:
    """0.34.0 (extensible_kv_cache.py:592-618): A = min(R − U, F₁ + C − max(1 GiB, 0.75·P)) − max(P, G),
    R = T with the default u = 1.0; U = weights + runner state + graphs; the device term binds.
    The pool is whole 2 MiB granules per layer: 8 blocks of 64 tokens × 256 KiB per layer."""
    p = plan("0.34.0")
    out = outside(H100, 1)
    assert p.non_torch == 0  # NCCL and cuBLAS precede the snapshot
    peak = p.profile_peak
    reserve = max(GiB, int(0.75 * peak)) + peak
    assert p.kv_reserve == reserve
    free = TOTAL - out.context - out.later - (p.weights + p.runner_buffers + p.cuda_graph)
    assert p.kv_available == free - reserve
    assert p.blocks % 8 == 0 and p.kv_pool <= p.kv_available < p.kv_pool + 8 * 32 * 256 * 1024
    assert p.kv_pool == p.blocks * 32 * 64 * 8 * 128 * 2 * 2
    assert p.cuda_graph_in_budget and p.cuda_graph_estimate == 0
    # "Available KV cache memory" is the reservation's capacity: T − (consumed + transient peak)
    assert p.log[1] == f"Available KV cache memory: {round((TOTAL - p.weights - p.runner_buffers - peak) / GiB, 2)} GiB"
    assert p.log[-1] == f"Extended KV cache to {p.blocks} blocks ({p.kv_pool / GiB:.2f} GiB)."
    assert p.log[-2].startswith(f"GPU KV cache size: {p.tokens:,} tokens, Maximum concurrency for 32,768")
    assert "--gpu-memory-utilization" not in p.command
    # an explicit utilization below 1 caps the pool: R − U binds
    capped = plan("0.34.0", memory_fraction=0.5)
    assert capped.kv_available == math.ceil(TOTAL * 0.5) - (p.weights + p.runner_buffers + p.cuda_graph) - peak
    assert "--gpu-memory-utilization 0.5" in capped.command


def test_0_34_without_the_extensible_cache_sizes_from_the_profile() -> None:
    """--no-enable-extensible-kv-cache: ⌈T·0.92⌉ − (consumed + transient) − the graph estimate,
    and one request of max_model_len must fit in the budget less one null block."""
    p = plan("0.34.0", extensible_kv_cache=False)
    assert p.budget == math.ceil(TOTAL * 0.92) and p.kv_reserve == 0
    assert p.kv_available == p.budget - (p.weights + p.runner_buffers + p.profile_peak) - p.cuda_graph_estimate
    assert "--no-enable-extensible-kv-cache" in p.command
    with pytest.raises(WorkloadError, match="extensible KV cache is vLLM 0.34's"):
        plan("0.33.0", extensible_kv_cache=True)


def test_the_refusal_texts_follow_the_release() -> None:
    long = dict(model="llama-3.1-70b", max_model_len=131072, tp=2)
    old = plan("0.10.1.1", **long)
    assert not old.starts and "models's max seq len (131072)" in (old.error or "")
    assert "See https://docs.vllm.ai" not in (old.error or "")
    mid = plan("0.22.0", **long)
    assert "model's max seq len (131072)" in (mid.error or "") and "CPU backend" in (mid.error or "")
    new = plan("0.34.0", **long)
    assert not new.starts and "The extensible KV cache already takes all device memory left after" in (new.error or "")
    # the free-memory refusal at start-up: the device named from 0.14.0, skipped when extensible
    assert "on device (" in Release.of("0.13.0").startup_error(GiB, 2 * GiB, 0.9, GiB)
    assert "on device cuda:0 (" in Release.of("0.14.0").startup_error(GiB, 2 * GiB, 0.9, GiB)
    assert plan("0.34.0", memory_fraction=1.0).starts
    assert not plan("0.33.0", memory_fraction=1.0).starts


def test_log_lines_per_release() -> None:
    """The weights line: "%.4f GiB" to 0.11.0, "… GiB memory" from 0.11.1 (V1 runner), format_gib
    from 0.14.0; the two capacity lines become one in 0.28.0."""
    assert plan("0.10.1.1").log[0] == f"Model loading took {plan('0.10.1.1').weights / GiB:.4f} GiB"
    assert plan("0.11.1").log[0].endswith(" GiB memory")
    assert plan("0.20.0").log[0] == f"Model loading took {round(plan('0.20.0').weights / GiB, 2)} GiB memory"
    assert any(line.startswith("Maximum concurrency") for line in plan("0.27.1").log)
    assert not any(line.startswith("Maximum concurrency") for line in plan("0.28.0").log)


def test_sliding_window_reserve_doubles_with_async_scheduling() -> None:
    """0.28.0: a sliding-window layer reserves its window + (PP + 1) × max_num_batched_tokens."""
    assert Release.of("0.27.1").inflight_tokens(8192, 1) == 8192
    assert Release.of("0.28.0").inflight_tokens(8192, 1) == 16384
    a, b = plan("0.27.1", model="gemma-2-9b", max_model_len=8192), plan("0.28.0", model="gemma-2-9b", max_model_len=8192)
    assert b.max_concurrency <= a.max_concurrency


def test_cli_engine_version(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve-plan", "llama-3.1-8b", "--gpu", "h100-sxm", "--engine-version", "0.11", "--format", "json"]) == 0
    out = capsys.readouterr().out
    assert '"engine_version": "0.11"' in out
    assert main(["serve-plan", "llama-3.1-8b", "--gpu", "h100-sxm", "--engine-version", "0.7.3"]) == 2
    err = capsys.readouterr().err
    assert "not modelled" in err and len(err.strip().splitlines()) == 1
    assert main(["serve-plan", "llama-3.1-8b", "--gpu", "h100-sxm", "--no-enable-extensible-kv-cache"]) == 0
    assert "--no-enable-extensible-kv-cache" in capsys.readouterr().out


def test_the_library_and_the_cli_paths_agree_for_a_release() -> None:
    """serving.vllm.plan and pools.vllm.plan agree for a release (the CLI's path and the library's)."""
    from vramplan.engine.forward import forward
    spec = resolve("llama-3.1-8b")
    s = vllm.VllmSettings(engine_version="0.20.0", max_model_len=32768)
    fwd = forward(spec, tokens=vllm.profile_tokens(H100, s), tp=1, pp=1, quant="none", dtype="bf16")
    assert vllm.plan(spec, H100, fwd, settings=s).kv_available == plan("0.20.0").kv_available


# --- a public start-up log of a newer release ------------------------------------------------
QWEN3_235B_FP8 = {  # Qwen/Qwen3-235B-A22B-Instruct-2507-FP8's dimensions (its model card / config)
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 4096,
    "intermediate_size": 12288, "moe_intermediate_size": 1536, "num_experts": 128, "num_experts_per_tok": 8,
    "num_hidden_layers": 94, "num_attention_heads": 64, "num_key_value_heads": 4, "head_dim": 128,
    "vocab_size": 151936, "max_position_embeddings": 262144, "tie_word_embeddings": False, "rms_norm_eps": 1e-6,
    "torch_dtype": "bfloat16", "decoder_sparse_step": 1, "mlp_only_layers": [], "norm_topk_prob": True,
    "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                            "weight_block_size": [128, 128]}}


def test_log_qwen3_235b_fp8_on_8_l40s_vllm_0_10_2() -> None:
    """A public start-up log ("Hosting Qwen3-235B-A22B-Instruct-2507-FP8 on 8xL40S", vLLM 0.10.2,
    TP 8 with expert parallelism, max_model_len 32768, gpu_memory_utilization 0.9, 2048 batched
    tokens; docs/research/vllm-public-logs.md §1), rank 0:
    "Model loading took 27.7183 GiB", "Available KV cache memory: 10.68 GiB", "GPU KV cache size:
    238,208 tokens", "Maximum concurrency for 32,768 tokens per request: 7.27x", "Graph capturing
    finished in 53 secs, took 3.45 GiB", and the suggestion line "Free memory on device
    (43.93/44.42 GiB) on startup. Desired GPU memory utilization is (0.9, 39.98 GiB). Actual usage
    is 27.72 GiB for weight, 1.4 GiB for peak activation, 0.18 GiB for non-torch memory, and 3.45 GiB
    for CUDAGraph memory. …".

    0.10.2's rules on the log's own parts reproduce its pool exactly. vramplan's own parts: weights
    −0.5 %, non-torch −0.05 GiB, the profile peak 1.38 against 1.4 (the sampler over 256 × 151,936 logits
    at the CUDA sort's instant, 38 B per logit: ``vllm_release.cuda_sort_scratch``; the ops' own 28 B per
    logit gave 1.01, 0.39 GiB short). One is off, measured here so a change shows: the CUDA-graph pool
    (a lower bound of 0.01 GiB against 3.45 logged: outside 0.10.2's budget, so it moves device use, not
    the pool). The L40S's total is 0.10 GiB above the log's."""
    import json

    from vramplan.models.catalog import spec_from_text
    from vramplan.pools.kvspec import LayerKV

    rel = Release.of("0.10.2")
    # the release's arithmetic on the log's parts
    total, weights, peak, non_torch = 44.42 * GiB, 27.7183 * GiB, 1.4 * GiB, 0.18 * GiB
    available = int(total * 0.9) - (weights + peak + non_torch)
    assert rel.gib(available) == "10.68"
    layers = tuple(LayerKV("full", 1, 128, 2) for _ in range(94))  # 4 KV heads over TP 8: one per rank
    cfg = vllm.kv_cache_config(layers, int(10.68 * GiB), 16, "0.10.2")
    assert cfg.tokens == pytest.approx(238208, rel=0.001)
    assert vllm.max_concurrency(cfg, 32768, 16, 2048) == pytest.approx(7.27, abs=0.01)
    # vramplan's whole plan
    spec = spec_from_text(json.dumps(QWEN3_235B_FP8), "Qwen3-235B-A22B-Instruct-2507-FP8/config.json")
    p = serve_plan(spec, "l40s", tp=8, quantization="fp8", max_model_len=32768, memory_fraction=0.9,
                   engine_version="0.10.2")
    assert p.settings["max_num_batched_tokens"] == 2048 and p.settings["max_num_seqs"] == 256
    assert p.weights / GiB == pytest.approx(27.7183, rel=0.01)
    assert abs(p.non_torch - non_torch) < 0.2 * GiB
    assert p.profile_peak == 256 * 151936 * 38 and abs(peak - p.profile_peak) < 0.05 * GiB
    assert p.kv_available / GiB == pytest.approx(10.68, rel=0.07)
    assert p.tokens == pytest.approx(238208, rel=0.07)
    assert p.cuda_graph < 3.45 * GiB and not p.cuda_graph_in_budget
    usage = next(line for line in p.log if line.startswith("Free memory on device ("))
    assert " GiB for weight, " in usage and usage.endswith(" bytes.") and "Desired GPU memory utilization is (0.9, " in usage


def test_multimodal_profile_per_release() -> None:
    """The dummy item is built at max_num_batched_tokens to 0.10.x and at max_model_len from 0.11.0
    (a Qwen2.5-VL video of 7 frame pairs at 128,000 tokens instead of one); 0.11.0 pads each image
    output to the encoder budget (2 × 32,768 rows instead of 2 × 16,384 with 32,768 batched
    tokens); model runner V2 (0.29.0 for multimodal models) frees the dummy pixels before the
    language-model phase (docs/research/vllm-multimodal-profile.md §2b)."""
    from vramplan.pools.mm import MmSettings, profile

    spec = resolve("qwen2.5-vl-7b")
    common = dict(max_model_len=128000, max_num_batched_tokens=8192, max_num_seqs=1024, mm=MmSettings())
    old, new = profile(spec, version="0.10.1.1", **common), profile(spec, version="0.11.0", **common)
    assert old is not None and new is not None
    assert old.grid == (1, 256, 256) and new.grid == (7, 256, 256) and new.patches == 7 * old.patches
    images = dict(common, max_num_batched_tokens=32768, mm=MmSettings(limit_video=0))
    padded, plain = profile(spec, version="0.11.0", **images), profile(spec, version="0.12.0", **images)
    assert padded is not None and plain is not None
    assert padded.items == plain.items == 2 and padded.tokens == plain.tokens == 2 * 16384
    assert padded.held_tokens == 2 * 32768 and plain.held_tokens == 0
    kw = dict(model="qwen2.5-vl-7b", max_model_len=32768, limit_mm_per_prompt={"image": 1, "video": 0})
    v1, v2 = plan("0.28.0", **kw), plan("0.29.0", **kw)
    assert v1.encoder_held - v2.encoder_held == 65536 * 1176 * 4  # the fp32 pixels: 256 × 256 patches × 1176 values


# --- the host KV tier (--kv-offloading-size) -------------------------------------------------
def test_native_offloading_from_0_27_is_one_shm_region_of_whole_chunks() -> None:
    """0.27+: ⌊S·2^30 / c⌋ chunks of c = roundup(b·W, 4096) bytes in one /dev/shm region per engine,
    each rank pinning its own b per chunk; the GPU pool is sized before the connector exists
    (docs/research/vllm-kv-offload.md §1.3-1.5)."""
    base = plan("0.34.0", model="qwen3-8b")
    p = plan("0.34.0", model="qwen3-8b", kv_offloading_size=10)
    b = 36 * 64 * 8 * 128 * 2 * 2  # one 64-token block of Qwen3-8B's 36 layers, this rank
    chunks = 10 * 2**30 // b
    assert (p.host_kv_tokens, p.host_kv, p.host_kv_shared) == (chunks * 64, chunks * b, chunks * b)
    assert p.kv_pool == base.kv_pool and p.tokens == base.tokens and p.connector_gpu == 0
    assert any(line.startswith("Created mmap file /dev/shm/vllm_offload_") for line in p.log)
    assert "--kv-offloading-size 10" in p.command
    two = plan("0.34.0", model="qwen3-8b", kv_offloading_size=10, tp=2)  # S is over all ranks
    assert two.host_kv_tokens == p.host_kv_tokens and two.host_kv == p.host_kv // 2


def test_native_offloading_0_14_to_0_26_pins_power_of_two_tensors_per_layer() -> None:
    """0.14–0.26: N = ⌊S·2^30 / (b·W)⌋ blocks, one pinned tensor per layer per rank, each rounded up to
    a power of two by PyTorch's pinned allocator: Qwen3-8B, 10 GiB → 4,551 blocks, 18 GiB pinned."""
    p = plan("0.20.0", model="qwen3-8b", kv_offloading_size=10)
    assert p.host_kv_tokens == 4551 * 16 and p.host_kv == 36 * 512 * 2**20


def test_lmcache_in_process_then_its_own_server() -> None:
    """0.11.1–0.22.x: LMCacheConnectorV1 in vLLM's process: S/(TP·PP) GiB per rank and a GPU buffer of
    layers × 2 × 256 tokens × KV heads × head size outside the budget; from 0.23.0 LMCacheMPConnector
    (a separate server: nothing in vLLM's process)."""
    p = plan("0.20.0", model="qwen3-8b", kv_offloading_size=10, kv_offloading_backend="lmcache", tp=2)
    assert p.host_kv == 5 * 2**30 and p.connector_gpu == 36 * 2 * 256 * 4 * 128 * 2
    assert p.device_used - plan("0.20.0", model="qwen3-8b", tp=2).device_used == p.connector_gpu
    q = plan("0.23.0", model="qwen3-8b", kv_offloading_size=10, kv_offloading_backend="lmcache")
    assert q.host_kv == q.connector_gpu == 0 and any("lmcache server" in n for n in q.notes)


def test_offloading_refusals_and_the_hybrid_manager() -> None:
    """The flags appear in 0.11.1; native's flag path is broken to 0.13.x (num_cpu_blocks 0); up to
    0.21.x any connector turns the hybrid manager off (Gemma 2's sliding layers sized as full)."""
    with pytest.raises(WorkloadError, match="appears in 0.11.1"):
        plan("0.10.1.1", kv_offloading_size=4)
    with pytest.raises(WorkloadError, match="num_cpu_blocks 0"):
        plan("0.12.0", kv_offloading_size=4)
    with pytest.raises(WorkloadError, match="modelled for vLLM"):
        serve_plan("llama-3.1-8b", "h100-sxm", engine="tgi", kv_offloading_size=4)
    g = dict(model="gemma-2-9b", max_model_len=8192)
    assert plan("0.21.0", kv_offloading_size=4, **g).layer_kinds == {"full": 42}
    assert plan("0.22.0", kv_offloading_size=4, **g).layer_kinds == plan("0.22.0", **g).layer_kinds != {"full": 42}
