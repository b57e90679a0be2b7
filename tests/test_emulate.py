"""The emulated GPU (vramplan.emulate): what real code sees of a GPU it does not have."""

from __future__ import annotations

import inspect
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import vramplan
from vramplan.emulate import DeviceFacts, LiveAllocator, emulated_gpu
from vramplan.errors import TraceError
from vramplan.events import Category, EventLog
from vramplan.hardware.catalog import get_gpu

EX = Path(__file__).parent / "examples"
MODULES = ("cuda", "cuda.memory", "cuda.random", "cuda.nvtx", "accelerator", "accelerator.memory")


def _module(name: str) -> object:
    obj: object = torch
    for part in name.split("."):
        obj = getattr(obj, part, None)
    return obj


def _callables() -> dict[tuple[str, str], object]:
    out = {}
    for mod_name in MODULES:
        mod = _module(mod_name)
        if mod is None:
            continue
        for name in dir(mod):
            if not name.startswith("__"):
                value = getattr(mod, name)
                if callable(value):
                    out[(mod_name, name)] = value
    return out


@pytest.fixture
def gpu():  # noqa: ANN201
    facts = DeviceFacts(name="NVIDIA H100 80GB HBM3", sm=(9, 0), total_memory=80 * 2**30, sm_count=132, count=2)
    syncs: list[str] = []
    with emulated_gpu(facts, LiveAllocator(EventLog()), on_sync=syncs.append,
                      values=lambda t, what, exact=False: None) as em:
        yield em, syncs


def test_every_emulated_callable_has_torchs_own_signature() -> None:
    real = _callables()
    facts = DeviceFacts(name="x", sm=(8, 0), total_memory=2**30)
    with emulated_gpu(facts, LiveAllocator(EventLog()), on_sync=lambda k: None, values=lambda t, w, exact=False: None):
        emulated = {k: v for k, v in _callables().items() if real.get(k) is not v}
    assert len(emulated) >= 60, sorted(emulated)
    checked = 0
    for key, fn in emulated.items():
        try:
            want = inspect.signature(real[key])
        except (TypeError, ValueError):
            continue  # a builtin without a text signature
        assert inspect.signature(fn) == want, key
        checked += 1
    assert checked >= 50


def test_emulated_calls_take_torchs_keyword_names(gpu) -> None:  # noqa: ANN001
    em, syncs = gpu
    s = torch.cuda.Stream()
    with torch.cuda.stream(stream=s):  # the keyword torch names it by
        pass
    assert torch.cuda.mem_get_info(device=0)[1] == 80 * 2**30
    assert torch.cuda.get_device_properties(device="cuda:1").multi_processor_count == 132
    assert torch.cuda.is_bf16_supported(including_emulation=False)
    torch.accelerator.synchronize(0)
    torch.cuda.synchronize(device=None)
    assert syncs == ["synchronize", "synchronize"]
    with pytest.raises(TypeError, match="unexpected keyword"):
        torch.cuda.mem_get_info(dev=0)  # as torch's own function refuses it
    with pytest.raises(RuntimeError, match="invalid device ordinal 2"):
        torch.cuda.set_device(2)
    with pytest.raises(TraceError, match="CUDA graph"):
        torch.cuda.CUDAGraph()


def test_torch_accelerator_names_the_emulated_gpu(gpu) -> None:  # noqa: ANN001
    acc = torch.accelerator
    assert acc.is_available() and acc.current_accelerator() == torch.device("cuda")
    assert acc.device_count() == torch.cuda.device_count() == 2
    acc.set_device_index(1)
    assert acc.current_device_index() == torch.cuda.current_device() == 1
    with torch.cuda.device(0):
        assert torch.cuda.current_device() == 0
    assert torch.cuda.current_device() == 1
    assert torch.get_device_module() is torch.cuda


def test_everything_is_put_back_afterwards() -> None:
    before = _callables()
    version, tensor_device = torch.version.cuda, torch.Tensor.__dict__.get("device")
    facts = DeviceFacts(name="x", sm=(8, 0), total_memory=2**30)
    with emulated_gpu(facts, LiveAllocator(EventLog()), on_sync=lambda k: None, values=lambda t, w, exact=False: None):
        assert torch.cuda.is_available()
    assert _callables() == before
    assert torch.version.cuda == version and torch.Tensor.__dict__.get("device") is tensor_device
    assert not torch.accelerator.is_available() or torch.cuda.is_available()


def test_a_script_cannot_tell_the_emulated_gpu_from_a_real_one(tmp_path: Path) -> None:
    out = tmp_path / "seen.json"
    r = vramplan.run_script(EX / "device_probe.py", [str(out)], gpu="rtx-4090", steps=2)
    seen = json.loads(out.read_text())
    assert seen["accelerator"] == [True, "cuda", 1, 0]
    assert seen["param"] == ["cuda:0", True, 0, False, "torch.cuda.FloatTensor"]
    assert seen["input"] == ["cuda:0", True, 0]
    assert seen["int_device"] == "cuda:0"
    assert seen["tied"] and seen["same_object"]  # .to() kept the Parameter objects and the tie
    assert seen["format"].strip().replace(".", "").isdigit() and seen["repr_device"]
    assert seen["host"] == ["cpu", True]
    assert seen["default_device"] == seen["factory"] == "cuda:0"
    # the tied embedding/head is counted once, with one gradient and one momentum-free SGD
    assert r.params == seen["params"] == 512 * 64
    assert r.model_states.weights == 512 * 64 * 4
    assert r.ran is not None and r.ran.optimizers == ("SGD (foreach)",)
    assert (r.ran.batch, r.ran.seq) == (4, 16) and r.ran.precision == "fp32 weights"


