"""The page's state (a query string) → a :class:`Query`: model, workload, GPU, method.

The query keys are the CLI's flag names without the dashes in front (``batch``, ``new-tokens``,
``offload-optimizer``), derived from the fields of :class:`~vramplan.workload.Workload` and
:class:`~vramplan.workload.Parallel` — one source of truth, so that a page URL maps one to one
onto a ``vramplan estimate`` command line. Missing keys take the fields' defaults.

Bad input raises :class:`FieldError`: the one-line message the CLI prints, plus the query key
it belongs to (the page shows it beside that field).
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import enum
import hashlib
import json
import re
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cache
from typing import Any

from vramplan.errors import FIELD_REF, VramplanError, did_you_mean
from vramplan.workload import Method, Parallel, Workload, auto_checkpointing, field_docs

MAX_CONFIG_BYTES = 256 * 1024
"""Largest config.json the page accepts (a transformers config.json is a few KiB)."""
MAX_LINK_CONFIG_CHARS = 24 * 1024
"""Largest encoded config carried in a link (the query string)."""
MAX_INT = 2**40
"""Largest integer a field takes from a page (far above any real batch, sequence or GPU count)."""
MAX_SEARCH_GPUS = 4096
"""Most GPUs a plan or GPU search of the page considers (each costs the search time)."""
MAX_LAYERS = 1024
"""Most layers of a dropped config.json (the largest published models have under 200; a trace
builds each one)."""
MAX_EXPERTS = 1024
"""Most experts per layer of a dropped config.json (published MoE models have up to 384)."""
SEARCH_KEYS = ("gpus", "budget", "global-batch", "allow-peft", "sort")
"""Planner options (``vramplan plan`` flags) the page sends to the plan and GPU views."""
SERVE_KEYS = ("serve-engine", "memory-fraction", "max-model-len", "max-num-seqs", "max-num-batched-tokens",
              "block-size", "kv-cache-dtype", "quantization", "avg-request-len", "spec-method", "spec-tokens",
              "limit-images", "limit-videos", "engine-version", "kv-offloading-size")
"""``vramplan serve-plan`` flags the serving view sends (its TP and PP are the layout's; its
``--engine`` is ``serve-engine``, as ``engine`` is the parallel layout's framework)."""
PAGE_KEYS = ("model", "gpu", "method", "config", *SEARCH_KEYS, *SERVE_KEYS)
"""Query keys beyond the workload's fields."""
OPTION_KEYS = {"max_gpus": "gpus", "allow_peft": "allow-peft", "global_batch": "global-batch"}
"""Library option names in core messages → the page's keys (Plan search)."""


class FieldError(VramplanError):
    """A user mistake tied to one query key (``field``), or to none (``field=None``)."""

    def __init__(self, message: str, *, field: str | None, hint: str | None = None) -> None:
        super().__init__(message, hint=hint)
        self.field = field


@dataclass(frozen=True)
class Field:
    """One workload input: query key (= CLI flag without ``--``), attribute, kind, default."""

    key: str
    name: str
    kind: str
    """int | float | bool | enum | list | str."""
    default: Any
    choices: tuple[str, ...] = ()
    parallel: bool = False
    doc: str = ""


@cache
def fields() -> tuple[Field, ...]:
    """Every Workload and Parallel field, in declaration order (``parallel`` itself expanded)."""
    out: list[Field] = []
    for cls, par in ((Workload, False), (Parallel, True)):
        hints = typing.get_type_hints(cls)
        docs = field_docs(cls)
        base = cls()
        for f in dataclasses.fields(cls):
            if f.name == "parallel":
                continue
            tp = hints[f.name]
            default = getattr(base, f.name)
            if f.name in ("precision", "checkpointing"):  # "auto": resolved per task (and PEFT), as the CLI does
                default = "auto"
            choices: tuple[str, ...] = ()
            if isinstance(tp, type) and issubclass(tp, enum.Enum):
                kind = "enum"
                choices = tuple(str(m.value) for m in tp)
                if f.name in ("precision", "checkpointing"):
                    choices = ("auto", *choices)
                default = default.value if isinstance(default, enum.Enum) else default
            elif tp is bool:
                kind = "bool"
            elif tp is int:
                kind = "int"
            elif tp is float:
                kind = "float"
            elif isinstance(default, tuple) and all(isinstance(x, str) for x in default):
                kind = "list"
                default = ",".join(default)
            elif tp is str or (default is None and "str" in str(tp)):
                kind = "str"
                default = default or ""
            else:  # a nested value the page has no input for (yet): the default applies
                continue
            out.append(Field(key=f.name.replace("_", "-"), name=f.name, kind=kind, default=default,
                             choices=choices, parallel=par, doc=docs.get(f.name, "")))
    return tuple(out)


@dataclass(frozen=True)
class Query:
    """One request of the page: what to estimate, on what, how."""

    model: str
    """Catalog alias, or the display name of an uploaded config.json."""
    workload: Workload
    gpu: str | None = None
    method: Method = Method.AUTO
    config: str | None = None
    """The uploaded config.json's text (JSON data, parsed, never executed)."""
    explicit: frozenset[str] = frozenset()
    """The query keys the request set (an error naming several fields is shown under the one
    of them the user changed)."""

    def spec(self) -> Any:
        """The ModelSpec (rebuilt in a worker process: specs hold read-only mappings)."""
        if self.config is not None:
            from vramplan.models.catalog import spec_from_text

            return spec_from_text(self.config, self.model)
        from vramplan.models.catalog import resolve

        return resolve(self.model)

    def key(self, **extra: Any) -> str:
        """A stable cache key for this query (and ``extra`` options)."""
        cfg = hashlib.sha256(self.config.encode()).hexdigest()[:16] if self.config else None
        blob = {"model": self.model, "config": cfg, "w": self.workload.to_dict(), "gpu": self.gpu,
                "method": str(self.method), **extra}
        return json.dumps(blob, sort_keys=True)

    def with_method(self, method: Method | str) -> Query:
        return dataclasses.replace(self, method=Method(str(method)))


def parse_query(q: Mapping[str, str], *, method: str | None = None) -> Query:
    """A :class:`Query` from the page's parameters (strings); raises :class:`FieldError`."""
    keys = _keys()
    for k in q:  # a library spelling of a page key would be ignored: the answer would not be the one asked
        if k not in keys and k.replace("_", "-") in keys:
            raise FieldError(f"unknown key `{k}`", field=k.replace("_", "-"),
                             hint=f"the page's key is `{k.replace('_', '-')}`")
    model = (q.get("model") or "").strip()
    config = decode_config(q["config"]) if q.get("config") else None
    if config is None:
        model = check_model(model)
        from vramplan.models.catalog import resolve

        spec = resolve(model)
    else:
        model = model or "config.json"
        spec = _spec_or_field_error(config, model)
    workload = parse_workload(q)
    if not (q.get("seq") or "").strip():
        workload = seq_for_model(spec, workload)
    gpu = (q.get("gpu") or "").strip() or None
    if gpu is not None:
        from vramplan.hardware.catalog import get_gpu

        try:
            gpu = get_gpu(gpu).key
        except VramplanError as e:
            raise FieldError(page_message(e), field="gpu") from None
    m = method if method is not None else (q.get("method") or "auto")
    try:
        meth = Method(str(m).strip().lower())
    except ValueError:
        raise FieldError(f"invalid method {m!r}", field="method",
                         hint="choose one of " + " | ".join(x.value for x in Method)) from None
    explicit = frozenset(k for k, v in q.items() if v not in ("", None) and k not in ("model", "gpu", "method", "config"))
    return Query(model=model, workload=workload, gpu=gpu, method=meth, config=config, explicit=explicit)


def seq_for_model(spec: Any, w: Workload) -> Workload:
    """``seq`` not given and the default longer than the model's positions (gpt2's 1,024, BERT's
    512): the model's own maximum (less ``new_tokens`` when generating), as ``vramplan estimate``
    does without ``--seq`` (the page shows the length in its summary and in the seq field)."""
    from vramplan.models.spec import Family

    if w.seq != Workload().seq or spec.family in (Family.VIT, Family.OTHER) or not spec.max_positions:
        return w
    room = spec.max_positions - (w.new_tokens if w.task.value == "generate" else 0)
    if room >= w.seq or room < 1:
        return w
    return w.replace(seq=room)


def check_model(name: str) -> str:
    """A catalog model only: a page never reads local paths or downloads Hub configs."""
    from vramplan.models.catalog import catalog_alias, catalog_entries

    if not name:
        raise FieldError("no model chosen", field="model",
                         hint="pick one from the catalog, e.g. llama-3.1-8b, or drop a config.json")
    alias = catalog_alias(name)
    if alias is None:
        e = did_you_mean(name, catalog_entries().keys(), kind="model", listing="vramplan models")
        hint = e.hint if e.hint and e.hint.startswith("did you mean") else \
            "type in the model box to search the catalog, or drop a config.json"
        raise FieldError(e.message, field="model", hint=hint)
    return alias


def recipe_defaults() -> dict[str, dict[str, dict[str, str]]]:
    """Each recipe's knob defaults per PEFT mode, as the form's values (query key → text; a
    switch on is "1", off ""): the page shows them and sends only values that differ."""
    from ..recipes import CATALOG, defaults
    from ..workload import Peft

    def text(v: Any) -> str:
        if isinstance(v, bool):
            return "1" if v else ""
        return str(getattr(v, "value", v))

    return {str(r.value): {str(p.value): {d.field.replace("_", "-"): text(d.value) for d in defaults(r, peft=p)}
                           for p in Peft} for r in CATALOG}


def parse_workload(q: Mapping[str, str]) -> Workload:
    """The Workload of the query; a value that cannot be read names its key."""
    values: dict[str, Any] = {}
    par: dict[str, Any] = {}
    for f in fields():
        raw = q.get(f.key)
        if raw is None or raw == "":
            continue
        v = _convert(f, raw)
        (par if f.parallel else values)[f.name] = v
    try:
        if str(values.get("checkpointing", "auto")) == "auto":
            values.pop("checkpointing", None)
            if str(values.get("recipe", "plain")) == "plain":  # (with a recipe: the recipe's)
                values["checkpointing"] = auto_checkpointing(values.get("peft", Workload.peft),
                                                              values.get("task", Workload.task))
        if str(values.get("recipe", "plain")) != "plain":  # the recipe fills the knobs the query leaves out
            from ..recipes import apply

            return apply(values.pop("recipe"), **values, **par)
        return Workload(**values, parallel=Parallel(**par))
    except VramplanError as e:
        raise FieldError(page_message(e), field=field_of(e, {k for k, v in q.items() if v})) from None


def _convert(f: Field, raw: str) -> Any:
    text = raw.strip()
    if f.kind == "int":
        try:
            v = int(text)
        except ValueError:
            raise FieldError(f"--{f.key} must be an integer, got {raw!r}", field=f.key) from None
        if abs(v) > MAX_INT:
            raise FieldError(f"--{f.key} {text[:20]}{'…' if len(text) > 20 else ''} is too large",
                             field=f.key, hint=f"at most {MAX_INT:,}")
        return v
    if f.kind == "float":
        try:
            return float(text)
        except ValueError:
            raise FieldError(f"--{f.key} must be a number, got {raw!r}", field=f.key) from None
    if f.kind == "bool":
        low = text.lower()
        if low in ("1", "true", "on", "yes"):
            return True
        if low in ("0", "false", "off", "no"):
            return False
        raise FieldError(f"--{f.key} is on or off, got {raw!r}", field=f.key, hint="use 1 or 0")
    if f.kind == "list":
        return tuple(t.strip() for t in text.split(",") if t.strip())
    return text


_FLAG = re.compile(r"--([a-z][a-z0-9-]*)")
_COMMAND = re.compile(r"`vramplan ([a-z-]+)[^`]*`")
_PAGE_PLACES = {"plan": "the Plans tab", "fit": "the Fit tab", "serve-plan": "the Serving tab",
                "estimate": "the estimate", "models": "the model box (type to search)",
                "gpus": "the GPU list"}


def _keys() -> set[str]:
    return {f.key for f in fields()} | set(PAGE_KEYS)


def _flag_of(name: str) -> str | None:
    key = OPTION_KEYS.get(name, name.replace("_", "-"))
    return f"--{key}" if key in _keys() else None


def page_message(e: VramplanError) -> str:
    """The CLI's one-line message, as the page shows it: core field references (`` `batch` ``,
    `` `max_gpus=N` ``) as the page's keys, which are the CLI's flags (``--batch``, ``--gpus N``),
    and a suggested command the page answers itself as the place on the page
    (`` `vramplan plan …` `` → the Plans tab)."""
    text = e.render(_flag_of)
    text = re.sub(r"see `vramplan models`( for the list)?", "type in the model box to search the catalog", text)

    def place(m: re.Match[str]) -> str:
        where = _PAGE_PLACES.get(m.group(1))
        return where if where is not None else f"{m.group(0)} in a terminal"

    return _COMMAND.sub(place, text)


def field_of(e: BaseException, explicit: frozenset[str] | set[str] = frozenset()) -> str | None:
    """The query key an error is about: the error's own ``field`` when it has one; else the
    one field its message names (`` `seq` ``, ``--seq``); where it names several (``check the
    sizes (--batch, --seq, …)``), the one of them the request set (``explicit``), or none
    (the page shows the message above the figures rather than under a field it is not about);
    else the field an ``invalid <what>`` message names."""
    own = getattr(e, "field", None)
    keys = _keys()
    if isinstance(own, str) and own:
        key = own.rsplit(".", 1)[-1].replace("_", "-").removeprefix("--")  # "parallel.dp" → "dp"
        key = OPTION_KEYS.get(own, key)
        if key in keys:
            return key
    text = str(e)
    named: list[str] = []
    for m in FIELD_REF.finditer(text):  # a core message names fields: `method=trace`
        key = OPTION_KEYS.get(m.group(1), m.group(1).replace("_", "-"))
        if key in keys and key not in named:
            named.append(key)
    for m in _FLAG.finditer(text):
        if m.group(1) in keys and m.group(1) not in named:
            named.append(m.group(1))
    if len(named) == 1:
        return named[0]
    if named:
        chosen = [k for k in named if k in explicit]
        return chosen[0] if len(chosen) == 1 else None
    low = text.lower()
    for f in fields():
        if low.startswith(f"invalid {f.name.replace('_', ' ')} "):
            return f.key
    if "zero stage" in low:
        return "zero"
    if "checkpoint fraction" in low:
        return "checkpoint-fraction"
    return None


def decode_config(text: str) -> str:
    """An uploaded config.json as carried in a link: base64url of its (minified) JSON text."""
    if len(text) > MAX_LINK_CONFIG_CHARS:
        raise FieldError(f"the config.json in this link is too long ({len(text):,} characters)",
                         field="config", hint=f"at most {MAX_LINK_CONFIG_CHARS:,}")
    try:
        raw = base64.b64decode(text + "=" * (-len(text) % 4), altchars=b"-_", validate=True)
        return raw.decode("utf-8")
    except (binascii.Error, ValueError):
        raise FieldError("the config.json in this link is damaged", field="config",
                         hint="drop the config.json on the page again") from None


def encode_config(text: str) -> str:
    return base64.urlsafe_b64encode(text.encode("utf-8")).decode("ascii").rstrip("=")


def read_upload(body: bytes, name: str = "config.json") -> tuple[str, Any]:
    """Check an uploaded config.json (size, UTF-8, JSON object with a model_type) and return
    its minified text and spec. Data only: nothing in it is run."""
    if len(body) > MAX_CONFIG_BYTES:
        raise FieldError(f"{name} is {len(body):,} bytes; the page accepts up to {MAX_CONFIG_BYTES:,}",
                         field="config", hint="a transformers config.json is a few KiB: check the file")
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError:
        raise FieldError(f"{name} is not UTF-8 text", field="config", hint="drop a config.json") from None
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise FieldError(f"{name}: malformed JSON at line {e.lineno} column {e.colno} ({e.msg})",
                         field="config") from None
    mini = json.dumps(obj, separators=(",", ":"), ensure_ascii=False)
    spec = _spec_or_field_error(mini, name)
    if len(encode_config(mini)) > MAX_LINK_CONFIG_CHARS:
        raise FieldError(f"{name} is too large to carry in a link", field="config",
                         hint=f"at most {MAX_LINK_CONFIG_CHARS * 3 // 4:,} bytes of minified JSON")
    return mini, spec


def _spec_or_field_error(text: str, name: str) -> Any:
    from vramplan.models.catalog import spec_from_text

    try:
        spec = spec_from_text(text, name)
    except VramplanError as e:
        raise FieldError(page_message(e), field="config") from None
    except Exception as e:  # a config whose values have the wrong types: still the user's file
        raise FieldError(f"{name}: cannot read this config ({e.__class__.__name__}: {e})".split("\n")[0],
                         field="config") from None
    check_size(spec, name)
    check_buildable(spec, name)
    return spec


_LAYER_KEYS = ("num_hidden_layers", "n_layer", "n_layers", "num_layers", "num_decoder_layers",
               "num_encoder_layers", "encoder_layers", "decoder_layers")
_EXPERT_KEYS = ("num_local_experts", "n_routed_experts", "num_experts", "moe_num_experts")


def _largest(config: Any, names: tuple[str, ...], depth: int = 0) -> int:
    """The largest integer under any of ``names`` in a config (nested configs included)."""
    best = 0
    if isinstance(config, Mapping) and depth < 4:
        for k, v in config.items():
            if k in names and isinstance(v, int) and not isinstance(v, bool):
                best = max(best, v)
            elif isinstance(v, Mapping):
                best = max(best, _largest(v, names, depth + 1))
    return best


def check_size(spec: Any, name: str) -> None:
    """A dropped config.json the page can afford: a trace builds every layer and expert, so a
    config with 10,000 layers would hold a worker for minutes."""
    layers = max(spec.layers, _largest(spec.config, _LAYER_KEYS))
    experts = max(spec.n_experts, _largest(spec.config, _EXPERT_KEYS))
    for what, n, most in (("layers", layers, MAX_LAYERS), ("experts per layer", experts, MAX_EXPERTS)):
        if n > most:
            raise FieldError(f"{name} has {n:,} {what}; the page takes up to {most:,}", field="config",
                             hint="published models have far fewer: check the file (`vramplan estimate` "
                                  "in a terminal has no such limit)")


def check_buildable(spec: Any, name: str) -> None:
    """A config.json whose model_type neither vramplan's formulas nor transformers know is
    refused when it is dropped, not half-accepted until the trace fails."""
    from vramplan.models.spec import Family

    if spec.family is not Family.OTHER:
        return
    try:
        import transformers
        from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
    except ImportError:
        raise FieldError(f"{name}: model_type {spec.model_type!r} has no closed form, and tracing it needs "
                         "transformers", field="config", hint="pip install 'vramplan[models]'") from None
    if spec.model_type not in CONFIG_MAPPING_NAMES:
        raise FieldError(f"{name}: unknown model_type {spec.model_type!r}: not a family vramplan's formulas "
                         f"know, nor one transformers {transformers.__version__} can build", field="config",
                         hint="check model_type (e.g. llama, mistral, qwen2, gpt2, bert)")



_SERVE_WORDS = (
    (("tensor parallel",), "tp"), (("pipeline parallelism",), "pp"),
    (("gpu_memory_utilization", "mem_fraction_static", "cuda_memory_fraction", "free_gpu_memory_fraction"),
     "memory-fraction"),
    (("max_model_len",), "max-model-len"), (("serving engine",), "serve-engine"), (("kv_cache_dtype",), "kv-cache-dtype"),
    (("quantization",), "quantization"), (("block_size",), "block-size"), (("max_num_seqs",), "max-num-seqs"),
    (("max_num_batched_tokens",), "max-num-batched-tokens"), (("average request length",), "avg-request-len"),
    (("speculative", "num_speculative_tokens", "eagle", "mtp"), "spec-method"),
    (("limit_mm_per_prompt", "takes no images", "vision-language"), "limit-images"),
    (("vllm version", "vllm release"), "engine-version"),
)


def serve_field(e: BaseException) -> str | None:
    """The serving view's key an error of :func:`vramplan.serving.serve_plan` is about (its
    messages name the engine's own settings, as the engine would)."""
    own = {"speculative_config": "spec-method", "limit_mm_per_prompt": "limit-images", "images": "limit-images",
           "engine_version": "engine-version", "kv_offloading_size": "kv-offloading-size"}
    field = getattr(e, "field", None)
    if field in own:
        return own[str(field)]
    if field:
        return field_of(e)
    low = str(e).lower()
    for words, key in _SERVE_WORDS:  # before the flags a hint suggests (``use --tp instead``)
        if any(w in low for w in words):
            return key
    return field_of(e)
