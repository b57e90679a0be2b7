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
    from vramplan.report.replay import replay_doc, replay_json

    path = Path(args.file)
    if path.is_dir():
        raise VramplanError(f"cannot read {path}: Is a directory", hint="name an events .jsonl or a snapshot .pickle file")
    if not path.exists():
        raise VramplanError(f"cannot read {path}: no such file")
    if not path.is_file():
        from vramplan.snapshot.reader import check_regular_file

        check_regular_file(path, path.stat(), 0)
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
    emit(replay_doc(path, kind, conf_text, source, args.capacity, res, cmp), args.format, sys.stdout,
         replay_json(path, kind, conf_text, source, args.capacity, res, cmp))
    return 0
