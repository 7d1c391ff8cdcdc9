"""Independent float64 evaluation of the gdn_jax contract (spec/contract.md).

This module is the yardstick every implementation (native kernels on every ISA, the
pure-jnp reference) is measured against. It is written straight from the formulas in
the contract, token by token and sequence by sequence, with plain Python loops: it is
meant to be obviously correct, not fast. It shares no code with ``gdn_jax``.

Conventions
-----------
* Every argument is a NumPy array. Activations that are bf16 in the test are passed here
  already upcast (exact bf16 values as float64); everything is converted to float64.
* Index arrays are integers; ``-1`` (PAD_SLOT_ID) marks a padding row: nothing is read or
  written for it and its output rows are zero.
* Pools are returned as new float64 arrays; the inputs are never modified.
* No rounding to any storage dtype is modelled: this is the exact math. (A bf16 state
  pool is compared against these values with the budget for its roundings.)
"""

from __future__ import annotations

import numpy as np

PAD_SLOT_ID = -1

__all__ = [
    "PAD_SLOT_ID",
    "bf16_round",
    "rel_rmse",
    "gating_f64",
    "conv_fwd_f64",
    "conv_update_f64",
    "gdn_recurrent_f64",
    "prefill_f64",
    "decode_f64",
    "spec_f64",
]


# ---------------------------------------------------------------------------------------
# small helpers
# ---------------------------------------------------------------------------------------


def _f64(x):
    return None if x is None else np.asarray(x, dtype=np.float64)


def bf16_round(x, dtype=np.float64):
    """Round every element of ``x`` to the nearest bfloat16 value (ties to even).

    Returned as ``dtype`` (float64 by default, or float32); the values are exactly
    representable in bf16, so casting the result to bf16 anywhere is lossless.
    Implemented directly on float64 (no double rounding through float32): bf16 keeps
    8 significant bits; below the smallest normal (2**-126) the quantum is 2**-133.
    Overflow to inf and NaN payloads are not handled (test inputs never reach them).
    """
    x = np.asarray(x, dtype=np.float64)
    _, e = np.frexp(x)  # x = m * 2**e with 0.5 <= |m| < 1
    q = np.maximum(e - 8, -133).astype(np.float64)  # exponent of one bf16 ulp
    quantum = np.exp2(q)
    out = np.rint(x / quantum) * quantum  # np.rint rounds half to even
    return out.astype(dtype)


