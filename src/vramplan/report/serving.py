"""Doc builders and the plot for serving plans (``vramplan serve-plan``).

Sizes in GiB (2^30 bytes) per GPU; JSON is the plan's own ``to_dict()`` (integer bytes).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from vramplan.pools.result import ServePlan
from vramplan.serving.api import FRACTION_NAME, Option
from vramplan.units import GiB

from .doc import Doc, KeyValues, Notes, Table
from .plot import PlotData, _cycle, _mem_axis, _new_figure, _save, _styled, _unit, check_plot_path

ENGINE_NAMES = {"vllm": "vLLM", "sglang": "SGLang", "tgi": "TGI", "trtllm": "TensorRT-LLM"}


def _gib(n: float) -> str:
    return f"{n / GiB:,.2f}"


def _x(v: float | None) -> str:
    return "–" if v is None else f"{v:,.2f}×"


def to_doc(p: ServePlan) -> Doc:
    name = ENGINE_NAMES.get(p.engine, p.engine)
    gpus = f"{p.tp}× " if p.gpus == 1 else f"{p.gpus}× "
    doc = Doc(title=f"Serving plan: {p.model} on {gpus}{p.gpu} with {name} {p.engine_version}"
              + ("" if p.starts else " — DOES NOT START"),
              subtitle=f"per GPU ({_layout(p)}); GiB = 2^30 bytes; profile forward: {p.profile_method}")
    graphs = "inside" if p.cuda_graph_in_budget else "outside the budget"
    if p.cuda_graph_estimate:
        graphs = f"inside: {_gib(p.cuda_graph_estimate)} GiB estimated and taken from the budget"
    elif p.kv_reserve:
        graphs = "inside: measured"
    pool, pool_note, graph = _gib(p.kv_pool), f"{p.blocks:,} blocks × {p.block_size} tokens", _gib(p.cuda_graph)
    if not p.starts and not p.kv_pool:  # vLLM: stopped by its check, before the pool and the graphs
        pool, pool_note = "–", f"not allocated: {name} stops first ({p.blocks:,} blocks × {p.block_size} tokens would fit)"
        if not p.cuda_graph and not p.settings.get("enforce_eager"):
            graph, graphs = "–", f"not captured: {name} stops first"
    mem = [
        ["GPU total (CUDA)", _gib(p.total_memory), ""],
        [f"budget ({FRACTION_NAME[p.engine]} {p.settings.get(FRACTION_NAME[p.engine])})", _gib(p.budget), ""],
        ["weights", _gib(p.weights), _weights_note(p)],
        ["profile-run peak (activations)", _gib(p.profile_peak),
         f"vision encode {_gib(p.encoder_peak)} GiB" if p.encoder_peak else
         "transient: within what is kept free" if p.kv_reserve else ""],
        ["non-torch (cuBLAS, NCCL)", _gib(p.non_torch), f"DeepEP buffer {_gib(p.ep_buffers)}" if p.ep_buffers else
         "" if p.non_torch or not p.context else "before the first snapshot: outside"],
    ]
    if p.runner_buffers:
        mem.append(["flashinfer workspace" if p.engine == "tgi" else "model runner's sampler state",
                    _gib(p.runner_buffers), "allocated after the weights: inside"])
    if p.kv_reserve:
        mem.append(["kept free for transients", _gib(p.kv_reserve),
                    "max(1 GiB, 0.75 P) + max(P, G)"])
    mem += [
        ["available for the KV cache", _gib(p.kv_available), ""],
        ["KV-cache pool", pool, pool_note],
        ["CUDA graphs", graph, graphs],
        ["CUDA context + kernels" + (" (+ NCCL, cuBLAS)" if not p.non_torch and p.engine == "vllm" else ""),
         _gib(p.context), "outside the budget"],
    ]
    if p.draft_buffers:
        mem.append(["speculative proposer buffers", _gib(p.draft_buffers), "outside the budget"])
    if p.connector_gpu:
        mem.append(["KV connector buffer (LMCache)", _gib(p.connector_gpu), "outside the budget"])
    doc.add(Table(["memory per GPU", "GiB", "note"], mem, title="Start-up sizing", align=["l", "r", "l"],
                  footer=["predicted device used", _gib(p.device_used), ""]))
    users = [("KV cache size", f"{p.tokens:,} tokens ({p.bytes_per_token:,} B per token per GPU)"),
             (f"max concurrency at {p.max_model_len:,} tokens", _x(p.max_concurrency)),
             ("engine's concurrency limit", f"{p.max_running:,} sequences")]
    if p.avg_request_len:
        users.append((f"concurrency at {p.avg_request_len:,} tokens", _x(p.concurrency_at_avg)))
    if p.host_kv or p.host_kv_tokens:
        shm = f"; /dev/shm region {_gib(p.host_kv_shared)} GiB per engine" if p.host_kv_shared else ""
        users.append(("host KV tier", f"{p.host_kv_tokens:,} tokens; {_gib(p.host_kv)} GiB host RAM per rank{shm}"))
    doc.add(KeyValues(users, title="What it means for users" if p.starts else
                      "What it would mean for users, had it started"))
    doc.add(KeyValues([(k, str(v)) for k, v in p.settings.items()], title="Settings in effect"))
    doc.add(Notes(list(p.log), title="The engine would log"))
    if p.error:
        doc.add(Notes([p.error], title="Does not start"))
    doc.add(Notes([p.command], title="Command"))
    doc.add(Notes(list(p.notes)))
    return doc


def compare_doc(plans: Sequence[ServePlan]) -> Doc:
    """The engines side by side for one model, GPU and settings."""
    first = plans[0]
    doc = Doc(title=f"Serving engines compared: {first.model} on {first.gpus}× {first.gpu}",
              subtitle="per GPU; GiB = 2^30 bytes; each engine with its own defaults where a setting is not given")
    rows = [[f"{ENGINE_NAMES.get(p.engine, p.engine)} {p.engine_version}", "yes" if p.starts else "NO",
             _gib(p.weights), _gib(p.profile_peak), _gib(p.kv_pool), f"{p.tokens:,}", f"{p.max_model_len:,}",
             _x(p.max_concurrency), _x(p.concurrency_at_avg)] for p in plans]
    avg = f"at {first.avg_request_len:,}" if first.avg_request_len else "at avg"
    doc.add(Table(["engine", "starts", "weights", "profile peak", "KV GiB", "KV tokens", "max len",
                   "concurrency", avg], rows, align=["l", "l", "r", "r", "r", "r", "r", "r", "r"]))
    doc.add(Notes([p.command for p in plans], title="Commands"))
    errors = [f"{p.engine}: {p.error}" for p in plans if p.error]
    if errors:
        doc.add(Notes(errors, title="Does not start"))
    return doc


def largest_doc(p: ServePlan, n: int) -> Doc:
    doc = to_doc(p)
    doc.title = f"Largest max_model_len that starts: {n:,} tokens — " + doc.title
    return doc


def options_doc(options: Sequence[Option], *, concurrency: int, context: int, engine: str) -> Doc:
    doc = Doc(title=f"Cheapest GPUs for {concurrency} requests × {context:,} tokens with "
              f"{ENGINE_NAMES.get(engine, engine)}",
              subtitle="price of the GPUs used (TP × the instance's $/GPU-hour, catalog prices); per-GPU memory in GiB")
    rows = [[str(i + 1), o.gpu, str(o.tp), o.provider or "–", o.instance or "–",
             "–" if o.usd_per_hour is None else f"{o.usd_per_hour:,.2f}", f"{o.concurrency:,.1f}",
             _gib(o.plan.kv_pool), f"{o.plan.tokens:,}"] for i, o in enumerate(options)]
    doc.add(Table(["#", "GPU", "TP", "provider", "instance", "$/h", "concurrency", "KV GiB", "KV tokens"], rows,
                  align=["r", "l", "r", "l", "l", "r", "r", "r", "r"]))
    if options:
        doc.add(Notes([options[0].plan.command], title="Command for the cheapest"))
    return doc


@_styled
def plot_serving(points: Sequence[tuple[float, ServePlan]], path: str | Path, *, over: str) -> PlotData:
    """Stacked per-GPU memory (weights, activation budget, KV pool, CUDA graphs + context)
    against the memory fraction or max_model_len; plans that do not start have no KV pool."""
    p = check_plot_path(path)
    xs = tuple(float(x) for x, _ in points)
    stacked = {
        "weights": tuple(pl.weights for _, pl in points),
        "activation budget": tuple(pl.profile_peak + pl.non_torch for _, pl in points),
        "KV-cache pool": tuple(pl.kv_pool for _, pl in points),
        "CUDA graphs + context": tuple(pl.cuda_graph + pl.context for _, pl in points),
    }
    total = points[0][1].total_memory
    unit = _unit(total, *(sum(c) for c in zip(*stacked.values(), strict=True)))
    first = points[0][1]
    x_label = FRACTION_NAME[first.engine] if over == "utilization" else "max_model_len (tokens)"
    title = f"{ENGINE_NAMES.get(first.engine, first.engine)}: {first.model} on {first.gpu} (TP {first.tp})"
    data = PlotData(path=str(p), kind="serving", title=title, x=xs, x_label=x_label, stacked=stacked,
                    levels={"GPU total": total}, unit=unit)
    sc = GiB if unit == "GiB" else 2**20
    fig = _new_figure((9.0, 5.6))
    ax = fig.add_subplot(1, 1, 1)
    ax.stackplot(list(xs), *[[v / sc for v in col] for col in stacked.values()], labels=list(stacked),
                 colors=[_cycle(i) for i in range(len(stacked))], alpha=0.9)
    ax.axhline(total / sc, color="black", ls="--", lw=1, label=f"GPU total {total / GiB:,.1f} GiB")
    bad = [x for x, pl in points if not pl.starts]
    if bad:
        ax.scatter(bad, [0] * len(bad), marker="X", color="#C00000", zorder=5, label="does not start")
    if over == "context" and max(xs) / max(min(xs), 1) >= 8:
        ax.set_xscale("log", base=2)
    ax.set_xlabel(x_label)
    _mem_axis(ax, unit)
    ax.set_ylim(bottom=0)
    ax.legend(loc="upper left", fontsize=8, framealpha=0.9)
    ax.set_title(title, fontsize=12, loc="left")
    fig.tight_layout()
    _save(fig, data, "")
    return data


def _layout(p: ServePlan) -> str:
    """The layout line: TP and PP, and vLLM's DP and EP when used."""
    out = f"TP {p.tp}, PP {p.pp}"
    if p.dp > 1:
        out += f", DP {p.dp}"
    if p.ep > 1:
        out += f", EP {p.ep}: {p.local_experts} experts per GPU"
    return out


def _weights_note(p: ServePlan) -> str:
    parts = [f"routed experts {_gib(p.expert_weights)}" if p.expert_weights else "",
             f"vision tower {_gib(p.vision_weights)}" if p.vision_weights else "",
             f"drafter {_gib(p.draft_weights)} (+{p.draft_layers} KV layer{'s' if p.draft_layers != 1 else ''})"
             if p.draft_weights else ""]
    return "; ".join(x for x in parts if x)
