"""Best-effort category of a recorded allocation, from its stack frames and its lifetime.

A real snapshot does not say what a block holds; its frames (where it was allocated, and
where it was freed) and whether it outlived the trace usually do. The rules, first match wins:

=====  ==============================================================  =====================
rule   the allocation ...                                              category
=====  ==============================================================  =====================
vp     was written by vramplan (frame name ``"<category>: <op>"``)     that category
entry  carries a ``category`` (written by vramplan, or by PyTorch's    that category
       memory profiler: ``_memory_viz.profile_plot``)
none   has no frames (allocated before recording started, or on a      unknown
       thread without a Python stack)
kv     was allocated under ``transformers/cache_utils`` or a           kv_cache
       ``*cache*`` update / ``past_key_value`` frame
opt    was allocated in an optimizer step (``torch/optim``,            optimizer if alive at
       bitsandbytes or transformers optimizers)                        the end, else temporaries
ckpt   was allocated under ``torch/utils/checkpoint`` (recomputation)  activations
bwd    was allocated in backward (``backward`` / ``autograd`` frames)  gradients if freed by
                                                                       ``zero_grad`` / the
                                                                       optimizer or alive at
                                                                       the end, else
                                                                       temporaries
init   was allocated while building / moving / loading the model      weights
       (``_apply``, ``to``, ``cuda``, ``reset_parameters``,
       ``torch/nn/init``, ``from_pretrained``, ``load_state_dict``)
fwd    was allocated in a module's forward (``torch/nn/modules``,      activations if freed in
       ``forward``, ``_call_impl``)                                    backward or alive at the
                                                                       end, else temporaries
other  anything else                                                   unknown
=====  ==============================================================  =====================

Inputs are frames as PyTorch records them (``{"filename", "line", "name"}``, innermost
first). The result is one of :data:`vramplan.results.BREAKDOWN_KEYS` or ``"unknown"``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from vramplan.events import Category
from vramplan.results import BREAKDOWN_KEYS

UNKNOWN = "unknown"
CATEGORIES: tuple[str, ...] = (*BREAKDOWN_KEYS, UNKNOWN)

Frame = Mapping[str, Any]
_FINE_TO_BUCKET = {c.label: c.bucket for c in Category} | {k: k for k in CATEGORIES}
_PROFILER_CATEGORIES = {  # torch.profiler._memory_profiler.Category, lower-cased
    "input": "activations", "temporary": "temporaries", "activation": "activations",
    "gradient": "gradients", "autograd_detail": "temporaries", "parameter": "weights",
    "optimizer_state": "optimizer",
}
_PROFILER_FRAME = re.compile(r"^(.*)\((\d+)\): (.+)$")

_OPT_FILES = ("torch/optim/", "bitsandbytes/optim", "transformers/optimization", "torchao/optim")
_INIT_NAMES = {
    "_apply", "to", "cuda", "reset_parameters", "load_state_dict", "_load_from_state_dict",
    "from_pretrained", "_init_weights", "init_weights", "_initialize_weights", "from_config",
    "_load_state_dict_into_meta_model", "set_module_tensor_to_device", "to_empty",
}
_FWD_NAMES = {"forward", "_call_impl", "_wrapped_call_impl"}
_CPP_SUFFIXES = (".cpp", ".h", ".hpp", ".cu", ".cc", ".c")


@dataclass(frozen=True)
class Attribution:
    category: str
    rule: str


def _text(f: Frame) -> tuple[str, str]:
    """(file, function) of a frame; the profiler's ``{"filename": "none", "name": "path.py(12): fn"}``
    form is split into its parts."""
    fn, name = str(f.get("filename", "")).replace("\\", "/"), str(f.get("name", ""))
    if fn == "none":
        m = _PROFILER_FRAME.match(name)
        if m:
            return m.group(1), m.group(2)
    return fn, name


def _any(frames: Sequence[Frame], pred: Any) -> bool:
    return any(pred(*_text(f)) for f in frames)


def _is_optimizer(fn: str, name: str) -> bool:
    return any(s in fn for s in _OPT_FILES)


def _is_backward(fn: str, name: str) -> bool:
    return "backward" in name or "autograd" in fn or "autograd::Engine" in name


def _is_zero_grad(fn: str, name: str) -> bool:
    return name == "zero_grad" or name.endswith("::zero_grad")


def _is_init(fn: str, name: str) -> bool:
    return name in _INIT_NAMES or "torch/nn/init" in fn or "torch/nn/parameter" in fn


def _is_forward(fn: str, name: str) -> bool:
    return "torch/nn/modules/" in fn or name in _FWD_NAMES


def _is_kv(fn: str, name: str) -> bool:
    return "cache_utils" in fn or "past_key_value" in name or ("cache" in name.lower() and "update" in name)


def vramplan_category(frames: Sequence[Frame]) -> str | None:
    """The category vramplan wrote into a predicted snapshot's frame (``"activation: aten.mm"``).

    The frame names the event log's fine category (:class:`vramplan.events.Category` label);
    the result is its breakdown bucket.
    """
    if not frames:
        return None
    name = str(frames[0].get("name", ""))
    head, sep, _ = name.partition(": ")
    if not sep or str(frames[0].get("filename", "")).endswith(".py"):
        return None
    return _FINE_TO_BUCKET.get(head)


def entry_category(label: str) -> str | None:
    """The bucket of an entry's own ``category`` field (vramplan's, or the memory profiler's)."""
    return _FINE_TO_BUCKET.get(label) or _PROFILER_CATEGORIES.get(label)


