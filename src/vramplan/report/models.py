"""Doc builders for the model catalog (``vramplan models``) and one model's normalised spec
(``vramplan models MODEL``), and their JSON objects."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from .doc import Doc, KeyValues, Notes, Table

if TYPE_CHECKING:
    from vramplan.models.catalog import CatalogEntry
    from vramplan.models.pipelines import PipelineEntry
    from vramplan.models.spec import ModelSpec


def _count(n: int) -> str:
    return f"{n:,}" if n else "–"


def _short(n: int) -> str:
    for unit, div in (("T", 10**12), ("B", 10**9), ("M", 10**6), ("K", 10**3)):
        if n >= div:
            return f"{n / div:.3g}{unit}"
    return str(n)


def _heads(s: ModelSpec) -> str:
    return f"{s.heads}/{s.kv_heads}" if s.heads else "–"


def catalog_doc(specs: Sequence[ModelSpec], entries: Mapping[str, CatalogEntry], family: str | None,
                pipelines: Sequence[PipelineEntry] = ()) -> Doc:
    """The catalog list: exact and published parameter counts and the main shapes."""
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
    if pipelines:
        doc.add(Table(["pipeline", "Hub id", "components (exact params)", "params (exact)"],
                      [[e.alias, e.hub_id, ", ".join(f"{name} {_count(c.params)}" for name, c in e.components.items()),
                        _count(e.params)] for e in pipelines],
                      align=["l", "l", "l", "r"], title="Diffusion pipelines (vramplan estimate PIPELINE)"))
    doc.add(Notes([
        "params: exact count of the model transformers builds from the embedded config.json "
        "(tied weights once); active: MoE parameters used per token (routed top-k experts).",
        "published: the figure the model card or paper states; --format json names each source.",
        "Resolve any other model by Hub id (online) or a local config.json path; "
        "`vramplan models MODEL` shows its normalised spec.",
    ]))
    return doc


def spec_doc(s: ModelSpec, e: CatalogEntry | None) -> Doc:
    """One model's normalised spec, with its published parameter count when in the catalog."""
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


def spec_json(s: ModelSpec, e: CatalogEntry | None) -> dict[str, Any]:
    """``vramplan models MODEL --json``."""
    out: dict[str, Any] = {
        "name": s.name, "hub_id": s.hub_id, "family": str(s.family), "model_type": s.model_type,
        "source": s.source, "params": s.params, "active_params": s.active_params,
        "published_params": s.published_params, "dtype": s.dtype,
    }
    if e is not None:
        out.update(published_text=e.published_text, published_source=e.published_source)
    out.update(_shape_fields(s))
    return out


def catalog_json(specs: Sequence[ModelSpec], entries: Mapping[str, CatalogEntry],
                 pipelines: Sequence[PipelineEntry] = ()) -> dict[str, Any]:
    """``vramplan models --json``."""
    doc: dict[str, Any] = {"models": [_row_json(s, entries[s.name]) for s in specs]}
    if pipelines:
        doc["pipelines"] = [{"alias": e.alias, "hub_id": e.hub_id, "params": e.params, "vendored": e.vendored,
                             "components": {name: {"params": c.params, "published": c.published_text,
                                                   "published_kind": c.published_kind, "source": c.published_source}
                                            for name, c in e.components.items()}} for e in pipelines]
    return doc
