"""CUDA emulation: SDPA kernel choice, autocast, workspaces, optimizer implementations."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from vramplan.events import Action, Category
from vramplan.hardware.gpu import GPU
from vramplan.hardware.target import device_profile
from vramplan.trace import analysis
from vramplan.trace.cuda import DeviceProfile
from vramplan.trace.run import TraceOptions, trace_model
from vramplan.trace.sdpa import choose_backend
from vramplan.workload import Workload

NO_WS = TraceOptions(workspaces=False)


def _gpu(cc: str, key: str = "gpu") -> GPU:
    return GPU(key=key, name=key, vendor="nvidia", arch="x", compute_capability=cc, capacity=80 << 30)


def _qkv(b=2, h=8, t=128, d=64, dtype=torch.bfloat16, hk=None, tk=None):
    q = torch.empty(b, h, t, d, dtype=dtype, device="meta")
    k = torch.empty(b, hk or h, tk or t, d, dtype=dtype, device="meta")
    return q, k, k.clone()


@pytest.mark.parametrize(("cc", "dtype", "mask", "kw", "expected"), [
    ("8.0", torch.bfloat16, False, {}, "flash"),
    ("8.0", torch.float32, False, {}, "efficient"),
    ("8.0", torch.bfloat16, True, {}, "efficient"),
    ("7.5", torch.float16, False, {}, "efficient"),
    ("7.5", torch.bfloat16, False, {}, "math"),
    ("9.0", torch.bfloat16, False, {}, "cudnn"),
    ("9.0", torch.bfloat16, False, {"d": 160, "grad": True}, "flash"),
    ("8.6", torch.bfloat16, False, {"d": 200, "grad": True}, "efficient"),
    ("8.6", torch.bfloat16, False, {"d": 200, "grad": False}, "flash"),
    ("8.0", torch.bfloat16, False, {"causal": True, "tk": 256}, "efficient"),
    ("8.0", torch.bfloat16, False, {"hk": 2, "gqa": True}, "flash"),
    ("8.0", torch.bfloat16, False, {"hk": 2, "gqa": False}, "math"),
    ("8.0", torch.bfloat16, False, {"d": 60}, "flash"),
    ("7.0", torch.float16, False, {"d": 60}, "math"),
])
def test_sdpa_backend_follows_sdp_utils(cc, dtype, mask, kw, expected) -> None:
    q, k, v = _qkv(d=kw.get("d", 64), dtype=dtype, hk=kw.get("hk"), tk=kw.get("tk"))
    m = torch.empty(2, 1, q.shape[2], k.shape[2], dtype=torch.bool, device="meta") if mask else None
    got = choose_backend(device_profile(_gpu(cc)), q, k, v, m, causal=kw.get("causal", False),
                         gqa=kw.get("gqa", False), grad=kw.get("grad", False))
    assert got == expected


class Attn(nn.Module):
    def __init__(self, d: int = 64, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d, 3 * d)
        self.out = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(b, t, d))


def _descs(r, op_part: str) -> list[str]:
    log = r.events
    return [log.strings[log.desc[k]] for k in range(len(log))
            if log.action[k] == Action.ALLOC and op_part in log.strings[log.op[k]]]


def test_flash_attention_saves_logsumexp_not_scores() -> None:
    b, t = 2, 256
    r = trace_model(Attn(), torch.randn(b, t, 64), workload=Workload(task="train", precision="bf16"),
                    device=device_profile(_gpu("8.0")), options=NO_WS, iterations=1)
    assert "SDPA kernels: flash ×1" in r.notes
    assert f"f32[{b},4,{t}]" in _descs(r, "_scaled_dot_product_flash_attention.default")  # logsumexp
    biggest = max(s for s, a in zip(r.events.size, r.events.action, strict=True) if a == Action.ALLOC)
    assert biggest < b * 4 * t * t * 2  # no materialised score matrix
    bufs = [d for d in _descs(r, "flash_attn.bwd_buffers")]
    assert bufs == [f"f32[{b},4,256]", f"f32[{b},256,4,32]"]  # softmax_d, dq_accum (rounded)


class KeywordAttn(Attn):
    """diffusers' native attention backend: ``F.scaled_dot_product_attention(query=…, key=…, value=…)``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(query=q, key=k, value=v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(b, t, d))


def test_sdpa_called_with_keywords_takes_the_gpus_kernel() -> None:
    b, t = 2, 256
    r = trace_model(KeywordAttn(), torch.randn(b, t, 64), workload=Workload(task="train", precision="bf16"),
                    device=device_profile(_gpu("8.0")), options=NO_WS, iterations=1)
    assert "SDPA kernels: flash ×1" in r.notes  # it took meta's math path: the scores [B,H,T,T]
    biggest = max(s for s, a in zip(r.events.size, r.events.action, strict=True) if a == Action.ALLOC)
    assert biggest < b * 4 * t * t * 2


