"""``from_pretrained`` without weights: the model is built from its config on the fake device.

A script's ``AutoModelForCausalLM.from_pretrained("meta-llama/Llama-3.1-8B", dtype=…)`` would
download and read 16 GB of weights; under ``vramplan run`` it resolves the config the way
``vramplan estimate`` does (embedded catalog alias or Hub id, a local folder's config.json, or
the Hub when online) and builds the same class from it on ``meta`` — every parameter exists
with its shape and dtype, none is read. transformers is patched only once the script imports
it (an import hook), so scripts that never use it pay nothing.

Follows transformers 5's loading rules for what matters to memory: ``dtype``/``torch_dtype``
(``"auto"`` or absent: the checkpoint's ``torch_dtype`` from its config, transformers 5's
default), ``attn_implementation``, ``quantization_config`` (and the checkpoint's own one): the
quantised layers each library loads (:mod:`.quantized`).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import _disable_current_modes

from ..emulate.imports import patched_on_import, replace
from ..errors import TraceError
from ..target import DEFAULT_PROFILE, DeviceProfile
from . import quantized


@dataclasses.dataclass
class Loading:
    """What a ``from_pretrained`` under ``vramplan run`` needs of the run (:func:`weightless_from_pretrained`)."""

    device: DeviceProfile = DEFAULT_PROFILE
    notes: list[str] = dataclasses.field(default_factory=list)
    host_scope: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext
    """Books the tensors made inside it on the host."""
    book: Callable[[nn.Module], None] = lambda model: None
    """Records a model's parameters and buffers as device memory, now."""
    spread: Callable[[nn.Module, dict[str, Any]], list[str]] | None = None
    """Places a built model's tensors as a device map says (GPU 0, the other emulated GPUs, the
    host) and dispatches it as transformers does; returns notes (None: the run cannot, and the
    whole model stays on GPU 0)."""


_context: list[Loading] = []

_building = [0]


def building() -> bool:
    """A ``from_pretrained`` stand-in is being built (its ``meta`` tensors stand for host weights)."""
    return _building[0] > 0


def _config_dict(name: str) -> dict[str, Any]:
    from ..models.catalog import resolve

    spec = resolve(str(name))
    return {k: v for k, v in spec.config.items() if k != "auto_map"}


def _dtype(value: Any, config: Any) -> torch.dtype | None:
    if isinstance(value, torch.dtype):
        return value
    if value in (None, "auto"):
        value = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
        if isinstance(value, torch.dtype):
            return value
    if isinstance(value, str):
        t = getattr(torch, value.removeprefix("torch."), None)
        if isinstance(t, torch.dtype):
            return t
    return None


def _build(klass: Any, config: Any, kwargs: dict[str, Any], model_kwargs: dict[str, Any]) -> Any:
    qc = quantized.requested(kwargs, config)
    dtype = _dtype(kwargs.get("dtype", kwargs.get("torch_dtype")), config)
    if qc is not None:
        dtype = quantized.load_dtype(qc, dtype)
    extra: dict[str, Any] = {}
    if kwargs.get("attn_implementation"):
        extra["attn_implementation"] = kwargs["attn_implementation"]
    if dtype is not None:
        extra["dtype"] = dtype
    run = _context[-1] if _context else Loading()
    on_host = _loads_on_host(kwargs.get("device_map"), qc)
    quant_notes = _quantized_map(qc, kwargs.get("device_map"), on_host)
    # transformers builds the model empty and loads each weight into place (tied weights tied
    # first; a quantised weight quantised as it is read): no construction-time tensor is device
    # memory. The model is built unrecorded and its parameters and buffers are then booked on
    # the device; a model loaded without a GPU device_map is host memory instead (booked there:
    # the script moves it, or runs on the CPU)
    _building[0] += 1
    try:
        with torch.device("meta"), run.host_scope() if on_host else _disable_current_modes():
            model = klass._from_config(config, **extra, **model_kwargs)  # (meta tensors stand for loaded weights)
            if qc is not None:
                run.notes += quantized.apply(model, qc, run.device)
    finally:
        _building[0] -= 1
    placement = None
    run.notes += quant_notes
    if qc is None and kwargs.get("device_map") in _STRATEGIES:  # (before booking: GPU 0's free memory as transformers reads it)
        placement, notes = _auto_placement(model, kwargs["device_map"], kwargs.get("max_memory"), run.spread is not None)
        run.notes += notes
    elif isinstance(kwargs.get("device_map"), dict) and not on_host and not quant_notes:
        placement = dict(kwargs["device_map"])  # (a quantised model's too: its layers go where the map says)
    if placement is not None and run.spread is not None and _spreads(placement):
        # (not building: accelerate's dispatch runs as in a real load, its ``.to("meta")`` of an
        # offloaded weight a tensor on meta)
        run.notes += run.spread(model, placement)
    elif not on_host:
        _building[0] += 1
        try:
            run.book(model)
        finally:
            _building[0] -= 1
    model.eval()  # from_pretrained returns a model in eval mode
    return model


