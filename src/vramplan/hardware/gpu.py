"""The GPU record: every figure with where it comes from."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import field

from vramplan._dataclass import dataclass


@dataclass(frozen=True, kw_only=True)
class GPU:
    """One GPU model of the catalog; every figure names its source."""

    key: str
    """Catalog key, e.g. ``h100-sxm``."""
    name: str
    """Marketing name, e.g. ``NVIDIA H100 SXM5 80GB``."""
    vendor: str  # nvidia | amd | intel
    arch: str
    """Architecture / generation: volta, turing, ampere, ada, hopper, blackwell, cdna2, cdna3, gaudi."""
    compute_capability: str | None = None
    """CUDA compute capability, e.g. ``9.0`` (NVIDIA only)."""
    capacity: int
    """Memory capacity in bytes (nominal; 80 GB cards are 80 GiB, see ``capacity_note``)."""
    memory_type: str | None = None
    bus_width_bits: int | None = None
    data_rate_gbps: float | None = None
    """Per-pin data rate in Gbit/s (already counts both clock edges)."""
    bandwidth: float | None = None
    """Stated memory bandwidth in bytes/s (10^9 GB/s × 1e9)."""
    bf16_tflops: float | None = None
    """Dense (not sparse) tensor BF16 TFLOP/s."""
    fp16_tflops: float | None = None
    fp8_tflops: float | None = None
    fp32_tflops: float | None = None
    tf32_tflops: float | None = None
    interconnect: str | None = None
    interconnect_bw: float | None = None
    """GPU-to-GPU bandwidth in bytes/s (bidirectional per GPU)."""
    pcie_gen: int | None = None
    form_factor: str | None = None  # sxm | pcie | nvl | oam | consumer
    tdp_w: int | None = None
    launch_price_usd: float | None = None
    launch_date: str | None = None
    aliases: tuple[str, ...] = ()
    sources: Mapping[str, str] = field(default_factory=dict)
    """Field name → source citation (URL or document) for each figure."""
    notes: str = ""
    # --- added by the hardware module (all optional, backwards compatible) ---
    sm_count: int | None = None
    """Streaming multiprocessors (NVIDIA)."""
    nvenc_engines: int | None = None
    """NVENC video encoder engines on the chip (0: none, e.g. A100/H100)."""
    av1_encode: bool | None = None
    ecc_gddr: bool = False
    """ECC is on by default on this GDDR card and takes 1/16 of the capacity."""
    cuda_total: int | None = None
    """Measured total that CUDA reports (``torch.cuda.mem_get_info()[1]``), bytes."""
    smi_total: int | None = None
    """Measured total that nvidia-smi shows, bytes."""
    epoch_row: str | None = None
    """Row name in Epoch AI's ML hardware data, where the card has one."""
    spec_url: str | None = None
    """The vendor's specification page or datasheet."""

    @property
    def sm(self) -> tuple[int, int] | None:
        """Compute capability as (major, minor), parsed from ``compute_capability``; None
        where the catalog has none (AMD, Intel)."""
        if not self.compute_capability:
            return None
        major, _, minor = self.compute_capability.partition(".")
        return int(major), int(minor or 0)

    @property
    def derived_bandwidth(self) -> float | None:
        """bus width × per-pin rate ÷ 8, in bytes/s."""
        if self.bus_width_bits and self.data_rate_gbps:
            return self.bus_width_bits * self.data_rate_gbps / 8 * 1e9
        return None

    @property
    def peak_bandwidth(self) -> float | None:
        return self.bandwidth or self.derived_bandwidth
