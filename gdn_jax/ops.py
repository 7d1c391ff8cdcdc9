"""The GDN ops, each with ``impl="auto" | "native" | "reference"``.

``"auto"`` runs the native XLA FFI kernels when JAX's default backend is the CPU and the pure
jnp reference elsewhere, so code written against gdn_jax runs on any JAX backend. Both
implementations take the same arguments, validate them the same way (static mistakes raise
at trace time naming the argument) and refuse the same bad batches before writing anything.

Data-dependent errors (a slot out of range, one slot named twice, a bad ``query_start_loc``
or ``num_accepted_tokens``): the op writes nothing and its output is zero. Called eagerly,
the op raises ``InvalidBatchError``; under ``jit`` it cannot raise without losing a donated
cache, so it reports the error on stderr (natively on the CPU; elsewhere from a host
callback taken only when one occurs) and returns the caches unchanged. The
``*_with_status`` variants return the status vector instead, for callers that check it
themselves (the serving steps do).

Shapes: T tokens, S rows (sequences), H key heads, HV value heads (HV % H == 0), K/V head
dims, D = 2*H*K + HV*V conv channels, W conv width, N cache slots, L conv state length.
"""
from __future__ import annotations

import functools
import inspect
import logging
import warnings

import jax
import jax.numpy as jnp
import numpy as np

from . import _checks as C
from . import _native
from ._checks import InvalidBatchError
from ._ffi import native_available

_log = logging.getLogger("gdn_jax")
IMPLS = ("auto", "native", "reference")


def resolve_impl(impl: str) -> str:
    """'native' or 'reference' for an ``impl`` argument."""
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    if impl == "auto":
        return "native" if jax.default_backend() == "cpu" and native_available() else "reference"
    return impl


def _reference():
    from . import reference  # imported lazily: it is only needed off the native path

    return reference


def _report_host(op: str, status) -> None:
    msg = C.status_message(op, status)
    if msg:
        _log.error(msg)
        warnings.warn(msg, RuntimeWarning, stacklevel=2)


_TEMPLATES = "\n".join(C.STATUS_MESSAGES[c] for c in range(1, max(C.STATUS_MESSAGES) + 1))


def report_status(op: str, status, carrier):
    """Raise (eager) or report (traced) ``status`` if it is an error; returns ``carrier``.

    The ops pass their updated cache as ``carrier``: a caller keeps it (it is the next step's
    input), so XLA cannot drop the report as dead code, as it would with an output the caller
    does not use.

    Traced on the CPU with the native module, ``carrier`` (any result of the op) passes
    through the native ``report`` call, aliased (nothing copied), which prints the message to
    stderr when the status is an error: the call stays on JAX's fast dispatch path. Elsewhere
    the message is logged from a host callback taken only when an error occurs.
    """
    if isinstance(status, jax.core.Tracer):
        if jax.default_backend() == "cpu" and native_available():
            return _native.report(carrier, status, op=op, templates=_TEMPLATES)
        jax.lax.cond(status[0] != 0, lambda s: jax.debug.callback(lambda v: _report_host(op, v), s),
                     lambda s: None, status)
        return carrier
    msg = C.status_message(op, status)
    if msg:
        raise InvalidBatchError(msg)
    return carrier


# Keyword arguments that select a program rather than feed it data: static in the cached jit.
_STATIC_ARGS = ("impl", "activation", "conv_state_layout", "scale", "use_qk_l2norm", "l2norm_eps")
# Checked on the host before jit (``_checks.host_int32``): jit wraps int64 values beyond int32.
_INDEX_ARGS = ("query_start_loc", "state_indices", "spec_state_indices", "num_accepted_tokens", "src", "dst")


def _is_traced(tree) -> bool:
    return any(isinstance(x, jax.core.Tracer) for x in jax.tree_util.tree_leaves(tree))


def _static_value(v):
    """A 0-d array given for a static argument (``scale=jnp.float32(0.1)``) keys by its value."""
    return v.item() if getattr(v, "ndim", None) == 0 and hasattr(v, "item") else v


def _compiled_once(fn):
    """Run eager calls of op ``fn`` through one cached ``jax.jit`` of it.

    Called op by op, the reference path's ``lax.cond`` closes over fresh Python functions on
    every call, so JAX compiled (and mapped into memory) a new program each time: ~45 memory
    mappings a call until the process ran out of them. The jitted body compiles once per
    static configuration (``_STATIC_ARGS``; shapes and dtypes key jit's own cache). Traced
    calls (inside the caller's jit, vmap, ...) run ``fn`` inline, as before. ``impl="auto"``
    is resolved first, so the cache keys on the implementation that runs.
    """
    params = inspect.signature(fn).parameters
    static = tuple(n for n in _STATIC_ARGS if n in params)
    jitted = jax.jit(fn, static_argnames=static)

    @functools.wraps(fn)
    def call(*args, **kwargs):
        kwargs["impl"] = resolve_impl(kwargs.get("impl", "auto"))
        if _is_traced((args, kwargs)):
            return fn(*args, **kwargs)
        for n in static:
            if n in kwargs:
                kwargs[n] = _static_value(kwargs[n])
        for n in _INDEX_ARGS:
            if n in kwargs:
                kwargs[n] = C.host_int32(n, kwargs[n])
        try:
            hash(tuple(kwargs.get(n) for n in static))
        except TypeError:  # not a valid static value: fn's own checks raise, naming it
            return fn(*args, **kwargs)
        return jitted(*args, **kwargs)

    call.jitted = jitted
    return call


