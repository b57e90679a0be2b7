"""The fake-process-group session (trace/dist.py): one rank of a world traced alone."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from vramplan.errors import TraceError
from vramplan.events import Action, Category
from vramplan.target import DEFAULT_PROFILE
from vramplan.trace import dist as D
from vramplan.trace.session import TraceSession

fully_shard = pytest.importorskip("torch.distributed.fsdp").fully_shard


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.up = nn.Linear(d, 4 * d, bias=False)
        self.down = nn.Linear(4 * d, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x)))


class Net(nn.Module):
    def __init__(self, d: int = 64, layers: int = 3) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Block(d) for _ in range(layers))
        self.head = nn.Linear(d, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for blk in self.layers:
            x = blk(x)
        return self.head(x)


def _fsdp_trace(world: D.World, *, d: int = 64, reshard: bool = True, iterations: int = 2) -> TraceSession:
    with torch.device("meta"):
        model = Net(d)
    sess = TraceSession(DEFAULT_PROFILE)
    with D.rank_session(sess, world) as ctx:
        mesh = ctx.submesh("dp")
        for blk in model.layers:
            fully_shard(blk, mesh=mesh, reshard_after_forward=reshard)
        fully_shard(model, mesh=mesh, reshard_after_forward=reshard)
        sess.add_model(model, "Net")
        opt = torch.optim.AdamW(model.parameters())
        x = torch.empty(2, 16, d, device="meta")
        for it in range(1, iterations + 1):
            sess.start_iteration(it)
            model(x).sum().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    return sess


def _params_bytes(sess: TraceSession) -> int:
    log = sess.rec.log
    return sum(log.size[k] for k in range(len(log))  # (set up before the first iteration)
               if log.action[k] == Action.ALLOC and log.category[k] == Category.PARAMETER and log.iteration[k] == 0)


def _sized(sess: TraceSession) -> list[int]:
    log = sess.rec.log
    return [log.stream[k] for k in range(len(log)) if log.action[k] == Action.ALLOC and log.size[k] > 0]


def test_world_validation() -> None:
    with pytest.raises(TraceError, match="outside a world of 8"):
        D.World((("dp", 8),), rank=8)
    with pytest.raises(TraceError, match="positive integer"):
        D.World((("dp", 0),))
    with pytest.raises(TraceError, match="repeat"):
        D.World((("dp", 2), ("dp", 2)))
    with pytest.raises(TraceError, match="unknown mesh"):
        D.world_of(dq=2)
    w = D.world_of(pp=2, dp=4, tp=2)
    assert w.names == ("pp", "dp", "tp") and w.size == 16 and w.dim("cp") == 1
    assert D.world_of(dp=1).dims == (("dp", 1),)


def test_fsdp2_shards_parameters_and_records_comm_streams() -> None:
    sess = _fsdp_trace(D.World((("dp", 8),)))
    d = 64
    total = (3 * 8 * d * d + d * d) * 4  # fp32 weights
    assert _params_bytes(sess) == total // 8  # each rank holds 1/8 (sizes divide: no padding)
    log = sess.rec.log
    streams = {log.stream[k] for k in range(len(log)) if log.action[k] == Action.ALLOC}
    assert 0 in streams and len(streams) >= 3  # compute, all-gather copy-in, reduce-scatter
    assert not dist.is_initialized()  # torn down


def test_unsharded_parameters_are_gathered_and_freed_by_storage_resize() -> None:
    sess = _fsdp_trace(D.World((("dp", 4),)), iterations=1)
    log = sess.rec.log
    block_bytes = 8 * 64 * 64 * 4  # one block's unsharded fp32 weights (up + down)
    allocs = [log.size[k] for k in range(len(log)) if log.action[k] == Action.ALLOC]
    # the all-gather output of one block (world × shard) is allocated per unshard
    assert allocs.count(block_bytes) >= 3


def test_repeatable_and_world_size_costs_nothing() -> None:
    a = _fsdp_trace(D.World((("dp", 8),)))
    b = _fsdp_trace(D.World((("dp", 8),)))
    cols = ("action", "size", "stream", "category")
    assert all(list(getattr(a.rec.log, c)) == list(getattr(b.rec.log, c)) for c in cols)
    big = _fsdp_trace(D.World((("dp", 1024),), rank=0), d=1024)
    small = _fsdp_trace(D.World((("dp", 8),), rank=0), d=1024)
    # the same step: the same allocations (FSDP's empty chunks for ranks past the last
    # row of a weight are 0-byte storages, which the allocator never sees)
    assert _sized(big) == _sized(small)
    assert _params_bytes(small) == 128 * _params_bytes(big)


def test_teardown_after_failure_and_refuses_nested_world() -> None:
    sess = TraceSession(DEFAULT_PROFILE)
    with pytest.raises(RuntimeError, match="boom"), D.rank_session(sess, D.World((("dp", 2),))):
        raise RuntimeError("boom")
    assert not dist.is_initialized()
    with D.fake_world(D.World((("dp", 2),))), pytest.raises(TraceError, match="another distributed trace"):
        with D.fake_world(D.World((("dp", 2),))):
            pass
    assert not dist.is_initialized()


def test_the_fake_world_does_not_make_cuda_available_through_device_count(monkeypatch: pytest.MonkeyPatch) -> None:
    # ``import deepspeed`` sets PYTORCH_NVML_BASED_CUDA_CHECK=1, and torch's is_available() then answers
    # ``device_count() > 0`` (on a CUDA build; a CPU build says no regardless): the fake world answers
    # device_count() with 1, is_available() must keep its answer
    monkeypatch.setenv("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
    before = torch.cuda.is_available()
    with D.fake_world(D.World((("dp", 2),))):
        assert torch.cuda.device_count() == 1
        assert torch.cuda.is_available() == before
    assert torch.cuda.is_available() == before


def test_functional_collective_output_is_recorded() -> None:
    import torch.distributed._functional_collectives as fc

    sess = TraceSession(DEFAULT_PROFILE)
    with D.rank_session(sess, D.World((("dp", 4), ("tp", 2)), rank=5)) as ctx:
        assert list(ctx.mesh.get_coordinate()) == [2, 1]
        x = torch.empty(16, 8, device="meta")
        y = fc.wait_tensor(fc.all_gather_tensor(x, 0, ctx.submesh("dp").get_group()))
        assert y.shape == (64, 8)
        log = sess.rec.log
        assert 64 * 8 * 4 in [log.size[k] for k in range(len(log)) if log.action[k] == Action.ALLOC]
    with pytest.raises(TraceError, match="no dimension"):
        ctx.submesh("pp")


def test_cuda_stream_api_restored() -> None:
    before = (torch.cuda.Stream, torch.cuda.current_stream, torch.cuda.stream, torch.UntypedStorage.resize_)
    _fsdp_trace(D.World((("dp", 2),)), iterations=1)
    after = (torch.cuda.Stream, torch.cuda.current_stream, torch.cuda.stream, torch.UntypedStorage.resize_)
    assert before == after and not hasattr(torch, "meta")


@given(rows=st.integers(1, 300), cols=st.integers(1, 3), n=st.integers(1, 70))
@settings(max_examples=60)
def test_lazy_chunks_match_fsdp_chunk_with_empty(rows: int, cols: int, n: int) -> None:
    common = pytest.importorskip("torch.distributed.fsdp._fully_shard._fsdp_common")
    t = torch.arange(rows * cols, dtype=torch.float32).reshape(rows, cols)
    want = common._chunk_with_empty(t, n, dim=0)
    got = D._lazy_chunk_with_empty(t, n, 0)
    assert len(got) == len(want) == n
    for i in (0, n - 1, n // 2, -1):
        assert got[i].shape == want[i].shape and torch.equal(got[i], want[i])
