"""vLLM's data and expert parallelism in serve-plan (vramplan.pools.ep; docs/research/vllm-expert-parallel.md)."""

from __future__ import annotations

import math

import pytest

from vramplan.errors import WorkloadError
from vramplan.models.catalog import resolve
from vramplan.pools import ep
from vramplan.pools.vllm_release import Release
from vramplan.serving.api import serve_plan

KW = dict(max_model_len=4096, engine_version="0.10.1.1")


def _expert_bytes(name: str) -> tuple[int, int]:
    """(routed-expert bytes of the whole bf16 model, bytes of one expert over all layers), from config.json."""
    s = resolve(name)
    inter = s.moe_intermediate or s.intermediate
    per_expert = (s.layers - s.dense_layers) * 3 * s.hidden * inter * 2  # gate, up, down
    return s.n_experts * per_expert, per_expert


def test_mixtral_ep_weights_from_the_config():
    """Mixtral-8x7B (8 experts of 3 × 4096 × 14336, 32 layers): under TP 2 each GPU holds half of every
    expert; with EP 2 four whole experts; with DP 2 × TP 2 (EP 4) two — the rest (attention, embeddings)
    is the TP-2 estimate's either way."""
    total, one = _expert_bytes("mixtral-8x7b")
    assert total == 8 * 32 * 3 * 4096 * 14336 * 2
    tp = serve_plan("mixtral-8x7b", "h100", tp=2, **KW)
    epp = serve_plan("mixtral-8x7b", "h100", tp=2, enable_expert_parallel=True, **KW)
    assert epp.expert_weights == 4 * one == total // 2 and epp.local_experts == 4 and epp.ep == 2
    assert epp.weights == tp.weights  # 8 experts over 2 GPUs: the same bytes, whole instead of sliced
    ep4 = serve_plan("mixtral-8x7b", "h100", tp=2, data_parallel_size=2, enable_expert_parallel=True, **KW)
    assert ep4.expert_weights == 2 * one and ep4.ep == 4 and ep4.gpus == 4
    assert tp.weights - ep4.weights == total // 2 - 2 * one
    assert ep4.kv_pool > tp.kv_pool  # the freed weights go to the KV cache
    assert "EP 4: 2 experts per GPU" in _subtitle(ep4)


def test_dp_without_ep_flattens_tp_over_the_experts():
    """flatten_tp_across_dp: without EP the experts are TP-sharded over tp × dp GPUs: the same bytes per
    GPU as EP when the experts divide."""
    total, _ = _expert_bytes("qwen3-30b-a3b")
    dp = serve_plan("qwen3-30b-a3b", "h100", tp=1, data_parallel_size=4, **KW)
    epp = serve_plan("qwen3-30b-a3b", "h100", tp=1, data_parallel_size=4, enable_expert_parallel=True, **KW)
    assert dp.expert_weights == total // 4 == epp.expert_weights
    assert dp.ep == 1 and epp.ep == 4 and epp.local_experts == 32


def test_qwen3_moe_ep4_places_32_of_128_experts():
    """A public vLLM log of a Qwen3 MoE (128 experts) at EP 4 (https://github.com/QwenLM/Qwen3-VL/issues/1520):
    "[EP Rank 0/4] Expert parallelism is enabled. … Local/global number of experts: 32/128"."""
    p = serve_plan("qwen3-30b-a3b", "h100", tp=4, enable_expert_parallel=True, **KW)
    assert (p.local_experts, p.ep) == (32, 4)


def test_uneven_split_and_eplb():
    """determine_expert_map gives the remainder to the first ranks (rank 0: ⌈E/ep⌉); EPLB refuses an uneven split
    and adds its redundant experts."""
    _, one = _expert_bytes("qwen3-30b-a3b")
    p = serve_plan("qwen3-30b-a3b", "h100", data_parallel_size=3, enable_expert_parallel=True, **KW)
    assert p.local_experts == 43 and p.expert_weights == 43 * one  # 128 = 42 × 3 + 2
    with pytest.raises(WorkloadError, match="EPLB currently only supports even distribution"):
        serve_plan("qwen3-30b-a3b", "h100", data_parallel_size=3, enable_expert_parallel=True, num_redundant_experts=2, **KW)
    r = serve_plan("qwen3-30b-a3b", "h100", tp=4, enable_expert_parallel=True, num_redundant_experts=4, **KW)
    assert r.local_experts == 33 and r.expert_weights == 33 * one
    assert "--enable-eplb" in r.command and "--num-redundant-experts 4" in r.command
    new = serve_plan("qwen3-30b-a3b", "h100", tp=4, enable_expert_parallel=True, num_redundant_experts=4,
                     max_model_len=4096)
    assert "--eplb-config" in new.command


