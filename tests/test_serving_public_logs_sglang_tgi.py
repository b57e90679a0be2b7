"""Public SGLang (and, at the end, TGI 3.x) start-up logs as tests (issue 30): each plans the log's configuration with
``serve_plan`` (analytic, no trace) and compares every part the log prints — the free memory before
the weights, the weights, the free memory after them, the KV pool (#tokens, K size), "Memory pool
end", the CUDA-graph capture, max_total_num_tokens / max_running_requests, start or fail.

The issue's tolerance is 5 %, or 0.2 GiB for parts under 4 GiB (:func:`close`). Where vramplan lands
outside it the test asserts the measured gap as it is, so a change shows, and the docstring names it.
Each test also checks SGLang's own rule on the log's own figures (``profile_max_num_token``: tokens
= ⌊(after − before × (1 − f)) × 2^30 / cell⌋, GB floats as printed), which isolates vramplan's inputs
from the rule. Sources, verbatim lines, what is known and assumed, and the table of every part:
docs/research/sglang-tgi-public-logs.md. SGLang prints GB but divides by 2^30 (GiB)."""

from __future__ import annotations

import dataclasses
import json
import re

import pytest

from vramplan.hardware.catalog import get_gpu
from vramplan.models.catalog import resolve, spec_from_text
from vramplan.pools.kvspec import bytes_per_token, layer_specs
from vramplan.pools.result import ServePlan
from vramplan.pools.sglang_release import SglangRelease
from vramplan.pools.tgi_release import TgiRelease
from vramplan.serving import sglang, tgi
from vramplan.serving.api import serve_plan
from vramplan.units import GiB

QWEN3_14B = {  # Qwen/Qwen3-14B config.json dimensions
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 5120, "intermediate_size": 17408,
    "num_hidden_layers": 40, "num_attention_heads": 40, "num_key_value_heads": 8, "head_dim": 128,
    "vocab_size": 151936, "max_position_embeddings": 40960, "tie_word_embeddings": False, "rms_norm_eps": 1e-6,
    "torch_dtype": "bfloat16"}
QWEN3_06B = {  # Qwen/Qwen3-0.6B config.json dimensions
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 1024, "intermediate_size": 3072,
    "num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128,
    "vocab_size": 151936, "max_position_embeddings": 40960, "tie_word_embeddings": True, "rms_norm_eps": 1e-6,
    "torch_dtype": "bfloat16"}


def close(predicted: float, logged: float) -> bool:
    """Issue 30's tolerance on one part (GiB): within 0.2 GiB for a part under 4 GiB, else within 5 %."""
    if abs(logged) < 4:
        return abs(predicted - logged) <= 0.2
    return abs(predicted - logged) <= 0.05 * abs(logged)


def gib(x: int) -> float:
    return x / GiB


def before_weights(p: ServePlan) -> float:
    """vramplan's free memory after the distributed init ("Load weight begin. avail mem")."""
    return gib(p.total_memory - p.context - p.non_torch)


def pool_end(p: ServePlan) -> float:
    m = re.fullmatch(r"Memory pool end\. avail mem=([\d.]+) GB", p.log[2])
    assert m, p.log
    return float(m.group(1))


def k_size(p: ServePlan) -> float:
    m = re.search(r"K size: ([\d.]+) GB", p.log[1])
    assert m, p.log
    return float(m.group(1))


def rule_tokens(before: float, after: float, frac: float, cell: int) -> int:
    """SGLang's profile_max_num_token on the log's own (rounded) GB figures."""
    return int((after - before * (1 - frac)) * GiB) // cell


def display_slack(cell: int, frac: float, summed: int = 1) -> int:
    """Tokens the printed 0.01 GB rounding can move: half a unit on "after" and on each of the ``summed``
    figures "before" is read from (2 where it is after + mem usage)."""
    return int(0.005 * (1 + summed * (1 - frac)) * GiB / cell) + 1


def cell_of(model: object, tp: int) -> int:
    spec = model if not isinstance(model, str) else resolve(model)
    return bytes_per_token(layer_specs(spec, tp=tp, pp=1, kv_cache_dtype="auto", engine="sglang",  # type: ignore[arg-type]
                                       sliding=False))


def test_log_llama31_8b_h100_docs_2025_01() -> None:
    """docs.sglang.ai "Quick Start: Sending Requests" (2025-01-23; SGLang 0.4.1/0.4.2, planned with
    0.4.6's rules, the oldest modelled: profile_max_num_token and the pool are the same), H100 80 GB,
    meta-llama/Meta-Llama-3.1-8B-Instruct, mem_fraction_static 0.88, chunked_prefill_size 8192:
    "Load weight begin. avail mem=78.81 GB", "Load weight end. … avail mem=63.72 GB", "KV Cache is
    allocated. K size: 27.13 GB, V size: 27.13 GB.", "Memory pool end. avail mem=8.34 GB",
    "max_total_num_tokens=444500, max_prefill_tokens=16384, max_running_requests=2049,
    context_len=131072". Every part within the tolerance (weights = 78.81 − 63.72 = 15.09)."""
    p = serve_plan("llama-3.1-8b", "h100-sxm", engine="sglang", engine_version="0.4.6", memory_fraction=0.88,
                   max_num_batched_tokens=8192)
    cell = cell_of("llama-3.1-8b", 1)
    assert abs(rule_tokens(78.81, 63.72, 0.88, cell) - 444500) <= display_slack(cell, 0.88)
    assert close(before_weights(p), 78.81) and close(gib(p.weights), 78.81 - 63.72)
    assert close(before_weights(p) - gib(p.weights), 63.72)
    assert p.tokens == pytest.approx(444500, rel=0.05) and close(k_size(p), 27.13) and close(pool_end(p), 8.34)
    assert (p.max_running, p.max_model_len, p.starts) == (2049, 131072, True)