def categorize(
    alloc_frames: Sequence[Frame], free_frames: Sequence[Frame] | None, *, alive_at_end: bool,
    label: str = "",
) -> Attribution:
    """Category of one allocation (see the module docstring for the rules).

    ``free_frames`` are the frames of the ``free_requested`` entry, ``None`` when the block was
    not freed during the trace; ``label`` is the alloc entry's ``category`` field, if any.
    """
    pred = vramplan_category(alloc_frames)
    if pred is not None:
        return Attribution(pred, "vp")
    known = entry_category(label) if label and label != UNKNOWN else None
    if known is not None:
        return Attribution(known, "entry")
    if not alloc_frames:
        return Attribution(UNKNOWN, "none")
    freed = free_frames or ()
    if _any(alloc_frames, _is_kv):
        return Attribution("kv_cache", "kv")
    if _any(alloc_frames, _is_optimizer):
        return Attribution("optimizer" if alive_at_end else "temporaries", "opt")
    if _any(alloc_frames, lambda fn, name: "torch/utils/checkpoint" in fn):
        return Attribution("activations", "ckpt")
    if _any(alloc_frames, _is_backward):
        kept = alive_at_end or _any(freed, _is_zero_grad) or _any(freed, _is_optimizer)
        return Attribution("gradients" if kept else "temporaries", "bwd")
    if _any(alloc_frames, _is_init):
        return Attribution("weights", "init")
    if _any(alloc_frames, _is_forward):
        kept = alive_at_end or _any(freed, _is_backward)
        return Attribution("activations" if kept else "temporaries", "fwd")
    return Attribution(UNKNOWN, "other")


def is_internal(f: Frame) -> bool:
    """A frame of PyTorch itself, of the interpreter, or C++ (hidden from 'where' columns)."""
    fn, name = _text(f)
    if fn.endswith(_CPP_SUFFIXES) or fn.startswith("??") or "::" in name or name.startswith("<built-in"):
        return True
    stdlib = "/lib/python3" in fn and "site-packages" not in fn
    return "/torch/" in fn or fn.startswith("torch/") or stdlib


def user_frames(frames: Sequence[Frame], n: int = 3) -> tuple[str, ...]:
    """Up to ``n`` innermost frames outside PyTorch, as ``file:line:name``.

    Falls back to PyTorch's Python frames, then to any frame, when there are no others.
    """
    def fmt(f: Frame) -> str:
        fn, name = _text(f)
        if vramplan_category([f]) is not None:  # written by vramplan: module and what
            return f"{fn}: {name}"
        if fn == "vramplan":  # vramplan's phase frame
            return f"{name.removeprefix('phase: ')} (iteration {f.get('line', 0)})"
        if f.get("filename") == "none":  # the memory profiler's frames name everything in 'name'
            return str(f.get("name", ""))
        return f"{fn.split('/')[-1]}:{f.get('line', 0)}:{name}"

    picked = [f for f in frames if not is_internal(f)]
    if not picked:
        picked = [f for f in frames if _text(f)[0].endswith(".py")]
    if not picked:
        picked = list(frames)
    return tuple(fmt(f) for f in picked[:n])
