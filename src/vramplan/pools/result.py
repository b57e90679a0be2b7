"""The typed result of a serving plan: what the engine would log at start-up, and what it
means for users. Bytes are ints; ``to_dict`` is the JSON form (integer bytes)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True, kw_only=True)
class ServePlan:
    """One engine's start-up sizing of its KV-cache pool on one GPU (rank)."""

    engine: str
    """``vllm`` | ``sglang`` | ``tgi`` | ``trtllm``."""
    engine_version: str
    """The engine release whose sizing code is followed."""
    model: str
    gpu: str
    tp: int
    pp: int
    settings: Mapping[str, Any]
    """The engine settings in effect, defaults filled in, under the engine's own names."""
    total_memory: int
    """What CUDA reports as the GPU's total (``torch.cuda.mem_get_info()[1]``)."""
    budget: int
    """Memory the engine allows itself (vLLM: total × gpu_memory_utilization)."""
    weights: int
    """Model weights on this rank."""
    profile_peak: int
    """Activation peak of the profiling / warm-up forward above the weights (0 where the engine does not profile)."""
    non_torch: int
    """Memory outside PyTorch's allocator that the engine counts against its budget."""
    context: int
    """CUDA context, kernel images and thread stacks (outside the budget for vLLM)."""
    cuda_graph: int
    """CUDA-graph pool, as the engine accounts for it (see ``cuda_graph_in_budget``)."""
    cuda_graph_in_budget: bool
    kv_available: int
    """Memory the engine computes as available for the KV cache (vLLM "Available KV cache
    memory"; may be negative when it does not start)."""
    kv_pool: int
    """Bytes of the KV-cache pool on this rank (whole blocks; 0 when it does not start)."""
    block_size: int
    """Tokens per KV block (page)."""
    blocks: int
    """KV blocks of the pool (when it does not start: the blocks the available memory would hold)."""
    tokens: int
    """KV-cache size in tokens, as the engine logs it (when it does not start: what it would hold)."""
    bytes_per_token: int
    """KV bytes per token on this rank, all layers of the stage."""
    max_model_len: int
    max_concurrency: float
    """Requests of ``max_model_len`` tokens the pool holds at once (the engine's own figure)."""
    avg_request_len: int | None = None
    concurrency_at_avg: float | None = None
    """Requests of ``avg_request_len`` tokens at once (capped by the engine's max running requests)."""
    max_running: int = 0
    """The engine's limit on concurrent sequences (max_num_seqs / max_running_requests / max_batch_size)."""
    starts: bool = True
    error: str | None = None
    """The engine's own error when it would refuse to start."""
    device_used: int = 0
    """Predicted nvidia-smi used per GPU after start-up."""
    log: tuple[str, ...] = ()
    """The start-up lines the engine would log, with these figures."""
    command: str = ""
    """The engine's command line for these settings."""
    profile_method: str = "analytic"
    notes: tuple[str, ...] = ()
    layer_kinds: Mapping[str, int] = field(default_factory=dict)
    """KV layer kinds on this rank: kind → layers."""
    vision_weights: int = 0
    """A vision-language model's vision tower (and projector) on this rank, inside ``weights``."""
    encoder_peak: int = 0
    """The profile's vision encode: allocated above the weights at its peak (0: not profiled)."""
    encoder_held: int = 0
    """The encoder outputs and dummy pixels held through the language-model phase of the profile."""
    draft_weights: int = 0
    """Speculative decoding: the drafter's weights on this rank, inside ``weights``."""
    draft_layers: int = 0
    """Speculative decoding: KV layers the drafter adds to the pool's division."""
    draft_buffers: int = 0
    """Speculative decoding: the proposer's persistent buffers, outside the budget (in ``device_used``)."""
    runner_buffers: int = 0
    """vLLM's model runner V2: persistent sampler state allocated after the weights (inside the budget);
    TGI: the shared flashinfer workspace (128 MiB) its attention states keep from start-up."""
    kv_reserve: int = 0
    """vLLM 0.34's extensible KV cache: memory kept free below the pool (the transient reserve and its margin)."""
    cuda_graph_estimate: int = 0
    """vLLM ≥ 0.20: the CUDA-graph estimate taken from the budget (0: none taken)."""
    host_kv: int = 0
    """vLLM's KV offload tier: host RAM this rank pins for it."""
    host_kv_shared: int = 0
    """vLLM ≥ 0.27's native tier: the ``/dev/shm`` region per engine (all ranks' slots)."""
    host_kv_tokens: int = 0
    """Tokens the host tier holds (0: none, or outside vLLM's process)."""
    connector_gpu: int = 0
    """A KV connector's own device buffer, outside the budget (in ``device_used``; LMCache in-process)."""
    dp: int = 1
    """vLLM ``--data-parallel-size``: engine replicas (the figures are one GPU's)."""
    ep: int = 1
    """vLLM's expert-parallel size (tp × dp with ``--enable-expert-parallel``, else 1)."""
    expert_weights: int = 0
    """Rank 0's routed-expert weights (inside ``weights``) under DP/EP (:mod:`.ep`); 0 when not planned."""
    local_experts: int = 0
    """Routed experts (whole) on rank 0 under EP."""
    ep_buffers: int = 0
    """All2all buffers allocated outside PyTorch (DeepEP), inside the budget (in ``non_torch``)."""

    @property
    def gpus(self) -> int:
        return self.tp * self.pp * self.dp

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["settings"] = dict(self.settings)
        d["layer_kinds"] = dict(self.layer_kinds)
        d["log"] = list(self.log)
        d["notes"] = list(self.notes)
        d["gpus"] = self.gpus
        return d
