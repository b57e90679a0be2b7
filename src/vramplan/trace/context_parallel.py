"""Context parallelism in a trace: PyTorch's own ring attention on a fake process group.

``torch.distributed.tensor.experimental.context_parallel(mesh, buffers=..., buffer_seq_dims=...)``
(torch/distributed/tensor/experimental/_context_parallel/_attention.py, torch 2.13) shards the
step's sequence-shaped inputs in place and replaces ``F.scaled_dot_product_attention`` by a
wrapper that turns query/key/value into sequence-sharded DTensors; DTensor then runs the
flash / memory-efficient attention ops of the trace's SDPA emulation through its ring
attention handlers: ``cp`` rounds of attention on the local query against each rank's
key/value shard, the shards passed around the ring with functional collectives, the partial
outputs merged in fp32. Every buffer of that is an op on the local shards, recorded as any.

As in torchtitan (``torchtitan/train.py``: inputs, labels and the rotary table are the
buffers, inputs and labels not restored), the batch's ``input_ids``, ``labels`` and explicit
``position_ids`` are the buffers. transformers reads positions from ``position_ids``; the
load-balanced ("zig-zag") sharding would hand rank 0 two non-adjacent chunks, which
transformers takes for packed sequences and answers with a mask that ring attention does not
support, so the trace shards contiguously (``_cp_options.enable_load_balance = False`` while
``context_parallel`` shards them): the buffers of each round are the same size either way. The
ring then runs with ``enable_load_balance`` on, torch's default, which torchtitan 0.3.0 leaves as
it is (its head-tail sharding, ``distributed/context_parallel/api.py`` L114–L165): every rank
attends in every round (contiguous shards without it would skip rank 0's later rounds: the
lightest rank, which is the one traced).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from ..errors import TraceError

BUFFER_KEYS = ("input_ids", "labels", "position_ids")


def heaviest_rank(cp: int, training: bool) -> int:
    """The context-parallel rank whose ring peaks highest, the one a pipeline trace runs.

    Under load balancing every rank holds two chunks of the sequence, and round ``i > 0`` of
    torch's ring runs the whole local query against the first chunk of the key/value it received
    where ``i <= rank``, and only the second half of the query against the whole key/value where
    ``i > rank`` (torch 2.13 ``distributed/tensor/experimental/_context_parallel/_attention.py``
    ``_templated_ring_attention`` L450–L470; the backward alike, L541–L560). A forward-only step
    (``training`` False) peaks in a whole-query round, whose output and fp32 merge are twice a
    half-query round's: rank 0 runs none, the last rank only those (real gloo runs, pp 2 × cp 2:
    cp rank 1 peaks 34,816 B above cp rank 0; tests/test_pipeline_gloo.py; traced for cp 4, ranks 1–3
    peak alike, above rank 0). Training peaks in the backward, where rank 0 is the highest (the same
    real runs; real gloo runs without pp, a tiny Llama at 64 tokens per rank: cp 2, rank 0 25,088 B
    above rank 1; cp 4, rank 0 8,192 / 8,704 / 25,088 B above ranks 1 / 2 / 3, each rank's trace
    agreeing with it; tests/test_context_parallel_gloo.py)."""
    return 0 if training else cp - 1


@contextlib.contextmanager
def ring_attention(mesh: Any, batch_kwargs: dict[str, Any]) -> Iterator[None]:
    """Enter ``context_parallel`` over ``mesh`` with the batch's sequence tensors as buffers."""
    try:
        from torch.distributed.tensor.experimental import _attention as cp_impl
        from torch.distributed.tensor.experimental import context_parallel
    except ImportError as e:  # pragma: no cover - torch without the experimental API
        raise TraceError(f"torch {torch.__version__} has no context_parallel", hint="use `method=analytic`") from e
    buffers = [batch_kwargs[k] for k in BUFFER_KEYS if isinstance(batch_kwargs.get(k), torch.Tensor)]
    if not buffers:
        raise TraceError("context parallelism shards token inputs (input_ids); this model takes none",
                         hint="use `method=analytic`")
    options = cp_impl._cp_options
    balance = options.enable_load_balance
    options.enable_load_balance = False
    try:
        with context_parallel(mesh, buffers=buffers, buffer_seq_dims=[1] * len(buffers),
                              no_restore_buffers=set(buffers)):
            # the rounds torchtitan's ring runs (load-balanced: every rank attends in every round)
            options.enable_load_balance = True
            yield
    finally:
        options.enable_load_balance = balance


