"""``vramplan gpu NAME``: one catalog GPU, every figure with its source."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from typing import TYPE_CHECKING, Any

from vramplan.cli.common import add_output_args

if TYPE_CHECKING:
    from vramplan.hardware.gpu import GPU
    from vramplan.report.doc import Doc

_RATES = (("bf16_tflops", "BF16 dense"), ("fp16_tflops", "FP16 dense"), ("fp8_tflops", "FP8 dense"),
          ("tf32_tflops", "TF32 dense"), ("fp32_tflops", "FP32"))


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "gpu", help="show one GPU: every figure with its source, bandwidth derivation, usable memory",
        description="Show one catalog GPU (key, alias or name: h100, a100-80gb, rtx-4090, 4090): "
        "every figure with its source, the bandwidth derived from bus width and per-pin rate "
        "next to the stated one, the usable capacity with its source, the memory the CUDA "
        "context and libraries take, and cloud instances that carry it.",
    )
    p.add_argument("name", metavar="NAME", help="GPU key or alias (see `vramplan gpus`)")
    p.add_argument("--world-size", type=int, default=1,
                   help="ranks for the NCCL part of the overhead (default 1: none)")
    add_output_args(p, plot=False)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from vramplan.hardware.catalog import get_gpu, usable_capacity
    from vramplan.hardware.overhead import cublas_workspace_bytes, device_overhead
    from vramplan.hardware.prices import list_instances
    from vramplan.report.render import emit

    g = get_gpu(args.name)
    usable, usable_src = usable_capacity(g)
    overhead = device_overhead(g, world_size=args.world_size)
    instances = list_instances(gpu=g.key)
    derivation = bandwidth_derivation(g)
    data: dict[str, Any] = {
        **{k: v for k, v in dataclasses.asdict(g).items() if k != "sources"},
        "aliases": list(g.aliases),
        "sources": dict(g.sources),
        "usable": usable,
        "usable_source": usable_src,
        "bandwidth_derivation": derivation,
        "overhead": [dataclasses.asdict(o) for o in overhead],
        "cublas_workspace": cublas_workspace_bytes(g),
        "instances": [dataclasses.asdict(i) | {"usd_per_gpu_hour": i.usd_per_gpu_hour} for i in instances],
    }
    emit(_doc(g, usable, usable_src, derivation, overhead, instances), args.format, sys.stdout, data)
    return 0


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


def _v(x: Any, unit: str = "", fmt: str = "{:,}") -> str:
    if x is None:
        return "–"
    if isinstance(x, str):
        return x
    return (fmt.format(x) + (f" {unit}" if unit else "")).strip()


def _doc(g: GPU, usable: int, usable_src: str, derivation: dict[str, Any], overhead: Any,
         instances: Any) -> Doc:
    from vramplan.report.doc import Doc, KeyValues, Notes, Table
    from vramplan.units import fmt_bytes

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
        ("bandwidth", derivation["text"]),
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
