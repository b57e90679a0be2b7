"""cuDNN's RNN path, emulated: ``nn.LSTM`` / ``nn.GRU`` / ``nn.RNN`` as ``_cudnn_rnn``.

On CUDA, ``at::lstm``/``at::gru``/``at::rnn_tanh``/``at::rnn_relu`` (padded and packed) go
to ``_cudnn_impl`` in ``aten/src/ATen/native/cudnn/RNN.cpp`` (PyTorch 2.4–2.14), which calls
``_cudnn_rnn`` once for the whole sequence and all layers; on ``meta`` the same ops
decompose into per-step cell ops that keep far less. The trace's function mode turns these
calls into ``aten._cudnn_rnn`` (:func:`call_cudnn_rnn`, the Python twin of ``_cudnn_impl``)
and the dispatch mode builds the tensors the CUDA kernels make:

forward (``_cudnn_rnn``)
    ``output`` (seq-major, transposed back for ``batch_first``), ``hy``, ``cy``, the
    training ``reserve`` (kept by autograd for backward) and, transient, ``x =
    input.transpose(0, 1).contiguous()`` for ``batch_first`` unpacked input and the cuDNN
    workspace. ``weight_buf`` is the flattened parameter storage (``flatten_parameters``
    runs when the module moves to CUDA), so it costs nothing new.
backward (``_cudnn_rnn_backward``)
    zero-filled ``grad_output``/``grad_hy``/``grad_cy`` where autograd passes none, ``dx``,
    ``dhx``, ``dcx``, the contiguous ``x``/``dy`` copies and the workspace of
    ``cudnnRNNBackwardData``; then one flat ``dw`` (``zeros(weight_buf)``) whose views are
    the weight gradients (``_cudnn_rnn_backward_weight``), plus its own workspace.

Reserve and workspace sizes come from ``cudnnGetRNNTempSpaceSizes`` (cuDNN 8/9,
``CUDNN_FWD_MODE_TRAINING``; https://docs.nvidia.com/deeplearning/cudnn/api/cudnn-adv-library.html),
which documents the query but not a formula. The sizes here are **approximations** from
what the standard algorithm must keep for backward, per layer, direction and token:

- reserve: LSTM the 4 gate activations + the cell state + the layer output (``5H + O``
  elements), GRU its 3 input-side and 3 hidden-side gate projections (kept apart: the
  reset gate multiplies only the hidden side) + the output (``6H + O``), plain RNN the
  pre-activation + output (``H + O``), in the input's dtype; plus, with dropout between
  layers in training, one byte per element of each dropped layer output. The one public
  measurement found, pytorch/pytorch#2895 (2017), reports 736,000,000 B (LSTM) and
  864,000,000 B (GRU) for the same shapes: a GRU/LSTM ratio of 1.174, against 7/6 = 1.167
  here;
- workspace: the input-projection GEMM result of one layer (``gates·H`` per token and
  direction), in the input's dtype.

The dropout state (``_cudnn_init_dropout_state``, cached per device once an RNN trains with
dropout; "slightly over 2MB" per ``RNN.cpp``) is taken as 2 MiB.
"""

from __future__ import annotations

from typing import Any

import torch

from ..emulate.tensors import on_meta
from ..errors import TraceError

aten = torch.ops.aten

MODES = {"rnn_relu": 0, "rnn_tanh": 1, "lstm": 2, "gru": 3}
"""cuDNN's ``cudnnRNNMode_t`` values, as ``_cudnn_rnn`` takes them."""
GATES = {0: 1, 1: 1, 2: 4, 3: 3}
_RESERVE_EXTRA = {0: 0, 1: 0, 2: 1, 3: 3}
"""Per-token state beyond gates and output: LSTM's cell state, GRU's hidden-side projections."""
DROPOUT_STATE_BYTES = 2 << 20
CUDNN_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
FORWARD = aten._cudnn_rnn.default
BACKWARD = aten._cudnn_rnn_backward.default
OPS = frozenset({FORWARD, BACKWARD})


def reserve_bytes(mode: int, layers: int, dirs: int, tokens: int, hidden: int, out: int, itemsize: int,
                  dropout: float) -> int:
    """Training reserve of one ``_cudnn_rnn`` call (approximation, see the module doc)."""
    per_token = (GATES[mode] + _RESERVE_EXTRA[mode]) * hidden + out
    size = layers * dirs * tokens * per_token * itemsize
    if dropout > 0 and layers > 1:
        size += (layers - 1) * tokens * dirs * out
    return size


