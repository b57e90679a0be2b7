"""torchrun / accelerate launch scripts in `vramplan run`: rank 0 of the declared world, on
PyTorch's fake process group."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import vramplan
from vramplan.errors import VramplanError
from vramplan.events import Action
from vramplan.script.launch import parse_launch

EX = Path(__file__).parent / "examples"
FSDP = str(EX / "fsdp2_loop.py")
DDP = str(EX / "ddp_loop.py")
FSDP1 = str(EX / "fsdp1_loop.py")
MODEL = 4 * 1024 * 1024 * 4  # four fp32 1024×1024 linears


@pytest.mark.parametrize("cmd, world, per_node, argv", [
    (["torchrun", "--nproc-per-node", "8", FSDP, "--lr", "1"], 8, 8, ("--lr", "1")),
    (["--", "torchrun", "--nproc_per_node=4", "--nnodes", "2", "--standalone", FSDP], 8, 4, ()),
    (["torchrun", "--nnodes", "1:4", "--nproc-per-node", "8", "--rdzv-endpoint", "h:29400", FSDP], 32, 8, ()),
    (["torchrun", FSDP], 1, 1, ()),
    (["accelerate", "launch", "--num_processes", "16", "--num_machines", "2", "--multi_gpu", FSDP], 16, 8, ()),
    (["accelerate", "launch", "--num-processes=2", FSDP, "x"], 2, 2, ("x",)),
])
def test_launchers_declare_the_world(cmd, world, per_node, argv):
    launch = parse_launch(cmd)
    assert (launch.world, launch.per_node, launch.argv) == (world, per_node, argv)
    assert launch.script == Path(FSDP)


def test_accelerate_config_file_gives_the_process_count(tmp_path):
    cfg = tmp_path / "accelerate.yaml"
    cfg.write_text("distributed_type: FSDP\nnum_machines: 2\nnum_processes: 16\n")
    launch = parse_launch(["accelerate", "launch", "--config_file", str(cfg), FSDP])
    assert (launch.world, launch.per_node) == (16, 8)


@pytest.mark.parametrize("cmd, match", [
    (["torchrun", "--nproc-per-node", "auto", FSDP], "counts the GPUs"),
    (["torchrun", "--nproc-per-node", "0", FSDP], "positive integer"),
    (["torchrun", "-m", "no_such_pkg.train"], "no module named 'no_such_pkg'"),
    (["torchrun", "-m"], "expected a module"),
    (["accelerate", "config"], "only `accelerate launch"),
    (["accelerate", "launch", "--num_processes", "6", "--num_machines", "4", FSDP], "do not split"),
    (["torchrun", "--nproc-per-node"], "needs a value"),
])
def test_bad_launch_lines_are_user_errors(cmd, match):
    with pytest.raises(VramplanError, match=match):
        parse_launch(cmd)


def test_gpus_must_agree_with_the_launcher():
    with pytest.raises(VramplanError, match="contradicts"):
        parse_launch(["torchrun", "--nproc-per-node", "8", FSDP], gpus=4)
    assert parse_launch(["torchrun", "--nproc-per-node", "8", FSDP], gpus=8).world == 8


@pytest.mark.parametrize("world", [8, 64])
def test_fsdp2_script_traces_rank_zero_with_sharded_states(world):
    r = vramplan.run_script(EX / "fsdp2_loop.py", [], gpu="h100-sxm", world=world, gpus=8)
    b = r.breakdown
    assert b.optimizer == 2 * MODEL // world  # AdamW exp_avg + exp_avg_sq shards, 1/world each
    assert 0 < b.gradients <= MODEL // world  # fp32 gradient shards (those alive at the peak)
    assert any("NCCL" in o.name for o in r.overhead)


def test_fsdp2_meta_init_script_keeps_only_the_materialised_shards():
    """Built on meta, sharded, then ``to_empty(device="cuda")``: FSDP2 rebinds its flat shards to
    the new local tensors at lazy init, so fully_shard's own shards die (they stayed alive, as
    extra "activations", while the trace's reset returned early for meta tensors)."""
    meta = vramplan.run_script(EX / "fsdp2_meta_init.py", [], gpu="h100-sxm", world=8, gpus=8)
    built = vramplan.run_script(EX / "fsdp2_loop.py", [], gpu="h100-sxm", world=8, gpus=8)
    assert meta.breakdown == built.breakdown
    assert meta.peak.allocated == built.peak.allocated
    assert meta.breakdown.activations < MODEL // 8 // 4  # no 512 KiB shard counted beside the batch

    def whole_weights(r) -> int:  # allocations of a whole f32[1024,1024] weight (not the gathered flat ones)
        log, s = r.events, r.events.strings
        return sum(1 for k in range(len(log)) if log.action[k] == Action.ALLOC and s[log.desc[k]] == "f32[1024,1024]"
                   and s[log.op[k]] in ("aten.empty.memory_format", "aten._to_copy.default"))

    # the meta model (and fully_shard's meta shards) take no memory; a model built on the host
    # and moved with .cuda() is on the GPU whole until each layer is sharded
    assert whole_weights(meta) == 0
    assert whole_weights(built) == 4


