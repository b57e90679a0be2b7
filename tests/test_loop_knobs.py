"""Issue 10's loop knobs in the traced step, each against a hand-computed delta on a small model,
the loss implementations against the real library where it runs on a CPU, and the analytic
estimate against the trace on each knob.

- keep_grads: from the second step on, the gradients exist through the forward — the
  forward's peak grows by exactly the gradient bytes;
- keep_outputs: a loop that holds ``out`` keeps the bf16 logits through backward: the
  backward's peak grows by exactly ``b·s·V·2``;
- loss=chunked (torchtune): one fp32 upcast of ``1/N`` of the logits at a time;
- loss=liger / cce: no full-vocabulary logits at all;
- optimizer_in_backward: the gradients are never all alive at once.

torchtune's ``CEWithChunkedOutputLoss`` runs on a real CPU (its file is loaded by path:
torchtune 0.6.1 does not import next to torchao ≥ 0.13) and its peak is compared with the
trace within 1 %. Liger's fused linear cross-entropy has no pure-PyTorch path (its forward
launches a Triton kernel; ``liger_kernel.chunked_loss`` covers preference/distillation losses
only), but Triton's interpreter (``TRITON_INTERPRET=1``) runs its real code on the CPU: the
emulation is compared with that run within 1 %. Cut Cross-Entropy's kernels fail in the
interpreter (``InterpreterError`` in ``_cce_lse_forward_kernel``, cut-cross-entropy 25.1.1)
and its ``torch_compile`` path materialises the logits (a different algorithm): CCE is
checked against the sizes its code allocates only.
"""

from __future__ import annotations

import importlib.util
import os
from typing import Any

import pytest
import torch
from torch import nn

from vramplan.analytic.estimate import estimate
from vramplan.errors import WorkloadError
from vramplan.events import Action, Category
from vramplan.models.catalog import resolve
from vramplan.models.normalize import spec_from_config
from vramplan.trace import analysis
from vramplan.trace.loss import liger_chunk
from vramplan.trace.run import TraceOptions, trace_model, trace_workload
from vramplan.trace.testing import real_peak, tiny_config
from vramplan.workload import Phase, Workload

transformers = pytest.importorskip("transformers")

NO_WS = TraceOptions(workspaces=False)
B, S, V, H = 2, 64, 512, 64


def _llama() -> nn.Module:
    cfg = transformers.LlamaConfig(hidden_size=H, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=4, vocab_size=V, max_position_embeddings=256, use_cache=False,
                                   tie_word_embeddings=False)
    cfg._attn_implementation = "eager"
    return transformers.LlamaForCausalLM(cfg)


def _inputs() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, V, (B, S), generator=g)
    return {"input_ids": ids, "labels": ids.clone()}


def _trace(**kw: Any):
    w = Workload(task="train", optimizer="adamw", attention="eager", **{"precision": "bf16", **kw})
    return trace_model(_llama, _inputs(), workload=w, options=NO_WS)


def _phase(r, phase: Phase) -> int:
    return next(p.allocated for p in r.phases if p.phase is phase)


def _grad_bytes(r) -> int:
    return sum(2 * n for n in [r.trainable_params])  # bf16 gradients


# --------------------------------------------------------------------------- hand-computed deltas
def test_keep_grads_adds_the_gradient_bytes_to_the_forward() -> None:
    base, kept = _trace(), _trace(keep_grads=True)
    assert _phase(kept, Phase.FORWARD) - _phase(base, Phase.FORWARD) == 2 * base.trainable_params
    # zeroed in place, never freed: the optimizer step sees the same gradients
    assert _phase(kept, Phase.OPTIMIZER) == _phase(base, Phase.OPTIMIZER)


def test_keep_outputs_holds_the_bf16_logits_through_backward() -> None:
    base, kept = _trace(), _trace(keep_outputs=True)
    assert _phase(kept, Phase.BACKWARD) - _phase(base, Phase.BACKWARD) == B * S * V * 2
    assert _phase(kept, Phase.FORWARD) == _phase(base, Phase.FORWARD)


def _fp32_upcasts(r) -> list[int]:
    """Sizes of the forward's fp32 copies of logit-shaped tensors (``logits.float()``)."""
    log = r.events
    return [log.size[k] for k in range(len(log))
            if log.action[k] == int(Action.ALLOC) and log.phase[k] == list(Phase).index(Phase.FORWARD)
            and log.strings[log.op[k]] in ("aten._to_copy.default", "aten.to.dtype")
            and log.strings[log.desc[k]].startswith("f32[") and log.strings[log.desc[k]].endswith(f",{V}]")]