def workspace_bytes(mode: int, dirs: int, tokens: int, hidden: int, itemsize: int) -> int:
    """cuDNN RNN workspace (approximation: one layer's input-projection GEMM output)."""
    return dirs * tokens * GATES[mode] * hidden * itemsize


# --------------------------------------------------------------------------- function mode
def call_cudnn_rnn(name: str, args: tuple[Any, ...], host_values: Any, *, autocast: bool = False,
                   dropout_state: Any = None) -> Any:
    """``torch._VF.<name>(...)`` as ``_cudnn_impl`` runs it on CUDA, or ``NotImplemented``
    when cuDNN would not be used (a non-meta input, float64).

    ``host_values(t)``: the real values of the packed ``batch_sizes`` tensor (a host tensor,
    or a meta one with known values), or None. ``autocast``: an autocast region is active —
    ``_cudnn_rnn_cast_reflatten`` (``aten/src/ATen/cudnn/AutocastRNN.cpp``) then runs the RNN
    in fp16 whatever the autocast dtype: input and states cast to fp16, and the weights copied
    (autograd-exposed) into a new fp16 flat buffer on every call. ``dropout_state()`` is
    called when the call needs cuDNN's dropout state (training with dropout)."""
    mode = MODES[name]
    packed = isinstance(args[1], torch.Tensor) if mode == 2 else isinstance(args[2], torch.Tensor)
    if packed:
        data, batch_sizes_t, hx, params, has_biases, layers, dropout, train, bidir = args[:9]
        batch_first = False
    else:
        data, hx, params, has_biases, layers, dropout, train, bidir, batch_first = args[:9]
        batch_sizes_t = None
    if not isinstance(data, torch.Tensor) or not on_meta(data) or data.dtype not in CUDNN_DTYPES:
        return NotImplemented
    if mode == 2:
        h0, c0 = hx[0], hx[1]
    else:
        h0, c0 = hx, None
    hidden, proj = int(h0.shape[2]), 0
    if c0 is not None and c0.shape[2] != h0.shape[2]:
        hidden, proj = int(c0.shape[2]), int(h0.shape[2])
    batch_sizes: list[int] = []
    if batch_sizes_t is not None:
        vals = host_values(batch_sizes_t)
        if vals is None:
            raise TraceError(
                "a packed sequence's batch_sizes have no known values (they live on the host in a real run)",
                hint="build the PackedSequence with pack_padded_sequence / pack_sequence from lengths given as a "
                     "CPU tensor or a list",
            )
        batch_sizes = [int(v) for v in vals.tolist()]
    per_layer = (4 if has_biases else 2) + (1 if proj else 0)
    if train and dropout > 0 and dropout_state is not None:
        dropout_state()
    params = list(params)
    total = sum(p.numel() for p in params)
    if autocast and params[0].dtype != torch.float16:
        half = torch.float16
        data, h0 = data.to(half), h0.to(half)
        c0 = c0.to(half) if c0 is not None else None
        weight_buf = torch.zeros(total, dtype=half, device="meta")
        views, off = [], 0
        for p in params:
            v = weight_buf.narrow(0, off, p.numel()).view(p.shape)
            v.copy_(p)
            views.append(v)
            off += p.numel()
        params = views
        weight_buf = weight_buf.detach()  # the flat storage; gradients flow through the views
    else:
        # flatten_parameters() made the weights views of one buffer: no new memory
        from torch.utils._python_dispatch import _disable_current_modes

        with _disable_current_modes():
            weight_buf = torch.empty(total, dtype=params[0].dtype, device="meta")
    out = aten._cudnn_rnn.default(
        data, params, per_layer, weight_buf, h0, c0, mode, hidden, proj, int(layers), bool(batch_first),
        float(dropout), bool(train), bool(bidir), batch_sizes, None,
    )
    output, hy, cy = out[0], out[1], out[2]
    return (output, hy, cy) if mode == 2 else (output, hy)


# --------------------------------------------------------------------------- dispatch mode
def _geometry(inp: torch.Tensor, batch_first: bool, batch_sizes: list[int]) -> tuple[int, int, int]:
    """(seq_length, mini_batch, tokens) as ``TensorDescriptorListParams::set`` reads them."""
    if batch_sizes:
        return len(batch_sizes), int(batch_sizes[0]), int(inp.shape[0])
    t, n = (inp.shape[1], inp.shape[0]) if batch_first else (inp.shape[0], inp.shape[1])
    return int(t), int(n), int(t) * int(n)


