"""What changed in vLLM's start-up sizing from release to release (V1 engine, CUDA), for
``serve-plan --engine-version``: :class:`Release` answers each rule for one version.

Read in the sdists of 0.9.2 … 0.34.0 (every release on the index from 0.10.0, 0.15.x has no
sdist); the notes ``docs/research/vllm-version-history.md`` (each change bisected, file:line per
version) and ``docs/research/vllm-0.34-startup.md`` (the newest release, rule by rule) cite the
lines. Paths below are inside each sdist's ``vllm/`` package.

Rules that are the same in every release (the KV bytes per token, ``max_memory_usage`` of a full
attention layer, the profile forward over ``max_num_batched_tokens`` tokens as
``min(max_num_seqs, max_num_batched_tokens)`` requests) live in :mod:`.vllm`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from vramplan.errors import WorkloadError
from vramplan.units import GiB

OLDEST = "0.9.2"
RELEASES = ("0.34.0", "0.33.0", "0.32.0", "0.31.0", "0.30.0", "0.29.0", "0.28.0", "0.27.1", "0.26.0", "0.25.1",
            "0.24.0", "0.23.0", "0.22.1", "0.21.0", "0.20.2", "0.19.1", "0.18.1", "0.17.1", "0.16.0", "0.14.1",
            "0.13.0", "0.12.0", "0.11.2", "0.11.0", "0.10.2", "0.10.1.1", "0.9.2")
"""The releases whose sdists were read (newest first; 0.15.x has none on the index): what the web
page offers. Any release between OLDEST and NEWEST is accepted."""
NEWEST = "0.34.0"
"""The newest vLLM release on the package index when this was written (the default)."""

SAMPLER_BYTES_PER_LOGIT = 26
"""0.10.1.1's sort-based sampler, beyond the 16-bit logits, as its own tensors: fp32 copy 4 + sorted 4
+ int64 indices 8 + two bool masks 2 + softmax 4 + scatter output 4 (``apply_top_k_top_p``); a vramplan
trace of the same ops peaks at 27.4 B per logit in all, the 16-bit logits included
(tests/test_serving.py). On CUDA ``torch.sort`` adds its own temporaries: :func:`cuda_sort_scratch`."""


def cuda_sort_scratch(rows: int) -> int:
    """Bytes per element ``torch.sort`` allocates on CUDA beside its outputs while it sorts ``rows`` rows
    of a float32 vocabulary (> 4096 values per row, so the stable radix path: aten/src/ATen/native/cuda/
    Sort.cpp ``sort_cuda_kernel`` → SortStable.cu ``launch_stable_sort_kernel``):

    * 1 row, or 128 rows and more: ``segmented_sort_large_segments`` / ``segmented_sort_pairs``
      (SortStable.cu) fill int64 reverse indices (8) and call cub's segmented radix sort without a
      ``DoubleBuffer``, whose temporary storage holds a third key buffer (4) and a third value buffer
      (int64: 8) of all the items (NVIDIA/cub cub/device/dispatch/dispatch_radix_sort.cuh,
      ``DispatchSegmentedRadixSort``: ``allocation_sizes[2]``): 20 B;
    * 2 to 127 rows: ``segmented_sort_pairs_by_full_sort`` holds two ``int2`` (index, segment) arrays
      (8 + 8) and sorts the whole batch once with keys written to a new buffer (4) and cub's third
      key and ``int2`` value buffers (4 + 8): 32 B.

    Read in the sources, not measured on a GPU; three public logs' profile peaks (0.10.1, 0.10.2,
    0.15.1 at 256 and 1024 rows) land within 0.02–0.16 GiB with it and 10–11 B per logit short
    without it (docs/research/vllm-public-logs.md, "Logs added in session 53")."""
    return 32 if 1 < rows < 128 else 20

_RE = re.compile(r"^v?(\d+)\.(\d+)(?:\.(\d+))?(?:\.(\d+))?(?:[.+-]?(?:post|rc|dev)\d*)?(?:\+.*)?$")


def parse(text: str) -> tuple[int, int, int]:
    """``0.11``, ``0.10.1.1``, ``v0.20.2rc1``, ``0.11.0+nv25.11`` → (major, minor, patch)."""
    m = _RE.match((text or "").strip().lower())
    if not m:
        raise WorkloadError(f"invalid vLLM version {text!r}", hint=f"e.g. `engine_version={NEWEST}` or 0.11",
                            field="engine_version")
    return int(m.group(1)), int(m.group(2)), int(m.group(3) or 0)


@dataclass(frozen=True)
class Release:
    """The sizing rules of one vLLM release (``v``: major, minor, patch)."""

    text: str
    v: tuple[int, int, int]

    @classmethod
    def of(cls, text: str | None) -> Release:
        text = (text or NEWEST).strip()
        v = parse(text)
        if v < parse(OLDEST)[:2] + (0,):
            raise WorkloadError(
                f"vLLM {text} is not modelled: serve-plan follows the V1 engine's sizing from {OLDEST} to {NEWEST} "
                "(before 0.9 the V0 engine sized the cache its own way)", hint=f"use `engine_version={OLDEST}` or later",
                field="engine_version")
        if v > parse(NEWEST):
            raise WorkloadError(f"vLLM {text} is newer than the newest release modelled ({NEWEST})",
                                hint=f"use `engine_version={NEWEST}` (or leave it out)", field="engine_version")
        return cls(text, v)

    def since(self, text: str) -> bool:
        return self.v >= parse(text)

    # ------------------------------------------------------------------ defaults
    def default_utilization(self, extensible: bool) -> float:
        """``gpu_memory_utilization``: 0.9 to 0.19.x (config/cache.py), 0.92 from 0.20.0; 0.34.0:
        unset means 1.0 with the extensible KV cache, else 0.92 (config/cache.py:186,495-501)."""
        if extensible:
            return 1.0
        return 0.92 if self.since("0.20.0") else 0.9

    @property
    def extensible_default(self) -> bool:
        """0.34.0 turns the extensible KV cache on for CUDA unless ``kv_cache_memory_bytes``,
        ``num_gpu_blocks_override`` or some KV connectors are set (config/vllm.py:3180-3270)."""
        return self.since("0.34.0")

    @property
    def block_size(self) -> int:
        """16 to 0.33.0 (platforms/cuda.py), 64 in 0.34.0 (config/cache.py:185; FlashAttention,
        FlashInfer and FlashMLA all keep 64)."""
        return 64 if self.since("0.34.0") else 16

    def mla_block(self, cc: str | None, *, kv_fp8: bool, given: int | None = None,
                  qk_nope_head_dim: int = 128) -> tuple[int, str]:
        """(block size, the rule's attention backend) of an MLA model (DeepSeek-V2/V3) on a GPU of
        compute capability ``cc``, with no attention backend forced (docs/research/vllm-mla-kv.md):

        * to 0.17.x ``CudaPlatform.check_and_update_config`` (platforms/cuda.py) overrides the
          block size, the user's too: 0.9.2/0.10.0 FlashMLA's 64 on Hopper (0.10.0 cuda.py:152-163),
          else 16; from 0.10.1 CUTLASS MLA's 128 on Blackwell (cc 10.0, the 10.x family from 0.13.0;
          0.10.1.1 cuda.py:142-178, 0.13.0 cuda.py:185-216); from 0.16.0 FlashInfer MLA's 64 there
          when ``qk_nope_head_dim`` is 128 (0.16.0 cuda.py:188-242; 32 kept). From 0.11.1 a multiple
          of the size is kept (``% 64``, ``% 128``; 0.11.1 cuda.py:205-225), before only the size.
        * from 0.18.0 a given ``--block-size`` is kept, else ``update_block_size_for_backend``
          (0.18.0 platforms/interface.py:427-472) takes the first valid backend of the priority list
          (0.18.0 platforms/cuda.py:48-81) and its ``get_preferred_block_size`` (the default if the
          kernel takes it, else its smallest size; 0.18.0 v1/attention/backend.py:189-197): Hopper
          FlashAttention MLA (multiples of 16; ``auto``/16-bit KV only) else FlashMLA (64); Blackwell
          FlashInfer MLA (32 or 64: 32 from the default 16, 64 from 0.34's default 64) when
          ``qk_nope_head_dim`` is 64 or 128, else CUTLASS MLA (128); other GPUs Triton MLA (16s).
        """
        major = int(cc.split(".")[0]) if cc else 0
        hopper, blackwell = major == 9, major == 10
        if self.since("0.18.0"):
            if given:
                return given, "the given block size"
            default = self.block_size
            if hopper:
                return (64, "FLASHMLA") if kv_fp8 else (_preferred(default, (), 16), "FLASH_ATTN_MLA")
            if blackwell:
                if qk_nope_head_dim in (64, 128):
                    return _preferred(default, (32, 64)), "FLASHINFER_MLA"
                return 128, "CUTLASS_MLA"
            return _preferred(default, (), 16), "TRITON_MLA"
        block = given or self.block_size
        multiple = self.since("0.11.1")

        def force(size: int, also: tuple[int, ...] = ()) -> int:
            ok = block in also or (block % size == 0 if multiple else block == size)
            return block if ok else size

        if self.since("0.10.1"):
            sm100 = blackwell if self.since("0.13.0") else cc == "10.0"
            if sm100 and self.since("0.16.0") and qk_nope_head_dim == 128:
                return force(64, (32,)), "FLASHINFER_MLA"
            if sm100:
                return force(128), "CUTLASS_MLA"
        if hopper:
            return force(64), "FLASHMLA"
        return block, "TRITON_MLA"

    def batch_defaults(self, total: int, big: bool, cc: str | None) -> tuple[int, int]:
        """``vllm serve``'s (max_num_batched_tokens, max_num_seqs): 8192/1024 on ≥ 70 GiB GPUs that
        are not A100s, else 2048/256 (engine/arg_utils.py); from 0.28.0 ≥ 160 GiB → 16384/1024
        (0.28.0 arg_utils.py:2582); from 0.33.0 GB10 (cc 12.1) is in the small tier."""
        if self.since("0.28.0") and total >= 160 * GiB:
            return 16384, 1024
        if big and not (self.since("0.33.0") and cc == "12.1"):
            return 8192, 1024
        return 2048, 256

    # ------------------------------------------------------------------ the budget
    @property
    def ceil_request(self) -> bool:
        """requested = ⌈total × utilization⌉ from 0.14.0 (v1/worker/utils.py ``request_memory``), else the float."""
        return self.since("0.14.0")

    @property
    def nccl_in_budget(self) -> bool:
        """Up to 0.10.2 the first snapshot is taken before distributed init: NCCL's buffers grow
        ``non_torch_increase``; from 0.11.0 after it (gpu_worker.py ``init_device``)."""
        return not self.since("0.11.0")

    @property
    def cublas_in_budget(self) -> bool:
        """0.34.0 creates the cuBLAS/cuBLASLt handles before the snapshot (gpu_worker.py:527-537)."""
        return not self.since("0.34.0")

    def v2_runner(self, moe: bool) -> bool:
        """Model runner V2 (``v1/worker/gpu/``): the default for dense models from 0.25.0, for
        every supported model from 0.29.0, the only runner in 0.34.0 (0.22–0.24 used it for some
        models only: the V1 runner is assumed there)."""
        return self.since("0.29.0") or (self.since("0.25.0") and not moe)

    def sampler_bytes(self, moe: bool, rows: int) -> int:
        """Bytes per logit the dummy sampler run over ``rows`` requests adds to the 16-bit logits:

        * V1 runner to 0.16.x: the sort-based top-k/top-p path (v1/sample/ops/topk_topp_sampler.py
          ``apply_top_k_top_p``), whose peak is ``logits.sort`` on CUDA: fp32 copy 4 + sorted values 4
          + int64 indices 8 + the sort's temporaries (:func:`cuda_sort_scratch`: 20 B, 32 B for 2–127
          rows), above the 26 B of its later steps (masks, softmax, scatter);
        * V1 runner from 0.17.0: the Triton top-k/top-p kernel masks the fp32 copy in place
          (≥ 8 rows), then softmax and the exponential draw: 12 B (0.17.0 topk_topp_sampler.py:251);
        * V2 runner to 0.32.x: one light pass, the fp32 copy only: 4 B (gpu/sample/sampler.py);
        * V2 runner from 0.33.0: a second pass with warm-up sampling parameters through FlashInfer's
          fused top-k/top-p: fp32 copy, masked logits, softmax = 12 B (0.34.0 gpu/model_runner.py:1038-1062).
        """
        if self.v2_runner(moe):
            return 12 if self.since("0.33.0") else 4
        if self.since("0.17.0"):
            return 12
        return max(SAMPLER_BYTES_PER_LOGIT, 4 + 4 + 8 + cuda_sort_scratch(rows))

    def runner_buffers(self, moe: bool, max_num_seqs: int, vocab: int) -> int:
        """The V2 runner's persistent sampler state, created after "Model loading took" and so in
        the profile's consumed memory: penalty bin counts ``max_num_seqs × vocab`` int32 and the
        prompt bin mask ``max_num_seqs × ⌈vocab/32⌉`` int32 (gpu/sample/penalties.py), the grammar
        bitmask (the same shape, gpu/structured_outputs.py)."""
        if not self.v2_runner(moe) or not vocab:
            return 0
        return max_num_seqs * vocab * 4 + 2 * max_num_seqs * -(-vocab // 32) * 4

    @property
    def buffers_counted(self) -> bool:
        """Whether state allocated between the weights' measurement and the profile is in the budget:
        to 0.26.x ``non_kv = weights + torch_peak_increase + non_torch_increase`` and the peak's
        baseline is what is allocated when profiling starts, so it is not (the 1 − utilization share
        holds it); from 0.27.0 ``total_consumed`` (the drop in free memory since start-up) counts it
        (utils/mem_utils.py ``memory_profiling``)."""
        return self.since("0.27.0")

    def graphs_estimated(self, moe: bool) -> bool:
        """``VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS``: absent to 0.17.x, opt-in in 0.18–0.19,
        on from 0.20.0 (envs.py): the estimate is subtracted from the KV budget. The V2 runner's
        ``profile_cudagraph_memory`` returns 0 in 0.22–0.28 (real from 0.29.0)."""
        if not self.since("0.20.0"):
            return False
        return not (self.v2_runner(moe) and not self.since("0.29.0"))

    @property
    def full_graphs(self) -> bool:
        """``cudagraph_mode`` FULL_AND_PIECEWISE from 0.11.0 (PIECEWISE before): uniform decode
        batches get full graphs of their own."""
        return self.since("0.11.0")

    def capture_sizes(self, max_num_seqs: int, mnbt: int, given: tuple[int, ...] = (), spec_tokens: int = 0,
                      sm100: bool = False) -> list[int]:
        """``cudagraph_capture_sizes``. To 0.11.0: ``[1, 2, 4] + range(8, min(2·S, 512) + 1, 8)``
        capped at max_num_batched_tokens (config/__init__.py). From 0.11.1 (config/vllm.py):
        ``M = min(2·S, 512, mnbt)`` (2·S·(1 + speculative tokens) from 0.13.0; 1024 on SM100 from
        0.28.0), sizes 1, 2, 4, steps of 8 below 256 and of 16 from 256 to M; from 0.20.1 M's
        ``mnbt`` itself is added when ≤ M, from 0.31.0 ``max_num_seqs`` too."""
        if len(given) > 1:
            return [s for s in sorted(given) if s <= mnbt]
        if not self.since("0.11.1"):
            top = given[0] if given else min(max_num_seqs * 2, 512)
            sizes = [1, 2, 4] + list(range(8, top + 1, 8))
            return [s for s in sizes if s <= mnbt]
        per_seq = 1 + spec_tokens if self.since("0.13.0") else 1
        cap = 1024 if sm100 and self.since("0.28.0") else 512
        top = given[0] if given else min(2 * max_num_seqs * per_seq, cap)
        m = min(top, mnbt)
        out = {s for s in (1, 2, 4) if s <= m} | set(range(8, min(m, 255) + 1, 8)) | set(range(256, m + 1, 16))
        if self.since("0.20.1") and mnbt <= m:
            out.add(mnbt)
        if self.since("0.31.0") and max_num_seqs <= m:
            out.add(max_num_seqs)
        return sorted(out)

    # ------------------------------------------------------------------ the KV-cache config
    def inflight_tokens(self, mnbt: int, pp: int) -> int:
        """Tokens a sliding-window layer reserves beyond its window: ``max_num_batched_tokens`` to
        0.27.x; from 0.28.0 ``max_in_flight_tokens`` = (PP + 1) × mnbt with async scheduling (on by
        default; config/vllm.py ``max_concurrent_batches``)."""
        return (pp + 1) * mnbt if self.since("0.28.0") else mnbt

    @property
    def tokens_from_concurrency(self) -> bool:
        """The logged token count: ``num_blocks // num_groups × block_size`` to 0.20.0,
        ``⌊concurrency × max_model_len⌋`` from 0.20.1 (v1/core/kv_cache_utils.py)."""
        return self.since("0.20.1")

    @property
    def null_block(self) -> bool:
        """0.34.0 checks one request of max_model_len against the budget less one (null) block
        (v1/core/kv_cache_planning.py:1635-1644)."""
        return self.since("0.34.0")

    # ------------------------------------------------------------------ log and error texts
    def gib(self, n: float) -> str:
        """``%.2f`` to 0.13.x, ``format_gib`` (``round(x, 2)``: ``60.5``) from 0.14.0."""
        return f"{round(n / GiB, 2)}" if self.since("0.14.0") else f"{n / GiB:.2f}"

    def gib_rounded(self, n: float) -> str:
        """``round(x / GiB, 2)``: the suggestion line's figures in every release."""
        return f"{round(n / GiB, 2)}"

    def weights_line(self, weights: int, moe: bool) -> str:
        """"Model loading took %.4f GiB and …" to 0.11.0; "… GiB memory and …" (V1 runner
        0.11.1–0.33, V2 runner from 0.28.0); ``%s`` (format_gib) from 0.14.0."""
        amount = self.gib(weights) if self.since("0.14.0") else f"{weights / GiB:.4f}"
        v2 = self.v2_runner(moe)
        memory = (self.since("0.28.0") if v2 else self.since("0.11.1"))
        return f"Model loading took {amount} GiB{' memory' if memory else ''}"

    def usage_line(self, *, free: int, total: int, utilization: float, requested: int, weights: int, non_torch: int,
                   consumed: int, peak: int, graphs: int, available: int) -> str | None:
        """The suggestion ``compile_or_warm_up_model`` logs after capture (from 0.10.2): what each part
        took and the ``--kv-cache-memory`` that fits, with a 150 MiB buffer (gpu_worker.py). ``peak``
        is its "peak activation" (from 0.27.0 the transient peak + the graph estimate)."""
        if not self.since("0.10.2"):
            return None
        g = self.gib_rounded
        if self.since("0.27.0"):
            non_kv = consumed + peak + graphs
            parts = (f"{g(consumed)} GiB for consumed memory (weights + non-torch), {g(peak)} GiB for peak activation, "
                     f"and {g(graphs)} GiB for CUDAGraph memory")
        else:
            non_kv = weights + peak + non_torch + graphs
            parts = (f"{g(weights)} GiB for weight, {g(peak)} GiB for peak activation, {g(non_torch)} GiB for non-torch "
                     f"memory, and {g(graphs)} GiB for CUDAGraph memory")
        buffer = 150 * (1 << 20)
        fit, full = int(requested) - non_kv - buffer, free - non_kv - buffer
        head = (f"Free memory on device ({g(free)}/{g(total)} GiB) on startup. Desired GPU memory utilization is "
                f"({utilization}, {g(requested)} GiB). Actual usage is {parts}. Replace gpu_memory_utilization config "
                "with ")
        if not self.since("0.11.0"):
            return (head + f"`--kv-cache-memory={fit}` to fit into requested memory, or `--kv-cache-memory={full}` to "
                    f"fully utilize gpu memory. Current kv cache memory in use is {int(available)} bytes.")
        return (head + f"`--kv-cache-memory={fit}` ({g(fit)} GiB) to fit into requested memory, or "
                f"`--kv-cache-memory={full}` ({g(full)} GiB) to fully utilize gpu memory. Current kv cache memory "
                f"in use is {g(available)} GiB.")

    @property
    def kv_one_line(self) -> bool:
        """From 0.28.0 "GPU KV cache size: N tokens, Maximum concurrency for …" is one line."""
        return self.since("0.28.0")

    def startup_error(self, free: int, total: int, utilization: float, requested: int) -> str:
        """``request_memory``'s refusal (verbatim per version; the device from 0.14.0)."""
        device = "cuda:0 " if self.since("0.14.0") else ""
        return (f"Free memory on device {device}({self.gib(free)}/{self.gib(total)} GiB) on startup is less "
                f"than desired GPU memory utilization ({utilization}, {self.gib(requested)} GiB). "
                "Decrease GPU memory utilization or reduce GPU memory used by other processes.")

    def no_memory_error(self, hint: str) -> str:
        docs = " See https://docs.vllm.ai/en/latest/configuration/conserving_memory/ for more details."
        if self.since("0.34.0"):
            return f"No available memory for the cache blocks. {hint}{docs}"
        if self.since("0.22.0"):
            return ("No available memory for the cache blocks. Try increasing `gpu_memory_utilization` when "
                    "initializing the engine (this flag also controls CPU memory reservation on the CPU backend, "
                    f"despite its name).{docs}")
        base = "No available memory for the cache blocks. Try increasing `gpu_memory_utilization` when initializing the engine."
        return base + (docs if self.since("0.13.0") else "")

    def too_long_error(self, max_model_len: int, needed: int, available: int, estimated: int, hint: str) -> str:
        """``check_enough_kv_cache_memory``'s error: "models's" and ``%.2f`` to 0.13.x, the docs link
        from 0.13.0, ``format_gib`` from 0.14.0, "model's" and the CPU-backend note from 0.22.0, the
        mode's hint from 0.34.0."""
        docs = " See https://docs.vllm.ai/en/latest/configuration/conserving_memory/ for more details."
        est = (f"Based on the available memory, the estimated maximum model length is {estimated}. "
               if estimated > 0 else "")
        if self.since("0.34.0"):
            return (f"To serve at least one request with the model's max seq len ({max_model_len}), "
                    f"({self.gib(needed)} GiB KV cache is needed, which is larger than the available KV cache "
                    f"memory ({self.gib(available)} GiB). {est}{hint} Decreasing `max_model_len` also reduces "
                    f"what is needed.{docs}")
        if self.since("0.22.0"):
            return (f"To serve at least one request with the model's max seq len ({max_model_len}), "
                    f"({self.gib(needed)} GiB KV cache is needed, which is larger than the available KV cache "
                    f"memory ({self.gib(available)} GiB). {est}Try increasing `gpu_memory_utilization` (which also "
                    "controls CPU memory on the CPU backend) or decreasing `max_model_len` when initializing the "
                    f"engine.{docs}")
        if self.since("0.14.0"):
            return (f"To serve at least one request with the models's max seq len ({max_model_len}), "
                    f"({self.gib(needed)} GiB KV cache is needed, which is larger than the available KV cache "
                    f"memory ({self.gib(available)} GiB). {est}Try increasing `gpu_memory_utilization` or "
                    f"decreasing `max_model_len` when initializing the engine.{docs}")
        return (f"To serve at least one request with the models's max seq len ({max_model_len}), "
                f"({needed / GiB:.2f} GiB KV cache is needed, which is larger than the available KV cache "
                f"memory ({available / GiB:.2f} GiB). {est.rstrip()} Try increasing `gpu_memory_utilization` or "
                "decreasing `max_model_len` when initializing the engine."
                + (docs if self.since("0.13.0") else ""))


def _preferred(default: int, sizes: tuple[int, ...], multiple_of: int = 0) -> int:
    """``AttentionBackend.get_preferred_block_size``: ``default`` when the kernel takes it (one of
    ``sizes``, or a multiple of ``multiple_of``), else the smallest size it takes."""
    if (multiple_of and default % multiple_of == 0) or default in sizes:
        return default
    return min(sizes) if sizes else multiple_of
