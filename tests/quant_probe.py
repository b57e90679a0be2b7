"""The real quantisation libraries' layers on the CPU: what they store, and the peak of new
storage one forward (and compressed-tensors' decompression) allocates.

Run in a child process with ``.quant-deps`` on the path (tests/test_quant_formats.py): prints one
JSON object per format. :func:`peak_of` is imported by the test too, to measure vramplan's own
layers the same way. Only torch at module level: the libraries are imported per format.
"""

from __future__ import annotations

import json
import sys
import warnings
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_leaves

D_IN, D_OUT = 256, 512
X_SHAPE = (4, 64, D_IN)


class _Peak(TorchDispatchMode):
    """Live bytes of storages created by ops inside the mode (the peak of new memory)."""

    def __init__(self, known: list[torch.Tensor]) -> None:
        super().__init__()
        self.known = {t.untyped_storage().data_ptr() for t in known}
        self.live: dict[int, list[int]] = {}
        self.now = self.peak = 0

    def _drop(self, ptr: int) -> None:
        entry = self.live.get(ptr)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] == 0:
            self.now -= entry[0]
            del self.live[ptr]

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor) or is_traceable_wrapper_subclass(t):
                continue
            st = t.untyped_storage()
            ptr = st.data_ptr()
            if ptr == 0 or ptr in self.known:
                continue
            if ptr not in self.live:
                self.live[ptr] = [st.nbytes(), 0]
                self.now += st.nbytes()
                self.peak = max(self.peak, self.now)
            self.live[ptr][1] += 1
            weakref.finalize(t, self._drop, ptr)
        return out


def peak_of(fn: Callable[[], Any], known: list[torch.Tensor]) -> int:
    """Peak bytes of new storage while ``fn`` runs (its result dropped at once)."""
    mode = _Peak(known)
    with torch.no_grad(), mode:
        out = fn()
        del out
    return mode.peak


def _inner(t: torch.Tensor, name: str) -> list[tuple[str, str, list[int]]]:
    if is_traceable_wrapper_subclass(t):
        names, _ = t.__tensor_flatten__()  # type: ignore[attr-defined]
        return [x for n in names for x in _inner(getattr(t, n), n)]
    return [(name, str(t.dtype).removeprefix("torch."), list(t.shape))]


def _linear() -> nn.Linear:
    torch.manual_seed(0)
    return nn.Linear(D_IN, D_OUT, bias=True, dtype=torch.bfloat16)


def _x() -> torch.Tensor:
    torch.manual_seed(1)
    return torch.randn(X_SHAPE, dtype=torch.bfloat16)


def hqq() -> dict[str, Any]:
    from hqq.core.quantize import BaseQuantizeConfig, HQQLinear

    cfg = BaseQuantizeConfig(nbits=4, group_size=64, axis=1)  # transformers' HqqConfig defaults
    layer = HQQLinear(_linear(), quant_config=cfg, compute_dtype=torch.bfloat16, device="cpu")
    stored = [("W_q", *_inner(layer.W_q, "W_q")[0][1:])]
    stored += [(k, str(layer.meta[k].dtype).removeprefix("torch."), list(layer.meta[k].shape)) for k in ("scale", "zero")]
    x = _x()
    known = [x, layer.W_q, layer.meta["scale"], layer.meta["zero"], layer.bias]
    return {"stored": stored, "forward": peak_of(lambda: layer(x), known)}


def _torchao(config: Any) -> dict[str, Any]:
    from torchao.quantization import quantize_

    lin = _linear()
    quantize_(lin, config)
    stored = _inner(lin.weight, "weight")
    x = _x()
    inner = [getattr(lin.weight, n) for n in lin.weight.__tensor_flatten__()[0]]
    return {"stored": stored, "forward": peak_of(lambda: lin(x), [x, *inner, lin.bias])}


def ao_int8() -> dict[str, Any]:
    from torchao.quantization import Int8WeightOnlyConfig

    return _torchao(Int8WeightOnlyConfig())


def ao_int8_dyn() -> dict[str, Any]:
    from torchao.quantization import Int8DynamicActivationInt8WeightConfig

    out = _torchao(Int8DynamicActivationInt8WeightConfig())
    del out["forward"]  # (its CPU path skips the CUDA path's contiguous weight copy: not compared)
    return out


def ao_fp8() -> dict[str, Any]:
    from torchao.quantization import Float8WeightOnlyConfig

    return _torchao(Float8WeightOnlyConfig())


def _ct(scheme: str) -> dict[str, Any]:
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.compressors.base import decompress_module
    from compressed_tensors.quantization import (
        QuantizationConfig,
        QuantizationStrategy,
        apply_quantization_config,
        preset_name_to_scheme,
    )
    from compressed_tensors.quantization.utils import calculate_qparams

    model = nn.Sequential(_linear())
    sch = preset_name_to_scheme(scheme, ["Linear"])
    apply_quantization_config(model, QuantizationConfig(config_groups={"g": sch}, quantization_status="frozen"))
    lin = model[0]
    w, wa = lin.weight.data, sch.weights
    if wa.strategy == QuantizationStrategy.GROUP:  # min/max observer stand-in
        g = w.unflatten(-1, (w.shape[-1] // wa.group_size, wa.group_size))
        lo, hi = g.amin(-1), g.amax(-1)
    else:
        lo, hi = w.amin(-1, keepdim=True), w.amax(-1, keepdim=True)
    scale, _zp = calculate_qparams(lo, hi, wa)
    lin.weight_scale.data.copy_(scale.to(lin.weight_scale.dtype))
    ModelCompressor.from_pretrained_model(model).compress_model(model)
    named = list(lin.named_parameters(recurse=False)) + list(lin.named_buffers(recurse=False))
    stored = [(n, str(t.dtype).removeprefix("torch."), list(t.shape)) for n, t in named if n != "bias"]
    decompress = peak_of(lambda: decompress_module(lin), [t for _, t in named])
    x = _x()
    forward = peak_of(lambda: lin(x), [x, *lin.parameters(), *lin.buffers()])
    return {"stored": stored, "decompress": decompress, "forward": forward}


PROBES: dict[str, Callable[[], dict[str, Any]]] = {
    "hqq": hqq, "ao-int8": ao_int8, "ao-int8-dyn": ao_int8_dyn, "ao-fp8": ao_fp8,
    "ct-w4a16": lambda: _ct("W4A16"), "ct-w8a8": lambda: _ct("W8A8"), "ct-fp8": lambda: _ct("FP8_DYNAMIC"),
}

if __name__ == "__main__":
    warnings.filterwarnings("ignore")
    out: dict[str, Any] = {}
    for key in sys.argv[1:] or list(PROBES):
        out[key] = PROBES[key]()
    print("QUANT-PROBE " + json.dumps(out))
