"""FSDP1's ``CPUOffload(offload_params=True)`` traced on the fake process group (``engine=fsdp1``
with ``offload_params``), against figures computed by hand from FSDP1's flat-parameter
arithmetic (torch 2.13 ``torch/distributed/fsdp/_flat_param.py``; docs/research/fsdp1-cpu-offload.md).

No real run is compared here, because a CPU-only gloo world cannot run FSDP1's CPU offload: at
lazy init FSDP1 pins the local shard and the gradient buffer with ``Tensor.pin_memory()``
(``init_flat_param_attributes``), which raises "Cannot access accelerator device when none is
available" without an accelerator; and with the CPU as the compute device the host-to-device
copy before each all-gather (``pre_unshard``: ``flat_param.device != self.device``) and the
device-to-host gradient copy would not happen, so such a run would not be the offload path.
The model is the one of the FSDP1 gloo agreement test (``block_model``, 2 ranks), at width 99
so that each block's flat parameter (78,903 elements) is padded to an even length."""

from __future__ import annotations

import dataclasses
from collections import Counter
from functools import partial

import pytest

from vramplan.analytic.host import pinned_bytes
from vramplan.errors import TraceError
from vramplan.trace.host import FLAT_SHARDS, GRADIENTS, PARAMETERS, STATES, STEP
from vramplan.trace.run import TraceOptions, trace_model
from vramplan.trace.testing import block_inputs, block_model
from vramplan.workload import Workload

WIDTH, WORLD = 99, 2
OPTS = TraceOptions(workspaces=False, count_flops=False)


def _units(align: int) -> list[tuple[int, list[tuple[int, int]]]]:
    """(flat elements, [(start, elements) of each original parameter]) of each FSDP1 unit —
    one per block, the root's the rest — as ``FlatParamHandle`` lays them out with
    ``use_orig_params``: each parameter starts at a multiple of ``align`` elements (16 bytes in
    the unsharded dtype; padding before it, ``_flat_param.py`` ``_init_flat_param_and_metadata``),
    the whole padded to a multiple of the world size."""
    model = block_model(WIDTH)
    groups = [list(b.parameters()) for b in model.layers]
    groups.append([p for p in model.parameters() if all(p is not q for g in groups for q in g)])
    out = []
    for params in groups:
        at, spans = 0, []
        for p in params:
            at += -at % align
            spans.append((at, p.numel()))
            at += p.numel()
        out.append((at + -at % WORLD, spans))
    return out


def _mine(units: list[tuple[int, list[tuple[int, int]]]], rank: int) -> int:
    """Elements of the original parameters inside rank ``rank``'s shards."""
    total = 0
    for numel, spans in units:
        lo, hi = rank * numel // WORLD, (rank + 1) * numel // WORLD
        total += sum(max(0, min(hi, a + n) - max(lo, a)) for a, n in spans)
    return total


def _w(precision: str = "fp32", offload: bool = True, **kw) -> Workload:
    return Workload(task="train", precision=precision, **kw).replace(dp=WORLD, zero=3, engine="fsdp1",
                                                                     offload_params=offload)


def _trace(w: Workload, rank: int = 0, iterations: int = 2):
    return trace_model(partial(block_model, WIDTH), block_inputs(WIDTH), workload=w,
                       options=dataclasses.replace(OPTS, rank=rank), iterations=iterations)


