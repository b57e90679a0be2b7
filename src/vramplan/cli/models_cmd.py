"""``vramplan models``: list the embedded model catalog, or show one model's normalised spec."""

from __future__ import annotations

import argparse
import sys

from vramplan.cli.common import add_output_args

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
    from vramplan.models.pipelines import pipeline_entries
    from vramplan.report.models import catalog_doc, catalog_json, spec_doc, spec_json
    from vramplan.report.render import emit

    entries = catalog_entries()
    if args.model:
        spec = resolve(args.model)
        alias = catalog_alias(args.model)
        entry = entries.get(alias) if alias else None
        emit(spec_doc(spec, entry), args.format, sys.stdout, {"model": spec_json(spec, entry)})
        return 0
    specs = list_models(args.family)
    pipelines = list(pipeline_entries().values()) if args.family in (None, "other") else []
    emit(catalog_doc(specs, entries, args.family, pipelines), args.format, sys.stdout,
         catalog_json(specs, entries, pipelines))
    return 0