def _empty(shape: tuple[int, ...] | list[int], dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(tuple(shape), dtype=dtype, device="meta")


def _seq_major(shape_sm: tuple[int, int, int], dtype: torch.dtype, batch_first: bool) -> torch.Tensor:
    t = _empty(shape_sm, dtype)
    return t.transpose(0, 1) if batch_first else t


def forward(args: tuple[Any, ...]) -> tuple[tuple[Any, ...], list[tuple[int, str]]]:
    """Outputs of ``_cudnn_rnn`` and the transient buffers (bytes, description) it uses."""
    (inp, _weight, _stride0, weight_buf, hx, cx, mode, hidden, proj, layers, batch_first, dropout, train, bidir,
     batch_sizes, _dstate) = args[:16]
    hidden, proj, layers = int(hidden), int(proj), int(layers)
    batch_sizes = [int(b) for b in batch_sizes]
    seq, mini, tokens = _geometry(inp, batch_first, batch_sizes)
    dirs = 2 if bidir else 1
    o = proj or hidden
    if batch_sizes:
        output = _empty((tokens, o * dirs), inp.dtype)
    else:
        output = _seq_major((seq, mini, o * dirs), inp.dtype, batch_first)
    hy = _empty((layers * dirs, mini, o), hx.dtype)
    cy = _empty((layers * dirs, mini, hidden), cx.dtype) if cx is not None else _empty((0,), hx.dtype)
    e = inp.element_size()
    reserve = _empty((reserve_bytes(mode, layers, dirs, tokens, hidden, o, e, dropout if train else 0.0)
                      if train else 0,), torch.uint8)
    transient = []
    if batch_first and not batch_sizes and seq > 1 and mini > 1:
        transient.append((inp.numel() * e, "cudnn rnn input (seq-major copy)"))
    transient.append((workspace_bytes(mode, dirs, tokens, hidden, e), "cudnn rnn workspace"))
    return (output, hy, cy, reserve, weight_buf), transient


def backward(args: tuple[Any, ...]) -> tuple[Any, list[tuple[int, str]], list[tuple[int, str]]]:
    """(outputs, transient buffers of the data pass, transient buffers of the weight pass).

    Zero fills for missing incoming gradients are listed first in the data pass."""
    (inp, weight, _stride0, weight_buf, hx, cx, output, g_out, g_hy, g_cy, mode, hidden, _proj, _layers,
     batch_first, _dropout, _train, _bidir, batch_sizes, _dstate, _reserve, mask) = args[:22]
    if g_out is None and g_hy is None and g_cy is None:
        return (None, None, None, [None] * len(weight)), [], []
    batch_sizes = [int(b) for b in batch_sizes]
    seq, mini, tokens = _geometry(inp, batch_first, batch_sizes)
    dirs = 2 if _bidir else 1
    e = inp.element_size()
    data_pass: list[tuple[int, str]] = []
    if g_out is None:
        data_pass.append((output.numel() * output.element_size(), "zero grad_output"))
    if g_hy is None:
        data_pass.append((hx.numel() * hx.element_size(), "zero grad_hy"))
    if cx is not None and g_cy is None:
        data_pass.append((cx.numel() * cx.element_size(), "zero grad_cy"))
    transposed = batch_first and not batch_sizes and seq > 1 and mini > 1
    ws = workspace_bytes(mode, dirs, tokens, int(hidden), e)
    if transposed:
        data_pass.append((inp.numel() * e, "cudnn rnn input (seq-major copy)"))
        data_pass.append((output.numel() * output.element_size(), "cudnn rnn grad_output (seq-major copy)"))
    data_pass.append((ws, "cudnn rnn workspace"))
    if batch_sizes:
        dx = _empty(tuple(inp.shape), inp.dtype)
    else:
        sm = (seq, mini, int(inp.shape[-1]))
        dx = _seq_major(sm, inp.dtype, batch_first)
    dhx = _empty(tuple(hx.shape), hx.dtype)
    dcx = _empty(tuple(cx.shape), cx.dtype) if cx is not None else None
    weight_pass: list[tuple[int, str]] = []
    dws: list[Any] = []
    if mask[3]:
        flat = _empty((weight_buf.numel(),), weight_buf.dtype)
        off = 0
        for w in weight:
            n = w.numel()
            dws.append(flat.narrow(0, off, n).view(tuple(w.shape)))
            off += n
        if transposed:
            weight_pass.append((inp.numel() * e, "cudnn rnn input (seq-major copy)"))
        weight_pass.append((ws, "cudnn rnn workspace"))
    return (dx, dhx, dcx, dws), data_pass, weight_pass
