"""The zoo of real public scripts (tests/zoo): each runs unmodified under ``vramplan run`` and is
compared with a real CPU run of the same script, every difference itemised."""

from __future__ import annotations

from pathlib import Path

import pytest

import vramplan
from vramplan.events import Category
from vramplan.script.truth import live_at_peak
from zoo import ZOO, Entry, fixtures, run


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return fixtures(tmp_path_factory.mktemp("zoo"))


def _args(e: Entry, root: Path) -> list[str]:
    return [a.replace("ROOT", str(root)) for a in e.args]


def _library(e: Entry) -> str:
    return e.needs or e.package


FRESH = {next(e.name for e in ZOO if _library(e) == lib) for lib in {_library(e) for e in ZOO}}
"""The first entry of each library runs in a new process, its libraries imported under the
emulated GPU as ``vramplan run`` imports them (what a library detects when it is imported is
checked there); the others in processes forked from a server that imported them already."""


@pytest.mark.parametrize("entry", [pytest.param(e, id=e.name, marks=[pytest.mark.slow] if e.slow else []) for e in ZOO])
def test_a_real_script_matches_its_cpu_run(entry: Entry, root: Path) -> None:
    # in its own process: vramplan run, then the script for real on the CPU
    c = run(entry, root, fresh=entry.name in FRESH)
    if "skip" in c:
        pytest.skip(c["skip"])
    assert c["ran"] and c["params"] > 0
    assert c["unexplained"] == 0  # every byte of the difference is in one of the items
    # the caching allocator's rounding: 512-byte blocks, and a large block's unsplit tail (< 1 MiB)
    assert 0 <= c["rounding"] <= (1 << 20) * (c["live"] + len(c["only_predicted"]))
    assert abs(c["residual"]) <= 0.01 * c["truth"], (c["residual"], c["only_predicted"][:8],
                                                                c["only_truth"][:8])
    for why, pred, true in c["paths"]:  # a code-path difference that is declared is also seen
        assert pred or true, why


def test_cuda_only_workspaces_are_the_difference_they_say(root: Path) -> None:
    e = next(x for x in ZOO if x.name == "TRL SFT")
    why = e.available()
    if why:
        pytest.skip(why)
    path = e.path()
    assert path is not None
    plain = vramplan.run_script(path, _args(e, root), gpu="h100-sxm", workspaces=False)
    cuda = vramplan.run_script(path, _args(e, root), gpu="h100-sxm", workspaces=True)
    assert cuda.events is not None and plain.events is not None
    requested, live = live_at_peak(cuda.events)
    cats = cuda.events.category
    ws = sum(cuda.events.size[k] for k in range(len(cuda.events)) if cats[k] == int(Category.WORKSPACE)
             and cuda.events.action[k] == 0 and cuda.events.size[k] >= 2**20)
    assert ws > 0  # the cuBLAS workspaces (one per handle and stream) are there on CUDA only
    gained = live_at_peak(cuda.events)[0] - live_at_peak(plain.events)[0]
    assert 0 < gained <= ws
    assert any("cuBLAS workspace" in n for n in cuda.notes)
    assert requested and live


def test_dropout_masks_are_one_byte_on_cuda_and_the_difference_they_say(tmp_path: Path) -> None:
    from vramplan.script.truth import DROPOUT_MASKS, compare, cpu_truth

    script = tmp_path / "dropout_loop.py"
    script.write_text(
        "import torch\nfrom torch import nn\n"
        "device = 'cuda' if torch.cuda.is_available() else 'cpu'\n"
        "torch.manual_seed(0)\n"
        "model = nn.Sequential(nn.Linear(64, 1024), nn.ReLU(), nn.Dropout(0.1), nn.Linear(1024, 64),\n"
        "                      nn.Dropout(0.1)).to(device)\n"
        "opt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
        "for _ in range(3):\n"
        "    loss = model(torch.randn(2048, 64, device=device)).pow(2).mean()\n"
        "    loss.backward(); opt.step(); opt.zero_grad()\n")
    r = vramplan.run_script(script, gpu="h100-sxm", workspaces=False, steps=2)
    c = compare(r, cpu_truth(script, steps=2))
    assert c.unexplained == 0
    masks = [(p, t) for why, p, t in c.paths if why == DROPOUT_MASKS]  # (activations dominate: masks at the peak)
    assert masks and masks[0][1] == 4 * masks[0][0] > 0  # bool on CUDA, fp32 on the CPU: 1 byte against 4
    assert c.residual == 0  # the rest is the same storages


