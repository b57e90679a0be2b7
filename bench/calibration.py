"""Predict the HF Trainer BERT-large / V100 calibration table (shared/data/calibration).

    python bench/calibration.py              # the table: measured vs predicted nvidia-smi used, error
    python bench/calibration.py --markdown   # the same as a markdown table (README)
    python bench/calibration.py --json       # one JSON object per row

The measurements (transformers docs, `model_memory_anatomy.md` / `perf_train_gpu_one.md`,
2022, V100-SXM2 16 GB, CUDA 11.2) are nvidia-smi's used memory after one epoch of HF
`Trainer` on `bert-large-uncased` with `AutoModelForSequenceClassification` (2 labels), 512
random sequences of 512 tokens. The prediction is vramplan's trace of the same step with
`recipe=hf-trainer` on the emulated V100: the allocator's reserved peak (the pool stays
reserved after training: Trainer does not empty the cache) plus the memory outside the
allocator for the torch 1.x of the run (no lazy module loading).

What the 2022 code did differently from today's Trainer, given explicitly (each shows in the
report header as "given instead of its defaults"), never tuned:
- `optim` defaulted to "adamw_hf" (transformers' own AdamW, a per-parameter loop), not
  "adamw_torch_fused" (transformers v4.20 training_args.py `optim` default);
- `model.zero_grad()` kept the gradients zeroed in place: `nn.Module.zero_grad` defaulted to
  `set_to_none=False` before torch 2.0 (torch 1.12 torch/nn/modules/module.py);
- BERT ran eager attention (transformers added SDPA to BERT in 2024), adding an fp32 extended
  attention mask to the scores of every layer (`extended_mask_2022`).

The doc does not name its torch version. Two predictions are printed: with today's autograd
(the trace as it runs on torch 2.x), and with torch <= 1.10's softmax, which kept its input for
backward as well as its output (pytorch/pytorch#64000, fixed in 1.11 by #65242) — emulated
by `softmax_keeps_input` with exactly those saved tensors.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

MiB = 2**20
GPU = "v100-sxm2-16gb"
TORCH = "1.10"  # a torch 1.x of 2022 (CUDA 11.x; no lazy module loading before 1.13): the doc names none
BNB = "0.35.0"
"""A bitsandbytes of 2022 for the Adam8bit rows (the doc names none): 0.32.0 (Aug 2022) to 0.35.x keep
an fp32 absmax per 2,048-element block (optim/optimizer.py L411 at 0.35.0, ``n // 2048``), as every
release before 0.44 does (today's 256-element blocks: 8x the absmax)."""


@dataclass(frozen=True)
class Row:
    label: str
    measured_mib: int
    batch: int = 4
    grad_accum: int = 1
    precision: str = "fp32"
    checkpointing: str = "none"
    optimizer: str = "adamw"
    hf_optim: str = "adamw_hf"


ROWS = (
    Row("batch 4, fp32, AdamW", 14_949),
    Row("batch 1, gradient accumulation 4", 8_681, batch=1, grad_accum=4),
    Row("batch 1, GA 4, gradient checkpointing", 6_775, batch=1, grad_accum=4, checkpointing="full"),
    Row("batch 4, fp16 (AMP)", 13_939, precision="fp16-mixed"),
    Row("batch 1, GA 4, checkpointing, fp16", 7_275, batch=1, grad_accum=4, checkpointing="full",
        precision="fp16-mixed"),
    Row("batch 4, Adafactor", 12_295, optimizer="adafactor", hf_optim="adafactor"),
    Row("batch 1, GA 4, checkpointing, fp16, Adafactor", 4_847, batch=1, grad_accum=4, checkpointing="full",
        precision="fp16-mixed", optimizer="adafactor", hf_optim="adafactor"),
    Row("batch 4, bitsandbytes Adam8bit", 13_085, optimizer="adamw-8bit", hf_optim="adamw_bnb_8bit"),
    Row("batch 1, GA 4, checkpointing, fp16, Adam8bit", 5_363, batch=1, grad_accum=4, checkpointing="full",
        precision="fp16-mixed", optimizer="adamw-8bit", hf_optim="adamw_bnb_8bit"),
)
SEQ = 512
WEIGHTS_ROW = ("+ model weights loaded", 2_631)


def _config():  # type: ignore[no-untyped-def]
    from transformers import BertConfig

    from vramplan.models.catalog import resolve

    cfg = BertConfig(**dict(resolve("bert-large").config), num_labels=2)
    cfg._attn_implementation = "eager"  # 2022 BERT: materialised scores, softmax, dropout
    return cfg


def make_model():  # type: ignore[no-untyped-def]
    from transformers import BertForSequenceClassification

    return BertForSequenceClassification(_config())


def overhead_bytes(*, gemm: bool = True) -> int:
    """Memory outside the allocator; ``gemm=False`` before any matmul ran (no cuBLAS handle)."""
    from vramplan.hardware.catalog import get_gpu
    from vramplan.hardware.overhead import device_overhead

    return sum(o.bytes for o in device_overhead(get_gpu(GPU), torch_version=TORCH, lazy_loading=False)
               if gemm or not o.name.startswith("cuBLAS"))


def weights_reserved() -> int:
    """`model.to("cuda")`: one allocation per parameter and buffer, in `Module._apply` order
    (children first, then the module's own parameters and buffers), through the allocator
    simulation; the reserved pool after it."""
    import torch

    from vramplan.allocator import CachingAllocator

    with torch.device("meta"):
        model = make_model()
    alloc = CachingAllocator()
    seen: set[int] = set()

    def walk(m: torch.nn.Module) -> None:
        for c in m.children():
            walk(c)
        for t in [*m._parameters.values(), *m._buffers.values()]:
            if t is not None and id(t) not in seen:
                seen.add(id(t))
                alloc.malloc(t.numel() * t.element_size())

    walk(model)
    return int(alloc.reserved)


@contextlib.contextmanager
def softmax_keeps_input() -> Iterator[None]:
    """torch <= 1.10's softmax node kept its input as well as its output for backward (the
    formula of `_softmax` referenced `self`, pytorch/pytorch#64000; PR #65242 stopped saving it
    in torch 1.11). Under autocast, fp16 scores go through CUDA's half_to_float kernel: the node
    keeps the fp16 input and the fp32 output. A stand-in `torch.nn.functional.softmax` with exactly those saved tensors, while tracing."""
    import torch

    original = torch.nn.functional.softmax

    class Softmax110(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, dim, dtype):  # type: ignore[no-untyped-def, override]
            if x.dtype == torch.float16:  # fp16 scores here only under autocast: softmax(dtype=float32),
                y = torch._softmax(x, dim, True)  # CUDA's half_to_float kernel (no fp32 copy of the input)
            else:
                y = torch._softmax(x if dtype is None else x.to(dtype), dim, False)
            ctx.save_for_backward(x, y)
            ctx.dim = dim
            return y

        @staticmethod
        def backward(ctx, g):  # type: ignore[no-untyped-def, override]
            x, y = ctx.saved_tensors
            return torch._softmax_backward_data(g, y, ctx.dim, x.dtype), None, None

    def softmax(input, dim=None, _stacklevel=3, dtype=None):  # type: ignore[no-untyped-def]
        if not (torch.is_grad_enabled() and input.requires_grad):
            return original(input, dim=dim, dtype=dtype)
        return Softmax110.apply(input, dim, dtype)

    torch.nn.functional.softmax = softmax
    try:
        yield
    finally:
        torch.nn.functional.softmax = original


@contextlib.contextmanager
def extended_mask_2022() -> Iterator[None]:
    """transformers 4.x's BertModel built an all-ones attention mask when none was given and
    added its extended form, `(1 - mask) * finfo.min` in the model's dtype (fp32: zeros), to the
    scores of every layer (modeling_bert.py `get_extended_attention_mask`, v4.16); today's BERT
    skips an all-ones mask. Under AMP the add turns fp16 scores into fp32. While tracing, BERT's
    eager attention gets that (batch, 1, 1, keys) fp32 mask when it has none."""
    import torch
    from transformers.models.bert import modeling_bert

    original = modeling_bert.eager_attention_forward

    def eager(module, query, key, value, attention_mask, *args, **kwargs):  # type: ignore[no-untyped-def]
        if attention_mask is None:
            attention_mask = torch.zeros(key.shape[0], 1, 1, key.shape[2], dtype=torch.float32, device=key.device)
        return original(module, query, key, value, attention_mask, *args, **kwargs)

    modeling_bert.eager_attention_forward = eager
    try:
        yield
    finally:
        modeling_bert.eager_attention_forward = original


def predict(row: Row, *, torch110: bool = False) -> dict[str, object]:
    import torch

    import vramplan
    from vramplan.recipes import apply

    w = apply("hf-trainer", batch=row.batch, seq=SEQ, grad_accum=row.grad_accum, precision=row.precision,
              checkpointing=row.checkpointing, optimizer=row.optimizer, attention="eager",
              # 2022 code, see the module docstring
              optimizer_impl="for-loop", keep_grads=True,
              **({"bnb_version": BNB} if row.optimizer == "adamw-8bit" else {}))
    inputs = {"input_ids": torch.randint(100, 30000, (row.batch, SEQ)),
              "labels": torch.randint(0, 2, (row.batch,))}
    with extended_mask_2022(), softmax_keeps_input() if torch110 else contextlib.nullcontext():
        r = vramplan.trace(make_model, inputs, workload=w, gpu=GPU, name="bert-large (seq-cls)")
    used = r.peak.reserved + overhead_bytes()
    return {"row": row.label, "hf_optim": row.hf_optim, "measured_mib": row.measured_mib,
            "predicted_mib": round(used / MiB), "error": used / MiB / row.measured_mib - 1,
            "allocated_mib": round(r.peak.allocated / MiB), "reserved_mib": round(r.peak.reserved / MiB),
            "peak_phase": str(r.peak_phase)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--markdown", action="store_true")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--only", type=int, nargs="*", help="row numbers (1-based) to predict")
    args = ap.parse_args(argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    out: list[dict[str, object]] = []
    ctx = overhead_bytes()
    wr = weights_reserved() + overhead_bytes(gemm=False)  # loading runs no matmul: no cuBLAS handle yet
    w_err = wr / MiB / WEIGHTS_ROW[1] - 1
    out.append({"row": WEIGHTS_ROW[0], "hf_optim": "-", "measured_mib": WEIGHTS_ROW[1],
                "predicted_mib": round(wr / MiB), "error": w_err, "predicted_110_mib": round(wr / MiB),
                "error_110": w_err})
    for i, row in enumerate(ROWS, 1):
        if args.only and i not in args.only:
            continue
        now, old = predict(row), predict(row, torch110=True)
        out.append({**now, "predicted_110_mib": old["predicted_mib"], "error_110": old["error"]})
        if args.json:
            print(json.dumps(out[-1]), flush=True)
    if args.json:
        return 0
    print(f"outside the allocator (torch {TORCH}, no lazy loading, {GPU}): {ctx / MiB:,.0f} MiB = the measured "
          "context row (1,343 MiB) less the allocator's first 2 MiB segment, plus the cuBLAS handle once a "
          "matmul ran")
    if args.markdown:
        print("| configuration | HF `optim` | measured (MiB) | predicted, torch ≥ 1.11 autograd | error | "
              "predicted, torch ≤ 1.10 softmax | error |")
        print("| --- | --- | ---: | ---: | ---: | ---: | ---: |")
        for o in out:
            print(f"| {o['row']} | {o['hf_optim']} | {o['measured_mib']:,} | {o['predicted_mib']:,} | "
                  f"{float(o['error']):+.1%} | {o['predicted_110_mib']:,} | {float(o['error_110']):+.1%} |")  # type: ignore[arg-type]
    else:
        print(f"{'configuration':48} {'measured':>9} {'>=1.11':>9} {'error':>7} {'<=1.10':>9} {'error':>7}")
        for o in out:
            print(f"{o['row']:48} {o['measured_mib']:>9,} {o['predicted_mib']:>9,} {float(o['error']):>+7.1%} "  # type: ignore[arg-type]
                  f"{o['predicted_110_mib']:>9,} {float(o['error_110']):>+7.1%}")  # type: ignore[arg-type]
    return 0


if __name__ == "__main__":
    sys.exit(main())
