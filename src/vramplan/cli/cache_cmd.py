"""``vramplan cache``: what the on-disk store of traces and replays holds, and clearing it."""

from __future__ import annotations

import argparse
import json
import sys


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "cache", help="show or clear the on-disk store of traces and replays",
        description="Traces and allocator replays are stored on disk so that the next question about "
        "the same model (another batch, `fit` after `estimate`) answers without tracing again. Keys "
        "hold everything a result depends on, vramplan's, torch's, transformers' and peft's versions "
        "included. Folder: $VRAMPLAN_CACHE_DIR, else $XDG_CACHE_HOME/vramplan, else ~/.cache/vramplan; "
        "bound: $VRAMPLAN_CACHE_MAX (default 2GiB); off: $VRAMPLAN_NO_CACHE=1 or --no-cache.",
    )
    p.add_argument("action", nargs="?", choices=["info", "clear", "path"], default="info",
                   help="info (default): folder, files and bytes by kind; clear: delete every file; "
                   "path: print the folder")
    p.add_argument("--format", choices=["table", "json"], default="table", help="output format (default: table)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ..engine.store import Store, off
    from ..units import fmt_bytes

    store = Store()
    if args.action == "path":
        print(store.root.parent)
        return 0
    if args.action == "clear":
        freed = store.clear()
        print(f"cleared {store.root.parent}: {fmt_bytes(freed, 'MiB')} freed")
        return 0
    info = store.info()
    if args.format == "json":
        json.dump({"directory": str(info.directory), "entries": info.entries, "bytes": info.bytes,
                   "max_bytes": info.max_bytes, "enabled": not off(),
                   "kinds": {k: {"entries": n, "bytes": b} for k, n, b in info.by_kind}}, sys.stdout, indent=2)
        print()
        return 0
    state = "off: VRAMPLAN_NO_CACHE is set, nothing is read or written" if off() else "on"
    if not off():
        try:
            store.root.mkdir(parents=True, exist_ok=True)
        except OSError as e:  # (a trace then simply stores nothing: say why here)
            state = f"on, but nothing can be stored: {e.strerror or e}"
    print(f"store: {info.directory} ({state})")
    print(f"holds {info.entries:,} file(s), {fmt_bytes(info.bytes, 'MiB')} of at most {fmt_bytes(info.max_bytes, 'GiB')}")
    for kind, n, b in info.by_kind:
        print(f"  {kind:<8} {n:>6,} file(s) {fmt_bytes(b, 'MiB'):>12}")
    return 0
