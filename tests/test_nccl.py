"""NCCL communicator memory: one item per process group, each from NCCL's buffer formulas."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from vramplan.engine import overhead_items
from vramplan.errors import VramplanError
from vramplan.hardware.catalog import get_gpu
from vramplan.hardware.nccl import (
    LL128_BUFFSIZE,
    LL_BUFFSIZE,
    SIMPLE_BUFFSIZE,
    Communicator,
    collective_bytes,
    communicator_items,
    mesh_communicators,
)
from vramplan.units import KiB, MiB
from vramplan.workload import Parallel, Workload


def _names(comms):
    return {c.name: c for c in comms}


def test_one_communicator_per_mesh_dimension():
    c = _names(mesh_communicators(dp=8, tp=8, pp=4))
    assert set(c) == {"tp", "dp", "pp", "world"}
    assert (c["tp"].size, c["tp"].local) == (8, 8)  # tensor parallelism innermost: one node
    assert (c["dp"].size, c["dp"].local) == (8, 1)  # dp ranks 8 apart: one per node
    assert c["pp"].pattern == "p2p" and c["pp"].local == 1
    assert c["world"].size == 256


def test_single_dimension_needs_no_separate_world_communicator():
    assert [c.name for c in mesh_communicators(dp=64)] == ["dp"]
    assert mesh_communicators() == ()


def test_hsdp_has_a_shard_and_a_replicate_group():
    c = _names(mesh_communicators(dp=32, dp_shard=8))
    assert (c["dp_shard"].size, c["dp_shard"].local) == (8, 8)
    assert (c["dp_replicate"].size, c["dp_replicate"].local) == (4, 1)
    with pytest.raises(VramplanError):
        mesh_communicators(dp=12, dp_shard=8)


def test_collective_buffers_follow_ncclS_defaults():
    per_conn = SIMPLE_BUFFSIZE + LL_BUFFSIZE + LL128_BUFFSIZE
    assert per_conn == 4 * MiB + 512 * KiB + 4800 * KiB
    assert collective_bytes(16) == 16 * 2 * per_conn


def test_nvls_only_on_nvswitch_hopper_with_more_than_two_local_ranks():
    h100, a100, h100_pcie = get_gpu("h100"), get_gpu("a100-80gb"), get_gpu("h100-pcie")
    eight = (Communicator("dp", 8, 8),)
    nvls = [i for i in communicator_items(h100, eight) if "NVLS" in i.name]
    assert len(nvls) == 1 and nvls[0].bytes == 16 * 2 * 128 * KiB * 8 * 8  # 256 MiB
    assert not [i for i in communicator_items(a100, eight) if "NVLS" in i.name]  # no multicast before sm90
    assert not [i for i in communicator_items(h100_pcie, eight) if "NVLS" in i.name]
    assert not [i for i in communicator_items(h100, (Communicator("dp", 2, 2),)) if "NVLS" in i.name]
    assert not [i for i in communicator_items(h100, eight, nvls=False) if "NVLS" in i.name]
    b200 = [i for i in communicator_items(get_gpu("b200"), eight) if "NVLS" in i.name]
    assert b200[0].bytes == 2 * nvls[0].bytes  # NVLS_NCHANNELS_SM100 = 32


def test_p2p_buffers_for_pipeline_neighbours_and_all_to_all_peers():
    h100 = get_gpu("h100")
    (pp,) = communicator_items(h100, (Communicator("pp", 4, 1, "p2p"),))
    assert pp.bytes == 2 * 8 * 2 * 128 * KiB  # 2 neighbours over the network
    (ep,) = communicator_items(h100, (Communicator("ep", 8, 8, "all-to-all"),))
    assert ep.bytes == 2 * 8 * 7 * 512 * KiB  # 7 peers over NVLink


def test_memory_grows_with_the_number_of_communicators_not_the_world_size():
    h100 = get_gpu("h100")

    def nccl(**par):
        w = Workload(parallel=Parallel(**par))
        return sum(o.bytes for o in overhead_items(h100, w) if o.name.startswith("NCCL"))

    assert nccl(dp=8, zero=3) == nccl(dp=1024, zero=3)  # one group either way; 8 of its ranks per node
    assert nccl(dp=8, tp=8, zero=3) > nccl(dp=64, zero=3)  # two communicators (+ world) beat one
    assert nccl() == 0


def test_every_item_has_a_source():
    for g in (get_gpu("h100"), get_gpu("l4"), None):
        for o in communicator_items(g, mesh_communicators(dp=4, tp=2, pp=2, cp=2, ep=2)):
            assert o.bytes > 0 and o.source.strip()


def test_bad_communicators_are_user_errors():
    with pytest.raises(VramplanError):
        Communicator("dp", 4, 5)
    with pytest.raises(VramplanError):
        Communicator("dp", 4, 1, "ring")
    with pytest.raises(VramplanError):
        mesh_communicators(dp=0)


_POW2 = st.sampled_from([1, 2, 4, 8, 16])


@given(dp=_POW2, tp=st.sampled_from([1, 2, 4, 8]), pp=st.sampled_from([1, 2, 4]), cp=st.sampled_from([1, 2]),
       shard=st.sampled_from([0, 2, 8]))
def test_mesh_invariants(dp, tp, pp, cp, shard):
    if shard and dp % shard:
        return
    comms = mesh_communicators(dp=dp, tp=tp, pp=pp, cp=cp, dp_shard=shard)
    by = _names(comms)
    world = dp * tp * pp * cp
    # the groups of the mesh dimensions multiply to the world
    prod = 1
    for name in ("tp", "cp", "dp", "dp_shard", "dp_replicate", "pp"):
        prod *= by[name].size if name in by else 1
    assert prod == world
    for c in comms:
        assert 2 <= c.size <= world and 1 <= c.local <= min(c.size, 8)
    # tensor parallelism is innermost: its ranks are on one node whenever it fits one
    if tp > 1:
        assert by["tp"].local == tp
    # one communicator per dimension of size > 1, and exactly one collective group spans the world
    dims = sum(1 for n in (tp, cp, pp) if n > 1) + (0 if dp == 1 else (1 if not shard or shard == dp else
                                                                      (2 if shard > 1 else 1)))
    assert len([c for c in comms if c.name != "world"]) == dims
    if world > 1:
        assert len([c for c in comms if c.size == world and c.pattern == "collective"]) == 1
