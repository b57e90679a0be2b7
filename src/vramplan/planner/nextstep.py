"""The cheapest change that makes a workload fit a GPU, for `fit` and `estimate` when the
answer is "no" (or a batch of 1).

Changes are tried in order of what they cost the user, and the first that fits wins:

1. a smaller batch (same job, more accumulation steps);
2. full activation checkpointing (~1/3 more compute, same results);
3. an 8-bit AdamW (bitsandbytes; states in 8 bits, a small numerical change);
4. both;
5. the loop's own savings, each with checkpointing: chunked cross-entropy (the same loss, the
   fp32 logits 1/8 at a time), the optimizer step inside backward (gradients freed one by
   one; no accumulation), activation offload to host RAM (slower: PCIe);
6. the same job sharded over 2, 4 or 8 GPUs with ZeRO-3 / FSDP (more GPUs);
7. LoRA, then QLoRA, with checkpointing (a different job: adapters are trained, not the model).

A change the workload's recipe cannot run (``vramplan.recipes``) is not suggested.

Each candidate is screened with the analytic method (milliseconds). With ``method`` trace or
auto, the first that passes the screen is confirmed by that method (a trace, seconds), and one
the trace finds too large gives way to the next (at most :data:`CONFIRMATIONS` traces); the
figure named is the confirming method's predicted device memory, and the sentence says which
method it is.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from vramplan.errors import VramplanError
from vramplan.hardware.gpu import GPU
from vramplan.models.spec import ModelSpec
from vramplan.recipes import allows
from vramplan.workload import (
    Checkpointing,
    Loss,
    Method,
    Optimizer,
    Peft,
    Rollout,
    Task,
    Workload,
)

from .evaluator import Estimator, Evaluator


@dataclass(frozen=True)
class Suggestion:
    """One change to the workload that makes it fit ``gpu``."""

    flags: str
    """The command-line flags that make the change (``--checkpointing full``)."""
    why: str
    """What the change costs, in a few words."""
    workload: Workload
    device_used: int
    """Predicted device memory per GPU with the change (analytic), bytes."""
    usable: int
    """The GPU's usable memory, bytes."""
    num_gpus: int = 1
    method: Method = Method.ANALYTIC
    """The method whose figure ``device_used`` is (trace when the screen was confirmed)."""
    screened: int | None = None
    """The analytic screen's device_used, when a trace confirmed it (else None)."""

    def sentence(self) -> str:
        from vramplan.units import fmt_bytes

        gpus = f" per GPU on {self.num_gpus} GPUs" if self.num_gpus > 1 else ""
        return (f"{self.flags} makes it fit: {fmt_bytes(self.device_used)} of {fmt_bytes(self.usable)} usable"
                f"{gpus} ({self.method}; {self.why})")

    def to_dict(self) -> dict[str, object]:
        return {"flags": self.flags, "why": self.why, "device_used": self.device_used, "usable": self.usable,
                "num_gpus": self.num_gpus, "method": str(self.method), "screened": self.screened}


CONFIRMATIONS = 3
"""At most this many candidates are confirmed by a trace (each costs seconds)."""


