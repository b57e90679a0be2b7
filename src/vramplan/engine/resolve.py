"""Names → objects: a model name or spec → :class:`ModelSpec`, a GPU name → :class:`GPU`."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..models.spec import ModelSpec

if TYPE_CHECKING:
    from ..hardware.gpu import GPU


def resolve_model(model: str | ModelSpec) -> ModelSpec:
    if isinstance(model, ModelSpec):
        return model
    from ..models.catalog import resolve

    return resolve(model)


def resolve_gpu(gpu: str | GPU | None) -> GPU | None:
    if gpu is None:
        return None
    # imported only once a GPU is named: an estimate without one never loads the class (start-up)
    from ..hardware.gpu import GPU

    if isinstance(gpu, GPU):
        return gpu
    from ..hardware.catalog import get_gpu

    return get_gpu(gpu)


__all__ = ["resolve_model", "resolve_gpu"]
