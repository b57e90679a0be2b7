"""``serve-plan --engine sglang|tgi --engine-version``: each release's own sizing rules
(pools/sglang_release.py, pools/tgi_release.py), read in SGLang 0.4.6 … 0.5.23 and TGI v3.0.0 …
v3.3.7 (docs/research/sglang-version-history.md). Each test states the rule and the release it
changes in, and checks the plan against that rule's arithmetic on the same inputs."""

from __future__ import annotations

import pytest

from vramplan.errors import WorkloadError
from vramplan.hardware.catalog import get_gpu, usable_capacity
from vramplan.pools import sglang_release as sr
from vramplan.pools import tgi_release as tr
from vramplan.pools.base import outside
from vramplan.pools.kvspec import LayerKV, bytes_per_token, kv_heads_per_rank
from vramplan.pools.sglang_release import SglangRelease
from vramplan.pools.tgi_release import TgiRelease
from vramplan.serving.api import serve_plan
from vramplan.units import GiB

H100 = get_gpu("h100-sxm")  # nvidia-smi 81,559 MiB


def sg(version: str | None, **kw: object):  # type: ignore[no-untyped-def]
    return serve_plan(kw.pop("model", "llama-3.1-8b"), kw.pop("gpu", "h100-sxm"), engine="sglang",
                      engine_version=version, **kw)


def test_default_is_the_newest_and_outside_the_range_is_refused() -> None:
    assert sg(None).engine_version == sr.NEWEST == "0.5.23"
    assert serve_plan("llama-3.1-8b", "h100-sxm", engine="tgi", max_model_len=8192).engine_version == tr.NEWEST
    for engine, bad, says in (("sglang", "0.4.5", "0.4.6 to 0.5.23"), ("sglang", "0.6.0", "0.4.6 to 0.5.23"),
                              ("sglang", "latest", "invalid SGLang version"), ("tgi", "2.4.1", "3.0.0 to 3.3.7"),
                              ("tgi", "3.4.0", "3.0.0 to 3.3.7"), ("trtllm", "1.0", "one release")):
        with pytest.raises(WorkloadError, match=says):
            serve_plan("llama-3.1-8b", "h100-sxm", engine=engine, engine_version=bad, max_model_len=8192)
    assert sr.parse("0.5.0rc2") < sr.parse("0.5.0") < sr.parse("0.5.0.post1") < sr.parse("0.5.1")


def test_mem_fraction_static_per_release() -> None:
    """0.4.6: the TP table up to 81,920 MiB (H100: 0.88), (gpu_mem − 13 GiB)/gpu_mem above (H200);
    0.4.6.post2: above 96 GiB min(f + 48 GiB(1 − f)/gpu_mem, (gpu_mem − 18 GiB)/gpu_mem); 0.4.7: 0.79
    above 180,000 MiB (B200); 0.4.7.post1: round((gpu_mem − (9.5 + P/2) GiB)/gpu_mem, 3) on H100;
    0.5.3: 512 + 1.5 × chunk + 2 × max_bs + P/8 GiB, ≥ 10 GiB; 0.5.10: + 8 MiB per piecewise size."""
    h200 = get_gpu("h200-sxm").smi_total / 2**20  # type: ignore[operator]
    b200 = get_gpu("b200").smi_total / 2**20  # type: ignore[operator]
    h100 = 81559.0
    r = SglangRelease.of
    assert r("0.4.6").mem_fraction_static(h100, tp=4, pp=1, chunk=8192, graph_bs=160, mla=False) == 0.85
    assert r("0.4.6").mem_fraction_static(h200, tp=1, pp=1, chunk=8192, graph_bs=160, mla=False) == \
        (h200 - 13 * 1024) / h200
    assert r("0.4.6.post2").mem_fraction_static(h200, tp=1, pp=1, chunk=8192, graph_bs=160, mla=False) == \
        min(0.88 + 48 * 1024 * 0.12 / h200, (h200 - 18 * 1024) / h200)
    assert r("0.4.7").mem_fraction_static(b200, tp=1, pp=1, chunk=16384, graph_bs=160, mla=False) == 0.79
    assert r("0.4.7.post1").mem_fraction_static(h100, tp=2, pp=1, chunk=8192, graph_bs=160, mla=False) == \
        round((h100 - 10.5 * 1024) / h100, 3)
    reserved = 512 + 8192 * 1.5 + 256 * 2 + 1 / 8 * 1024
    assert r("0.5.3").mem_fraction_static(h100, tp=1, pp=1, chunk=8192, graph_bs=256, mla=False) == \
        round((h100 - reserved) / h100, 3)
    pcg = SglangRelease.of("0.5.10").prefill_graph_tokens(8192, False, 1)
    assert len(pcg) == 8 + 14 + 8 + 8 + 12 + 8 and pcg[-1] == 8192
    assert r("0.5.10").mem_fraction_static(h100, tp=1, pp=1, chunk=8192, graph_bs=256, mla=False) == \
        round((h100 - reserved - 8 * len(pcg)) / h100, 3)
    # small GPUs: at least 10 GiB only above 60 GiB (L4: 23,034 MiB)
    l4 = 23034.0
    assert r("0.5.3").mem_fraction_static(l4, tp=1, pp=1, chunk=2048, graph_bs=16, mla=False) == \
        round((l4 - (512 + 2048 * 1.5 + 32 + 128)) / l4, 3)
    # the plan takes these defaults
    assert sg("0.4.6").settings["mem_fraction_static"] == 0.88
    assert sg("0.5.3").settings["mem_fraction_static"] == round((h100 - reserved) / h100, 3)


