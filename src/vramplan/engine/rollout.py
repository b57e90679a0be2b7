"""A rollout engine colocated with the trainer (GRPO ``rollout=vllm``), sized by its own rules.

TRL 1.16's ``VLLMGeneration._init_vllm`` (trl/generation/vllm_generation.py, ``vllm_mode=
"colocate"``) starts ``vllm.LLM`` in the trainer's process after the model is on the device, with
``gpu_memory_utilization=vllm_gpu_memory_utilization`` (GRPOConfig default 0.3),
``max_model_len=vllm_max_model_length`` (default None: vLLM takes the model's), ``max_num_seqs =
per_device_train_batch_size x vllm_tensor_parallel_size x steps_per_generation``,
``max_num_batched_tokens=4096`` and ``enable_sleep_mode=vllm_enable_sleep_mode``; CUDA graphs are
captured (no ``enforce_eager``). The engine's blocks follow the vLLM start-up sizing of
:mod:`vramplan.pools.vllm` for this GPU, on vramplan's estimate of its profile run's forward
(:mod:`.forward`); the trainer's step places them in its own allocator
(:mod:`vramplan.trace.grpo`, :mod:`vramplan.analytic.grpo`).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from ..recipes import TRL_ROLLOUT
from ..target import DeviceProfile, RolloutEngine, rollout_unsized
from ..units import GiB
from ..workload import Peft, Rollout, Workload

if TYPE_CHECKING:
    from vramplan.hardware.gpu import GPU
    from vramplan.models.spec import ModelSpec

MAX_NUM_BATCHED_TOKENS = TRL_ROLLOUT.max_num_batched_tokens
"""trl/generation/vllm_generation.py: ``max_num_batched_tokens=4096`` ("the v1 memory profiler is
misled by the high default value"). Other recipes' engines: ``RecipeSpec.rollout``."""


def with_rollout(dev: DeviceProfile, spec: ModelSpec, w: Workload, g: GPU | None) -> DeviceProfile:
    """``dev`` with ``w``'s colocated rollout engine sized for ``g`` (unchanged without one)."""
    if not w.rl or w.rollout is not Rollout.VLLM:
        return dev if dev.rollout is None else dataclasses.replace(dev, rollout=None)
    if g is None:
        raise rollout_unsized()
    return dataclasses.replace(dev, rollout=engine(spec, w, g))


def engine(spec: ModelSpec, w: Workload, g: GPU) -> RolloutEngine:
    from .. import recipes
    from ..pools import vllm
    from ..pools.base import serving_dtype
    from .forward import forward

    rules = recipes.get(w.recipe).rollout
    version = rules.engine_version
    seqs = w.batch * w.grad_accum if rules.window_seqs else rules.max_num_seqs
    settings = vllm.VllmSettings(
        engine_version=version, gpu_memory_utilization=w.vllm_memory, max_model_len=w.vllm_max_len or None,
        max_num_seqs=seqs, max_num_batched_tokens=rules.max_num_batched_tokens)
    quant = "bitsandbytes" if w.peft is Peft.QLORA else "none"  # (TRL passes quantization="bitsandbytes")
    dtype = serving_dtype(spec, "auto")
    mnbt = vllm.profile_tokens(g, settings)
    fwd = forward(spec, tokens=mnbt, tp=1, pp=1, quant=quant, dtype=dtype)
    sp = vllm.plan(spec, g, fwd, quant=quant, dtype=dtype, settings=settings)
    st = sp.settings
    summary = (f"vLLM {version} colocated ({rules.framework}): gpu_memory_utilization "
               f"{w.vllm_memory}, max_model_len {st['max_model_len']:,}, max_num_seqs {st['max_num_seqs']}, "
               f"max_num_batched_tokens {st['max_num_batched_tokens']:,}, CUDA graphs, sleep mode "
               f"{'on (level 2)' if w.vllm_sleep else 'off'}: budget {sp.budget / GiB:.2f} GiB = weights "
               f"{sp.weights / GiB:.2f} + profile peak {sp.profile_peak / GiB:.2f} + non-torch "
               f"{sp.non_torch / GiB:.2f} + KV cache {sp.kv_pool / GiB:.2f} GiB ({sp.tokens:,} tokens); CUDA graphs "
               f"{sp.cuda_graph / GiB:.2f} GiB beside it")
    return RolloutEngine(
        engine=f"vLLM {version}", budget=sp.budget, weights=sp.weights if sp.starts else 0,
        kv_pool=sp.kv_pool, graphs=sp.cuda_graph, activations=sp.profile_peak if sp.starts else 0,
        sleep=w.vllm_sleep, refusal=sp.error or "", summary=summary)


def refusal(dev: DeviceProfile, weights: int, w: Workload) -> str:
    """The colocated engine's start-up refusal, verbatim (empty: it starts): its own (the KV pool
    cannot hold one sequence of ``max_model_len``), else ``Worker.init_device``'s when the
    trainer's model already on the device (``weights``, the engine's own copy excluded) with the
    CUDA context leaves less free than its budget."""
    from .. import recipes
    from ..pools.base import context_bytes
    from ..pools.vllm_release import Release

    e = dev.rollout
    assert e is not None and dev.usable is not None
    if e.refusal:
        return e.refusal
    trainer = weights - (0 if e.sleep else e.weights)  # (before vLLM starts)
    free = dev.usable - context_bytes(dev.overhead) - trainer
    return Release.of(recipes.get(w.recipe).rollout.engine_version).startup_error(free, dev.usable, w.vllm_memory, e.budget) if free < e.budget else ""


__all__ = ["MAX_NUM_BATCHED_TOKENS", "engine", "refusal", "with_rollout"]
