"""The local web page's server: a Starlette app (ASGI; served by uvicorn in ``vramplan web``).

Starlette because it is small, typed and well kept (the ASGI toolkit under FastAPI), parses
HTTP, query strings and bodies for us, serves the static page, and ships a ``TestClient``;
the page needs no validation framework on top (its inputs are the Workload's own).

Every ``/api/…`` endpoint answers JSON. The page's state is its query string; the same
string goes to the endpoints:

- ``GET /api/estimate?model=gpt2&batch=4&gpu=rtx-4090&method=analytic`` → exactly what
  ``vramplan estimate gpt2 --batch 4 --gpu rtx-4090 --method analytic --json`` prints;
- ``/api/fit``, ``/api/plan``, ``/api/rank`` → ``vramplan fit``, ``plan`` and
  ``plan --rank-gpus`` ``--json``; ``/api/timeline`` → the data ``--plot`` draws;
- ``/api/download/report|snapshot|emit`` → the JSON report, the predicted snapshot
  (``--snapshot``), the emitted DeepSpeed/Accelerate/FSDP config (``plan --emit``);
- ``/api/serve`` → ``vramplan serve-plan MODEL --gpu G … --json`` (with ``doc=1``, also the
  document the terminal prints, for the page's serving view);
- ``POST /api/config`` checks a dropped config.json (data only, size-limited) and returns it
  encoded for the link.

A user mistake answers 400 ``{"error": <the CLI's one-line message>, "field": <query key>}``,
and so does a request that asks for more work than the page allows (a search over more than
4,096 GPUs, a config.json of 10,000 layers, anything past the time budget of a request);
a request overtaken by a newer one of its kind 409 ``{"stale": true}``; anything else 500
with one line. The analytic method runs in the server process (milliseconds); traces and
searches run in worker processes (:mod:`vramplan.web.jobs`), cancelled when the page that
asked aborts its request.

Only this machine's names reach the server (:class:`Guard`): a ``Host`` other than
127.0.0.1, localhost, [::1] or the ``--host`` given is refused (a DNS-rebinding page cannot
read the API), and so is a POST from another origin or any cross-site request that is not a
navigation.
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import contextlib
import functools
import ipaddress
import re
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from importlib import resources
from typing import Any, TypeVar

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.types import ASGIApp, Receive, Scope, Send

from vramplan.errors import VramplanError
from vramplan.workload import Method

from . import work
from .jobs import DEFAULT_BUDGET_S, Jobs, Stale
from .params import (
    MAX_SEARCH_GPUS,
    FieldError,
    Query,
    field_of,
    fields,
    page_message,
    parse_query,
    read_upload,
    recipe_defaults,
)

Handler = Callable[..., Awaitable[Response]]
T = TypeVar("T")
LOCAL_NAMES = ("127.0.0.1", "localhost", "::1")
"""The Host names the server answers to (plus the ``--host`` given)."""
MAX_QUERY_BYTES = 32 * 1024
"""Longest query string (a link carries a config.json of at most 24 KiB)."""
PAGE_DEFAULTS = {"model": "llama-3.2-1b", "gpu": "rtx-4090", "method": "auto"}
"""What a bare ``/`` shows (the page writes these into its URL, so a link keeps them)."""
BOOT_SLOT = '<script id="boot" type="application/json">{}</script>'

SORTS = ("speed", "cost", "memory")


def _static_dir() -> str:
    return str(resources.files("vramplan.web").joinpath("static"))


class Bug(Exception):
    """An internal error already put in one line (in a worker)."""


def api(fn: Handler) -> Handler:
    """One JSON error contract for every endpoint; the server never crashes on a request."""

    @functools.wraps(fn)
    async def wrapper(*args: Any) -> Response:
        try:
            return await fn(*args)
        except FieldError as e:
            return JSONResponse({"error": str(e), "field": e.field}, status_code=400)
        except VramplanError as e:
            return JSONResponse({"error": page_message(e), "field": field_of(e)}, status_code=400)
        except Stale:
            return JSONResponse({"error": "superseded by a newer request", "stale": True}, status_code=409)
        except Bug as e:
            return JSONResponse({"error": str(e)}, status_code=500)
        except Exception as e:  # a bug in vramplan: one line, logged by nobody, shown to the user
            first = (str(e).strip().splitlines() or [""])[0][:300]
            return JSONResponse({"error": f"internal error ({e.__class__.__name__}: {first})"}, status_code=500)

    return wrapper


def _answer(out: work.Outcome) -> Any:
    if out.ok:
        return out.value
    if out.bug:
        raise Bug(out.error)
    raise FieldError(out.error or "error", field=out.field)


class Server:
    """The endpoints, over one :class:`Jobs` pool and one analytic cache."""

    def __init__(self, jobs: Jobs) -> None:
        self.jobs = jobs

    # ------------------------------------------------------------------ computing
    async def here(self, key: str, fn: Callable[..., work.Outcome], *args: Any) -> Any:
        """A computation of milliseconds (analytic), in this process, cached."""
        hit = self.jobs.cached(key)
        if hit is None:
            hit = await run_in_threadpool(fn, *args)
            self.jobs.remember(key, hit)
        return _answer(hit)

    async def report(self, q: Query, request: Request | None = None) -> Any:
        """The MemoryReport: analytic in this process, trace/auto in a worker."""
        key = q.key(kind="estimate")
        if q.method is Method.ANALYTIC:
            return await self.here(key, work.estimate, q)
        return _answer(await _while_connected(request, self.jobs.run("trace", key, work.estimate, q)))

    async def search(self, kind: str, q: Query, opts: dict[str, Any], request: Request | None = None) -> Any:
        fns: dict[str, Callable[..., work.Outcome]] = {"fit": work.fit, "plan": work.plan, "rank": work.rank}
        fn = fns[kind]
        args: tuple[Any, ...] = (q,) if kind == "fit" else (q, opts)
        key = q.key(kind=kind, **opts)
        if q.method is Method.ANALYTIC and kind == "fit":  # milliseconds: no worker needed
            return await self.here(key, fn, *args)
        return _answer(await _while_connected(request, self.jobs.run(kind, key, fn, *args)))

    # ------------------------------------------------------------------ endpoints
    @api
    async def index(self, request: Request) -> Response:
        """The page, with its boot data inline: defaults, catalog, and the analytic answer (or
        the error) for this very URL — the first answer needs no further round trip."""
        import json

        first: dict[str, Any] | None
        try:
            q = parse_query({**PAGE_DEFAULTS, **request.query_params}, method="analytic")
            first = {"status": 200, "body": (await self.report(q)).to_dict()}
        except FieldError as e:
            first = {"status": 400, "body": {"error": str(e), "field": e.field}}
        except VramplanError as e:
            first = {"status": 400, "body": {"error": page_message(e), "field": field_of(e)}}
        except Exception:  # the page still loads; its own request will show the error
            first = None
        boot = {"defaults": PAGE_DEFAULTS, "catalog": catalog_body(), "first": first}
        text = json.dumps(boot, separators=(",", ":")).replace("</", "<\\/")
        html = _page().replace(BOOT_SLOT, f'<script id="boot" type="application/json">{text}</script>', 1)
        return HTMLResponse(html, headers={"Cache-Control": "no-cache"})

    @api
    async def status(self, request: Request) -> Response:
        return JSONResponse(self.jobs.status())

    @api
    async def catalog(self, request: Request) -> Response:
        return JSONResponse(catalog_body())

    @api
    async def estimate(self, request: Request) -> Response:
        q = parse_query(request.query_params)
        return JSONResponse((await self.report(q, request)).to_dict())

    @api
    async def timeline(self, request: Request) -> Response:
        from vramplan.report.web import timeline_json

        q = parse_query(request.query_params)
        return JSONResponse(timeline_json(await self.report(q, request)))

    @api
    async def fit(self, request: Request) -> Response:
        q = parse_query(request.query_params, method=request.query_params.get("method") or "analytic")
        return JSONResponse((await self.search("fit", q, {}, request)).to_dict())

    @api
    async def plan(self, request: Request) -> Response:
        q = parse_query(request.query_params, method=request.query_params.get("method") or "analytic")
        return JSONResponse((await self.search("plan", q, search_options(request.query_params), request)).to_dict())

    @api
    async def rank(self, request: Request) -> Response:
        q = parse_query(request.query_params, method=request.query_params.get("method") or "analytic")
        return JSONResponse((await self.search("rank", q, search_options(request.query_params), request)).to_dict())

    @api
    async def serve(self, request: Request) -> Response:
        """``vramplan serve-plan --json``; with ``doc=1`` also the terminal's document of it."""
        from vramplan.report.serving import to_doc
        from vramplan.report.web import doc_json

        p = request.query_params
        q = parse_query({k: p[k] for k in ("model", "config", "gpu", "tp", "pp") if k in p}, method="analytic")
        opts = serve_options(p)
        plan = await self.here(q.key(kind="serve", **opts), work.serve, q, opts)
        body = plan.to_dict()
        if p.get("doc"):
            body = {**body, "doc": doc_json(to_doc(plan))}
        return JSONResponse(body)

    @api
    async def download_report(self, request: Request) -> Response:
        import json

        q = parse_query(request.query_params)
        text = json.dumps((await self.report(q, request)).to_dict(), indent=2) + "\n"
        return _attachment(text.encode(), f"vramplan-{_slug(q.model)}.json", "application/json")

    @api
    async def download_snapshot(self, request: Request) -> Response:
        q = parse_query(request.query_params, method="trace")
        data = _answer(await _while_connected(request, self.jobs.run("snapshot", q.key(kind="snapshot"), work.snapshot, q)))
        return _attachment(data, f"vramplan-{_slug(q.model)}-predicted.pickle", "application/octet-stream")

    @api
    async def download_emit(self, request: Request) -> Response:
        from vramplan.planner.emit import emit

        p = request.query_params
        fmt = p.get("fmt", "")
        if fmt not in emit_formats():
            raise FieldError(f"unknown --emit format {fmt!r}", field="fmt", hint=f"choose one of {', '.join(emit_formats())}")
        view = p.get("view", "plan")
        if view not in ("plan", "rank"):
            raise FieldError(f"unknown view {view!r}", field="view", hint="plan or rank")
        pick = _int(p, "pick", 1, minimum=1)
        q = parse_query(p, method=p.get("method") or "analytic")
        result = await self.search(view, q, search_options(p), request)
        plans = list(result.plans) if view == "plan" else [r.plan for r in result.ranked]
        if pick > len(plans):
            raise FieldError(f"--pick {pick}: there are only {len(plans)} plan(s)", field="pick")
        out = emit(plans[pick - 1], fmt)
        return _attachment(out.text.encode(), out.filename, "text/plain; charset=utf-8")

    @api
    async def upload_config(self, request: Request) -> Response:
        from .params import MAX_CONFIG_BYTES, encode_config

        name = _safe_name(request.query_params.get("name") or "config.json")
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > MAX_CONFIG_BYTES:
            raise FieldError(f"{name} is {int(declared):,} bytes; the page accepts up to {MAX_CONFIG_BYTES:,}",
                             field="config", hint="a transformers config.json is a few KiB: check the file")
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > MAX_CONFIG_BYTES:
                break
        text, spec = read_upload(bytes(body), name)
        return JSONResponse({"config": encode_config(text), "name": name, "family": str(spec.family),
                             "params": spec.params, "model_type": spec.model_type})