def _guarded(status, run, skip):
    """Reference path: run() only when status is OK, else skip() (nothing written). Empty
    batches (no tokens, no rows, an empty pool) are the reference's own early return."""
    return jax.lax.cond(status[0] == 0, run, skip)


# --- gating ----------------------------------------------------------------------------------


@_compiled_once
def fused_gdn_gating(a, b, *, A_log, dt_bias, impl: str = "auto"):
    """Gates of the gated delta rule.

    Args:
      a, b: [T, HV] activation dtype (bf16 or f32).
      A_log: [HV]; dt_bias: [HV] (f32 or the activation dtype).
    Returns:
      g: [T, HV] f32, ``-exp(A_log) * softplus(a + dt_bias)`` (log-space decay).
      beta: [T, HV] f32, ``sigmoid(b)``.
    """
    T, HV = C.check_rank("a", a, 2, "[T, HV]")
    C.check_dtype("a", a, C.ACT_DTYPES)
    C.check_shape("b", b, (T, HV), "[T, HV] like a")
    C.check_same_dtype("b", b, "a", a)
    C.check_gate_params(A_log, dt_bias, HV)
    if resolve_impl(impl) == "native":
        return _native.gating(a, b, A_log, dt_bias)
    return _reference().fused_gdn_gating(a, b, A_log=A_log, dt_bias=dt_bias)


# --- gated RMSNorm ---------------------------------------------------------------------------


def gated_rms_norm(o, z, *, weight, eps: float, impl: str = "auto"):
    """The layer's gated RMSNorm per value head (transformers' ``Qwen3NextRMSNormGated``).

    Args:
      o: [..., V] f32 or bf16 (the core's output, [T, HV, V] in the layer).
      z: o's shape and dtype (the gate, in_proj_z's output).
      weight: [V] (cast to o's dtype).
      eps: > 0 (config.json's ``rms_norm_eps``).
    Returns:
      [..., V] o's dtype: ``n = o * rsqrt(mean(o^2) + eps)`` in f32, cast to o's dtype, times
      ``weight``, times ``silu(z)`` in f32, cast back (the native kernel in one pass per row).
    """
    if jnp.ndim(o) < 1:
        raise ValueError(f"o must be [..., V] (rank >= 1), got shape {jnp.shape(o)}")
    V = o.shape[-1]
    C.check_dtype("o", o, C.ACT_DTYPES)
    C.check_shape("z", z, tuple(o.shape), "o's shape")
    C.check_same_dtype("z", z, "o", o)
    C.check_shape("weight", weight, (V,), "[V], V the last dim of o")
    eps = float(eps)
    if not eps > 0:
        raise ValueError(f"eps must be > 0, got {eps!r}")
    weight = weight.astype(o.dtype)
    if resolve_impl(impl) == "native":
        return _native.gated_rms_norm(o, z, weight, eps)
    return _reference().gated_rms_norm(o, z, weight=weight, eps=eps)


# --- projection ------------------------------------------------------------------------------


PACK_BLOCK = 16  # outputs per block of a packed weight


class PackedLinearWeight:
    """A bf16 ``[out, in]`` weight packed once for :func:`linear` (:func:`pack_linear_weight`).

    ``data`` [ceil(out / 16), ceil(in / 2), 16, 2] bf16 with ``data[b, p, j, k] = w[16 b + j,
    2 p + k]``, zero past ``out`` and ``in``: 16 outputs per block, each block one contiguous
    stream along ``in`` in the pairs a bf16 dot product takes, so the kernel reads every weight
    once per call at decode and keeps 16 outputs in one vector (ffi/README.md, "Projections
    (linear)"). A pytree: ``data`` is its leaf, ``shape`` (out, in) static.
    """

    def __init__(self, data, shape):
        self.data = data
        self.shape = tuple(int(d) for d in shape)

    @property
    def dtype(self):
        return self.data.dtype

    def unpack(self):
        """The ``[out, in]`` weight."""
        n_out, n_in = self.shape
        nb, np_ = self.data.shape[:2]
        return jnp.transpose(self.data, (0, 2, 1, 3)).reshape(nb * PACK_BLOCK, np_ * 2)[:n_out, :n_in]

    def __repr__(self) -> str:
        return f"PackedLinearWeight(shape={self.shape}, data={getattr(self.data, 'shape', '?')})"


jax.tree_util.register_pytree_node(
    PackedLinearWeight, lambda p: ((p.data,), p.shape), lambda shape, leaves: PackedLinearWeight(leaves[0], shape))