def rel_rmse(out, ref):
    """FLA's relative RMSE: rmse(out - ref) / rmse(ref), computed in float64.

    Returns 0.0 when both are exactly zero everywhere, inf when only ``ref`` is zero.
    """
    out = np.asarray(out, dtype=np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    assert out.shape == ref.shape, (out.shape, ref.shape)
    err = np.sqrt(np.mean((out - ref) ** 2)) if out.size else 0.0
    den = np.sqrt(np.mean(ref**2)) if ref.size else 0.0
    if den == 0.0:
        return 0.0 if err == 0.0 else float("inf")
    return float(err / den)


def _softplus(x):
    # contract: softplus(x) = x if x > 20 else log1p(exp(x)); scalar, float64
    return x if x > 20.0 else np.log1p(np.exp(x))


def _sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def _silu(x):
    return x * _sigmoid(x)


def _l2norm(x, eps):
    return x / np.sqrt(np.sum(x * x) + eps)


# ---------------------------------------------------------------------------------------
# gating
# ---------------------------------------------------------------------------------------


def gated_norm_f64(o, z, w, eps):
    """The layer's gated RMSNorm, exactly: o / sqrt(mean(o^2) + eps) * w * silu(z) over the last
    dim (no casts). o, z [..., V]; w [V]."""
    n = o / np.sqrt(np.mean(o * o, axis=-1, keepdims=True) + eps)
    return n * w * z / (1 + np.exp(-z))


def gating_f64(a, b, A_log, dt_bias):
    """g = -exp(A_log) * softplus(a + dt_bias), beta = sigmoid(b).

    a, b [T, HV]; A_log [HV]; dt_bias [HV]. Returns (g, beta), both float64 [T, HV].
    """
    a, b, A_log, dt_bias = _f64(a), _f64(b), _f64(A_log), _f64(dt_bias)
    T, HV = a.shape
    g = np.zeros((T, HV))
    beta = np.zeros((T, HV))
    for t in range(T):
        for h in range(HV):
            g[t, h] = -np.exp(A_log[h]) * _softplus(a[t, h] + dt_bias[h])
            beta[t, h] = _sigmoid(b[t, h])
    return g, beta


# ---------------------------------------------------------------------------------------
# causal conv1d
# ---------------------------------------------------------------------------------------


def _to_sd(conv_state, layout):
    cs = _f64(conv_state).copy()
    if layout == "SD":
        return cs
    if layout == "DS":
        return np.ascontiguousarray(cs.transpose(0, 2, 1))
    raise ValueError(f"layout must be 'SD' or 'DS', got {layout!r}")


def _from_sd(cs, layout):
    return cs if layout == "SD" else np.ascontiguousarray(cs.transpose(0, 2, 1))


def _conv_outputs(xt, weight, bias, silu):
    """Valid (no padding) depthwise conv over xt [W-1+n, D]; returns [n, D]."""
    D, W = weight.shape
    n = xt.shape[0] - (W - 1)
    y = np.zeros((n, D))
    for t in range(n):
        acc = np.zeros(D) if bias is None else bias.copy()
        for i in range(W):
            acc = acc + weight[:, i] * xt[t + i]
        y[t] = _silu(acc) if silu else acc
    return y


def conv_fwd_f64(x, weight, bias, conv_state, query_start_loc, state_indices,
                 has_initial_state, silu, layout="SD"):
    """Varlen causal conv1d (prefill).

    x [T, D]; weight [D, W]; bias [D] or None; conv_state [N, L, D] ("SD") or
    [N, D, L] ("DS"), L >= W-1; query_start_loc [S+1]; state_indices [S];
    has_initial_state [S] bool.

    Per sequence s with n = qsl[s+1] - qsl[s] > 0 and slot = state_indices[s] != -1:
    prior = rows [0, W-1) of the slot if has_initial_state[s] else zeros,
    x~ = prior ++ x[qsl[s]:qsl[s+1]], y_t = act(bias + sum_i w[:, i] * x~[t + i]);
    afterwards rows [0, W-1) of the slot hold the last W-1 entries of x~ (rows >= W-1
    untouched). Zero-length sequences change nothing; padding rows and tokens past
    qsl[-1] give zero output. Returns (y [T, D], new conv_state in ``layout``).
    """
    x, weight, bias = _f64(x), _f64(weight), _f64(bias)
    cs = _to_sd(conv_state, layout)
    old = cs.copy()  # every sequence reads the state as it was before the step
    T, D = x.shape
    W = weight.shape[1]
    y = np.zeros((T, D))
    S = len(state_indices)
    for s in range(S):
        slot = int(state_indices[s])
        start, end = int(query_start_loc[s]), int(query_start_loc[s + 1])
        n = end - start
        if slot == PAD_SLOT_ID or n == 0:
            continue
        if bool(has_initial_state[s]):
            prior = old[slot, : W - 1].copy()
        else:
            prior = np.zeros((W - 1, D))
        xt = np.concatenate([prior, x[start:end]], axis=0)
        y[start:end] = _conv_outputs(xt, weight, bias, silu)
        if W > 1:
            cs[slot, : W - 1] = xt[-(W - 1):]
    return y, _from_sd(cs, layout)


def conv_update_f64(x, weight, bias, conv_state, state_indices, silu,
                    num_accepted_tokens=None, query_start_loc=None, layout="SD"):
    """Causal conv1d decode / spec-verify update (rolling buffer).

    x [T, D]; state_indices [B] (one slot per row; for spec this is column 0 of
    spec_state_indices). Rows: one token per row when query_start_loc is None (B = T),
    else row s has tokens [qsl[s], qsl[s+1]). acc = num_accepted_tokens[s] (default 1).

    Per row with q > 0 tokens and slot != -1: window = slot rows [acc-1, acc-1+W-1);
    outputs = act(conv over window ++ x_row); afterwards rows [0, W-2+q) of the slot
    hold window[1:] ++ x_row, other rows untouched. Plain decode is acc = 1, q = 1.
    Zero-length rows change nothing; padding rows / uncovered tokens give zero output.
    Returns (y [T, D], new conv_state in ``layout``).
    """
    x, weight, bias = _f64(x), _f64(weight), _f64(bias)
    cs = _to_sd(conv_state, layout)
    old = cs.copy()
    T, D = x.shape
    W = weight.shape[1]
    if query_start_loc is None:
        B = len(state_indices)
        query_start_loc = np.arange(B + 1)
    B = len(state_indices)
    y = np.zeros((T, D))
    for s in range(B):
        slot = int(state_indices[s])
        start, end = int(query_start_loc[s]), int(query_start_loc[s + 1])
        q = end - start
        if slot == PAD_SLOT_ID or q == 0:
            continue
        acc = 1 if num_accepted_tokens is None else int(num_accepted_tokens[s])
        window = old[slot, acc - 1: acc - 1 + W - 1].copy()
        assert window.shape[0] == W - 1, "window runs past the end of the buffer"
        xt = np.concatenate([window, x[start:end]], axis=0)
        y[start:end] = _conv_outputs(xt, weight, bias, silu)
        new_rows = xt[1:]  # window[1:] ++ x_row, W-2+q rows
        assert new_rows.shape[0] <= cs.shape[1], "buffer too short for this row"
        cs[slot, : new_rows.shape[0]] = new_rows
    return y, _from_sd(cs, layout)


# ---------------------------------------------------------------------------------------
# gated delta rule
# ---------------------------------------------------------------------------------------


def _step(S, q_hat, k_hat, v, g, beta):
    """One recurrence step for one value head. S [K, V] k-major (modified copy)."""
    S = np.exp(g) * S
    delta = beta * (v - S.T @ k_hat)
    S = S + np.outer(k_hat, delta)
    o = S.T @ q_hat
    return S, o


def _prep_qk(q, k, scale, use_qk_l2norm, eps):
    K = q.shape[-1]
    if scale is None:
        scale = K ** -0.5
    if use_qk_l2norm:
        q = _l2norm(q, eps)
        k = _l2norm(k, eps)
    return q * scale, k


def gdn_recurrent_f64(q, k, v, g, beta, S0, scale=None, use_qk_l2norm=True, eps=1e-6):
    """Gated delta rule over ONE sequence of one slot, token by token.

    q, k [T, H, K]; v [T, HV, V]; g, beta [T, HV]; S0 [HV, K, V] (k-major).
    Value head h uses key head h // (HV // H). Returns (o [T, HV, V], S [HV, K, V]).
    """
    q, k, v, g, beta = _f64(q), _f64(k), _f64(v), _f64(g), _f64(beta)
    S = _f64(S0).copy()
    T, H, K = q.shape
    HV, V = v.shape[1], v.shape[2]
    G = HV // H
    o = np.zeros((T, HV, V))
    for t in range(T):
        for h in range(HV):
            kh = h // G
            q_hat, k_hat = _prep_qk(q[t, kh], k[t, kh], scale, use_qk_l2norm, eps)
            S[h], o[t, h] = _step(S[h], q_hat, k_hat, v[t, h], g[t, h], beta[t, h])
    return o, S


def prefill_f64(q, k, v, g, beta, ssm_state, query_start_loc, state_indices,
                has_initial_state, scale=None, use_qk_l2norm=True, eps=1e-6):
    """Varlen prefill over a pool.

    q, k [T, H, K]; v [T, HV, V]; g, beta [T, HV]; ssm_state [N, HV, K, V];
    query_start_loc [S+1]; state_indices [S]; has_initial_state [S].
    Each sequence with n > 0 tokens and a real slot starts from the slot (or zeros
    without initial state) and writes its final state back. Zero-length sequences change
    nothing; padding rows write nothing and output zeros. Returns (o [T, HV, V], pool).
    """
    pool = _f64(ssm_state).copy()
    old = pool.copy()
    T, HV, V = np.shape(v)
    o = np.zeros((T, HV, V))
    for s in range(len(state_indices)):
        slot = int(state_indices[s])
        start, end = int(query_start_loc[s]), int(query_start_loc[s + 1])
        if slot == PAD_SLOT_ID or end == start:
            continue
        S0 = old[slot] if bool(has_initial_state[s]) else np.zeros_like(old[slot])
        o_s, S = gdn_recurrent_f64(q[start:end], k[start:end], v[start:end],
                                   g[start:end], beta[start:end], S0,
                                   scale=scale, use_qk_l2norm=use_qk_l2norm, eps=eps)
        o[start:end] = o_s
        pool[slot] = S
    return o, pool


def decode_f64(q, k, v, a, b, A_log, dt_bias, ssm_state, state_indices, scale=None,
               use_qk_l2norm=True, eps=1e-6):
    """Decode, one token per row, gating fused in.

    q, k [B, H, K]; v [B, HV, V]; a, b [B, HV]; A_log, dt_bias [HV];
    ssm_state [N, HV, K, V]; state_indices [B]. Returns (o [B, HV, V], pool).
    """
    g, beta = gating_f64(a, b, A_log, dt_bias)
    pool = _f64(ssm_state).copy()
    old = pool.copy()
    B, HV, V = np.shape(v)
    o = np.zeros((B, HV, V))
    for r in range(B):
        slot = int(state_indices[r])
        if slot == PAD_SLOT_ID:
            continue
        o_r, S = gdn_recurrent_f64(q[r:r + 1], k[r:r + 1], v[r:r + 1], g[r:r + 1],
                                   beta[r:r + 1], old[slot], scale=scale,
                                   use_qk_l2norm=use_qk_l2norm, eps=eps)
        o[r] = o_r[0]
        pool[slot] = S
    return o, pool


def spec_f64(q, k, v, a, b, A_log, dt_bias, ssm_state, query_start_loc,
             spec_state_indices, num_accepted_tokens, scale=None, use_qk_l2norm=True,
             eps=1e-6):
    """Speculative-decode verify step, gating fused in.

    q, k [T, H, K]; v [T, HV, V]; a, b [T, HV]; ssm_state [N, HV, K, V];
    query_start_loc [S+1]; spec_state_indices [S, M]; num_accepted_tokens [S].
    Row i (tokens [qsl[i], qsl[i+1]), q_i <= M) starts from slot
    spec_state_indices[i, acc-1]; the state after its token t is written to slot
    spec_state_indices[i, t]. A row is padding iff spec_state_indices[i, 0] == -1.
    Returns (o [T, HV, V], pool).
    """
    g, beta = gating_f64(a, b, A_log, dt_bias)
    pool = _f64(ssm_state).copy()
    old = pool.copy()
    q, k, v = _f64(q), _f64(k), _f64(v)
    T, HV, V = v.shape
    G = HV // q.shape[1]
    o = np.zeros((T, HV, V))
    for i in range(spec_state_indices.shape[0]):
        if int(spec_state_indices[i, 0]) == PAD_SLOT_ID:
            continue
        start, end = int(query_start_loc[i]), int(query_start_loc[i + 1])
        if end == start:
            continue
        acc = int(num_accepted_tokens[i])
        S = old[int(spec_state_indices[i, acc - 1])].copy()
        for t in range(end - start):
            tok = start + t
            for h in range(HV):
                kh = h // G
                q_hat, k_hat = _prep_qk(q[tok, kh], k[tok, kh], scale, use_qk_l2norm, eps)
                S[h], o[tok, h] = _step(S[h], q_hat, k_hat, v[tok, h], g[tok, h],
                                        beta[tok, h])
            dst = int(spec_state_indices[i, t])
            if dst != PAD_SLOT_ID:
                pool[dst] = S
    return o, pool