def _quantized_map(qc: Any, device_map: Any, on_host: bool) -> list[str]:
    """A quantised model's device map. A dict over GPUs only is placed as any model's (each quantised
    layer loads on its device; transformers dispatches a map over several devices alike). One with
    the CPU or the disk: bitsandbytes refuses it without ``llm_int8_enable_fp32_cpu_offload``
    (transformers 5.24.0 quantizers/quantizer_bnb_4bit.py:71-81, quantizer_bnb_8bit.py:71-81: the
    same ``ValueError``: the run stops there, as the real one does); with it, or with another format, the offloaded
    layers are not emulated — a note says the whole model stays on GPU 0, as does a placement
    strategy (``"auto"``…), whose quantised sizes transformers computes with the quantizer's
    adjustments (not emulated)."""
    if qc is None or on_host or device_map is None:
        return []
    if isinstance(device_map, dict):
        host = {str(v) for v in device_map.values() if _host_name(v)}
        if not host:
            return []
        if quantized.method(qc) == "bitsandbytes" and not quantized._get(qc, "llm_int8_enable_fp32_cpu_offload", False):
            raise TraceError(f"from_pretrained: a device_map with {' and '.join(sorted(host))} for a bitsandbytes model: "
                             "transformers' quantizer raises ValueError (\"Some modules are dispatched on the CPU or "
                             "the disk…\") — the real run stops here too",
                             hint="map every module to a GPU, or pass BitsAndBytesConfig(…, "
                             "llm_int8_enable_fp32_cpu_offload=True)")
        return [f"device_map with {' and '.join(sorted(host))} for a {quantized.method(qc)}-quantised model: the "
                "offload of quantised layers is not emulated; vramplan run keeps the whole model on GPU 0 (the "
                "figures are the whole model on one GPU)"]
    if device_map in _STRATEGIES and torch.cuda.device_count() > 1:  # (one GPU: the whole model is there)
        return [f"device_map={device_map!r} for a {quantized.method(qc)}-quantised model: transformers' placement of "
                "quantised weights is not emulated; vramplan run keeps the whole model on GPU 0 (a real load may "
                "spread it over GPUs or offload part of it)"]
    return []


_STRATEGIES = ("auto", "balanced", "balanced_low_0", "sequential")
"""The ``device_map`` values transformers computes a placement for (``_get_device_map``)."""


def _spreads(placement: dict[str, Any]) -> bool:
    """A device map over more than one device, or with the disk: transformers then dispatches the
    model with accelerate's hooks (transformers 5.24 modeling_utils.py:4464-4466). (A map with one
    GPU stays the emulated GPU's, whichever its index.)"""
    devices = {_gpu_key(d) for d in placement.values()}
    return len(devices) > 1 or "disk" in devices


def _gpu_key(dev: Any) -> str:
    key = str(dev)
    return "GPU 0" if key in ("0", "cuda", "cuda:0") else f"GPU {key.removeprefix('cuda:')}" \
        if key.removeprefix("cuda:").isdigit() else key