@functools.cache
def catalog_body() -> dict[str, Any]:
    """The pickers' data: catalog models and GPUs, the workload fields, category colours."""
    from vramplan.hardware.catalog import list_gpus, usable_capacity
    from vramplan.models.catalog import list_models
    from vramplan.report.web import catalog_json, legend_json

    gpus = list_gpus()
    body = catalog_json(list_models(), gpus, {g.key: usable_capacity(g)[0] for g in gpus})
    body["fields"] = [{"key": f.key, "kind": f.kind, "default": f.default, "choices": list(f.choices),
                       "parallel": f.parallel, "doc": f.doc} for f in fields()]
    body["recipes"] = recipe_defaults()
    body["legend"] = legend_json()
    body["emit_formats"] = list(emit_formats())
    body["serve"] = serve_choices()
    return body


def emit_formats() -> tuple[str, ...]:
    """Every format ``vramplan plan --emit`` writes (the page offers each one per plan)."""
    from vramplan.planner.emit import FORMATS

    return tuple(FORMATS)


def serve_choices() -> dict[str, Any]:
    """The serving view's pickers: ``vramplan serve-plan``'s choices. ``engine_versions``: per engine,
    the releases whose sizing was read (newest first, the default; TensorRT-LLM follows one, none)."""
    from vramplan.pools import sglang_release, tgi_release, vllm_release
    from vramplan.serving.api import ENGINES, FRACTION_NAME

    read = {"vllm": vllm_release.RELEASES, "sglang": sglang_release.RELEASES, "tgi": tgi_release.RELEASES}

    return {"engines": list(ENGINES), "fraction_names": dict(FRACTION_NAME),
            "quantization": ["none", "fp8", "awq", "gptq", "bitsandbytes", "mxfp4"],
            "kv_cache_dtype": ["auto", "fp8", "fp8_e4m3", "fp8_e5m2"],
            "spec_methods": ["none", "eagle", "eagle3", "deepseek_mtp", "ngram"],
            "engine_versions": {e: list(read.get(e, ())) for e in ENGINES}}