FSDP2_RESET = """\
import os

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

device = "cuda" if torch.cuda.is_available() else "cpu"
dist.init_process_group(dist.get_default_backend_for_device(device))
if device == "cuda":
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
mesh = init_device_mesh(device, (dist.get_world_size(),))
with torch.device("meta"):
    model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(4)])
for layer in model:
    fully_shard(layer, mesh=mesh)
fully_shard(model, mesh=mesh)
model.to_empty(device=device)
for layer in model:
    layer.reset_parameters()
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
for _ in range(3):
    model(torch.randn(32, 256, device=device)).sum().backward()
    opt.step()
    opt.zero_grad()
dist.destroy_process_group()
"""


def test_fsdp2_sharded_reset_parameters_runs_and_rank_zero_agrees_with_gloo(tmp_path):
    """PyTorch's own FSDP2 example's order (examples distributed/FSDP2/example.py): built on
    meta, sharded, ``to_empty(device="cuda")``, then ``reset_parameters()`` on the DTensor
    parameters. ``nn.Linear``'s ``kaiming_uniform_`` stopped in DTensor's fake shape propagation
    ("PyTorch is not linked with support for cuda devices": its ``uniform_`` decomposition copies
    between fake CUDA tensors). Rank 0 holds what rank 0 of a real 2-process gloo run holds at its
    peak, storage for storage; the CPU run's count sees FSDP2 free its unsharded parameters
    (``UntypedStorage.resize_(0)``: it counted every layer's as alive after its first forward)."""
    from vramplan.script.truth import compare, cpu_truth_world

    script = tmp_path / "fsdp2_reset.py"
    script.write_text(FSDP2_RESET)
    r = vramplan.run_script(script, [], gpu="h100-sxm", world=2, gpus=2, workspaces=False)
    n = 4 * (256 * 256 + 256) * 4
    assert r.model_states.weights == n // 2 and r.model_states.optimizer == n  # half a rank, AdamW's two states
    ranks: list = []
    truth = cpu_truth_world(script, [], world=2, steps=2, forked=True, ranks=ranks)
    assert len(ranks) == 2 and ranks[0] is truth and ranks[1].steps == truth.steps == 2  # (every rank's, rank 0's first)
    c = compare(r, truth)
    assert c.unexplained == 0 and not c.only_predicted, c.only_predicted
    # only on the CPU: AdamW's host step counters (host tensors on a GPU too, where the GPU run
    # leaves them out) and gloo's 8 bytes; FSDP2's freed unsharded parameters, resized to 0 bytes
    assert all(n <= 8 for _, n in c.only_truth), c.only_truth
    assert 0 <= c.truth - c.requested <= 64, (c.requested, c.truth)