def _ladder(w: Workload, spec: ModelSpec) -> Iterator[tuple[str, str, dict[str, object]]]:
    ckpt = {"checkpointing": Checkpointing.FULL, "checkpoint_fraction": 1.0}
    has_ckpt = w.checkpointing is Checkpointing.FULL and w.checkpoint_fraction >= 1.0
    if w.rl and w.rollout is Rollout.VLLM:
        if not w.vllm_max_len or w.vllm_max_len > w.seq:
            yield (f"--vllm-max-len {w.seq}", "vLLM's context no longer than a prompt and its completion (TRL "
                   "`vllm_max_model_length`): it starts with a smaller KV cache pool", {"vllm_max_len": w.seq})
        if not w.vllm_sleep:
            yield ("--vllm-sleep", "vLLM's weights and KV cache released while the policy trains (TRL "
                   "`vllm_enable_sleep_mode`): copies at each wake-up", {"vllm_sleep": True})
    if w.batch > 1:
        for b in _halvings(w.batch):
            yield (f"--batch {b} --grad-accum {w.grad_accum * w.batch // b}" if w.batch % b == 0
                   else f"--batch {b}", "the same global batch in more steps", {"batch": b,
                   "grad_accum": w.grad_accum * w.batch // b if w.batch % b == 0 else w.grad_accum})
    if w.task is not Task.TRAIN:
        return
    if not has_ckpt and spec.layers:
        yield "--checkpointing full", "about 1/3 more compute, same results", ckpt
    adamw = w.optimizer in (Optimizer.ADAMW, Optimizer.ADAM)
    if adamw:
        yield "--optimizer adamw-8bit", "8-bit optimizer states (bitsandbytes)", {"optimizer": Optimizer.ADAMW_8BIT}
        if not has_ckpt and spec.layers:
            yield ("--checkpointing full --optimizer adamw-8bit", "more compute and 8-bit optimizer states",
                   {**ckpt, "optimizer": Optimizer.ADAMW_8BIT})
    yield from _loop_savings(w, spec, ckpt, has_ckpt)
    if w.parallel.dp == 1 and w.parallel.world_size == 1:
        for n in (2, 4, 8):
            yield (f"--dp {n} --zero 3" + ("" if has_ckpt else " --checkpointing full"),
                   f"the job sharded over {n} GPUs (FSDP / ZeRO-3)", {**ckpt, "dp": n, "zero": 3})
    if w.peft is Peft.NONE and spec.is_decoder:
        yield ("--peft lora" + ("" if has_ckpt else " --checkpointing full"),
               "trains LoRA adapters, not the whole model", {**ckpt, "peft": Peft.LORA})
    if w.peft is not Peft.QLORA and spec.is_decoder:
        yield ("--peft qlora" + ("" if has_ckpt else " --checkpointing full"),
               "LoRA on 4-bit base weights: slower (dequantisation)", {**ckpt, "peft": Peft.QLORA})


def _loop_savings(w: Workload, spec: ModelSpec, ckpt: dict[str, object],
                  has_ckpt: bool) -> Iterator[tuple[str, str, dict[str, object]]]:
    more = "" if has_ckpt or not spec.layers else " --checkpointing full"
    base = {} if has_ckpt or not spec.layers else ckpt
    if w.loss is Loss.FULL and spec.vocab:
        yield (f"--loss chunked{more}", "torchtune's chunked cross-entropy: the same loss, 1/8 of the fp32 logits "
               "at a time", {**base, "loss": Loss.CHUNKED})
    if not w.optimizer_in_backward and w.grad_accum == 1 and w.peft is Peft.NONE and w.parallel.world_size == 1:
        yield (f"--optimizer-in-backward{more}", "each gradient freed right after its update (no accumulation "
               "or clipping)", {**base, "optimizer_in_backward": True})
    if not w.activation_offload and spec.layers:
        yield (f"--activation-offload{more}", "saved activations in host RAM: slower (PCIe copies)",
               {**base, "activation_offload": True})


def _halvings(b: int) -> list[int]:
    out = []
    while b > 1:
        b //= 2
        out.append(max(b, 1))
    return out


def cheapest_fix(spec: ModelSpec, w: Workload, gpu: GPU, *, method: Method | str = Method.ANALYTIC,
                 estimator: Estimator | None = None) -> Suggestion | None:
    """The first change (in the order of the module docstring) that fits ``gpu``, or None:
    screened analytically, then confirmed with ``method`` unless that is analytic."""
    m = Method(method)
    ev = Evaluator(spec, estimator=estimator)
    confirmed = 0
    for flags, why, changes in _ladder(w, spec):
        try:
            cand = w.replace(**changes)
            if not allows(cand):
                continue
            r = ev.report(cand, gpu=gpu, method=Method.ANALYTIC)
        except VramplanError:
            continue
        v = r.verdict
        if v is None or not v.fits:
            continue
        if m is Method.ANALYTIC or confirmed >= CONFIRMATIONS:
            return Suggestion(flags=flags, why=why, workload=cand, device_used=r.peak.device_used,
                              usable=v.usable, num_gpus=cand.parallel.world_size)
        confirmed += 1
        try:
            t = ev.report(cand, gpu=gpu, method=m)
        except VramplanError:  # `method=trace` and this change cannot be traced: the next one
            continue
        tv = t.verdict
        if tv is not None and tv.fits:
            return Suggestion(flags=flags, why=why, workload=cand, device_used=t.peak.device_used,
                              usable=tv.usable, num_gpus=cand.parallel.world_size, method=t.method,
                              screened=r.peak.device_used if t.method is not Method.ANALYTIC else None)
    return None