@functools.cache
def _page() -> str:
    """index.html with style.css and app.js inlined: one response carries the whole page
    (the files are also served under /static/, as they ship in the package)."""
    d = _static_dir()

    def read(name: str) -> str:
        with open(f"{d}/{name}", encoding="utf-8") as f:
            return f.read()

    html = read("index.html")
    css, js = read("style.css"), read("app.js").replace("</script", "<\\/script")
    html = html.replace('<link rel="stylesheet" href="/static/style.css">', f"<style>\n{css}</style>", 1)
    return html.replace('<script src="/static/app.js" defer></script>', f"<script>\n{js}</script>", 1)


def search_options(p: Mapping[str, str]) -> dict[str, Any]:
    """``vramplan plan``'s search flags, checked as the CLI checks them."""
    opts: dict[str, Any] = {}
    if p.get("gpus"):
        opts["gpus"] = _int(p, "gpus", 1, minimum=1)
        if opts["gpus"] > MAX_SEARCH_GPUS:
            raise FieldError(f"--gpus {opts['gpus']:,}: the page searches up to {MAX_SEARCH_GPUS:,} GPUs", field="gpus",
                             hint="`vramplan plan` in a terminal has no such limit")
    if p.get("global-batch"):
        opts["global_batch"] = _int(p, "global-batch", 1, minimum=1)
    if p.get("budget"):
        try:
            b = float(p["budget"])
        except ValueError:
            raise FieldError(f"--budget must be a number of dollars per hour, got {p['budget']!r}", field="budget") from None
        if not b > 0:
            raise FieldError(f"--budget must be a positive number of dollars per hour, got {p['budget']}", field="budget")
        opts["budget"] = b
    if p.get("allow-peft", "").lower() in ("1", "true", "on", "yes"):
        opts["allow_peft"] = True
    if p.get("sort"):
        if p["sort"] not in SORTS:
            raise FieldError(f"invalid sort {p['sort']!r}", field="sort", hint=f"choose one of {' | '.join(SORTS)}")
        opts["sort"] = p["sort"]
    return opts


