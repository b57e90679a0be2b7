"""``vramplan web``: the local web page (needs the ``web`` extra: starlette + uvicorn)."""

from __future__ import annotations

import argparse

from .common import hint


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "web", help="a local web page: pick a model and a GPU, move the inputs, watch the memory",
        description="Serve vramplan's page on this machine (nothing leaves it): estimates answer "
        "as the inputs change (analytic at once, then the trace), with fit boundaries, plans, a "
        "GPU comparison and downloads. The page's state is its URL. Needs `pip install 'vramplan[web]'`.",
    )
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8765, help="port (default 8765)")
    p.add_argument("--open", action="store_true", help="open the page in the default browser")
    p.add_argument("--workers", type=int, default=2,
                   help="worker processes for traces and searches (default 2)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from vramplan.errors import VramplanError

    if not 0 < args.port < 65536:
        raise VramplanError(f"--port must be 1-65535, got {args.port}")
    if args.workers < 1:
        raise VramplanError(f"--workers must be positive, got {args.workers}")
    try:
        import uvicorn

        from vramplan.web.app import create_app
    except ImportError as e:
        raise VramplanError(f"the web page needs {e.name or 'starlette and uvicorn'}",
                            hint="pip install 'vramplan[web]'") from None
    import socket
    import sys

    with socket.socket(socket.AF_INET6 if ":" in args.host else socket.AF_INET) as s:
        if hasattr(socket, "SO_REUSEADDR") and sys.platform != "win32":  # as uvicorn binds: a restart is not refused
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # for the last run's connections in TIME_WAIT
        try:
            s.bind((args.host, args.port))
        except OSError as e:
            raise VramplanError(f"cannot listen on {args.host}:{args.port} ({e.strerror or e})",
                                hint="choose another --port") from None
    url = f"http://{'[' + args.host + ']' if ':' in args.host else args.host}:{args.port}/"
    hint(f"vramplan web: {url}  (Ctrl+C to stop)")
    if args.host not in ("127.0.0.1", "localhost", "::1"):
        hint(f"note: listening on {args.host}: anyone who can reach this address can use the page "
             "(there is no authentication)")
    if args.open:
        import threading
        import webbrowser

        threading.Timer(1.0, webbrowser.open, args=(url,)).start()
    app = create_app(workers=args.workers, host=args.host)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    return 0