def _auto_placement(model: Any, strategy: str, max_memory: Any,
                    emulated: bool = False) -> tuple[dict[str, Any] | None, list[str]]:
    """What transformers does with ``device_map=strategy``: its own ``_get_device_map``
    (transformers/integrations/accelerate.py: accelerate's ``get_balanced_memory`` and
    ``infer_auto_device_map`` over each GPU's ``mem_get_info`` — the emulated GPUs' — and this
    machine's RAM), run on the model as built: (the placement, notes). ``emulated``: the run
    places the model that way (:attr:`Loading.spread`); otherwise, when the placement leaves GPU 0,
    a note says that the run keeps the whole model on GPU 0 where a real load would spread or
    offload it."""
    try:
        from accelerate.utils import compute_module_sizes
        from transformers.integrations.accelerate import _get_device_map

        placement = _get_device_map(model, strategy, max_memory, None)
        sizes = compute_module_sizes(model)
    except Exception as e:  # noqa: BLE001 (a note only: say why it could not be computed)
        return None, [f"device_map={strategy!r}: the whole model is on GPU 0; transformers' placement could not be "
                      f"computed here ({type(e).__name__}: {str(e)[:120]}), so a real load may spread it over GPUs "
                      "or offload part of it"]
    where: dict[str, int] = {}
    for name, dev in placement.items():
        key = _gpu_key(dev)
        where[key] = where.get(key, 0) + sizes.get(name, 0)
    if set(where) <= {"GPU 0"}:
        return placement, []
    gib = ", ".join(f"{k} {_size(v)}" for k, v in where.items())
    if emulated:
        return placement, [f"device_map={strategy!r}: transformers places the weights as {gib} (accelerate's "
                           "infer_auto_device_map over the emulated GPUs' free memory and this machine's RAM)"]
    return placement, [f"device_map={strategy!r}: transformers would place the weights as {gib} (accelerate's "
                       "infer_auto_device_map over the emulated GPUs' free memory and this machine's RAM); vramplan "
                       f"run keeps the whole model ({_size(sizes.get('', 0))}) on GPU 0 and does not emulate the "
                       "split or the offload: the figures are the whole model on one GPU"]


def _size(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.2f} MiB"


def _loads_on_host(device_map: Any, qc: Any) -> bool:
    """Where transformers 5 puts the weights: ``device_map`` absent or ``None`` keeps them on
    the CPU, except for bitsandbytes and fine-grained fp8, whose quantizers set it to the current
    GPU (``update_device_map``); ``"cpu"``/``"disk"`` (or a map with only those) is the host;
    anything else (``"auto"``, ``"cuda"``, an index, a map naming a GPU) the GPU."""
    if device_map is None:
        return qc is None or quantized.method(qc) not in ("bitsandbytes", "fp8")
    if isinstance(device_map, dict):
        return all(_host_name(v) for v in device_map.values()) if device_map else True
    return _host_name(device_map)


def _host_name(where: Any) -> bool:
    if isinstance(where, torch.device):
        return where.type == "cpu"
    return str(where).split(":")[0] in ("cpu", "disk", "meta")


_HUB = frozenset({"cache_dir", "force_download", "local_files_only", "proxies", "revision", "subfolder", "token",
                  "code_revision", "_commit_hash", "trust_remote_code", "user_agent", "_from_auto", "_from_pipeline"})
"""Where a config is read from (transformers 5.24 ``AutoConfig.from_pretrained`` / ``get_config_dict``)."""

_LOADING = frozenset({
    # transformers 5.24 modeling_utils.PreTrainedModel.from_pretrained: its own parameters …
    "config", "cache_dir", "ignore_mismatched_sizes", "force_download", "local_files_only", "token", "revision",
    "use_safetensors", "weights_only", "fusion_config", "disable_mmap",
    # … and what it pops from its kwargs before the rest reach the model's __init__
    "proxies", "tqdm_class", "output_loading_info", "_from_pipeline", "_from_auto", "dtype", "torch_dtype",
    "device_map", "max_memory", "offload_folder", "offload_buffers", "quantization_config", "subfolder",
    "_commit_hash", "variant", "adapter_kwargs", "adapter_name", "generation_config", "gguf_file",
    "distributed_config", "device_mesh", "tp_plan", "tp_size", "trust_remote_code", "allow_all_kernels",
    "use_kernels", "kernel_config", "key_mapping", "state_dict", "attn_implementation", "experts_implementation",
    "low_cpu_mem_usage", "code_revision", "load_in_4bit", "load_in_8bit", "offload_state_dict",
})
"""What ``from_pretrained`` takes for loading (never a config attribute or a model argument)."""


def _config(name: Any, kwargs: dict[str, Any] | None = None) -> tuple[Any, dict[str, Any]]:
    """The config ``from_pretrained`` would read for ``name``, with ``kwargs`` applied as
    transformers applies them (its own ``PreTrainedConfig.from_dict``: a key the config has sets
    that attribute, ``num_labels`` its label maps), and the kwargs it left (the model's)."""
    from transformers import CONFIG_MAPPING

    cfg = _config_dict(name)
    model_type = cfg.pop("model_type", None)
    qc = cfg.pop("quantization_config", None)
    kw = {k: v for k, v in (kwargs or {}).items() if k not in _HUB and k != "quantization_config"
          and not (k in ("dtype", "torch_dtype") and v == "auto")}
    config, unused = CONFIG_MAPPING[model_type].from_dict(cfg, return_unused_kwargs=True, **kw)
    if qc is not None:  # a quantised checkpoint's own config: from_pretrained applies it
        config._vramplan_quantization_config = qc
    return config, unused


