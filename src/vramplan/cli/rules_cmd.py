"""``vramplan rules {bandwidth,render,video,array}``: GPU memory rules beyond deep learning."""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

from vramplan.cli.common import _FormatAction, size_arg

if TYPE_CHECKING:
    from vramplan.hardware.rules import RuleResult

OUTPUT_FORMATS = ("table", "json", "markdown")
COLOR_FORMATS = ("rgba8", "bgra8", "rgb10a2", "r11g11b10f", "rgba16f", "rgba32f")  # = rules.COLOR_FORMATS


def _count(text: str) -> int:
    """``10M`` / ``2.5k`` / ``1000000`` → an integer count."""
    t = text.strip().lower().replace(",", "").replace("_", "")
    mult = {"k": 10**3, "m": 10**6, "g": 10**9, "b": 10**9}.get(t[-1:], 1)
    try:
        value = float(t[:-1] if mult > 1 else t)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid count {text!r} (write e.g. 10M or 2500000)") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"invalid count {text!r}: must not be negative")
    return int(round(value * mult))


def _output(p: argparse.ArgumentParser, *, format_flag: bool = True) -> None:
    g = p.add_argument_group("output")
    if format_flag:
        g.add_argument("--format", choices=OUTPUT_FORMATS, default="table", action=_FormatAction,
                       help="report format (default: table)")
    g.add_argument("--json", action=_FormatAction, const="json", dest="format", nargs=0,
                   help="same as --format json (integer bytes, floats)")


