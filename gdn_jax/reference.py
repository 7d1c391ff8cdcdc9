"""Pure-jnp reference implementation of the gdn_jax contract (spec/contract.md).

Everything here is jit-compatible: shapes are static, counts (sequence lengths, number
of accepted tokens, slot ids) are data. All arithmetic is float32 (matmuls with
``precision=HIGHEST``); storage dtypes (activations, pools) are only used at the edges.

Conventions shared by every function:

* ``PAD_SLOT_ID = -1`` marks a padding row: nothing is read or written for it and its
  output rows are zero. Tokens past ``query_start_loc[-1]`` are outputs of zero too.
* A slot that the call does not name is bit-identical afterwards (writes are scatters
  with ``mode="drop"``; padding writes are sent out of range rather than to index -1,
  which JAX would wrap to the last slot).
* No data validation happens here (indices in range, monotone ``query_start_loc``, no
  slot named twice): the caller (``ops.py``) owns that. Shapes are not checked either.
* A call with no tokens, no rows or an empty pool writes nothing and outputs zeros.

Public functions: ``fused_gdn_gating``, ``causal_conv1d_fwd``, ``causal_conv1d_update``,
``chunk_gated_delta_rule``, ``fused_sigmoid_gating_delta_rule_update``,
``fused_sigmoid_gating_delta_rule_update_spec``, ``gdn_token_scan`` (slow oracle) and the
NumPy plan builders ``scan_plan_prefill`` / ``scan_plan_decode`` / ``scan_plan_spec``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

PAD_SLOT_ID = -1
CHUNK_SIZE = 64
# The lowest gate the chunked form's in-chunk cumsum takes (the native chunk clamps the same,
# ffi/src/kernels/chunk.h kGateFloor): e^-110 is 0 in f32, so no decay across it changes.
GATE_FLOOR = -110.0
_HI = lax.Precision.HIGHEST
_F32 = jnp.float32

__all__ = [
    "PAD_SLOT_ID",
    "CHUNK_SIZE",
    "fused_gdn_gating",
    "causal_conv1d_fwd",
    "causal_conv1d_update",
    "chunk_gated_delta_rule",
    "fused_sigmoid_gating_delta_rule_update",
    "fused_sigmoid_gating_delta_rule_update_spec",
    "gdn_token_scan",
    "scan_plan_prefill",
    "scan_plan_decode",
    "scan_plan_spec",
]


# ---------------------------------------------------------------------------------------
# shared pieces
# ---------------------------------------------------------------------------------------


def _drop_index(idx, valid, size):
    """Index for a mode="drop" scatter: invalid entries go to ``size`` (out of range)."""
    return jnp.where(valid, idx, size).astype(jnp.int32)


def _safe_index(idx, valid):
    """Index for a gather whose result is masked anyway: invalid entries read slot 0."""
    return jnp.where(valid, idx, 0).astype(jnp.int32)


def _writes_nothing(*arrays) -> bool:
    """True when a leading dim is 0: no tokens, no rows or an empty pool (then every row is
    padding). Such a call writes nothing and outputs zeros, as the kernels do; the callers
    return early because the gathers below have no empty form."""
    return any(a.shape[0] == 0 for a in arrays)


def _token_rows(query_start_loc, T):
    """Row id, position in row and row validity of every token under ``query_start_loc``.

    Returns (row [T] int32 clipped to [0, S), pos [T] int32, covered [T] bool) where
    covered means qsl[0] <= t < qsl[-1]. Zero-length rows own no token.
    """
    qsl = query_start_loc.astype(jnp.int32)
    S = qsl.shape[0] - 1
    t = jnp.arange(T, dtype=jnp.int32)
    row = jnp.searchsorted(qsl, t, side="right").astype(jnp.int32) - 1
    covered = (row >= 0) & (row < S)
    row = jnp.clip(row, 0, max(S - 1, 0))
    pos = t - qsl[row]
    return row, pos, covered


def _softplus(x):
    # softplus(x) = x if x > 20 else log1p(exp(x)); the min() keeps exp finite on the
    # unused branch so no inf/nan leaks through jnp.where (matters for gradients too).
    return jnp.where(x > 20.0, x, jnp.log1p(jnp.exp(jnp.minimum(x, 20.0))))


def _l2norm(x, eps):
    return x * lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


def _prep_qk(q, k, HV, scale, use_qk_l2norm, eps):
    """f32 q_hat (normalised, scaled) and k_hat, repeated from H key heads to HV value heads.

    q, k [..., H, K] -> [..., HV, K]; value head h uses key head h // (HV // H).
    """
    K = q.shape[-1]
    H = q.shape[-2]
    if scale is None:
        scale = K ** -0.5
    q = q.astype(_F32)
    k = k.astype(_F32)
    if use_qk_l2norm:
        q = _l2norm(q, eps)
        k = _l2norm(k, eps)
    q = q * jnp.asarray(scale, _F32)
    G = HV // H
    if G > 1:
        q = jnp.repeat(q, G, axis=-2)
        k = jnp.repeat(k, G, axis=-2)
    return q, k


def _delta_step(S, q_hat, k_hat, v, g, beta):
    """One recurrence step for all value heads, f32.

    S [HV, K, V]; q_hat, k_hat [HV, K]; v [HV, V]; g, beta [HV].
    Returns (S_new [HV, K, V], o [HV, V]).
    """
    S = jnp.exp(g)[:, None, None] * S
    kS = jnp.einsum("hk,hkv->hv", k_hat, S, precision=_HI)
    delta = beta[:, None] * (v - kS)
    S = S + k_hat[:, :, None] * delta[:, None, :]
    o = jnp.einsum("hk,hkv->hv", q_hat, S, precision=_HI)
    return S, o


# ---------------------------------------------------------------------------------------
# gating
# ---------------------------------------------------------------------------------------


def fused_gdn_gating(a, b, *, A_log, dt_bias):
    """Gates of the gated delta rule.

    Args:
      a, b: [T, HV], activation dtype.
      A_log: [HV] float32.
      dt_bias: [HV] float32 or activation dtype (upcast).
    Returns:
      (g, beta): both float32 [T, HV]; g = -exp(A_log) * softplus(a + dt_bias)
      (threshold 20), beta = sigmoid(b). beta stays float32 on purpose.
    """
    x = a.astype(_F32) + dt_bias.astype(_F32)
    g = -jnp.exp(A_log.astype(_F32)) * _softplus(x)
    beta = jax.nn.sigmoid(b.astype(_F32))
    return g, beta


def gated_rms_norm(o, z, *, weight, eps):
    """Gated RMSNorm per value head, as transformers' ``Qwen3NextRMSNormGated``.

    Args:
      o, z: [..., V], activation dtype.
      weight: [V] (cast to o's dtype).
      eps: float > 0.
    Returns:
      [..., V] o's dtype: ``n = o * rsqrt(mean(o^2) + eps)`` in f32, cast to o's dtype, times
      ``weight``; then times ``silu(z)`` in f32 and cast back.
    """
    dt = jnp.dtype(o.dtype)
    x = o.astype(_F32)
    n = _round_to(x * lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps), dt)
    m = _round_to(weight.astype(dt).astype(_F32) * n, dt)   # weight * n in dt: exact in f32, then rounded
    zf = z.astype(_F32)
    return (m * (zf * jax.nn.sigmoid(zf))).astype(dt)


def _round_to(x32, dt):
    """f32 x rounded to dt's precision, kept f32. A reduce_precision, not a convert pair:
    under jit XLA drops f32 -> bf16 -> f32 converts (excess precision allowed), which left the
    weight product unrounded (a quarter of bf16 outputs one step off transformers')."""
    if dt == jnp.dtype(_F32):
        return x32
    fi = jnp.finfo(dt)
    return lax.reduce_precision(x32, exponent_bits=fi.nexp, mantissa_bits=fi.nmant)


# ---------------------------------------------------------------------------------------
# causal conv1d
# ---------------------------------------------------------------------------------------


def _check_layout(layout):
    if layout not in ("SD", "DS"):
        raise ValueError(f"conv_state_layout must be 'SD' or 'DS', got {layout!r}")


def _state_rows(conv_state, slot, row, layout):
    """Gather conv_state rows as [..., D] f32 for matching index arrays slot, row."""
    if layout == "SD":
        return conv_state[slot, row].astype(_F32)
    return conv_state[slot, :, row].astype(_F32)


def _scatter_state_rows(conv_state, slot, row, vals, layout):
    """conv_state[slot, row] = vals ([..., D]); out-of-range slots are dropped."""
    vals = vals.astype(conv_state.dtype)
    if layout == "SD":
        return conv_state.at[slot, row].set(vals, mode="drop")
    # [N, D, L]: advanced indices separated by a slice put their dims first, so the
    # update has the same [..., D] shape as in the SD case.
    return conv_state.at[slot, :, row].set(vals, mode="drop")


def _conv_apply(x32, taps, weight, bias, activation, out_mask):
    """y_t = act(bias + sum_i w[:, i] * taps[i][t]); taps[i] [T, D] f32 is x~[t + i]."""
    w = weight.astype(_F32)
    acc = jnp.zeros_like(x32) if bias is None else jnp.broadcast_to(
        bias.astype(_F32), x32.shape)
    for i, tap in enumerate(taps):
        acc = acc + w[:, i] * tap
    if activation == "silu":
        acc = acc * jax.nn.sigmoid(acc)
    elif activation is not None:
        raise ValueError(f"activation must be 'silu' or None, got {activation!r}")
    return jnp.where(out_mask[:, None], acc, 0.0)


def causal_conv1d_fwd(x, *, weight, bias, conv_state, query_start_loc, state_indices,
                      has_initial_state, activation="silu", conv_state_layout="SD"):
    """Varlen causal depthwise conv1d for prefill, with a pooled conv state.

    Args:
      x: [T, D] activation dtype (bf16 or f32); raw pre-conv inputs.
      weight: [D, W]; tap W-1 multiplies the current token.
      bias: [D] or None.
      conv_state: [N, L, D] ("SD") or [N, D, L] ("DS"), L >= W-1, activation dtype.
      query_start_loc: [S+1] int32; sequence s owns tokens [qsl[s], qsl[s+1]).
      state_indices: [S] int32 slot per sequence, -1 = padding row.
      has_initial_state: [S] bool; without it the prior is zeros (stale slot ignored).
      activation: "silu" or None.
      conv_state_layout: "SD" or "DS".
    Returns:
      (y [T, D] in x.dtype, conv_state): y_t = act(bias + sum_i w[:, i] x~[t+i]) over
      x~ = prior ++ x_seq; rows [0, W-1) of each named slot then hold the last W-1 raw
      inputs of prior ++ x_seq (rows >= W-1 untouched). Zero-length sequences change
      nothing; padding rows and uncovered tokens give zero output. Math in f32.
    """
    _check_layout(conv_state_layout)
    T, D = x.shape
    W = weight.shape[1]
    N = conv_state.shape[0]
    S = state_indices.shape[0]
    if _writes_nothing(x, state_indices, conv_state):
        return jnp.zeros_like(x), conv_state
    qsl = query_start_loc.astype(jnp.int32)
    slots = state_indices.astype(jnp.int32)
    has_init = has_initial_state.astype(bool)
    x32 = x.astype(_F32)

    row, pos, covered = _token_rows(qsl, T)
    slot_t = slots[row]
    live_t = covered & (slot_t != PAD_SLOT_ID)
    init_t = has_init[row] & live_t
    gslot_t = _safe_index(slot_t, init_t)
    t_idx = jnp.arange(T, dtype=jnp.int32)

    taps = []
    for i in range(W):
        m = W - 1 - i  # tap i looks m tokens back
        from_x = x32[jnp.clip(t_idx - m, 0, T - 1)]
        prow = jnp.clip(W - 1 + pos - m, 0, max(W - 2, 0))
        from_prior = jnp.where(init_t[:, None],
                               _state_rows(conv_state, gslot_t, prow, conv_state_layout),
                               0.0) if W > 1 else jnp.zeros_like(x32)
        taps.append(jnp.where((pos >= m)[:, None], from_x, from_prior))
    y = _conv_apply(x32, taps, weight, bias, activation, live_t).astype(x.dtype)

    if W == 1:
        return y, conv_state
    # New rows r in [0, W-1) per sequence: entry n + r of x~ (length W-1+n).
    n = qsl[1:] - qsl[:-1]  # [S]
    r = jnp.arange(W - 1, dtype=jnp.int32)
    j = n[:, None] + r[None, :]  # index into x~  [S, W-1]
    from_x_idx = jnp.clip(qsl[:-1, None] + j - (W - 1), 0, T - 1)
    from_x = x32[from_x_idx]  # [S, W-1, D]
    prow = jnp.clip(j, 0, W - 2)
    gslot = _safe_index(slots, has_init & (slots != PAD_SLOT_ID))
    from_prior = jnp.where(has_init[:, None, None],
                           _state_rows(conv_state, gslot[:, None], prow, conv_state_layout),
                           0.0)
    new_rows = jnp.where((j >= W - 1)[:, :, None], from_x, from_prior)
    write = (slots != PAD_SLOT_ID) & (n > 0)
    wslot = _drop_index(slots, write, N)
    conv_state = _scatter_state_rows(conv_state, wslot[:, None],
                                     jnp.broadcast_to(r[None, :], (S, W - 1)),
                                     new_rows, conv_state_layout)
    return y, conv_state


def causal_conv1d_update(x, *, weight, bias, conv_state, state_indices, activation="silu",
                         num_accepted_tokens=None, query_start_loc=None,
                         conv_state_layout="SD"):
    """Causal conv1d for decode and spec verify: a rolling buffer per slot.

    Args:
      x: [T, D] activation dtype, raw pre-conv inputs.
      weight: [D, W] (W >= 2); bias: [D] or None.
      conv_state: [N, L, D] ("SD") or [N, D, L] ("DS"), activation dtype.
      state_indices: [B] int32, the buffer slot of each row (spec: column 0 of
        spec_state_indices); -1 = padding row.
      activation: "silu" or None.
      num_accepted_tokens: [B] int32 in [1, L-W+2] or None (= all ones).
      query_start_loc: [B+1] int32 or None (= one token per row, B == T).
      conv_state_layout: "SD" or "DS".
    Returns:
      (y [T, D] in x.dtype, conv_state). Per row with q > 0 tokens: window = slot rows
      [acc-1, acc-1+W-1); y = act(conv over window ++ x_row); afterwards rows
      [0, W-2+q) hold window[1:] ++ x_row (needs W-2+q <= L), other rows untouched.
      Plain decode is acc = 1, q = 1. Zero-length and padding rows change nothing;
      their (and uncovered tokens') outputs are zero.
    """
    _check_layout(conv_state_layout)
    T, D = x.shape
    W = weight.shape[1]
    if W < 2:
        raise ValueError(f"causal_conv1d_update needs conv width >= 2, got {W}")
    if _writes_nothing(x, state_indices, conv_state):
        return jnp.zeros_like(x), conv_state
    N = conv_state.shape[0]
    L = conv_state.shape[1] if conv_state_layout == "SD" else conv_state.shape[2]
    B = state_indices.shape[0]
    slots = state_indices.astype(jnp.int32)
    if query_start_loc is None:
        qsl = jnp.arange(B + 1, dtype=jnp.int32)
    else:
        qsl = query_start_loc.astype(jnp.int32)
    if num_accepted_tokens is None:
        acc = jnp.ones((B,), jnp.int32)
    else:
        acc = num_accepted_tokens.astype(jnp.int32)
    x32 = x.astype(_F32)

    row, pos, covered = _token_rows(qsl, T)
    slot_t = slots[row]
    live_t = covered & (slot_t != PAD_SLOT_ID)
    gslot_t = _safe_index(slot_t, live_t)
    acc_t = acc[row]
    t_idx = jnp.arange(T, dtype=jnp.int32)

    taps = []
    for i in range(W):
        m = W - 1 - i
        from_x = x32[jnp.clip(t_idx - m, 0, T - 1)]
        wrow = jnp.clip(acc_t - 1 + W - 1 + pos - m, 0, L - 1)  # row of the buffer
        from_win = _state_rows(conv_state, gslot_t, wrow, conv_state_layout)
        taps.append(jnp.where((pos >= m)[:, None], from_x, from_win))
    y = _conv_apply(x32, taps, weight, bias, activation, live_t).astype(x.dtype)

    # New buffer rows r in [0, W-2+q): (window[1:] ++ x_row)[r].
    q = qsl[1:] - qsl[:-1]  # [B]
    r = jnp.arange(L, dtype=jnp.int32)
    live = (slots != PAD_SLOT_ID) & (q > 0)
    gslot = _safe_index(slots, live)
    old_rows = _state_rows(conv_state, gslot[:, None],
                           jnp.clip(acc[:, None] + r[None, :], 0, L - 1), conv_state_layout)
    from_x = x32[jnp.clip(qsl[:-1, None] + r[None, :] - (W - 2), 0, T - 1)]
    new_rows = jnp.where((r[None, :] < W - 2)[:, :, None], old_rows, from_x)
    write = live[:, None] & (r[None, :] < (W - 2 + q)[:, None])  # [B, L]
    wslot = _drop_index(jnp.broadcast_to(slots[:, None], (B, L)), write, N)
    conv_state = _scatter_state_rows(conv_state, wslot, jnp.broadcast_to(r, (B, L)),
                                     new_rows, conv_state_layout)
    return y, conv_state


# ---------------------------------------------------------------------------------------
# chunked prefill (WY form)
# ---------------------------------------------------------------------------------------


def _unit_lower_solve(A, rhs):
    """x with (I + A) x = rhs; A [HV, C, C] strictly lower, rhs [HV, C, D]: forward substitution,
    row by row. Not ``jax.scipy.linalg.solve_triangular``: jaxlib's CPU trsm waits, on a thread of
    XLA's pool, for tasks it queued to that same pool, so programs of several CPU devices running
    at once (a mesh of more devices than cores) all wait there for good."""
    def row(i, x):
        xi = rhs[:, i] - jnp.einsum("hj,hjd->hd", A[:, i], x, precision=_HI)  # rows >= i of x still 0
        return x.at[:, i].set(xi)
    return lax.fori_loop(0, A.shape[-1], row, jnp.zeros_like(rhs))


def _chunk_body(S0, q_hat, k_hat, v, g, beta):
    """One chunk of C tokens for all value heads, f32 WY form.

    S0 [HV, K, V]; q_hat, k_hat [C, HV, K]; v [C, HV, V]; g, beta [C, HV] (zero on
    padded positions, which then leave the state unchanged).
    Returns (S_end [HV, K, V], o [C, HV, V]).

    With G = cumsum(g), Gamma_ij = exp(G_i - G_j) (j <= i, else 0):
      A = strict_lower(diag(beta) K K^T * Gamma),  T = (I + A)^-1
      U = T diag(beta) V,  W = T diag(beta e^G) K,  V_new = U - W S0
      O = diag(e^G) Q S0 + lower(Q K^T * Gamma) V_new
      S_end = e^{G_last} S0 + (K * e^{G_last - G})^T V_new
    """
    C = g.shape[0]
    qh = jnp.swapaxes(q_hat, 0, 1)  # [HV, C, K]
    kh = jnp.swapaxes(k_hat, 0, 1)
    vh = jnp.swapaxes(v, 0, 1)  # [HV, C, V]
    # Gates below GATE_FLOOR raised to it: decays across them stay 0 (e^-110 underflows f32),
    # and the f32 cumsum keeps the gates after them (next to -1e16 they vanished: decays of 1).
    gh = jnp.maximum(g.T, GATE_FLOOR)  # [HV, C]; NaN stays NaN
    bh = beta.T
    G = jnp.cumsum(gh, axis=-1)
    ii = jnp.arange(C)[:, None]
    jj = jnp.arange(C)[None, :]
    lower = ii >= jj
    strict = ii > jj
    diff = G[:, :, None] - G[:, None, :]  # [HV, C, C]
    Gamma = jnp.exp(jnp.where(lower[None], diff, -jnp.inf))

    KK = jnp.einsum("hik,hjk->hij", kh, kh, precision=_HI)
    A = jnp.where(strict[None], bh[:, :, None] * KK * Gamma, 0.0)
    rhs = jnp.concatenate([bh[:, :, None] * vh,
                           (bh * jnp.exp(G))[:, :, None] * kh], axis=-1)
    sol = _unit_lower_solve(A, rhs)
    Vd = vh.shape[-1]
    U, Wm = sol[..., :Vd], sol[..., Vd:]
    V_new = U - jnp.einsum("hck,hkv->hcv", Wm, S0, precision=_HI)

    QK = jnp.einsum("hik,hjk->hij", qh, kh, precision=_HI) * Gamma  # zero above diag
    o = (jnp.exp(G)[:, :, None] * jnp.einsum("hck,hkv->hcv", qh, S0, precision=_HI)
         + jnp.einsum("hij,hjv->hiv", QK, V_new, precision=_HI))
    G_last = G[:, -1]
    k_dec = kh * jnp.exp(G_last[:, None] - G)[:, :, None]
    S_end = (jnp.exp(G_last)[:, None, None] * S0
             + jnp.einsum("hck,hcv->hkv", k_dec, V_new, precision=_HI))
    return S_end, jnp.swapaxes(o, 0, 1)


def chunk_gated_delta_rule(q, k, v, *, g, beta, ssm_state, query_start_loc, state_indices,
                           has_initial_state, scale=None, use_qk_l2norm=True,
                           l2norm_eps=1e-6):
    """Varlen chunked (WY, chunk 64) gated delta rule for prefill, on a state pool.

    Args:
      q, k: [T, H, K] activation dtype.
      v: [T, HV, V] activation dtype; HV % H == 0, value head h uses key head h // (HV//H).
      g, beta: [T, HV] float32 (from ``fused_gdn_gating``).
      ssm_state: [N, HV, K, V] float32 or bfloat16, k-major.
      query_start_loc: [S+1] int32; state_indices: [S] int32 (-1 = padding row);
      has_initial_state: [S] bool (False: start from zeros, the slot's contents ignored).
      scale: q scale after the norm, default K**-0.5.
      use_qk_l2norm, l2norm_eps: l2norm(x) = x * rsqrt(sum x^2 + eps) on q and k.
    Returns:
      (o [T, HV, V] in q.dtype, ssm_state): every sequence with tokens and a real slot
      has its final state (cast to the pool dtype once) written to its slot. Zero-length
      sequences change nothing; padding rows and uncovered tokens output zeros.

    Implementation: sequences are packed, each padded to a multiple of 64, into a static
    stream of (T + S*63) // 64 chunks; one ``lax.scan`` over the chunks carries the f32
    state, restarting it from the slot (or zeros) at each sequence's first chunk.
    """
    T, H, K = q.shape
    HV, V = v.shape[1], v.shape[2]
    N = ssm_state.shape[0]
    S = state_indices.shape[0]
    C = CHUNK_SIZE
    if _writes_nothing(v, state_indices, ssm_state):
        return jnp.zeros(v.shape, q.dtype), ssm_state
    NC = max((T + S * (C - 1)) // C, 1)  # >= sum_s ceil(n_s / C)
    qsl = query_start_loc.astype(jnp.int32)
    slots = state_indices.astype(jnp.int32)
    has_init = has_initial_state.astype(bool)

    q_hat, k_hat = _prep_qk(q, k, HV, scale, use_qk_l2norm, l2norm_eps)
    v32 = v.astype(_F32)
    g32 = g.astype(_F32)
    b32 = beta.astype(_F32)

    # Sequence geometry; padding rows take no chunks.
    n = jnp.where(slots != PAD_SLOT_ID, qsl[1:] - qsl[:-1], 0)  # [S]
    nchunks = (n + C - 1) // C
    chunk_end = jnp.cumsum(nchunks)
    chunk_off = chunk_end - nchunks  # first chunk of each sequence

    # Token -> packed position.
    row, pos, covered = _token_rows(qsl, T)
    live_t = covered & (slots[row] != PAD_SLOT_ID)
    P = chunk_off[row] * C + pos
    Pd = _drop_index(P, live_t, NC * C)

    def pack(a):
        z = jnp.zeros((NC * C,) + a.shape[1:], a.dtype)
        z = z.at[Pd].set(a, mode="drop")
        return z.reshape((NC, C) + a.shape[1:])

    qp, kp, vp, gp, bp = (pack(a) for a in (q_hat, k_hat, v32, g32, b32))

    # Chunk -> sequence, first-chunk flag, initial-state source.
    c_idx = jnp.arange(NC, dtype=jnp.int32)
    seq_c = jnp.clip(jnp.searchsorted(chunk_end, c_idx, side="right"), 0, max(S - 1, 0))
    seq_c = seq_c.astype(jnp.int32)
    first_c = (c_idx == chunk_off[seq_c]) & (c_idx < chunk_end[seq_c])
    init_c = first_c & has_init[seq_c]
    slot_c = _safe_index(slots[seq_c], init_c)

    last_c = (c_idx == chunk_end[seq_c] - 1) & (c_idx >= chunk_off[seq_c])

    def body(carry, xs):
        S_carry, finals = carry
        qc, kc, vc, gc, bc, is_first, use_init, slot, is_last, seq = xs
        S_init = jnp.where(use_init, ssm_state[slot].astype(_F32), 0.0)
        S_in = jnp.where(is_first, S_init, S_carry)
        S_out, o_c = _chunk_body(S_in, qc, kc, vc, gc, bc)
        # Keep each sequence's final state (reads above always see the original pool).
        kept = jnp.where(is_last, S_out, finals[seq])
        finals = lax.dynamic_update_index_in_dim(finals, kept, seq, axis=0)
        return (S_out, finals), o_c

    carry0 = (jnp.zeros((HV, K, V), _F32), jnp.zeros((max(S, 1), HV, K, V), _F32))
    (_, finals), o_p = lax.scan(
        body, carry0, (qp, kp, vp, gp, bp, first_c, init_c, slot_c, last_c, seq_c))

    o = o_p.reshape((NC * C, HV, V))[jnp.clip(P, 0, NC * C - 1)]
    o = jnp.where(live_t[:, None, None], o, 0.0).astype(q.dtype)

    write = (slots != PAD_SLOT_ID) & (n > 0)
    finals = finals[:S].astype(ssm_state.dtype)  # one rounding per call for a bf16 pool
    ssm_state = ssm_state.at[_drop_index(slots, write, N)].set(finals, mode="drop")
    return o, ssm_state


# ---------------------------------------------------------------------------------------
# decode and spec verify (token recurrence, gating fused)
# ---------------------------------------------------------------------------------------


def fused_sigmoid_gating_delta_rule_update(q, k, v, *, a, b, A_log, dt_bias, ssm_state,
                                           state_indices, scale=None, use_qk_l2norm=True,
                                           l2norm_eps=1e-6):
    """Decode: one token per row, gating fused, state updated in place at its slot.

    Args:
      q, k: [B, H, K]; v: [B, HV, V]; a, b: [B, HV] (activation dtype).
      A_log: [HV] f32; dt_bias: [HV] f32 or activation dtype.
      ssm_state: [N, HV, K, V] f32 or bf16, k-major.
      state_indices: [B] int32, -1 = padding row.
      scale, use_qk_l2norm, l2norm_eps: as in ``chunk_gated_delta_rule``.
    Returns:
      (o [B, HV, V] in q.dtype, ssm_state). Padding rows output zeros and write nothing.
    """
    B, HV, V = v.shape
    N = ssm_state.shape[0]
    if _writes_nothing(v, state_indices, ssm_state):
        return jnp.zeros(v.shape, q.dtype), ssm_state
    g, beta = fused_gdn_gating(a, b, A_log=A_log, dt_bias=dt_bias)
    q_hat, k_hat = _prep_qk(q, k, HV, scale, use_qk_l2norm, l2norm_eps)
    slots = state_indices.astype(jnp.int32)
    live = slots != PAD_SLOT_ID
    S0 = ssm_state[_safe_index(slots, live)].astype(_F32)
    S1, o = jax.vmap(_delta_step)(S0, q_hat, k_hat, v.astype(_F32), g, beta)
    o = jnp.where(live[:, None, None], o, 0.0).astype(q.dtype)
    ssm_state = ssm_state.at[_drop_index(slots, live, N)].set(
        S1.astype(ssm_state.dtype), mode="drop")
    return o, ssm_state


def fused_sigmoid_gating_delta_rule_update_spec(q, k, v, *, a, b, A_log, dt_bias,
                                                ssm_state, query_start_loc,
                                                spec_state_indices, num_accepted_tokens,
                                                scale=None, use_qk_l2norm=True,
                                                l2norm_eps=1e-6):
    """Speculative-decode verify step: index-scattered per-token states.

    Args:
      q, k: [T, H, K]; v: [T, HV, V]; a, b: [T, HV] (activation dtype).
      A_log: [HV] f32; dt_bias: [HV] f32 or activation dtype.
      ssm_state: [N, HV, K, V] f32 or bf16, k-major.
      query_start_loc: [S+1] int32; row i owns tokens [qsl[i], qsl[i+1]), q_i <= M.
      spec_state_indices: [S, M] int32 (M = num_spec + 1); a row is padding iff its
        column 0 is -1.
      num_accepted_tokens: [S] int32 in [1, M].
      scale, use_qk_l2norm, l2norm_eps: as in ``chunk_gated_delta_rule``.
    Returns:
      (o [T, HV, V] in q.dtype, ssm_state). Row i starts from slot
      spec_state_indices[i, acc-1]; the state after its token t is stored (in the pool
      dtype) to spec_state_indices[i, t]. Token t+1 continues from the f32 state, not
      from the stored value: a bf16 pool gets one rounding per stored state and the
      row's last state equals a prefill of the same tokens (the native kernel does the
      same).
    """
    T, HV, V = v.shape
    N = ssm_state.shape[0]
    S, M = spec_state_indices.shape
    if _writes_nothing(v, spec_state_indices, ssm_state):
        return jnp.zeros(v.shape, q.dtype), ssm_state
    qsl = query_start_loc.astype(jnp.int32)
    idx = spec_state_indices.astype(jnp.int32)
    acc = num_accepted_tokens.astype(jnp.int32)
    g, beta = fused_gdn_gating(a, b, A_log=A_log, dt_bias=dt_bias)
    q_hat, k_hat = _prep_qk(q, k, HV, scale, use_qk_l2norm, l2norm_eps)
    v32 = v.astype(_F32)

    row_live = idx[:, 0] != PAD_SLOT_ID
    qlen = qsl[1:] - qsl[:-1]
    t_ = jnp.arange(M, dtype=jnp.int32)
    tok_live = row_live[:, None] & (t_[None, :] < qlen[:, None])  # [S, M]
    tok = jnp.clip(qsl[:-1, None] + t_[None, :], 0, T - 1)  # [S, M]

    start_slot = idx[jnp.arange(S), jnp.clip(acc - 1, 0, M - 1)]
    S_init = ssm_state[_safe_index(start_slot, row_live)].astype(_F32)  # [S, HV, K, V]

    def body(S_rows, t):
        tk = tok[:, t]
        live = tok_live[:, t]
        S_new, o = jax.vmap(_delta_step)(S_rows, q_hat[tk], k_hat[tk], v32[tk], g[tk],
                                         beta[tk])
        S_rows = jnp.where(live[:, None, None, None], S_new, S_rows)
        return S_rows, (o, S_new)

    _, (o_steps, S_steps) = lax.scan(body, S_init, t_)  # [M, S, ...]
    o_sm = jnp.swapaxes(o_steps, 0, 1)  # [S, M, HV, V]
    S_sm = jnp.swapaxes(S_steps, 0, 1)  # [S, M, HV, K, V]

    tok_d = _drop_index(tok, tok_live, T)
    o = jnp.zeros((T, HV, V), _F32).at[tok_d].set(o_sm, mode="drop").astype(q.dtype)
    write = tok_live & (idx != PAD_SLOT_ID)
    ssm_state = ssm_state.at[_drop_index(idx, write, N)].set(
        S_sm.astype(ssm_state.dtype), mode="drop")
    return o, ssm_state


# ---------------------------------------------------------------------------------------
# token-scan oracle
# ---------------------------------------------------------------------------------------


def gdn_token_scan(q, k, v, *, g, beta, ssm_state, read_slot, write_slot, reset, scale=None,
                   use_qk_l2norm=True, l2norm_eps=1e-6):
    """Slow, obviously-correct token-by-token oracle whose scan carry is the whole pool.

    Args:
      q, k: [T, H, K]; v: [T, HV, V]; g, beta: [T, HV] f32.
      ssm_state: [N, HV, K, V] f32 or bf16.
      read_slot, write_slot: [T] int32; reset: [T] bool.
      scale, use_qk_l2norm, l2norm_eps: as in ``chunk_gated_delta_rule``.
    Returns:
      (o [T, HV, V] in q.dtype, ssm_state). Token t is padding (zero output, nothing
      written) iff read_slot[t] == -1 or write_slot[t] == -1. Otherwise it takes the
      state zeros if reset[t] else pool[read_slot[t]], applies one recurrence step and
      stores the result to pool[write_slot[t]] (in the pool dtype: a bf16 pool is
      rounded after every token, the literal memory model). Build the plans with
      ``scan_plan_prefill`` / ``scan_plan_decode`` / ``scan_plan_spec``.
    """
    if _writes_nothing(v, ssm_state):
        return jnp.zeros(v.shape, q.dtype), ssm_state
    HV = v.shape[1]
    q_hat, k_hat = _prep_qk(q, k, HV, scale, use_qk_l2norm, l2norm_eps)
    v32 = v.astype(_F32)
    g32 = g.astype(_F32)
    b32 = beta.astype(_F32)
    rs = read_slot.astype(jnp.int32)
    ws = write_slot.astype(jnp.int32)
    rst = reset.astype(bool)

    def body(pool, xs):
        qt, kt, vt, gt, bt, r, w, z = xs
        live = (r != PAD_SLOT_ID) & (w != PAD_SLOT_ID)
        S = jnp.where(z, 0.0, pool[jnp.maximum(r, 0)].astype(_F32))
        S_new, o = _delta_step(S, qt, kt, vt, gt, bt)
        wi = jnp.maximum(w, 0)
        stored = jnp.where(live, S_new.astype(pool.dtype), pool[wi])
        pool = lax.dynamic_update_index_in_dim(pool, stored, wi, axis=0)
        return pool, jnp.where(live, o, 0.0)

    pool, o = lax.scan(body, ssm_state, (q_hat, k_hat, v32, g32, b32, rs, ws, rst))
    return o.astype(q.dtype), pool


def scan_plan_prefill(query_start_loc, state_indices, has_initial_state, T):
    """(read_slot, write_slot, reset) [T] for a varlen prefill (NumPy, host side).

    read = write = the sequence's slot; reset on the first token of a sequence without
    initial state; tokens of padding rows and past qsl[-1] are -1.
    """
    qsl = np.asarray(query_start_loc)
    read = np.full((T,), PAD_SLOT_ID, np.int32)
    reset = np.zeros((T,), bool)
    for s in range(len(state_indices)):
        lo, hi = int(qsl[s]), int(qsl[s + 1])
        read[lo:hi] = int(state_indices[s])
        if hi > lo and not bool(has_initial_state[s]):
            reset[lo] = True
    return read, read.copy(), reset


def scan_plan_decode(state_indices):
    """(read_slot, write_slot, reset) [B] for decode: read = write = slot, no reset."""
    s = np.asarray(state_indices, np.int32)
    return s.copy(), s.copy(), np.zeros(s.shape, bool)


def scan_plan_spec(query_start_loc, spec_state_indices, num_accepted_tokens, T):
    """(read_slot, write_slot, reset) [T] for a spec verify step (NumPy, host side).

    Token 0 of row i reads column acc-1 and writes column 0; token t > 0 reads column
    t-1 and writes column t. Tokens of padding rows (column 0 == -1) are -1.
    """
    qsl = np.asarray(query_start_loc)
    idx = np.asarray(spec_state_indices)
    read = np.full((T,), PAD_SLOT_ID, np.int32)
    write = np.full((T,), PAD_SLOT_ID, np.int32)
    for i in range(idx.shape[0]):
        if int(idx[i, 0]) == PAD_SLOT_ID:
            continue
        lo, hi = int(qsl[i]), int(qsl[i + 1])
        for t in range(hi - lo):
            read[lo + t] = idx[i, int(num_accepted_tokens[i]) - 1] if t == 0 else idx[i, t - 1]
            write[lo + t] = idx[i, t]
    return read, write, np.zeros((T,), bool)
