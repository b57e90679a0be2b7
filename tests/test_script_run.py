"""`vramplan run`: unmodified scripts on an emulated GPU (tests/examples/*.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import vramplan
from vramplan.errors import TraceError
from vramplan.hardware.catalog import get_gpu, usable_capacity

EX = Path(__file__).parent / "examples"
sys.path.insert(0, str(EX))
import plain_loop  # noqa: E402


@pytest.mark.parametrize("amp", [False, True])
def test_plain_loop_agrees_with_the_same_step_as_a_factory(amp: bool) -> None:
    argv = ["--batch", "512"] + (["--amp"] if amp else [])
    r = vramplan.run_script(EX / "plain_loop.py", argv, gpu="h100-sxm", steps=2)
    y = torch.randint(0, 10, (512,))
    t = vramplan.trace(lambda: plain_loop.Net(256), inputs=(torch.randn(512, 256),), task="train",
                       precision="bf16-mixed" if amp else "fp32",
                       optimizer=lambda p: torch.optim.AdamW(p, lr=1e-3),
                       loss_fn=lambda out, x: nn.functional.cross_entropy(out, y.to(out.device)), gpu="h100-sxm")
    assert r.method.value == "trace"
    assert abs(r.peak.allocated - t.peak.allocated) <= 0.005 * t.peak.allocated
    assert r.model_states == t.model_states
    fwd = {p.phase.value: p.breakdown.total for p in r.phases}
    fwd_t = {p.phase.value: p.breakdown.total for p in t.phases}
    assert abs(fwd["backward"] - fwd_t["backward"]) <= 0.005 * fwd_t["backward"]
    assert any("stopped after 2 optimizer step(s)" in n for n in r.notes)


def test_autocast_in_the_script_changes_what_is_saved() -> None:
    fp32 = vramplan.run_script(EX / "plain_loop.py", ["--batch", "512"], gpu="h100-sxm")
    amp = vramplan.run_script(EX / "plain_loop.py", ["--batch", "512", "--amp"], gpu="h100-sxm")
    act_fp32, act_amp = (max(p.breakdown.activations for p in r.phases) for r in (fp32, amp))
    assert act_amp < act_fp32


def test_the_script_sees_the_target_gpu_and_the_simulated_memory(tmp_path: Path) -> None:
    out = tmp_path / "probe.json"
    r = vramplan.run_script(EX / "probe.py", [str(out)], gpu="rtx-4090", steps=2, gpus=2)
    info = json.loads(out.read_text())
    g = get_gpu("rtx-4090")
    assert info["available"] and info["count"] == 2 and info["name"] == g.name
    assert info["capability"] == [8, 9] and info["bf16"]
    assert info["total"] == info["mem_total"] == usable_capacity(g)[0]
    # memory figures come from the allocator simulation of what ran so far
    assert 4 * 1024 * 1024 <= info["allocated"] <= info["max_allocated"] == info["stats_peak"] <= r.peak.allocated
    assert info["reserved"] >= info["allocated"] and 0 < info["free"] < info["mem_total"]


def test_inference_script_stops_after_n_forward_calls() -> None:
    r = vramplan.run_script(EX / "inference.py", gpu="a100-80gb", steps=3)
    assert r.workload.task.value == "infer"
    # batches of one shape: memory stops growing within the first calls (the previous output is
    # still held while the next one is made; the workspaces come with the first GEMMs), then holds
    # for 3 calls, and the script's 10 calls are not all run
    import re

    m = [re.search(r"stopped after (\d+) forward call\(s\) .*memory last grew at call (\d+), then held for 3", n)
         for n in r.notes]
    found = [x for x in m if x]
    assert found, r.notes
    calls, grew = int(found[0][1]), int(found[0][2])
    assert calls == grew + 3 and calls < 10
    assert r.breakdown.gradients == 0 and r.breakdown.weights >= (128 * 512 * 2 + 512 + 128) * 4


def test_an_op_the_emulation_cannot_serve_names_the_users_line() -> None:
    with pytest.raises(TraceError, match=r"bad_op\.py:6\b.*\.tolist\(\) of a torch.int64 tensor needs values"):
        vramplan.run_script(EX / "bad_op.py", steps=1)


def test_timeout_stops_a_script_that_never_steps() -> None:
    with pytest.raises(TraceError, match=r"within 1 s .*step 0"):
        vramplan.run_script(EX / "forever.py", timeout=1.0)


def test_the_deadline_never_interrupts_an_import(tmp_path: Path) -> None:
    """A deadline that falls while a module's body runs waits for the import to finish: an
    exception there would leave the package half-initialised for the rest of the process (its
    submodule imported, the package not), as torch._dynamo was when a short ``timeout`` fell in
    the script's first meta op, and every test after it in that worker failed."""
    pkg = tmp_path / "vramplan_slow_import_pkg"
    pkg.mkdir()
    (pkg / "first.py").write_text("X = 1\n")
    (pkg / "__init__.py").write_text("import time\n\nfrom . import first\n\ntime.sleep(2.5)\nDONE = True\n")
    script = tmp_path / "slow_import.py"
    script.write_text("import vramplan_slow_import_pkg\n\nwhile True:\n    pass\n")
    names = ("vramplan_slow_import_pkg", "vramplan_slow_import_pkg.first")
    try:
        with pytest.raises(TraceError, match=r"within 1 s .*step 0"):
            vramplan.run_script(script, timeout=1.0)
        assert "vramplan_slow_import_pkg" in sys.modules, "the deadline interrupted the package's import"
        assert sys.modules["vramplan_slow_import_pkg"].DONE
    finally:
        for name in names:
            sys.modules.pop(name, None)


def test_the_deadline_waits_for_an_import_only_up_to_its_grace(tmp_path: Path) -> None:
    import time

    from vramplan.script.runner import _deadline, _Timeout

    (tmp_path / "vramplan_endless_import.py").write_text("import time\n\ntime.sleep(30)\n")
    sys.path.insert(0, str(tmp_path))
    t = time.monotonic()
    try:
        with pytest.raises(_Timeout), _deadline(0.2, grace=0.5):
            import vramplan_endless_import  # noqa: F401
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("vramplan_endless_import", None)
    assert 0.6 < time.monotonic() - t < 10


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "vramplan.cli.main", *args], capture_output=True, text=True,
                          timeout=300)