def serve_options(p: Mapping[str, str]) -> dict[str, Any]:
    """``vramplan serve-plan``'s engine settings from the query (engine defaults when absent; the
    engine is ``serve-engine``: ``engine`` is the parallel layout's framework)."""
    opts: dict[str, Any] = {"engine": (p.get("serve-engine") or "vllm").strip().lower()}
    for key, name in (("max-model-len", "max_model_len"), ("max-num-seqs", "max_num_seqs"),
                      ("max-num-batched-tokens", "max_num_batched_tokens"), ("block-size", "block_size"),
                      ("avg-request-len", "avg_request_len")):
        if p.get(key):
            opts[name] = _int(p, key, 1, minimum=1)
    for key, name, what, hint in (("memory-fraction", "memory_fraction", "a number", "e.g. 0.9 for 90 % of the GPU"),
                                  ("kv-offloading-size", "kv_offloading_size", "a number of GiB", "e.g. 16")):
        if p.get(key):
            try:
                opts[name] = float(p[key])
            except ValueError:
                raise FieldError(f"--{key} must be {what}, got {p[key]!r}", field=key, hint=hint) from None
    for key, name in (("kv-cache-dtype", "kv_cache_dtype"), ("quantization", "quantization")):
        if p.get(key):
            opts[name] = p[key].strip()
    method = (p.get("spec-method") or "").strip().lower()
    if method and method != "none":  # (the page's speculative decoding: no head config, the target's layer shape)
        opts["speculative_config"] = {"method": method, "num_speculative_tokens": _int(p, "spec-tokens", 3, minimum=1)}
    if p.get("engine-version"):  # (the chosen engine's release; TensorRT-LLM refuses one, as the CLI does)
        opts["engine_version"] = p["engine-version"].strip()
    limits = {m: _int(p, f"limit-{m}s", 0, minimum=0) for m in ("image", "video") if p.get(f"limit-{m}s")}
    if limits:
        opts["limit_mm_per_prompt"] = limits
    return opts


