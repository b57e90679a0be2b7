"""vLLM: its start-up sizing rules (:mod:`vramplan.pools.vllm`) on vramplan's own estimate of the
profile run's forward (:func:`vramplan.engine.forward.forward`)."""

from __future__ import annotations

from vramplan.engine.forward import forward
from vramplan.hardware.gpu import GPU
from vramplan.models.spec import ModelSpec
from vramplan.pools import vllm as rules
from vramplan.pools.kvspec import layer_specs
from vramplan.pools.result import ServePlan
from vramplan.pools.vllm import LORA_RANKS, VERSION, VllmSettings, command

DEFAULTS = VllmSettings()


def plan(spec: ModelSpec, gpu: GPU, *, tp: int = 1, pp: int = 1, quant: str = "none", dtype: str = "bf16",
         settings: VllmSettings = DEFAULTS, avg_request_len: int | None = None,
         method: str = "analytic") -> ServePlan:
    # vLLM's own refusals of the layout (heads per rank) come before its profile run
    layer_specs(spec, tp=tp, pp=pp, kv_cache_dtype=settings.kv_cache_dtype, engine="vllm")
    fwd = forward(spec, tokens=rules.profile_tokens(gpu, settings), tp=tp, pp=pp, quant=quant, dtype=dtype,
                  method=method)
    return rules.plan(spec, gpu, fwd, tp=tp, pp=pp, quant=quant, dtype=dtype, settings=settings,
                      avg_request_len=avg_request_len)


__all__ = ["LORA_RANKS", "VERSION", "VllmSettings", "command", "plan"]