def packed_shape(n_out: int, n_in: int) -> tuple:
    """Shape of the packed data of an ``[n_out, n_in]`` weight."""
    return (-(-n_out // PACK_BLOCK), -(-n_in // 2), PACK_BLOCK, 2)


def pack_linear_weight(w) -> PackedLinearWeight:
    """Pack a bf16 ``[out, in]`` weight for :func:`linear` (once, at load time).

    Same results as the plain weight, to the accumulation order; on the CPU kernels it is the
    fast layout (a decode step reads each weight once). Only bf16 is packed: packing an f32
    weight would round it.

    Args:
      w: [out, in] bf16 (Hugging Face's ``nn.Linear`` layout).
    Returns:
      :class:`PackedLinearWeight` of ``w``.
    """
    n_out, n_in = C.check_rank("w", w, 2, "[out, in]")
    if jnp.dtype(w.dtype) != jnp.dtype(jnp.bfloat16):
        raise TypeError(f"w must be bfloat16 to be packed (an f32 weight would be rounded), got {jnp.dtype(w.dtype)}")
    nb, np_ = packed_shape(n_out, n_in)[:2]
    wp = jnp.pad(jnp.asarray(w), ((0, nb * PACK_BLOCK - n_out), (0, np_ * 2 - n_in)))
    return PackedLinearWeight(jnp.transpose(wp.reshape(nb, PACK_BLOCK, np_, 2), (0, 2, 1, 3)), (n_out, n_in))


def _check_packed(w: PackedLinearWeight, n_in: int, name: str = "w") -> int:
    n_out, w_in = w.shape
    if w_in != n_in:
        raise ValueError(f"{name} must be packed from [out, in] with in={n_in} (the last dim of x), got in={w_in}")
    C.check_shape(f"{name}.data", w.data, packed_shape(n_out, n_in), "[ceil(out / 16), ceil(in / 2), 16, 2]")
    C.check_dtype(f"{name}.data", w.data, (jnp.bfloat16,))
    return n_out


def linear(x, w, *, out_dtype=None, impl: str = "auto"):
    """The layer's projections: ``y = x @ w.T`` with f32 accumulation and one rounding.

    Args:
      x: [T, in] f32 or bf16.
      w: [out, in] f32 or bf16 (Hugging Face's ``nn.Linear`` layout), or a bf16 weight packed
        by :func:`pack_linear_weight` (:class:`PackedLinearWeight`).
      out_dtype: f32 or bf16; default x's dtype.
    Returns:
      y: [T, out] ``out_dtype``.
    """
    T, n_in = C.check_rank("x", x, 2, "[T, in]")
    C.check_dtype("x", x, C.ACT_DTYPES)
    packed = isinstance(w, PackedLinearWeight)
    if packed:
        n_out = _check_packed(w, n_in)
    else:
        n_out = C.check_rank("w", w, 2, "[out, in]")[0]
        C.check_shape("w", w, (n_out, n_in), f"[out, in] with in={n_in} (the last dim of x)")
        C.check_dtype("w", w, C.ACT_DTYPES)
    out_dtype = x.dtype if out_dtype is None else jnp.dtype(out_dtype)
    if out_dtype not in C.ACT_DTYPES:
        raise TypeError(f"out_dtype must be float32 or bfloat16, got {out_dtype}")
    if resolve_impl(impl) == "native":
        return _native.linear_packed(x, [w.data], [n_out], out_dtype)[0] if packed else _native.linear(x, w, out_dtype)
    if packed:  # contract x's pairs with the blocks as stored: no unpacked copy of w
        xp = jnp.pad(x, ((0, 0), (0, w.data.shape[1] * 2 - n_in))).reshape(T, w.data.shape[1], 2)
        y = jnp.einsum("tpk,bpjk->tbj", xp, w.data, preferred_element_type=jnp.float32)
        return y.reshape(T, y.shape[1] * y.shape[2])[:, :n_out].astype(out_dtype)  # (T, -1) fails at T = 0
    y = jax.lax.dot_general(x, w, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
    return y.astype(out_dtype)


MERGED_PARTS = 8  # packed weights per native call of merged_linear (ffi kMaxLinearParts)


def merged_linear(x, ws, *, out_dtype=None, impl: str = "auto") -> tuple:
    """Several projections of one x: ``tuple(linear(x, w) for w in ws)``, each output its own
    array (vLLM's merged column-parallel linear without the concatenation).

    On the native kernels the packed weights run in one call per 8 (x read once, and on AMX
    copied into tile order once, for all of them; one fork), each output bit for bit what
    :func:`linear` gives; unpacked weights run as :func:`linear` does.

    Args:
      x: [T, in] f32 or bf16.
      ws: a non-empty sequence of weights as :func:`linear` takes them ([out_i, in], or packed).
      out_dtype: f32 or bf16 for every output; default x's dtype.
    Returns:
      tuple of y_i: [T, out_i] ``out_dtype``, in the order of ``ws``.
    """
    ws = list(ws) if isinstance(ws, (list, tuple)) else None
    if not ws:
        raise TypeError("ws must be a non-empty list or tuple of weights")
    packed = [i for i, w in enumerate(ws) if isinstance(w, PackedLinearWeight)]
    if resolve_impl(impl) != "native" or len(packed) < 2:
        return tuple(linear(x, w, out_dtype=out_dtype, impl=impl) for w in ws)
    T, n_in = C.check_rank("x", x, 2, "[T, in]")
    C.check_dtype("x", x, C.ACT_DTYPES)
    n_outs = [_check_packed(ws[i], n_in, f"ws[{i}]") for i in packed]
    out_dtype = x.dtype if out_dtype is None else jnp.dtype(out_dtype)
    if out_dtype not in C.ACT_DTYPES:
        raise TypeError(f"out_dtype must be float32 or bfloat16, got {out_dtype}")
    ys = [None] * len(ws)
    for k in range(0, len(packed), MERGED_PARTS):
        idx = packed[k:k + MERGED_PARTS]
        got = _native.linear_packed(x, [ws[i].data for i in idx], n_outs[k:k + MERGED_PARTS], out_dtype)
        for i, y in zip(idx, got):
            ys[i] = y
    for i, w in enumerate(ws):
        if ys[i] is None:
            ys[i] = linear(x, w, out_dtype=out_dtype, impl=impl)
    return tuple(ys)


# --- causal conv -----------------------------------------------------------------------------


def _conv_common(x, weight, bias, conv_state, activation, conv_state_layout):
    T, D = C.check_rank("x", x, 2, "[T, D]")
    C.check_dtype("x", x, C.ACT_DTYPES)
    Dw, W = C.check_rank("weight", weight, 2, "[D, W]")
    if Dw != D:
        raise ValueError(f"weight must be [D, W] with D={D} (channels of x), got shape {weight.shape}")
    if not 2 <= W <= 4:
        raise ValueError(f"conv width W = weight.shape[1] must be 2, 3 or 4, got {W}")
    C.check_dtype("weight", weight, C.ACT_DTYPES)
    if bias is not None:
        C.check_shape("bias", bias, (D,), "[D]")
        C.check_dtype("bias", bias, C.ACT_DTYPES)
    silu = C.check_activation(activation)
    layout = C.check_layout(conv_state_layout)
    N, L = C.conv_state_dims(conv_state, conv_state_layout, D)
    if L < W - 1:
        raise ValueError(f"conv_state length L={L} must be at least W-1={W - 1}")
    C.check_same_dtype("conv_state", conv_state, "x", x)
    return T, D, W, N, L, silu, layout


@_compiled_once
def causal_conv1d_fwd_with_status(x, *, weight, bias, conv_state, query_start_loc, state_indices,
                                  has_initial_state, activation="silu", conv_state_layout="SD", impl="auto"):
    """:func:`causal_conv1d_fwd` returning ``(y, conv_state, status int32[4])``."""
    T, D, W, N, L, silu, layout = _conv_common(x, weight, bias, conv_state, activation, conv_state_layout)
    (S,) = C.check_rank("state_indices", state_indices, 1, "[S]")
    C.check_index("state_indices", state_indices, (S,), "[S]")
    C.check_index("query_start_loc", query_start_loc, (S + 1,), "[S + 1]")
    C.check_bool("has_initial_state", has_initial_state, (S,), "[S]")
    if resolve_impl(impl) == "native":
        return _native.conv_fwd(x, weight, bias, conv_state, query_start_loc, state_indices, has_initial_state,
                                silu=silu, layout=layout)
    status = C.status_slots_jnp(query_start_loc, state_indices, T, N)
    ref = _reference()

    def run():
        return ref.causal_conv1d_fwd(x, weight=weight, bias=bias, conv_state=conv_state,
                                     query_start_loc=query_start_loc, state_indices=state_indices,
                                     has_initial_state=has_initial_state, activation=activation,
                                     conv_state_layout=conv_state_layout)

    y, cs = _guarded(status, run, lambda: (jnp.zeros_like(x), conv_state))
    return y, cs, status


def causal_conv1d_fwd(x, *, weight, bias, conv_state, query_start_loc, state_indices, has_initial_state,
                      activation="silu", conv_state_layout="SD", impl="auto"):
    """Varlen causal depthwise conv1d (prefill) over a pool of conv states.

    Args:
      x: [T, D] raw inputs (``mixed_qkv``), activation dtype; sequence s is tokens
        ``[query_start_loc[s], query_start_loc[s+1])``.
      weight: [D, W] (tap W-1 multiplies the current token); bias: [D] or None.
      conv_state: [N, L, D] ("SD") or [N, D, L] ("DS") pool of raw inputs, dtype of x.
      query_start_loc: [S + 1] int32; state_indices: [S] int32 (-1 = padding row);
      has_initial_state: [S] bool (False: the slot's old contents are ignored).
      activation: "silu" or None.
    Returns:
      y: [T, D] in x's dtype (zero for padding rows and tokens past query_start_loc[-1]).
      conv_state: the pool with rows [0, W-1) of each named slot holding the last W-1 raw
        inputs of ``prior ++ x``; every other slot and row unchanged.
    """
    y, cs, status = causal_conv1d_fwd_with_status(
        x, weight=weight, bias=bias, conv_state=conv_state, query_start_loc=query_start_loc,
        state_indices=state_indices, has_initial_state=has_initial_state, activation=activation,
        conv_state_layout=conv_state_layout, impl=impl)
    cs = report_status("causal_conv1d_fwd", status, cs)
    return y, cs


@_compiled_once
def causal_conv1d_update_with_status(x, *, weight, bias, conv_state, state_indices, activation="silu",
                                     num_accepted_tokens=None, query_start_loc=None, conv_state_layout="SD",
                                     impl="auto"):
    """:func:`causal_conv1d_update` returning ``(y, conv_state, status int32[4])``."""
    T, D, W, N, L, silu, layout = _conv_common(x, weight, bias, conv_state, activation, conv_state_layout)
    (S,) = C.check_rank("state_indices", state_indices, 1, "[S]")
    C.check_index("state_indices", state_indices, (S,), "[S]")
    if query_start_loc is None:
        if T != S:
            raise ValueError(f"without query_start_loc each row has one token: x must be [S, D] with S={S}, got T={T}")
        qsl = jnp.arange(S + 1, dtype=jnp.int32)
    else:
        C.check_index("query_start_loc", query_start_loc, (S + 1,), "[S + 1]")
        qsl = query_start_loc
    if num_accepted_tokens is None:
        acc = jnp.ones((S,), jnp.int32)
    else:
        C.check_index("num_accepted_tokens", num_accepted_tokens, (S,), "[S]")
        acc = num_accepted_tokens
    if resolve_impl(impl) == "native":
        return _native.conv_update(x, weight, bias, conv_state, qsl, state_indices, acc, silu=silu, layout=layout)
    max_rows = L - W + 2
    status = C.status_spec_jnp(qsl, state_indices[:, None], acc, T, N, max_rows, max_rows, slot_cols=False)
    ref = _reference()

    def run():
        return ref.causal_conv1d_update(x, weight=weight, bias=bias, conv_state=conv_state,
                                        state_indices=state_indices, activation=activation,
                                        num_accepted_tokens=acc, query_start_loc=qsl,
                                        conv_state_layout=conv_state_layout)

    y, cs = _guarded(status, run, lambda: (jnp.zeros_like(x), conv_state))
    return y, cs, status


def causal_conv1d_update(x, *, weight, bias, conv_state, state_indices, activation="silu",
                         num_accepted_tokens=None, query_start_loc=None, conv_state_layout="SD", impl="auto"):
    """Causal conv1d decode step, and the spec-decode rolling-buffer update.

    Args:
      x: [T, D]; without ``query_start_loc`` one token per row (T == S).
      conv_state: [N, L, D] ("SD") or [N, D, L] ("DS"), L = W - 1 + num_spec.
      state_indices: [S] int32, the row's conv slot (column 0 of the spec block table).
      num_accepted_tokens: [S] int32 in [1, L - W + 2] or None (= 1): the window is rows
        ``[acc-1, acc-1+W-1)`` of the slot.
      query_start_loc: [S + 1] int32 or None: row i has q_i <= L - W + 2 tokens.
    Returns:
      y: [T, D], the conv over ``window ++ x_row``.
      conv_state: rows ``[0, W-2+q_i)`` of each named slot hold ``window[1:] ++ x_row``
        (plain decode: the window shifted by one token); other rows and slots unchanged.
    """
    y, cs, status = causal_conv1d_update_with_status(
        x, weight=weight, bias=bias, conv_state=conv_state, state_indices=state_indices, activation=activation,
        num_accepted_tokens=num_accepted_tokens, query_start_loc=query_start_loc,
        conv_state_layout=conv_state_layout, impl=impl)
    cs = report_status("causal_conv1d_update", status, cs)
    return y, cs


# --- gated delta rule ------------------------------------------------------------------------


NATIVE_MAX_HEAD_DIM = 256
CHUNK_HEAD_DIM_MULTIPLE = 16  # the chunk kernel's panels and row vectors: 16 f32 lanes


def _check_native_head_dims(K, V, *, chunked=False):
    """Head dims the native kernels take: up to 256; multiples of 16 for the chunked prefill
    (and so for the serving steps, which run it)."""
    m = CHUNK_HEAD_DIM_MULTIPLE if chunked else 1
    for name, d in (("K", K), ("V", V)):
        if d % m or not m <= d <= NATIVE_MAX_HEAD_DIM:
            what = f"multiples of {m} in [{m}, {NATIVE_MAX_HEAD_DIM}]" if chunked else f"up to {NATIVE_MAX_HEAD_DIM}"
            raise ValueError(f"the native {'chunked prefill' if chunked else 'kernels'} supports head dims K, V "
                             f"{what}, got {name}={d} (K={K}, V={V}; impl='reference' has no limit)")


def _qk_args(K, scale, use_qk_l2norm, l2norm_eps):
    """(scale, use_qk_l2norm, l2norm_eps) as the kernels take them: scale (default K ** -0.5) a
    finite number, use_qk_l2norm a bool, l2norm_eps a number > 0 (as GDNConfig asks). They are
    static (they select the program), so a traced value is refused on both paths alike: the
    native call cannot take one, and the reference took "no" as True. Errors name the argument."""
    def number(name, x):
        if isinstance(x, jax.core.Tracer):
            raise TypeError(f"{name} must be a concrete number (a static argument: it selects the compiled "
                            f"program), got a traced value")
        try:
            v = float(x)
        except (TypeError, ValueError):
            raise TypeError(f"{name} must be a number, got {x!r}") from None
        if not np.isfinite(v):
            raise ValueError(f"{name} must be finite, got {x!r}")
        return v

    sc = float(K) ** -0.5 if scale is None else number("scale", scale)
    if not isinstance(use_qk_l2norm, (bool, np.bool_)):
        raise TypeError(f"use_qk_l2norm must be a bool, got {use_qk_l2norm!r}")
    eps = number("l2norm_eps", l2norm_eps)
    if eps <= 0:
        raise ValueError(f"l2norm_eps must be > 0, got {l2norm_eps!r}")
    return sc, bool(use_qk_l2norm), eps


def _native_qkv(q, k, v, mixed_qkv):
    """The q, k, v operands of a native call: the arrays, or three times the mixed [T, D] array
    they were sliced from (the kernels then read its rows in place: no split copies)."""
    if mixed_qkv is None:
        return q, k, v
    T, H, K = q.shape
    HV, V = v.shape[1:]
    if mixed_qkv.shape != (T, 2 * H * K + HV * V) or mixed_qkv.dtype != q.dtype:
        raise ValueError(f"_mixed_qkv must be [T, 2*H*K + HV*V] = [{T}, {2 * H * K + HV * V}] {q.dtype}, "
                         f"got {mixed_qkv.shape} {mixed_qkv.dtype}")
    return mixed_qkv, mixed_qkv, mixed_qkv


@_compiled_once
def chunk_gated_delta_rule_with_status(q, k, v, *, g, beta, ssm_state, query_start_loc, state_indices,
                                       has_initial_state, scale=None, use_qk_l2norm=True, l2norm_eps=1e-6,
                                       impl="auto", _mixed_qkv=None):
    """:func:`chunk_gated_delta_rule` returning ``(o, ssm_state, status int32[4])``.

    ``_mixed_qkv`` (internal, the serving steps): the [T, 2HK + HV V] array whose column blocks
    q, k, v are; the native kernel reads it in place instead of copies of the slices.
    """
    T, H, K, HV, V = C.check_qkv(q, k, v)
    N = C.check_ssm_state(ssm_state, HV, K, V)
    C.check_shape("g", g, (T, HV), "[T, HV]")
    C.check_dtype("g", g, C.ACT_DTYPES)
    C.check_shape("beta", beta, (T, HV), "[T, HV]")
    C.check_dtype("beta", beta, C.ACT_DTYPES)
    (S,) = C.check_rank("state_indices", state_indices, 1, "[S]")
    C.check_index("state_indices", state_indices, (S,), "[S]")
    C.check_index("query_start_loc", query_start_loc, (S + 1,), "[S + 1]")
    C.check_bool("has_initial_state", has_initial_state, (S,), "[S]")
    sc, use_qk_l2norm, l2norm_eps = _qk_args(K, scale, use_qk_l2norm, l2norm_eps)
    if resolve_impl(impl) == "native":
        _check_native_head_dims(K, V, chunked=True)
        return _native.chunk(*_native_qkv(q, k, v, _mixed_qkv), g, beta, ssm_state, query_start_loc, state_indices,
                             has_initial_state, scale=sc, eps=l2norm_eps, l2norm=use_qk_l2norm)
    status = C.status_slots_jnp(query_start_loc, state_indices, T, N)
    ref = _reference()

    def run():
        return ref.chunk_gated_delta_rule(q, k, v, g=g, beta=beta, ssm_state=ssm_state,
                                          query_start_loc=query_start_loc, state_indices=state_indices,
                                          has_initial_state=has_initial_state, scale=sc,
                                          use_qk_l2norm=use_qk_l2norm, l2norm_eps=l2norm_eps)

    o, st = _guarded(status, run, lambda: (jnp.zeros_like(v), ssm_state))
    return o, st, status


def chunk_gated_delta_rule(q, k, v, *, g, beta, ssm_state, query_start_loc, state_indices, has_initial_state,
                           scale=None, use_qk_l2norm=True, l2norm_eps=1e-6, impl="auto"):
    """Varlen chunked gated delta rule prefill over a pool of SSM states (native chunk size 64, or
    32 for sequences over 128 tokens where measured faster: ffi/README.md, "Chunk size").

    Args:
      q, k: [T, H, K]; v: [T, HV, V]; activation dtype. Value head h uses key head h // (HV // H).
      g: [T, HV] log-space decay; beta: [T, HV] (post-sigmoid), e.g. from fused_gdn_gating.
      ssm_state: [N, HV, K, V] (k-major per head), f32 or bf16.
      query_start_loc: [S + 1] int32; state_indices: [S] int32 (-1 = padding);
      has_initial_state: [S] bool (False: start from zeros, the slot's contents are ignored).
      scale: defaults to K ** -0.5; use_qk_l2norm / l2norm_eps: normalise q and k first.
    Returns:
      o: [T, HV, V] activation dtype; ssm_state with each named slot holding its final state.
    """
    o, st, status = chunk_gated_delta_rule_with_status(
        q, k, v, g=g, beta=beta, ssm_state=ssm_state, query_start_loc=query_start_loc,
        state_indices=state_indices, has_initial_state=has_initial_state, scale=scale,
        use_qk_l2norm=use_qk_l2norm, l2norm_eps=l2norm_eps, impl=impl)
    st = report_status("chunk_gated_delta_rule", status, st)
    return o, st


def _recurrent_common(q, k, v, a, b, A_log, dt_bias, ssm_state):
    T, H, K, HV, V = C.check_qkv(q, k, v)
    N = C.check_ssm_state(ssm_state, HV, K, V)
    C.check_shape("a", a, (T, HV), "[T, HV]")
    C.check_same_dtype("a", a, "q", q)
    C.check_shape("b", b, (T, HV), "[T, HV]")
    C.check_same_dtype("b", b, "q", q)
    C.check_gate_params(A_log, dt_bias, HV)
    return T, H, K, HV, V, N


@_compiled_once
def fused_sigmoid_gating_delta_rule_update_with_status(q, k, v, *, a, b, A_log, dt_bias, ssm_state, state_indices,
                                                       scale=None, use_qk_l2norm=True, l2norm_eps=1e-6,
                                                       impl="auto"):
    """:func:`fused_sigmoid_gating_delta_rule_update` returning ``(o, ssm_state, status)``."""
    B, H, K, HV, V, N = _recurrent_common(q, k, v, a, b, A_log, dt_bias, ssm_state)
    C.check_index("state_indices", state_indices, (B,), "[B] (one row per token)")
    sc, use_qk_l2norm, l2norm_eps = _qk_args(K, scale, use_qk_l2norm, l2norm_eps)
    qsl = jnp.arange(B + 1, dtype=jnp.int32)
    acc = jnp.ones((B,), jnp.int32)
    if resolve_impl(impl) == "native":
        _check_native_head_dims(K, V)
        return _native.recurrent(q, k, v, a, b, A_log, dt_bias, ssm_state, qsl, state_indices[:, None], acc,
                                 scale=sc, eps=l2norm_eps, l2norm=use_qk_l2norm)
    status = C.status_spec_jnp(qsl, state_indices[:, None], acc, B, N, 1, 1, slot_cols=True)
    ref = _reference()

    def run():
        return ref.fused_sigmoid_gating_delta_rule_update(
            q, k, v, a=a, b=b, A_log=A_log, dt_bias=dt_bias, ssm_state=ssm_state, state_indices=state_indices,
            scale=sc, use_qk_l2norm=use_qk_l2norm, l2norm_eps=l2norm_eps)

    o, st = _guarded(status, run, lambda: (jnp.zeros_like(v), ssm_state))
    return o, st, status


def fused_sigmoid_gating_delta_rule_update(q, k, v, *, a, b, A_log, dt_bias, ssm_state, state_indices, scale=None,
                                           use_qk_l2norm=True, l2norm_eps=1e-6, impl="auto"):
    """One decode step of the gated delta rule with fused gating, in place at ``state_indices``.

    Args:
      q, k: [B, H, K]; v: [B, HV, V]; a, b: [B, HV] (raw gate inputs); activation dtype.
      A_log, dt_bias: [HV]. ssm_state: [N, HV, K, V] f32 or bf16.
      state_indices: [B] int32 (-1 = padding row: zero output, nothing written).
    Returns:
      o: [B, HV, V]; ssm_state with slot ``state_indices[b]`` advanced by one token.
    """
    o, st, status = fused_sigmoid_gating_delta_rule_update_with_status(
        q, k, v, a=a, b=b, A_log=A_log, dt_bias=dt_bias, ssm_state=ssm_state, state_indices=state_indices,
        scale=scale, use_qk_l2norm=use_qk_l2norm, l2norm_eps=l2norm_eps, impl=impl)
    st = report_status("fused_sigmoid_gating_delta_rule_update", status, st)
    return o, st


@_compiled_once
def fused_sigmoid_gating_delta_rule_update_spec_with_status(q, k, v, *, a, b, A_log, dt_bias, ssm_state,
                                                            query_start_loc, spec_state_indices,
                                                            num_accepted_tokens, scale=None, use_qk_l2norm=True,
                                                            l2norm_eps=1e-6, impl="auto", _mixed_qkv=None):
    """:func:`fused_sigmoid_gating_delta_rule_update_spec` returning ``(o, ssm_state, status)``.

    ``_mixed_qkv``: as in :func:`chunk_gated_delta_rule_with_status`.
    """
    T, H, K, HV, V, N = _recurrent_common(q, k, v, a, b, A_log, dt_bias, ssm_state)
    S, cols = C.check_rank("spec_state_indices", spec_state_indices, 2, "[S, num_spec + 1]")
    C.check_index("spec_state_indices", spec_state_indices, (S, cols), "[S, num_spec + 1]")
    C.check_index("query_start_loc", query_start_loc, (S + 1,), "[S + 1]")
    C.check_index("num_accepted_tokens", num_accepted_tokens, (S,), "[S]")
    sc, use_qk_l2norm, l2norm_eps = _qk_args(K, scale, use_qk_l2norm, l2norm_eps)
    if resolve_impl(impl) == "native":
        _check_native_head_dims(K, V)
        return _native.recurrent(*_native_qkv(q, k, v, _mixed_qkv), a, b, A_log, dt_bias, ssm_state, query_start_loc,
                                 spec_state_indices, num_accepted_tokens, scale=sc, eps=l2norm_eps,
                                 l2norm=use_qk_l2norm)
    status = C.status_spec_jnp(query_start_loc, spec_state_indices, num_accepted_tokens, T, N, cols, cols,
                               slot_cols=True)
    ref = _reference()

    def run():
        return ref.fused_sigmoid_gating_delta_rule_update_spec(
            q, k, v, a=a, b=b, A_log=A_log, dt_bias=dt_bias, ssm_state=ssm_state, query_start_loc=query_start_loc,
            spec_state_indices=spec_state_indices, num_accepted_tokens=num_accepted_tokens, scale=sc,
            use_qk_l2norm=use_qk_l2norm, l2norm_eps=l2norm_eps)

    o, st = _guarded(status, run, lambda: (jnp.zeros_like(v), ssm_state))
    return o, st, status


def fused_sigmoid_gating_delta_rule_update_spec(q, k, v, *, a, b, A_log, dt_bias, ssm_state, query_start_loc,
                                                spec_state_indices, num_accepted_tokens, scale=None,
                                                use_qk_l2norm=True, l2norm_eps=1e-6, impl="auto"):
    """Speculative-decode verify step with fused gating (index-scatter state slots).

    Row i has tokens ``[query_start_loc[i], query_start_loc[i+1])`` (1 + its drafts,
    at most num_spec + 1). It starts from slot ``spec_state_indices[i, num_accepted_tokens[i]-1]``
    and writes the state after its token t into slot ``spec_state_indices[i, t]``. A row whose
    column 0 is -1 is padding.

    Args:
      q, k: [T, H, K]; v: [T, HV, V]; a, b: [T, HV]; A_log, dt_bias: [HV].
      ssm_state: [N, HV, K, V]; spec_state_indices: [S, num_spec + 1] int32;
      num_accepted_tokens: [S] int32 in [1, num_spec + 1]; query_start_loc: [S + 1] int32.
    Returns:
      o: [T, HV, V]; ssm_state with the per-token states scattered.
    """
    o, st, status = fused_sigmoid_gating_delta_rule_update_spec_with_status(
        q, k, v, a=a, b=b, A_log=A_log, dt_bias=dt_bias, ssm_state=ssm_state, query_start_loc=query_start_loc,
        spec_state_indices=spec_state_indices, num_accepted_tokens=num_accepted_tokens, scale=scale,
        use_qk_l2norm=use_qk_l2norm, l2norm_eps=l2norm_eps, impl=impl)
    st = report_status("fused_sigmoid_gating_delta_rule_update_spec", status, st)
    return o, st


# --- slot copies (index-scatter rollback) ---------------------------------------------------


@_compiled_once
def copy_slots_with_status(pool, *, src, dst, impl="auto"):
    """:func:`copy_slots` returning ``(pool, status int32[4])``."""
    if len(getattr(pool, "shape", ())) < 1:
        raise ValueError(f"pool must have a leading slot dimension [N, ...], got shape {getattr(pool, 'shape', ())}")
    C.check_byte_dtype("pool", pool.dtype)
    (S,) = C.check_rank("src", src, 1, "[S]")
    C.check_index("src", src, (S,), "[S]")
    C.check_index("dst", dst, (S,), "[S]")
    if resolve_impl(impl) == "native":
        return _native.copy_slots(pool, src, dst)
    status = C.status_copy_slots_jnp(src, dst, pool.shape[0])
    N = pool.shape[0]
    if N == 0:  # nothing to read or write (a named slot is refused by the status); no gather of row 0
        return pool, status
    write = (dst != C.PAD_SLOT_ID) & (status[0] == 0)
    moved = pool.at[jnp.where(write, dst, N)].set(pool[jnp.where(write, src, 0)], mode="drop")
    return moved, status


def copy_slots(pool, *, src, dst, impl="auto"):
    """Index-scatter rollback: ``pool[dst[i]] = pool[src[i]]`` for every row with ``dst[i] != -1``.

    Args:
      pool: [N, ...] cache pool of any dtype of 8 bits or more (e.g. ssm_state [N, HV, K, V]).
      src, dst: [S] int32 slots; a row with dst -1 is skipped. Each dst at most once, and no
        slot that one row reads may be written by another (the result would depend on order).
    Returns:
      the pool, updated in place when donated (native: a memcpy per row; no pass over the
      pool, also for bf16 pools, which a jnp scatter would convert whole on XLA:CPU).
    """
    pool, status = copy_slots_with_status(pool, src=src, dst=dst, impl=impl)
    return report_status("copy_slots", status, pool)
