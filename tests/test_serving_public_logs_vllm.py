"""Public vLLM start-up logs as tests (issue 30): gpt-oss's MXFP4 weights (vllm-project/vllm#23278, a public
blog post) and a Llama-3.1-8B start-up on an A100 40 GB at 0.15.1, each planned with ``serve_plan`` at the
log's settings and compared part by part (weights, available KV memory, tokens, concurrency, graphs, start or
fail) with issue 30's tolerance: 5 %, or 0.2 GiB for parts under 4 GiB (:func:`close`). The profile peak
(which these logs give only as what their budget leaves) is the dummy sampler at ``torch.sort``'s instant on
CUDA (``vllm_release.cuda_sort_scratch``), which these logs located.
Verbatim lines, sources, what is assumed, and the table of every part: docs/research/vllm-public-logs.md
("Logs added in session 53")."""

from __future__ import annotations

import pytest

from test_serving_public_logs_sglang_tgi import close, gib  # (issue 30's tolerance, shared)
from vramplan.errors import WorkloadError
from vramplan.hardware.catalog import get_gpu
from vramplan.models.catalog import resolve
from vramplan.pools.mxfp4 import expert_bytes, marlin_align
from vramplan.serving.api import serve_plan
from vramplan.units import GiB


def test_mxfp4_marlin_expert_layout() -> None:
    """Mxfp4MoEMethod.create_weights with the Marlin backend (0.10.1.1 quantization/mxfp4.py:154-260): gpt-oss's
    experts (hidden 2880, intermediate 2880) padded to I = 2944 (a multiple of 128) and H = 3072 (of 256):
    w13 [2I, H/2] + scales [2I, H/32] + bf16 bias [2I], w2 [H, I/2] + scales [H, I/32] + bias [H]."""
    i, h = 2944, 3072
    per_expert = 2 * i * h // 2 + 2 * i * h // 32 + 2 * i * 2 + h * i // 2 + h * i // 32 + h * 2
    assert per_expert == 14_431_744
    assert expert_bytes(2880, 2880, 1, (128, 256)) == per_expert
    # TP shards the intermediate size before the padding (FusedMoE intermediate_size_per_partition)
    assert expert_bytes(2880, 2880, 2, (128, 256)) == (2 * 1536 * 1536 + 2 * 1536 * 96 + 2 * 1536 * 2
                                                      + 3072 * 768 + 3072 * 48 + 3072 * 2)
    # unpadded (the Triton path's 64 alignment keeps 2880): 4.25 bits per value plus the biases
    assert expert_bytes(2880, 2880, 1, (64, 1)) == 3 * 2880 * 2880 * 17 // 32 + (2 * 2880 + 2880) * 2


def test_mxfp4_backend_per_release_and_gpu() -> None:
    """Marlin on every non-SM100 CUDA GPU at 0.10.1.x (torch 2.7.1 < 2.8.0, mxfp4.py:123-135), below compute
    capability 9.0 from 0.11.0; Hopper from 0.11.0 runs the triton_kernels layout, which is refused, as are
    releases without MXFP4 or past 0.19 and models other than gpt-oss."""
    spec = resolve("gpt-oss-120b")
    h100, a100 = get_gpu("h100-sxm"), get_gpu("a100-sxm4-80gb")
    assert marlin_align(spec, h100, "0.10.1") == (128, 256)
    assert marlin_align(spec, a100, "0.19.0") == (128, 256)
    with pytest.raises(WorkloadError, match="triton_kernels"):
        marlin_align(spec, h100, "0.14.1")
    with pytest.raises(WorkloadError, match="no MXFP4"):
        marlin_align(spec, a100, "0.10.0")
    with pytest.raises(WorkloadError, match="from 0.20"):
        marlin_align(spec, a100, "0.20.2")
    with pytest.raises(WorkloadError, match="gpt-oss"):
        serve_plan("llama-3.1-8b", "a100-sxm4-80gb", quantization="mxfp4", engine_version="0.19.1")
    with pytest.raises(WorkloadError, match="vLLM only"):
        serve_plan("gpt-oss-20b", "a100-sxm4-80gb", quantization="mxfp4", engine="sglang")


