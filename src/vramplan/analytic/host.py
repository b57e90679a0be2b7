"""Host RAM of one rank under FSDP2's ``CPUOffloadPolicy(pin_memory=True)`` (``offload_params``
with the FSDP engine), in the parts the trace reports (:mod:`vramplan.trace.host`):

- **parameters (pinned)**: each parameter's padded dim-0 shard (``ceil(rows / shards)`` rows on
  rank 0, torch 2.13 ``_fsdp_param.py`` ``_init_sharded_param``) in its own dtype, pinned: PyTorch's
  ``CachingHostAllocator`` rounds every request up to a power of two
  (``aten/src/ATen/core/CachingHostAllocator.h``);
- **gradients (pinned)**: each trainable parameter's gradient shard, copied to the host with a
  non-blocking copy (pinned, power-of-two blocks; ``_fsdp_collectives.py`` ``foreach_reduce``),
  in the parameter's dtype;
- **optimizer states**: the sharded states, ordinary host memory (the step runs on the CPU);
- **optimizer step temporaries**: what the step allocates while it runs (foreach Adam's
  ``exp_avg_sq_sqrt`` list, as on the GPU).

The tensors of a layer are its linears (a stack of ``count`` matrices counts ``count`` tensors),
its LoRA adapters, and its vector parameters taken as ``hidden``-sized vectors (norm weights;
a remainder — biases of other sizes — as one vector): exact for Llama-style models, where the
vectors are the norms.
"""

from __future__ import annotations

from vramplan.results import HOST_GRADIENTS, HOST_PARAMETERS, HOST_STATES, HOST_STEP
from vramplan.workload import Workload

from .arch import Arch
from .blocks import head_linear
from .parallel import Stage, local, local_adapters, local_small
from .regime import Regime, Trainable
from .states import States

PARAMETERS, GRADIENTS, STATES, STEP = HOST_PARAMETERS, HOST_GRADIENTS, HOST_STATES, HOST_STEP


def pinned_bytes(n: int) -> int:
    """Bytes the CachingHostAllocator reserves for a request of ``n`` (next power of two)."""
    return 1 << (n - 1).bit_length() if n > 1 else n


def _tensors(arch: Arch, stage: Stage, w: Workload, rg: Regime, tr: Trainable) -> list[tuple[int, int, int, bool]]:
    """(rows, columns, bytes per element, trainable) of every parameter tensor on this stage's rank."""
    h = arch.hidden
    out: list[tuple[int, int, int, bool]] = []

    def vectors(total: int, size: int, trains: bool) -> None:
        if total <= 0:
            return
        k, rest = divmod(total, size) if size > 0 else (0, total)
        out.extend([(size, 1, rg.weight, trains)] * k)
        if rest:
            out.append((rest, 1, rg.weight, trains))

    for g, n in stage.groups:
        for lin in g.linears:
            rows = local(lin, w) // max(1, lin.count) // max(1, lin.d_in)
            out.extend([(rows, lin.d_in, rg.weight, tr.full)] * (lin.count * n))
            if tr.lora_on(lin):
                a, b = local_adapters(lin, tr.rank, w)
                out.extend([(tr.rank, a // tr.rank, rg.adapter, True), (b // tr.rank, tr.rank, rg.adapter, True)]
                           * (lin.count * n))
        for _ in range(n):
            vectors(local_small(g, w), h, tr.full)
    if stage.embed:
        vocab_rows = arch.vocab // w.parallel.tp
        out.append((vocab_rows, h, rg.weight, tr.full))
        vectors(arch.embed_params // w.parallel.tp - vocab_rows * h, h, tr.full)
    if stage.head:
        mats = list(arch.head.linears)
        if arch.head.tied and not stage.embed:
            mats.append(head_linear(arch.head, h))
        for lin in mats:
            out.append((local(lin, w) // max(1, lin.d_in), lin.d_in, rg.weight, tr.full))
        vectors(arch.head.small_params + arch.final_norm_params, h, tr.full)
    if stage.index == 0:
        vectors(arch.extra_params, arch.extra_params, tr.full)
    return out


def fsdp_offload_parts(arch: Arch, stage: Stage, w: Workload, rg: Regime, tr: Trainable,
                       st: States) -> tuple[tuple[str, int], ...]:
    """(part, bytes) of rank 0's host RAM under FSDP2 CPU offload (see the module docstring)."""
    shards = w.parallel.shard_group
    params = grads = 0
    for rows, cols, elem, trains in _tensors(arch, stage, w, rg, tr):
        n = -(-rows // shards) * cols * elem  # rank 0's (padded) dim-0 chunk
        params += pinned_bytes(n)
        if trains and w.training:
            grads += pinned_bytes(n)
    parts = [(PARAMETERS, params), (GRADIENTS, grads), (STATES, st.host_optimizer), (STEP, st.host_step)]
    return tuple((name, b) for name, b in parts if b)
