"""``vramplan gpus``: list the GPU catalog, or the GPUs of this machine (``--local``)."""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING, Any

from vramplan.cli.common import add_output_args, size_arg

if TYPE_CHECKING:
    from vramplan.hardware.gpu import GPU
    from vramplan.hardware.nvml import LocalGPU
    from vramplan.report.doc import Doc


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "gpus", help="list the GPU catalog (memory, bandwidth, rates, prices) or this machine's GPUs",
        description="List the embedded GPU catalog: memory (GiB = 2^30 B), memory type, stated "
        "bandwidth (GB/s = 10^9 B/s), dense BF16 TFLOPS, interconnect, TDP and launch price. "
        "`vramplan gpu NAME` shows one card with the source of every figure. With --local, read "
        "the GPUs of this machine through NVML instead.",
    )
    p.add_argument("--min-memory", type=size_arg, metavar="SIZE",
                   help="only GPUs with at least this much memory, e.g. 24GB or 80GiB")
    p.add_argument("--vendor", choices=["nvidia", "amd", "intel"], help="only one vendor's GPUs")
    p.add_argument("--local", action="store_true",
                   help="read this machine's GPUs through NVML (needs nvidia-ml-py and a driver)")
    add_output_args(p, plot=False)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from vramplan.report.render import emit

    if args.local:
        from vramplan.hardware.nvml import local_gpus

        devices = local_gpus()
        emit(_local_doc(devices), args.format, sys.stdout, {"local_gpus": [_local_json(d) for d in devices]})
        return 0
    from vramplan.hardware.catalog import list_gpus, usable_capacity

    gpus = list_gpus(min_memory=args.min_memory, vendor=args.vendor)
    rows = [{**_gpu_json(g), "usable": usable_capacity(g)[0]} for g in gpus]
    emit(_catalog_doc(gpus, args), args.format, sys.stdout, {"gpus": rows})
    return 0


def _f(x: float | None, fmt: str = "{:,.0f}") -> str:
    return "–" if x is None else fmt.format(x)


def _catalog_doc(gpus: list[GPU], args: argparse.Namespace) -> Doc:
    from vramplan.report.doc import Doc, Notes, Table

    rows = [[
        g.key, _short_name(g.name), _f(g.capacity / 2**30, "{:,.0f}"), g.memory_type or "–",
        _f(g.peak_bandwidth / 1e9 if g.peak_bandwidth else None), _f(g.bf16_tflops, "{:,.1f}"),
        _short_link(g.interconnect), _f(g.tdp_w), _f(g.launch_price_usd, "${:,.0f}"),
    ] for g in gpus]
    filters = []
    if args.min_memory:
        filters.append(f"≥ {args.min_memory / 2**30:,.1f} GiB")
    if args.vendor:
        filters.append(args.vendor)
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


def _gpu_json(g: GPU) -> dict[str, Any]:
    import dataclasses

    d = dataclasses.asdict(g)
    d["aliases"] = list(g.aliases)
    d["sources"] = dict(g.sources)
    return d


def _local_json(d: LocalGPU) -> dict[str, Any]:
    import dataclasses

    out = dataclasses.asdict(d)
    out["bandwidth"] = d.bandwidth
    return out


def _local_doc(devices: list[LocalGPU]) -> Doc:
    from vramplan.report.doc import Doc, Notes, Table

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
