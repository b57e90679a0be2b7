"""Whole diffusers pipelines from their published configs: the catalog's ``pipelines`` and local folders.

A pipeline is a folder laid out as its Hub repository is: ``model_index.json`` (the pipeline
class, and the library and class of each component) and one folder per component holding its
``config.json`` (``scheduler_config.json`` for the scheduler). The catalog embeds such folders
(``configs/pipelines/<folder>/``, verbatim copies of the published files, sources in
``configs/index.json``); a local folder with a ``model_index.json`` works the same way.

:func:`build_pipeline` makes the pipeline from them with diffusers' and transformers' own classes
(``from_config`` / ``Model(Config)``: nothing is downloaded, no weight is read). Tokenizers are
not part of the configs: word-level stand-ins take their place. The encoders pad every prompt to
their full length (CLIP's ``max_position_embeddings``, T5's ``max_sequence_length``), so the
prompt's words do not change memory. Nothing here imports torch at import time.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from functools import lru_cache
from typing import TYPE_CHECKING, Any

from vramplan._dataclass import dataclass
from vramplan.errors import ConfigError

if TYPE_CHECKING:
    from pathlib import Path

    import torch

_INDEX = "model_index.json"
DENOISERS = ("transformer", "unet")
"""model_index.json keys of the denoiser a pipeline calls once per step."""
_TEXT_ENCODERS = ("text_encoder", "text_encoder_2", "text_encoder_3")
_CONFIG_FILES = ("config.json", "scheduler_config.json")
_NOT_MODELS = ("scheduler", "tokenizer", "tokenizer_2", "tokenizer_3", "feature_extractor", "image_processor")
_STAND_IN_WORDS = 300


@dataclass(frozen=True)
class ComponentFigure:
    """One model of a catalog pipeline: its exact parameter count and the published figure."""

    params: int
    published_params: int | None
    published_text: str
    published_kind: str
    """exact | rounded | none (no published figure found: ``params`` is the meta-built count). An
    exact figure from a checkpoint's safetensors total counts what it stores: the parameters and
    any persistent buffer (SD3's positional embedding), as the tests check."""
    published_source: str


@dataclass(frozen=True)
class PipelineEntry:
    """A whole pipeline of the embedded catalog (``configs/index.json``'s ``pipelines``)."""

    alias: str
    hub_id: str
    folder: str
    """Folder under ``configs/pipelines/``: the repository's layout, its config files only."""
    vendored: str
    """Where the embedded files were copied from (repository@commit path)."""
    components: Mapping[str, ComponentFigure]
    aliases: tuple[str, ...] = ()

    @property
    def params(self) -> int:
        return sum(c.params for c in self.components.values())

    @property
    def path(self) -> Path:
        # (pathlib imported here, not at import: the analytic command's start-up imports no pathlib)
        from pathlib import Path

        return Path(_configs_dir()) / "pipelines" / self.folder


def _configs_dir() -> str:
    return os.path.join(os.path.dirname(__file__), "configs")


@lru_cache(maxsize=1)
def pipeline_entries() -> dict[str, PipelineEntry]:
    """alias → entry, in catalog order."""
    with open(os.path.join(_configs_dir(), "index.json"), encoding="utf-8") as f:
        raw = json.load(f).get("pipelines", {})
    out: dict[str, PipelineEntry] = {}
    for alias, e in raw.items():
        comps = {name: ComponentFigure(params=int(c["params"]), published_params=c.get("published_params"),
                                       published_text=c.get("published_text", ""),
                                       published_kind=c["published_kind"], published_source=c["published_source"])
                 for name, c in e["components"].items()}
        out[alias] = PipelineEntry(alias=alias, hub_id=e["hub_id"], folder=e["folder"], vendored=e["vendored"],
                                   components=comps, aliases=tuple(e.get("aliases", ())))
    return out


def pipeline_alias(name: str) -> str | None:
    """The catalog pipeline ``name`` refers to (alias or extra spelling, any case), or None."""
    key = name.strip().lower()
    for alias, e in pipeline_entries().items():
        if key == alias.lower() or key in (a.lower() for a in e.aliases):
            return alias
    return None


def pipeline_folder(name: str) -> Path | None:
    """The folder of the pipeline ``name`` names: a catalog pipeline, or a local folder holding a
    ``model_index.json`` (or that file itself); None when ``name`` is neither."""
    alias = pipeline_alias(name)
    if alias is not None:
        return pipeline_entries()[alias].path
    path = os.path.expanduser(name.strip())
    if os.path.basename(path) == _INDEX and os.path.isfile(path):
        folder = os.path.dirname(path) or "."
    elif os.path.isdir(path) and os.path.isfile(os.path.join(path, _INDEX)):
        folder = path
    else:
        return None
    from pathlib import Path

    return Path(folder)


@dataclass(frozen=True)
class PipelineConfigs:
    """A pipeline folder read: its class and each component's (library, class, config)."""

    name: str
    pipeline_class: str
    components: Mapping[str, tuple[str, str, Mapping[str, Any]]]
    """model_index.json key → (library, class name, config); tokenizers carry no config."""

    @property
    def denoiser(self) -> str:
        return next((k for k in DENOISERS if k in self.components), "")

    def role(self, component: str) -> str:
        """What a component does in the pipeline's call: text encoding, denoising, VAE decode."""
        if component in _TEXT_ENCODERS:
            return "text encoding"
        if component in DENOISERS:
            return "denoising"
        return "VAE decode" if component == "vae" else component


def read_pipeline(folder: str | Path, name: str | None = None) -> PipelineConfigs:
    """model_index.json and every component's config under ``folder`` (data only, never code)."""
    from pathlib import Path

    root = Path(folder)
    index = _read_json(root / _INDEX)
    cls = index.get("_class_name")
    if not isinstance(cls, str):
        raise ConfigError(f"{root / _INDEX}: no _class_name (the pipeline's class)",
                          hint="a diffusers model_index.json names its pipeline class")
    comps: dict[str, tuple[str, str, Mapping[str, Any]]] = {}
    for key, value in index.items():
        if key.startswith("_") or not isinstance(value, list) or len(value) != 2 or value[0] is None:
            continue  # (settings such as force_zeros_for_empty_prompt; a component left out: [null, null])
        lib, klass = str(value[0]), str(value[1])
        if key.startswith("tokenizer"):
            comps[key] = (lib, klass, {})
            continue
        found = next((root / key / f for f in _CONFIG_FILES if (root / key / f).is_file()), None)
        if found is None:
            raise ConfigError(f"{root}: model_index.json names {key} ({lib}.{klass}) but {key}/ holds no config.json",
                              hint=f"copy the repository's {key}/config.json into {root / key}")
        comps[key] = (lib, klass, _read_json(found))
    if not any(k in comps for k in DENOISERS):
        raise ConfigError(f"{root}: {cls} has no transformer or unet among its components",
                          hint="vramplan sizes text-to-image and text-to-video pipelines (a denoiser per step)")
    return PipelineConfigs(name=name or root.name, pipeline_class=cls, components=comps)


def _read_json(file: Path) -> dict[str, Any]:
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{file}: cannot read ({e.__class__.__name__})") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"{file}: malformed JSON at line {e.lineno} column {e.colno} ({e.msg})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{file}: must hold a JSON object, not {type(data).__name__}")
    return data


def build_pipeline(cfg: PipelineConfigs, dtype: torch.dtype) -> Any:
    """The diffusers pipeline ``cfg`` describes, each model built from its config in ``dtype``
    (where the caller's default device puts it: ``torch.device("meta")`` for a count, the host
    under ``vramplan run``), the scheduler from its config, stand-in tokenizers."""
    import diffusers
    import torch
    import transformers

    from .build import quiet

    parts: dict[str, Any] = {}
    with quiet():
        for key, (lib, klass, config) in cfg.components.items():
            if key.startswith("tokenizer"):
                parts[key] = _stand_in_tokenizer(_max_length(cfg, key))
                continue
            if lib not in ("diffusers", "transformers"):
                raise ConfigError(f"{cfg.name}: component {key} comes from {lib}, not diffusers or transformers",
                                  hint="vramplan builds diffusers pipelines of diffusers and transformers models")
            module = diffusers if lib == "diffusers" else transformers
            made = getattr(module, klass, None)
            if made is None:
                raise ConfigError(f"{cfg.name}: {lib} {getattr(module, '__version__', '')} has no {klass} ({key})",
                                  hint=f"upgrade {lib}")
            clean = {k: v for k, v in config.items() if not k.startswith("_")}
            if key == "scheduler":
                with torch.device("cpu"):  # (host work: its tables are read on the host)
                    parts[key] = made.from_config(clean)
            elif lib == "diffusers":
                parts[key] = made.from_config(clean).to(dtype)
            else:
                parts[key] = made(made.config_class.from_dict(clean)).to(dtype)
        pipe_cls = getattr(diffusers, cfg.pipeline_class, None)
        if pipe_cls is None:
            raise ConfigError(f"{cfg.name}: diffusers {diffusers.__version__} has no {cfg.pipeline_class}",
                              hint="upgrade diffusers")
        extra = {"add_watermarker": False} if "add_watermarker" in _init_params(pipe_cls) else {}
        return pipe_cls(**parts, **extra)


def _init_params(cls: type) -> set[str]:
    import inspect

    return set(inspect.signature(cls).parameters)


def _max_length(cfg: PipelineConfigs, tokenizer: str) -> int:
    """The stand-in tokenizer's ``model_max_length``: its encoder's positions (CLIP's 77), else
    512 (T5 has relative positions; FluxPipeline pads T5 prompts to ``max_sequence_length``, 512)."""
    encoder = "text_encoder" + tokenizer.removeprefix("tokenizer")
    config = cfg.components.get(encoder, ("", "", {}))[2]
    return int(config.get("max_position_embeddings", 512))


def _stand_in_tokenizer(max_length: int) -> Any:
    """A word-level tokenizer (``w0`` … ``w299``, pad 0, end 1, unknown 2) in place of the published
    one: ids stay within any vocabulary, and the pipeline pads to ``max_length`` as it would."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "</s>": 1, "<unk>": 2, **{f"w{i}": i + 3 for i in range(_STAND_IN_WORDS)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="</s>", unk_token="<unk>",
                                   model_max_length=max_length)


def count_component_params(cfg: PipelineConfigs) -> dict[str, int]:
    """Parameters of each model of the pipeline, built on ``meta`` (exact, shared ones once)."""
    import torch

    with torch.device("meta"):
        pipe = build_pipeline(cfg, torch.float32)
    out: dict[str, int] = {}
    for key in cfg.components:
        m = getattr(pipe, key, None)
        if isinstance(m, torch.nn.Module):
            out[key] = sum(p.numel() for p in m.parameters())
    return out


__all__ = ["ComponentFigure", "PipelineConfigs", "PipelineEntry", "build_pipeline", "count_component_params",
           "pipeline_alias", "pipeline_entries", "pipeline_folder", "read_pipeline"]