def test_cli_runs_a_script_and_reports_json() -> None:
    p = _cli("run", "--gpu", "rtx-4090", "--json", "--", "python", str(EX / "plain_loop.py"), "--batch", "16")
    assert p.returncode == 0, p.stderr
    d = json.loads(p.stdout[p.stdout.index("{"):])
    assert d["method"] == "trace" and d["peak"]["allocated"] > 0
    p = _cli("run", "--gpu", "rtx-4090", "--format", "markdown", "--", "python", str(EX / "plain_loop.py"), "--batch", "16")
    assert p.returncode == 0, p.stderr
    assert "vramplan run: plain_loop.py" in p.stdout and "vramplan trace:" not in p.stdout  # (it said "trace")


@pytest.mark.parametrize("argv, match", [
    (["--", "python", str(EX / "distributed.py")], "init_process_group"),
    (["--", "python", "nope.py"], "no such script"),
    (["--", "torchrun", "train.py"], "no such script: train.py"),
    (["--", "torchrun", "--nproc-per-node", "gpu", "train.py"], "give the number: --nproc-per-node 8"),
    (["--gpus", "4", "--", "torchrun", "--nproc-per-node", "8", str(EX / "fsdp2_loop.py")],
     "--gpus 4 contradicts torchrun's 8 process(es) per node"),
    (["--steps", "0", "--", "python", str(EX / "inference.py")], "--steps must be"),
    (["--gpu", "nope", "--", "python", str(EX / "inference.py")], "nope"),
])
def test_cli_bad_input_is_one_line_exit_2(argv: list[str], match: str) -> None:
    p = _cli("run", *argv)
    assert p.returncode == 2, p.stderr
    assert match in p.stderr and "Traceback" not in p.stderr


def test_hf_trainer_script_agrees_with_the_same_step_as_a_factory() -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    r = vramplan.run_script(EX / "hf_trainer.py", ["--bf16", "--batch", "4", "--seq", "128"], gpu="h100-sxm")
    cfg = LlamaConfig(hidden_size=256, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=8,
                      num_key_value_heads=4, vocab_size=4096, max_position_embeddings=1024)
    ids = torch.randint(0, 4096, (4, 128))
    # HF Trainer: bf16 autocast over fp32 weights, fused AdamW (its default on torch >= 2.8), the
    # model's own loss, outputs dropped before backward
    t = vramplan.trace(lambda: LlamaForCausalLM(cfg), inputs={"input_ids": ids, "labels": ids}, task="train",
                       precision="bf16-mixed", optimizer=lambda p: torch.optim.AdamW(p, lr=1e-4, fused=True),
                       gpu="h100-sxm")
    assert abs(r.peak.allocated - t.peak.allocated) <= 0.005 * t.peak.allocated
    assert r.peak_phase == t.peak_phase
    assert any("taken as finite" in n for n in r.notes)


def test_from_pretrained_builds_from_the_config_without_weights() -> None:
    # an 8B model: built on the fake device from the embedded config, nothing downloaded or read
    r = vramplan.run_script(EX / "pretrained_infer.py", ["llama-3.1-8b", "1", "512"], gpu="h100-sxm")
    e = vramplan.estimate("llama-3.1-8b", task="infer", batch=1, seq=512, precision="bf16", method="trace",
                          gpu="h100-sxm")
    assert r.params == e.params == 8_030_261_248
    assert abs(r.breakdown.weights - e.breakdown.weights) <= 1024  # rotary buffers: exact up to inv_freq copies
    assert abs(r.peak.allocated - e.peak.allocated) <= 0.005 * e.peak.allocated