def test_chunk_and_graph_defaults_per_release() -> None:
    """chunked_prefill_size / cuda_graph_max_bs by nvidia-smi total: 2048/8 on an L4 to 0.5.19 and
    4096/48 from 0.5.20; 8192/160 on an H100 to 0.5.2, 8192/256 (512 at TP ≥ 4) from 0.5.3; 24 for
    20–35 GiB cards from 0.5.4.post1."""
    assert (sg("0.5.19", gpu="l4").settings["chunked_prefill_size"], sg("0.5.19", gpu="l4").settings["cuda_graph_max_bs"]) == (2048, 24)
    assert (sg("0.5.20", gpu="l4").settings["chunked_prefill_size"], sg("0.5.20", gpu="l4").settings["cuda_graph_max_bs"]) == (4096, 48)
    assert sg("0.5.4", gpu="l4").settings["cuda_graph_max_bs"] == 16
    assert sg("0.5.2").settings["cuda_graph_max_bs"] == 160 and sg("0.5.3").settings["cuda_graph_max_bs"] == 256
    assert sg("0.5.3", model="llama-3.1-70b", tp=4).settings["cuda_graph_max_bs"] == 512
    assert sg("0.4.7", gpu="b200").settings["chunked_prefill_size"] == 16384
    assert sg("0.4.6", gpu="b200").settings["chunked_prefill_size"] == 8192


def test_pool_follows_profile_max_num_token() -> None:
    """Every release: rest = free_after_weights − free_after_init × (1 − f) in GB; tokens =
    int(rest × 2^30) // cell; K and V buffers of tokens + page_size rows; the request pool
    min(clamp(tokens / context × 512, 2048, 4096), tokens // 2) rows (from 0.4.7; + 1 before) × (context + 4) int32."""
    p = sg("0.5.23", max_model_len=32768)
    total, _ = usable_capacity(H100)
    out = outside(H100, 1)
    t0 = total - out.context - out.later
    f = p.settings["mem_fraction_static"]
    rest = int(((t0 - p.weights) / GiB - t0 / GiB * (1 - f)) * GiB)
    cell = 32 * 2 * 8 * 128 * 2
    assert p.tokens == rest // cell and p.kv_pool == (p.tokens + 1) * cell
    reqs = min(max(int(p.tokens / 32768 * 512), 2048), 4096)
    assert p.settings["max_num_reqs"] == min(reqs, p.tokens // 2)
    pool_end = (t0 - p.weights - p.kv_pool - reqs * (32768 + 4) * 4) / GiB
    assert p.log[2] == f"Memory pool end. avail mem={pool_end:.2f} GB"
    assert p.log[1].startswith(f"KV Cache is allocated. dtype: torch.bfloat16, #tokens: {p.tokens}, K size: ")
    assert "dtype" not in sg("0.5.12").log[1]


def test_log_qwen3_235b_tp4_sglang_21348() -> None:
    """vllm-project/vllm#21348 (July 2025, SGLang 0.4.9.x): Qwen3-235B-A22B-FP8 on 4× H100,
    "KV Cache is allocated. #tokens: 367404, K size: 8.23 GB, V size: 8.23 GB". The K buffers hold
    #tokens + 1 rows of 94 layers × 1 KV head × 128 × 2 B; the line is the rule's text at 0.4.9."""
    layers = tuple(LayerKV("full", kv_heads_per_rank(4, 4, "sglang"), 128, 2) for _ in range(94))
    cell = bytes_per_token(layers)
    k = (367404 + 1) * cell // 2
    assert SglangRelease.of("0.4.9").kv_line(367404, k, k, False, "torch.bfloat16") == \
        "KV Cache is allocated. #tokens: 367404, K size: 8.23 GB, V size: 8.23 GB"


def test_tgi_wiggle_room_per_release() -> None:
    """TGI_WIGGLE_ROOM 0.95 (3.0.x) → 0.93 (3.1.0) → 0.90 (3.3.0); free = CUDA free − (1 −
    cuda_memory_fraction × wiggle) × total; num_blocks = ⌊free / block bytes⌋ + the warm-up batch's."""
    assert [TgiRelease.of(v).wiggle_room for v in ("3.0.2", "3.1.0", "3.2.3", "3.3.0")] == [0.95, 0.93, 0.93, 0.90]
    total, _ = usable_capacity(H100)
    out = outside(H100, 1)
    for v, w in (("3.0.0", 0.95), ("3.3.7", 0.90)):
        p = serve_plan("llama-3.1-8b", "h100-sxm", engine="tgi", engine_version=v, max_model_len=8192,
                       memory_fraction=0.9)
        # the warm-up batch: ⌈prefill / 8191⌉ requests of 8191 prompt tokens' blocks each (block size 1);
        # the launcher's default prefill on an H100 (test_serving_public_logs_sglang_tgi.py)
        assert p.settings["max_batch_prefill_tokens"] == 59870
        batch = -(-59870 // 8191) * 8191
        # flashinfer (the default) keeps its 128 MiB workspace from start-up
        assert p.runner_buffers == 128 * 2**20
        free = total - out.context - out.later - p.weights - p.runner_buffers - p.profile_peak - batch * 131072
        assert p.blocks == int((free - (1 - 0.9 * w) * total) // 131072) + batch
        assert p.log[0] == f"KV-cache blocks: {p.blocks}, size: 1"