@pytest.mark.parametrize("chunks", [2, 4, 8])
def test_chunked_loss_upcasts_one_nth_of_the_logits_at_a_time(chunks: int) -> None:
    full, chunked = _trace(), _trace(loss="chunked", loss_chunks=chunks)
    e = B * S * V
    assert max(_fp32_upcasts(full)) == 4 * e
    assert max(_fp32_upcasts(chunked)) == 4 * e // chunks
    # every chunk's log-softmax output is saved, as the full loss's is: the forward's peak drops
    # by (about: the instants differ by a few small tensors) the upcast that is no longer whole
    drop = _phase(full, Phase.FORWARD) - _phase(chunked, Phase.FORWARD)
    assert 0.85 * (4 * e - 4 * e // chunks) <= drop <= 4 * e - 4 * e // chunks


@pytest.mark.parametrize("loss", ["liger", "cce"])
def test_fused_losses_never_materialise_the_logits(loss: str) -> None:
    r = _trace(loss=loss)
    log = r.events
    logits = [log.size[k] for k in range(len(log)) if log.action[k] == int(Action.ALLOC)
              and log.strings[log.desc[k]].endswith(f",{V}]") and log.phase[k] != 0]
    if loss == "liger":  # one chunk of logits (bf16) at a time
        assert max(logits) == liger_chunk(B * S, V, H) * V * 2 < B * S * V * 2
    else:
        assert logits == []  # no tensor is vocabulary-wide per token
    assert r.peak_allocated < _trace().peak_allocated


def test_liger_chunk_follows_its_formula() -> None:
    # chunk = next_pow2(ceil(BT / ceil(V / H))), at most BT (liger_kernel 0.8.5)
    assert liger_chunk(4096, 128256, 4096) == 128
    assert liger_chunk(100, 512, 64) == 16
    assert liger_chunk(8, 512, 1024) == 8


def _max_live_gradients(r) -> int:
    a = analysis.arrays(r.events)
    grads = a.delta * (a.cat == int(Category.GRADIENT))
    return int(grads.cumsum().max())


def test_optimizer_in_backward_never_holds_all_gradients() -> None:
    base, inbwd = _trace(), _trace(optimizer_in_backward=True)
    total = 2 * base.trainable_params
    assert _max_live_gradients(base) == total
    largest = max(p.numel() for p in _llama().parameters()) * 2
    assert _max_live_gradients(inbwd) <= 2 * largest < total
    assert not any(p.phase is Phase.OPTIMIZER for p in inbwd.phases)


# --------------------------------------------------------------------------- the real library
def _torchtune_loss_class() -> Any:
    spec = importlib.util.find_spec("torchtune")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("torchtune is not installed")
    path = os.path.join(list(spec.submodule_search_locations)[0], "modules", "loss", "ce_chunked_output_loss.py")
    mod_spec = importlib.util.spec_from_file_location("_tt_ce_chunked_output_loss", path)
    assert mod_spec is not None and mod_spec.loader is not None
    mod = importlib.util.module_from_spec(mod_spec)
    mod_spec.loader.exec_module(mod)
    return mod.CEWithChunkedOutputLoss


class _ChunkedOutputs(nn.Module):
    """torchtune's ``TransformerDecoder.chunked_output`` on a transformers Llama."""

    def __init__(self, chunks: int) -> None:
        super().__init__()
        self.lm = _llama()
        self.chunks = chunks

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> list[torch.Tensor]:
        h = self.lm.model(input_ids=input_ids).last_hidden_state
        return [self.lm.lm_head(c) for c in h.chunk(self.chunks, dim=1)]


@pytest.mark.parametrize("chunks", [1, 4])
def test_chunked_loss_matches_torchtune_on_a_real_cpu_run(chunks: int) -> None:
    ce = _torchtune_loss_class()(num_output_chunks=chunks)

    def loss_fn(out: list[torch.Tensor], input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        ignore = torch.full((labels.shape[0], 1), -100, dtype=labels.dtype, device=labels.device)
        return ce(out, torch.hstack((labels[..., 1:], ignore)))

    ref = real_peak(lambda: _ChunkedOutputs(chunks), _inputs, loss_fn=loss_fn)
    w = Workload(task="train", precision="fp32", optimizer="adamw", attention="eager", loss="chunked",
                 loss_chunks=chunks)
    r = trace_model(_llama, _inputs(), workload=w, options=NO_WS)
    assert abs(r.peak_allocated - ref) / ref < 0.01, (r.peak_allocated, ref)


# --------------------------------------------------------------------------- analytic = trace
def _small():
    spec = resolve("llama-3.1-8b")
    c = tiny_config(dict(spec.config), 2)
    c.update(hidden_size=256, intermediate_size=768, vocab_size=2048)
    return spec_from_config(c, name="small-llama", source="test")


KNOBS = [
    ({"keep_grads": True}, 0.03),
    ({"keep_outputs": True}, 0.03),
    ({"loss": "chunked"}, 0.03),
    ({"loss": "chunked", "loss_chunks": 2}, 0.03),
    ({"loss": "liger"}, 0.05),
    ({"loss": "cce"}, 0.05),
    ({"optimizer_in_backward": True, "seq": 16, "batch": 1}, 0.03),
    ({"peft": "lora", "peft_base_dtype": "fp32"}, 0.03),
    ({"peft": "qlora", "bnb_compute_dtype": "fp32", "seq": 16, "batch": 1}, 0.03),
    ({"peft": "qlora", "bnb_single_quant": True}, 0.03),
]


@pytest.mark.parametrize(("kw", "tol"), KNOBS, ids=["-".join(f"{k}={v}" for k, v in kw.items()) for kw, _ in KNOBS])
def test_analytic_agrees_with_the_trace_on_each_knob(kw: dict, tol: float) -> None:
    """Tolerances as tests/test_trace_agreement.py (liger/cce 5 %: with no loss instant on top,
    the analytic's last-layer backward instant — all of one layer's gradients next to all its
    activations — is the peak, a bound the trace stays under)."""
    spec = _small()
    w = Workload(**{"task": "train", "batch": 2, "seq": 256, "precision": "bf16-mixed", **kw})
    a = estimate(spec, w)
    r = trace_workload(spec, w)
    assert abs(r.peak_allocated - a.peak.allocated) / a.peak.allocated < tol, (r.peak_allocated, a.peak.allocated)


def test_knob_effects_have_the_same_sign_in_both_methods() -> None:
    spec = _small()
    base = Workload(task="train", batch=2, seq=256, precision="bf16-mixed")
    a0, t0 = estimate(spec, base).peak.allocated, trace_workload(spec, base).peak_allocated
    for kw in ({"keep_grads": True}, {"keep_outputs": True}, {"loss": "chunked"}, {"loss": "cce"}):
        w = base.replace(**kw)
        da = estimate(spec, w).peak.allocated - a0
        dt = trace_workload(spec, w).peak_allocated - t0
        assert (da > 0) == (dt > 0) and da != 0, (kw, da, dt)


def test_paged_8bit_states_of_large_tensors_are_outside_the_allocator_in_both_methods() -> None:
    from vramplan.trace.optim import BNB_PAGED_MIN

    spec = _small()
    w = Workload(task="train", batch=1, seq=16, precision="bf16-mixed", optimizer="adamw-8bit")
    a8, ap = estimate(spec, w), estimate(spec, w.replace(optimizer="paged-adamw-8bit"))
    t8, tp = trace_workload(spec, w), trace_workload(spec, w.replace(optimizer="paged-adamw-8bit"))
    sizes = [p.numel() for p in _llama_params(spec)]
    paged = sum(2 * n for n in sizes if n >= BNB_PAGED_MIN)  # two uint8 state buffers each
    assert paged > 0
    opt = [next(p.breakdown.optimizer for p in r.phases if p.phase is Phase.OPTIMIZER) for r in (t8, tp)]
    assert opt[0] - opt[1] == paged
    assert a8.states.optimizer - ap.states.optimizer == paged
    assert any("cudaMallocManaged" in n for n in tp.notes)


def _llama_params(spec) -> list[torch.Tensor]:
    from vramplan.models.build import build_model

    return list(build_model(spec, task="train", device="meta").parameters())


# --------------------------------------------------------------------------- precision knobs
def test_fp32_peft_base_stores_the_base_in_fp32_and_casts_it_under_autocast() -> None:
    spec = _small()
    w = Workload(task="train", batch=1, seq=16, precision="bf16-mixed", peft="lora")
    a16, a32 = estimate(spec, w), estimate(spec, w.replace(peft_base_dtype="fp32"))
    base_params = a16.params
    assert a32.states.weights - a16.states.weights == 2 * base_params  # 4 B instead of 2 per base weight
    r32 = trace_workload(spec, w.replace(peft_base_dtype="fp32"))
    assert any("frozen base stored in float32" in n for n in r32.notes)


def test_single_quantisation_stores_fp32_absmax() -> None:
    spec = _small()
    w = Workload(task="train", batch=1, seq=16, precision="bf16-mixed", peft="qlora")
    double, single = estimate(spec, w), estimate(spec, w.replace(bnb_single_quant=True))
    # per 64-element block: an fp32 absmax (4 B) instead of a uint8 (1 B) + fp32 per 256 blocks
    mats = [(lin.d_in * lin.d_out, g.count) for g in _arch(spec).groups for lin in g.linears]
    # uint8 absmax + fp32 per 256 blocks + a 256-entry fp32 code + an fp32 offset → fp32 absmax
    want = sum(n * (3 * (e // 64) - 4 * -(-(e // 64) // 256) - 1028) for e, n in mats)
    assert single.states.weights - double.states.weights == want
    t_double = trace_workload(spec, w).breakdown_at_peak.weights
    t_single = trace_workload(spec, w.replace(bnb_single_quant=True)).breakdown_at_peak.weights
    assert t_single - t_double == want


def _arch(spec):
    from vramplan.analytic.estimate import build_arch

    return build_arch(spec)


def test_fp32_bnb_compute_dequantises_to_bf16_then_fp32() -> None:
    from vramplan.trace.quant import QuantLinear
    from vramplan.workload import Quant

    q = QuantLinear(128, 256, bias=False, kind=Quant.NF4, compute_dtype=torch.float32, double_quant=True,
                    storage_dtype=torch.bfloat16)
    from vramplan.target import DEFAULT_PROFILE
    from vramplan.trace.session import TraceSession

    sess = TraceSession(DEFAULT_PROFILE.without_workspaces())
    with sess:
        sess.add_model(q)
        x = torch.empty(4, 128, dtype=torch.bfloat16, device="meta", requires_grad=True)
        sess.add_inputs([x])
        y = q(x)
        y.float().sum().backward()
    descs = [sess.rec.log.strings[sess.rec.log.desc[k]] for k in range(len(sess.rec.log))
             if sess.rec.log.action[k] == int(Action.ALLOC)]
    assert "bf16[256,128]" in descs and "f32[256,128]" in descs  # dequantise_4bit(B) then .to(fp32)


# --------------------------------------------------------------------------- bad input
def test_optimizer_in_backward_refuses_accumulation_and_fp16_scaling() -> None:
    with pytest.raises(WorkloadError, match="grad_accum"):
        Workload(task="train", optimizer_in_backward=True, grad_accum=4)
    with pytest.raises(WorkloadError, match="bf16-mixed"):
        Workload(task="train", optimizer_in_backward=True, precision="fp16-mixed")


@pytest.mark.parametrize(("precision", "base"), [("bf16", "fp32"), ("bf16-mixed", "fp16"), ("fp32", "bf16")])
def test_peft_base_dtype_that_cannot_run_is_refused(precision: str, base: str) -> None:
    with pytest.raises(WorkloadError, match="peft_base_dtype|base"):
        Workload(task="train", peft="lora", precision=precision, peft_base_dtype=base)


def test_fused_loss_on_a_model_that_is_not_a_causal_lm_is_one_line() -> None:
    from vramplan.errors import VramplanError

    w = Workload(task="train", precision="fp32", loss="cce")
    with pytest.raises(VramplanError, match="causal LM"):
        trace_model(lambda: nn.Sequential(nn.Linear(8, 8)), torch.randn(2, 8), workload=w)
    with pytest.raises(WorkloadError, match="causal language model"):
        estimate(resolve("bert-base"), Workload(task="train", seq=128, loss="chunked"))


# --------------------------------------------------------------------------- step time
def test_cut_cross_entropy_recomputes_the_logits_in_backward() -> None:
    from vramplan.models.flops import layout_of, train_flops
    from vramplan.models.shape import model_shape
    from vramplan.models.spec import Family, ModelSpec

    spec = ModelSpec(name="llama-3.1-8b", hub_id=None, family=Family.DENSE, source="test", config={},
                     hidden=4096, layers=32, heads=32, kv_heads=8, head_dim=128, intermediate=14336,
                     vocab=128256, max_positions=131072, params=8_030_261_248, active_params=8_030_261_248)
    f, w = layout_of(model_shape(spec)), Workload(batch=1, seq=2048)
    full = train_flops(f, w, 1, 2048)
    cce = train_flops(f, w.replace(loss="cce"), 1, 2048)
    assert cce.total - full.total == pytest.approx(2 * 4096 * 128256 * 2048)
    for loss in ("chunked", "liger"):  # the same three head matmuls, in other places
        assert train_flops(f, w.replace(loss=loss), 1, 2048).total == full.total


# --------------------------------------------------------------------------- fused attention backward
@pytest.mark.parametrize(("gpu", "precision", "kernel", "size"), [
    ("t4", "fp16", "efficient", 4 * 2 * 4 * 128 * 64),  # fp32 dQ tiles: ⌈T⌉₆₄ × ⌈D=16⌉₆₄ per (b, h)
    ("h100-sxm", "bf16", "cudnn", 4 * 2 * 4 * 128 * 16 + 4 * 2 * 4 * 128),
])
def test_fused_attention_backward_allocates_its_fp32_dq_workspace(gpu: str, precision: str, kernel: str,
                                                                  size: int) -> None:
    from vramplan.hardware.catalog import get_gpu
    from vramplan.hardware.target import device_profile
    from vramplan.trace.testing import tiny_spec

    r = trace_workload(tiny_spec("llama-3.1-8b"), Workload(task="train", batch=2, seq=128, precision=precision),
                       device=device_profile(get_gpu(gpu)))
    assert any(f"{kernel} ×" in n for n in r.notes)
    log = r.events
    sizes = {log.size[k] for k in range(len(log))
             if log.strings[log.op[k]] == "sdpa.bwd_workspace" and log.action[k] == int(Action.ALLOC)}
    assert sizes == {size}


# --------------------------------------------------------------------------- Liger on a real CPU
_LIGER_REAL = """
import json, sys
import torch
from torch import nn
from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss
from vramplan.trace.testing import real_peak

BT, H, V = {bt}, {h}, {v}

class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(H, H)
        self.head = nn.Linear(H, V, bias=False)
        self.loss = LigerFusedLinearCrossEntropyLoss()

    def forward(self, x, target):
        return self.loss(self.head.weight, self.lin(x), target)

def inputs():
    g = torch.Generator().manual_seed(0)
    return (torch.randn(BT, H, generator=g), torch.randint(0, V, (BT,), generator=g))

print(json.dumps(real_peak(Model, inputs, loss_fn=lambda out: out)))
"""


class _LigerEmulated(nn.Module):
    def __init__(self, h: int, v: int) -> None:
        super().__init__()
        self.lin = nn.Linear(h, h)
        self.head = nn.Linear(h, v, bias=False)

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        from vramplan.trace.loss import LigerFusedLinearCE

        return LigerFusedLinearCE.apply(self.lin(x), self.head.weight, target, None, False, False)


def test_liger_emulation_matches_liger_run_on_a_cpu_with_tritons_interpreter() -> None:
    """Liger's own code (its Triton kernels under ``TRITON_INTERPRET=1``, which runs them on the
    CPU without allocating torch tensors) against the trace of the emulation, CPU-side decisions."""
    pytest.importorskip("liger_kernel")
    import json
    import subprocess
    import sys

    bt, h, v = 256, 64, 1024  # 16 chunks of 16 tokens
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.run([sys.executable, "-c", _LIGER_REAL.format(bt=bt, h=h, v=v)], env=env,
                          capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        pytest.skip(f"Liger does not run under Triton's interpreter here: {proc.stderr.strip().splitlines()[-1:]}")
    ref = json.loads(proc.stdout.strip().splitlines()[-1])
    g = torch.Generator().manual_seed(0)
    inputs = (torch.randn(bt, h, generator=g), torch.randint(0, v, (bt,), generator=g))
    w = Workload(task="train", precision="fp32", optimizer="adamw")
    r = trace_model(lambda: _LigerEmulated(h, v), inputs, workload=w, loss_fn=lambda out: out, options=NO_WS)
    assert abs(r.peak_allocated - ref) / ref < 0.01, (r.peak_allocated, ref)
