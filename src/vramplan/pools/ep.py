"""vLLM's MoE layout under data and expert parallelism (``--data-parallel-size``,
``--enable-expert-parallel``, ``--all2all-backend``, ``--enable-eplb --num-redundant-experts``):
what one GPU holds of the routed experts and what the profile run's MoE layers add.

The rules, with file:line per release, are in ``docs/research/vllm-expert-parallel.md``:

* ``FusedMoEParallelConfig.make`` (model_executor/layers/fused_moe/config.py): without EP the
  routed experts are tensor-parallel over **all** ``tp × dp`` GPUs (``flatten_tp_across_dp``);
  with EP each GPU holds whole experts, ``ep_size = tp × dp``, and the MoE layer's own TP is 1.
  Attention and the dense parts stay TP-sharded over ``tp`` and replicated over ``dp``.
* ``determine_expert_map`` (fused_moe/layer.py): ``(experts + redundant) // ep_size`` per rank,
  the remainder one each to the first ranks (rank 0 holds the most: the plan is rank 0's); EPLB
  refuses an uneven split ("EPLB currently only supports even distribution of experts across
  ranks").
* The Triton fused-MoE workspace (``fused_experts_impl``, fused_moe/fused_moe.py):
  ``M·top_k·max(N, K) + M·top_k·N/2`` elements, ``N = 2 × the rank's intermediate size``,
  ``K = hidden``, ``M`` the layer's tokens capped at ``VLLM_FUSED_MOE_CHUNK_SIZE`` (32768 to
  0.11.x, 16384 from 0.12.0, no chunking from 0.18.1). With ``dp > 1`` the naive and
  allgather/reduce-scatter backends gather every DP rank's tokens (and router logits) before it.
* DeepEP high-throughput: a 1 GiB NVLink buffer per rank (``num_nvl_bytes``; from 0.11.0
  ``VLLM_DEEPEP_BUFFER_SIZE_MB``), allocated by DeepEP outside PyTorch while the model loads,
  and a workspace over the tokens this rank *receives*, which depends on the routing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from vramplan.errors import WorkloadError
from vramplan.models.shape import model_shape
from vramplan.models.spec import ModelSpec
from vramplan.units import GiB, MiB

from .vllm_release import Release

BACKENDS = ("naive", "allgather_reducescatter", "deepep_high_throughput", "deepep_low_latency", "pplx")
"""The all2all backends every release from 0.11.0 to 0.34.0 names (later ones add more)."""
MODELLED = ("naive", "allgather_reducescatter", "deepep_high_throughput")
ROUTINGS = ("even", "worst")
DEEPEP_NVL_BYTES = 1024 * MiB
"""``num_nvl_bytes`` of DeepEP's intranode buffer: 1024 MiB (0.10.1.1 all2all.py:169; from
0.11.0 ``VLLM_DEEPEP_BUFFER_SIZE_MB``, default 1024: 0.11.0 all2all.py:250, envs.py:1442)."""


@dataclass(frozen=True, kw_only=True)
class EpSettings:
    data_parallel_size: int = 1
    enable_expert_parallel: bool = False
    all2all_backend: str | None = None
    """None: the release's default (naive to 0.10.x, allgather_reducescatter from 0.11.0)."""
    num_redundant_experts: int = 0
    """EPLB's redundant experts (``--enable-eplb``; implies it when > 0)."""
    routing: str = "even"
    """How the batch's tokens are routed for the workspace that depends on it: ``even`` (uniform
    top-k) or ``worst`` (every token of every DP rank to this rank's experts)."""

    @property
    def on(self) -> bool:
        return self.data_parallel_size > 1 or self.enable_expert_parallel


