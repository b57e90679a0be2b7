"""``vramplan models``: list the embedded model catalog, or show one model's normalised spec."""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING, Any

from vramplan.cli.common import add_output_args

if TYPE_CHECKING:
    from vramplan.models.catalog import CatalogEntry
    from vramplan.models.spec import ModelSpec
    from vramplan.report.doc import Doc

_FAMILIES = ["dense", "moe", "mla", "encoder", "vit", "other"]


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "models", help="list the embedded model catalog (exact parameter counts, shapes)",
        description="List the models whose published config.json ships with vramplan: alias, "
        "Hub id, family, exact parameter count (as transformers builds the model) beside the "
        "published figure, layers, hidden size, attention heads / KV heads and context length. "
        "With MODEL (an alias, Hub id or a local config.json), show that model's normalised spec.",
    )
    p.add_argument("model", nargs="?", metavar="MODEL",
                   help="show one model: catalog alias, Hub id, or path to a config.json / its folder")
    p.add_argument("--family", choices=_FAMILIES, help="only one family")
    add_output_args(p, plot=False)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from vramplan.models.catalog import catalog_alias, catalog_entries, list_models, resolve
    from vramplan.report.render import emit

    entries = catalog_entries()
    if args.model:
        spec = resolve(args.model)
        alias = catalog_alias(args.model)
        entry = entries.get(alias) if alias else None
        emit(_spec_doc(spec, entry), args.format, sys.stdout, {"model": _spec_json(spec, entry)})
        return 0
    specs = list_models(args.family)
    rows = [_row_json(s, entries[s.name]) for s in specs]
    emit(_catalog_doc(specs, entries, args.family), args.format, sys.stdout, {"models": rows})
    return 0


def _count(n: int) -> str:
    return f"{n:,}" if n else "–"


def _short(n: int) -> str:
    for unit, div in (("T", 10**12), ("B", 10**9), ("M", 10**6), ("K", 10**3)):
        if n >= div:
            return f"{n / div:.3g}{unit}"
    return str(n)


def _heads(s: ModelSpec) -> str:
    return f"{s.heads}/{s.kv_heads}" if s.heads else "–"


def _catalog_doc(specs: list[ModelSpec], entries: dict[str, CatalogEntry], family: str | None) -> Doc:
    from vramplan.report.doc import Doc, Notes, Table

    rows = []
    for s in specs:
        e = entries[s.name]
        active = _short(s.active_params) if s.is_moe else "–"
        # "46.7B total, 12.9B active" -> "46.7B"; an exact "25,557,032" keeps its digit groups
        published = e.published_text.split(", ")[0].removesuffix(" total")
        rows.append([
            s.name, e.hub_id, str(s.family), _count(s.params), active, published,
            str(s.layers or "–"), str(s.hidden or "–"), _heads(s),
            f"{s.max_positions:,}" if s.max_positions else "–",
        ])
    subtitle = f"{len(specs)} models" + (f" (family {family})" if family else "")
    doc = Doc("Model catalog", subtitle=subtitle)
    doc.add(Table(["alias", "Hub id", "family", "params (exact)", "active", "published", "layers",
                   "hidden", "heads/kv", "context"], rows,
                  align=["l", "l", "l", "r", "r", "r", "r", "r", "r", "r"]))
    doc.add(Notes([
        "params: exact count of the model transformers builds from the embedded config.json "
        "(tied weights once); active: MoE parameters used per token (routed top-k experts).",
        "published: the figure the model card or paper states; --format json names each source.",
        "Resolve any other model by Hub id (online) or a local config.json path; "
        "`vramplan models MODEL` shows its normalised spec.",
    ]))
    return doc


def _spec_doc(s: ModelSpec, e: CatalogEntry | None) -> Doc:
    from vramplan.report.doc import Doc, KeyValues

    items = [("family", str(s.family)), ("model_type", s.model_type or "–"), ("source", s.source),
             ("params (exact)", _count(s.params))]
    if s.is_moe:
        items.append(("active params / token", _count(s.active_params)))
    if e is not None:
        items.append(("published", f"{e.published_text} ({e.published_source})"))
    items += [(k, str(v)) for k, v in _shape_fields(s).items() if v not in (0, None, "")]
    items.append(("checkpoint dtype", s.dtype))
    return Doc(s.name, sections=[KeyValues(items)], subtitle=s.hub_id or "")


def _shape_fields(s: ModelSpec) -> dict[str, Any]:
    return {
        "layers": s.layers, "hidden": s.hidden, "heads": s.heads, "kv_heads": s.kv_heads,
        "head_dim": s.head_dim, "intermediate": s.intermediate, "vocab": s.vocab,
        "context": s.max_positions, "tie_embeddings": s.tie_embeddings if s.vocab else None,
        "mlp_kind": s.mlp_kind, "norm_kind": s.norm_kind,
        "sliding_window": s.sliding_window,
        "sliding_layers": s.sliding_layers, "n_experts": s.n_experts,
        "experts_per_token": s.experts_per_token, "shared_experts": s.shared_experts,
        "moe_intermediate": s.moe_intermediate, "dense_layers": s.dense_layers,
        "q_lora_rank": s.q_lora_rank, "kv_lora_rank": s.kv_lora_rank,
        "qk_rope_head_dim": s.qk_rope_head_dim, "qk_nope_head_dim": s.qk_nope_head_dim,
        "v_head_dim": s.v_head_dim, "image_size": s.image_size, "patch_size": s.patch_size,
        "num_channels": s.num_channels if (s.image_size or s.patch_size) else None,
    }


def _row_json(s: ModelSpec, e: CatalogEntry) -> dict[str, Any]:
    return {
        "alias": s.name, "hub_id": e.hub_id, "family": str(s.family), "model_type": s.model_type,
        "params": s.params, "active_params": s.active_params,
        "published_params": e.published_params, "published_text": e.published_text,
        "published_kind": e.published_kind, "published_source": e.published_source,
        "layers": s.layers, "hidden": s.hidden, "heads": s.heads, "kv_heads": s.kv_heads,
        "context": s.max_positions, "dtype": s.dtype,
    }


def _spec_json(s: ModelSpec, e: CatalogEntry | None) -> dict[str, Any]:
    out: dict[str, Any] = {
        "name": s.name, "hub_id": s.hub_id, "family": str(s.family), "model_type": s.model_type,
        "source": s.source, "params": s.params, "active_params": s.active_params,
        "published_params": s.published_params, "dtype": s.dtype,
    }
    if e is not None:
        out.update(published_text=e.published_text, published_source=e.published_source)
    out.update(_shape_fields(s))
    return out