def _model_kwargs(config: Any, name_or_path: Any, kwargs: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    """(config, the model's own keyword arguments), as ``from_pretrained`` splits its kwargs: without
    a config object, the config's attributes set from them; the rest, less what loading takes,
    go to the model's ``__init__`` (where an unknown one fails as it fails in transformers)."""
    if config is None or isinstance(config, str):
        config, rest = _config(config or name_or_path, kwargs)
    else:
        rest = dict(kwargs)
    return config, {k: v for k, v in rest.items() if k not in _LOADING and k not in _HUB}


def _named(model: Any, name_or_path: Any) -> Any:
    """The model and its config remember where they came from, as ``from_pretrained`` leaves
    them (TRL's trainers load the tokenizer from ``config._name_or_path``)."""
    name = str(name_or_path)
    try:
        model.config._name_or_path = name
        model.name_or_path = name
    except AttributeError:
        pass
    return model


def _patch_model(mu: Any, undo: contextlib.ExitStack) -> None:
    def from_pretrained(klass: Any, name_or_path: Any, *args: Any, **kwargs: Any) -> Any:
        config, model_kwargs = _model_kwargs(kwargs.get("config"), name_or_path, kwargs)
        return _named(_build(klass, config, kwargs, model_kwargs), name_or_path)

    replace(undo, mu.PreTrainedModel, "from_pretrained", classmethod(from_pretrained))


def _patch_auto(af: Any, undo: contextlib.ExitStack) -> None:
    def from_pretrained(klass: Any, name_or_path: Any, *args: Any, **kwargs: Any) -> Any:
        config, model_kwargs = _model_kwargs(kwargs.get("config"), name_or_path, kwargs)
        model_class = af._get_model_class(config, klass._model_mapping)
        return _named(_build(model_class, config, kwargs, model_kwargs), name_or_path)

    from_pretrained.__vramplan__ = True  # type: ignore[attr-defined]
    base = af._BaseAutoModelClass
    original = vars(base)["from_pretrained"]
    # each Auto class carries its own copy of the method (``auto_class_update`` copies the base's
    # when the class is made): patch them all, and afterwards put the original back on every class
    # made while the patch was in place too (they copied the patched one)
    for c in _auto_classes(base):
        if "from_pretrained" in c.__dict__:
            replace(undo, c, "from_pretrained", classmethod(from_pretrained))
    undo.callback(_unpatch_auto_classes, base, original)


def _auto_classes(base: Any) -> list[Any]:
    out, stack = [], [base]
    while stack:
        c = stack.pop()
        out.append(c)
        stack.extend(c.__subclasses__())
    return out


def _unpatch_auto_classes(base: Any, original: Any) -> None:
    for c in _auto_classes(base):
        fn = c.__dict__.get("from_pretrained")
        if getattr(getattr(fn, "__func__", None), "__vramplan__", False):
            c.from_pretrained = original


def _patch_config(ca: Any, undo: contextlib.ExitStack) -> None:
    def from_pretrained(klass: Any, name_or_path: Any, **kwargs: Any) -> Any:
        wanted = kwargs.pop("return_unused_kwargs", False)
        config, unused = _config(name_or_path, kwargs)
        config._name_or_path = str(name_or_path)
        return (config, unused) if wanted else config

    replace(undo, ca.AutoConfig, "from_pretrained", classmethod(from_pretrained))


@contextlib.contextmanager
def weightless_from_pretrained(run: Loading | None = None) -> Iterator[None]:
    """Within the block, transformers' ``from_pretrained`` builds on meta from the config
    (transformers is patched when the script imports it: :func:`~vramplan.emulate.imports.patched_on_import`);
    ``run``: the run's device, notes and bookings."""
    _context.append(run or Loading())
    try:
        with patched_on_import({
            "transformers.modeling_utils": _patch_model,
            "transformers.models.auto.auto_factory": _patch_auto,
            "transformers.models.auto.configuration_auto": _patch_config,
        }):
            yield
    finally:
        _context.pop()