def test_trl_sft_under_trls_own_fsdp1_accelerate_config(root: Path) -> None:
    """TRL's SFT script launched with the FSDP1 accelerate config TRL ships
    (``trl/accelerate_configs/fsdp1.yaml``: FULL_SHARD, BACKWARD_PRE, forward prefetch,
    use_orig_params, bf16), both unmodified, as ``accelerate launch`` runs them on 2 processes:
    rank 0 holds half of each flat parameter and of AdamW's states, and the header counts the
    whole model."""
    e = next(x for x in ZOO if x.name == "TRL SFT")
    why = e.available()
    if why:
        pytest.skip(why)
    from vramplan.script.launch import parse_launch

    script, cfg = e.path(), e.path().parent.parent / "accelerate_configs" / "fsdp1.yaml"  # type: ignore[union-attr]
    assert cfg.is_file()
    launch = parse_launch(["accelerate", "launch", "--config_file", str(cfg), "--num_processes", "2", str(script),
                           *_args(e, root)])
    env = dict(launch.env)  # accelerate's own launcher turns the config into the script's environment
    assert (env["ACCELERATE_USE_FSDP"], env["FSDP_VERSION"], env["FSDP_BACKWARD_PREFETCH"]) == ("true", "1", "BACKWARD_PRE")
    r = vramplan.run_script(launch.script, launch.argv, gpu="h100-sxm", workspaces=False, steps=2, world=launch.world,
                            gpus=launch.per_node, env=env)
    assert r.ran is not None and "bf16-mixed" in r.ran.line() and "FSDP mixed precision bf16" in r.ran.line()
    whole = vramplan.run_script(script, _args(e, root), gpu="h100-sxm", workspaces=False, steps=2)
    assert r.params == whole.params  # (not rank 0's shard)
    # fp32 flat shards: half the model's parameters, gradients and AdamW states (less than 1 KiB
    # apart: the flat parameters' padding, and the buffers FSDP1 keeps whole in bf16)
    for part in ("weights", "gradients", "optimizer"):
        assert abs(getattr(r.model_states, part) - getattr(whole.model_states, part) // 2) <= 1024, part


def test_the_cpu_truth_counts_weights_no_op_made(tmp_path: Path) -> None:
    # weights a loader reads in worker threads (transformers 5 loads safetensors in a thread
    # pool) are storages no op the tracker saw made (a dispatch mode is per thread); the truth
    # counts them all the same (a GPU run holds them on the device): they were left out, and each
    # TRL row's residual was the embedding's 129,024 B
    from vramplan.script.truth import cpu_truth

    script = tmp_path / "loaded.py"
    script.write_text(
        "import torch\nfrom concurrent.futures import ThreadPoolExecutor\nfrom torch import nn\n"
        "model = nn.Linear(256, 1024, device='meta')\n"
        "with ThreadPoolExecutor(2) as pool:\n"
        "    w, b = pool.map(lambda shape: torch.ones(shape), [(1024, 256), (1024,)])\n"
        "model.weight, model.bias = nn.Parameter(w), nn.Parameter(b)\n"
        "with torch.no_grad():\n"
        "    for _ in range(3):\n"
        "        model(torch.ones(4, 256))\n")
    t = cpu_truth(script, steps=2)
    assert ("f32[1024,256]", 1024 * 256 * 4) in t.at_peak and ("f32[1024]", 1024 * 4) in t.at_peak
    assert t.peak == 1024 * 256 * 4 + 1024 * 4 + 4 * 256 * 4 + 4 * 1024 * 4  # weights, input, output


def test_the_cpu_truth_runs_its_prelude_first_and_untracked(tmp_path: Path) -> None:
    # a prelude answers on the CPU what the script needs and only CUDA has (torchtune's distributed
    # recipes: tests/zoo/preludes/torchtune_cpu.py); it runs before the script, and what it makes is
    # not the script's memory
    import sys

    from vramplan.script.truth import cpu_truth

    prelude = tmp_path / "prelude.py"
    prelude.write_text("import sys, types, torch\n"
                       "sys.modules['prelude_probe'] = types.SimpleNamespace(width=512, held=torch.ones(1 << 20))\n")
    script = tmp_path / "uses_it.py"
    script.write_text("import torch\nfrom torch import nn\nfrom prelude_probe import width\n"
                      "model = nn.Linear(width, width, bias=False)\n"
                      "with torch.no_grad():\n"
                      "    for _ in range(3):\n"
                      "        model(torch.ones(4, width))\n")
    try:
        with pytest.raises(ModuleNotFoundError):
            cpu_truth(script, steps=2)
        t = cpu_truth(script, steps=2, prelude=prelude)
    finally:
        sys.modules.pop("prelude_probe", None)
    assert ("f32[512,512]", 512 * 512 * 4) in t.at_peak
    assert t.peak == 512 * 512 * 4 + 2 * 4 * 512 * 4  # weight, input, output: not the prelude's 4 MiB