def test_module_conversion_keeps_parameters_when_a_swap_is_impossible(tmp_path: Path) -> None:
    out = tmp_path / "out.json"
    script = tmp_path / "weakref_param.py"
    script.write_text(
        "import json, sys, weakref, torch\nfrom torch import nn\n"
        "model = nn.Linear(64, 64)\n"
        "ref = weakref.ref(model.weight)\n"  # a weak reference makes torch.utils.swap_tensors refuse
        "opt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
        "model.to(1)\n"  # an int: a CUDA ordinal
        "seen = [opt.param_groups[0]['params'][0] is model.weight, model.weight.is_cuda]\n"
        "json.dump(seen, open(sys.argv[1], 'w'))\n"
        "model(torch.randn(4, 64, device='cuda:1')).sum().backward(); opt.step()\n")
    r = vramplan.run_script(script, [str(out)], gpus=2, steps=1)
    assert json.loads(out.read_text()) == [True, True]  # the optimizer follows the new Parameter
    assert r.model_states.optimizer == 0 and r.model_states.gradients == (64 * 64 + 64) * 4


def test_module_to_with_the_device_as_a_keyword_moves_the_model(tmp_path: Path) -> None:
    # ``model.to(device=dev, dtype=None)`` (timm's train.py): Module.to's argument parser must see
    # the device as written, not the emulation's storage device
    out = tmp_path / "out.json"
    script = tmp_path / "to_keyword.py"
    script.write_text(
        "import json, sys, torch\nfrom torch import nn\n"
        "a, b = nn.Linear(64, 64), nn.Linear(64, 64)\n"
        "a.to(device=torch.device('cuda'), dtype=None)\n"
        "b.to(device='cuda', non_blocking=True)\n"
        "json.dump([str(a.weight.device), str(b.bias.device)], open(sys.argv[1], 'w'))\n"
        "opt = torch.optim.SGD([*a.parameters(), *b.parameters()], lr=0.1)\n"
        "b(a(torch.randn(4, 64, device='cuda'))).sum().backward(); opt.step()\n")
    r = vramplan.run_script(script, [str(out)], steps=1)
    assert json.loads(out.read_text()) == ["cuda:0", "cuda:0"]
    assert r.model_states.weights == 2 * (64 * 64 + 64) * 4


def _run_cli(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "vramplan.cli.main", *argv], capture_output=True, text=True,
                          timeout=300)


def test_a_model_left_on_the_cpu_is_never_called_fits(tmp_path: Path) -> None:
    script = tmp_path / "cpu_model.py"
    script.write_text(
        "import torch\nfrom torch import nn\n"
        "model = nn.Sequential(nn.Linear(512, 2048), nn.ReLU(), nn.Linear(2048, 512))\n"
        "opt = torch.optim.AdamW(model.parameters())\n"
        "for _ in range(3):\n"
        "    loss = model(torch.randn(8, 512)).sum()\n"  # line 6: the model runs on the CPU
        "    loss.backward(); opt.step(); opt.zero_grad()\n")
    p = _run_cli("run", "--", "python", str(script))
    assert p.returncode == 2, p.stdout + p.stderr
    assert "FITS" not in p.stdout + p.stderr and "Traceback" not in p.stderr
    assert "never reached the GPU" in p.stderr and "cpu_model.py:6" in p.stderr


