"""The TorchDispatchMode that records every op's memory on ``meta`` tensors.

Per op (below autograd, so backward ops and autograd's own buffers are seen too):

1. phase and module: forward phase/module come from the step runner and module hooks; in
   backward an op run by an autograd node with grad mode on is a checkpoint *recompute*,
   otherwise backward, and its module is found from the running node (:mod:`.modules`);
2. values: data-dependent ops get exact answers from shadows or the documented rules
   (:mod:`.datadep`); ``.item()`` without a value raises :class:`TraceError`;
3. the op runs on meta; new output storages become ALLOC events;
4. CUDA emulation: the cuBLAS workspace on the first GEMM per (thread, stream), a cuDNN
   workspace around each convolution, flash-attention backward's internal buffers.
"""

from __future__ import annotations

import math
import weakref
from collections import Counter
from typing import TYPE_CHECKING, Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass_type

from ..emulate.tensors import RAW, on_meta, raw_device
from ..errors import TraceError
from ..events import Category
from ..results import HOST_STEP
from ..workload import Phase
from . import rnn
from .cuda import DeviceProfile, conv_workspace_bytes
from .datadep import (
    NO_VALUE_OPS,
    SKIP_OPS,
    cuda_unique,
    known_masks,
    needs_rule,
    rule_values,
    symmetric_all_to_all,
    uniform_counts,
)
from .flex import register_rules as register_flex_rules
from .metacache import MetaCache
from .modules import ModuleTracker
from .recorder import PHASE_INDEX, Recorder, describe
from .values import SHADOW_LIMIT, Values, to_cpu_args
from .where import user_frame

if TYPE_CHECKING:
    from .experts import ExpertLoops

aten = torch.ops.aten

BLAS_OPS = frozenset(
    getattr(aten, n).default for n in (
        "mm", "addmm", "bmm", "baddbmm", "addbmm", "addmv", "mv", "dot", "vdot", "addr",
        "_addmm_activation", "_scaled_mm", "_int_mm", "_grouped_mm", "_scaled_grouped_mm",
        # composite ops that reach the mode themselves under inference_mode
        "linear", "matmul", "bilinear", "tensordot", "chain_matmul",
    ) if hasattr(aten, n)
) | {aten.einsum.default}
_COMPOSITE_GEMM = frozenset({aten.linear.default, aten.matmul.default})
CONV_OPS = frozenset({
    aten.convolution.default, aten.convolution_backward.default, aten._convolution.default,
    aten._convolution.deprecated, aten.conv1d.default, aten.conv2d.default, aten.conv3d.default,
    aten.conv1d.padding, aten.conv2d.padding, aten.conv3d.padding, aten.conv_transpose1d.default,
    aten.conv_transpose2d.input, aten.conv_transpose3d.input,
})
FLASH_BWD = aten._scaled_dot_product_flash_attention_backward.default
FUSED_BWD = frozenset(
    getattr(aten, n).default for n in (
        "_scaled_dot_product_efficient_attention_backward", "_scaled_dot_product_cudnn_attention_backward",
    ) if hasattr(aten, n)
)
INDEX_BOUND_OPS: dict[Any, tuple[int, int, int | None]] = {
    aten.topk.default: (1, 2, -1), aten.sort.default: (1, 1, -1), aten.sort.stable: (1, 99, -1),
    aten.max.dim: (1, 1, -1), aten.min.dim: (1, 1, -1), aten.argmax.default: (0, 1, None),
    aten.argmin.default: (0, 1, None), aten.argsort.default: (0, 1, -1), aten.argsort.stable: (0, 99, -1),
    aten.multinomial.default: (0, 99, -1),
}
"""Ops whose output holds indices into a dimension: (output position, dim argument
position, default dim; None = all elements)."""
_INT_ARITH = frozenset({aten.mul.Tensor, aten.mul.Scalar, aten.add.Tensor, aten.add.Scalar})
"""Integer arithmetic that keeps sampled indices below a bound (:meth:`DispatchMode._arith_bound`)."""
HINT_COPY_OPS = frozenset({
    aten._to_copy.default, aten.clone.default, aten.index.Tensor, aten.index_select.default,
    aten.gather.default, aten._unsafe_view.default, aten.view.default, aten.reshape.default, aten.squeeze.dim,
    aten.to.dtype, aten.to.dtype_layout,  # (aten.to reaches the mode under inference mode)
})
"""Ops that carry their first input's density/bound hint to their output."""
EMPTY_OPS = frozenset({
    aten.empty.memory_format, aten.empty_strided.default, aten.empty_like.default,
    aten.new_empty.default, aten.new_empty_strided.default, aten.empty_permuted.default,
})
NO_META_KERNEL_INPLACE = frozenset(
    getattr(aten, n).default for n in ("_fused_sgd_", "_fused_adagrad_") if hasattr(aten, n)
)
"""Fused optimizer kernels without a meta kernel: in-place, they allocate nothing."""
WRAP_OP = "_c10d_functional._wrap_tensor_autograd.default"
"""Functional collectives' wrapping of their output (torch >= 2.13: ``all_reduce`` & co. end in
``_maybe_wrap_tensor`` → this custom op, which returns ``AsyncCollectiveTensor(input)``: a
wrapper subclass without memory of its own, holding the collective's output). Its meta kernel is
``empty_like(input)``, a second buffer while the output is still live; the trace runs it as
``aten.alias`` instead (the output's storage, alive as long as the wrapper)."""
TO_OPS = frozenset({aten._to_copy.default, aten.to.dtype_layout, aten.to.device, aten.to.other})
"""Copies that may leave the device (``.cpu()``: values needed); ``aten.to`` reaches the mode
itself under inference mode."""
EQ_OPS = frozenset({aten.eq.Scalar, aten.eq.Tensor})
ROUTING_OPS = EQ_OPS | frozenset({aten.sum.default, aten.sum.dim_IntList, aten.count_nonzero.default,
                                  aten.count_nonzero.dim_IntList, aten.any.default, aten.histc.default})