def _int(p: Mapping[str, str], key: str, default: int, *, minimum: int) -> int:
    raw = p.get(key)
    if raw is None or raw == "":
        return default
    try:
        v = int(raw)
    except ValueError:
        raise FieldError(f"--{key} must be an integer, got {raw!r}", field=key) from None
    if v < minimum:
        raise FieldError(f"--{key} must be positive, got {v}", field=key)
    from .params import MAX_INT

    if v > MAX_INT:
        raise FieldError(f"--{key} {raw[:20]} is too large", field=key, hint=f"at most {MAX_INT:,}")
    return v


async def _while_connected(request: Request | None, job: Awaitable[T]) -> T:
    """Await ``job``, cancelling it when the client goes away: the page aborts a request when
    its user changes an input, and the work for the old inputs should stop (:mod:`.jobs`)."""
    task = asyncio.ensure_future(job)
    if request is None:
        return await task
    gone = asyncio.ensure_future(_disconnected(request.receive))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        raise
    finally:
        gone.cancel()
    if not task.done():
        task.cancel()
        raise Stale("client gone")
    return task.result()


async def _disconnected(receive: Receive) -> None:
    """Until the client closes the connection (a GET has no body to read first)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


def _slug(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "-", name).strip("-") or "model"


def _safe_name(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._ -]+", "", name.rsplit("/", 1)[-1])[:80] or "config.json"


def _attachment(data: bytes, filename: str, media: str) -> Response:
    return Response(data, media_type=media,
                    headers={"Content-Disposition": f'attachment; filename="{_slug(filename)}"'})


class Guard:
    """ASGI middleware: only this machine's pages reach the API.

    - ``Host`` must name this machine (127.0.0.1, localhost, [::1], or the ``--host`` given;
      any IP address when listening on all of them): a DNS-rebinding page's requests carry
      its own domain name and are refused, so it can neither read answers nor post configs;
    - a POST must come from the page's own origin (``Origin`` equal to the ``Host``);
    - a cross-site request that is not a navigation (another site's script or image asking
      for a trace) is refused, so no other page can spend this machine's CPU;
    - a query string longer than :data:`MAX_QUERY_BYTES` is refused before it is parsed.

    Refusals answer ``{"error": <one line>, "field": null}``: 400 for a bad Host or size, 403
    for a foreign origin."""

    def __init__(self, app: ASGIApp, host: str | None = None) -> None:
        self.app = app
        self.names, self.any_ip = allowed_hosts(host)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            refused = self.check(scope)
            if refused is not None:
                status, message = refused
                await JSONResponse({"error": message, "field": None}, status_code=status)(scope, receive, send)
                return
        await self.app(scope, receive, send)

    def check(self, scope: Scope) -> tuple[int, str] | None:
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        host = headers.get("host")
        if host is not None and not self.allowed(host):
            return 400, (f"this server answers only to {', '.join(self._shown())}, not to the host {host[:80]!r} "
                         "(open the page at http://127.0.0.1:PORT/, or start `vramplan web --host NAME`)")
        method = scope.get("method", "GET")
        origin = headers.get("origin")
        if method not in ("GET", "HEAD") and origin is not None and origin.rstrip("/") != f"{scope.get('scheme', 'http')}://{host}":
            return 403, f"refused: a {method} from another origin ({origin[:80]}); the page posts from its own"
        if headers.get("sec-fetch-site") == "cross-site" and headers.get("sec-fetch-mode", "navigate") != "navigate":
            return 403, "refused: a request from another site (only this page, or a link opened, reaches the API)"
        if len(scope.get("query_string", b"")) > MAX_QUERY_BYTES:
            return 400, f"the address is too long (more than {MAX_QUERY_BYTES:,} bytes of query)"
        return None

    def allowed(self, host: str) -> bool:
        name = _host_name(host)
        if name in self.names:
            return True
        if self.any_ip:
            try:
                ipaddress.ip_address(name)
            except ValueError:
                return False
            return True
        return False

    def _shown(self) -> list[str]:
        return [f"[{n}]" if ":" in n else n for n in sorted(self.names)] + (["any IP address"] if self.any_ip else [])


def allowed_hosts(host: str | None) -> tuple[frozenset[str], bool]:
    """The Host names the server answers to, and whether any IP address is one (when it
    listens on all addresses: ``--host 0.0.0.0`` or ``::``, where the machine's own names count too)."""
    import socket

    names = set(LOCAL_NAMES)
    any_ip = False
    if host:
        h = _host_name(host)
        if h in ("0.0.0.0", "::", ""):
            any_ip = True
            names |= {socket.gethostname().lower(), socket.getfqdn().lower()}
        else:
            names.add(h)
    return frozenset(names), any_ip


def _host_name(host: str) -> str:
    """``[::1]:8765`` → ``::1``; ``LocalHost.:8765`` → ``localhost``."""
    h = host.strip().lower()
    if h.startswith("["):
        h = h[1:].split("]", 1)[0]
    elif h.count(":") == 1:
        h = h.rsplit(":", 1)[0]
    return h.rstrip(".")


def create_app(*, executor: cf.Executor | None = None, workers: int = 2, warm: bool = True,
               host: str | None = None, budget_s: float = DEFAULT_BUDGET_S) -> Starlette:
    """The ASGI app. ``executor``: where traces and searches run (default: ``workers`` worker
    processes); ``warm``: at start-up, run one analytic estimate here and start the workers;
    ``host``: the address it listens on (a Host name it answers to, besides this machine's
    loopback names); ``budget_s``: the seconds of work one request may cost."""
    jobs = Jobs(executor, workers=workers, budget_s=budget_s)
    s = Server(jobs)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        if warm:
            await asyncio.get_running_loop().run_in_executor(None, _warm_here)
            jobs.warm(work.warm)
        try:
            yield
        finally:
            jobs.close()

    routes = [
        Route("/", s.index),
        Route("/api/status", s.status),
        Route("/api/catalog", s.catalog),
        Route("/api/estimate", s.estimate),
        Route("/api/timeline", s.timeline),
        Route("/api/fit", s.fit),
        Route("/api/plan", s.plan),
        Route("/api/rank", s.rank),
        Route("/api/serve", s.serve),
        Route("/api/config", s.upload_config, methods=["POST"]),
        Route("/api/download/report", s.download_report),
        Route("/api/download/snapshot", s.download_snapshot),
        Route("/api/download/emit", s.download_emit),
        Mount("/static", StaticFiles(directory=_static_dir()), name="static"),
    ]
    app = Starlette(routes=routes, lifespan=lifespan)
    app.add_middleware(Guard, host=host)
    app.state.jobs = jobs
    return app


def _warm_here() -> None:
    """The first analytic answer should not pay for imports and catalog parsing."""
    from vramplan.hardware.catalog import list_gpus
    from vramplan.models.catalog import list_models
    from vramplan.report.web import timeline_json
    from vramplan.workload import Workload

    list_gpus()
    list_models()
    catalog_body()
    q = Query(model="llama-3.1-8b", workload=Workload(), gpu="h100-sxm", method=Method.ANALYTIC)
    out = work.estimate(q)
    if out.ok:
        out.value.to_dict()
        timeline_json(out.value)