@pytest.mark.parametrize("precision, rank", [("fp32", 0), ("bf16-mixed", 1)])
def test_host_ram_per_part_is_the_flat_parameter_arithmetic(precision: str, rank: int) -> None:
    """Per unit, a pinned copy of the rank's padded fp32 shard (``_local_shard``) and a pinned
    fp32 gradient buffer of the same size (``_cpu_grad``, fp32 under bf16 ``MixedPrecision``
    too), each a power-of-two block; AdamW's two states over the rank's unpadded part of each
    flat parameter (``use_orig_params``: the original parameters are views of the shard; under
    bf16 ``MixedPrecision`` the alignment padding is in bf16 elements, which moves the shard
    boundary), and foreach AdamW's ``sqrt`` list as the step's temporaries."""
    units = _units(4 if precision == "fp32" else 8)
    assert sum(n for _, n in units[0][1]) % WORLD == 1  # a padded flat parameter
    r = _trace(_w(precision), rank)
    host = dict(r.host_parts)
    assert host[PARAMETERS] == host[GRADIENTS] == sum(pinned_bytes(4 * numel // WORLD) for numel, _ in units)
    assert host[STATES] == 2 * 4 * _mine(units, rank)
    assert host[STEP] == 4 * _mine(units, rank)
    assert r.host_memory == sum(host.values())
    assert any("CPUOffload(offload_params=True)" in n for n in r.notes)
    assert any(n.startswith("FSDP1 CPU offload: host RAM") for n in r.notes)


def _allocs(r) -> list[dict]:
    """The step's device allocations (the constructor's, in ``setup``, left out)."""
    return [row for row in r.events.rows() if row["action"] == "alloc" and row.get("phase") != "setup"]


@pytest.mark.parametrize("precision", ["fp32", "bf16-mixed"])
def test_gpu_keeps_no_state_and_copies_each_shard_up_before_its_all_gather(precision: str) -> None:
    """Against the same layout without offload: the GPU holds nothing but the batch between
    steps (no sharded parameter, gradient or optimizer state); every all-gather of a unit is
    preceded by one copy of its fp32 shard to the GPU (``pre_unshard``; under ``MixedPrecision``
    the copy is cast into the 16-bit ``_mp_shard``) — and the root, which FSDP1 does not reshard
    after the forward, has its shard copied up again in the backward although it is still
    unsharded (``pre_unshard`` skips only when not offloading); no gradient is kept on the GPU."""
    shard_bytes = {4 * numel // WORLD for numel, _ in _units(4 if precision == "fp32" else 8)}
    on, off = _trace(_w(precision)), _trace(_w(precision, offload=False))
    batch = block_inputs(WIDTH).numel() * 4
    log = on.events
    live: dict[int, int] = {}
    between = []
    for row in log.rows():
        if row["action"] == "alloc":
            live[row["id"]] = row["size"]
        elif row["action"] in ("free", "free_deferred"):
            live.pop(row["id"], None)
        elif row["action"] == "mark" and row["op"] in ("iteration 2", "optimizer"):
            between.append(sum(live.values()))
    assert between and all(b == batch for b in between), between
    on_allocs = _allocs(on)
    copies = [a for a in on_allocs if a["op"] == "aten._to_copy.default" and a["size"] in shard_bytes]
    gathered = {WORLD * b // 4 * (4 if precision == "fp32" else 2) for b in shard_bytes}  # padded unsharded
    gathers = [a for a in _allocs(off) if a["category"] == "parameter" and a["size"] in gathered
               and a["stream"] != 0]  # (on the unshard stream; lazy init's empties are on the default one)
    by_unit = Counter(a["size"] // (4 if precision == "fp32" else 2) for a in gathers)  # flat elements
    by_unit[_units(4 if precision == "fp32" else 8)[-1][0]] += 2  # the root, once more per step
    stream = copies[0]["stream"]  # FSDP1's pre-unshard stream (the bf16 gradient's fp32 cast is on another)
    copies = [a for a in copies if a["stream"] == stream]
    assert Counter(WORLD * a["size"] // 4 for a in copies) == by_unit and stream != 0
    assert not {a["category"] for a in on_allocs} & {"gradient", "optimizer_state"}
    assert on.peak_allocated < off.peak_allocated


def test_lora_pins_a_gradient_buffer_for_every_flat_parameter() -> None:
    """FSDP1 allocates ``_cpu_grad`` for every flat parameter under offload, frozen ones too (peft's
    wrap policy puts the frozen base weights in their own units): pinned gradients equal the pinned
    parameters, while the optimizer states are the adapters' only (FSDP2 offloads the gradients of
    trainable parameters only). Before the first all-gather each unit's flat shard is still in the
    pageable copy FSDP1's constructor made, next to the pinned one: with LoRA's small optimizer
    states that is the pageable peak, labelled so."""
    r = _trace(_w(peft="lora", lora_targets=("up", "down")))
    host = dict(r.host_parts)
    assert host[GRADIENTS] == host[PARAMETERS]
    adapters = 3 * (16 * WIDTH + 4 * WIDTH * 16 + 16 * 4 * WIDTH + WIDTH * 16)  # rank 16 on up and down
    assert host[STATES] == 2 * 4 * adapters // WORLD
    assert FLAT_SHARDS in host and STEP not in host


def test_refusals_name_fsdp1_offload() -> None:
    with pytest.raises(TraceError, match="FSDP CPU offload is traced without tensor parallelism"):
        _trace(_w().replace(tp=2, dp=1), iterations=1)


def test_accelerate_config_round_trips_fsdp1_offload() -> None:
    """``emit=accelerate`` writes FSDP1 with ``fsdp_offload_params``; ``layout=accelerate`` reads it
    back (both offload flags: FSDP1's one ``CPUOffload`` moves the step to the host too), which
    traces to the same GPU peak and host RAM as ``offload_params`` alone."""
    from vramplan.models.catalog import resolve
    from vramplan.planner.emit import emit
    from vramplan.planner.layout import read_layout
    from vramplan.planner.plan import plan

    template = plan(resolve("llama-3.2-1b"), Workload(seq=1024), gpu="h100", max_gpus=1, method="analytic",
                    confirm=0).plans[0]
    w = _w()
    text = emit(dataclasses.replace(template, workload=w, num_gpus=WORLD), "accelerate").text
    assert "fsdp_offload_params: true" in text and "fsdp_version: 1" in text
    back = read_layout("accelerate", text, w.replace(zero=0, offload_params=False, engine="auto")).workload
    assert back.parallel == w.replace(offload_optimizer=True).parallel  # (one CPUOffload: both flags)
    a, b = _trace(w, iterations=1), _trace(back, iterations=1)
    assert (a.peak_allocated, a.host_parts) == (b.peak_allocated, b.host_parts)