"""Ops that the routing rule gives densities or counts (:meth:`TraceMode._routing`)."""
ALL_TO_ALL = torch.ops._c10d_functional.all_to_all_single.default if hasattr(torch.ops, "_c10d_functional") \
    and hasattr(torch.ops._c10d_functional, "all_to_all_single") else None
"""The functional all-to-all (torchtitan's token-count and token exchange): values of known
inputs by :func:`~vramplan.trace.datadep.symmetric_all_to_all`."""
ZEROS_LIKE = frozenset({aten.zeros_like.default, aten.new_zeros.default})
"""Zeros shaped like a tensor without values: boolean ones (masks to fill) get their values."""
SCATTER_OPS = frozenset({aten.scatter_.value, aten.scatter.value})
"""``zeros(…, E).scatter_(-1, topk_ids, True)``: a routing map (:meth:`TraceMode._routing_map`)."""
HOST_ARGS: dict[Any, tuple[int, ...]] = {
    getattr(aten, n).default: pos for n, pos in (
        ("_pack_padded_sequence", (1,)), ("_pad_packed_sequence", (1,)), ("_pack_padded_sequence_backward", (2,)),
    ) if hasattr(aten, n)
}
"""Ops whose tensor arguments at these positions live on the host in a CUDA run (PyTorch
checks "should be a 1D CPU int64 tensor"): they get real CPU tensors in the trace too."""
SCALAR_READS = frozenset({aten._local_scalar_dense.default, aten.item.default})
ISIN_OPS = frozenset(getattr(aten.isin, n) for n in ("Tensor_Tensor", "Tensor_Scalar", "Scalar_Tensor")
                     if hasattr(aten.isin, n))
"""A device value read back to the host (``.item()`` reaches the mode itself under inference mode)."""
COPY_OPS = frozenset({aten.copy_.default})
"""Copies between the host and the device (``load_state_dict`` into a model on the other side)."""
CROSS_DEVICE_OPS = frozenset(
    getattr(aten, n).default for n in ("index_put", "index_put_", "_index_put_impl_") if hasattr(aten, n)
) | frozenset({aten.index.Tensor})
"""Ops CUDA runs with host tensor arguments (indices are copied to the device for the call)."""
_RANDOM = torch.Tag.nondeterministic_seeded
_BACKWARD = PHASE_INDEX[Phase.BACKWARD]
_RECOMPUTE = PHASE_INDEX[Phase.RECOMPUTE]
_OPTIMIZER = PHASE_INDEX[Phase.OPTIMIZER]
_current_node = torch._C._current_autograd_node
_META_DEVICE = torch.device("meta")
_REDISPATCHING: dict[type, bool] = {torch.Tensor: False, torch.nn.Parameter: False}


def _redispatching(t: type) -> bool:
    """Whether ``t`` is a wrapper subclass that unwraps to its inner tensors and runs the op on
    them (DTensor, torchao's float8 training tensors, functional collectives'
    ``AsyncCollectiveTensor``: every traceable wrapper subclass, ``__tensor_flatten__``): handed
    the op, its ops on the inner tensors come back to the mode and are recorded (the memory the
    GPU allocates: a cast, a ``.contiguous()`` copy inside torchao's fp8 matmul); the wrapper's own
    storage holds none (:func:`.recorder.inner_tensors`). Other subclasses (FakeTensor, used by
    DTensor's sharding propagation) are handled as before."""
    hit = _REDISPATCHING.get(t)
    if hit is None:
        hit = _REDISPATCHING[t] = is_traceable_wrapper_subclass_type(t)
    return hit


_FAKE: dict[type, bool] = {torch.nn.Parameter: False}
_FAKE_KEY = getattr(getattr(torch._C, "_TorchDispatchModeKey", None), "FAKE", None)


def _fake(t: type) -> bool:
    hit = _FAKE.get(t)
    if hit is None:
        hit = _FAKE[t] = any(c.__name__ == "FakeTensor" and c.__module__ == "torch._subclasses.fake_tensor"
                             for c in t.__mro__)
    return hit


