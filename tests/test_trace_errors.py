"""Bad input raises a one-line TraceError naming the op/module; known values stay exact."""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn

from vramplan.errors import TraceError
from vramplan.events import Action
from vramplan.trace.run import TraceOptions, trace_model
from vramplan.workload import Workload

NO_WS = TraceOptions(workspaces=False)
INFER = Workload(task="infer", precision="fp32")


class Branchy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.proj(x)
        if y.sum() > 0:  # control flow on model data
            return y * 2
        return y


class Outer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block = Branchy()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.block(x)


def test_data_dependent_control_flow_names_the_module() -> None:
    with pytest.raises(TraceError) as e:
        trace_model(Outer(), torch.randn(2, 8), workload=INFER, options=NO_WS)
    msg = str(e.value)
    assert "data-dependent control flow" in msg and "module block" in msg and "\n" not in msg


@torch.library.custom_op("vramplan_test::cpu_only", mutates_args=())
def _cpu_only(x: torch.Tensor) -> torch.Tensor:
    return x.clone()


class UsesExtension(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.vramplan_test.cpu_only(self.fc(x))


def test_op_without_meta_kernel_names_the_op_and_the_fix() -> None:
    with pytest.raises(TraceError) as e:
        trace_model(UsesExtension(), torch.randn(2, 8), workload=INFER, options=NO_WS)
    msg = str(e.value)
    assert "vramplan_test.cpu_only" in msg and "UsesExtension" in msg and "register_fake" in msg


def test_failing_factory_and_non_module() -> None:
    def broken() -> nn.Module:
        raise ValueError("no such layer")

    with pytest.raises(TraceError, match="building the model failed: ValueError: no such layer"):
        trace_model(broken, torch.randn(2, 8), workload=INFER)
    with pytest.raises(TraceError, match="nn.Module"):
        trace_model(lambda: 42, torch.randn(2, 8), workload=INFER)  # type: ignore[arg-type, return-value]


def test_shape_error_in_user_code_is_a_trace_error() -> None:
    with pytest.raises(TraceError, match="tracing failed in module"):
        trace_model(nn.Linear(8, 4), torch.randn(2, 5), workload=INFER, options=NO_WS)


class Masked(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        mask = torch.ones(b, t, dtype=torch.bool, device=x.device)
        mask[:, :3] = False  # known values: the selection below is exact
        kept = x[mask]
        n = int(torch.arange(4, device="cuda").sum())  # a value computed from known values; "cuda" maps to the trace device
        unknown = torch.nonzero(self.fc(x) > 0)  # model data: every element assumed non-zero
        return kept.sum() * n + unknown.shape[0]


def test_known_values_are_exact_and_unknown_ones_documented() -> None:
    b, t, d = 2, 16, 4
    r = trace_model(Masked(), torch.randn(b, t, d), workload=INFER, options=NO_WS)
    log = r.events
    descs = [log.strings[log.desc[k]] for k in range(len(log)) if log.action[k] == Action.ALLOC]
    assert f"f32[{b * (t - 3)},{d}]" in descs  # exact boolean-mask selection
    assert f"i64[{b * t * d},3]" in descs  # nonzero of model data: all elements
    assert any("data-dependent nonzero" in n for n in r.notes)
    # the input's own values are known (a small host tensor): a mask of it is exact
    x = torch.randn(b, t, d)
    r2 = trace_model(lambda: _Positives(), x, workload=INFER, options=NO_WS)
    descs2 = [r2.events.strings[r2.events.desc[k]] for k in range(len(r2.events)) if r2.events.action[k] == Action.ALLOC]
    assert f"i64[{int((x > 0).sum())},3]" in descs2


class _Positives(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nonzero(x > 0)




def test_cuda_calls_in_user_code_become_allocator_events() -> None:
    class Syncs(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = self.fc(x.cuda())
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            return y

    r = trace_model(Syncs(), torch.randn(2, 4), workload=INFER, options=NO_WS, iterations=1)
    actions = [Action(a) for a in r.events.action]
    assert Action.SYNC in actions and Action.EMPTY_CACHE in actions
    assert actions.index(Action.SYNC) < actions.index(Action.EMPTY_CACHE)


def test_sharded_layouts_are_refused_not_misreported() -> None:
    with pytest.raises(TraceError, match="not traced for catalog models: PyTorch has no expert-parallel API"):
        trace_model(nn.Linear(4, 4), torch.randn(2, 4), workload=Workload(task="train").replace(ep=2, dp=2))
    with pytest.raises(TraceError, match="traced for catalog models"):
        trace_model(nn.Linear(4, 4), torch.randn(2, 4), workload=Workload(task="train").replace(cp=2))
    with pytest.raises(TraceError, match="torchtitan's Llama plan"):  # TP needs named attention/MLP linears
        trace_model(nn.Linear(4, 4), torch.randn(2, 4), workload=Workload(task="train").replace(tp=2))
    with pytest.raises(TraceError, match="torchtitan's Llama plan"):  # TP x DDP is traced, with the same plan
        trace_model(nn.Linear(4, 4), torch.randn(2, 4), workload=Workload(task="train").replace(tp=2, dp=2))
    with pytest.raises(TraceError, match="DeepSpeed ZeRO-1 is not traced"):
        trace_model(nn.Linear(4, 4), torch.randn(2, 4), workload=Workload(task="train").replace(dp=2, zero=1))
    r = trace_model(nn.Linear(4, 4), torch.randn(2, 4), workload=Workload(task="train").replace(dp=4), options=NO_WS)
    assert any("DDP over dp=4" in n for n in r.notes)


def test_trace_failure_names_the_torch_version_and_the_op() -> None:
    with pytest.raises(TraceError) as e:
        trace_model(nn.Linear(8, 4), torch.randn(2, 5), workload=INFER, options=NO_WS)
    msg = str(e.value)
    assert f"on torch {torch.__version__}" in msg and "last op aten." in msg and "\n" not in msg


def test_unknown_checkpoint_internals_fail_loudly(monkeypatch: pytest.MonkeyPatch) -> None:
    """A torch whose checkpoint module lacks the generator we emulate recompute through: the
    trace refuses (naming the version) instead of recomputing outside the CUDA emulation."""
    import torch.utils.checkpoint as ckpt

    for name in ("_checkpoint_without_reentrant_generator", "_checkpoint_without_reentrant_generator_impl"):
        monkeypatch.delattr(ckpt, name, raising=False)
    hooks = dict(nn.modules.module._global_forward_pre_hooks)
    with pytest.raises(TraceError, match=re.escape(f"torch {torch.__version__}: torch.utils.checkpoint")):
        trace_model(nn.Linear(8, 4), torch.randn(2, 8), workload=INFER, options=NO_WS)
    assert dict(nn.modules.module._global_forward_pre_hooks) == hooks  # the session's set-up was undone


def test_a_flop_formula_that_rejects_the_shapes_does_not_fail_the_trace(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch 2.11's sdpa_flop_count refused grouped-query attention: FLOPs are a by-product,
    the memory trace goes on and the report says which ops were not counted."""
    from torch.utils.flop_counter import flop_registry

    def refuses(*args: object, **kwargs: object) -> int:
        raise AssertionError("shapes are incompatible")

    monkeypatch.setitem(flop_registry, torch.ops.aten.mm, refuses)
    train = Workload(task="train", precision="fp32")
    opts = TraceOptions(workspaces=False, count_flops=True)
    ok = trace_model(nn.Linear(8, 4), torch.randn(2, 8), workload=train, options=opts)
    monkeypatch.setitem(flop_registry, torch.ops.aten.addmm, refuses)
    r = trace_model(nn.Linear(8, 4), torch.randn(2, 8), workload=train, options=opts)
    assert r.peak_allocated == ok.peak_allocated > 0 and r.flops is not None and r.flops < ok.flops
    assert any("FLOPs not counted for aten.addmm.default ×1" in n for n in r.notes)


class ReadsActivation(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.router = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = int(self.router(x).argmax(-1).max())  # a value of model data: no sound answer
        return x[:n]


def test_value_of_model_data_names_the_users_file_line_and_the_override() -> None:
    import inspect

    with pytest.raises(TraceError) as e:
        trace_model(ReadsActivation, torch.randn(2, 8), workload=INFER, options=NO_WS)
    line = inspect.getsourcelines(ReadsActivation.forward)[1] + 1
    msg = str(e.value)
    assert f"test_trace_errors.py:{line}" in msg and "--routing-skew" in msg and "\n" not in msg


def test_cli_trace_of_unservable_model_exits_2_with_the_line(tmp_path, capsys, monkeypatch) -> None:
    from vramplan.cli.main import main

    (tmp_path / "usermodel.py").write_text(
        "import torch\n"
        "from torch import nn\n"
        "class M(nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.fc = nn.Linear(8, 8)\n"
        "    def forward(self, x):\n"
        "        if self.fc(x).mean().item() > 0:\n"
        "            return x\n"
        "        return -x\n"
        "def build():\n"
        "    return M(), torch.randn(2, 8)\n"
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    code = main(["trace", "usermodel.py:build", "--task", "infer", "--precision", "fp32"])
    err = capsys.readouterr().err
    assert code == 2
    assert "usermodel.py:8" in err and "Traceback" not in err