def check_kernel(profile: Any, dtype: torch.dtype, heads: int, head_dim: int, seq: int, cp: int) -> None:
    """Refuse a load-balanced ring whose attention kernel cannot merge its rounds.

    With the load balancer on (torchtitan's default, and the trace's), each rank's shard is two
    chunks of ``seq / (2·cp)`` tokens, and some rounds attend one chunk's queries. The
    memory-efficient kernel (fp32, or a head size flash attention does not take) returns its
    logsumexp padded to a multiple of 32 queries (torch 2.13 ``_meta_registrations.py``
    ``meta__scaled_dot_product_efficient_attention``, as the CUDA kernel allocates it), and the
    ring's merge of a round's partial result (``_context_parallel/_attention.py``
    ``_SDPAMerger.step``) does not slice that padding off: a chunk not a multiple of 32 fails,
    on a GPU as in the trace ("The size of tensor a (32) must match the size of tensor b (16)"
    at seq 64 over cp 2, docs/research/pipeline-fsdp.md)."""
    from .sdpa import choose_backend

    chunk = seq // (2 * cp)
    if chunk % 32 == 0 or chunk == 0:
        return
    q = torch.empty(1, heads, chunk, head_dim, dtype=dtype, device="meta")
    if choose_backend(profile, q, q, q, None, 0.0, True, False, True) != "efficient":
        return
    step = 64 * cp
    raise TraceError(f"PyTorch's load-balanced ring attention runs the memory-efficient kernel here "
                     f"({str(dtype).removeprefix('torch.')}, head size {head_dim}), whose logsumexp is padded to a "
                     f"multiple of 32 queries, which the ring's merge does not slice: each rank's chunks of "
                     f"`seq` / (2 × `cp`) = {chunk:,} tokens fail, on a GPU too",
                     hint=f"use a `seq` that is a multiple of {step:,} (e.g. {-(-seq // step) * step:,}), or half "
                          "precision (flash attention)")


def check_model(attention: str, window: int | None, seq: int) -> None:
    """Refuse what PyTorch's ring attention cannot run, rather than trace something else.

    ``context_parallel`` replaces ``F.scaled_dot_product_attention`` only: a model running
    eager (or another) attention would attend to its own sequence shard and never enter the
    ring. The ring's handlers take no attention mask (torch 2.13 ``_context_parallel/
    _attention.py``: the flash path has none, the memory-efficient one raises "attn_bias is
    not supported yet"): causal attention only, so a sliding window shorter than the sequence
    (which transformers expresses as a mask) is not run either."""
    if attention != "sdpa":
        raise TraceError(f"context parallelism runs PyTorch's ring attention in place of SDPA; this model runs "
                         f"'{attention}' attention, which would attend within each rank's shard only",
                         hint="use `method=analytic` for this model's context parallelism")
    if window and seq > window:
        raise TraceError(f"PyTorch's ring attention (context_parallel) is causal without a mask; a sliding window of "
                         f"{window:,} tokens over {seq:,} needs one (its memory-efficient path raises "
                         "'attn_bias is not supported yet')",
                         hint=f"use `method=analytic`, or `seq` of {window:,} or less")


@contextlib.contextmanager
def ring_dispatcher(mesh: Any) -> Iterator[None]:
    """Ring attention over ``mesh`` with no buffers to shard: the inputs are cp-local already.

    How torchtitan 0.3.0 runs context parallelism under pipeline parallelism: each micro-batch's
    inputs, labels and positions are sharded along the sequence before the schedule's step
    (``trainer.py`` ``post_dataloading_process`` L750–L759, called per micro-batch L838–L846;
    ``distributed/context_parallel/api.py`` ``prepare_context_parallel_input`` L114–L165), and
    each block's attention turns query/key/value into sequence-sharded DTensors on the ``cp``
    mesh under torch's context-parallel dispatcher (``apply_cp_to_forward`` L36–L111, applied
    to each model part by ``parallelize_llama`` before TP, ``models/llama3/parallelize.py``
    L46–L51). The stages then hand on cp-local hidden states. Here torch's own dispatcher
    (``_enable_context_parallel_dispatcher_impl``, the one ``context_parallel`` enters, SDPA
    replaced by its DTensor wrapper) is entered around the step with torch's ring options as
    torchtitan leaves them: ``enable_load_balance`` True (its head-tail sharding), every
    context-parallel rank running the same rounds on chunks of the same size."""
    try:
        from torch.distributed.tensor.experimental._context_parallel import _attention as impl
    except ImportError as e:  # pragma: no cover - torch without the experimental API
        raise TraceError(f"torch {torch.__version__} has no context-parallel dispatcher",
                         hint="use `method=analytic`") from e
    options = impl._cp_options
    balance = options.enable_load_balance
    options.enable_load_balance = True
    impl._dispatch_mode = impl._DispatchMode.MONKEY_PATCH
    impl._enable_context_parallel_dispatcher_impl(seq_dim=2, mesh=mesh)
    try:
        yield
    finally:
        impl._disable_context_parallel_dispatcher_impl()
        options.enable_load_balance = balance
