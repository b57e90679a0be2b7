"""What changed in SGLang's start-up sizing from release to release (CUDA, a text model, no
speculative decoding, DP attention or disaggregation), for ``serve-plan --engine sglang
--engine-version``: :class:`SglangRelease` answers each rule for one version.

Read in the packages of 0.4.6 … 0.5.23 on the index (sdists to 0.5.10.post1, wheels after:
every release and post-release); ``docs/research/sglang-version-history.md`` bisects each
change with file:line per version. Paths are inside each package's ``sglang/srt/``.

``gpu_mem`` is what ``get_device_memory_capacity`` returns: nvidia-smi's ``memory.total`` in MiB
(utils.py / utils/common.py ``get_nvgpu_memory_capacity``, every release). Rules that are the
same in every release read: ``rest = free_after_weights − free_after_dist_init × (1 −
mem_fraction_static)`` (GB floats, ``get_available_gpu_memory``), ``tokens = ⌊rest × 2^30 /
cell_size⌋`` rounded down to ``page_size``; each layer's K and V buffers hold ``tokens +
page_size`` rows (slot 0 is the padding slot); the request pool is ``max_num_reqs + 1`` rows of
``context_len + 4`` int32 to 0.4.6.post5, ``max_num_reqs`` rows from 0.4.7.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from vramplan.errors import WorkloadError

OLDEST = "0.4.6"
NEWEST = "0.5.23"
RELEASES = ("0.5.23", "0.5.22", "0.5.21", "0.5.20", "0.5.19", "0.5.18", "0.5.17", "0.5.16", "0.5.15", "0.5.14",
            "0.5.13", "0.5.12", "0.5.11", "0.5.10", "0.5.9", "0.5.8", "0.5.7", "0.5.6", "0.5.5", "0.5.4", "0.5.3",
            "0.5.2", "0.5.1", "0.5.0rc2", "0.4.10", "0.4.9", "0.4.8", "0.4.7", "0.4.6")
"""The releases read (newest first; post-releases were read too): what the web page offers."""

_RE = re.compile(r"^v?(\d+)\.(\d+)\.(\d+)(?:\.?(post|rc)(\d+))?$")


def parse(text: str) -> tuple[int, int, int, int]:
    """``0.4.6``, ``0.4.6.post2``, ``v0.5.0rc2`` → (major, minor, patch, n): ``rcN`` sorts
    below the release (n = N − 100), ``postN`` above it (n = N)."""
    m = _RE.match((text or "").strip().lower())
    if not m:
        raise WorkloadError(f"invalid SGLang version {text!r}", hint=f"e.g. `engine_version={NEWEST}` or 0.4.6.post5",
                            field="engine_version")
    n = int(m.group(5) or 0)
    return int(m.group(1)), int(m.group(2)), int(m.group(3)), (n - 100 if m.group(4) == "rc" else n)


GiB_MB = 1024
"""gpu_mem thresholds are MiB: ``20 * 1024`` is 20 GiB."""


@dataclass(frozen=True)
class SglangRelease:
    """The sizing rules of one SGLang release."""

    text: str
    v: tuple[int, int, int, int]

    @classmethod
    def of(cls, text: str | None) -> SglangRelease:
        text = (text or NEWEST).strip()
        v = parse(text)
        if v < parse(OLDEST) or v > parse(NEWEST):
            raise WorkloadError(f"SGLang {text} is not modelled: serve-plan follows SGLang's sizing from {OLDEST} to "
                                f"{NEWEST}", hint=f"use `engine_version` {OLDEST} … {NEWEST} (or leave it out)",
                                field="engine_version")
        return cls(text, v)

    def since(self, text: str) -> bool:
        return self.v >= parse(text)

    # ------------------------------------------------------------------ defaults
    def chunked_prefill_size(self, gpu_mem: float) -> int:
        """Default ``chunked_prefill_size`` (server_args.py; arg_groups/memory_hook.py from 0.5.19):
        0.4.6: 2048 below 25,000 MiB, else 8192; 0.4.7: 16384 above 180,000; 0.4.7.post1: 2048
        below 35 GiB, 8192 below 160 GiB, 16384; 0.5.3: 2048 below 35 GiB, 4096 below 60 GiB,
        8192 below 160 GiB, 16384; 0.5.20: 4096 from 20 to 35 GiB."""
        if self.since("0.5.3rc2"):
            if gpu_mem < 20 * GiB_MB:
                return 2048
            if gpu_mem < 35 * GiB_MB:
                return 4096 if self.since("0.5.20") else 2048
            if gpu_mem < 60 * GiB_MB:
                return 4096
            return 8192 if gpu_mem < 160 * GiB_MB else 16384
        if self.since("0.4.7.post1"):
            return 2048 if gpu_mem < 35 * GiB_MB else 8192 if gpu_mem < 160 * GiB_MB else 16384
        if self.since("0.4.7") and gpu_mem > 180_000:
            return 16384
        return 2048 if gpu_mem < 25_000 else 8192

    def cuda_graph_max_bs(self, gpu_mem: float, tp: int) -> int:
        """Default largest decode CUDA-graph batch. To 0.5.2 only small GPUs set it (8, or 80 at
        TP ≥ 4; below 25,000 MiB to 0.4.7, below 35 GiB from 0.4.7.post1); unset, the capture list
        ends at 160 (model_executor/cuda_graph_runner.py ``get_batch_sizes_to_capture``). From
        0.5.3 by GPU size: 8 below 20 GiB; 16 | 80 below 35 GiB (24 | 80 from 0.5.4.post1, 48 |
        160 from 0.5.20); 32 | 160 below 60 GiB; 256 | 512 below 160 GiB; 512 above (the second
        figure at TP ≥ 4)."""
        big_tp = tp >= 4
        if self.since("0.5.3rc2"):
            if gpu_mem < 20 * GiB_MB:
                return 8
            if gpu_mem < 35 * GiB_MB:
                if self.since("0.5.20"):
                    return 160 if big_tp else 48
                return 80 if big_tp else (24 if self.since("0.5.4.post1") else 16)
            if gpu_mem < 60 * GiB_MB:
                return 160 if big_tp else 32
            if gpu_mem < 160 * GiB_MB:
                return 512 if big_tp else 256
            return 512
        small = gpu_mem < (35 * GiB_MB if self.since("0.4.7.post1") else 25_000)
        if small:
            return 80 if big_tp else 8
        return 160

    def prefill_graph_tokens(self, chunk: int, mla: bool, pp: int) -> list[int]:
        """Piecewise (prefill) CUDA-graph token sizes, on by default from 0.5.10 (``disable_piecewise_cuda_graph``;
        off with PP > 1); up to ``chunked_prefill_size`` (MLA: 2048, 8192 from 0.5.23): 4…32 step 4, 48…256 step 16,
        288…512 step 32, 576…1024 step 64, 1280…4096 step 256, then step 512 (server_args.py
        ``_generate_piecewise_cuda_graph_tokens``; arg_groups/cuda_graph_hook.py from 0.5.19)."""
        if not self.since("0.5.10rc0") or pp > 1:
            return []
        top = min(8192 if self.since("0.5.23") else 2048, chunk) if mla else chunk
        sizes = (list(range(4, 33, 4)) + list(range(48, 257, 16)) + list(range(288, 513, 32))
                 + list(range(576, 1025, 64)) + list(range(1280, 4097, 256)) + list(range(4608, top + 1, 512)))
        return [s for s in sizes if s <= top]

    def mem_fraction_static(self, gpu_mem: float, *, tp: int, pp: int, chunk: int, graph_bs: int, mla: bool,
                            graphs: bool = True) -> float:
        """The default ``mem_fraction_static`` (MiB arithmetic on ``gpu_mem``):

        * 0.4.6: 0.88 / 0.87 (TP ≥ 2) / 0.85 (≥ 4) / 0.81 (≥ 8) / 0.79 (≥ 16) up to 81,920 MiB, else
          (gpu_mem − 13 GiB) / gpu_mem;
        * 0.4.6.post2: the same table by TP × PP, 0.88 above 81,920; above 96 GiB
          min(f + 48 GiB × (1 − f) / gpu_mem, (gpu_mem − 18 GiB) / gpu_mem); 0.4.7: 0.79 above 180,000 MiB;
        * 0.4.7.post1: round((gpu_mem − reserved) / gpu_mem, 3), reserved (2.8 + P/10) GiB below 35 GiB,
          (9.5 + P/2) GiB below 90 GiB, (12 + P/2) GiB below 160 GiB, else 32 GiB (P = TP × PP);
        * 0.5.3: reserved = 512 + 1.5 × max(chunked_prefill_size, 2048) + 2 × cuda_graph_max_bs +
          TP × PP / 8 × 1024 MiB, at least 10 GiB on GPUs above 60 GiB; from 0.5.10 the piecewise
          graphs add 8 MiB per captured size (1.5 GiB with MLA).
        """
        p = tp * pp
        if self.since("0.5.3rc2"):
            reserved = 512 + max(chunk, 2048) * 1.5 + (graph_bs * 2 if graphs else 0) + p / 8 * 1024
            if graphs and self.since("0.5.10rc0") and pp == 1:
                reserved += 1.5 * 1024 if mla else len(self.prefill_graph_tokens(chunk, mla, pp)) * 8
            if gpu_mem > 60 * GiB_MB:
                reserved = max(reserved, 10 * 1024)
            return round((gpu_mem - reserved) / gpu_mem, 3)
        if self.since("0.4.7.post1"):
            if gpu_mem < 35 * GiB_MB:
                reserved = (2.8 + p / 10) * 1024
            elif gpu_mem < 90 * GiB_MB:
                reserved = (9.5 + p / 2) * 1024
            elif gpu_mem < 160 * GiB_MB:
                reserved = (12 + p / 2) * 1024
            else:
                reserved = 32 * 1024
            return round((gpu_mem - reserved) / gpu_mem, 3)
        n = p if self.since("0.4.6.post2") else tp
        table = 0.79 if n >= 16 else 0.81 if n >= 8 else 0.85 if n >= 4 else 0.87 if n >= 2 else 0.88
        if not self.since("0.4.6.post2"):
            return table if gpu_mem <= 81920 else (gpu_mem - 1024 * 13) / gpu_mem
        f = table if gpu_mem <= 81920 else 0.88
        if self.since("0.4.7") and gpu_mem > 180 * 1000:
            return 0.79
        if gpu_mem > 96 * GiB_MB:
            return min(f + 48 * 1024 * (1 - f) / gpu_mem, (gpu_mem - 1024 * 18) / gpu_mem)
        return f

    # ------------------------------------------------------------------ the pools
    def max_num_reqs(self, tokens: int, context_len: int, given: int | None) -> int:
        """The request-to-token pool's rows: ``clamp(tokens / context_len × 512, 2048, 4096)``; a
        given ``max_running_requests`` caps it from 0.5.10 (model_runner_kv_cache_mixin.py
        ``_resolve_max_num_reqs``), and to 0.5.9 replaces it (model_runner.py ``init_memory_pool``)."""
        est = min(max(int(tokens / max(context_len, 1) * 512), 2048), 4096)
        if given is not None:
            return min(given, est) if self.since("0.5.10rc0") else given
        return min(est, tokens // 2) if self.since("0.5.10rc0") else est

    def req_pool_rows(self, max_num_reqs: int) -> int:
        """``ReqToTokenPool(size=max_num_reqs + 1)`` to 0.4.6.post5 (0.4.6 model_runner.py:794-796,
        0.4.6.post5 :904), ``size=max_num_reqs`` from 0.4.7 (model_runner.py:926,934; 0.5.19
        mem_cache/kv_cache_configurator.py:819). Public logs agree: "max_running_requests=2049" at 0.4.2-0.4.3,
        2048 at 0.4.9-0.4.10 (docs/research/sglang-tgi-public-logs.md)."""
        return max_num_reqs if self.since("0.4.7") else max_num_reqs + 1

    def max_running(self, tokens: int, max_num_reqs: int, given: int | None) -> int:
        """``max_running_requests``: ``min(tokens // 2 or the given value, req pool size)``
        (managers/tp_worker.py to 0.5.6; model_runner.py from 0.5.7)."""
        return min(given if given is not None else tokens // 2, self.req_pool_rows(max_num_reqs))

    # ------------------------------------------------------------------ log lines
    def kv_line(self, tokens: int, k: int, v: int, mla: bool, dtype: str) -> str:
        """"KV Cache is allocated. #tokens: N, K size: X GB, V size: Y GB" (bytes / 2^30, ``%.2f``);
        "dtype: torch.bfloat16, " after the first full stop from 0.5.13."""
        dt = f"dtype: {dtype}, " if self.since("0.5.13") else ""
        sizes = f"KV size: {(k + v) / (1 << 30):.2f} GB" if mla else \
            f"K size: {k / (1 << 30):.2f} GB, V size: {v / (1 << 30):.2f} GB"
        return f"KV Cache is allocated. {dt}#tokens: {tokens}, {sizes}"