def test_refusals():
    with pytest.raises(WorkloadError, match="enable_expert_parallel must be True to use EPLB"):
        serve_plan("qwen3-30b-a3b", "h100", tp=4, num_redundant_experts=4, **KW)
    with pytest.raises(WorkloadError, match="dense"):
        serve_plan("llama-3.1-8b", "h100", tp=2, enable_expert_parallel=True, **KW)
    with pytest.raises(WorkloadError, match="not modelled"):
        serve_plan("mixtral-8x7b", "h100", tp=2, data_parallel_size=2, enable_expert_parallel=True,
                   all2all_backend="deepep_low_latency", **KW)
    with pytest.raises(WorkloadError, match="no allgather_reducescatter"):
        serve_plan("mixtral-8x7b", "h100", tp=2, data_parallel_size=2, enable_expert_parallel=True,
                   all2all_backend="allgather_reducescatter", engine_version="0.9.2", max_model_len=4096)
    with pytest.raises(WorkloadError, match="vLLM, not sglang"):
        serve_plan("mixtral-8x7b", "h100", engine="sglang", tp=2, enable_expert_parallel=True)
    with pytest.raises(WorkloadError, match="routing"):
        serve_plan("mixtral-8x7b", "h100", tp=2, enable_expert_parallel=True, routing="skewed", **KW)


def test_workspace_grows_under_ep_and_with_dp():
    """fused_experts_impl: M·k·(max(2I', h) + I') elements; under EP I' is the whole intermediate size."""
    rel = Release.of("0.10.1.1")
    s = resolve("mixtral-8x7b")
    assert ep.chunk_size(rel) == 32768 and ep.chunk_size(Release.of("0.14.1")) == 16384
    assert ep.chunk_size(Release.of("0.34.0")) is None
    t = 8192
    lay = ep.layout(s, rel, ep.EpSettings(enable_expert_parallel=True), tp=2, pp=1, tokens=t,
                    expert_elems=8 * 32 * 3 * 4096 * 14336, weight_bytes=2.0)
    assert lay is not None
    want = t * 2 * (2 * 14336 + 14336) * 2 - t * 2 * (max(14336, 4096) + 7168) * 2
    assert lay.peak_delta == want


def test_routing_worst_matters_only_where_the_code_sizes_by_received_tokens():
    """Triton/allgather: the workspace covers every token × top-k whatever the routing (worst = even). DeepEP
    high-throughput: the experts run on the tokens received — all of them in the worst case."""
    base = dict(tp=2, data_parallel_size=2, enable_expert_parallel=True, **KW)
    even = serve_plan("mixtral-8x7b", "h100", **base)
    worst = serve_plan("mixtral-8x7b", "h100", routing="worst", **base)
    assert even.profile_peak == worst.profile_peak
    d_even = serve_plan("mixtral-8x7b", "h100", all2all_backend="deepep_high_throughput", **base)
    d_worst = serve_plan("mixtral-8x7b", "h100", all2all_backend="deepep_high_throughput", routing="worst", **base)
    assert d_worst.profile_peak > d_even.profile_peak
    assert d_even.ep_buffers == ep.DEEPEP_NVL_BYTES and d_even.non_torch >= ep.DEEPEP_NVL_BYTES
    assert d_worst.kv_pool < d_even.kv_pool
    # uniform top-2 of 8 experts, 2 local: 1 − C(6, 2)/C(8, 2) of the tokens
    assert ep.received(16384, 8, 2, 2, "even") == math.ceil(16384 * (1 - 15 / 28))
    assert ep.received(16384, 8, 2, 2, "worst") == 16384


def test_cli_layout_line(capsys):
    from vramplan.cli.main import main

    rc = main(["serve-plan", "mixtral-8x7b", "--gpu", "h100", "--tp", "2", "--dp", "2", "--enable-expert-parallel",
               "--engine-version", "0.10.1.1", "--max-model-len", "4096"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "TP 2, PP 1, DP 2, EP 4: 2 experts per GPU" in out
    assert "--data-parallel-size 2 --enable-expert-parallel" in out


def _subtitle(p) -> str:
    from vramplan.report.serving import to_doc

    return to_doc(p).subtitle or ""
