"""Doc builders for the GPU catalog: one card with every figure's source (``vramplan gpu``), the
catalog list and this machine's GPUs (``vramplan gpus``), and their JSON objects.

Memory in GiB (2^30 B); bandwidth in GB/s (10^9 B/s), as the vendors state it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from vramplan.units import fmt_bytes

from .doc import Doc, KeyValues, Notes, Table

if TYPE_CHECKING:
    from vramplan.hardware.gpu import GPU
    from vramplan.hardware.nvml import LocalGPU
    from vramplan.hardware.prices import Instance
    from vramplan.results import OverheadItem

_RATES = (("bf16_tflops", "BF16 dense"), ("fp16_tflops", "FP16 dense"), ("fp8_tflops", "FP8 dense"),
          ("tf32_tflops", "TF32 dense"), ("fp32_tflops", "FP32"))


def bandwidth_derivation(g: GPU) -> dict[str, Any]:
    """Derived (bus × rate ÷ 8) against stated bandwidth, as data and as one sentence."""
    derived = g.derived_bandwidth
    stated = g.bandwidth
    src = g.sources.get("bandwidth", "")
    if derived is None:
        text = (f"stated {stated / 1e9:,.0f} GB/s ({src}); no per-pin rate in the catalog to derive it from"
                if stated else "no bandwidth in the catalog")
    else:
        text = (f"{g.bus_width_bits:,} bit × {g.data_rate_gbps:g} Gbps ÷ 8 = {derived / 1e9:,.0f} GB/s"
                + (f"; stated {stated / 1e9:,.0f} GB/s ({src})" if stated else ""))
        rate_src = g.sources.get("data_rate_gbps", "")
        if "back-computed" in rate_src:
            text += " — the per-pin rate was back-computed from the stated figure"
    return {"derived": derived, "stated": stated, "text": text}


def gpu_json(g: GPU, usable: int, usable_source: str, overhead: Sequence[OverheadItem],
             cublas_workspace: int, instances: Sequence[Instance]) -> dict[str, Any]:
    """``vramplan gpu NAME --json``: every catalog field with integer bytes, plus the derived figures."""
    return {
        **{k: v for k, v in dataclasses.asdict(g).items() if k != "sources"},
        "aliases": list(g.aliases),
        "sources": dict(g.sources),
        "usable": usable,
        "usable_source": usable_source,
        "bandwidth_derivation": bandwidth_derivation(g),
        "overhead": [dataclasses.asdict(o) for o in overhead],
        "cublas_workspace": cublas_workspace,
        "instances": [dataclasses.asdict(i) | {"usd_per_gpu_hour": i.usd_per_gpu_hour} for i in instances],
    }


def _v(x: Any, unit: str = "", fmt: str = "{:,}") -> str:
    if x is None:
        return "–"
    if isinstance(x, str):
        return x
    return (fmt.format(x) + (f" {unit}" if unit else "")).strip()


def gpu_doc(g: GPU, usable: int, usable_src: str, overhead: Sequence[OverheadItem],
            instances: Sequence[Instance]) -> Doc:
    """One GPU: every figure with a numbered source, the derived figures, the overhead outside
    the allocator and the cloud instances that carry it."""
    s = g.sources
    rows: list[list[str]] = [
        ["capacity", f"{g.capacity / 2**30:,.0f} GiB ({g.capacity:,} B)", s.get("capacity", "")],
        ["memory type", _v(g.memory_type), s.get("memory_type", "")],
        ["bus width", _v(g.bus_width_bits, "bit"), s.get("bus_width_bits", "")],
        ["per-pin rate", _v(g.data_rate_gbps, "Gbps", "{:g}"), s.get("data_rate_gbps", "")],
        ["bandwidth", _v(g.bandwidth / 1e9 if g.bandwidth else None, "GB/s", "{:,.0f}"), s.get("bandwidth", "")],
    ]
    for f, label in _RATES:
        rows.append([label, _v(getattr(g, f), "TFLOPS", "{:,.1f}"), s.get(f, "")])
    rows += [
        ["interconnect", _v(g.interconnect), s.get("interconnect", "")],
        ["interconnect bandwidth", _v(g.interconnect_bw / 1e9 if g.interconnect_bw else None, "GB/s", "{:,.0f}"),
         s.get("interconnect_bw", "")],
        ["PCIe generation", _v(g.pcie_gen), s.get("pcie_gen", "")],
        ["TDP", _v(g.tdp_w, "W"), s.get("tdp_w", "")],
        ["launch date", _v(g.launch_date), s.get("launch_date", "")],
        ["launch price", _v(g.launch_price_usd, "", "${:,.0f}"), s.get("launch_price_usd", "")],
        ["compute capability", _v(g.compute_capability), s.get("compute_capability", "")],
        ["SMs", _v(g.sm_count), s.get("sm_count", "")],
        ["NVENC engines", _v(g.nvenc_engines), s.get("nvenc_engines", "")],
        ["CUDA total (measured)", _v(g.cuda_total / 2**20 if g.cuda_total else None, "MiB", "{:,.0f}"),
         s.get("cuda_total", "")],
        ["nvidia-smi total (measured)", _v(g.smi_total / 2**20 if g.smi_total else None, "MiB", "{:,.0f}"),
         s.get("smi_total", "")],
    ]
    rows = [r for r in rows if r[1] != "–" or r[0] in ("bandwidth", "BF16 dense")]
    refs: dict[str, int] = {}
    for r in rows:
        if r[2]:
            r[2] = f"[{refs.setdefault(r[2], len(refs) + 1)}]"
    doc = Doc(f"{g.name} ({g.key})",
              subtitle=f"{g.vendor} {g.arch}, {g.form_factor or '?'}; aliases: {', '.join(g.aliases) or '–'}")
    doc.add(Table(["figure", "value", "source"], rows, align=["l", "r", "l"]))
    doc.add(Notes([f"[{n}] {text}" for text, n in refs.items()], title="Sources"))
    doc.add(KeyValues([
        ("bandwidth", bandwidth_derivation(g)["text"]),
        ("usable capacity", f"{fmt_bytes(usable, 'GiB')} ({usable:,} B) — {usable_src}"),
    ], title="Derived"))
    total = sum(o.bytes for o in overhead)
    doc.add(Table(["outside the allocator", "MiB", "source"],
                  [[o.name, f"{o.bytes / 2**20:,.0f}", o.source] for o in overhead],
                  footer=["total", f"{total / 2**20:,.0f}", ""], align=["l", "r", "l"]))
    if instances:
        doc.add(Table(["provider", "instance", "GPUs", "$/h", "$/GPU-h", "region", "read"],
                      [[i.provider, i.name, str(i.count), f"{i.usd_per_hour:,.2f}", f"{i.usd_per_gpu_hour:,.2f}",
                        i.region, i.date_read] for i in instances],
                      title="Cloud instances (on demand)", align=["l", "l", "r", "r", "r", "l", "l"]))
    notes = [g.notes] if g.notes else []
    notes.append("GiB = 2^30 B; GB/s = 10^9 B/s. Epoch AI figures: 'Data on Machine Learning Hardware', CC BY 4.0.")
    doc.add(Notes(notes))
    return doc


def _f(x: float | None, fmt: str = "{:,.0f}") -> str:
    return "–" if x is None else fmt.format(x)


def catalog_doc(gpus: Sequence[GPU], *, min_memory: int | None = None, vendor: str | None = None) -> Doc:
    """The catalog list, with the filters that chose it."""
    rows = [[
        g.key, _short_name(g.name), _f(g.capacity / 2**30, "{:,.0f}"), g.memory_type or "–",
        _f(g.peak_bandwidth / 1e9 if g.peak_bandwidth else None), _f(g.bf16_tflops, "{:,.1f}"),
        _short_link(g.interconnect), _f(g.tdp_w), _f(g.launch_price_usd, "${:,.0f}"),
    ] for g in gpus]
    filters = []
    if min_memory:
        filters.append(f"≥ {min_memory / 2**30:,.1f} GiB")
    if vendor:
        filters.append(vendor)
    doc = Doc("GPU catalog", subtitle=f"{len(gpus)} GPUs" + (f" ({', '.join(filters)})" if filters else ""))
    doc.add(Table(["key", "name", "memory GiB", "type", "bandwidth GB/s", "BF16 TFLOPS", "interconnect",
                   "TDP W", "launch price"], rows, align=["l", "l", "r", "l", "r", "r", "l", "r", "r"]))
    doc.add(Notes([
        "Memory in GiB (2^30 B): an '80 GB' card has 80 GiB. Bandwidth in GB/s (10^9 B/s), as stated by the vendor.",
        "BF16: dense tensor TFLOPS (no sparsity); GeForce figures with FP32 accumulate.",
        "`vramplan gpu NAME` shows every figure with its source; `vramplan gpus --local` reads this machine.",
        "Figures from Epoch AI, Data on Machine Learning Hardware (CC BY 4.0), vendor datasheets and "
        "research notes — see DATA_SOURCES.md.",
    ]))
    return doc


def catalog_json(gpus: Sequence[GPU], usable: Sequence[int]) -> dict[str, Any]:
    """``vramplan gpus --json``: every field of each GPU with its usable capacity (bytes)."""
    rows = []
    for g, u in zip(gpus, usable, strict=True):
        d = dataclasses.asdict(g)
        d["aliases"] = list(g.aliases)
        d["sources"] = dict(g.sources)
        rows.append({**d, "usable": u})
    return {"gpus": rows}


def _short_name(name: str) -> str:
    for prefix in ("NVIDIA GeForce ", "NVIDIA Tesla ", "NVIDIA ", "AMD Instinct ", "AMD ", "Intel "):
        if name.startswith(prefix):
            return name[len(prefix):]
    return name


def _short_link(link: str | None) -> str:
    """``NVLink bridge (2 GPUs) / PCIe 4.0 x16`` → ``NVLink bridge``; full text in `vramplan gpu`."""
    if not link:
        return "–"
    return link.split(" / ")[0].split(" (")[0]


def local_json(devices: Sequence[LocalGPU]) -> dict[str, Any]:
    """``vramplan gpus --local --json``."""
    out = []
    for d in devices:
        row = dataclasses.asdict(d)
        row["bandwidth"] = d.bandwidth
        out.append(row)
    return {"local_gpus": out}


def local_doc(devices: Sequence[LocalGPU]) -> Doc:
    """This machine's GPUs as NVML reports them."""
    rows = []
    for d in devices:
        nvlink = "n/a" if d.nvlink_active is None else str(d.nvlink_active)
        pcie = f"{_f(d.pcie_gen_current)}/{_f(d.pcie_gen_max)}"
        rows.append([
            str(d.index), d.name, d.catalog_key or "?", f"{d.total / 2**30:,.2f}", f"{d.free / 2**30:,.2f}",
            f"{d.used / 2**30:,.2f}", _f(d.bus_width_bits), _f(d.max_memory_clock_mhz),
            _f(d.bandwidth / 1e9 if d.bandwidth else None), nvlink, pcie, d.compute_capability or "–",
        ])
    doc = Doc("Local GPUs (NVML)", subtitle=f"driver {devices[0].driver_version or '?'}" if devices else "")
    doc.add(Table(["#", "name", "catalog", "total GiB", "free GiB", "used GiB", "bus bits", "mem MHz",
                   "GB/s", "NVLink", "PCIe cur/max", "CC"], rows,
                  align=["r", "l", "l", "r", "r", "r", "r", "r", "r", "r", "r", "r"]))
    doc.add(Notes([d.bandwidth_formula for d in devices if d.bandwidth is not None] +
                  ["Bandwidth from NVML: bus bits ÷ 8 × max memory clock × 2."]))
    return doc