def test_log_r1_distill_qwen_7b_rtx3090_wsl_2025_02() -> None:
    """A public README ("Local deployment of Deepseek-R1 with RTX3090/RTX4090", 2025-02-04; SGLang
    0.4.2 in Docker on WSL2, planned with 0.4.6's rules), DeepSeek-R1-Distill-Qwen-7B on one RTX 3090,
    mem_fraction_static 0.88, chunk 2048, cuda_graph_max_bs 8: "Load weight begin. avail mem=22.76 GB",
    "Load weight end. … avail mem=8.37 GB", "K size: 2.82 GB", "Memory pool end. avail mem=1.68 GB",
    "max_total_num_tokens=105531, …, max_running_requests=2049, context_len=131072".

    The rule on the log's figures gives its #tokens. Weights (14.39 by difference) within 1.4 %; the
    free memory before them 2.2 % over (vramplan 23.26 GiB: WSL2 on a desktop card keeps ~0.5 GiB more
    than a bare card). That 0.5 GiB, carried into a rest of 5.6 GB, puts the free memory after the
    weights 8 % over and the pool 11–12 % over (#tokens, K size): outside the tolerance, asserted as
    measured. "Memory pool end" lands within 0.2 GiB."""
    p = serve_plan("deepseek-r1-distill-qwen-7b", "rtx-3090", engine="sglang", engine_version="0.4.6",
                   memory_fraction=0.88, max_num_batched_tokens=2048)
    cell = cell_of("deepseek-r1-distill-qwen-7b", 1)
    assert abs(rule_tokens(22.76, 8.37, 0.88, cell) - 105531) <= display_slack(cell, 0.88)
    assert close(before_weights(p), 22.76) and close(gib(p.weights), 22.76 - 8.37)
    after = before_weights(p) - gib(p.weights)
    assert 0.07 < after / 8.37 - 1 < 0.10  # the gap named above
    assert 0.10 < p.tokens / 105531 - 1 < 0.13 and 0.25 < k_size(p) - 2.82 < 0.4
    assert close(pool_end(p), 1.68)
    assert (p.max_running, p.max_model_len, p.starts) == (2049, 131072, True)


def test_log_qwq_32b_tp4_l4_2025_03() -> None:
    """A public deployment note (QwQ-32B on an AWS g6.12xlarge, 4× L4 24 GB, 2025-03-08; SGLang 0.4.3,
    planned with 0.4.6's rules; QwQ-32B has Qwen2.5-32B's dimensions), TP 4, mem_fraction_static 0.85,
    chunk 2048, cuda_graph_max_bs 80: "Init torch distributed ends. mem usage=0.13 GB", "Load weight
    begin. avail mem=21.63 GB", "Load weight end. … avail mem=6.09 GB, mem usage=15.54 GB.", "KV Cache is
    allocated. #tokens: 46611, K size: 1.42 GB, V size: 1.42 GB", "Memory pool end. avail mem=2.09 GB",
    "Capture cuda graph end. … avail mem=0.53 GB. mem usage=0.93 GB.", "max_total_num_tokens=46611,
    chunked_prefill_size=2048, max_prefill_tokens=16384, max_running_requests=2049, context_len=131072".

    Within the tolerance: the free memory before the weights (+0.3 %), the weights (−1.8 %: 15.26
    against 15.54), K size and pool end (< 0.2 GiB), max_running_requests, context_len. Outside: the
    0.28 GiB of weights not predicted leaves the free memory after them 0.34 GiB (5.6 %) over, and a rest
    of only 2.8 GB turns that into +11.6 % #tokens; the decode CUDA graphs (batch 1…80) take 0.93 GiB
    where vramplan's rough estimate gives under 0.01 GiB."""
    p = serve_plan("qwen2.5-32b", "l4", engine="sglang", engine_version="0.4.6", tp=4, memory_fraction=0.85,
                   max_num_batched_tokens=2048)
    cell = cell_of("qwen2.5-32b", 4)
    assert abs(rule_tokens(21.63, 6.09, 0.85, cell) - 46611) <= display_slack(cell, 0.85)
    assert close(before_weights(p), 21.63) and close(gib(p.weights), 15.54)
    after = before_weights(p) - gib(p.weights)
    assert 0.3 < after - 6.09 < 0.4  # the gap named above
    assert 0.10 < p.tokens / 46611 - 1 < 0.13
    assert close(k_size(p), 1.42) and close(pool_end(p), 2.09)
    assert gib(p.cuda_graph) < 0.05 and not close(gib(p.cuda_graph), 0.93)  # graphs: the gap named above
    assert (p.max_running, p.max_model_len, p.starts) == (2049, 131072, True)


def test_log_llama31_8b_24gb_docker_desktop_2025_07() -> None:
    """A public README (SGLang in Docker Desktop on Windows, 2025-07-14: 0.4.9), Llama-3.1-8B-Instruct on
    a 24 GB card (which one is not said: planned on an RTX 4090; an RTX 3090's 24,576 MiB gives the
    same default fraction 0.879), defaults (chunk 2048, graphs up to batch 8): "Load weight end. …
    avail mem=7.37 GB, mem usage=15.02 GB.", "#tokens: 38141, K size: 2.33 GB", "Memory pool end. avail
    mem=1.46 GB", "Capture cuda graph end. … mem usage=0.11 GB.", "max_total_num_tokens=38141,
    chunked_prefill_size=2048, max_prefill_tokens=16384, max_running_requests=2048, context_len=131072".

    0.4.9's default fraction (0.879, reserved 2.9 GiB) reproduces #tokens from the log's own figures,
    and max_running_requests=2048 (not 2049) is the request pool of max_num_reqs rows from 0.4.7
    (SglangRelease.req_pool_rows). Weights within 0.4 %, graphs within 0.2 GiB. The free memory before
    the weights is 22.39 GiB against vramplan's 23.48 (+4.9 %, the Windows desktop's share): that 1.1 GiB
    puts the memory after the weights 16 % over and the pool 22 % over; asserted as measured."""
    p = serve_plan("llama-3.1-8b", "rtx-4090", engine="sglang", engine_version="0.4.9")
    st = p.settings
    assert (st["mem_fraction_static"], st["chunked_prefill_size"], st["cuda_graph_max_bs"]) == (0.879, 2048, 8)
    cell = cell_of("llama-3.1-8b", 1)
    assert abs(rule_tokens(7.37 + 15.02, 7.37, 0.879, cell) - 38141) <= display_slack(cell, 0.879, 2)
    assert close(gib(p.weights), 15.02) and close(before_weights(p), 7.37 + 15.02)
    after = before_weights(p) - gib(p.weights)
    assert 0.14 < after / 7.37 - 1 < 0.18 and 0.20 < p.tokens / 38141 - 1 < 0.24  # the gap named above
    assert 0.4 < k_size(p) - 2.33 < 0.6 and 0.3 < pool_end(p) - 1.46 < 0.45
    assert close(gib(p.cuda_graph), 0.11)
    assert (p.max_running, p.max_model_len, p.starts) == (2048, 131072, True)


