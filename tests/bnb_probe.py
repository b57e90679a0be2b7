"""bitsandbytes QLoRA run for real on the CPU, next to the trace of the same workload (run with
``.quant-deps`` on the path by tests/test_bnb_qlora.py; prints one ``BNB-PROBE`` JSON line of
per-phase peaks). docs/research/bnb-qlora.md has the figures and the sources read.

The real side is what a QLoRA recipe runs: a tiny random Llama saved locally, loaded by
transformers' ``from_pretrained`` with ``BitsAndBytesConfig(load_in_4bit, nf4, double quant,
compute dtype)`` (bitsandbytes ``Linear4bit`` layers with ``Params4bit`` weights), peft LoRA on
every linear (peft's ``lora.bnb.Linear4bit`` wrapper), optionally after
``prepare_model_for_kbit_training`` (without its gradient checkpointing: that is the
``checkpointing`` knob), two AdamW steps, the live CPU storages counted per phase of the second
(:func:`_phase_peaks`). The trace side is ``trace_model`` of the plain bf16 model with
``peft=qlora``.
"""

from __future__ import annotations

import json
import sys
import tempfile
import warnings

import torch

from vramplan.trace.run import TraceOptions, trace_model
from vramplan.workload import Workload

NO_WS = TraceOptions(workspaces=False, count_flops=False)
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
RANK = 8


def _config() -> object:
    from transformers import LlamaConfig

    return LlamaConfig(hidden_size=256, intermediate_size=1024, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, vocab_size=256, max_position_embeddings=64, dtype="bfloat16")


def _plain() -> torch.nn.Module:
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    m = LlamaForCausalLM(_config()).to(torch.bfloat16)
    m.config._attn_implementation = "eager"
    return m


def _inputs() -> dict:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 256, (1, 16), generator=g)
    return {"input_ids": ids, "labels": ids}


def _quant_state(model: torch.nn.Module) -> list[torch.Tensor]:
    """The tensors of each ``Params4bit``'s quant state (absmax, code; nested: the second
    level's absmax and code, the offset): held by the weight, neither parameter nor buffer."""
    out: list[torch.Tensor] = []
    for p in model.parameters():
        qs = getattr(p, "quant_state", None)
        if qs is not None:
            out += [qs.absmax, qs.code]
            if qs.nested:
                out += [qs.state2.absmax, qs.state2.code, qs.offset]
    return out


def _phase_peaks(model: torch.nn.Module, inputs: dict, iterations: int = 2) -> dict:
    """The peak of live CPU storages in each phase of the last of ``iterations`` AdamW steps,
    measured as :func:`vramplan.trace.testing.real_peak` measures a step (the same tracker:
    weights, quant state, inputs and every op's outputs)."""
    from vramplan.trace.testing import _StoragePeak

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    tracker = _StoragePeak()
    for t in [*model.parameters(), *model.buffers(), *_quant_state(model), *inputs.values()]:
        tracker.add(t)
    peaks: dict = {"setup": tracker.current}
    try:
        with tracker:
            opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4, foreach=True)
            for _ in range(iterations):
                tracker.peak = tracker.current
                loss = model(**inputs).loss
                peaks["forward"] = tracker.peak
                tracker.peak = tracker.current
                loss.backward()
                del loss
                peaks["backward"] = tracker.peak
                tracker.peak = tracker.current
                opt.step()
                opt.zero_grad(set_to_none=True)
                peaks["optimizer"] = tracker.peak
    finally:
        torch.set_num_threads(threads)
    return peaks


def _unfused_gemm_4bit() -> None:
    """Run ``gemm_4bit`` as its Python implementation rather than as one custom op: on the CPU it
    is bitsandbytes' default kernel (``backends/default/ops.py`` L323-345: absmax dequantised,
    the weight dequantised into the input's dtype, ``F.linear``), and called through the op
    its tensors are made below the storage tracker's dispatch mode, out of its sight. The same
    code run as plain Python lets the tracker count them (the CUDA kernel's fallback makes the
    same tensors, holding the two fp32 absmax tensors a little longer)."""
    import types

    from bitsandbytes.backends.default.ops import _gemm_4bit_default_impl

    torch.ops.bitsandbytes.gemm_4bit = types.SimpleNamespace(default=_gemm_4bit_default_impl)


def real(path: str, compute: str, prepare: bool) -> dict:
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training
    from transformers import BitsAndBytesConfig, LlamaForCausalLM

    qcfg = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                              bnb_4bit_compute_dtype=getattr(torch, compute))
    m = LlamaForCausalLM.from_pretrained(path, dtype=torch.bfloat16, device_map="cpu", quantization_config=qcfg,
                                         attn_implementation="eager")
    if prepare:
        m = prepare_model_for_kbit_training(m, use_gradient_checkpointing=False)
    torch.manual_seed(0)
    cfg = LoraConfig(r=RANK, lora_alpha=2 * RANK, lora_dropout=0.0, target_modules=list(TARGETS), bias="none")
    model = get_peft_model(m, cfg)
    model.train()
    return _phase_peaks(model, _inputs())


def traced(compute: str) -> dict:
    w = Workload(task="train", precision="bf16", batch=1, seq=16, attention="eager", peft="qlora",
                 lora_rank=RANK, lora_targets=TARGETS, bnb_compute_dtype="bf16" if compute == "bfloat16" else "fp32")
    r = trace_model(_plain, _inputs, workload=w, options=NO_WS)
    return {str(p.phase): p.allocated for p in r.phases}


if __name__ == "__main__":
    warnings.filterwarnings("ignore")
    _unfused_gemm_4bit()
    out: dict = {}
    with tempfile.TemporaryDirectory() as d:
        _plain().save_pretrained(d)
        for key in sys.argv[1:]:
            compute, _, prep = key.partition("+")
            out[key] = {"real": real(d, compute, prep == "prepare"), "traced": traced(compute)}
    print("BNB-PROBE " + json.dumps(out))
