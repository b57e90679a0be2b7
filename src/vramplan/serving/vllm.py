"""vLLM: its start-up sizing rules (:mod:`vramplan.pools.vllm`) on vramplan's own estimate of the
profile run's forward (:func:`vramplan.engine.forward.forward`)."""

from __future__ import annotations

from vramplan.engine.encoder import encoder
from vramplan.engine.forward import forward
from vramplan.errors import WorkloadError
from vramplan.hardware.gpu import GPU
from vramplan.models import vlm
from vramplan.models.spec import ModelSpec
from vramplan.pools import mm, mxfp4
from vramplan.pools import vllm as rules
from vramplan.pools.kvspec import layer_specs
from vramplan.pools.result import ServePlan
from vramplan.pools.vllm import LORA_RANKS, VERSION, VllmSettings, command

DEFAULTS = VllmSettings()


def plan(spec: ModelSpec, gpu: GPU, *, tp: int = 1, pp: int = 1, quant: str = "none", dtype: str = "bf16",
         settings: VllmSettings = DEFAULTS, avg_request_len: int | None = None,
         method: str = "analytic") -> ServePlan:
    """A vision-language model is its language model (KV cache, profile forward) plus its vision
    tower (weights, the multimodal profile's encode: :mod:`vramplan.pools.mm`)."""
    mm.check(spec, settings.mm)
    if spec.model_type == "mllama":
        raise WorkloadError(f"serving {spec.name} (Llama 3.2 Vision: cross-attention to the image tiles, an "
                            "encoder-decoder cache in vLLM) is not modelled", hint="plan a Qwen-VL, Gemma 3 or LLaVA model")
    text = vlm.text_spec(spec)
    # vLLM's own refusals of the layout (heads per rank) come before its profile run
    layer_specs(text, tp=tp, pp=pp, kv_cache_dtype=settings.kv_cache_dtype, engine="vllm")
    mnbt = rules.profile_tokens(gpu, settings)
    align = mxfp4.marlin_align(text, gpu, settings.engine_version) if quant == "mxfp4" else None
    fwd = forward(text, tokens=mnbt, tp=tp, pp=pp, quant=quant, dtype=dtype, method=method, mxfp4_align=align)
    enc = None
    if vlm.is_vlm(spec):
        if quant != "none":
            raise WorkloadError(f"quantised serving of a vision-language model ({spec.name}) is not modelled",
                                hint="use quantization none")
        prof = mm.profile(spec, max_model_len=settings.max_model_len or text.max_positions,
                          max_num_batched_tokens=mnbt, max_num_seqs=settings.max_num_seqs or rules.default_max_num_seqs(gpu, settings.engine_version),
                          mm=settings.mm, version=settings.engine_version)
        enc = encoder(spec, prof, dtype=dtype, tp=tp, gpu=gpu, out_hidden=text.hidden)
    return rules.plan(text, gpu, fwd, tp=tp, pp=pp, quant=quant, dtype=dtype, settings=settings,
                      avg_request_len=avg_request_len, encoder=enc)


__all__ = ["LORA_RANKS", "VERSION", "VllmSettings", "command", "plan"]