def test_log_qwen3_06b_rtx5080_2025_08() -> None:
    """A public README (MinerU/SGLang images for Blackwell, 2025-08-08: SGLang 0.4.10, planned so),
    Qwen3-0.6B on one RTX 5080 16 GB (nvidia-smi 16,303 MiB in the same file), defaults: "Load weight
    end. … avail mem=13.91 GB, mem usage=1.25 GB.", "KV Cache is allocated. #tokens: 104273, K size:
    5.57 GB, V size: 5.57 GB", "Memory pool end. avail mem=2.43 GB", "Capture cuda graph end. … mem
    usage=0.11 GB.", "max_total_num_tokens=104273, chunked_prefill_size=2048, max_prefill_tokens=16384,
    max_running_requests=2048, context_len=40960".

    Every part within the tolerance: weights 1.11 against 1.25 (−0.14 GiB), #tokens +2.3 %, K size
    +2.2 %, pool end +0.08 GiB, graphs (vramplan < 0.01) within 0.2 GiB; max_running_requests 2048 (the
    pool of max_num_reqs rows from 0.4.7). The catalog has no nvidia-smi total for the RTX 5080, so the
    default fraction is 0.816 from the CUDA total. The log's own figures imply 0.817; the 16,303 MiB of
    the file's nvidia-smi gives 0.818 under 0.4.10's reserved 2.9 GiB, whose #tokens are 0.12 % over the
    log's (not found why: the nvidia-smi output was taken 15 h after the log)."""
    spec = spec_from_text(json.dumps(QWEN3_06B), "Qwen3-0.6B/config.json")
    p = serve_plan(spec, "rtx-5080", engine="sglang", engine_version="0.4.10")
    assert SglangRelease.of("0.4.10").mem_fraction_static(16303, tp=1, pp=1, chunk=2048, graph_bs=8,
                                                            mla=False) == 0.818
    cell = cell_of(spec, 1)
    assert abs(rule_tokens(13.91 + 1.25, 13.91, 0.817, cell) - 104273) <= display_slack(cell, 0.817, 2)
    assert 0.001 < rule_tokens(13.91 + 1.25, 13.91, 0.818, cell) / 104273 - 1 < 0.0015
    assert close(gib(p.weights), 1.25) and close(before_weights(p) - gib(p.weights), 13.91)
    assert p.tokens == pytest.approx(104273, rel=0.05) and close(k_size(p), 5.57) and close(pool_end(p), 2.43)
    assert close(gib(p.cuda_graph), 0.11)
    assert (p.max_running, p.max_model_len, p.starts) == (2048, 40960, True)


def test_log_qwen3_14b_tp4_rtx4090_2026_06() -> None:
    """A public project log (Qwen3-14B on 4× RTX 4090, 24,564 MiB, TP 4, 2026-06-14; SGLang at commit
    ebaf86d4, planned with 0.5.19's rules: the logged chunk 2048 on a 24 GiB card is the rule before
    0.5.20), mem_fraction_static 0.80: "Load weight end. … avail mem=16.00 GB, mem usage=7.08 GB.",
    "KV Cache is allocated. #tokens: 298447, K size: 5.69 GB, V size: 5.69 GB",
    "max_total_num_tokens=298447, chunked_prefill_size=2048, max_prefill_tokens=16384,
    max_running_requests=3730, context_len=40960, available_gpu_mem=2.82 GB".

    Every part within the tolerance: weights −2.9 %, free after them +3.3 %, #tokens and K size +4 %.
    max_running_requests is max_num_reqs = min(⌊tokens / 40960 × 512⌋, tokens // 2) (no + 1 from 0.4.7):
    the rule gives 3730 from the log's #tokens exactly; vramplan's own (from its #tokens) is 4 % over."""
    spec = spec_from_text(json.dumps(QWEN3_14B), "Qwen3-14B/config.json")
    p = serve_plan(spec, "rtx-4090", engine="sglang", engine_version="0.5.19", tp=4, memory_fraction=0.80)
    rel = SglangRelease.of("0.5.19")
    assert rel.max_running(298447, rel.max_num_reqs(298447, 40960, None), None) == 3730
    cell = cell_of(spec, 4)
    assert abs(rule_tokens(16.00 + 7.08, 16.00, 0.80, cell) - 298447) <= display_slack(cell, 0.80, 2)
    assert p.settings["chunked_prefill_size"] == 2048
    assert close(gib(p.weights), 7.08) and close(before_weights(p) - gib(p.weights), 16.00)
    assert p.tokens == pytest.approx(298447, rel=0.05) and close(k_size(p), 5.69)
    assert p.max_running == pytest.approx(3730, rel=0.05) and (p.max_model_len, p.starts) == (40960, True)