def test_math_path_on_old_gpus_materialises_scores() -> None:
    b, t = 2, 128
    r = trace_model(Attn(), torch.randn(b, t, 64), workload=Workload(task="train", precision="bf16"),
                    device=device_profile(_gpu("7.0")), options=NO_WS, iterations=1)
    assert "SDPA kernels: math ×1" in r.notes
    biggest = max(s for s, a in zip(r.events.size, r.events.action, strict=True) if a == Action.ALLOC)
    assert biggest >= b * 4 * t * t * 2


def test_autocast_casts_weights_once_and_keeps_softmax_fp32() -> None:
    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(64, 64)
            self.b = nn.Linear(64, 64)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.b(self.a(x) + self.a(x))  # self.a used twice: one cached cast
            return torch.softmax(h, -1)

    r = trace_model(Net(), torch.randn(8, 64), workload=Workload(task="train", precision="bf16-mixed"),
                    options=NO_WS, iterations=1)
    log = r.events
    cached = [k for k in range(len(log)) if log.action[k] == Action.ALLOC and log.category[k] == Category.AUTOCAST_CACHE]
    assert sorted(log.size[k] for k in cached) == sorted([64 * 64 * 2, 64 * 2] * 2)
    assert all(log.phase[k] == 1 for k in cached)  # made in the forward
    a = analysis.arrays(log)
    freed = {int(a.alloc_idx[j]): int(a.free_idx[j]) for j in range(len(a.alloc_idx))}
    assert all(freed[k] < len(log) for k in cached)  # all gone by the end of the step
    assert any(d.startswith("f32[8,64]") for d in _descs(r, "_softmax"))
    assert any(d.startswith("bf16[8,64]") for d in _descs(r, "addmm"))