@dataclass(frozen=True)
class EpLayout:
    """What the DP/EP layout changes on rank 0 of the plan (bytes)."""

    ep_size: int
    """1 without EP."""
    local_experts: int
    global_experts: int
    backend: str
    expert_weights: int
    """Rank 0's routed-expert weights."""
    weights_delta: int
    """``expert_weights`` less what the tensor-parallel estimate holds (experts / tp)."""
    peak_delta: int
    """What the profile run's MoE layers add above the tensor-parallel estimate's peak."""
    non_torch: int
    """Buffers allocated outside PyTorch after the first snapshot (DeepEP)."""
    notes: tuple[str, ...]


def default_backend(rel: Release) -> str:
    """``VLLM_ALL2ALL_BACKEND``'s default: naive to 0.10.x (0.10.1.1 envs.py:1021-1022), then
    allgather_reducescatter (0.11.0 envs.py:1240-1241; the ``--all2all-backend`` field from 0.12.0,
    config/parallel.py:125)."""
    return "allgather_reducescatter" if rel.since("0.11.0") else "naive"


def chunk_size(rel: Release) -> int | None:
    """``VLLM_FUSED_MOE_CHUNK_SIZE``'s default: 32768 to 0.11.x (0.11.0 envs.py:777-778), 16384
    from 0.12.0 (0.12.0 envs.py:789-790); ``fused_experts_impl`` stops chunking by 0.18.1
    (``M = num_tokens``, 0.18.1 fused_moe.py:1697; 0.17.1 fused_moe.py:1698-1699 still chunks)."""
    if rel.since("0.18.1"):
        return None
    return 16384 if rel.since("0.12.0") else 32768


def check(spec: ModelSpec, rel: Release, s: EpSettings, *, tp: int, pp: int) -> str:
    """vLLM's own refusals of the layout, and vramplan's where a part is not modelled; the backend."""
    dp = s.data_parallel_size
    if isinstance(dp, bool) or not isinstance(dp, int) or dp < 1:
        raise WorkloadError(f"`data_parallel_size` must be >= 1, got {dp!r}", field="data_parallel_size")
    r = s.num_redundant_experts
    if isinstance(r, bool) or not isinstance(r, int) or r < 0:
        raise WorkloadError(f"num_redundant_experts must be non-negative, but got {r!r}.",
                            field="num_redundant_experts")
    if s.routing not in ROUTINGS:
        raise WorkloadError(f"`routing={s.routing!r}` is not one of {' | '.join(ROUTINGS)}", field="routing")
    backend = (s.all2all_backend or default_backend(rel)).strip().lower()
    if backend not in BACKENDS:
        raise WorkloadError(f"`all2all_backend={backend}` is not one of {' | '.join(BACKENDS)}",
                            field="all2all_backend")
    if s.enable_expert_parallel and not spec.is_moe:
        raise WorkloadError(f"`enable_expert_parallel` needs a mixture-of-experts model; {spec.name} is dense",
                            hint="drop it", field="enable_expert_parallel")
    if r and not s.enable_expert_parallel:  # config/parallel.py: EPLB needs EP (0.10.1.1 :286-288)
        raise WorkloadError("enable_expert_parallel must be True to use EPLB.",
                            hint="add `enable_expert_parallel`", field="num_redundant_experts")
    if s.enable_expert_parallel and tp * dp == 1:
        raise WorkloadError("expert parallelism over one GPU does nothing (vLLM's use_ep needs tp × dp > 1)",
                            hint="raise `tp` or `data_parallel_size`", field="enable_expert_parallel")
    if s.enable_expert_parallel and pp > 1:
        raise WorkloadError("expert parallelism with pipeline parallelism is not modelled",
                            hint="use tp and data_parallel_size", field="enable_expert_parallel")
    if s.enable_expert_parallel and (tp * dp) > (spec.n_experts + r):
        raise WorkloadError(f"{tp * dp} EP ranks for {spec.n_experts + r} experts: some ranks would hold none",
                            hint="use fewer GPUs", field="enable_expert_parallel")
    if r and (spec.n_experts + r) % (tp * dp):
        raise WorkloadError("EPLB currently only supports even distribution of experts across ranks. Got "
                            f"{spec.n_experts + r} experts and {tp * dp} EP ranks.",
                            hint=f"choose num_redundant_experts so that {spec.n_experts} + it divides by {tp * dp}",
                            field="num_redundant_experts")
    if rel.since("0.19.1") and backend in ("naive", "pplx"):
        return backend  # (falls back to allgather_reducescatter: see layout)
    if s.enable_expert_parallel and dp > 1 and backend not in MODELLED:  # (use_all2all_kernels: dp > 1 and EP)
        raise WorkloadError(f"the {backend} all2all backend is not modelled (its NVSHMEM buffers are sized in C++ "
                            "by pplx-kernels / DeepEP's low-latency layout)",
                            hint="use allgather_reducescatter or deepep_high_throughput", field="all2all_backend")
    return backend