def test_log_qwen25_05b_h100_docs_ci_2026_02() -> None:
    """docs.sglang.io "SGLang Native APIs" (CI run 2026-02-04, SGLang 0.5.8: a date before 0.5.10's
    piecewise graphs), qwen/qwen2.5-0.5b-instruct on an H100 80 GB; the docs' launcher caps
    max_total_tokens 20480, max_running_requests 128 and graphs at batch 4 ("Capture cuda graph bs [1,
    2, 4]"): server info "mem_fraction_static":0.841, "chunked_prefill_size":8192; "Load weight begin.
    avail mem=78.43 GB", "Load weight end. … avail mem=77.45 GB, mem usage=0.98 GB.", "KV Cache is
    allocated. #tokens: 20480, K size: 0.12 GB, V size: 0.12 GB", "Memory pool end. avail mem=77.12 GB",
    "Capture cuda graph end. … mem usage=0.07 GB.", "max_total_num_tokens=20480, chunked_prefill_size=8192,
    max_prefill_tokens=16384, max_running_requests=128, context_len=32768".

    0.5.3's reserved memory (512 + 1.5 × 8192 + 2 × 4 + 128 MiB on 81,559 MiB) gives the logged default
    0.841. Every part within the tolerance (pool end +0.4 %)."""
    rel = SglangRelease.of("0.5.8")
    assert rel.mem_fraction_static(81559, tp=1, pp=1, chunk=8192, graph_bs=4, mla=False) == 0.841
    p = sglang.plan(resolve("qwen2.5-0.5b"), get_gpu("h100-sxm"), settings=sglang.SglangSettings(
        mem_fraction_static=0.841, max_total_tokens=20480, max_running_requests=128, engine_version="0.5.8"))
    assert close(before_weights(p), 78.43) and close(gib(p.weights), 0.98)
    assert close(before_weights(p) - gib(p.weights), 77.45)
    assert p.tokens == 20480 and k_size(p) == 0.12 and close(pool_end(p), 77.12)
    assert close(gib(p.cuda_graph), 0.07)
    assert (p.max_running, p.max_model_len, p.starts) == (128, 32768, True)


def test_log_qwen3_14b_48gb_xinference_2025_05() -> None:
    """xorbitsai/inference#3481 (2025-05-19, SGLang through Xinference, one card; SGLang ~0.4.6 from the
    date, planned so), Qwen3-14B: "Load weight end. type=Qwen3ForCausalLM, dtype=torch.bfloat16, avail
    mem=19.67 GB, mem usage=27.57 GB.", "KV Cache is allocated. #tokens: 91749, K size: 7.00 GB, V size:
    7.00 GB", "Memory pool end. avail mem=5.27 GB", "Capture cuda graph bs [1, 2, 4, 8, 16, 24, …, 152, 160]".
    The card is not named: 47.24 GB free before the weights is a 48 GB card, planned as an RTX A6000; the
    fraction is not printed, and 0.4.6's default for it (0.88) reproduces #tokens from the log's own figures.
    Whether it started is not in the excerpt (the title says it could not load), so not compared.

    Every part within the tolerance: free before the weights −0.8 %, weights −0.2 %, after them −1.7 %,
    #tokens −2.1 %, K size −0.15 GiB, pool end +0.04 GiB; the decode graphs' batches up to 160 are 0.4.6's
    default on a card of that size."""
    spec = spec_from_text(json.dumps(QWEN3_14B), "Qwen3-14B/config.json")
    p = serve_plan(spec, "rtx-a6000", engine="sglang", engine_version="0.4.6")
    st = p.settings
    assert (st["mem_fraction_static"], st["cuda_graph_max_bs"]) == (0.88, 160)
    cell = cell_of(spec, 1)
    assert abs(rule_tokens(19.67 + 27.57, 19.67, 0.88, cell) - 91749) <= display_slack(cell, 0.88, 2)
    assert close(before_weights(p), 19.67 + 27.57) and close(gib(p.weights), 27.57)
    assert close(before_weights(p) - gib(p.weights), 19.67)
    assert p.tokens == pytest.approx(91749, rel=0.05) and close(k_size(p), 7.00) and close(pool_end(p), 5.27)


def test_request_pool_rows_change_at_0_4_7() -> None:
    """ReqToTokenPool(size=max_num_reqs + 1) to 0.4.6.post5, size=max_num_reqs from 0.4.7: the logs
    above print max_running_requests=2049 at 0.4.1–0.4.3 and 2048 at 0.4.9–0.4.10."""
    assert SglangRelease.of("0.4.6.post5").req_pool_rows(2048) == 2049
    assert SglangRelease.of("0.4.7").req_pool_rows(2048) == 2048
    for v, expect in (("0.4.6", 2049), ("0.4.7", 2048), ("0.5.23", 2048)):
        p = serve_plan("llama-3.1-8b", "h100-sxm", engine="sglang", engine_version=v)
        assert p.max_running == expect


# --- TGI 3.x ---------------------------------------------------------------------------------
def test_tgi_launcher_default_prefill_per_card_and_release() -> None:
    """TGI 3's launcher, ``max_batch_prefill_tokens`` unset (launcher/src/main.rs v3.0.1:2030-2058):
    the card's f16 FLOP/s × shards ÷ the model's FLOP per token (``Config::flop``: 3 × 2·heads·d·h +
    2 × 2·kv·d·h + 2·3·h·ffn per layer), or 4096 on a card its nvidia-smi name table does not know
    (every GeForce card; the A100 40 GB until 3.1.0), capped by max_position_embeddings and by
    (nvidia-smi total × 0.95 − 2-byte weights) ÷ (KV + 9 × ffn B) per token. Llama-3.1-8B's sums
    written out: 32 layers × (3 × 33,554,432 + 2 × 8,388,608 + 352,321,536) FLOP."""
    flop = 32 * (3 * 2 * 32 * 128 * 4096 + 2 * 2 * 8 * 128 * 4096 + 2 * 3 * 4096 * 14336)
    assert flop == 15_032_385_536
    spec, l4 = resolve("llama-3.1-8b"), get_gpu("l4")
    model = ((3 * 14336 * 4096 + (32 + 16) * 128 + 32 * 128 * 4096) * 32 + 2 * 4096 * 128256) * 2
    per_token = 8 * 2 * 128 * 2 * 32 + (14336 + 7168) * 2 * 3
    vram_cap = (int(l4.smi_total * 0.95) - model) // per_token  # type: ignore[operator]
    assert vram_cap > 121 * 10**12 // flop == 8049  # the compute rule binds on one L4
    assert tgi.default_prefill(spec, l4, TgiRelease.of("3.0.0"), 1, "none", 1.0) == 8049
    assert tgi.default_prefill(spec, l4, TgiRelease.of("3.3.7"), 2, "none", 1.0) == 2 * 121 * 10**12 // flop
    # a card the launcher does not name: 4096
    assert tgi.default_prefill(spec, get_gpu("rtx-4090"), TgiRelease.of("3.3.7"), 1, "none", 1.0) == 4096
    a100 = get_gpu("a100-sxm4-40gb")
    assert tgi.default_prefill(spec, a100, TgiRelease.of("3.0.2"), 1, "none", 1.0) == 4096
    assert tgi.default_prefill(spec, a100, TgiRelease.of("3.1.0"), 1, "none", 1.0) == 312 * 10**12 // flop
    # the VRAM cap binds at a small cuda_memory_fraction (TGI multiplies in f32; the floor is the same here),
    # and is skipped for an AWQ / GPTQ checkpoint (its config has a quantization_config)
    h100 = get_gpu("h100-sxm")
    capped = (int(h100.smi_total * 0.2 * 0.95) - model) // per_token  # type: ignore[operator]
    assert 0 < capped < 900 * 10**12 // flop
    assert tgi.default_prefill(spec, h100, TgiRelease.of("3.3.7"), 1, "none", 0.2) == capped
    assert tgi.default_prefill(spec, h100, TgiRelease.of("3.3.7"), 1, "awq", 0.2) == 900 * 10**12 // flop
    # on an H100 the model's 131,072 positions do not bind either; the plan takes the default
    p = serve_plan("llama-3.1-8b", "h100-sxm", engine="tgi", max_model_len=8192)
    assert p.settings["max_batch_prefill_tokens"] == 900 * 10**12 // flop


