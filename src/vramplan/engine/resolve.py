"""Names → objects: a model name or spec → :class:`ModelSpec`, a GPU name → :class:`GPU`."""

from __future__ import annotations

from ..hardware.gpu import GPU
from ..models.spec import ModelSpec


def resolve_model(model: str | ModelSpec) -> ModelSpec:
    if isinstance(model, ModelSpec):
        return model
    from ..models.catalog import resolve

    return resolve(model)


def resolve_gpu(gpu: str | GPU | None) -> GPU | None:
    if gpu is None or isinstance(gpu, GPU):
        return gpu
    from ..hardware.catalog import get_gpu

    return get_gpu(gpu)


__all__ = ["resolve_model", "resolve_gpu"]