def test_fsdp1_script_runs_with_flat_sharded_states(tmp_path):
    """FSDP1 (``FullyShardedDataParallel``, flat parameters, a model built on the host and moved
    by ``device_id=torch.cuda.current_device()``): it runs (it stopped at ``torch.device(0)`` and
    at ``record_stream`` with an emulated stream), its states are 1/world flat shards, and right
    after the wrap only the shards are on the GPU. A fresh process: the first traced op imported
    torch._dynamo on the script's stack, whose import left a frame cycle pinning FSDP's
    per-parameter copies to the device (a whole model, until the next garbage collection)."""
    out = tmp_path / "after_wrap.txt"
    p = subprocess.run([sys.executable, "-m", "vramplan.cli.main", "run", "--gpu", "h100-sxm", "--json", "--", "torchrun",
                        "--nproc_per_node", "8", FSDP1, str(out)], capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-2000:]
    assert int(out.read_text()) == MODEL // 8
    report = json.loads(p.stdout)
    assert report["params"] == MODEL // 4  # the model's parameters, not this rank's shard of them
    states, b = report["model_states"], report["breakdown"]
    assert states == {"weights": MODEL // 8, "gradients": MODEL // 8, "optimizer": 2 * MODEL // 8,
                      "total": 4 * MODEL // 8}  # persistent: fp32 flat shards, their gradients, AdamW's two states
    assert b["optimizer"] == 2 * MODEL // 8 and 0 < b["gradients"] <= MODEL // 8
    # at the peak, beside the shards, whole units gathered (one layer's flat parameter: 4 MiB each)
    assert (b["weights"] - MODEL // 8) % (MODEL // 4) == 0 and b["weights"] > MODEL // 8


def test_accelerate_launch_gives_the_script_accelerates_own_environment(tmp_path):
    """`accelerate launch --config_file` turns the file into ACCELERATE_* / FSDP_* variables the
    script's Accelerator() reads (distributed type, mixed precision, the FSDP plugin): computed
    by accelerate's own launcher, not read by hand."""
    pytest.importorskip("accelerate")
    cfg = tmp_path / "fsdp.yaml"
    cfg.write_text("distributed_type: FSDP\nnum_processes: 4\nmixed_precision: bf16\nfsdp_config:\n"
                   "  fsdp_version: 1\n  fsdp_sharding_strategy: SHARD_GRAD_OP\n")
    launch = parse_launch(["accelerate", "launch", "--config_file", str(cfg), FSDP])
    env = dict(launch.env)
    assert launch.world == 4
    assert (env["ACCELERATE_USE_FSDP"], env["ACCELERATE_MIXED_PRECISION"], env["FSDP_SHARDING_STRATEGY"],
            env["FSDP_VERSION"]) == ("true", "bf16", "SHARD_GRAD_OP", "1")
    assert not [k for k in env if not k.startswith(("ACCELERATE_", "FSDP_"))]
    assert dict(parse_launch(["torchrun", "--nproc-per-node", "2", FSDP]).env) == {}


def test_ddp_script_traces_rank_zero_with_whole_states():
    r = vramplan.run_script(EX / "ddp_loop.py", [], gpu="h100-sxm", world=8, gpus=8)
    b = r.breakdown
    assert b.gradients == MODEL and b.optimizer == 2 * MODEL


def test_world_must_fill_nodes():
    with pytest.raises(VramplanError, match="does not fill nodes"):
        vramplan.run_script(EX / "fsdp2_loop.py", [], gpu="h100-sxm", world=12, gpus=8)


def test_accelerate_deepspeed_config_runs_deepspeeds_engine(tmp_path):
    """An accelerate DeepSpeed ZeRO-2 config: the script's Accelerator() builds DeepSpeed's own
    engine on the emulated GPU (it used to run as DDP: the config file's type was never seen);
    ZeRO-2 partitions the fp32 master weights and AdamW's states over the 2 ranks."""
    pytest.importorskip("deepspeed")
    pytest.importorskip("accelerate")
    cfg = tmp_path / "ds.yaml"
    cfg.write_text("distributed_type: DEEPSPEED\nnum_processes: 2\nmixed_precision: bf16\n"
                   "deepspeed_config:\n  zero_stage: 2\n")
    script = tmp_path / "train.py"
    script.write_text(
        "import torch\nfrom accelerate import Accelerator\nacc = Accelerator()\n"
        "model = torch.nn.Sequential(*[torch.nn.Linear(512, 512) for _ in range(4)])\n"
        "opt = torch.optim.AdamW(model.parameters(), lr=1e-4)\n"
        "data = torch.utils.data.DataLoader(torch.randn(16, 512), batch_size=2)\n"
        "model, opt, data = acc.prepare(model, opt, data)\n"
        "for x in data:\n    acc.backward(model(x.to(torch.bfloat16)).float().pow(2).mean()); opt.step(); opt.zero_grad()\n")
    launch = parse_launch(["accelerate", "launch", "--config_file", str(cfg), str(script)])
    assert dict(launch.env)["ACCELERATE_USE_DEEPSPEED"] == "true"
    r = vramplan.run_script(launch.script, launch.argv, gpu="h100-sxm", world=launch.world, gpus=launch.per_node,
                            env=dict(launch.env), workspaces=False)
    assert any("DeepSpeedEngine" in n for n in r.notes)
    n = 4 * (512 * 512 + 512)
    assert r.model_states.optimizer <= (4 + 4 + 4) * n // 2 + 4096  # fp32 master + exp_avg + exp_avg_sq, halved


def test_modules_run_as_python_dash_m_runs_them(tmp_path):
    # `python -m pkg.train` and `torchrun -m pkg.train` (torchtitan's own launch line): the
    # module found from the working folder without importing it, its package imported on the
    # emulated GPU, run as __main__ with its package set (relative imports work); torchrun with
    # one process still sets the rank variables (torchtitan reads LOCAL_RANK)
    pkg = tmp_path / "mypkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("import torch\nON_GPU = torch.cuda.is_available()\n")
    (pkg / "model.py").write_text("from torch import nn\nmake = lambda: nn.Linear(1024, 1024)\n")
    (pkg / "train.py").write_text(
        "import os, sys, torch\nfrom . import ON_GPU\nfrom .model import make\n"
        "assert __name__ == '__main__' and __package__ == 'mypkg' and ON_GPU, (__name__, __package__)\n"
        "assert sys.argv[1:] == ['--lr', '0.1'], sys.argv\n"
        "if 'LOCAL_RANK' in os.environ:\n"
        "    torch.distributed.init_process_group('nccl')\n"
        "    assert torch.distributed.get_world_size() == 1\n"
        "model = make().cuda()\nopt = torch.optim.SGD(model.parameters(), lr=float(sys.argv[2]))\n"
        "for _ in range(2):\n"
        "    model(torch.randn(8, 1024, device='cuda')).sum().backward(); opt.step(); opt.zero_grad()\n")
    for launch in (["python", "-m"], ["torchrun", "--nproc-per-node", "1", "-m"]):
        p = subprocess.run([sys.executable, "-m", "vramplan.cli.main", "run", "--json", "--", *launch, "mypkg.train",
                            "--lr", "0.1"], capture_output=True, text=True, timeout=300, cwd=tmp_path)
        assert p.returncode == 0, p.stderr[-2000:]
        doc = json.loads(p.stdout)
        assert doc["model_states"]["weights"] == (1024 * 1024 + 1024) * 4, launch
    launch = parse_launch(["torchrun", "--nproc-per-node", "1", "-m", "json.tool", "x"])
    assert (launch.module, launch.script.name, launch.argv) == ("json.tool", "tool.py", ("x",))
    with pytest.raises(VramplanError, match="no __main__"):
        parse_launch(["torchrun", "-m", "email"])
