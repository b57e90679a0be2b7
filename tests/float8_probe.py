"""torchao float8 training, traced and run for real on the CPU (run with ``.quant-deps`` on the
path by tests/test_float8_training.py; prints one ``FLOAT8-PROBE`` JSON line).

Single process: a tiny Llama (bf16, dimensions multiples of 16) converted by
``vramplan.trace.features.apply_float8`` — the real run's conversion is the same call, so the two
sides differ only in where torchao's code runs: on the emulated GPU (the trace) or on real CPU
tensors (``real_peak``). FSDP2 over 2 gloo processes: :func:`vramplan.trace.testing.block_model`
with the tensorwise recipe and FSDP2's plain all-gather.
"""

from __future__ import annotations

import json
import sys
import warnings

import torch

from vramplan.target import DeviceProfile
from vramplan.trace import features
from vramplan.trace.run import TraceOptions, trace_model
from vramplan.trace.testing import block_inputs, block_model, real_dist_peaks, real_peak
from vramplan.workload import Workload

H100 = DeviceProfile(name="h100 (test)", sm=(9, 0), sm_count=132, fp8=True, cublas_workspace=0)
NO_WS = TraceOptions(workspaces=False, count_flops=False)


def _config() -> object:
    from transformers import LlamaConfig

    return LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, vocab_size=256, max_position_embeddings=64, dtype="bfloat16")


def _llama() -> torch.nn.Module:
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(_config()).to(torch.bfloat16)


def _inputs() -> dict:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 256, (2, 32), generator=g)
    return {"input_ids": ids, "labels": ids}


def single(recipe: str) -> dict:
    w = Workload(task="train", precision="bf16", batch=2, seq=32, float8=recipe, attention="eager")

    def converted() -> torch.nn.Module:
        m = _llama()
        m.config._attn_implementation = "eager"  # (the CPU run and the trace take the same attention path)
        features.apply_float8(m, w, H100)
        return m

    def plain() -> torch.nn.Module:
        m = _llama()
        m.config._attn_implementation = "eager"
        return m

    traced = trace_model(plain, _inputs, workload=w, device=H100, options=NO_WS).peak_allocated
    return {"traced": traced, "real": real_peak(converted, _inputs)}


B200 = DeviceProfile(name="b200 (test)", sm=(10, 0), sm_count=148, fp8=True, cublas_workspace=0)


def mxfp8_emulated() -> dict:
    """torchao's MXFP8Linear with ``KernelPreference.EMULATED`` (its pure-torch casts and
    dequantise-then-mm: what runs on a CPU) on every linear of the tiny Llama, the output head
    included (torchtitan's converter): the same converted model run for real and traced."""
    import torchao.prototype.moe_training.mxfp8_linear  # noqa: F401 (loaded outside the trace's emulated CUDA)

    from vramplan.trace import mxfp8

    w = Workload(task="train", precision="bf16", batch=2, seq=32, attention="eager")

    def converted() -> torch.nn.Module:
        m = _llama()
        m.config._attn_implementation = "eager"
        mxfp8.convert(m, emulated=True)
        return m

    traced = trace_model(converted, _inputs, workload=w, device=B200, options=NO_WS).peak_allocated
    return {"traced": traced, "real": real_peak(converted, _inputs)}


MX_SHAPE = (256, 256, 512)
"""(tokens M, in K, out N) of :func:`mxfp8_bytes`: multiples of 128 with K/32, N/32, M/32 >= 8,
so that no scale is padded and both of ``to_blocked``'s reshapes copy."""


def mxfp8_bytes() -> dict:
    """torchtitan's MXFP8 recipe (AUTO: Triton dim-0, CUDA dim-1 casts) on one bias-free linear
    ``[M, K] -> [M, N]``, traced on a B200: the bytes each phase allocates in fp8 data, in the
    casts' scales (uint8/e8m0 from the kernels' ``empty``) and in ``to_blocked``'s rearranged
    scales (e8m0 from ``reshape``); and the bytes live when backward starts, with and without
    the conversion (what is saved for backward)."""
    from torch import nn
    from torchao.prototype.mx_formats import kernels, mx_tensor

    originals = (mx_tensor.triton_to_mxfp8_dim0, kernels.mxfp8_quantize_cuda)
    m, k, n = MX_SHAPE

    def make() -> nn.Module:
        return nn.Sequential(nn.Linear(k, n, bias=False))

    out: dict = {}
    for recipe in ("mxfp8", "none"):
        w = Workload(task="train", precision="bf16", float8=recipe, optimizer="sgd")
        r = trace_model(make, lambda: torch.randn(m, k), workload=w, device=B200, options=NO_WS, iterations=1)
        sums: dict = {}
        live: dict = {}
        cur, at_backward = 0, None
        for row in r.events.rows():
            if row["action"] == "alloc":
                if at_backward is None and row["phase"] == "backward":
                    at_backward = cur
                live[row["id"]] = row["size"]
                cur += row["size"]
                desc, op = row.get("desc", ""), row.get("op", "")
                kind = ("fp8" if desc.startswith("f8e4m3") else
                        "blocked" if op == "aten.reshape.default" and desc.startswith("float8_e8m0fnu") else
                        "scale" if desc.startswith(("u8", "float8_e8m0fnu")) else None)
                if kind is not None:
                    key = f"{row['phase']}:{kind}"
                    sums[key] = sums.get(key, 0) + row["size"]
            elif row["action"] in ("free", "free_deferred"):
                cur -= live.pop(row["id"], 0)
        out[recipe] = {"bytes": sums, "live_at_backward": at_backward}
    out["shape"] = MX_SHAPE
    out["restored"] = originals == (mx_tensor.triton_to_mxfp8_dim0, kernels.mxfp8_quantize_cuda)
    return out


FSDP = Workload(task="train", precision="fp32", float8="tensorwise").replace(dp=2, zero=3)
FSDP_FP8_GATHER = FSDP.replace(float8_fsdp_all_gather=True)


def _converted_blocks() -> torch.nn.Module:
    m = block_model()
    features.apply_float8(m, FSDP, H100)
    return m


def _converted_blocks_fp8_gather() -> torch.nn.Module:
    m = block_model()
    features.apply_float8(m, FSDP_FP8_GATHER, H100)
    return m


def fsdp(fp8_gather: bool = False) -> dict:
    """FSDP2 (bf16-free: fp32 block model) with float8 linears, the plain all-gather or torchao's
    float8 one (docs/research/float8-fsdp-all-gather.md: the trace once came out 4 % below this run
    with it, the meta-kernel cache rebuilding torchao's weight subclass as a plain tensor)."""
    w, make = (FSDP_FP8_GATHER, _converted_blocks_fp8_gather) if fp8_gather else (FSDP, _converted_blocks)
    real = real_dist_peaks(make, block_inputs, world=2, layout="fsdp2")
    traced = [trace_model(block_model, block_inputs(), workload=w, device=H100,
                          options=TraceOptions(workspaces=False, count_flops=False, rank=r)).peak_allocated
              for r in range(2)]
    return {"traced": traced, "real": real}


if __name__ == "__main__":
    warnings.filterwarnings("ignore")
    out: dict = {}
    for key in sys.argv[1:]:
        if key in ("fsdp", "fsdp-fp8-gather"):
            out[key] = fsdp(fp8_gather=key == "fsdp-fp8-gather")
        elif key == "mxfp8-emulated":
            out[key] = mxfp8_emulated()
        elif key == "mxfp8-bytes":
            out[key] = mxfp8_bytes()
        else:
            out[key] = single(key)
    print("FLOAT8-PROBE " + json.dumps(out))