class _RenderFormat(argparse.Action):
    """``--format`` of ``rules render`` takes a pixel format (rgba8…) or an output format (json…)."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: object, option_string: str | None = None) -> None:
        v = str(values).lower()
        if v in OUTPUT_FORMATS:  # as the other commands' --format: --json --format markdown contradict
            _FormatAction(self.option_strings, self.dest)(parser, namespace, v, option_string)
        elif v in COLOR_FORMATS:
            namespace.color_format = v
        else:
            parser.error(f"argument --format: invalid choice {values!r} "
                         f"(pixel: {', '.join(COLOR_FORMATS)}; output: {', '.join(OUTPUT_FORMATS)})")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "rules", help="rules beyond deep learning: bandwidth, render buffers, NVENC sessions, big arrays",
        description="Closed-form GPU memory rules, each printed with its formula and the numbers "
        "filled in: memory bandwidth from bus width and per-pin rate; frame buffers, MSAA, depth, "
        "textures and ray-tracing BVH for rendering; concurrent NVENC encode sessions; whether a "
        "large array fits.",
    )
    rs = p.add_subparsers(dest="rule", metavar="RULE", parser_class=type(p))

    b = rs.add_parser("bandwidth", help="GB/s from bus width and per-pin data rate",
                      description="Peak bandwidth = bus bits × per-pin Gbps ÷ 8 (no ×2: the per-pin rate "
                      "already counts both clock edges); effective = peak × controller efficiency.")
    b.add_argument("--bus", dest="bus_bits", type=int, required=True, help="memory bus width in bits, e.g. 384")
    rate = b.add_mutually_exclusive_group(required=True)
    rate.add_argument("--rate", dest="rate_gbps", type=float, help="per-pin data rate in Gbit/s, e.g. 21")
    rate.add_argument("--clock-mhz", type=float, help="memory clock as NVML reports it (rate = 2 × clock)")
    b.add_argument("--efficiency", type=float, default=1.0,
                   help="fraction of peak a memory controller reaches, e.g. 0.9 (default 1)")
    _output(b)
    b.set_defaults(func=run_bandwidth)

    r = rs.add_parser("render", help="frame buffers, depth, MSAA, textures, BVH and frame-write traffic",
                      description="Memory of a renderer's targets and assets, and the frame-write traffic at "
                      "a frame rate against the GPU's bandwidth. --format takes a pixel format "
                      f"({', '.join(COLOR_FORMATS)}) or an output format (table, json, markdown).")
    r.add_argument("--width", type=int, required=True)
    r.add_argument("--height", type=int, required=True)
    r.add_argument("--format", action=_RenderFormat, metavar="FORMAT", dest="format",
                   help="pixel format (default rgba8) or output format (default table)")
    r.add_argument("--color-format", choices=COLOR_FORMATS, default="rgba8", help=argparse.SUPPRESS)
    r.add_argument("--buffers", type=int, default=3, help="swap-chain images (default 3)")
    r.add_argument("--msaa", type=int, default=1, help="samples per pixel: 1, 2, 4, 8, 16 (default 1)")
    r.add_argument("--depth", default="d32", help="depth format: none, d16, d24s8, d32, d32s8 (default d32)")
    r.add_argument("--textures", type=size_arg, default=0, metavar="SIZE", help="texture memory, e.g. 4GiB")
    r.add_argument("--bvh-triangles", type=_count, default=0, metavar="N", help="ray-traced triangles, e.g. 10M")
    r.add_argument("--bvh-bytes-per-triangle", type=float, default=None,
                   help="BVH bytes per triangle (default 64, an assumption)")
    r.add_argument("--fps", type=float, default=60.0, help="frames per second (default 60)")
    r.add_argument("--gpu", help="catalog GPU to compare memory and bandwidth with")
    _output(r, format_flag=False)
    r.set_defaults(func=run_render, format="table")

    v = rs.add_parser("video", help="concurrent NVENC encode sessions on a GPU",
                      description="NVENC sessions: the GeForce driver cap (8 per system) against data-centre "
                      "GPUs (no cap), NVENC engines, and memory per session at a resolution.")
    v.add_argument("--codec", required=True, choices=["h264", "hevc", "av1"])
    v.add_argument("--gpu", required=True, help="catalog GPU, e.g. l4 or rtx-4090")
    v.add_argument("--width", type=int, default=1920, help="frame width in pixels (default 1920)")
    v.add_argument("--height", type=int, default=1080, help="frame height in pixels (default 1080)")
    v.add_argument("--bit-depth", type=int, default=8, choices=[8, 10], help="bits per sample (default 8)")
    v.add_argument("--b-frames", type=int, default=0, help="B-frames (more input surfaces; default 0)")
    _output(v)
    v.set_defaults(func=run_video)

    a = rs.add_parser("array", help="does a large array (× working set) fit on a GPU",
                      description="Bytes = product of the shape × dtype size; needed = bytes × working-set "
                      "factor; compared with the GPU's usable memory minus the CUDA context.")
    a.add_argument("--shape", required=True, help="dimensions, e.g. 4096,4096,4096")
    a.add_argument("--dtype", default="float32", help="float64, float32, float16, bfloat16, int8, … (default float32)")
    a.add_argument("--working-set", type=float, default=1.0,
                   help="arrays of this size alive at once (inputs, outputs, temporaries; default 1)")
    a.add_argument("--gpu", help="catalog GPU to check the fit against")
    _output(a)
    a.set_defaults(func=run_array)

    p.set_defaults(func=_no_rule, rules_parser=p)


def _no_rule(args: argparse.Namespace) -> int:
    args.rules_parser.print_help(sys.stderr)
    return 2


def _emit(result: RuleResult, fmt: str) -> int:
    from vramplan.report.render import emit
    from vramplan.report.rules import rule_doc

    emit(rule_doc(result), fmt, sys.stdout, result.to_dict())
    return 0


def run_bandwidth(args: argparse.Namespace) -> int:
    from vramplan.hardware.rules import bandwidth

    return _emit(bandwidth(args.bus_bits, args.rate_gbps, clock_mhz=args.clock_mhz, efficiency=args.efficiency), args.format)


def run_render(args: argparse.Namespace) -> int:
    from vramplan.hardware.rules import BVH_BYTES_PER_TRIANGLE, render

    bpt = BVH_BYTES_PER_TRIANGLE if args.bvh_bytes_per_triangle is None else args.bvh_bytes_per_triangle
    result = render(args.width, args.height, color_format=args.color_format, buffers=args.buffers,
                    msaa=args.msaa, depth=args.depth, textures=args.textures, bvh_triangles=args.bvh_triangles,
                    bvh_bytes_per_triangle=bpt, fps=args.fps, gpu=args.gpu)
    return _emit(result, args.format)


def run_video(args: argparse.Namespace) -> int:
    from vramplan.hardware.rules import video

    return _emit(video(args.codec, args.gpu, width=args.width, height=args.height, bit_depth=args.bit_depth,
                       b_frames=args.b_frames), args.format)


def run_array(args: argparse.Namespace) -> int:
    from vramplan.hardware.rules import array

    return _emit(array(args.shape, args.dtype, working_set=args.working_set, gpu=args.gpu), args.format)