def test_autocast_casts_an_ops_arguments_in_cudas_order() -> None:
    """CUDA's autocast casts an op's arguments right to left (one C++ pack expansion, as GCC
    evaluates it), so the backward casts the input's gradient back first, then the weight's, then
    the bias's. The CPU's autocast is the same wrapper from the same build: its order is the
    reference."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.scale = nn.Parameter(torch.ones(64))
            self.lin = nn.Linear(64, 32)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.lin(x * self.scale)  # an fp32 input that requires grad: three casts

    class Casts(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.seen: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN202
            out = func(*args, **(kwargs or {}))
            if func is torch.ops.aten._to_copy.default:
                self.seen.append(f"{str(out.dtype).removeprefix('torch.')}{list(out.shape)}")
            return out

    net = Net()
    with Casts() as real:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = net(torch.randn(8, 64))
        forward = list(real.seen)
        y.float().sum().backward()
    backward = real.seen[-3:]  # the three gradients cast back to fp32
    assert forward == ["bfloat16[32]", "bfloat16[32, 64]", "bfloat16[8, 64]"]  # bias, weight, input
    r = trace_model(Net(), torch.randn(8, 64), workload=Workload(task="train", precision="bf16-mixed"),
                    options=NO_WS, iterations=1)
    log = r.events
    casts = [(log.phase[k], log.strings[log.desc[k]].split(" ")[0]) for k in range(len(log))
             if log.action[k] == Action.ALLOC and log.strings[log.op[k]] == "aten._to_copy.default"]
    names = {"bfloat16": "bf16", "float32": "f32"}

    def short(s: str) -> str:
        dtype, shape = s.split("[")
        return f"{names[dtype]}[{shape.replace(' ', '')}"

    assert [d for ph, d in casts if ph == 1][:3] == [short(s) for s in forward]
    assert backward == ["float32[8, 64]", "float32[32, 64]", "float32[32]"]  # input, weight, bias
    assert [d for ph, d in casts if ph == 2][-3:] == [short(s) for s in backward]


def test_cublas_workspace_once_per_thread_with_the_gpus_size() -> None:
    model = nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 32))
    for cc, size in (("8.0", 8_519_680), ("9.0", 32 << 20)):
        r = trace_model(model, torch.randn(4, 32), workload=Workload(task="train", precision="fp32"), device=device_profile(_gpu(cc)))
        log = r.events
        ws = [k for k in range(len(log)) if log.strings[log.op[k]] == "cublas.workspace"]
        assert [log.size[k] for k in ws] == [size, size]  # main thread, autograd thread
        assert [log.phase[k] for k in ws] == [1, 2]
        assert all(log.action[k] == Action.ALLOC for k in ws)  # never freed
    r = trace_model(model, torch.randn(4, 32), workload=Workload(task="infer", precision="fp32"))
    assert sum(1 for k in range(len(r.events)) if r.events.strings[r.events.op[k]] == "cublas.workspace") == 1


def test_cudnn_conv_workspace_is_transient() -> None:
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Conv2d(8, 8, 3))
    r = trace_model(model, torch.randn(2, 3, 16, 16), workload=Workload(task="train", precision="fp32"),
                    iterations=1)
    log = r.events
    ks = [k for k in range(len(log)) if log.strings[log.op[k]] == "cudnn.workspace"]
    assert len(ks) >= 2 * 4  # 2 convs forward, 2 backward (weights; input grad of the 2nd)
    for a, f in zip(ks[::2], ks[1::2], strict=True):  # each ALLOC right followed by its FREE
        assert (log.action[a], log.action[f], f) == (Action.ALLOC, Action.FREE, a + 1)
        assert log.id[a] == log.id[f] and log.category[a] == Category.WORKSPACE


def _optimizer_peak_temporaries(impl: str) -> tuple[int, int]:
    model = nn.Sequential(nn.Linear(256, 256), nn.Linear(256, 256))
    r = trace_model(model, torch.randn(4, 256), workload=Workload(task="train", precision="fp32",
                    optimizer="adamw", optimizer_impl=impl), options=NO_WS)
    opt = [p for p in r.phases if str(p.phase) == "optimizer"][0]
    params = sum(p.numel() * 4 for p in model.parameters())
    return opt.breakdown.temporaries, params


def test_foreach_optimizer_has_whole_list_temporaries() -> None:
    foreach, params = _optimizer_peak_temporaries("foreach")
    loop, _ = _optimizer_peak_temporaries("for-loop")
    fused, _ = _optimizer_peak_temporaries("fused")
    assert foreach >= params  # sqrt(exp_avg_sq) for every parameter at once
    largest = 256 * 256 * 4
    assert loop < foreach and loop <= 2 * largest + 2 * 256 * 4  # sqrt and division of one parameter
    assert fused == 0


def test_profile_defaults_and_options() -> None:
    p = device_profile(None)
    assert isinstance(p, DeviceProfile) and p.sm == (8, 0) and p.cublas_workspace == 8_519_680
    assert device_profile(None, workspaces=False).cublas_workspace == 0
    assert device_profile(_gpu("9.0")).prefer_cudnn_attention


def test_moe_routing_gets_uniform_expert_load() -> None:
    from transformers import MixtralConfig, MixtralForCausalLM

    cfg = MixtralConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                        num_key_value_heads=2, vocab_size=256, num_local_experts=4, num_experts_per_tok=2)
    cfg._experts_implementation = "eager"
    tokens = 2 * 64
    r = trace_model(lambda: MixtralForCausalLM(cfg), {"input_ids": torch.zeros(2, 64, dtype=torch.long)},
                    workload=Workload(task="infer", precision="fp32"), options=NO_WS, iterations=1)
    assert any("uniform expert load" in n for n in r.notes)
    per_expert = tokens * 2 // 4
    gathered = [d for d in _descs(r, "aten.index.Tensor") if d.endswith(",64]") and d.startswith("f32[")]
    assert f"f32[{per_expert},64]" in gathered
    assert math.isclose(per_expert, tokens * cfg.num_experts_per_tok / cfg.num_local_experts)


def test_multihead_attention_runs_cudas_kernels_inside() -> None:
    # F.multi_head_attention_forward reaches the function mode as one call, which torch handles
    # with the mode popped: its projections, attention and dropout must still be CUDA's
    b, t, h = 2, 256, 4

    class MHA(nn.Module):
        def __init__(self, need_weights: bool) -> None:
            super().__init__()
            self.need_weights = need_weights
            self.attn = nn.MultiheadAttention(64, h, dropout=0.1, batch_first=True)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.attn(x, x, x, need_weights=self.need_weights)[0]

    x = torch.randn(b, t, 64)
    r = trace_model(MHA(False), x, workload=Workload(task="train", precision="bf16-mixed"),
                    device=device_profile(_gpu("8.0")), options=NO_WS, iterations=1)
    assert "SDPA kernels: flash ×1" in r.notes  # not the math path meta would take
    biggest = max(s for s, a in zip(r.events.size, r.events.action, strict=True) if a == Action.ALLOC)
    assert biggest < b * h * t * t * 2  # no materialised score matrix
    assert f"bf16[{b * t},192]" in _descs(r, "aten.mm")  # the packed in-projection, autocast to bf16
    # the weights path (need_weights=True): softmax, then dropout with CUDA's bool mask
    r = trace_model(MHA(True), x, workload=Workload(task="train", precision="fp32"),
                    device=device_profile(_gpu("8.0")), options=NO_WS, iterations=1)
    assert f"bool[{b * h},{t},{t}]" in _descs(r, "native_dropout")
    assert f"f32[{b * h},{t},{t}]" not in _descs(r, "empty_like")  # no float noise tensor (the CPU's path)