def test_tgi_marlin_temporaries_where_they_apply() -> None:
    """Marlin's per-GEMM buffers are counted for an AWQ / GPTQ dense model on compute capability 8.0+
    under TGI 3.0.0 … 3.1.0 (marlin-kernels 0.3.6 / 0.3.7, read); not before Ampere (no Marlin), not
    from 3.1.1 (kernels-community/quantization, not read), not for a 16-bit model. Small batches: the
    reduce buffer's rows are M rounded up to 16 up to 64 rows. A model whose TGI class was not read
    (Qwen3: TGI 3.x has no flash Qwen3 class) keeps vramplan's forward peak, to which the largest layer's
    buffers are added."""
    spec = resolve("llama-3.1-8b")
    rel, late = TgiRelease.of("3.0.1"), TgiRelease.of("3.1.1")
    a10g, v100 = get_gpu("a10g"), get_gpu("v100-sxm2-32gb")
    assert tgi.uses_marlin_temporaries(spec, a10g, rel, "gptq") and tgi.uses_marlin_temporaries(spec, a10g, rel, "awq")
    assert not tgi.uses_marlin_temporaries(spec, v100, rel, "awq")
    assert not tgi.uses_marlin_temporaries(spec, a10g, late, "awq")
    assert not tgi.uses_marlin_temporaries(spec, a10g, rel, "none")
    # 8B at 40 rows: gate_up (K 4096, N 28,672) with 48 reduce rows
    assert tgi.marlin_temporaries(spec, 40, 1) == 40 * 4096 * 2 + 48 * 28672 * 4
    assert [tgi.marlin_reduce_rows(m) for m in (1, 17, 64, 65, 4096)] == [16, 32, 64, 128, 1024]
    qwen3 = resolve("qwen3-8b")
    kw = {"engine": "tgi", "quantization": "awq", "max_model_len": 4096, "max_num_batched_tokens": 4096}
    base = serve_plan("qwen3-8b", "a10g", engine_version="3.0.1", **kw)  # type: ignore[arg-type]
    later = serve_plan("qwen3-8b", "a10g", engine_version="3.1.1", **kw)  # type: ignore[arg-type]
    assert tgi.warmup_peak(qwen3, 4096, 1, rel, marlin=True) is None
    assert base.profile_peak - later.profile_peak == tgi.marlin_temporaries(qwen3, 4096, 1)


def test_tgi_flash_llama_warmup_peak() -> None:
    """TGI's FlashLlamaForCausalLM keeps inputs_embeds, the loop's hidden_states / residual and the
    layer's five locals (8 × hidden) alive through the MLP, and the fused gate_up output through
    down_proj; the peak is the largest GEMM / activation moment. Llama-3.1-8B at 4,096 tokens, 16 bit:
    the act(gate) * up moment, 8 × 4096 + 4 × 14,336 columns; with Marlin the down_proj moment
    (9 × 4096 + 3 × 14,336 columns, + a_tmp [M, 14,336] + c_tmp [1024, 4096] fp32) is over it.
    Not a read layout: an MoE other than Mixtral (Qwen3-MoE), hidden > 8192 (in-place RMSNorm), Qwen3 (no flash
    class)."""
    spec, m, rel = resolve("llama-3.1-8b"), 4096, TgiRelease.of("3.3.7")
    act = 2 * m * (8 * 4096 + 4 * 14336)
    down = 2 * m * (9 * 4096 + 3 * 14336) + m * 14336 * 2 + 1024 * 4096 * 4
    assert tgi.warmup_peak(spec, m, 1, rel, marlin=False) == act < down == tgi.warmup_peak(spec, m, 1, rel, marlin=True)
    for older in ("3.0.0", "3.1.1", "3.2.0"):  # the same layer at every tag
        assert tgi.warmup_peak(spec, m, 1, TgiRelease.of(older), marlin=False) == act
    for other in ("qwen3-30b-a3b", "llama-3.1-405b", "qwen3-8b"):
        assert tgi.warmup_peak(resolve(other), m, 8, rel, marlin=False) is None
    p = serve_plan("llama-3.1-8b", "h100-sxm", engine="tgi", engine_version="3.3.7", max_model_len=8192,
                   max_num_batched_tokens=m)
    assert p.profile_peak == act and "FlashLlamaForCausalLM" in p.notes[0]