class _StoragePeak(torch.utils._python_dispatch.TorchDispatchMode):
    """Live bytes of real CPU tensor storages, as they come and go (a real run's storage peak)."""

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, int] = {}
        self.now = self.peak = 0

    def _gone(self, key: int, _ref: object) -> None:
        self.now -= self.live.pop(key, 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        import weakref

        out = func(*args, **(kwargs or {}))
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type == "cpu":
                st = t.untyped_storage()
                key = st._cdata
                if key not in self.live and st.nbytes():
                    self.live[key] = st.nbytes()
                    self.now += st.nbytes()
                    self.peak = max(self.peak, self.now)
                    weakref.finalize(st, self._gone, key, None)
        return out


def test_plain_loop_agrees_with_a_real_cpu_run_of_the_same_script(monkeypatch: pytest.MonkeyPatch) -> None:
    argv = ["--batch", "256", "--foreach", "--steps", "2"]
    r = vramplan.run_script(EX / "plain_loop.py", argv, gpu="h100-sxm", workspaces=False)
    mode = _StoragePeak()
    monkeypatch.setattr(sys, "argv", ["plain_loop.py", *argv, "--device", "cpu"])
    with mode:
        plain_loop.main()
    assert abs(r.peak.allocated - mode.peak) <= 0.01 * mode.peak


def test_accelerate_and_lightning_scripts_agree_with_their_factories() -> None:
    pytest.importorskip("accelerate")
    pytest.importorskip("lightning")
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(hidden_size=256, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=8,
                      num_key_value_heads=4, vocab_size=4096, max_position_embeddings=1024)
    ids = torch.randint(0, 4096, (4, 128))
    # accelerate: prepare() after the optimizer was built (parameters keep their identity), bf16
    r = vramplan.run_script(EX / "accelerate_loop.py", [], gpu="h100-sxm")
    t = vramplan.trace(lambda: LlamaForCausalLM(cfg), inputs={"input_ids": ids, "labels": ids}, task="train",
                       precision="bf16-mixed", optimizer=lambda p: torch.optim.AdamW(p, lr=1e-4), gpu="h100-sxm")
    assert abs(r.peak.allocated - t.peak.allocated) <= 0.005 * t.peak.allocated
    assert r.model_states == t.model_states
    # Lightning: bf16-mixed, AdamW from configure_optimizers
    r = vramplan.run_script(EX / "lightning_loop.py", [], gpu="h100-sxm")
    y = torch.randint(0, 10, (64,))
    t = vramplan.trace(lambda: nn.Sequential(nn.Linear(256, 1024), nn.GELU(), nn.Linear(1024, 256), nn.GELU(),
                                             nn.Linear(256, 10)),
                       inputs=(torch.randn(64, 256),), task="train", precision="bf16-mixed",
                       optimizer=lambda p: torch.optim.AdamW(p, lr=1e-3),
                       loss_fn=lambda o, x: nn.functional.cross_entropy(o, y.to(o.device)), gpu="h100-sxm")
    assert abs(r.peak.allocated - t.peak.allocated) <= 0.005 * t.peak.allocated


def test_trl_sft_script_runs_with_its_model_states() -> None:
    pytest.importorskip("trl")
    # TRL computes its loss with its own chunked log-prob function (trl/kernels/chunked_logprob.py):
    # a factory cannot express that loss yet, so this checks the run and the model states
    r = vramplan.run_script(EX / "trl_sft.py", [], gpu="h100-sxm")
    params = r.params
    assert r.method.value == "trace" and any("stopped after 2 optimizer step(s)" in n for n in r.notes)
    assert r.model_states.weights >= 4 * params and r.model_states.optimizer >= 8 * params


def test_scripts_make_no_network_calls(monkeypatch: pytest.MonkeyPatch) -> None:
    import socket

    calls: list[object] = []

    def refuse(addr: object, *args: object, **kwargs: object) -> None:
        calls.append(addr)
        raise OSError("no network in tests")

    monkeypatch.setattr(socket, "create_connection", refuse)
    vramplan.run_script(EX / "hf_trainer.py", ["--bf16"], gpu="h100-sxm", steps=1)
    assert calls == []


def test_a_sampled_token_read_on_the_host_is_an_index_in_its_range(tmp_path: Path) -> None:
    # PyTorch examples' word_language_model/generate.py: weights.exp().cpu(), multinomial on the
    # host, then a Python list indexed by the sampled tensor (its value is read)
    script = tmp_path / "sample_words.py"
    script.write_text(
        "import torch\n"
        "from torch import nn\n"
        "words = [f'w{i}' for i in range(100)]\n"
        "model = nn.Linear(8, 100).cuda().eval()\n"
        "seen = []\n"
        "with torch.no_grad():\n"
        "    for _ in range(3):\n"
        "        w = model(torch.randn(1, 8, device='cuda')).squeeze().exp().cpu()\n"
        "        idx = torch.multinomial(w, 1)[0]\n"
        "        seen.append(words[idx])\n"
        "        best = int(model(torch.randn(1, 8, device='cuda')).argmax())\n"
        "        assert 0 <= best < 100, best\n"
        "seq = torch.tensor([[3, 4]], device='cuda')\n"  # nanoGPT's sample.py: the prompt, then each token
        "for _ in range(3):\n"
        "    probs = model(torch.randn(1, 8, device='cuda')).softmax(-1)\n"
        "    seq = torch.cat((seq, torch.multinomial(probs, num_samples=1)), dim=1)\n"
        "print(''.join(words[i] for i in seq[0].tolist()))\n"
        "ids = torch.randint(0, 100, (1, 2), device='cuda')\n"  # transformers' generate: random prompt ids,
        "done = torch.ones(1, dtype=torch.long, device='cuda')\n"  # then the next token masked by the
        "pad = torch.tensor(0, device='cuda')\n"  # finished sequences and joined to the ids
        "for _ in range(2):\n"
        "    nxt = model(torch.randn(1, 8, device='cuda')).argmax(-1) * done + pad * (1 - done)\n"
        "    ids = torch.cat([ids, nxt[:, None]], dim=-1)\n"
        "assert all(0 <= i < 100 for i in ids[0].tolist())\n")
    r = vramplan.run_script(script, gpu="h100-sxm", steps=100)  # (more than its calls: it runs to its end)
    assert r.ran is not None and r.ran.forwards == 11 and "task infer" in r.ran.line()
    assert any("middle of their range" in n for n in r.notes)


def test_autocast_to_fp32_is_reported_as_fp32() -> None:
    from vramplan.engine.script import what_ran
    from vramplan.script.runner import ScriptRun

    run = ScriptRun(param_dtypes={"torch.float32": 100}, autocast=["torch.float32"])
    _, ran, _ = what_ran(run)
    assert "fp32" in ran.line() and "mixed" not in ran.line()
    _, ran, _ = what_ran(ScriptRun(param_dtypes={"torch.float32": 100}, autocast=["torch.bfloat16"]))
    assert "bf16-mixed" in ran.line()


def test_a_generation_loop_whose_cache_grows_runs_to_its_last_token(tmp_path: Path) -> None:
    # a KV cache grown by torch.cat each step peaks at the last token: stopping after a few calls
    # (as for batches of one shape) would under-count it
    script = tmp_path / "grow.py"
    script.write_text(
        "import torch\nfrom torch import nn\n"
        "model = nn.Linear(256, 256).cuda().eval()\n"
        "cache = torch.zeros(16, 0, 256, device='cuda')\n"
        "x = torch.randn(16, 1, 256, device='cuda')\n"
        "with torch.no_grad():\n"
        "    for _ in range(60):\n"
        "        x = model(x)\n"
        "        cache = torch.cat([cache, x], dim=1)\n")
    r = vramplan.run_script(script, gpu="h100-sxm", workspaces=False)
    assert r.ran is not None and r.ran.forwards == 60
    assert any("the script ended after 0 optimizer step(s) and 60 forward call(s)" in n for n in r.notes)
    last = 16 * 60 * 256 * 4
    assert r.peak.allocated >= 2 * last - 16 * 256 * 4  # the last cat: the old cache and the new one


def test_from_pretrained_without_a_gpu_device_map_loads_on_the_host(tmp_path) -> None:
    # transformers 5: no device_map → the weights are on the CPU until the script moves them;
    # a script that never does runs on the CPU, and vramplan says so instead of counting the model
    from vramplan.errors import TraceError

    body = ("import torch\nfrom transformers import AutoModelForCausalLM\n"
            "model = AutoModelForCausalLM.from_pretrained('qwen2.5-0.5b', dtype=torch.bfloat16{dm})\n{move}"
            "ids = torch.randint(0, 1000, (1, 64), device=next(model.parameters()).device)\n"
            "with torch.inference_mode():\n    for _ in range(3):\n        model(input_ids=ids)\n")
    stays = tmp_path / "stays.py"
    stays.write_text(body.format(dm="", move=""))
    with pytest.raises(TraceError, match="never reached the GPU"):
        vramplan.run_script(stays, gpu="h100-sxm")
    moved = tmp_path / "moved.py"
    moved.write_text(body.format(dm="", move="model = model.to('cuda')\n"))
    mapped = tmp_path / "mapped.py"
    mapped.write_text(body.format(dm=", device_map='auto'", move=""))
    a, b = vramplan.run_script(moved, gpu="h100-sxm"), vramplan.run_script(mapped, gpu="h100-sxm")
    assert abs(a.breakdown.weights - b.breakdown.weights) <= 1024 and a.breakdown.weights > 900_000_000
    assert abs(a.peak.allocated - b.peak.allocated) <= 0.005 * b.peak.allocated
    assert not [n for n in b.notes if "device_map" in n]  # one GPU that holds it: transformers puts it all there


_DEVICE_MAP_SCRIPT = """\
import json, sys, torch
from transformers import AutoModelForCausalLM
n = torch.cuda.device_count()
mm = {int(k) if k.isdigit() else k: v for k, v in json.loads(sys.argv[2]).items()}
model = AutoModelForCausalLM.from_pretrained('qwen2.5-0.5b', dtype=torch.bfloat16, num_hidden_layers=4,
                                             device_map='auto', max_memory=mm)
loaded = [torch.cuda.memory_allocated(i) for i in range(n)]
where = {}
for name, p in [*model.named_parameters(), *model.named_buffers()]:
    where[str(p.device)] = where.get(str(p.device), 0) + p.numel() * p.element_size()
ids = torch.tensor([[11, 12, 13, 14, 15, 16, 17, 18]]).to('cuda')
with torch.inference_mode():
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=3, do_sample=False)
got = [str(out.device), list(out.shape)]
del out, ids
dm = getattr(model, 'hf_device_map', None)  # (set by accelerate's dispatch: a map over more than one device)
json.dump({'map': dm and {k: str(v) for k, v in dm.items()}, 'where': where, 'loaded': loaded,
           'after': [torch.cuda.memory_allocated(i) for i in range(n)],
           'peak': [torch.cuda.max_memory_allocated(i) for i in range(n)],
           'reserved': [torch.cuda.max_memory_reserved(i) for i in range(n)],
           'free': [torch.cuda.mem_get_info(i)[0] for i in range(n)],
           'out': got}, open(sys.argv[1], 'w'))
"""


def _placed(max_memory: dict) -> tuple[dict[str, str], dict[str, int], int]:
    """transformers' own placement of the model the script loads (its ``_get_device_map`` on the
    same model built on meta, outside any run), the bytes of parameters and buffers each device
    gets, and the largest offloaded leaf module's weight bytes (accelerate's hooks bring in one at
    a time: accelerate 1.16 hooks.py:528-547, a hook on each module with tensors of its own)."""
    from accelerate.utils import compute_module_sizes
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.integrations.accelerate import _get_device_map, expand_device_map

    from vramplan.models.catalog import resolve

    cfg = {k: v for k, v in resolve("qwen2.5-0.5b").config.items() if k != "auto_map"}
    config = AutoConfig.for_model(**{**cfg, "num_hidden_layers": 4})  # (as the script loads it)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    placement = _get_device_map(model, "auto", dict(max_memory), None)
    tensors = [*model.named_parameters(), *model.named_buffers()]
    device_of = expand_device_map(placement, [n for n, _ in tensors])
    by_device: dict[str, int] = {}
    buffers = {n for n, _ in model.named_buffers()}
    for n, p in tensors:
        key = str(device_of[n])
        if key == "cpu" and n in buffers:  # an offloaded block's buffers go to the main GPU (offload_buffers=False:
            key = "0"  # accelerate 1.16 hooks.py:328-332, AlignDevicesHook.init_hook)
        by_device[key] = by_device.get(key, 0) + p.numel() * p.element_size()
        # what the caching allocator hands out for it: a block rounded up to 512 B (kMinBlockSize,
        # c10/cuda/CUDACachingAllocator.cpp round_size)
        rounded = -(-p.numel() * p.element_size() // 512) * 512
        by_device[f"{key} blocks"] = by_device.get(f"{key} blocks", 0) + rounded
        by_device[f"{key} tensors"] = by_device.get(f"{key} tensors", 0) + 1
    sizes = compute_module_sizes(model)
    leaves = [sizes[n] for n, m in model.named_modules() if n and not list(m.children())
              and any(str(device_of.get(f"{n}.{k}")) == "cpu" for k, _ in m.named_parameters(recurse=False))]
    return {k: str(v) for k, v in placement.items()}, by_device, max(leaves, default=0)


def test_device_map_auto_spreads_the_model_over_the_emulated_gpus(tmp_path) -> None:
    # device_map="auto" over 2 GPUs: transformers' own placement over the emulated GPUs, dispatched
    # by accelerate's hooks: each parameter on its GPU, each GPU's memory its blocks' weights (and
    # what they compute), generate() running across both, the output back on GPU 0
    import json

    script = tmp_path / "spread.py"
    script.write_text(_DEVICE_MAP_SCRIPT)
    out = tmp_path / "seen.json"
    mm = {"0": "320MiB", "1": "1GiB", "cpu": "8GiB"}
    r = vramplan.run_script(script, [str(out), json.dumps(mm)], gpu="h100-sxm", gpus=2, workspaces=False)
    seen = json.loads(out.read_text())
    placement, by_device, _ = _placed({0: "320MiB", 1: "1GiB", "cpu": "8GiB"})
    assert seen["map"] == placement and set(placement.values()) == {"0", "1"}
    assert seen["where"] == {"cuda:0": by_device["0"], "cuda:1": by_device["1"]}
    assert r.breakdown.weights == by_device["0"]  # GPU 0's figures: only its own blocks' weights
    # GPU 1: its blocks' weights in the allocator's blocks (at least each rounded up to 512 B; a block's unsplit
    # remainder below 1 MiB stays with it: CUDACachingAllocator.cpp should_split), and less than a segment more
    assert by_device["1 blocks"] <= seen["loaded"][1] < by_device["1 blocks"] + 2**20 * by_device["1 tensors"]
    # each GPU through the allocator simulation: GPU 0 first (the report's peak), the verdict the fullest one's
    assert [x.gpu for x in r.gpus] == [0, 1] and r.gpus[0].device_used == r.peak.device_used
    one_gpu = r.gpus[1]
    assert one_gpu.reserved >= one_gpu.allocated and one_gpu.reserved % (2 * 2**20) == 0  # (whole segments)
    assert (one_gpu.allocated, one_gpu.reserved) == (seen["peak"][1], seen["reserved"][1])  # the script read the same
    context = r.peak.device_used - r.peak.reserved  # (GPU 1's own CUDA context, as GPU 0's)
    assert one_gpu.device_used == one_gpu.reserved + context
    assert seen["free"][1] == r.verdict.usable - context - one_gpu.reserved  # (no empty_cache: reserved only grew)
    worst = max(r.gpus, key=lambda x: x.device_used)
    assert r.verdict.headroom == r.verdict.usable - worst.device_used
    assert r.to_dict()["gpus"][1] == {"gpu": 1, "allocated": one_gpu.allocated, "reserved": one_gpu.reserved,
                                      "device_used": one_gpu.device_used}
    assert seen["loaded"][0] >= by_device["0"] and seen["after"] == seen["loaded"]  # (nothing left behind)
    assert seen["out"] == ["cuda:0", [1, 11]]
    # what GPU 1's blocks compute is on GPU 1: at most what the whole model computes on one GPU
    one = tmp_path / "one.json"
    single = vramplan.run_script(script, [str(one), json.dumps({"0": "8GiB", "cpu": "8GiB"})], gpu="h100-sxm",
                                 workspaces=False)
    alone = json.loads(one.read_text())
    assert alone["map"] is None and single.breakdown.weights == by_device["0"] + by_device["1"]
    assert 0 < seen["peak"][1] - by_device["1"] < alone["peak"][0] - alone["loaded"][0]
    assert seen["peak"][0] - seen["loaded"][0] <= alone["peak"][0] - alone["loaded"][0]
    assert not single.gpus and "gpus" not in single.to_dict()  # (one GPU: nothing per GPU)


def test_device_map_auto_offloads_what_gpu_0_cannot_hold_to_the_cpu(tmp_path) -> None:
    # 2 GPUs, max_memory GPU 0 300 MiB and the CPU: the rest of the weights wait in host RAM (on meta in the model,
    # as accelerate leaves them) and each offloaded layer's weights come to GPU 0 for its call only
    import json

    script = tmp_path / "offload.py"
    script.write_text(_DEVICE_MAP_SCRIPT)
    out = tmp_path / "seen.json"
    r = vramplan.run_script(script, [str(out), json.dumps({"0": "300MiB", "cpu": "8GiB"})], gpu="h100-sxm",
                            gpus=2, workspaces=False)
    seen = json.loads(out.read_text())
    placement, by_device, largest = _placed({0: "300MiB", "cpu": "8GiB"})
    assert seen["map"] == placement and set(placement.values()) == {"0", "cpu"}
    assert seen["where"] == {"cuda:0": by_device["0"], "meta": by_device["cpu"]}
    assert 0 < by_device["0"] <= seen["loaded"][0] <= 300 * 2**20 and seen["after"] == seen["loaded"]
    assert seen["peak"][1] == 0 and not r.gpus  # (GPU 1 is not in max_memory: nothing there, no per-GPU figures)
    # at the peak: GPU 0's own weights and at most one offloaded leaf module's (a layer's MLP projection)
    assert by_device["0"] < r.breakdown.weights <= by_device["0"] + largest
    assert seen["out"] == ["cuda:0", [1, 11]]
    assert any(f"{by_device['cpu']:,} B" in n and "host RAM" in n for n in r.notes), r.notes


def test_another_gpu_s_memory_is_its_own_events_through_the_allocator() -> None:
    # a GPU other than 0 (a device map's): its storages are its own event stream; what the script reads about it
    # (live, while it runs) is the allocator simulation of that stream, as a replay of it afterwards says
    import gc
    from types import SimpleNamespace

    from vramplan.allocator import replay
    from vramplan.events import Action
    from vramplan.trace.places import GpuPlace

    rec = SimpleNamespace(live={}, ignore=lambda t: None)
    gpu = GpuPlace(rec, "cuda:1")  # type: ignore[arg-type]
    weights = [torch.empty(n, device="meta") for n in (3_000_000, 1000, 5_000_000)]  # fp32: 12 MB, 4 KB, 20 MB
    for w in weights:
        gpu.adopt(w)
    peak_live = gpu.live.stats()
    del weights[1]
    gc.collect()
    gpu.empty_cache()
    t = torch.empty(700_000, device="meta")  # (after the free: its 2.8 MB is a new segment; the small pool emptied)
    gpu.adopt(t)
    gpu.blas_workspace(4096, (0, 0))
    gpu.blas_workspace(4096, (0, 0))  # (once per thread and stream)
    log = gpu.log
    assert [Action(a) for a in log.action] == [Action.ALLOC] * 3 + [Action.FREE, Action.EMPTY_CACHE] + [Action.ALLOC] * 2
    stats = gpu.live.stats()
    res = replay(log, segment_map=False)
    assert (stats["allocated_bytes.all.peak"], stats["reserved_bytes.all.peak"]) == (res.max_allocated, res.max_reserved)
    # PyTorch's rules (c10/cuda/CUDACachingAllocator.cpp): a request of 10 MB or more gets a segment rounded up to
    # 2 MiB, whose remainder below 1 MiB is not split off (the block keeps it); the 4 KB one a 2 MiB small segment
    assert peak_live["allocated_bytes.all.current"] == 12 * 2**20 + 4096 + 20 * 2**20
    assert peak_live["reserved_bytes.all.current"] == 12 * 2**20 + 2 * 2**20 + 20 * 2**20
    # empty_cache released the emptied small segment; the 2.8 MB request (1-10 MB) takes a 20 MiB segment, the
    # workspace a new small one
    assert stats["reserved_bytes.all.current"] == 12 * 2**20 + 20 * 2**20 + 20 * 2**20 + 2 * 2**20
    assert res.max_reserved >= res.max_allocated


_OVERFLOW_SCRIPT = """\
import sys, torch
from transformers import AutoModelForCausalLM
n = int(sys.argv[1])  # the first n layers on GPU 0, the rest, the norm and the head on GPU 1
dm = {"model.embed_tokens": 0, "model.rotary_emb": 0, **{f"model.layers.{i}": int(i >= n) for i in range(8)},
      "model.norm": 1, "lm_head": 1}
model = AutoModelForCausalLM.from_pretrained('qwen2.5-7b', dtype=torch.float32, num_hidden_layers=8, device_map=dm)
ids = torch.tensor([[11, 12, 13, 14, 15, 16, 17, 18]]).to('cuda')
with torch.inference_mode():
    for _ in range(3):
        model(input_ids=ids)
"""


def test_a_split_that_overflows_gpu_1_does_not_fit_and_names_it(tmp_path) -> None:
    # an RTX 4060 (8 GB) pair, a dict device map: GPU 0 holds the embedding and one layer (~3 GB), GPU 1 the other
    # seven layers and the head (~8.7 GB): GPU 0 fits, GPU 1 does not, and so neither does the split
    from vramplan.report.estimate import to_doc
    from vramplan.report.render import to_text

    script = tmp_path / "over.py"
    script.write_text(_OVERFLOW_SCRIPT)
    r = vramplan.run_script(script, ["1"], gpu="rtx-4060", gpus=2)
    v = r.verdict
    assert v is not None and [x.gpu for x in r.gpus] == [0, 1]
    gpu0, gpu1 = r.gpus
    assert gpu0.device_used == r.peak.device_used <= v.usable < gpu1.device_used
    assert gpu1.reserved >= gpu1.allocated > 7 * 4 * 3584 * (3 * 18944 + 2 * 3584 + 2 * 512)  # (7 layers' fp32 weights)
    assert r.worst_gpu == gpu1 and not v.fits and v.headroom == v.usable - gpu1.device_used
    d = r.to_dict()
    assert d["fits"] is False and d["worst_gpu"] == 1 and [x["gpu"] for x in d["gpus"]] == [0, 1]
    text = to_text(to_doc(r), width=200)
    assert "DOES NOT FIT" in text and "on GPU 1, the fullest of 2" in text
    assert "GPU 1 (fullest)" in text


@pytest.mark.parametrize(("n", "full", "fits"), [("1", 1, 0), ("8", 0, 1)])
def test_each_gpu_is_replayed_within_its_capacity_and_its_oom_names_it(tmp_path, n, full, fits) -> None:
    # every GPU has its own caching allocator (NativeCachingAllocator::device_allocator): the GPU whose need passes
    # the allocator's bytes is replayed within them, as GPU 0 always was, and the out-of-memory note names it;
    # the GPU that fits gets no note. n=1: seven layers and the head on GPU 1, which runs out loading the head
    # (152,064 x 3,584 fp32); n=8: every layer on GPU 0, which runs out, the head alone on GPU 1
    script = tmp_path / "over.py"
    script.write_text(_OVERFLOW_SCRIPT)
    r = vramplan.run_script(script, [n], gpu="rtx-4060", gpus=2)
    capped = [x for x in r.notes if "for the allocator: replayed within it" in x]
    assert len(capped) == 1 and f"out of memory on GPU {full} at event" in capped[0], r.notes
    assert not any(f"on GPU {fits}" in x for x in r.notes)
    if full == 1:
        assert f"(setup, asking for {152064 * 3584 * 4:,} B)" in capped[0]
    else:
        assert r.allocator is not None and r.allocator.ooms == 1  # (GPU 0's summary is its own replay's)


def test_a_saved_trace_holds_every_gpus_trace_and_each_replays_to_that_gpus_figures(tmp_path, monkeypatch, capsys) -> None:
    # `vramplan run --snapshot` of a device map: one device trace per GPU (PyTorch's snapshot keeps one per
    # DeviceCachingAllocator), segments tagged with their device; `vramplan replay --device N` of the file gives
    # GPU N's figures in the report, and the recorded segments match the simulation's
    from vramplan.cli.main import main
    from vramplan.snapshot.reader import compare_with_recorded, load_snapshot

    script, snap_path = tmp_path / "over.py", tmp_path / "pred.pickle"
    script.write_text(_OVERFLOW_SCRIPT)
    monkeypatch.chdir(tmp_path)
    assert main(["run", "--gpu", "rtx-4060", "--gpus", "2", "--json", "--snapshot", str(snap_path), "--",
                 "python", str(script), "1"]) == 0
    report = json.loads(capsys.readouterr().out)
    snap = load_snapshot(snap_path)
    assert len(snap["device_traces"]) == 2 and all(snap["device_traces"])
    assert {s["device"] for s in snap["segments"]} == {0, 1}
    assert snap["vramplan"]["gpus"] == report["gpus"]
    for g in report["gpus"]:
        cmp = compare_with_recorded(snap, device=g["gpu"])
        assert (cmp.result.max_allocated, cmp.result.max_reserved) == (g["allocated"], g["reserved"])
        assert cmp.match
    assert main(["replay", str(snap_path), "--device", "1", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["max_reserved"] == report["gpus"][1]["reserved"]


_SIDE_STREAM_SCRIPT = """\
import json, sys, torch
from transformers import AutoModelForCausalLM
dm = {"model.embed_tokens": 0, "model.rotary_emb": 0, "model.layers.0": 0, "model.layers.1": 1, "model.norm": 1,
      "lm_head": 1}
model = AutoModelForCausalLM.from_pretrained('qwen2.5-7b', dtype=torch.bfloat16, num_hidden_layers=2, device_map=dm)
side = torch.cuda.Stream(device=1)
seen = {}
base = torch.cuda.memory_reserved(1)
with torch.cuda.stream(side):
    seen["in"] = [torch.cuda.current_device(), torch.cuda.current_stream(1) == side,
                  torch.cuda.current_stream(0) == torch.cuda.default_stream(0)]
    staged = torch.empty(64 * 2**20, dtype=torch.uint8, device="cuda:1")  # 64 MiB on GPU 1's side stream
del staged
seen["after"] = [torch.cuda.current_device(), torch.cuda.current_stream(1) == torch.cuda.default_stream(1)]
x = torch.empty(64 * 2**20, dtype=torch.uint8, device="cuda:1")  # GPU 1's default stream: not the side stream's block
seen["grew"] = torch.cuda.memory_reserved(1) - base
del x
with torch.inference_mode():
    model(input_ids=torch.tensor([[11, 12, 13, 14]]).to("cuda"))
json.dump(seen, open(sys.argv[1], "w"))
"""


def test_a_side_stream_of_gpu_1_is_its_own_pool_on_gpu_1(tmp_path) -> None:
    # torch.cuda.Stream(device=1) under a device map: entering it makes GPU 1 current and the stream GPU 1's current
    # one (torch's StreamContext / _cuda_setStream), GPU 0 keeps its default stream; what is allocated there is
    # on that stream in GPU 1's events, and the caching allocator does not hand a block cached by one stream to
    # another (get_free_block matches the stream): a 64 MiB block freed by the side stream is not reused by the
    # default stream's 64 MiB request, so GPU 1 reserves both, live (as the script reads) and in the report
    import json

    script, out = tmp_path / "side.py", tmp_path / "seen.json"
    script.write_text(_SIDE_STREAM_SCRIPT)
    r = vramplan.run_script(script, [str(out)], gpu="h100-sxm", gpus=2, workspaces=False)
    seen = json.loads(out.read_text())
    assert seen["in"] == [1, True, True] and seen["after"] == [0, True]
    assert seen["grew"] == 2 * 64 * 2**20  # (one stream would have reused the block: 64 MiB)
    (i, log), = r.gpu_events
    streams = sorted(st for a, sz, st in zip(log.action, log.size, log.stream, strict=True) if a == 0 and sz == 64 * 2**20)
    assert i == 1 and len(streams) == 2 and streams[0] == 0 < streams[1]  # (one block on each stream)
    assert r.events is not None and set(r.events.stream) == {0}  # (GPU 0 never left its default stream)
    assert r.gpus[1].reserved >= 2 * 64 * 2**20 + r.gpus[1].allocated - 64 * 2**20


_QUANT_MAP_SCRIPT = """\
import json, sys, torch
from transformers import AutoModelForCausalLM, BitsAndBytesConfig
rest = json.loads(sys.argv[2])  # where layers 2-3, the norm and the head go
dm = {"model.embed_tokens": 0, "model.rotary_emb": 0, "model.layers.0": 0, "model.layers.1": 0,
      "model.layers.2": rest, "model.layers.3": rest, "model.norm": rest, "lm_head": rest}
q = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_compute_dtype=torch.bfloat16, bnb_4bit_quant_type="nf4")
model = AutoModelForCausalLM.from_pretrained('qwen2.5-7b', num_hidden_layers=4, quantization_config=q, device_map=dm)
down = model.model.layers[3].mlp.down_proj
seen = {"loaded": [torch.cuda.memory_allocated(0), torch.cuda.memory_allocated(1)], "map": model.hf_device_map,
        "down": [type(down).__name__, str(down.weight.device)]}
with torch.inference_mode():
    seen["out"] = str(model(input_ids=torch.tensor([[11, 12, 13, 14]]).to("cuda")).logits.device)
json.dump(seen, open(sys.argv[1], "w"))
"""


def test_a_bitsandbytes_model_is_spread_by_its_device_map_and_cpu_in_it_stops_as_transformers_does(tmp_path) -> None:
    # BitsAndBytesConfig(load_in_4bit) with a dict map over two GPUs: transformers dispatches it as any model
    # (modeling_utils.py:4464-4466), each layer quantised on its GPU; before, the map was dropped and the whole
    # model sat on GPU 0. qwen2.5-7b (hidden 3,584, intermediate 18,944, 4 KV heads of 128): a layer's linears hold
    # 3,584 x (3,584 + 512 + 512 + 3,584 + 3 x 18,944) parameters, at 0.5 B each in nf4 (+ absmax, biases, norms);
    # the head stays bf16 (152,064 x 3,584 x 2 B). With the CPU in the map, bitsandbytes' quantizer raises
    # (quantizer_bnb_4bit.py:71-81) without llm_int8_enable_fp32_cpu_offload: the run stops there too
    import json

    script, out = tmp_path / "q.py", tmp_path / "seen.json"
    script.write_text(_QUANT_MAP_SCRIPT)
    r = vramplan.run_script(script, [str(out), "1"], gpu="rtx-4090", gpus=2, workspaces=False)
    seen = json.loads(out.read_text())
    layer, head = 3584 * (3584 + 512 + 512 + 3584 + 3 * 18944), 152064 * 3584 * 2
    assert seen["down"] == ["QuantLinear", "cuda:1"]  # (vramplan's nf4 layer, trace.quant: on the map's GPU)
    assert seen["map"]["lm_head"] == 1 and seen["out"] == "cuda:0"
    assert head + 2 * layer // 2 <= seen["loaded"][1] <= head + 2 * layer * 5 // 8  # (bf16 layers: 4 B per 2 params)
    assert [x.gpu for x in r.gpus] == [0, 1] and r.gpus[1].allocated >= seen["loaded"][1]
    with pytest.raises(TraceError, match="the real run stops here too"):
        vramplan.run_script(script, [str(out), '"cpu"'], gpu="rtx-4090", gpus=2, workspaces=False)


_DISK_MAP_SCRIPT = """\
import json, sys, torch
from transformers import AutoModelForCausalLM
away = json.loads(sys.argv[2])  # where layers 2-3 go: "cpu" or "disk"
dm = {"model.embed_tokens": 0, "model.rotary_emb": 0, "model.layers.0": 0, "model.layers.1": 1,
      "model.layers.2": away, "model.layers.3": away, "model.norm": 1, "lm_head": 1}
model = AutoModelForCausalLM.from_pretrained('qwen2.5-7b', dtype=torch.bfloat16, num_hidden_layers=4, device_map=dm)
with torch.inference_mode():
    model(input_ids=torch.tensor([[11, 12, 13, 14]]).to("cuda"))
"""


def test_disk_in_a_device_map_runs_as_the_cpu_offload_with_its_note(tmp_path) -> None:
    # "disk" in a device map: transformers reads those weights from the checkpoint's safetensors per call
    # (integrations/accelerate.py:461-530 accelerate_disk_offload) and accelerate's hooks bring them to the main
    # GPU for the call, as for "cpu": every GPU's figures are the CPU offload's, and the notes say the disk
    script = tmp_path / "disk.py"
    script.write_text(_DISK_MAP_SCRIPT)
    cpu = vramplan.run_script(script, [str(tmp_path), '"cpu"'], gpu="rtx-4090", gpus=2, workspaces=False)
    disk = vramplan.run_script(script, [str(tmp_path), '"disk"'], gpu="rtx-4090", gpus=2, workspaces=False)
    assert [x.gpu for x in disk.gpus] == [0, 1] and disk.gpus == cpu.gpus
    # a layer in bf16: its linears (3,584 x (3,584 + 512 + 512 + 3,584 + 3 x 18,944)), q/k/v biases, two norms
    layer = 2 * (3584 * (3584 + 512 + 512 + 3584 + 3 * 18944) + (3584 + 512 + 512) + 2 * 3584)
    assert any(f"{2 * layer:,} B" in n and "in the offload folder on disk" in n for n in disk.notes), disk.notes
    assert any('placed on "disk" are emulated as offloaded to the CPU' in n for n in disk.notes)
    assert any(f"{2 * layer:,} B" in n and "in host RAM" in n for n in cpu.notes) \
        and not any("on disk" in n or '"disk"' in n for n in cpu.notes)
    # an offloaded layer's weights come to GPU 0 (the main device) for its call: GPU 0's peak holds more than its
    # own embedding and layer 0
    assert disk.breakdown.weights > 152064 * 3584 * 2 + layer


def test_from_pretrained_applies_its_keyword_arguments_as_transformers_does(tmp_path) -> None:
    # config attributes passed to from_pretrained / AutoConfig.from_pretrained change the model
    # built (TRL's RewardTrainer passes num_labels=1: a 1-row score head, not the config's 2);
    # the rest reach the model's __init__, where an unknown one fails as in transformers
    import json

    from transformers import (
        AutoConfig,
        AutoModelForSequenceClassification,
        LlamaConfig,
        LlamaForCausalLM,
    )

    folder = tmp_path / "tiny"
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=512, max_position_embeddings=128)
    LlamaForCausalLM(cfg).save_pretrained(folder)
    out = tmp_path / "seen.json"
    script = tmp_path / "load.py"
    script.write_text(
        "import json, sys, torch\n"
        "from transformers import AutoConfig, AutoModelForSequenceClassification\n"
        "name, out = sys.argv[1], sys.argv[2]\n"
        "m = AutoModelForSequenceClassification.from_pretrained(name, num_labels=1, num_hidden_layers=2,\n"
        "                                                       use_cache=False, device_map='cuda')\n"
        "c = AutoConfig.from_pretrained(name, rms_norm_eps=1e-3)\n"
        "try:\n"
        "    AutoModelForSequenceClassification.from_pretrained(name, not_an_argument=1)\n"
        "    err = ''\n"
        "except TypeError as e:\n"
        "    err = type(e).__name__\n"
        "json.dump({'shapes': {k: list(v.shape) for k, v in m.state_dict().items()},\n"
        "           'use_cache': m.config.use_cache, 'eps': c.rms_norm_eps, 'err': err}, open(out, 'w'))\n"
        "with torch.no_grad():\n"
        "    m(input_ids=torch.ones(1, 8, dtype=torch.long, device='cuda'))\n")
    vramplan.run_script(script, [str(folder), str(out)], gpu="h100-sxm")
    seen = json.loads(out.read_text())
    real = AutoModelForSequenceClassification.from_pretrained(folder, num_labels=1, num_hidden_layers=2,
                                                              use_cache=False)
    assert seen["shapes"] == {k: list(v.shape) for k, v in real.state_dict().items()}
    assert seen["shapes"]["score.weight"] == [1, 64]
    assert seen["use_cache"] is False and seen["eps"] == AutoConfig.from_pretrained(folder, rms_norm_eps=1e-3).rms_norm_eps
    with pytest.raises(TypeError):
        AutoModelForSequenceClassification.from_pretrained(folder, not_an_argument=1)
    assert seen["err"] == "TypeError"


def test_a_second_model_s_modules_carry_its_class(tmp_path: Path) -> None:
    """A pipeline calls several models whose paths can be the same (a text encoder's and a VAE's
    ``0``): the models after the first are named under their class."""
    script = tmp_path / "two_models.py"
    script.write_text(
        "import torch\nfrom torch import nn\n"
        "class Encoder(nn.Sequential): pass\nclass Decoder(nn.Sequential): pass\n"
        "enc = Encoder(nn.Linear(64, 4096), nn.ReLU()).cuda()\n"
        "dec = Decoder(nn.Linear(4096, 8192), nn.ReLU()).cuda()\n"
        "with torch.no_grad():\n"
        "    for _ in range(2):\n"
        "        dec(enc(torch.randn(256, 64, device='cuda')))\n")
    r = vramplan.run_script(script, gpu="h100-sxm", steps=2)
    names = {m.module for m in r.top_modules}
    assert "Decoder.0" in names and "0" in names, names  # (the first model's paths stay as they are)


_RETRYING = """import torch
from torch import nn
from accelerate.utils import find_executable_batch_size

model = nn.Sequential(nn.Linear(4096, 4096), nn.GELU(), nn.Linear(4096, 4096)).cuda()
opt = torch.optim.AdamW(model.parameters())
ran = []

@find_executable_batch_size(starting_batch_size=1 << 20)
def train(batch_size):
    for _ in range(2):
        model(torch.randn(batch_size, 4096, device="cuda")).sum().backward()
        opt.step()
        opt.zero_grad()
    ran.append(batch_size)

train()
print("ran", ran)
"""


def test_a_script_that_recovers_from_out_of_memory_runs_the_batch_the_gpu_would(tmp_path: Path) -> None:
    """accelerate's find_executable_batch_size (HF Trainer's auto_find_batch_size) catches CUDA's
    out-of-memory error and retries smaller: inside it the emulated GPU raises one where the caching
    allocator, within the GPU's free memory, could not allocate; the run is the batch that fits."""
    pytest.importorskip("accelerate")
    script = tmp_path / "retrying.py"
    script.write_text(_RETRYING)
    r = vramplan.run_script(script, [], gpu="rtx-4090")
    note = next(n for n in r.notes if "out-of-memory handler" in n)
    sizes = [int(x.replace(",", "")) for x in note.split("batch sizes ")[1].split(":")[0].split(", ")]
    assert sizes[0] == 1 << 20 and all(b < a for a, b in zip(sizes, sizes[1:], strict=False)) and len(sizes) > 3
    assert r.ran is not None and r.ran.batch == sizes[-1] and r.ran.steps == 2
    assert r.verdict is not None and r.verdict.fits, r.verdict
    # the batch before the last did not fit: its first step's two [batch, 4096] activations and the input alone
    # would not leave room for the rest (the replay says where)
    assert 3 * sizes[-2] * 4096 * 4 > r.verdict.usable * 0.5
    # without a handler the run goes past the GPU and reports the whole need
    script.write_text(_RETRYING.replace("@find_executable_batch_size(starting_batch_size=1 << 20)\n", "")
                      .replace("train()", "train(1 << 20)"))
    whole = vramplan.run_script(script, [], gpu="rtx-4090")
    assert whole.verdict is not None and not whole.verdict.fits
    assert not any("out-of-memory handler" in n for n in whole.notes)


def test_lightnings_batch_size_finder_settles_where_the_gpu_runs_out() -> None:
    """Lightning's finder (Tuner.scale_batch_size, power mode) doubles the batch until CUDA raises its
    out-of-memory error, then trains with the last size that ran: the emulated GPU raises it inside the
    finder's trials, where the caching allocator replay could not allocate within the GPU's free memory."""
    pytest.importorskip("lightning")
    r = vramplan.run_script(EX / "lightning_find_batch.py", ["--init", "32"], gpu="rtx-4090")
    note = next(n for n in r.notes if "Lightning's batch-size finder" in n)
    sizes = [int(x.replace(",", "")) for x in note.split("batch sizes ")[1].split(":")[0].split(", ")]
    assert sizes[0] == 32 and all(b == 2 * a for a, b in zip(sizes, sizes[1:], strict=False)) and len(sizes) >= 2
    assert "1 emulated CUDA out-of-memory error" in note and f"settled on {sizes[-2]:,}" in note
    assert r.ran is not None and r.ran.batch == sizes[-2] and r.ran.steps == 2  # the training after the finder
    assert r.verdict is not None and r.verdict.fits, r.verdict
    # the size that failed: its first forward's up-projection and GELU outputs, [batch, 2048, 4096] fp32 each,
    # are most of the GPU
    assert 2 * sizes[-1] * 2048 * 4096 * 4 > r.verdict.usable * 0.6
