"""Rules beyond deep learning: memory bandwidth, rendering, video encoding, large arrays.

Each rule returns a frozen :class:`RuleResult`: the steps of its formula with the numbers
filled in (``steps``), the results in integer bytes / floats (``values``, what JSON shows),
and the assumptions (``notes``). Nothing here prints.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

from vramplan.errors import VramplanError
from vramplan.units import GiB, fmt_bytes

from .catalog import get_gpu, list_gpus, usable_capacity
from .gpu import GPU
from .overhead import device_overhead


@dataclass(frozen=True)
class Step:
    label: str
    formula: str
    """The formula with the numbers filled in, ending in its result."""


@dataclass(frozen=True)
class RuleResult:
    rule: str
    steps: tuple[Step, ...]
    values: Mapping[str, Any] = field(default_factory=dict)
    notes: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {
            "rule": self.rule,
            **dict(self.values),
            "steps": [{"label": s.label, "formula": s.formula} for s in self.steps],
            "notes": list(self.notes),
        }


def _gbs(x: float) -> str:
    return f"{x / 1e9:,.1f} GB/s" if x < 100e9 else f"{x / 1e9:,.0f} GB/s"


def _num(x: float) -> str:
    return f"{x:,.0f}" if float(x).is_integer() else f"{x:,.4g}"


def _positive(name: str, v: float) -> None:
    if not (isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0 and math.isfinite(v)):
        raise VramplanError(f"--{name} must be a positive number, got {v!r}")


# --- bandwidth ----------------------------------------------------------------------


def bandwidth(bus_bits: int, rate_gbps: float | None = None, *, clock_mhz: float | None = None,
              efficiency: float = 1.0) -> RuleResult:
    """Peak memory bandwidth = bus width (bits) × per-pin data rate (Gbit/s) ÷ 8, in GB/s.

    ``clock_mhz`` instead of ``rate_gbps`` takes NVML's memory clock, whose double is the
    per-pin rate. ``efficiency`` (0–1] gives the effective figure a memory controller reaches.
    """
    if not isinstance(bus_bits, int) or isinstance(bus_bits, bool) or bus_bits <= 0:
        raise VramplanError(f"`bus_bits` must be a positive number of bits, got {bus_bits!r}", field="bus_bits")
    if (rate_gbps is None) == (clock_mhz is None):
        raise VramplanError("give the per-pin rate or the memory clock, not both or neither",
                            hint="`rate_gbps=21` (Gbps per pin) or `clock_mhz=10501` (as NVML reports it)")
    if not (0 < efficiency <= 1):
        raise VramplanError(f"`efficiency` must be in (0, 1], got {efficiency!r}", hint="e.g. 0.9", field="efficiency")
    steps: list[Step] = []
    if clock_mhz is not None:
        _positive("clock-mhz", clock_mhz)
        rate = 2 * clock_mhz / 1000
        steps.append(Step("per-pin rate", f"2 × {_num(clock_mhz)} MHz = {_num(rate)} Gbps (NVML memory clock × 2)"))
    else:
        assert rate_gbps is not None
        _positive("rate", rate_gbps)
        rate = float(rate_gbps)
    peak = bus_bits * rate / 8 * 1e9
    steps.append(Step("peak", f"{bus_bits:,} bit × {_num(rate)} Gbps ÷ 8 = {_gbs(peak)}"))
    effective = peak * efficiency
    if efficiency < 1:
        steps.append(Step("effective", f"{_gbs(peak)} × {efficiency:g} = {_gbs(effective)}"))
    wrong = peak * 2
    matches = [g.key for g in list_gpus()
               if g.bus_width_bits == bus_bits and g.data_rate_gbps and abs(g.data_rate_gbps - rate) < 1e-6]
    notes = [
        f"Not × 2 for DDR: a per-pin rate in Gbps already counts both clock edges; "
        f"{bus_bits:,} × {_num(rate)} × 2 ÷ 8 = {_gbs(wrong)} would double-count.",
        "Per-pin rates: GDDR6 14–20, GDDR6X 19–24, GDDR7 28–32, HBM2e ~3.2, HBM3 ~5.2, HBM3e ~6–8 Gbps.",
    ]
    if matches:
        notes.append("Catalog GPUs with this bus and rate: " + ", ".join(matches))
    return RuleResult(
        "bandwidth", tuple(steps),
        {"bus_bits": bus_bits, "rate_gbps": rate, "efficiency": efficiency,
         "peak_bytes_per_s": peak, "effective_bytes_per_s": effective,
         "double_counted_bytes_per_s": wrong, "matching_gpus": matches},
        tuple(notes))


# --- rendering -----------------------------------------------------------------------

COLOR_FORMATS: Mapping[str, int] = {
    "rgba8": 4, "bgra8": 4, "rgb10a2": 4, "r11g11b10f": 4, "rgba16f": 8, "rgba32f": 16,
}
"""Bytes per pixel of common colour formats."""

DEPTH_FORMATS: Mapping[str, int] = {"none": 0, "d16": 2, "d24s8": 4, "d32": 4, "d32s8": 8}
"""Bytes per sample; d32s8 has 5 bytes of data, stored padded to 8 (assumption)."""

MSAA_SAMPLES = (1, 2, 4, 8, 16)

BVH_BYTES_PER_TRIANGLE = 64
"""Assumption: order of magnitude of a DXR/Vulkan bottom-level acceleration structure per
triangle before compaction (compaction typically halves it). The exact size comes from
``vkGetAccelerationStructureBuildSizesKHR`` / ``GetRaytracingAccelerationStructurePrebuildInfo``."""


def _choice(name: str, value: str, table: Mapping[str, int]) -> int:
    v = value.strip().lower()
    if v not in table:
        raise VramplanError(f"unknown {name} {value!r}", hint=f"choose one of {', '.join(table)}")
    return table[v]


def render(width: int, height: int, *, color_format: str = "rgba8", buffers: int = 3, msaa: int = 1,
           depth: str = "d32", textures: int = 0, bvh_triangles: int = 0,
           bvh_bytes_per_triangle: float = BVH_BYTES_PER_TRIANGLE, fps: float = 60.0,
           gpu: GPU | str | None = None) -> RuleResult:
    """Frame buffers, depth, MSAA, textures and a ray-tracing BVH; frame-write traffic vs bandwidth."""
    for name, v in (("width", width), ("height", height), ("buffers", buffers)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise VramplanError(f"--{name} must be a positive integer, got {v!r}")
    if msaa not in MSAA_SAMPLES:
        raise VramplanError(f"`msaa` must be one of {', '.join(map(str, MSAA_SAMPLES))}, got {msaa!r}", field="msaa")
    _positive("fps", fps)
    if textures < 0 or bvh_triangles < 0 or bvh_bytes_per_triangle < 0:
        raise VramplanError("`textures`, `bvh_triangles` and `bvh_bytes_per_triangle` must not be negative", field="textures")
    bpp = _choice("colour format", color_format, COLOR_FORMATS)
    dbpp = _choice("depth format", depth, DEPTH_FORMATS)
    px = width * height
    steps: list[Step] = []
    color = px * bpp * buffers
    steps.append(Step("swap-chain colour buffers",
                      f"{width:,} × {height:,} × {bpp} B ({color_format}) × {buffers} buffers = {color:,} B"))
    msaa_color = px * bpp * msaa if msaa > 1 else 0
    if msaa_color:
        steps.append(Step("MSAA colour target",
                          f"{width:,} × {height:,} × {bpp} B × {msaa} samples = {msaa_color:,} B"))
    depth_bytes = px * dbpp * msaa
    if dbpp:
        steps.append(Step("depth buffer",
                          f"{width:,} × {height:,} × {dbpp} B ({depth}) × {msaa} sample{'s' if msaa > 1 else ''} = {depth_bytes:,} B"))
    if textures:
        steps.append(Step("textures", f"{textures:,} B (given)"))
    bvh = int(bvh_triangles * bvh_bytes_per_triangle)
    if bvh_triangles:
        steps.append(Step("ray-tracing BVH",
                          f"{bvh_triangles:,} triangles × {_num(bvh_bytes_per_triangle)} B/triangle = {bvh:,} B"))
    total = color + msaa_color + depth_bytes + textures + bvh
    steps.append(Step("total", " + ".join(f"{x:,}" for x in (color, msaa_color, depth_bytes, textures, bvh) if x)
                      + f" = {total:,} B ({fmt_bytes(total, 'auto')})"))
    final_writes = px * bpp * fps
    steps.append(Step("final-frame writes", f"{width:,} × {height:,} × {bpp} B × {_num(fps)} fps = {_gbs(final_writes)}"
                      f" ({final_writes / GiB:,.2f} GiB/s)"))
    per_frame = (px * bpp * msaa + (px * bpp if msaa > 1 else 0) + px * dbpp * msaa)
    target_writes = per_frame * fps
    steps.append(Step("colour + depth writes",
                      f"({width:,} × {height:,}) × ({bpp} × {msaa} colour{' + ' + str(bpp) + ' resolve' if msaa > 1 else ''}"
                      f" + {dbpp} × {msaa} depth) B × {_num(fps)} fps = {_gbs(target_writes)}"))
    values: dict[str, Any] = {
        "width": width, "height": height, "color_format": color_format, "buffers": buffers, "msaa": msaa,
        "depth": depth, "fps": fps, "color_bytes": color, "msaa_color_bytes": msaa_color,
        "depth_bytes": depth_bytes, "texture_bytes": textures, "bvh_bytes": bvh,
        "bvh_bytes_per_triangle": bvh_bytes_per_triangle, "total_bytes": total,
        "final_frame_writes_bytes_per_s": final_writes, "target_writes_bytes_per_s": target_writes,
    }
    notes = [
        "One write per pixel per frame (no overdraw, no blending reads); real traffic is dominated by "
        "texture, G-buffer and post-processing reads, often 10–100× these writes.",
    ]
    if bvh_triangles:
        notes.append(f"BVH at {_num(bvh_bytes_per_triangle)} B/triangle is an assumption (uncompacted order of "
                     "magnitude; compaction typically halves it) — query the API's prebuild size for the real one.")
    if gpu is not None:
        g = get_gpu(gpu) if isinstance(gpu, str) else gpu
        usable, _ = usable_capacity(g)
        values["gpu"] = g.key
        values["usable_bytes"] = usable
        values["fits"] = total <= usable
        steps.append(Step("fits", f"{fmt_bytes(total, 'auto')} vs {fmt_bytes(usable, 'auto')} usable on {g.key}: "
                          f"{'yes' if total <= usable else 'no'}"))
        if g.peak_bandwidth:
            share = target_writes / g.peak_bandwidth
            values["bandwidth_bytes_per_s"] = g.peak_bandwidth
            values["write_share_of_bandwidth"] = share
            steps.append(Step("share of bandwidth", f"{_gbs(target_writes)} ÷ {_gbs(g.peak_bandwidth)} = {share:.2%}"))
    return RuleResult("render", tuple(steps), values, tuple(notes))


# --- video encoding ------------------------------------------------------------------

CODECS = ("h264", "hevc", "av1")
GEFORCE_SESSION_CAP = 8
"""Concurrent NVENC sessions per system on GeForce since the January 2024 drivers (5 from
March 2023, 3 before; Wikipedia "Nvidia NVENC", NVIDIA Video Encode and Decode GPU Support
Matrix). Data-centre and qualified professional GPUs have no driver cap."""
REFERENCE_FRAMES = 4
"""Assumption: reference frames held per session (NVENC's default DPB for 1–4 refs)."""


def _nvenc_surfaces(b_frames: int) -> int:
    """Input surfaces: ffmpeg's automatic choice, max(4, 4 × (B-frames + 1)) (libavcodec nvenc.c)."""
    return max(4, 4 * (b_frames + 1))


def video(codec: str, gpu: GPU | str, *, width: int = 1920, height: int = 1080, bit_depth: int = 8,
          b_frames: int = 0) -> RuleResult:
    """Concurrent NVENC encode sessions: driver cap, engines, and memory per session."""
    c = codec.strip().lower()
    if c not in CODECS:
        raise VramplanError(f"unknown codec {codec!r}", hint=f"choose one of {', '.join(CODECS)}")
    if bit_depth not in (8, 10):
        raise VramplanError(f"`bit_depth` must be 8 or 10, got {bit_depth!r}", field="bit_depth")
    for name, v in (("width", width), ("height", height)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise VramplanError(f"--{name} must be a positive integer, got {v!r}")
    if b_frames < 0:
        raise VramplanError("`b_frames` must not be negative", field="b_frames")
    g = get_gpu(gpu) if isinstance(gpu, str) else gpu
    if g.vendor != "nvidia":
        raise VramplanError(f"{g.key} has no NVENC: NVENC is NVIDIA's encoder",
                            hint="AMD GPUs encode with VCN/AMF; Gaudi has no video encoder")
    engines = g.nvenc_engines
    steps: list[Step] = []
    notes: list[str] = []
    supported = bool(engines) and (c != "av1" or bool(g.av1_encode))
    if not engines:
        notes.append(f"{g.key} has no NVENC engine (data-centre compute GPUs such as A100/H100/B200 only decode).")
    elif not supported:
        notes.append(f"{g.key}'s NVENC cannot encode AV1 (AV1 encode needs Ada or newer).")
    consumer = g.form_factor == "consumer"
    cap: int | None = GEFORCE_SESSION_CAP if consumer else None
    aw, ah = -(-width // 32) * 32, -(-height // 32) * 32
    bpp = 1.5 if bit_depth == 8 else 3.0
    frame = int(aw * ah * bpp)
    surfaces = _nvenc_surfaces(b_frames)
    refs = REFERENCE_FRAMES
    bitstream = surfaces * frame // 2
    per_session = (surfaces + refs + 2) * frame + bitstream
    steps.append(Step("frame", f"{aw:,} × {ah:,} (aligned to 32) × {bpp:g} B ({'NV12' if bit_depth == 8 else 'P010'}) = {frame:,} B"))
    steps.append(Step("per session",
                      f"({surfaces} input surfaces + {refs} references + 2 reconstruction/scratch) × {frame:,} B"
                      f" + {surfaces} bitstream buffers × {frame // 2:,} B = {per_session:,} B ({fmt_bytes(per_session, 'MiB', 1)})"))
    usable, _ = usable_capacity(g)
    context = sum(o.bytes for o in device_overhead(g))
    by_memory = max(0, (usable - context) // per_session) if supported else 0
    if supported:
        steps.append(Step("memory limit", f"({usable:,} usable − {context:,} context) ÷ {per_session:,} = {by_memory:,} sessions"))
    sessions = 0 if not supported else (min(cap, by_memory) if cap is not None else by_memory)
    steps.append(Step("sessions",
                      (f"min(GeForce driver cap {cap}, memory {by_memory:,}) = {sessions:,}" if cap is not None
                       else f"no driver cap on {g.key} (data-centre/professional); memory allows {by_memory:,}")
                      if supported else "0 (cannot encode this codec)"))
    steps.append(Step("engines", f"{engines} NVENC engine{'s share' if engines != 1 else ' shares'} the sessions' throughput"))
    notes += [
        "Throughput, not memory, usually limits real-time sessions: each NVENC engine encodes a few "
        "hundred 1080p frames per second at fast presets (NVIDIA's NVENC performance table).",
        f"Per-session memory assumes ffmpeg's automatic surface count max(4, 4 × (B-frames + 1)), "
        f"{REFERENCE_FRAMES} reference frames and bitstream buffers of half a frame; each encoding process "
        "also carries its own CUDA context.",
    ]
    if cap is not None:
        notes.append("The GeForce cap of 8 concurrent sessions is per system, across all GeForce cards "
                     "(drivers from January 2024; 5 from March 2023, 3 before).")
    return RuleResult(
        "video", tuple(steps),
        {"codec": c, "gpu": g.key, "width": width, "height": height, "bit_depth": bit_depth,
         "nvenc_engines": engines, "codec_supported": supported, "driver_session_cap": cap,
         "bytes_per_session": per_session, "sessions_by_memory": by_memory, "sessions": sessions},
        tuple(notes))


# --- large arrays --------------------------------------------------------------------

DTYPES: Mapping[str, int] = {
    "float64": 8, "double": 8, "f8": 8, "float32": 4, "float": 4, "f4": 4, "float16": 2, "half": 2,
    "f2": 2, "bfloat16": 2, "bf16": 2, "int64": 8, "int32": 4, "int16": 2, "int8": 1, "uint8": 1,
    "bool": 1, "complex64": 8, "complex128": 16,
}


def parse_shape(text: str | tuple[int, ...] | list[int]) -> tuple[int, ...]:
    """``"4096,4096,4096"`` or ``"4096x4096"`` → (4096, 4096, 4096)."""
    if isinstance(text, str):
        # one separator between dimensions: "5,,5" is a typo, not a 5×5 shape
        parts = re.split(r"\s*[,x×]\s*|\s+", text.strip().lower()) if text.strip() else []
        if "" in parts:
            raise VramplanError(f"invalid shape {text!r}: an empty dimension", hint="write e.g. 4096,4096,4096")
        try:
            dims = tuple(int(p) for p in parts)
        except ValueError:
            raise VramplanError(f"invalid shape {text!r}", hint="write e.g. 4096,4096,4096") from None
    else:
        dims = tuple(text)
    if not dims or any((not isinstance(d, int)) or d < 1 for d in dims):
        raise VramplanError(f"invalid shape {text!r}: dimensions must be positive integers",
                            hint="write e.g. 4096,4096,4096")
    return dims


def array(shape: str | tuple[int, ...], dtype: str = "float32", *, working_set: float = 1.0,
          gpu: GPU | str | None = None) -> RuleResult:
    """Bytes of a dense array × a working-set factor (inputs, outputs, temporaries), and the fit."""
    dims = parse_shape(shape)
    itemsize = _choice("dtype", dtype, DTYPES)
    _positive("working-set", working_set)
    elems = math.prod(dims)
    nbytes = elems * itemsize
    # exact: the factor as the decimal it was written as (2.5, 0.1), never a float product
    # (int(1.2e19 * 2.5) is off by thousands of bytes above 2^53)
    factor = repr(float(working_set)).removesuffix(".0")
    need = math.ceil(nbytes * Fraction(factor))
    steps = [
        Step("elements", " × ".join(f"{d:,}" for d in dims) + f" = {elems:,}"),
        Step("array", f"{elems:,} × {itemsize} B ({dtype}) = {nbytes:,} B ({fmt_bytes(nbytes, 'auto')})"),
        Step("working set", f"{nbytes:,} B × {factor} = {need:,} B ({fmt_bytes(need, 'auto')})"),
    ]
    values: dict[str, Any] = {"shape": list(dims), "dtype": dtype, "itemsize": itemsize, "elements": elems,
                              "array_bytes": nbytes, "working_set": working_set, "needed_bytes": need}
    notes = ["The working-set factor counts inputs, outputs and temporaries alive at once "
             "(e.g. 3 for c = a + b without in-place ops)."]
    if gpu is not None:
        g = get_gpu(gpu) if isinstance(gpu, str) else gpu
        usable, src = usable_capacity(g)
        context = sum(o.bytes for o in device_overhead(g))
        avail = usable - context
        fits = need <= avail
        gpus_needed = max(1, -(-need // avail)) if avail > 0 else None
        values.update(gpu=g.key, usable_bytes=usable, context_bytes=context, available_bytes=avail,
                      fits=fits, gpus_needed=gpus_needed)
        steps.append(Step("available", f"{usable:,} usable − {context:,} context = {avail:,} B ({fmt_bytes(avail, 'auto')}) on {g.key}"))
        steps.append(Step("fits", f"{fmt_bytes(need, 'auto')} {'≤' if fits else '>'} {fmt_bytes(avail, 'auto')}: "
                          + ("yes" if fits else f"no — about {gpus_needed:,} GPUs' worth if split evenly")))
        notes.append(f"Usable capacity: {src}.")
    return RuleResult("array", tuple(steps), values, tuple(notes))