def test_tgi_qwen2_warmup_peak_per_release() -> None:
    """TGI's Qwen2ForCausalLM, counted by hand from the code. Qwen2.5-7B (hidden 3584, intermediate 18,944,
    28 heads, 4 KV heads of 128) at 4,096 tokens, 16 bit:

    - to v3.1.0 the layer is FlashLlama's (flash_qwen2_modeling.py v3.0.1:254-277): 8 hidden-sized tensors
      through the MLP, 5 during the attention; the act(gate) * up moment 8 × 3584 + 4 × 18,944 columns;
    - from v3.1.1 (v3.1.1:238-256, v3.3.7:288-310) the norms take no residual and the sums are explicit:
      ``inputs_embeds``, the loop's input, ``normed_hidden_states``, ``attn_output``, the sum, its normed
      copy — 6 through the MLP, 3 during the attention: 6 × 3584 + 4 × 18,944;
    - to v3.2.0 the batch fills ``prefill_cache_indices`` (config ``sliding_window`` 131,072 ≥ the prompt) and
      the attention copies ``kv_to_cache`` [4096, 2 × 4 × 128] through o_proj (v3.0.1:143-146); from v3.2.1
      no copy (flash_causal_lm.py v3.3.7:1139): the o_proj moment loses 4096 × 1024 × 2 bytes."""
    spec, m = resolve("qwen2.5-7b"), 4096
    h, i, q, kv = 3584, 18944, 28 * 128, 4 * 128
    old, mid, new = TgiRelease.of("3.0.1"), TgiRelease.of("3.2.0"), TgiRelease.of("3.3.7")
    assert tgi.warmup_peak(spec, m, 1, old, marlin=False) == 2 * m * (8 * h + 4 * i)
    assert tgi.warmup_peak(spec, m, 1, TgiRelease.of("3.1.0"), marlin=False) == 2 * m * (8 * h + 4 * i)
    assert tgi.warmup_peak(spec, m, 1, TgiRelease.of("3.1.1"), marlin=False) == 2 * m * (6 * h + 4 * i)
    assert tgi.warmup_peak(spec, m, 1, new, marlin=False) == 2 * m * (6 * h + 4 * i)
    o_proj = 2 * m * (3 * h + (q + 2 * kv) + q + h)
    assert tgi.warmup_moments(spec, m, 1, new, marlin=False)["o_proj"] == o_proj
    assert tgi.warmup_moments(spec, m, 1, mid, marlin=False)["o_proj"] == o_proj + 2 * m * 2 * kv
    assert tgi.warmup_moments(spec, m, 1, old, marlin=False)["o_proj"] == 2 * m * (5 * h + q + 2 * kv + q + h + 2 * kv)
    # TP 4: one KV head, 7 query heads, intermediate 4,736 per rank
    assert tgi.warmup_peak(spec, m, 4, new, marlin=False) == 2 * m * (6 * h + 4 * 4736)
    # the plan uses it, and names the class
    p = serve_plan("qwen2.5-7b", "h100-sxm", engine="tgi", engine_version="3.3.7", max_model_len=8192,
                   max_num_batched_tokens=m)
    assert p.profile_peak == 2 * m * (6 * h + 4 * i) and "Qwen2ForCausalLM" in p.notes[0]


def test_tgi_mistral_and_gemma2_warmup_peak() -> None:
    """FlashMistralForCausalLM has FlashLlama's layer (flash_mistral_modeling.py v3.0.1:370-394): Mistral-7B
    at 4,096 tokens peaks at act(gate) * up, 8 × 4096 + 4 × 14,336 columns. Its sliding window (4,096) caps
    the ``kv_to_cache`` copy to the last 4,096 positions of each warm-up request to v3.2.0 (flash_causal_lm.py
    v3.0.1:1059-1063): one 8,192-token request (zero config) copies 4,096 rows of 2 × 8 × 128, four
    2,047-token requests and one of 4 (``max_total_tokens`` 2,048) all 8,192.

    FlashGemma2ForCausalLM (v3.0.1:405-430) keeps 4 hidden-sized tensors during the attention and 7 through
    the MLP; its fp32 RMSNorm (:118-126) on ``mlp_output`` adds an fp32 copy and product (4 units) over the 7
    and ``mlp_output``. Gemma-2-9B (hidden 3584, intermediate 14,336, 16 heads of 256, 8 KV heads) at
    4,096 tokens: act 7 × 3584 + 4 × 14,336; a norm moment of 12 × 3584 under it."""
    rel, late = TgiRelease.of("3.0.1"), TgiRelease.of("3.2.1")
    mistral, m, kv = resolve("mistral-7b"), 4096, 8 * 128
    assert tgi.warmup_peak(mistral, m, 1, rel, marlin=False) == 2 * m * (8 * 4096 + 4 * 14336)
    base = tgi.warmup_moments(mistral, 2 * m, 1, late, marlin=False)["o_proj"]
    assert tgi.warmup_moments(mistral, 2 * m, 1, rel, marlin=False)["o_proj"] - base == 2 * 2 * kv * 4096
    four = tgi.warmup_moments(mistral, 8192, 1, rel, marlin=False, max_total=2048)["o_proj"]
    assert four - base == 2 * 2 * kv * 8192
    assert tgi.warmup_requests(8192, 2048) == (2047, 2047, 2047, 2047, 4)
    assert tgi.warmup_moments(resolve("mistral-7b-v0.3"), 2 * m, 1, rel, marlin=False)["o_proj"] == base
    gemma = resolve("gemma-2-9b")
    h, i, q, kvg = 3584, 14336, 16 * 256, 8 * 256
    moments = tgi.warmup_moments(gemma, m, 1, late, marlin=False)
    assert moments["act"] == 2 * m * (7 * h + 4 * i) == tgi.warmup_peak(gemma, m, 1, rel, marlin=False)
    assert moments["post_norm"] == 2 * m * 12 * h and moments["o_proj"] == 2 * m * (4 * h + q + 2 * kvg + q + h)


