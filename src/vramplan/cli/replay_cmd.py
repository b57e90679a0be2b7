"""``vramplan replay FILE``: run an allocation trace through the caching-allocator simulation.

FILE is a PyTorch memory snapshot (``torch.cuda.memory._dump_snapshot``'s pickle, or the same
dict as JSON, either gzip-compressed or not; read without executing code) or a JSON-lines event
file (``{"action": "alloc", "id": 7, "size": 1048576, "stream": 0}`` / ``{"action": "free", "id": 7}``),
told apart by content, not by name. For a snapshot the simulated segment events and reserved
peak are also compared with the recorded ones.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from .common import add_output_args, size_arg


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "replay", help="simulate PyTorch's caching allocator on a snapshot or event file",
        description="Replay a memory snapshot (pickle or JSON, plain or gzip) or a JSON-lines event "
        "file through the simulated CUDA caching allocator: peak allocated/reserved, segments, "
        "fragmentation, OOMs. Snapshots are also compared with their recorded segment events "
        "and reserved peak.",
    )
    p.add_argument("file", metavar="FILE", help="memory snapshot (pickle or JSON, plain or gzip) "
                   "or JSON-lines event file; the format is read from the content")
    p.add_argument("--alloc-conf", metavar="STRING", default=None,
                   help="PYTORCH_CUDA_ALLOC_CONF to simulate (default: the snapshot's own settings, "
                   "else PyTorch's defaults; the environment variable is not read)")
    p.add_argument("--capacity", type=size_arg, metavar="SIZE", default=None,
                   help="memory the allocator may reserve, e.g. 80GiB (default: unlimited, no OOM)")
    p.add_argument("--device", type=int, default=0, help="device trace of a snapshot (default 0)")
    add_output_args(p, plot=False)
    p.set_defaults(func=run)


def _is_snapshot(path: Path) -> bool:
    from vramplan.errors import VramplanError
    from vramplan.snapshot.reader import is_snapshot

    try:
        with open(path, "rb") as f:
            head = f.read(1 << 16)
    except OSError as e:
        raise VramplanError(f"cannot read {path}: {e.strerror or e}") from None
    return is_snapshot(head)


def run(args: argparse.Namespace) -> int:
    from vramplan.allocator import parse_conf, replay
    from vramplan.errors import VramplanError
    from vramplan.events import EventLog
    from vramplan.report.render import emit

    path = Path(args.file)
    if path.is_dir():
        raise VramplanError(f"cannot read {path}: Is a directory", hint="name an events .jsonl or a snapshot .pickle file")
    if not path.is_file():
        raise VramplanError(f"cannot read {path}: no such file")
    conf = parse_conf(args.alloc_conf) if args.alloc_conf is not None else None
    if _is_snapshot(path):
        from vramplan.snapshot.analyze import pick_device
        from vramplan.snapshot.reader import compare_with_recorded, load_snapshot

        snap = load_snapshot(path)
        pick_device(snap, args.device)  # a device the snapshot has data for
        cmp = compare_with_recorded(snap, conf, device=args.device, capacity=args.capacity)
        res = cmp.result
        conf_text, source = cmp.conf, cmp.conf_source
        kind = "snapshot"
    else:
        log = EventLog.read_jsonl(path)
        cmp = None
        conf_text = conf.text if conf is not None else ""
        source = "--alloc-conf" if conf is not None else "PyTorch defaults"
        res = replay(log, conf, capacity=args.capacity)
        kind = "events"
    obj: dict[str, Any] = {"file": str(path), "kind": kind, **res.to_dict(), "conf": conf_text,
                           "conf_source": source, "capacity": args.capacity}
    if cmp is not None:
        obj["comparison"] = cmp.to_dict()
    emit(_doc(path, kind, conf_text, source, args.capacity, res, cmp), args.format, sys.stdout, obj)
    return 0


def _doc(path: Path, kind: str, conf: str, source: str, capacity: int | None, res: Any, cmp: Any) -> Any:
    from vramplan.report.doc import Doc, KeyValues, Notes
    from vramplan.units import fmt_bytes

    def b(n: int) -> str:
        return f"{fmt_bytes(n, 'GiB', 3)} ({n:,} B)"

    doc = Doc(f"Allocator replay: {path.name}",
              subtitle=f"{kind}, {res.events:,} events, backend {res.backend}; GiB = 2^30 bytes")
    doc.add(KeyValues([
        ("conf", f"{conf or '(defaults)'}  [{source}]"),
        ("capacity", b(capacity) if capacity is not None else "unlimited"),
        ("max_allocated", b(res.max_allocated)),
        ("max_reserved", b(res.max_reserved)),
        ("max_active", b(res.max_active)),
        ("segments", f"{res.segments} at the reserved peak (max {res.max_segments})"),
        ("fragmentation_at_peak", f"{res.fragmentation_at_peak:.1%} (1 − allocated/reserved)"),
        ("alloc_retries", str(res.alloc_retries)),
        ("ooms", str(res.ooms) + (f" (first at event {res.oom_indices[0]})" if res.oom_indices else "")),
    ], title="Simulated"))
    if cmp is not None:
        items = [
            ("verdict", cmp.verdict),
            ("trace", cmp.coverage + (f" ({cmp.allocations_set_aside:,} allocations in those segments "
                                      "left out)" if cmp.reserved_before_recording else "")),
            ("segment events", f"{cmp.matching} of {cmp.recorded_segment_events} recorded match "
                               f"({cmp.simulated_segment_events} simulated)"),
            ("peak reserved", f"recorded {b(cmp.recorded_peak_reserved)}, predicted "
                              f"{b(cmp.simulated_peak_reserved)}"),
            ("final reserved", f"recorded {b(cmp.recorded_final_reserved)}, simulated "
                               f"{b(cmp.simulated_final_reserved)}"),
        ]
        items.append(("final layout", "identical, every block at its recorded address" if cmp.addresses_match
                      else "same blocks (sizes, states) in each segment" if cmp.layout_match else "differs"))
        if cmp.first_mismatch:
            items.append(("first mismatch", cmp.first_mismatch))
        doc.add(KeyValues(items, title="Compared with the recorded trace"))
    notes = list(res.notes) + ([n for n in cmp.notes if n not in res.notes] if cmp is not None else [])
    if notes:
        doc.add(Notes(notes))
    return doc