def _workspace(tokens: int, top_k: int, inter: int, hidden: int, chunk: int | None, b: int) -> int:
    """``fused_experts_impl``'s cache13 + cache2 for ``tokens`` tokens, ``inter`` the rank's
    intermediate size (``N = 2·inter``)."""
    m = min(tokens, chunk) if chunk else tokens
    n = 2 * inter
    return m * top_k * (max(n, hidden) + n // 2) * b


def received(tokens: int, experts: int, local: int, top_k: int, routing: str) -> int:
    """Tokens a DeepEP rank receives from ``tokens`` sent over all DP ranks: ``worst`` all of
    them; ``even`` those whose top-k picks at least one of the ``local`` experts under uniform
    routing, ``1 − C(E − local, k) / C(E, k)`` of them."""
    if routing == "worst" or local >= experts:
        return tokens
    miss = math.comb(experts - local, top_k) / math.comb(experts, top_k) if experts - local >= top_k else 0.0
    return math.ceil(tokens * (1 - miss))


def layout(spec: ModelSpec, rel: Release, s: EpSettings, *, tp: int, pp: int, tokens: int, expert_elems: int,
           weight_bytes: float, dtype_bytes: int = 2) -> EpLayout | None:
    """Rank 0's routed experts and the MoE profile terms under ``s``; None when there is neither
    DP nor EP (the tensor-parallel plan stands). ``expert_elems``: the routed experts' elements in
    the whole model; ``weight_bytes``: bytes per weight; ``tokens``: the profile's tokens per DP rank."""
    backend = check(spec, rel, s, tp=tp, pp=pp)
    if not s.on:
        return None
    dp = s.data_parallel_size
    notes: list[str] = []
    tp_held = int(expert_elems * weight_bytes) // tp  # what the tensor-parallel estimate holds
    if not spec.is_moe:
        return EpLayout(1, 0, 0, backend, 0, 0, 0, 0, (
            f"Data parallel {dp}: {dp} engine replicas of TP {tp}; each GPU holds the same weights and its own "
            "KV cache (the figures are per GPU).",))
    E, k, h = spec.n_experts, spec.experts_per_token, spec.hidden
    inter = model_shape(spec).moe_intermediate
    per_expert = expert_elems // E
    chunk = chunk_size(rel)
    if rel.since("0.19.1") and backend in ("naive", "pplx"):
        notes.append(f"vLLM {rel.text} has removed the {backend} all2all backend: it falls back to "
                     "allgather_reducescatter (config/parallel.py, 0.19.1 :344).")
        backend = "allgather_reducescatter"
    if backend == "allgather_reducescatter" and not rel.since("0.11.0"):
        raise WorkloadError(f"vLLM {rel.text} has no allgather_reducescatter backend (from 0.11.0)",
                            hint="use naive or deepep_high_throughput", field="all2all_backend")
    base = _workspace(tokens, k, inter // tp, h, chunk, dtype_bytes)
    moe_tokens = dp * tokens
    if not s.enable_expert_parallel:
        ep, glob, local = 1, E, E
        held = int(expert_elems * weight_bytes) // (tp * dp)
        ws = _workspace(moe_tokens, k, inter // (tp * dp), h, chunk, dtype_bytes)
        notes.append(f"Data parallel {dp} without expert parallelism: vLLM shards every routed expert over all "
                     f"{tp * dp} GPUs (flatten_tp_across_dp: the MoE layers' TP is tp × dp), attention over tp "
                     f"only; rank 0 holds {held / GiB:.2f} GiB of experts.")
    else:
        ep = tp * dp
        glob = E + s.num_redundant_experts
        local = glob // ep + (1 if glob % ep else 0)
        held = int(local * per_expert * weight_bytes)
        ws = 0
        notes.append(
            f"Expert parallel {ep} (tp {tp} × dp {dp}): each GPU holds whole experts, {glob} // {ep} each"
            + (f", the first {glob % ep} rank(s) one more (rank 0: {local}, the plan's)" if glob % ep else f" = {local}")
            + f" — {held / GiB:.2f} GiB on rank 0 (determine_expert_map); attention and the dense layers stay "
            f"TP-sharded over {tp} and replicated over dp.")
        if s.num_redundant_experts:
            notes.append(f"EPLB: {s.num_redundant_experts} redundant experts (copies of busy ones) make {glob} physical "
                         f"experts, {local} per rank: {s.num_redundant_experts * per_expert * weight_bytes / ep / GiB:.2f} "
                         "GiB more per GPU than the logical experts alone.")
    non_torch = 0
    extra = 0
    if dp > 1 and (backend in ("naive", "allgather_reducescatter") or not s.enable_expert_parallel):
        # dispatch gathers every DP rank's hidden states and router logits; the experts' output covers them all
        extra = moe_tokens * (2 * h + E) * dtype_bytes
        notes.append(f"{backend}: each MoE layer gathers the {dp} DP ranks' tokens ({moe_tokens:,} = {dp} × "
                     f"{tokens:,}) with their router logits before the experts and holds the output for all of them "
                     f"({extra / GiB:.2f} GiB, in the profile's peak).")
    if s.enable_expert_parallel:
        if backend == "deepep_high_throughput" and dp > 1:
            got = received(moe_tokens, glob, local, k, s.routing)
            ws = _workspace(got, k, inter, h, chunk, dtype_bytes) + got * h * dtype_bytes
            non_torch = DEEPEP_NVL_BYTES
            notes.append(
                f"DeepEP high-throughput: a {DEEPEP_NVL_BYTES // MiB} MiB NVLink buffer per GPU allocated outside "
                "PyTorch while the model loads (after the first memory snapshot, so inside the budget); the rank's "
                f"experts run on the tokens it receives: {got:,} of {moe_tokens:,} with routing={s.routing} "
                + ("(every DP rank's batch routed to this rank's experts)." if s.routing == "worst" else
                   f"(uniform top-{k}: a token reaches this rank when one of its {k} experts is among the {local})."))
        else:
            ws = _workspace(moe_tokens if dp > 1 else tokens, k, inter, h, chunk, dtype_bytes)
            notes.append(
                f"The Triton fused-MoE workspace under EP: the rank's experts are whole (N = 2 × {inter}, not "
                f"2 × {inter}/{tp}) and it is sized for every token × top-{k} whichever experts they pick "
                "(non-local ones are masked by the expert map), so routing skew does not change it"
                + (": routing=worst is the same as even here." if s.routing == "worst" else "."))
    elif s.routing == "worst":
        notes.append("routing=worst changes nothing without expert parallelism: every GPU holds a slice of every "
                     "expert and the workspace is sized for all tokens × top-k.")
    peak_delta = max(0, ws - base) + extra
    if peak_delta:
        notes.append(f"MoE workspace above the tensor-parallel estimate: {peak_delta / GiB:.2f} GiB "
                     f"(fused_experts_impl's caches{'' if chunk is None else f', chunks of {chunk:,} tokens'}).")
    return EpLayout(ep, local, glob, backend, held, held - tp_held, peak_delta, non_torch, tuple(notes))