def test_tgi_mixtral_fused_moe_warmup_peak() -> None:
    """FlashMixtralForCausalLM to TGI 3.1.0 (moe-kernels 0.7.0 / 0.8.2): FlashMistral's layer without the
    outer frames' embeddings (flash_mixtral_modeling.py v3.0.1:463-485), 4 hidden-sized tensors during the
    attention and 7 through the MoE, which writes into its input (``inplace=True``, layers/moe/unquantized.py
    v3.0.1:84-95). Hand count, Mixtral-8x7B (hidden 4096, expert intermediate 14,336, 8 experts, top 2) at
    4,096 tokens, one GPU, at ``fused_experts`` (moe_kernels/fused_moe.py v0.7.0:517-531): the 7 held, the
    router logits [M, 8] bf16, ``topk_weights`` fp32 + ``topk_ids`` int32 [M, 2], the caches [M, 2, 28,672],
    [2M, 14,336], [M, 2, 4096] bf16, and ``sorted_ids`` [2M + 8 × 63] / ``expert_ids`` [⌈that / 64⌉] /
    the padded count [1] int32 (v0.7.0:218-231, default BLOCK_SIZE_M 64 at :345)."""
    spec, m, h = resolve("mixtral-8x7b"), 4096, 4096
    old, new = TgiRelease.of("3.0.1"), TgiRelease.of("3.1.1")
    padded = 2 * m + 8 * 63
    experts = 2 * m * 7 * h + 2 * m * 8 + 8 * m * 2 + 2 * m * 2 * (2 * 14336 + 14336 + h) + 4 * (padded + 136 + 1)
    moments = tgi.warmup_moments(spec, m, 1, old, marlin=False)
    assert moments["fused_experts"] == experts == tgi.warmup_peak(spec, m, 1, TgiRelease.of("3.1.0"), marlin=False)
    assert moments["topk_softmax"] == 2 * m * 7 * h + 2 * m * 8 + 4 * m * 8 + 12 * m * 2
    assert moments["renormalize"] == 2 * m * 7 * h + 2 * m * 8 + 12 * m * 2 + 4 * m
    assert moments["o_proj"] == 2 * m * (4 * h + 32 * 128 + 2 * 8 * 128 + 32 * 128 + h)  # no sliding window
    assert "gate_up" not in moments
    # a config with a sliding window (Mixtral-8x7B's has none) copies the last 4,096 K/V rows (:256-259)
    windowed = dataclasses.replace(spec, config={**spec.config, "sliding_window": 4096})
    copied = tgi.warmup_moments(windowed, 2 * m, 1, old, marlin=False)["o_proj"]
    assert copied - tgi.warmup_moments(spec, 2 * m, 1, old, marlin=False)["o_proj"] == 2 * 2 * 8 * 128 * 4096
    # from 3.1.1 the kernel hub's MoE (tests/test_serving_tgi_moe.py); AWQ experts run Marlin MoE at every release,
    # fp8 experts from 3.1.0 (3.0.x has no fp8 MoE layer); another MoE model class is not read: vramplan's generic forward
    assert tgi.warmup_layout(spec, new).moe_kernel == "kernels-community/moe"
    assert tgi.warmup_layout(spec, old).moe_kernel == "moe-kernels" and tgi.warmup_layout(spec, old, "awq")
    assert tgi.warmup_layout(spec, old, "fp8") is None and tgi.warmup_layout(spec, new, "fp8") is not None
    assert tgi.warmup_layout(resolve("qwen3-30b-a3b"), old) is None
    # a non-power-of-two expert count adds topk_softmax's fp32 [M, E] workspace (topk_softmax_kernels.cu
    # v0.7.0:489-495); past one pass (32,768 tokens) the caches stay one pass long and two passes' alignment
    # outputs meet: 40,000 tokens = passes of 32,768 and 7,232
    six, eight = tgi.fused_moe_moments(m, h, 14336, 6, 2), tgi.fused_moe_moments(m, h, 14336, 8, 2)
    assert six["topk_softmax"] - eight["topk_softmax"] == 2 * m * (6 - 8) + 4 * m * (6 - 8) + 4 * m * 6
    big = tgi.fused_moe_moments(40000, h, 14336, 8, 2)["fused_experts"]
    align = [4 * (p + -(-p // 64) + 1) for p in (2 * 32768 + 504, 2 * 7232 + 504)]
    assert big == 2 * 40000 * 8 + 8 * 40000 * 2 + 2 * 32768 * 2 * (3 * 14336 + h) + sum(align)
    assert tgi.moe_align_ints(8, 2, 8) == 4 * (16 + 8 * 15 + 9 + 1)  # M ≤ E: BLOCK_SIZE_M 16 (v0.7.0:351-357)


def test_tgi_mixtral_plan_follows_fused_moe_per_release() -> None:
    """serve-plan's TGI warm-up peak for Mixtral-8x7B, TP 2 on H100 (the launcher's 32,768 prefill tokens):
    to 3.1.0 moe-kernels' fused-MoE count (each rank's experts at I / 2 = 7,168, one 32,768-token pass, three
    caches), from 3.1.1 the kernel hub's (caches 1 and 3 share one buffer, max(2·I, hidden) wide, so 2 × M × 2 ×
    min(2·I, hidden) bytes less; the fp32 router copy and ``token_expert_indicies`` outlive the renormalization,
    which is not the peak here). No note then: every release's kernel for it was read."""
    m, h, i = 32768, 4096, 7168
    padded = 2 * m + 8 * 63
    align = 4 * (padded + -(-padded // 64) + 1)
    hand = 2 * m * 7 * h + 2 * m * 8 + 8 * m * 2 + 2 * m * 2 * (3 * i + h) + align
    hub = 2 * m * 7 * h + 2 * m * 8 + 8 * m * 2 + 2 * m * 2 * (max(2 * i, h) + i) + align
    for version, want in (("3.0.1", hand), ("3.1.0", hand), ("3.1.1", hub), ("3.3.7", hub)):
        p = serve_plan("mixtral-8x7b", "h100-sxm", engine="tgi", engine_version=version, tp=2)
        assert p.settings["max_batch_prefill_tokens"] == m and p.profile_peak == want
        assert "FlashMixtralForCausalLM" in p.notes[0]
        assert not any("fused-MoE kernel's per-call" in n for n in p.notes)
    assert hand - hub == 2 * m * 2 * min(2 * i, h)
    # an MoE model class that was not read keeps the generic forward and says what it leaves out
    other = serve_plan("qwen3-30b-a3b", "h100-sxm", engine="tgi", engine_version="3.3.7")
    said = [n for n in other.notes if n.startswith("The fused-MoE kernel's per-call buffers")]
    assert len(said) == 1 and "TGI 3.3.7's MoE layer for qwen3-30b-a3b was not read" in said[0]


def test_log_qwen25_3b_rtx_a6000_tgi_3_2_3_issue_3181() -> None:
    """huggingface/text-generation-inference#3181 (2025-04-16, TGI 3.2.3, one RTX A6000, defaults): "KV-cache
    blocks: 1069251, size: 1", "Setting max batch total tokens to 1069251". Tier C: the thread starts both
    Qwen/Qwen2.5-VL-3B-Instruct and Qwen/Qwen2.5-3B-Instruct and the excerpt does not say which run this is;
    planned as the text model (TGI refuses nothing here; vramplan plans no VLM for TGI).

    The prefill budget is the launcher's 4096 (an RTX A6000 is not in its card table). TGI 3.2.3 serves it with
    Qwen2ForCausalLM's v3.1.1+ layer (6 hidden-sized tensors through the MLP, no sliding-window copy from
    v3.2.1): warm-up peak 2 × 4096 × (6 × 2048 + 4 × 11,008) bytes = 440 MiB, where vramplan's generic forward
    gave 298 MiB. Blocks: 1,084,258 (+1.4 %; the generic forward gave 1,088,293, +1.8 %) — within the 5 %
    tolerance both ways; the rest, 15,007 tokens = 0.52 GiB, is not explained (the VL model's vision tower
    would be one candidate), and not tuned."""
    p = serve_plan("qwen2.5-3b", "rtx-a6000", engine="tgi", engine_version="3.2.3")
    m, h, i = 4096, 2048, 11008
    assert p.starts and p.settings["max_batch_prefill_tokens"] == m and p.block_size == 1
    assert p.profile_peak == 2 * m * (6 * h + 4 * i)
    assert p.blocks == p.tokens == pytest.approx(1069251, rel=0.05)
    assert p.blocks > 1069251  # the measured gap as it is: +1.4 %
    assert p.log[:2] == (f"KV-cache blocks: {p.blocks}, size: 1", f"Setting max batch total tokens to {p.tokens}")


def test_log_llama33_70b_awq_tp2_rtx3090_tgi_3_0_1() -> None:
    """huggingface/text-generation-inference#2842 (2024-12-14): TGI 3.0.1 (ghcr.io image tag),
    ``--model-id llama-3.3-70b --quantize awq --cuda-memory-fraction 1 --sharded true --num-shard 2``
    on 2× RTX 3090 (nvidia-smi in the issue), every limit unset (zero config):
    "KV-cache blocks: 13807, size: 1", "Setting max batch total tokens to 13793", "Maximum input
    tokens defaulted to 13792", "Maximum total tokens defaulted to 13793", then the server starts.

    What the log shows and vramplan now follows: the router takes the *minimum* over the shards
    (backends/v3/src/client/sharded_client.rs:127-133; rank 0 logs 13807, the other 14 fewer), and
    zero config sets max_total_tokens = min(blocks, max_position_embeddings) and max_input_tokens one
    less (flash_causal_lm.py v3.0.1:1595-1606). The prefill budget is the launcher's: an RTX 3090 is
    not in its card table, so 4096. Before this change vramplan defaulted TGI 3 to 2.x's
    max_input_tokens + 50 = 131,121 prefill tokens and said this configuration fails at warm-up.

    The warm-up peak is TGI's own (:func:`vramplan.serving.tgi.warmup_peak`): its
    FlashLlamaForCausalLM keeps 8 hidden-sized tensors alive through the MLP and the fused gate_up output
    through down_proj, and the AWQ checkpoint runs on Marlin (compute capability 8.6), whose
    marlin-kernels 0.3.6 allocates per GEMM an fp16 input copy and an fp32 reduce buffer: 1,056 MiB at
    down_proj. vramplan's generic forward (0.46 GiB, no Marlin buffers) left the pool +26 % (17,454
    blocks); now every part the log prints is within the tolerance: blocks 13,717 against 13,807
    (−0.7 %), the router's min over shards 13,793 (−0.6 %), the zero-config limits one less / equal."""
    p = serve_plan("llama-3.3-70b", "rtx-3090", engine="tgi", engine_version="3.0.1", tp=2, quantization="awq")
    assert p.starts and p.settings["max_batch_prefill_tokens"] == 4096
    assert p.bytes_per_token == 80 * 4 * 128 * 2 * 2  # 8 KV heads over 2 shards
    assert p.runner_buffers == 128 * 2**20  # flashinfer's workspace
    # TGI's warm-up peak per rank (hidden 8192, intermediate 28,672 / 2): the down_proj moment, 9 hidden-sized
    # tensors + gate_up + its product, and Marlin's a_tmp [4096, 14,336] fp16 + c_tmp [1024, 8192] fp32
    m, h, i = 4096, 8192, 14336
    down = 2 * m * (9 * h + 3 * i) + m * i * 2 + 64 * 16 * h * 4
    assert p.profile_peak == down == tgi.warmup_peak(resolve("llama-3.3-70b"), m, 2, TgiRelease.of("3.0.1"), marlin=True)
    assert p.blocks == pytest.approx(13807, rel=0.05) and close(p.blocks * p.bytes_per_token / GiB, 13807 * 160 / 2**20)
    assert p.tokens == pytest.approx(13793, rel=0.05)
    # zero config on vramplan's own pool: the router's figures follow from the blocks
    assert p.log == (f"KV-cache blocks: {p.blocks}, size: 1", f"Setting max batch total tokens to {p.tokens}",
                     f"Maximum input tokens defaulted to {p.tokens - 1}",
                     f"Maximum total tokens defaulted to {p.tokens}")
    assert p.max_model_len == p.tokens and p.max_concurrency == 1.0