def test_log_gpt_oss_120b_h100_vllm_0_10_1_fails_23278() -> None:
    """vllm-project/vllm#23278 (2025-08-20): ``vLLM API server version 0.10.1``, args ``{'model_tag':
    'openai/gpt-oss-120b', 'model': 'openai/gpt-oss-120b'}`` (all defaults: gmu 0.90, ``Using max model len
    131072``, ``max_num_batched_tokens=8192``) on one H100 80 GB: "Model loading took 65.9651 GiB and 12.799889
    seconds", "Available KV cache memory: -2.14 GiB", then "EngineCore failed to start.".

    Weights within 0.1 % (MXFP4 experts through Marlin: 66.50 GB of experts, 1.94 GB attention / router /
    norms, 2.32 GB embeddings and head in bf16). Start or fail matches: both fail for want of KV memory. The
    log's parts give profile peak + non-torch = 0.9 × total − 65.97 + 2.14 ≈ 7.4 GiB: the dummy sampler over
    1024 × 201,088 logits at the CUDA sort's instant, 16-bit logits + fp32 copy + sorted values and int64
    indices + the sort's reverse indices and cub's third key / value buffers = 38 B per logit (7.29 GiB;
    ``cuda_sort_scratch``). Available KV −1.98 GiB against −2.14 logged: within 0.2 GiB. Without the sort's
    temporaries (the ops' own 28 B per logit, as a CPU trace sees them) it was −0.06 GiB."""
    p = serve_plan("gpt-oss-120b", "h100-sxm", quantization="mxfp4", engine_version="0.10.1")
    assert p.settings["max_num_batched_tokens"] == 8192 and p.settings["max_model_len"] == 131072
    assert close(gib(p.weights), 65.9651) and p.weights / GiB == pytest.approx(65.9651, rel=0.002)
    assert p.log[0] == f"Model loading took {gib(p.weights):.4f} GiB"
    assert not p.starts and "No available memory for the cache blocks" in (p.error or "")
    assert close(gib(p.kv_available), -2.14)
    assert p.profile_peak == 1024 * 201088 * (2 + 4 + 4 + 8 + 8 + 4 + 8)
    assert close(gib(p.profile_peak + p.non_torch), gib(p.budget) - 65.9651 + 2.14)  # the log's parts, this total


def test_log_gpt_oss_20b_a100_vllm_0_19_0_blog() -> None:
    """https://myoceane.fr/index.php/ai-vllm-a100-gemma-4/ (2026-04-18): ``vllm serve openai/gpt-oss-20b --port
    10000 --max-model-len 131072 --gpu-memory-utilization 0.65 --trust-remote-code``, banner ``version 0.19.0``,
    one A100 (the 80 GB card assumed: 36.56 + 13.72 ≈ 0.65 × 80 GB): "Model loading took 13.72 GiB memory and
    62.336108 seconds", "Available KV cache memory: 36.56 GiB"; the server started.

    An A100 (compute capability 8.0) holds MXFP4 experts in Marlin's layout at 0.19 (the Triton and FlashInfer
    backends need 9.0 or newer: 0.19.1 fused_moe/oracle/mxfp4.py:204-207). Every part within the tolerance:
    weights −0.4 %, available KV +1.4 %, starts."""
    p = serve_plan("gpt-oss-20b", "a100-sxm4-80gb", quantization="mxfp4", engine_version="0.19.0",
                   max_model_len=131072, memory_fraction=0.65)
    assert close(gib(p.weights), 13.72) and close(gib(p.kv_available), 36.56)
    assert p.log[0] == f"Model loading took {round(gib(p.weights), 2)} GiB memory"
    assert p.starts and p.max_model_len == 131072
    # the 16-bit plan would size the experts at 2 B each: the MXFP4 layout is what brings it to the log
    bf16 = serve_plan("gpt-oss-20b", "a100-sxm4-80gb", engine_version="0.19.0", max_model_len=131072,
                      memory_fraction=0.65)
    assert gib(bf16.weights) > 2.5 * 13.72


def test_log_llama31_8b_a100_40gb_vllm_0_15_1_eager() -> None:
    """ilseokoh/vllm-gce README.md (GCE a2-highgpu-1g: one A100 40 GB; ``uv run test.py``, the offline ``LLM``
    class): "non-default args: {'disable_log_stats': True, 'enforce_eager': True, 'model': …Meta-Llama-3.1-8B-
    Instruct}", "Initializing a V1 LLM engine (v0.15.1)", "Using max model len 131072", "Chunked prefill is
    enabled with max_num_batched_tokens=8192.", "Model loading took 14.99 GiB memory and 6.720924 seconds",
    "Available KV cache memory: 19.28 GiB", "GPU KV cache size: 157,936 tokens", "Maximum concurrency for
    131,072 tokens per request: 1.20x", "Cudagraph is disabled under eager mode"; it then generates.

    Every part within the tolerance: weights −0.2 %, available KV +0.9 %, tokens +0.9 %, concurrency +1.3 %, no
    graphs, starts. The log's parts leave profile peak + non-torch ≈ 0.9 × 39.5 − 14.99 − 19.28 ≈ 1.27 GiB;
    vramplan's is the sampler's 256 × 128,256 logits at the CUDA sort's 38 B each + non-torch = 1.22 GiB
    (with the ops' own 28 B per logit: 0.92, and the KV +2.4 %)."""
    p = serve_plan("llama-3.1-8b", "a100-sxm4-40gb", engine_version="0.15.1", enforce_eager=True,
                   max_num_batched_tokens=8192)
    assert close(gib(p.weights), 14.99) and close(gib(p.kv_available), 19.28)
    assert p.tokens == pytest.approx(157936, rel=0.05) and p.max_concurrency == pytest.approx(1.20, rel=0.05)
    assert p.cuda_graph == 0 and p.starts and p.max_model_len == 131072
    assert p.log[2].startswith("GPU KV cache size: ") and "Maximum concurrency for 131,072 tokens" in p.log[3]
    assert close(gib(p.profile_peak + p.non_torch), gib(p.budget) - 14.99 - 19.28)  # the log's parts, this total