def test_the_scripts_own_errors_are_reported_as_its_own(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text("import torch\nx = torch.ones(2, device='cuda')\nraise ValueError('wrong --lr')\n")
    with pytest.raises(TraceError, match=r"bad\.py:3: the script raised ValueError: wrong --lr") as e:
        vramplan.run_script(bad)
    assert "emulat" not in str(e.value.message)
    syntax = tmp_path / "syntax.py"
    syntax.write_text("import torch\nif True print(1)\n")
    with pytest.raises(TraceError, match=r"syntax\.py:2: SyntaxError"):
        vramplan.run_script(syntax)


def test_os_exit_ends_the_script_not_vramplan(tmp_path: Path) -> None:
    script = tmp_path / "exits.py"
    script.write_text(
        "import os, sys, torch\nfrom torch import nn\n"
        "m = nn.Linear(64, 64).cuda()\nopt = torch.optim.SGD(m.parameters(), lr=0.1)\n"
        "m(torch.randn(4, 64, device='cuda')).sum().backward(); opt.step()\n"
        "os._exit(int(sys.argv[1]))\n")
    r = vramplan.run_script(script, ["0"], steps=5)
    assert r.peak.allocated > 0 and any("ended after 1 optimizer step" in n for n in r.notes)
    p = _run_cli("run", "--", "python", str(script), "5")
    assert p.returncode == 2 and "exited with status 5 (os._exit)" in p.stderr, p.stderr


def test_json_output_is_clean_when_the_script_prints(tmp_path: Path) -> None:
    script = tmp_path / "chatty.py"
    script.write_text(
        "import torch\nfrom torch import nn\nprint('hello from the script')\n"
        "m = nn.Linear(64, 64).cuda()\nopt = torch.optim.SGD(m.parameters(), lr=0.1)\n"
        "for i in range(3):\n"
        "    loss = m(torch.randn(4, 64, device='cuda')).sum(); loss.backward(); opt.step()\n"
        "    print(f'step {i} loss {loss.item():.3f}')\n")
    p = _run_cli("run", "--json", "--", "python", str(script))
    assert p.returncode == 0, p.stderr
    d = json.loads(p.stdout)
    assert d["ran"]["optimizers"] == ["SGD (foreach)"]
    assert "hello from the script" in p.stderr


def test_inference_progress_counts_forward_calls(tmp_path: Path) -> None:
    lines: list[str] = []
    script = tmp_path / "infer.py"
    script.write_text(
        "import time, torch\nfrom torch import nn\nm = nn.Linear(64, 64).cuda().eval()\n"
        "with torch.no_grad():\n"
        "    for _ in range(10):\n"
        "        m(torch.randn(4, 64, device='cuda')); time.sleep(0.4)\n")
    vramplan.run_script(script, steps=5, progress=lines.append)
    assert lines and all("forward" in line and "step" not in line for line in lines)


def test_a_large_model_built_on_the_cpu_takes_no_ram(tmp_path: Path) -> None:
    out = tmp_path / "out.json"
    script = tmp_path / "big.py"
    script.write_text(
        "import json, sys, torch\nfrom torch import nn\nfrom vramplan.emulate.tensors import on_meta\n"
        "m = nn.Linear(20000, 20000)\n"  # 1.6 GB of fp32 on the host
        "small = torch.arange(10)\n"
        "seen = [on_meta(m.weight), str(m.weight.device), small.tolist()]\n"
        "m.cuda()\n"
        "m(torch.randn(2, 20000, device='cuda'))\n"
        "json.dump(seen, open(sys.argv[1], 'w'))\n")
    r = vramplan.run_script(script, [str(out)], steps=1)
    assert json.loads(out.read_text()) == [True, "cpu", list(range(10))]
    assert r.model_states.weights == (20000 * 20000 + 20000) * 4  # the GPU still holds the whole layer


def test_data_parallel_reports_gpu_0s_share(tmp_path: Path) -> None:
    script = tmp_path / "dp.py"
    script.write_text(
        "import torch\nfrom torch import nn\n"
        "model = nn.DataParallel(nn.Sequential(nn.Linear(1024, 4096), nn.ReLU(), nn.Linear(4096, 1024)).cuda())\n"
        "opt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
        "for _ in range(3):\n"
        "    loss = model(torch.randn(256, 1024, device='cuda')).float().pow(2).mean()\n"
        "    loss.backward(); opt.step(); opt.zero_grad()\n")
    one = vramplan.run_script(script, gpus=1, workspaces=False)
    four = vramplan.run_script(script, gpus=4, workspaces=False)
    assert one.model_states == four.model_states  # the module and its gradients live on GPU 0
    fwd = [max(p.breakdown.activations for p in r.phases if p.phase.value == "forward") for r in (one, four)]
    assert fwd[1] <= 0.6 * fwd[0]  # replica 0 runs a quarter of the batch (plus the gathered output)
    grads = four.model_states.gradients
    bwd = max(p.breakdown.temporaries for p in four.phases if p.phase.value == "backward")
    assert bwd >= grads  # Broadcast.backward's reduce-add sum, beside replica 0's own gradients


def test_checkpoints_load_to_the_device_and_copies_count_where_they_land(tmp_path: Path) -> None:
    ckpt = tmp_path / "model.pt"
    torch.manual_seed(0)
    torch.save(torch.nn.Linear(1024, 1024).state_dict(), ckpt)  # a real file (saved on the CPU)
    n = (1024 * 1024 + 1024) * 4
    script = tmp_path / "load.py"
    script.write_text(
        "import sys, torch\nfrom torch import nn\n"
        "sd = torch.load(sys.argv[1], map_location='cuda')\n"  # to the GPU: one copy there
        "assert sd['weight'].is_cuda\n"
        "cpu_model = nn.Linear(1024, 1024)\n"
        "cpu_model.load_state_dict(sd)\n"  # a CUDA checkpoint into a CPU model: lands on the host
        "model = cpu_model.cuda()\n"
        "del sd\n"
        "opt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
        "model(torch.randn(8, 1024, device='cuda')).sum().backward(); opt.step()\n")
    r = vramplan.run_script(script, [str(ckpt)], steps=1, workspaces=False)
    assert r.model_states.weights == n  # the model once; the host copy is not GPU memory
    inputs = [t for t in r.top_tensors if t.category == "input" and t.shape == (1024, 1024)]
    assert not inputs  # the checkpoint was freed before the step's peak
    assert r.peak.allocated < 3 * n  # weights, gradients and the step: no second model on the GPU


def test_a_pickled_module_loads_onto_the_device(tmp_path: Path) -> None:
    # `torch.save(model)` then `torch.load(f, map_location=device)` (PyTorch examples'
    # word_language_model/generate.py): the module's parameters land on the GPU
    ckpt = tmp_path / "whole.pt"
    torch.save(torch.nn.Linear(1024, 1024), ckpt)
    script = tmp_path / "load_module.py"
    script.write_text(
        "import sys, torch\n"
        "model = torch.load(sys.argv[1], map_location=torch.device('cuda'), weights_only=False).eval()\n"
        "assert model.weight.is_cuda, model.weight.device\n"
        "with torch.no_grad():\n"
        "    for _ in range(2):\n"
        "        model(torch.randn(8, 1024, device='cuda'))\n")
    r = vramplan.run_script(script, [str(ckpt)], steps=2, workspaces=False)
    assert r.model_states.weights == (1024 * 1024 + 1024) * 4


def test_a_loop_without_an_optimizer_stops_after_its_backward_passes() -> None:
    r = vramplan.run_script(EX / "lstm_manual_sgd.py", steps=2)
    assert r.ran is not None and r.ran.line().startswith("task train · batch 20 · seq 35")  # time-major LSTM input
    assert r.workload.task.value == "train" and r.ran.optimizers == ()
    assert any("stopped after 2 backward pass(es)" in n for n in r.notes)
    ev = r.events
    assert ev is not None
    grads = sum(ev.size[k] for k in range(len(ev)) if ev.action[k] == 0 and ev.category[k] == int(Category.GRADIENT))
    assert grads >= r.model_states.weights  # every parameter's gradient is labelled as one (two steps)


def test_a_trace_factory_picks_the_emulated_gpu_as_it_would_a_real_one() -> None:
    seen: dict[str, object] = {}

    def make() -> torch.nn.Module:  # PyTorch's current examples pick the device this way
        acc = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else torch.device("cpu")
        seen.update(acc=acc, name=torch.cuda.get_device_name(), cuda=torch.cuda.is_available())
        return torch.nn.Linear(512, 512).to(acc)

    r = vramplan.trace(make, (torch.randn(8, 512, device="meta"),), gpu="h100-sxm")
    assert seen == {"acc": torch.device("cuda"), "name": get_gpu("h100-sxm").name, "cuda": True}
    assert r.model_states.weights == (512 * 512 + 512) * 4
    assert not torch.cuda.is_available() and not torch.accelerator.is_available()  # restored after


def test_a_dataloader_keeps_its_signature_for_libraries_that_rebuild_it(tmp_path: Path) -> None:
    # Lightning (DDP: a DistributedSampler) and accelerate rebuild the script's DataLoader from
    # inspect.signature(loader.__init__); vramplan's in-process workers wrapper must not hide it
    seen = tmp_path / "seen.json"
    script = tmp_path / "rebuild.py"
    script.write_text(
        "import inspect, json, sys, torch\nfrom torch import nn\n"
        "from torch.utils.data import DataLoader, SequentialSampler, TensorDataset\n"
        "ds = TensorDataset(torch.randn(64, 16), torch.randn(64, 1))\n"
        "dl = DataLoader(ds, batch_size=8, shuffle=True, num_workers=2)\n"
        "params = inspect.signature(dl.__init__).parameters\n"
        "kw = {k: getattr(dl, k) for k, p in params.items() if k in vars(dl) and k not in ('sampler', 'batch_sampler')\n"
        "      and p.default != getattr(dl, k)}\n"
        "again = DataLoader(**kw, sampler=SequentialSampler(ds))\n"
        "json.dump(list(params), open(sys.argv[1], 'w'))\n"
        "model = nn.Linear(16, 1).cuda()\nopt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
        "for x, y in again:\n"
        "    nn.functional.mse_loss(model(x.cuda()), y.cuda()).backward(); opt.step(); opt.zero_grad()\n")
    r = vramplan.run_script(script, [str(seen)], gpu="h100-sxm", steps=2)
    assert json.loads(seen.read_text())[:3] == ["dataset", "batch_size", "shuffle"]  # DataLoader's own
    assert r.ran is not None and r.ran.batch == 8  # not the default batch of 1
    assert any("num_workers=2 ran in this process" in n for n in r.notes)  # the wrapper still acts


def test_the_users_line_is_never_vramplans_own_frame_beside_the_script() -> None:
    # a script at the root of a vramplan checkout (its src/ in the script's folder): the line
    # named is the script's, not the runner's hook that noticed the CPU forward
    import traceback

    from vramplan.script import runner

    pkg = Path(runner.__file__).resolve()
    script = pkg.parents[3] / "train.py"  # the checkout's root: src/vramplan/script/runner.py below it
    frames = [traceback.FrameSummary(str(script), 7, "<module>"),
              traceback.FrameSummary(str(pkg), 189, "module_pre")]
    assert runner._user_frame(frames, script).endswith("train.py:7")


def test_the_users_line_is_found_through_a_symlinked_folder(tmp_path: Path) -> None:
    # a library folder reached through a symlink (a dependency folder linked into a checkout):
    # its frames are resolved as the script's folder is, and the line keeps the path as run
    import traceback

    from vramplan.script import runner

    (tmp_path / "real" / "pkg").mkdir(parents=True)
    (tmp_path / "link").symlink_to(tmp_path / "real")
    script = tmp_path / "link" / "train.py"
    frames = [traceback.FrameSummary(str(script), 3, "<module>"),
              traceback.FrameSummary(str(tmp_path / "link" / "pkg" / "fsdp.py"), 51, "enable")]
    assert runner._user_frame(frames, script).endswith(str(Path("link", "pkg", "fsdp.py")) + ":51")


def test_data_assignment_across_host_and_device_keeps_the_object(tmp_path: Path) -> None:
    """``param.data = param.to("cuda")`` (FSDP1's own move, ``_move_states_to_device``) on a small
    host model: on a GPU the Parameter object stays (CPU and CUDA tensors are shallow-copy
    compatible); here the moved contents are swapped into it, its attributes and the optimizer
    built before the move kept."""
    out = tmp_path / "seen.json"
    script = tmp_path / "data_move.py"
    script.write_text(
        "import json, sys, torch\nfrom torch import nn\n"
        "m = nn.Linear(8, 8)\nw = m.weight\nw.tag = 'kept'\nopt = torch.optim.SGD(m.parameters(), lr=0.1)\n"
        "for p in m.parameters():\n    p.data = p.to('cuda')\n"
        "m(torch.randn(2, 8, device='cuda')).sum().backward()\n"
        "json.dump([m.weight is w, str(w.device), w.tag, type(w).__name__, w.grad is not None], open(sys.argv[1], 'w'))\n"
        "opt.step()\n")
    r = vramplan.run_script(script, [str(out)], steps=1)
    assert json.loads(out.read_text()) == [True, "cuda:0", "kept", "Parameter", True]
    assert r.model_states.weights == (8 * 8 + 8) * 4


def test_cuda_generators_and_legacy_tensor_types(tmp_path: Path) -> None:
    """``torch.Generator("cuda")`` (diffusers' seeded sampling) and ``torch.cuda.FloatTensor`` &
    co. (``Tensor = torch.cuda.FloatTensor``; ``x.type(Tensor)``) exist only in a CUDA build; on
    the emulated GPU they make and describe tensors of the target, and torch's own classes still
    answer ``isinstance`` for host generators."""
    out = tmp_path / "seen.json"
    script = tmp_path / "legacy.py"
    script.write_text(
        "import json, sys, torch\n"
        "g = torch.Generator('cuda').manual_seed(0)\nz = torch.randn(2, 4, device='cuda', generator=g)\n"
        "T = torch.cuda.FloatTensor\na = T(4, 3).fill_(1.0)\nb = torch.randn(2, 3).type(T)\n"
        "c = torch.cuda.LongTensor([1, 2])\n"
        "seen = [str(g.device), isinstance(g, torch.Generator), isinstance(torch.Generator(), torch.Generator),\n"
        "        str(z.device), str(a.device), str(a.dtype), str(b.device), str(c.dtype), isinstance(a, T),\n"
        "        isinstance(c, T), str(torch.randn(2).type('torch.cuda.HalfTensor').dtype)]\n"
        "json.dump(seen, open(sys.argv[1], 'w'))\n"
        "m = torch.nn.Linear(3, 3).cuda(); m(a).sum().backward()\n")
    vramplan.run_script(script, [str(out)], steps=1)
    assert json.loads(out.read_text()) == ["cuda:0", True, True, "cuda:0", "cuda:0", "torch.float32", "cuda:0",
                                           "torch.int64", True, False, "torch.float16"]


def test_threads_the_script_starts_see_the_emulated_gpu(tmp_path: Path) -> None:
    # a loader's thread pool moving weights to the device: on a CPU-only torch the worker raised
    # "not linked with support for cuda devices", reported as the script's own error
    body = ("import torch\nfrom concurrent.futures import ThreadPoolExecutor\nfrom torch import nn\n"
            "model = nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(4)])\n"
            "def move(p):\n"
            "    p.data = p.data.to('cuda')\n"
            "    return p.is_cuda and torch.cuda.is_available() and torch.accelerator.is_available()\n"
            "{how}\n"
            "opt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
            "for _ in range(2):\n"
            "    model(torch.randn(64, 1024, device='cuda')).sum().backward(); opt.step(); opt.zero_grad()\n")
    threaded = tmp_path / "threaded.py"
    threaded.write_text(body.format(how="with ThreadPoolExecutor(4) as pool:\n"
                                        "    assert all(pool.map(move, model.parameters()))"))
    inline = tmp_path / "inline.py"
    inline.write_text(body.format(how="assert all(map(move, model.parameters()))"))
    a = vramplan.run_script(threaded, steps=2, workspaces=False)
    b = vramplan.run_script(inline, steps=2, workspaces=False)
    assert a.model_states.weights == b.model_states.weights == 4 * (1024 * 1024 + 1024) * 4
    assert a.peak.allocated == b.peak.allocated


_FLEX = ("import sys, torch\n"
         "from torch.nn.attention.flex_attention import flex_attention, create_block_mask\n"
         "device = 'cuda' if torch.cuda.is_available() else 'cpu'\n"
         "attend = torch.compile(flex_attention) if sys.argv[1] == 'compiled' else flex_attention\n"
         "train = sys.argv[2] == 'train'\n"
         "torch.manual_seed(0)\n"
         "proj = torch.nn.Linear(64, 3 * 64, device=device)\n"
         "opt = torch.optim.SGD(proj.parameters(), lr=0.1)\n"
         "bm = create_block_mask(lambda b, h, q, k: q >= k, None, None, 256, 256, device=device)\n"
         "x = torch.randn(2, 256, 64, device=device)\n"
         "with torch.set_grad_enabled(train):\n"
         "    for _ in range(4):\n"
         "        q, k, v = proj(x).view(2, 256, 3, 4, 16).permute(2, 0, 3, 1, 4)\n"
         "        out = attend(q, k, v, block_mask=bm)\n"
         "        if train:\n"
         "            out.sum().backward(); opt.step(); opt.zero_grad()\n")


def test_flex_attention_eager_matches_its_cpu_run_and_compiled_is_the_fused_kernel(tmp_path: Path) -> None:
    # FlexAttention's autograd kernel traced its score function with fake tensors on the query's
    # device: 'cuda' on a CPU-only torch aborted the process (C++ terminate). Eager runs torch's
    # dense reference (the scores [B,H,Q,K] materialised), as on the CPU; compiled, Inductor's
    # fused kernels allocate their outputs only
    from vramplan.script.truth import compare, cpu_truth

    script = tmp_path / "flex.py"
    script.write_text(_FLEX)
    eager = vramplan.run_script(script, ["eager", "infer"], workspaces=False)
    c = compare(eager, cpu_truth(script, ["eager", "infer"]))
    assert c.residual == 0 and c.unexplained == 0  # the same storages at the peak as the CPU run
    compiled = vramplan.run_script(script, ["compiled", "infer"], workspaces=False)
    scores = 2 * 4 * 256 * 256 * 4  # one fp32 [B, H, Q, K]
    assert compiled.peak.allocated + scores <= eager.peak.allocated
    assert any("fused FlexAttention kernels" in n for n in compiled.notes)
    # training: backward runs (it has no CPU run to compare with: torch refuses FlexAttention's
    # backward on the CPU); compiled, no [B, H, Q, K] tensor is ever made
    for how in ("eager", "compiled"):
        r = vramplan.run_script(script, [how, "train"], workspaces=False)
        assert r.ran is not None and r.ran.steps == 2
        assert r.events is not None
        shapes = {r.events.strings[r.events.desc[k]] for k in range(len(r.events))}
        assert any(s.endswith("[2,4,256,256]") for s in shapes) == (how == "eager"), how


def test_foreach_gradient_clipping_and_dtype_views_of_host_values(tmp_path: Path) -> None:
    # torchtitan: clip_grad_norm_(foreach=True) on device parameters, and rank 0's host RNG state
    # sent to the device and read back as one uint64 (a dtype view of known values)
    out = tmp_path / "seed.txt"
    script = tmp_path / "titan_idioms.py"
    script.write_text(
        "import sys, torch\n"
        "seed = torch.get_rng_state()[:8].to('cuda')\n"
        "open(sys.argv[1], 'w').write(f\"{seed.to('cpu').view(torch.uint64).item()} \"\n"
        "                             f\"{torch.get_rng_state()[:8].view(torch.uint64).item()}\")\n"
        "model = torch.nn.Linear(1024, 1024).cuda()\n"
        "opt = torch.optim.AdamW(model.parameters())\n"
        "for _ in range(2):\n"
        "    model(torch.randn(8, 1024, device='cuda')).sum().backward()\n"
        "    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)\n"
        "    opt.step(); opt.zero_grad()\n")
    r = vramplan.run_script(script, [str(out)], workspaces=False)
    device_read, host = out.read_text().split()
    assert device_read == host
    assert r.ran is not None and r.ran.steps == 2


def test_cuda_graphs_capture_into_a_private_pool_and_replays_allocate_nothing(tmp_path: Path) -> None:
    # PyTorch's whole-network capture example (docs "CUDA Graphs"): warm-up on a side stream,
    # capture forward, backward and the optimizer step, replay. torch's own torch.cuda.graph and
    # make_graphed_callables run on the emulated CUDAGraph; the captured memory stays in the graph's
    # pool (empty_cache keeps it), replays allocate nothing
    out = tmp_path / "mem.json"
    script = tmp_path / "graphed.py"
    script.write_text(
        "import json, sys, torch\n"
        "model = torch.nn.Sequential(torch.nn.Linear(1024, 2048), torch.nn.Dropout(0.2), torch.nn.Linear(2048, 512)).cuda()\n"
        "opt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
        "x, y = torch.randn(256, 1024, device='cuda'), torch.randn(256, 512, device='cuda')\n"
        "s = torch.cuda.Stream()\ns.wait_stream(torch.cuda.current_stream())\n"
        "with torch.cuda.stream(s):\n"
        "    for _ in range(3):\n"
        "        opt.zero_grad(set_to_none=True)\n"
        "        torch.nn.functional.mse_loss(model(x), y).backward(); opt.step()\n"
        "torch.cuda.current_stream().wait_stream(s)\n"
        "g = torch.cuda.CUDAGraph()\nopt.zero_grad(set_to_none=True)\n"
        "assert not torch.cuda.is_current_stream_capturing()\n"
        "with torch.cuda.graph(g):\n"
        "    assert torch.cuda.is_current_stream_capturing()\n"
        "    loss = torch.nn.functional.mse_loss(model(x), y); loss.backward(); opt.step()\n"
        "mem = {'captured': torch.cuda.memory_allocated(), 'reserved': torch.cuda.memory_reserved()}\n"
        "for _ in range(4):\n"
        "    x.copy_(torch.randn(256, 1024, device='cuda')); g.replay()\n"
        "torch.cuda.empty_cache()\n"
        "mem.update(replayed=torch.cuda.memory_allocated(), kept=torch.cuda.memory_reserved(),\n"
        "           grads=all(p.grad is not None for p in model.parameters()))\n"
        "head = torch.nn.Linear(512, 512).cuda()\n"
        "graphed = torch.cuda.make_graphed_callables(head, (torch.randn(8, 512, device='cuda', requires_grad=True),))\n"
        "graphed(torch.randn(8, 512, device='cuda', requires_grad=True)).sum().backward()\n"
        "json.dump(mem, open(sys.argv[1], 'w'))\n")
    r = vramplan.run_script(script, [str(out)], steps=20, workspaces=False)
    mem = json.loads(out.read_text())
    assert mem["replayed"] == mem["captured"] and mem["grads"]  # the gradients live in the pool
    assert mem["kept"] == mem["reserved"]  # empty_cache left the graph's pool
    assert any("CUDA graphs" in n for n in r.notes)
    assert r.events is not None and any(s >= (1 << 30) for s in r.events.stream)


def test_to_meta_leaves_the_device_and_frees_its_copy(tmp_path: Path) -> None:
    """``t.to("meta")`` (accelerate's offload hooks putting weights away): a meta tensor that holds
    no memory; the emulated device's own storage is meta too, and torch handed ``t`` back."""
    out = tmp_path / "seen.json"
    script = tmp_path / "to_meta.py"
    script.write_text(
        "import json, sys, torch\n"
        "x = torch.randn(1024, 1024, device='cuda')\n"
        "before = torch.cuda.memory_allocated()\n"
        "y = x.to('meta')\n"
        "p = torch.nn.Parameter(y)\n"
        "del x\n"
        "seen = [before, str(y.device), y.is_meta, torch.cuda.memory_allocated(), p.to('meta') is p]\n"
        "json.dump(seen, open(sys.argv[1], 'w'))\n"
        "torch.nn.Linear(4, 4).cuda()(torch.randn(2, 4, device='cuda'))\n")
    vramplan.run_script(script, [str(out)], steps=1)
    assert json.loads(out.read_text()) == [1024 * 1024 * 4, "meta", True, 0, True]


@pytest.mark.parametrize("mode", ["model", "sequential"])
def test_diffusers_cpu_offload_hooks_bring_each_model_in_for_its_call(mode: str) -> None:
    pytest.importorskip("diffusers")
    pytest.importorskip("accelerate")
    script = Path(__file__).parent / "zoo" / "scripts" / "diffusers_flux.py"
    resident = vramplan.run_script(script, [], gpu="h100-sxm", workspaces=False)
    off = vramplan.run_script(script, ["--offload", mode], gpu="h100-sxm", workspaces=False)
    assert off.ran is not None and off.ran.forwards > 0  # the hooked models ran on the GPU (else: "stayed on the CPU")
    assert off.peak.allocated < resident.peak.allocated
    if mode == "model":  # one model on the GPU at a time: at the peak (the VAE decode), the VAE
        assert 0 < off.breakdown.weights < resident.breakdown.weights  # (brought in by the hook: weights)
        assert off.breakdown.activations + off.breakdown.temporaries == pytest.approx(
            resident.breakdown.activations + resident.breakdown.temporaries, rel=0.05)
    else:  # layer by layer: no whole model is ever resident
        assert off.breakdown.weights < resident.breakdown.weights / 4


def test_a_cpu_reference_run_that_runs_nothing_is_refused(tmp_path: Path) -> None:
    # pytorch/examples' FSDP2 and tensor-parallel examples exit on their GPU-count check before any forward on
    # the CPU: the reference was a silent zero (and the comparison divided by it)
    from vramplan.errors import TraceError
    from vramplan.script.truth import cpu_truth

    script = tmp_path / "needs_gpus.py"
    script.write_text("import sys\nimport torch\nif torch.cuda.device_count() < 2:\n    print('needs 2 GPUs')\n"
                      "    sys.exit()\nprint(torch.nn.Linear(4, 4)(torch.ones(1, 4)))\n")
    with pytest.raises(TraceError, match="ran no forward on the CPU"):
        cpu_truth(script)


def test_the_cpu_reference_runs_the_optimizers_cuda_default(tmp_path: Path) -> None:
    # torch.optim's default is foreach on CUDA and the single-tensor loop on the CPU: the reference runs the
    # GPU's path, so an optimizer-step peak (weights far larger than the activations) is the same storages
    from vramplan.script.truth import compare, cpu_truth

    script = tmp_path / "opt_peak.py"
    script.write_text("import torch\nfrom torch import nn\ndev = 'cuda' if torch.cuda.is_available() else 'cpu'\n"
                      "m = nn.Sequential(nn.Linear(512, 512), nn.Linear(512, 512)).to(dev)\n"
                      "opt = torch.optim.AdamW(m.parameters())\n"
                      "for _ in range(3):\n"
                      "    m(torch.ones(1, 512, device=dev)).sum().backward(); opt.step(); opt.zero_grad()\n")
    c = compare(vramplan.run_script(script, [], workspaces=False), cpu_truth(script))
    assert c.unexplained == 0 and abs(c.residual) <= 64, c  # (AdamW's host step counters)


def test_a_checkpoint_saved_from_the_device_loads_back_onto_it(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # torch.save of device tensors (a training script's checkpoint, Lightning's batch-size finder saving
    # the model before its trials) writes a file of shapes without values; loading it within the run
    # makes one device allocation per saved storage (tied weights once), where map_location puts it
    n = (1024 * 1024 + 1024) * 4
    script = tmp_path / "save_load.py"
    script.write_text(
        "import sys, torch\nfrom torch import nn\n"
        "model = nn.Linear(1024, 1024).cuda()\n"
        "torch.save({'model': model.state_dict(), 'tied': [model.weight, model.weight]}, sys.argv[1])\n"
        "before = torch.cuda.memory_allocated()\n"
        "ck = torch.load(sys.argv[1], map_location='cuda', weights_only=True)\n"
        "assert ck['model']['weight'].is_cuda and ck['model']['weight'].shape == (1024, 1024)\n"
        "assert ck['tied'][0].data_ptr() == ck['tied'][1].data_ptr()\n"
        "model.load_state_dict(ck['model'])\n"
        "print('loaded', torch.cuda.memory_allocated() - before)\n"
        "del ck\n"
        "opt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
        "model(torch.randn(8, 1024, device='cuda')).sum().backward(); opt.step()\n")
    ckpt = tmp_path / "ck.pt"
    r = vramplan.run_script(script, [str(ckpt)], steps=1, workspaces=False)
    assert r.model_states.weights == n
    # two allocations: the weight's storage (the state dict's tensor and both list entries share it) and the bias
    assert "loaded 4198400" in capsys.readouterr().out
    assert any(n.startswith("torch.save wrote 1 file(s)") and str(ckpt) in n for n in r.notes)
    # the file is real, and says what it is anywhere else
    with pytest.raises(RuntimeError, match="written by `vramplan run`"):
        torch.load(ckpt, weights_only=False)
    # a file an emulated run wrote is written again; one it did not write is never overwritten
    vramplan.run_script(script, [str(ckpt)], steps=1, workspaces=False)
    mine = tmp_path / "mine.pt"
    mine.write_bytes(b"a real checkpoint")
    with pytest.raises(TraceError, match="over an existing file"):
        vramplan.run_script(script, [str(mine)], steps=1, workspaces=False)
    assert mine.read_bytes() == b"a real checkpoint"


def test_saving_device_tensors_with_safetensors_stops_with_the_cause(tmp_path: Path) -> None:
    # safetensors writes every value: the run says so instead of the library's "invalid shape, data type,
    # or offset", which a real GPU never raises; host tensors still save for real
    pytest.importorskip("safetensors")
    script = tmp_path / "st.py"
    script.write_text(
        "import sys, torch\nfrom safetensors.torch import save_file\n"
        "save_file({'host': torch.ones(4)}, sys.argv[1] + '.host')\n"
        "m = torch.nn.Linear(64, 64).cuda()\n"
        "save_file(m.state_dict(), sys.argv[1])\n")
    with pytest.raises(TraceError, match="saves 2 device tensor.s. with safetensors"):
        vramplan.run_script(script, [str(tmp_path / "m.st")], steps=1, workspaces=False)
    from safetensors.torch import load_file

    assert load_file(str(tmp_path / "m.st.host"))["host"].tolist() == [1.0] * 4


_TIME_MAJOR = """
import torch
from torch import nn


class LM(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(1000, 64)
        self.enc = nn.TransformerEncoder(nn.TransformerEncoderLayer(64, 4, 128), 2)
        self.out = nn.Linear(64, 1000)

    def forward(self, ids):
        return self.out(self.enc(self.emb(ids)TRANSPOSE))


m = LM().cuda()
opt = torch.optim.AdamW(m.parameters())
for _ in range(2):
    ids = torch.randint(0, 1000, SHAPE, device="cuda")
    m(ids).float().logsumexp(-1).mean().backward(); opt.step(); opt.zero_grad()
"""


@pytest.mark.parametrize(("shape", "transpose"), [("(35, 20)", ""), ("(20, 35)", ".transpose(0, 1)")])
def test_a_time_major_transformer_input_reads_as_seq_then_batch(tmp_path: Path, shape: str, transpose: str) -> None:
    # nn.Transformer* layers default to batch_first=False: word_language_model feeds them [seq 35, batch 20];
    # a model that transposes a [batch, seq] input inside (open_clip's text tower) hands them the same
    # [35, 20, 64], and its own input is still batch-major
    script = tmp_path / "tm.py"
    script.write_text(_TIME_MAJOR.replace("SHAPE", shape).replace("TRANSPOSE", transpose))
    r = vramplan.run_script(script, steps=1, workspaces=False)
    assert r.ran is not None and r.ran.line().startswith("task train · batch 20 · seq 35"), r.ran.line()