def _flash_bwd_buffers(args: tuple[Any, ...]) -> list[tuple[int, str]]:
    """flash-attn 2 ``mha_bwd`` internals: softmax_d, dq_accum (fp32), and for GQA the
    expanded dk/dv (q dtype) that are summed into dk/dv afterwards."""
    q, k = args[1], args[2]
    b, h, tq, d = q.shape
    hk, tk = k.shape[1], k.shape[2]
    tq_r = -(-tq // 128) * 128
    d_r = -(-d // 32) * 32 if d <= 192 else 256
    out = [(4 * b * h * tq_r, f"f32[{b},{h},{tq_r}]"), (4 * b * tq_r * h * d_r, f"f32[{b},{tq_r},{h},{d_r}]")]
    if hk != h:
        e = q.element_size()
        out += [(e * b * tk * h * d, f"dk_expanded[{b},{tk},{h},{d}]"), (e * b * tk * h * d, f"dv_expanded[{b},{tk},{h},{d}]")]
    return out


def _fused_bwd_workspace(func: Any, args: tuple[Any, ...]) -> tuple[int, str] | None:
    """The fp32 dQ accumulator of the memory-efficient / cuDNN attention backward.

    Memory-efficient (PyTorch aten/src/ATen/native/transformers/cuda/attention_backward.cu:
    ``workspace = at::empty({p.workspace_size()}, Byte)`` through the caching allocator;
    mem_eff_attention/kernel_backward.h ``workspace_elements_gq``: one fp32 accumulator tile
    per query block and head-dim column block, only when the output dtype is not fp32 —
    ``B·H·⌈Tq⌉₆₄·⌈D⌉₆₄·4`` bytes here, the tile sizes of the sm80 kernels). cuDNN (PyTorch
    cudnn/MHA.cpp ``run_cudnn_SDP_bprop``: ``mha_graph->get_workspace_size()`` allocated
    through the caching allocator; its size is cuDNN's choice): the same fp32 dQ accumulator
    plus an fp32 softmax sum per query, an approximation of what cuDNN's backward graph asks."""
    q = args[1] if len(args) > 1 else None
    if not isinstance(q, torch.Tensor) or q.dim() != 4 or q.dtype not in (torch.float16, torch.bfloat16):
        return None
    b, h, tq, d = q.shape
    tq_r, d_r = -(-tq // 64) * 64, -(-d // 64) * 64
    if "cudnn" in str(func):
        return 4 * b * h * tq * d + 4 * b * h * tq, f"cudnn attention bwd workspace (~f32[{b},{h},{tq},{d}] + f32[{b},{h},{tq}])"
    return 4 * b * h * tq_r * d_r, f"mem-efficient attention bwd workspace f32[{b},{h},{tq_r},{d_r}]"


class TraceMode(TorchDispatchMode):
    """Records allocations of ``meta`` tensors into a :class:`Recorder`."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        """Read by ``TorchDispatchMode.__init_subclass__`` (torch ≥ 2.9): False leaves
        :meth:`__torch_dispatch__` unwrapped by ``torch._dynamo.disable``. Nothing is compiled
        while a trace runs (a session makes ``torch.compile`` the identity, :mod:`.session`),
        and the wrapper costs every op two eval-frame switches (~5 µs)."""
        return False

    def __init__(self, rec: Recorder, modules: ModuleTracker, values: Values, profile: DeviceProfile) -> None:
        super().__init__()
        self.rec = rec
        self.modules = modules
        self.values = values
        self.profile = profile
        self.in_backward = False
        """Set by the step runner around ``loss.backward()``."""
        self.count_flops = False
        self.flops = 0
        self.flops_skipped: Counter[str] = Counter()
        """Ops whose FLOPs torch's formula refused (an older ``torch.utils.flop_counter``)."""
        self.rules_used: Counter[str] = Counter()
        self.float_reads: float | None = None
        """A float read back to the host (``.item()``) outside the optimizer: None refuses (its
        value could steer what is allocated); a number answers every such read (``vramplan run``:
        scripts log losses and gradient norms)."""
        self._blas_seen: set[tuple[int, int]] = set()
        self._op_ids: dict[Any, int] = {}
        self._mutated: dict[Any, tuple[int, ...]] = {}
        self.cache = MetaCache()
        self._lifted: dict[int, tuple[weakref.ref[torch.Tensor], torch.Tensor]] = {}
        self.bool_reads: bool | None = None
        """A boolean read back to the host without a value: None refuses; False answers every
        such read (``vramplan run``: a generation loop's "every sequence hit a stop token?")."""
        self.strict_devices = False
        """A device tensor meeting a host tensor (not a 0-dim one) raises as CUDA does, except in
        the ops CUDA lets take host arguments (``vramplan run``); otherwise the host tensor is
        taken as the step's input on the device (``vramplan trace`` factories pass CPU inputs)."""
        self.host_reads: Counter[str] = Counter()
        """Copies into host tensors whose device source had no values (the host keeps its old ones)."""
        self.rnn_dropout_state = False
        """cuDNN's dropout state (:mod:`.rnn`) was allocated."""
        self.experts: ExpertLoops | None = None
        """MoE expert loops cut to a few experts (:mod:`.experts`, for :mod:`.replicate`)."""
        from torch.utils.flop_counter import flop_registry

        self._flop_registry = flop_registry

    # ------------------------------------------------------------------------------
    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None) -> Any:
        RAW.depth += 1  # kernels and meta functions below see storages' real devices
        try:
            return self._dispatch(func, types, args, kwargs)
        finally:
            RAW.depth -= 1

    def _dispatch(self, func: Any, types: Any, args: tuple[Any, ...], kwargs: dict[str, Any] | None) -> Any:
        for t in types:
            if t is not torch.Tensor and _redispatching(t):
                # a tensor subclass (DTensor): it unwraps to plain tensors and redispatches,
                # and the mode records those (returning NotImplemented hands the op to it)
                return NotImplemented
            if t is not torch.Tensor and _fake(t):
                # DTensor's sharding propagation runs ops on FakeTensors: shapes only, no memory
                return func(*args, **(kwargs or {}))
        if _FAKE_KEY is not None and torch._C._get_dispatch_mode(_FAKE_KEY) is not None:
            return func(*args, **(kwargs or {}))  # (the meta kernels a FakeTensorMode runs inside)
        kwargs = kwargs or {}
        dev = kwargs.get("device")
        to_device = False
        if dev is not None and getattr(dev, "type", None) == "cuda":
            # a CUDA factory call that reached dispatch without the function mode (which does
            # not follow autograd into its thread: FSDP2 all-gathers from backward hooks)
            kwargs = {**kwargs, "device": _META_DEVICE}
            to_device = True
        rec = self.rec
        host_mem = rec.host
        on_host = False
        if dev is not None and getattr(host_mem, "reported", False):  # FSDP1's CPUOffload (HostMemory.reporting)
            kind = torch.device(dev).type
            to_device = to_device or kind == "meta"  # ``empty_like(host_shard, device=<compute device>)``: the GPU's
            on_host = kind == "cpu" and host_mem.cpu_factories
            if on_host:  # FSDP1's own host tensors: pageable host memory, not a real CPU tensor
                kwargs = {**kwargs, "device": _META_DEVICE}
        if func.namespace == "_c10d_functional" and str(func) == WRAP_OP:
            func = aten.alias.default
        op = self._op_ids.get(func)
        if op is None:
            op = self._op_ids[func] = rec.intern(str(func))
        rec.op = op
        if self.in_backward:
            if torch.is_grad_enabled() and _current_node() is not None:
                rec.phase = _RECOMPUTE
                rec.module = self.modules.current
            else:
                rec.phase = _BACKWARD
                rec.module = self.modules.backward_owner()
        else:
            rec.module = self.modules.current

        if func in SKIP_OPS:
            return None
        if func in NO_META_KERNEL_INPLACE:
            return None
        if func in rnn.OPS:
            return self._cudnn_rnn(func, args)
        host = HOST_ARGS.get(func)
        if host is not None:
            args = self._host_args(func, args, host)
        if _any_meta(args) and _any_host(args):
            if func in COPY_OPS:
                return self._copy_across(args)
            place = host_mem.target(args) if host_mem is not None else None
            if place is not None:
                args = self._lift_to(place, args, host or ())  # host tensors meeting host tensors: no GPU memory
            elif self.strict_devices and func not in CROSS_DEVICE_OPS:
                raise RuntimeError(_device_mismatch(func, args))
            else:
                args = self._lift(args, host or (), cache=not self.strict_devices)
        values = self.values
        cpu_args: Any = None
        if values.shadow or not _any_meta(args):
            cpu_args = self._shadow_args(func, args, kwargs)

        if func in TO_OPS and host_mem is not None and host_mem.host_copies and _to_host(args, kwargs) \
                and (cpu_args is None or not host_mem.counted):
            # FSDP2 CPU offload: a gradient shard to pinned memory; ``vramplan run``: ``.cpu()``,
            # a host tensor (with the values, where the trace has them)
            out = host_mem.to_host(func, args, kwargs)
            if cpu_args is not None:
                _attach(values, out, func(*cpu_args[0], **cpu_args[1]))
            elif isinstance(out, torch.Tensor) and isinstance(args[0], torch.Tensor):
                _copy_hints(values, args[0], out)  # (sampled token ids read back on the host)
            return out
        if func in NO_VALUE_OPS or (func in TO_OPS and _to_host(args, kwargs)):
            return self._value_op(func, args, kwargs, cpu_args)

        rule = needs_rule(func, args, kwargs)
        if rule is not None and self.experts is not None and self.experts.in_loop:
            self.experts.rule(rule[0], exact=cpu_args is not None)
        cpu_out: Any = None
        if rule is not None and cpu_args is not None:
            cpu_out = func(*cpu_args[0], **cpu_args[1])
            if rule[0] == "unique" and not func.__name__.startswith("unique_dim"):
                out = cuda_unique(func, args, kwargs, int(cpu_out[0].numel()))  # (CUDA's storages)
            else:
                out = _mirror(cpu_out)
        elif rule is not None:
            if not known_masks(values, rule[0], args):  # (known masks over model data: exact counts)
                self.rules_used[rule[0]] += 1
            out = rule[1](values, func, args, kwargs)
            cpu_out = rule_values(rule[0], values, args, kwargs, out)
        else:
            key = self.cache.key(func, args, kwargs)
            hit, out = self.cache.get(key, args) if key is not None else (False, None)
            if not hit:
                try:
                    out = func(*args, **kwargs)
                except NotImplementedError as e:
                    raise self._no_kernel(func, e) from None
                if key is not None:
                    self.cache.put(key, args, out)
            if cpu_args is not None and _meta_and_small(out):
                if func is ALL_TO_ALL:  # (a fake process group's output holds no values)
                    cpu_out = symmetric_all_to_all(*cpu_args[0], **cpu_args[1])
                    if cpu_out is not None:
                        self.rules_used["symmetric_exchange"] += 1
                else:
                    cpu_out = func(*cpu_args[0], **cpu_args[1])

        if on_host:
            host_mem.adopt(out, part=HOST_STEP, pinned=False)
        elif host_mem is not None and not to_device:
            place = host_mem.target(args)
            if place is not None:
                place.adopt(out)  # on the host in the real run (FSDP2 CPU offload): not GPU memory
        self._track(out)
        if func in EMPTY_OPS and isinstance(out, torch.Tensor) and _index_like(out):
            # uninitialised index memory: a correct program reads only what it then writes
            # (invert_permutation's empty_like + scatter_), so zeros are as good as any value
            cpu_out = torch.zeros(out.shape, dtype=out.dtype)
        if cpu_out is None and func in ZEROS_LIKE and isinstance(out, torch.Tensor) and out.dtype == torch.bool \
                and on_meta(out) and out.numel() <= SHADOW_LIMIT:
            cpu_out = torch.zeros(tuple(out.shape), dtype=torch.bool)  # (a mask to fill: its values are known)
        hot = self._routing_map(func, args) if cpu_out is None and func in SCATTER_OPS else None
        if cpu_out is not None:
            _attach(values, out, cpu_out)
        elif values.shadow:
            self._drop_mutated(func, args)
        if hot is not None and isinstance(out, torch.Tensor):
            self.rules_used["routing_map"] += 1
            values.set_hot(out, *hot)
            values.set_density(out, min(1.0, hot[1] * values.class_share(out.shape[hot[0]])))
        if cpu_out is None and isinstance(out, torch.Tensor) and func in ROUTING_OPS:
            self._routing(func, args, out)
        if cpu_out is None and func in ISIN_OPS and self.bool_reads is False and isinstance(out, torch.Tensor) \
                and out.numel() <= SHADOW_LIMIT:
            # `isin(sampled tokens, stop tokens)` without values: no stop token is generated, so a
            # generation loop runs to its length limit (the worst case for memory)
            values.set_shadow(out, torch.zeros(tuple(out.shape), dtype=torch.bool))
            self.rules_used["host_bool"] += 1
        if func in INDEX_BOUND_OPS:
            self._set_bound(func, args, kwargs, out)
        elif func is aten.cat.default and cpu_out is None and isinstance(out, torch.Tensor):
            self._cat_bound(args[0] if args else kwargs.get("tensors", ()), out)
        elif func in (aten.randint.default, aten.randint.low) and isinstance(out, torch.Tensor):
            high = args[0] if func is aten.randint.default else args[1] if len(args) > 1 else None
            low = 0 if func is aten.randint.default else args[0]
            if isinstance(high, int) and isinstance(low, int) and 0 <= low < high:
                values.set_bound(out, high)  # random token ids: indices below `high`
        elif func in _INT_ARITH and cpu_out is None and isinstance(out, torch.Tensor) and len(args) >= 2:
            self._arith_bound(func, args[0], args[1], out)
        elif rule is not None and rule[0] == "nms" and isinstance(out, torch.Tensor):
            values.set_bound(out, int(args[0].shape[0]))
        elif func in HINT_COPY_OPS and isinstance(out, torch.Tensor) and isinstance(args[0], torch.Tensor):
            _copy_hints(values, args[0], out)

        if func in BLAS_OPS:
            self._blas_workspace(args)
        elif func is aten.multinomial.default and isinstance(args[0], torch.Tensor) and on_meta(args[0]) \
                and (len(args) < 3 or not args[2] or args[1] == 1):
            # ATen's multinomial (native/Distributions.cpp, the fast path for one sample or no
            # replacement): ``q = at::empty_like(self).exponential_(1); div_out(q, self, q)``, then
            # argmax/topk of q: one temporary the size of the probabilities
            x = args[0]
            eid = self.rec.synthetic_alloc(x.numel() * x.element_size(), Category.TEMPORARY,
                                           describe(x),
                                           op="multinomial.exponential_")
            self.rec.synthetic_free(eid, Category.TEMPORARY, op="multinomial.exponential_")
        elif func in CONV_OPS and self.profile.cudnn_conv_workspace:
            self._conv_workspace(func, args, out)
        elif func is FLASH_BWD:
            self._flash_bwd(args)
        elif func in FUSED_BWD and self.profile.cublas_workspace:
            ws = _fused_bwd_workspace(func, args)
            if ws is not None:
                eid = self.rec.synthetic_alloc(ws[0], Category.WORKSPACE, ws[1], op="sdpa.bwd_workspace")
                self.rec.synthetic_free(eid, Category.WORKSPACE, op="sdpa.bwd_workspace")
        if self.count_flops:
            self._count_flops(func, args, kwargs, out)
        return out

    def _count_flops(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> None:
        fn = self._flop_registry.get(func._overloadpacket)
        if fn is not None:
            # FLOPs are a by-product: a formula that rejects the shapes must not fail the
            # memory trace (torch 2.11's sdpa_flop_count asserts equal query and key/value
            # heads, so grouped-query attention raised there; 2.13 counts it).
            try:
                self.flops += int(fn(*args, **kwargs, out_val=out))
            except Exception:
                self.flops_skipped[str(func)] += 1
        elif func in _COMPOSITE_GEMM and isinstance(out, torch.Tensor):
            # linear/matmul reach the mode undecomposed under inference_mode: 2·out·K
            self.flops += 2 * out.numel() * int(args[0].shape[-1])

    def _host_args(self, func: Any, args: tuple[Any, ...], host: tuple[int, ...]) -> tuple[Any, ...]:
        """Arguments that CUDA kernels read on the host (``pack_padded_sequence``'s lengths, a
        packed sequence's batch sizes) stay real CPU tensors: a fake one is replaced by its
        known values, or the trace stops and says what to pass."""
        out = list(args)
        for i in host:
            a = out[i] if i < len(out) else None
            if isinstance(a, torch.Tensor) and on_meta(a):
                v = self.values.cpu_view(a)
                if v is None:
                    raise TraceError(
                        f"{func} at {user_frame()} needs its argument '{func._schema.arguments[i].name}' on the "
                        "host with real values, and this one was computed from model data on the GPU",
                        hint="pass sequence lengths as a Python list or a CPU tensor built from the inputs, "
                             "not from activations",
                    )
                out[i] = v.clone()
        return tuple(out)

    def _cudnn_rnn(self, func: Any, args: tuple[Any, ...]) -> Any:
        """cuDNN's RNN forward/backward (:mod:`.rnn`): outputs, reserve, transient buffers."""
        rec = self.rec
        if func is rnn.FORWARD:
            out, transient = rnn.forward(args)
            for t in out[:4]:
                rec.track(t)
            self._transient(transient)
            return out
        out, data_pass, weight_pass = rnn.backward(args)
        fills = [rec.synthetic_alloc(n, Category.TEMPORARY, d, op="cudnn.rnn") for n, d in data_pass if d.startswith("zero")]
        for t in out[:3]:
            if isinstance(t, torch.Tensor):
                rec.track(t)
        self._transient([x for x in data_pass if not x[1].startswith("zero")])
        rec.track_many(out[3])
        self._transient(weight_pass)
        for eid in fills:
            rec.synthetic_free(eid, Category.TEMPORARY, op="cudnn.rnn")
        return out

    def _transient(self, bufs: list[tuple[int, str]]) -> None:
        ids = [self.rec.synthetic_alloc(n, Category.WORKSPACE, d, op="cudnn.rnn") for n, d in bufs if n > 0]
        for eid in ids:
            self.rec.synthetic_free(eid, Category.WORKSPACE, op="cudnn.rnn")

    def _copy_across(self, args: tuple[Any, ...]) -> Any:
        """``dst.copy_(src)`` between the host and the device: no new device memory (the copy
        lands in ``dst``). Values follow the copy where they are known; a host tensor receiving
        device data the trace has no values for keeps its own (counted in :attr:`host_reads`)."""
        dst, src = args[0], args[1]
        values = self.values
        if on_meta(dst):  # host → device
            values.drop_shadow(dst)
            if isinstance(src, torch.Tensor) and dst.numel() * dst.element_size() == dst.untyped_storage().nbytes():
                values.set_shadow(dst, src.detach().expand(dst.shape).to(dst.dtype))
            return dst
        cpu = values.cpu_view(src) if isinstance(src, torch.Tensor) else None
        if cpu is not None:
            dst.copy_(cpu)
        else:
            self.host_reads["copy_"] += 1
        return dst

    def _lift_to(self, place: Any, args: tuple[Any, ...], keep: tuple[int, ...]) -> tuple[Any, ...]:
        """Real host tensors in an op on host tensors without values: meta copies with their
        values, in the same place (host memory, never the GPU's)."""
        out: list[Any] = []
        for i, a in enumerate(args):
            if i not in keep and isinstance(a, torch.Tensor) and not on_meta(a) and a.dim() > 0:
                m = torch.empty_strided(a.shape, a.stride(), dtype=a.dtype, device="meta")
                place.adopt(m)
                self.values.set_shadow(m, a.detach())
                out.append(m)
            elif isinstance(a, (list, tuple)) and _any_host(a):
                out.append(type(a)(self._lift_to(place, tuple(a), ())))
            else:
                out.append(a)
        return tuple(out)

    def _lift(self, args: tuple[Any, ...], keep: tuple[int, ...] = (), *, cache: bool = True) -> tuple[Any, ...]:
        """Host tensors met beside fake ones (a label tensor captured by the user's loss
        closure, say) would be on the GPU in the real run: replace them by fake copies that
        keep their values, recorded as inputs at first use (once per host tensor). Arguments
        at ``keep`` positions are host arguments of the op and stay."""
        out: list[Any] = []
        for i, a in enumerate(args):
            if i in keep:
                out.append(a)
            elif isinstance(a, torch.Tensor) and not on_meta(a) and a.dim() > 0:
                hit = self._lifted.get(id(a)) if cache else None
                if hit is not None and hit[0]() is a:
                    m = hit[1]
                else:  # (tensors compare elementwise, so key by identity, not by the tensor)
                    m = torch.empty_strided(a.shape, a.stride(), dtype=a.dtype, device="meta")
                    self.values.set_shadow(m, a.detach())
                    self.rec.track(m, int(Category.INPUT if cache else Category.TEMPORARY))
                    if cache:
                        self._lifted[id(a)] = (weakref.ref(a), m)
                out.append(m)
            elif isinstance(a, (list, tuple)) and _any_host(a):
                out.append(type(a)(self._lift(tuple(a))))
            else:
                out.append(a)
        return tuple(out)

    # --- tracking ------------------------------------------------------------------
    def _track(self, out: Any) -> None:
        rec = self.rec
        if isinstance(out, torch.Tensor):
            rec.track(out)
        elif isinstance(out, (tuple, list)):
            for t in out:
                if isinstance(t, torch.Tensor):
                    rec.track(t)
                elif isinstance(t, (tuple, list)):
                    rec.track_many(t)

    # --- values --------------------------------------------------------------------
    def _shadow_args(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """(cpu args, cpu kwargs) when every meta tensor argument has a shadow, else None."""
        if _RANDOM in func.tags or func in EMPTY_OPS:
            return None
        cargs, ok = to_cpu_args(self.values, args)
        if not ok:
            return None
        ckw, ok = to_cpu_args(self.values, kwargs)
        if not ok:
            return None
        if "device" in ckw and isinstance(ckw["device"], (str, torch.device)) and torch.device(ckw["device"]).type == "meta":
            ckw["device"] = torch.device("cpu")
        return cargs, ckw

    def _value_op(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], cpu_args: Any) -> Any:
        if not any(isinstance(a, torch.Tensor) and on_meta(a) for a in args):
            return func(*args, **kwargs)  # a host tensor: real values
        if cpu_args is not None:
            return func(*cpu_args[0], **cpu_args[1])
        if self.rec.phase == _OPTIMIZER and func in SCALAR_READS:
            # Optimizers read norms/steps (Adafactor, clipping): values scale the update, never memory.
            self.rules_used["optimizer_value"] += 1
            t = args[0]
            return True if t.dtype == torch.bool else (1.0 if t.is_floating_point() else 1)
        if self.float_reads is not None and func in SCALAR_READS and args[0].is_floating_point():
            self.rules_used["host_float"] += 1
            return self.float_reads
        if self.bool_reads is not None and func in SCALAR_READS and args[0].dtype == torch.bool:
            self.rules_used["host_bool"] += 1
            return self.bool_reads
        index = self.sampled_index(args[0])
        if index is not None and func in SCALAR_READS:
            return index
        what = "copying tensor values to the host (.cpu()/.tolist()/.numpy())" if func in TO_OPS \
            else "reading a tensor's value (.item(), bool(tensor), if tensor: ...)"
        raise TraceError(
            f"data-dependent control flow at {user_frame()} ({self._where()}): {what} needs values computed "
            "from model data, which a trace on fake tensors does not have",
            hint="make the branch depend on shapes or configuration; pass such values as inputs (a Python list "
                 "or a CPU tensor); per-expert token counts are known when they come from bincount / (idx == e)"
                 ".sum() of top-k indices (uniform routing, --routing-skew to change it)",
        )

    def _top(self, x: Any) -> int | None:
        """The largest value ``x`` may hold (an index bound's, known values', a Python int's), or
        None: unknown or negative."""
        if isinstance(x, bool):
            return int(x)
        if isinstance(x, int):
            return x if x >= 0 else None
        if not isinstance(x, torch.Tensor) or x.is_floating_point():
            return None
        b = self.values.get_bound(x)
        if b is not None:
            return b - 1
        known = self.values.cpu_view(x) if on_meta(x) else x
        if known is None:
            return None
        if not known.numel():
            return 0
        lo, hi = int(known.min()), int(known.max())
        return hi if lo >= 0 else None

    def _arith_bound(self, func: Any, a: Any, b: Any, out: torch.Tensor) -> None:
        """``next_tokens * unfinished + pad_token_id * (1 - unfinished)`` (transformers' generate):
        sampled indices times or plus known non-negative values stay below a bound."""
        if out.is_floating_point() or out.dtype == torch.bool:
            return
        if not any(isinstance(x, torch.Tensor) and self.values.get_bound(x) is not None for x in (a, b)):
            return
        ta, tb = self._top(a), self._top(b)
        if ta is None or tb is None:
            return
        top = ta * tb if func in (aten.mul.Tensor, aten.mul.Scalar) else ta + tb
        self.values.set_bound(out, top + 1)

    def _cat_bound(self, parts: Any, out: torch.Tensor) -> None:
        """Sampled indices joined to known ones (``torch.cat([prompt, next_token])``: a generation
        loop's growing sequence) stay indices below the largest bound (see :meth:`sampled_index`)."""
        if out.is_floating_point() or out.dtype == torch.bool or not isinstance(parts, (list, tuple)) \
                or not any(isinstance(t, torch.Tensor) and self.values.get_bound(t) is not None for t in parts):
            return
        tops = [self._top(t) if isinstance(t, torch.Tensor) else None for t in parts]
        if all(t is not None for t in tops):
            self.values.set_bound(out, max(t for t in tops if t is not None) + 1)

    def sampled_index(self, t: torch.Tensor) -> int | None:
        """The value a script reads from a sampled or selected index (``multinomial``, ``argmax``,
        ``topk`` indices) without values, under ``vramplan run``: the middle of its range (any
        index is as good for memory, and the middle is no special token at either end of a
        vocabulary); None elsewhere."""
        if self.bool_reads is None or t.is_floating_point() or t.dtype == torch.bool:
            return None
        bound = self.values.get_bound(t)
        if bound is None or bound < 1:
            return None
        self.rules_used["sampled_index"] += 1
        return bound // 2

    def _routing(self, func: Any, args: tuple[Any, ...], out: torch.Tensor) -> None:
        """The routing rule (:mod:`.datadep`) for masks and counts without values:
        ``idx == e`` over indices below ``n`` selects ``share(n)`` of the elements, and a
        full or partial count of such a mask is ``share·(elements counted)``."""
        values = self.values
        x = args[0]
        if not isinstance(x, torch.Tensor) or not on_meta(x):
            return
        if func in EQ_OPS:
            bound = values.get_bound(x)
            if bound is not None and out.dtype == torch.bool:
                self.rules_used["eq_mask"] += 1
                values.set_density(out, values.class_share(bound))
            return
        hot = values.get_hot(x)
        if hot is not None and func in (aten.sum.dim_IntList, aten.sum.default) and out.numel() <= SHADOW_LIMIT:
            # a routing map's per-class sums (torchtitan: ``routing_map_BLE.sum(dim=(0, 1))``): the
            # routing rule's counts of its ``rows·k`` ones over its ``n`` classes
            dim, k = hot
            n = x.shape[dim]
            ones = x.numel() // n * k
            if out.numel() == 1:  # (every row's k ones: exact)
                values.set_shadow(out, torch.full(tuple(out.shape), ones, dtype=out.dtype))
            elif out.numel() == n and _reduces_all_but(args, x.dim(), dim):
                self.rules_used["bincount"] += 1
                values.set_shadow(out, uniform_counts(ones, n, values.routing_skew).to(out.dtype).reshape(out.shape))
            return
        if func is aten.histc.default:  # per-expert counts as torch.histc(idx.float(), bins=n, ...)
            if self.experts is not None and self.experts.in_loop:
                self.experts.rule("histc", exact=False)
            if values.get_bound(x) is not None and out.dim() == 1 and out.numel() <= SHADOW_LIMIT:
                self.rules_used["bincount"] += 1
                values.set_shadow(out, uniform_counts(x.numel(), out.numel(), values.routing_skew).to(out.dtype))
            return
        d = values.get_density(x)
        if d < 1.0 and func is aten.any.default:  # `if mask.any():` — an expert with tokens
            self.rules_used["mask_count"] += 1
            values.set_shadow(out, torch.ones((), dtype=torch.bool))
        elif d < 1.0 and not out.is_floating_point() and out.numel() <= SHADOW_LIMIT:
            per = x.numel() // max(out.numel(), 1)
            self.rules_used["mask_count"] += 1
            values.set_shadow(out, torch.full(tuple(out.shape), max(1, math.ceil(per * d)), dtype=out.dtype))

    def _routing_map(self, func: Any, args: tuple[Any, ...]) -> tuple[int, int] | None:
        """(class dimension, ones per row) when ``func`` scatters a non-zero value into known zeros
        at indices below the class dimension's size, one row of ``k`` indices per row of the map
        (``top-k`` ids: distinct per row, so each row holds exactly ``k`` ones); else None."""
        if len(args) < 4 or not all(isinstance(a, torch.Tensor) for a in args[:3:2]):
            return None
        x, dim, index, value = args[0], args[1], args[2], args[3]
        if not on_meta(x) or not isinstance(dim, int) or not value or x.dim() != index.dim() or not x.dim():
            return None
        dim %= x.dim()
        n, k = x.shape[dim], index.shape[dim]
        if self.values.get_bound(index) != n or k > n \
                or any(a != b for i, (a, b) in enumerate(zip(x.shape, index.shape, strict=True)) if i != dim):
            return None
        known = self.values.cpu_view(x)
        if known is None or bool(known.any()):
            return None
        return dim, k

    def _drop_mutated(self, func: Any, args: tuple[Any, ...]) -> None:
        idx = self._mutated.get(func)
        if idx is None:
            idx = tuple(i for i, a in enumerate(func._schema.arguments)
                        if a.alias_info is not None and a.alias_info.is_write)
            self._mutated[func] = idx
        for i in idx:
            if i < len(args) and isinstance(args[i], torch.Tensor):
                self.values.drop_shadow(args[i])

    def _set_bound(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> None:
        pos, dim_pos, default = INDEX_BOUND_OPS[func]
        x = args[0]
        dim = args[dim_pos] if dim_pos < len(args) else kwargs.get("dim", default)
        size = x.numel() if dim is None or x.dim() == 0 else x.shape[dim]
        t = out[pos] if isinstance(out, (tuple, list)) else out
        if isinstance(t, torch.Tensor):
            self.values.set_bound(t, size)

    # --- CUDA emulation ------------------------------------------------------------
    def _blas_workspace(self, args: tuple[Any, ...]) -> None:
        size = self.profile.cublas_workspace
        if size <= 0:
            return
        key = (1 if self.in_backward else 0, self.rec.stream)
        host = self.rec.host
        book = getattr(host.target(args), "blas_workspace", None) if host is not None else None
        if book is not None:  # a GEMM on another GPU (a device map's): that GPU's cuBLAS handle, its workspace
            book(size, key)
            return
        if key in self._blas_seen:
            return
        self._blas_seen.add(key)
        thread = "autograd thread" if key[0] else "main thread"
        self.rec.synthetic_alloc(size, Category.WORKSPACE, f"cublas workspace ({thread})", op="cublas.workspace")

    def _conv_workspace(self, func: Any, args: tuple[Any, ...], out: Any) -> None:
        x = args[1] if func is aten.convolution_backward.default else args[0]
        if not isinstance(x, torch.Tensor):
            return
        outs = out if isinstance(out, (tuple, list)) else (out,)
        out_bytes = sum(o.numel() * o.element_size() for o in outs if isinstance(o, torch.Tensor))
        size = conv_workspace_bytes(x.numel() * x.element_size(), out_bytes)
        if size > 0:
            eid = self.rec.synthetic_alloc(size, Category.WORKSPACE, "cudnn conv workspace", op="cudnn.workspace")
            self.rec.synthetic_free(eid, Category.WORKSPACE, op="cudnn.workspace")

    def _flash_bwd(self, args: tuple[Any, ...]) -> None:
        ids = [self.rec.synthetic_alloc(n, Category.WORKSPACE, d, op="flash_attn.bwd_buffers")
               for n, d in _flash_bwd_buffers(args)]
        for eid in ids:
            self.rec.synthetic_free(eid, Category.WORKSPACE, op="flash_attn.bwd_buffers")

    # --- errors --------------------------------------------------------------------
    def _where(self) -> str:
        rec = self.rec
        mod = rec.log.strings[rec.module] or "<top level>"
        return f"module {mod} (op {rec.log.strings[rec.op]})"

    def _no_kernel(self, func: Any, e: Exception) -> TraceError:
        return TraceError(
            f"op {func} has no meta kernel, so {self._where()} at {user_frame()} cannot run on fake tensors",
            hint="register one with @torch.library.register_fake for custom ops "
                 "(a CUDA-only extension cannot be traced otherwise)",
        )


def _register_higher_order_rules() -> None:
    """Rules for the higher-order operators a traced step meets. DTensor's random ops (dropout,
    ``init.normal_`` of a sharded parameter: torchtitan's initialisation) run through
    ``run_dtensor_rng_op`` (torch ≥ 2.12), which adjusts the CUDA generator's Philox offsets
    around the op; on the emulated GPU the op itself runs, recorded (memory does not depend
    on the offsets), as torch's own fake-tensor rule runs it."""
    try:
        from torch._prims.rng_prims import run_dtensor_rng_op
    except ImportError:  # torch < 2.12: DTensor calls the op directly
        return

    @run_dtensor_rng_op.py_impl(TraceMode)  # type: ignore[untyped-decorator]
    def _rng_op(mode: TraceMode, start: Any, end: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
        with mode:
            return op(*args, **kwargs)


_register_higher_order_rules()
register_flex_rules(TraceMode)


def _any_meta(args: tuple[Any, ...]) -> bool:
    for a in args:
        if isinstance(a, torch.Tensor):
            if on_meta(a):
                return True
        elif isinstance(a, (list, tuple)):
            for t in a:
                if isinstance(t, torch.Tensor) and on_meta(t):
                    return True
    return False


def _any_host(args: Any) -> bool:
    for a in args:
        if isinstance(a, torch.Tensor):
            if not on_meta(a) and a.dim() > 0:
                return True
        elif isinstance(a, (list, tuple)) and _any_host(a):
            return True
    return False


def _to_host(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    dev = kwargs.get("device")
    if dev is None and len(args) > 1:  # to.device(self, device, ...) / to.other(self, other, ...)
        dev = args[1].device if isinstance(args[1], torch.Tensor) else args[1]
    if not isinstance(dev, (str, torch.device)):
        return False
    return isinstance(args[0], torch.Tensor) and on_meta(args[0]) and torch.device(dev).type != "meta"


def _device_mismatch(func: Any, args: tuple[Any, ...]) -> str:
    """CUDA's message for an op given tensors on two devices."""
    names = [a.name for a in func._schema.arguments]
    for i, a in enumerate(args):
        if isinstance(a, torch.Tensor) and not on_meta(a) and a.dim() > 0:
            arg = names[i] if i < len(names) else f"argument {i}"
            return (f"Expected all tensors to be on the same device, but found at least two devices, cuda:0 and "
                    f"{raw_device(a)}! (when checking argument for argument {arg} in method {func})")
    return f"Expected all tensors to be on the same device, but found at least two devices (in method {func})"


def _index_like(t: torch.Tensor) -> bool:
    return on_meta(t) and not t.is_floating_point() and not t.is_complex() and t.numel() <= SHADOW_LIMIT


def _reduces_all_but(args: tuple[Any, ...], ndim: int, keep: int) -> bool:
    """``sum(x, dims)`` reduces every dimension of ``x`` but ``keep``."""
    dims = args[1] if len(args) > 1 else None
    if dims is None:
        return False
    reduced = {d % ndim for d in ([dims] if isinstance(dims, int) else dims)}
    return reduced == set(range(ndim)) - {keep}


def _meta_and_small(out: Any) -> bool:
    """The op made device tensors, none too large to shadow (so computing values is worth it)."""
    if isinstance(out, torch.Tensor):
        return on_meta(out) and out.numel() <= SHADOW_LIMIT
    if isinstance(out, (tuple, list)):
        ts = [o for o in out if isinstance(o, torch.Tensor)]
        return bool(ts) and all(_meta_and_small(o) for o in ts)
    return False


def _mirror(cpu_out: Any) -> Any:
    """Meta tensors shaped like a CPU result (for data-dependent ops computed exactly)."""
    if isinstance(cpu_out, torch.Tensor):
        return torch.empty_strided(cpu_out.shape, cpu_out.stride(), dtype=cpu_out.dtype, device="meta")
    if isinstance(cpu_out, (tuple, list)):
        return type(cpu_out)(_mirror(o) for o in cpu_out)
    return cpu_out


def _attach(values: Values, out: Any, cpu_out: Any) -> None:
    if isinstance(out, torch.Tensor) and isinstance(cpu_out, torch.Tensor):
        if on_meta(out) and not values.has_shadow(out) and out.shape == cpu_out.shape:
            values.set_shadow(out, cpu_out)
    elif isinstance(out, (tuple, list)) and isinstance(cpu_out, (tuple, list)):
        for o, c in zip(out, cpu_out, strict=False):
            _attach(values, o, c)


def _copy_hints(values: Values, src: torch.Tensor, dst: torch.Tensor) -> None:
    d = values.get_density(src)
    if d < 1.0:
        values.set_density(dst, d)
    b = values.get_bound(src)
    if b is not None:
        values.set_bound(dst, b)

