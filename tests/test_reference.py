"""The pure-jnp reference (gdn_jax.reference) held to the contract's accuracy budget.

Every number is measured against tests/f64_math.py (an independent float64 evaluation of
spec/contract.md) on the same inputs, with FLA's relative RMSE. bf16 inputs are exact
bf16 values (bf16_round), so the float64 side sees exactly what the reference sees.

Configurations (``CFGS``): "f32" (f32 activations, f32 state), "bf16" (bf16 activations,
f32 state), "bf16_state" (bf16 activations, bf16 state). Shapes are small so the whole
file runs in well under two minutes on two cores; every jitted function is shared across
tests so each (shape, dtype) compiles once.
"""

from __future__ import annotations

import math
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(__file__))  # f64_math lives beside this file

from f64_math import (  # noqa: E402
    bf16_round,
    conv_fwd_f64,
    conv_update_f64,
    decode_f64,
    gating_f64,
    gdn_recurrent_f64,
    prefill_f64,
    rel_rmse,
    spec_f64,
)

from gdn_jax import reference as R  # noqa: E402

BF16 = jnp.bfloat16
F32 = jnp.float32

# cfg -> (activation dtype, state dtype)
CFGS = {"f32": (F32, F32), "bf16": (BF16, F32), "bf16_state": (BF16, BF16)}

# One bf16 rounding of a value has a relative error of at most 2**-8 (half an ulp of an
# 8-bit significand), uniformly spread, so its relative RMS is at most 2**-8/sqrt(3)
# = 2.26e-3 whatever the data. A bf16 state that went through r independent roundings
# (each later step is a contraction: exp(g) <= 1 and (I - beta k k^T) has norm <= 1 for
# |k| = 1, beta <= 1) is thus within sqrt(r) * 2.26e-3; 2.5e-3 leaves ~10% for the f32
# math and for the error of the initial state's own influence.
BF16_ONE_ROUNDING = 2.5e-3

# Budget (contract.md "Accuracy budget"), relative RMSE vs float64.
# gating: g and beta are f32 outputs in every configuration (the contract wants beta f32
# everywhere) and their inputs are exact, so they are held to 1e-6 even for bf16 inputs;
# the 4e-3 column is the conv, whose output is rounded to bf16.
BUDGET = {
    "f32": dict(gate=1e-6, conv=1e-6, dec_o=1e-5, dec_s=1e-5, pre_o=1e-5, pre_s=1e-5),
    "bf16": dict(gate=1e-6, conv=4e-3, dec_o=2e-3, dec_s=1e-4, pre_o=3e-3, pre_s=2e-3),
    # bf16 state: outputs keep the bf16-activation budget (decode/prefill outputs are
    # computed from the f32 state before it is stored); every stored state is one bf16
    # rounding (decode: one per token; prefill: one per call), see BF16_ONE_ROUNDING.
    # Spec output/state: see test_spec (token t has seen t roundings of its state).
    "bf16_state": dict(gate=1e-6, conv=4e-3, dec_o=2e-3, dec_s=BF16_ONE_ROUNDING,
                       pre_o=3e-3, pre_s=BF16_ONE_ROUNDING),
}

# Small shapes. "gqa": HV = 2H and K != V; "mha": HV = H, K = V.
SHAPES = {"gqa": dict(H=2, HV=4, K=32, V=48), "mha": dict(H=2, HV=2, K=32, V=32)}
# (cfg, shape) cases of the recurrence tests: every dtype on the GQA shape, and the
# HV = H shape once (head mapping does not depend on the dtype). Keeps compiles few.
RECUR_CASES = [("f32", "gqa"), ("bf16", "gqa"), ("bf16_state", "gqa"), ("f32", "mha")]
W = 4
GDN_N = 20  # one pool size for every recurrence test, so compiled executables are shared

# ---------------------------------------------------------------------------------------
# jitted entry points (shared, so each shape/dtype compiles once per session)
# ---------------------------------------------------------------------------------------

_RECUR_STATIC = ("scale", "use_qk_l2norm", "l2norm_eps")
j_gating = jax.jit(R.fused_gdn_gating)
j_conv_fwd = jax.jit(R.causal_conv1d_fwd, static_argnames=("activation", "conv_state_layout"))
j_conv_update = jax.jit(R.causal_conv1d_update,
                        static_argnames=("activation", "conv_state_layout"))
j_chunk = jax.jit(R.chunk_gated_delta_rule, static_argnames=_RECUR_STATIC)
j_decode = jax.jit(R.fused_sigmoid_gating_delta_rule_update, static_argnames=_RECUR_STATIC)
j_spec = jax.jit(R.fused_sigmoid_gating_delta_rule_update_spec,
                 static_argnames=_RECUR_STATIC)
j_scan = jax.jit(R.gdn_token_scan, static_argnames=_RECUR_STATIC)


# ---------------------------------------------------------------------------------------
# input helpers: NumPy float64 values that are exact in the target dtype
# ---------------------------------------------------------------------------------------


def exact_in(x, dtype):
    """float64 copy of x rounded to the values ``dtype`` (F32 or BF16) can hold."""
    x = np.asarray(x, np.float64)
    if dtype == BF16:
        return bf16_round(x)
    return x.astype(np.float32).astype(np.float64)


def to_jnp(x64, dtype):
    """jnp array of ``dtype`` holding the (already exact) float64 values x64."""
    return jnp.asarray(np.asarray(x64, np.float32)).astype(dtype)


def as_f64(x):
    return np.asarray(jnp.asarray(x).astype(F32), np.float64)


def bits(x):
    """Raw bit pattern of a jnp array, for bit-identity checks."""
    x = np.asarray(x)
    return x.view(np.uint16 if x.dtype.itemsize == 2 else np.uint32)


def make_gdn_inputs(rng, T, H, HV, K, V, N, act, state, l2norm=True):
    """Realistic random GDN inputs as exact float64 values (dict)."""
    d = {}
    qk_scale = 1.0 if l2norm else K ** -0.5  # without the in-kernel norm, |k| ~ 1
    d["q"] = exact_in(rng.standard_normal((T, H, K)) * qk_scale, act)
    d["k"] = exact_in(rng.standard_normal((T, H, K)) * qk_scale, act)
    d["v"] = exact_in(rng.standard_normal((T, HV, V)), act)
    d["a"] = exact_in(rng.standard_normal((T, HV)), act)
    d["b"] = exact_in(rng.standard_normal((T, HV)), act)
    d["A_log"] = exact_in(np.log(rng.uniform(1.0, 16.0, HV)), F32)
    d["dt_bias"] = exact_in(rng.standard_normal(HV) * 0.5, F32)
    d["pool"] = exact_in(rng.standard_normal((N, HV, K, V)) * 0.1, state)
    return d


def jnp_inputs(d, act, state):
    j = {n: to_jnp(d[n], act) for n in ("q", "k", "v", "a", "b")}
    j["A_log"] = to_jnp(d["A_log"], F32)
    j["dt_bias"] = to_jnp(d["dt_bias"], F32)
    j["pool"] = to_jnp(d["pool"], state)
    return j


def i32(x):
    return jnp.asarray(np.asarray(x, np.int32))


def assert_untouched(out_pool, in_pool, slots):
    slots = list(slots)
    assert slots, "test must name at least one untouched slot"
    np.testing.assert_array_equal(bits(out_pool)[slots], bits(in_pool)[slots])


def written_slots(pool_ref, pool_in):
    """Slots the float64 evaluation changed (state errors are judged on these only:
    untouched slots are checked bit-for-bit separately and would dilute the RMSE)."""
    pool_in = np.asarray(pool_in, np.float64)
    return [s for s in range(pool_in.shape[0]) if not np.array_equal(pool_ref[s], pool_in[s])]


def state_err(pool, pool_ref, pool_in):
    slots = written_slots(pool_ref, pool_in)
    assert slots, "test must write at least one slot"
    return rel_rmse(as_f64(pool)[slots], pool_ref[slots])


def report(name, err, bound):
    # visible with -rA / -s; the assertion is what counts
    print(f"{name}: rel_rmse={err:.3e} (bound {bound:.1e})")
    assert err <= bound, f"{name}: rel_rmse {err:.3e} > {bound:.1e}"


# ---------------------------------------------------------------------------------------
# the yardstick itself
# ---------------------------------------------------------------------------------------


def test_f64_yardstick_self_checks():
    rng = np.random.default_rng(0)
    # bf16_round agrees with ml_dtypes (round to nearest even) on float32 inputs
    import ml_dtypes

    x = (rng.standard_normal(20000) * np.exp2(rng.integers(-130, 30, 20000))).astype(np.float32)
    np.testing.assert_array_equal(
        bf16_round(x), x.astype(ml_dtypes.bfloat16).astype(np.float64))
    assert bf16_round(1.0 + 2.0 ** -8) == 1.0  # tie -> even
    assert bf16_round(1.0 + 3 * 2.0 ** -8) == 1.0 + 2.0 ** -6
    assert rel_rmse(np.zeros(3), np.zeros(3)) == 0.0
    assert rel_rmse(np.array([1.0, 1.0]), np.array([1.0, 0.0])) == pytest.approx(1.0)

    # one recurrence step from zero state: S = beta k v^T, o = beta (k.q) v
    q, k, v = rng.standard_normal((3, 1, 1, 4))
    v = rng.standard_normal((1, 1, 5))
    o, S = gdn_recurrent_f64(q, k, v, np.full((1, 1), -0.3), np.full((1, 1), 0.5),
                             np.zeros((1, 4, 5)), scale=1.0, use_qk_l2norm=False)
    np.testing.assert_allclose(S[0], 0.5 * np.outer(k[0, 0], v[0, 0]), rtol=1e-14)
    np.testing.assert_allclose(o[0, 0], 0.5 * (k[0, 0] @ q[0, 0]) * v[0, 0], rtol=1e-14)

    # contract 4.3 worked example: W=4, L=6, acc=2, q=4 -> [col2, col3, x0..x3]
    D = 3
    cs = rng.standard_normal((1, 6, D))
    x = rng.standard_normal((4, D))
    w = rng.standard_normal((D, 4))
    y, new = conv_update_f64(x, w, None, cs, np.array([0]), False, np.array([2]),
                             np.array([0, 4]))
    np.testing.assert_array_equal(new[0], np.concatenate([cs[0, 2:4], x]))
    xt = np.concatenate([cs[0, 1:4], x])
    np.testing.assert_allclose(y[1], sum(w[:, i] * xt[1 + i] for i in range(4)))


# ---------------------------------------------------------------------------------------
# gating
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("cfg", list(CFGS))
@pytest.mark.parametrize("dt_in_act", [False, True])
def test_gating(cfg, dt_in_act):
    act, _ = CFGS[cfg]
    rng = np.random.default_rng(1)
    T, HV = 64, 8
    a = rng.standard_normal((T, HV))
    a[0, :4] = [25.0, 20.5, 19.5, -30.0]  # both sides of the softplus threshold
    a = exact_in(a, act)
    b = exact_in(rng.standard_normal((T, HV)) * 3.0, act)
    A_log = exact_in(np.log(rng.uniform(1.0, 16.0, HV)), F32)
    dt_dtype = act if dt_in_act else F32
    dt_bias = exact_in(rng.standard_normal(HV) * 0.5, dt_dtype)
    dt_bias[:4] = 0.0
    g, beta = j_gating(to_jnp(a, act), to_jnp(b, act), A_log=to_jnp(A_log, F32),
                       dt_bias=to_jnp(dt_bias, dt_dtype))
    assert g.dtype == F32 and beta.dtype == F32 and g.shape == (T, HV)
    g_ref, beta_ref = gating_f64(a, b, A_log, dt_bias)
    report(f"gating g [{cfg}]", rel_rmse(g, g_ref), BUDGET[cfg]["gate"])
    report(f"gating beta [{cfg}]", rel_rmse(beta, beta_ref), BUDGET[cfg]["gate"])
    # the threshold branch is the identity, elementwise (not just on average)
    np.testing.assert_allclose(np.asarray(g)[0, :2], g_ref[0, :2], rtol=2e-7)


# ---------------------------------------------------------------------------------------
# causal conv1d
# ---------------------------------------------------------------------------------------

CONV_D = 2 * 2 * 32 + 4 * 48  # 2*H*K + HV*V for the gqa shape
CONV_N, CONV_L = 7, W - 1 + 2  # a wide (spec-capable) state: rows >= W-1 must survive


def make_conv_inputs(rng, T, act, with_bias):
    x = exact_in(rng.standard_normal((T, CONV_D)), act)
    w = exact_in(rng.standard_normal((CONV_D, W)) / math.sqrt(W), act)
    bias = exact_in(rng.standard_normal(CONV_D) * 0.1, act) if with_bias else None
    cs = exact_in(rng.standard_normal((CONV_N, CONV_L, CONV_D)), act)  # SD values
    return x, w, bias, cs


def conv_state_in_layout(cs_sd, layout):
    return cs_sd if layout == "SD" else np.ascontiguousarray(cs_sd.transpose(0, 2, 1))


@pytest.mark.parametrize("cfg", ["f32", "bf16"])
@pytest.mark.parametrize("layout", ["SD", "DS"])
@pytest.mark.parametrize("with_bias,activation", [(True, "silu"), (False, None)])
def test_conv_fwd(cfg, layout, with_bias, activation):
    act, _ = CFGS[cfg]
    rng = np.random.default_rng(2)
    T = 96
    x, w, bias, cs_sd = make_conv_inputs(rng, T, act, with_bias)
    cs_sd[5] = exact_in(cs_sd[5] * 1e3, act)  # stale slot (no initial state): garbage
    cs = conv_state_in_layout(cs_sd, layout)
    # sequences: long with init; empty; 1 token with init (shorter than W-1); 2 tokens
    # without init on a stale slot; padding row with tokens; 40 tokens without init;
    # tokens [90, 96) are covered by no row.
    qsl = np.array([0, 45, 45, 46, 48, 50, 90])
    si = np.array([2, 4, 0, 5, -1, 6])
    hi = np.array([True, True, True, False, True, False])
    y, new = j_conv_fwd(to_jnp(x, act), weight=to_jnp(w, act),
                        bias=None if bias is None else to_jnp(bias, act),
                        conv_state=to_jnp(cs, act), query_start_loc=i32(qsl),
                        state_indices=i32(si), has_initial_state=jnp.asarray(hi),
                        activation=activation, conv_state_layout=layout)
    assert y.dtype == act and y.shape == (T, CONV_D) and new.dtype == act
    y_ref, new_ref = conv_fwd_f64(x, w, bias, cs, qsl, si, hi, activation == "silu", layout)
    report(f"conv_fwd y [{cfg},{layout}]", rel_rmse(y, y_ref), BUDGET[cfg]["conv"])
    # padding row and uncovered tokens: exactly zero
    assert not np.any(np.asarray(as_f64(y))[48:50]) and not np.any(as_f64(y)[90:])
    # the state holds raw inputs: exact copies, including the untouched wide rows
    np.testing.assert_array_equal(as_f64(new), new_ref)
    # slot 4 (empty sequence), 1 and 3 (not named) are bit-identical
    assert_untouched(new, to_jnp(cs, act), [1, 3, 4])


@pytest.mark.parametrize("cfg", ["f32", "bf16"])
@pytest.mark.parametrize("layout", ["SD", "DS"])
def test_conv_update_decode(cfg, layout):
    act, _ = CFGS[cfg]
    rng = np.random.default_rng(3)
    B = 5
    x, w, bias, cs_sd = make_conv_inputs(rng, B, act, True)
    cs = conv_state_in_layout(cs_sd, layout)
    si = np.array([6, -1, 0, 3, 2])
    y, new = j_conv_update(to_jnp(x, act), weight=to_jnp(w, act), bias=to_jnp(bias, act),
                           conv_state=to_jnp(cs, act), state_indices=i32(si),
                           activation="silu", conv_state_layout=layout)
    y_ref, new_ref = conv_update_f64(x, w, bias, cs, si, True, layout=layout)
    report(f"conv_update decode y [{cfg},{layout}]", rel_rmse(y, y_ref), BUDGET[cfg]["conv"])
    assert not np.any(as_f64(y)[1])
    np.testing.assert_array_equal(as_f64(new), new_ref)
    assert_untouched(new, to_jnp(cs, act), [1, 4, 5])


@pytest.mark.parametrize("cfg", ["f32", "bf16"])
@pytest.mark.parametrize("layout", ["SD", "DS"])
def test_conv_update_spec(cfg, layout):
    """Rolling buffer with ragged drafts: L = W-1+num_spec, num_spec = 2 (q <= 3)."""
    act, _ = CFGS[cfg]
    rng = np.random.default_rng(4)
    T = 12
    x, w, bias, cs_sd = make_conv_inputs(rng, T, act, True)
    cs = conv_state_in_layout(cs_sd, layout)
    # rows: q=3 acc=3; q=1 acc=2; padding (q=2); q=2 acc=1; q=0; uncovered tail [9, 12)
    qsl = np.array([0, 3, 4, 6, 8, 8])
    si = np.array([5, 1, -1, 0, 3])
    acc = np.array([3, 2, 1, 1, 2])
    y, new = j_conv_update(to_jnp(x, act), weight=to_jnp(w, act), bias=to_jnp(bias, act),
                           conv_state=to_jnp(cs, act), state_indices=i32(si),
                           activation="silu", num_accepted_tokens=i32(acc),
                           query_start_loc=i32(qsl), conv_state_layout=layout)
    y_ref, new_ref = conv_update_f64(x, w, bias, cs, si, True, acc, qsl, layout)
    report(f"conv_update spec y [{cfg},{layout}]", rel_rmse(y, y_ref), BUDGET[cfg]["conv"])
    assert not np.any(as_f64(y)[4:6]) and not np.any(as_f64(y)[8:])
    np.testing.assert_array_equal(as_f64(new), new_ref)
    assert_untouched(new, to_jnp(cs, act), [2, 3, 4, 6])  # 3: zero-length row


def test_conv_update_decode_equals_fwd_step():
    """Plain decode == a one-token prefill with initial state (same conv, same state)."""
    rng = np.random.default_rng(5)
    x, w, bias, cs = make_conv_inputs(rng, 3, F32, True)
    si = np.array([4, 0, 6])
    y1, s1 = j_conv_update(to_jnp(x, F32), weight=to_jnp(w, F32), bias=to_jnp(bias, F32),
                           conv_state=to_jnp(cs, F32), state_indices=i32(si))
    y2, s2 = j_conv_fwd(to_jnp(x, F32), weight=to_jnp(w, F32), bias=to_jnp(bias, F32),
                        conv_state=to_jnp(cs, F32), query_start_loc=i32([0, 1, 2, 3]),
                        state_indices=i32(si), has_initial_state=jnp.ones(3, bool))
    np.testing.assert_allclose(np.asarray(y1), np.asarray(y2), rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(bits(s1), bits(s2))


# ---------------------------------------------------------------------------------------
# chunked prefill
# ---------------------------------------------------------------------------------------

PRE_N = GDN_N
PRE_T = 240
# sequences: 150 tokens (3 chunks, init); empty; 2 tokens (init); 64 tokens exactly,
# no init on a garbage-filled slot; padding row with tokens; 1 token without init;
# 17 tokens with init. Tokens [237, 240) are covered by no row.
PRE_QSL = np.array([0, 150, 150, 152, 216, 219, 220, 237])
PRE_SI = np.array([3, 6, 0, 5, -1, 7, 1])
PRE_HI = np.array([True, True, True, False, True, False, True])
PRE_UNTOUCHED = [2, 4, 6, 19]  # 6 is named by the empty sequence
PRE_GARBAGE_SLOT = 5


def run_prefill(cfg, shape, seed=6, l2norm=True, qsl=PRE_QSL, si=PRE_SI, hi=PRE_HI,
                T=PRE_T, fn=None):
    act, state = CFGS[cfg]
    sh = SHAPES[shape]
    rng = np.random.default_rng(seed)
    d = make_gdn_inputs(rng, T, sh["H"], sh["HV"], sh["K"], sh["V"], PRE_N, act, state,
                        l2norm=l2norm)
    d["pool"][PRE_GARBAGE_SLOT] = exact_in(
        rng.standard_normal(d["pool"].shape[1:]) * 1e3, state)  # stale slot: huge garbage
    j = jnp_inputs(d, act, state)
    g, beta = j_gating(j["a"], j["b"], A_log=j["A_log"], dt_bias=j["dt_bias"])
    o, pool = (fn or j_chunk)(j["q"], j["k"], j["v"], g=g, beta=beta, ssm_state=j["pool"],
                              query_start_loc=i32(qsl), state_indices=i32(si),
                              has_initial_state=jnp.asarray(hi), use_qk_l2norm=l2norm)
    assert o.dtype == act and o.shape == d["v"].shape and pool.dtype == state
    g64, beta64 = gating_f64(d["a"], d["b"], d["A_log"], d["dt_bias"])
    o_ref, pool_ref = prefill_f64(d["q"], d["k"], d["v"], g64, beta64, d["pool"], qsl, si,
                                  hi, use_qk_l2norm=l2norm)
    return d, j, o, pool, o_ref, pool_ref


@pytest.mark.parametrize("cfg,shape", RECUR_CASES)
def test_prefill(cfg, shape):
    d, j, o, pool, o_ref, pool_ref = run_prefill(cfg, shape)
    report(f"prefill o [{cfg},{shape}]", rel_rmse(o, o_ref), BUDGET[cfg]["pre_o"])
    assert written_slots(pool_ref, d["pool"]) == sorted([0, 1, 3, 5, 7])
    report(f"prefill state [{cfg},{shape}]", state_err(pool, pool_ref, d["pool"]),
           BUDGET[cfg]["pre_s"])
    # the stale slot's garbage must not leak: its final state is judged on its own
    report(f"prefill stale slot [{cfg},{shape}]",
           rel_rmse(as_f64(pool)[PRE_GARBAGE_SLOT], pool_ref[PRE_GARBAGE_SLOT]),
           BUDGET[cfg]["pre_s"])
    assert not np.any(as_f64(o)[216:219]), "padding row output must be zero"
    assert not np.any(as_f64(o)[237:]), "uncovered tokens must output zero"
    assert_untouched(pool, j["pool"], PRE_UNTOUCHED)


@pytest.mark.parametrize("kind", ["chunk_like", "parallel_keys"])
def test_unit_lower_solve_matches_f64(kind):
    """The chunk's (I + A) x = rhs (forward substitution, not jaxlib's trsm) against float64:
    A as the chunk builds it (beta K K^T * Gamma below the diagonal) and the worst case of
    that form (equal unit keys, beta = 1, no decay: every entry below the diagonal is 1)."""
    rng = np.random.default_rng(3)
    HV, C, D = 3, 64, 40
    if kind == "chunk_like":
        kk = rng.standard_normal((HV, C, 16))
        kk /= np.linalg.norm(kk, axis=-1, keepdims=True)
        G = np.cumsum(-rng.uniform(0, 0.2, (HV, C)), axis=-1)
        A = rng.uniform(0, 1, (HV, C, 1)) * (kk @ np.swapaxes(kk, 1, 2)) * np.exp(G[:, :, None] - G[:, None, :])
    else:
        A = np.ones((HV, C, C))
    A = np.tril(A, -1).astype(np.float32)
    rhs = rng.standard_normal((HV, C, D)).astype(np.float32)
    x = np.asarray(R._unit_lower_solve(jnp.asarray(A), jnp.asarray(rhs)), np.float64)
    x64 = np.linalg.solve(np.eye(C) + A.astype(np.float64), rhs.astype(np.float64))
    report(f"unit lower solve [{kind}]", rel_rmse(x, x64), 1e-6)


def test_prefill_l2norm_off():
    d, j, o, pool, o_ref, pool_ref = run_prefill("f32", "gqa", l2norm=False)
    report("prefill o [l2norm off]", rel_rmse(o, o_ref), BUDGET["f32"]["pre_o"])
    report("prefill state [l2norm off]", state_err(pool, pool_ref, d["pool"]), BUDGET["f32"]["pre_s"])


def test_prefill_counts_are_data():
    """One compiled executable serves different sequence layouts of the same bucket."""
    fn = jax.jit(R.chunk_gated_delta_rule, static_argnames=_RECUR_STATIC)
    qsl2 = np.array([0, 64, 65, 129, 129, 200, 200, 230])
    hi2 = np.array([False, True, True, True, False, True, True])
    d, j, o, pool, o_ref, pool_ref = run_prefill("f32", "gqa", seed=7, qsl=qsl2, hi=hi2,
                                                 fn=fn)
    compiled = fn._cache_size()  # (the jit cache is shared per function, so compare)
    qsl3 = np.array([0, 3, 103, 104, 170, 170, 171, 239])
    run_prefill("f32", "gqa", seed=8, qsl=qsl3, fn=fn)
    assert fn._cache_size() == compiled
    report("prefill o [other layout]", rel_rmse(o, o_ref), BUDGET["f32"]["pre_o"])
    report("prefill state [other layout]", state_err(pool, pool_ref, d["pool"]), BUDGET["f32"]["pre_s"])


def _random_layout(rng, T, S):
    """Random varlen layout hitting chunk boundaries, empties, padding and a free tail."""
    lens = rng.choice([0, 1, 2, 3, 31, 63, 64, 65, 100, 128, 129], size=S)
    while lens.sum() > T:
        lens[np.argmax(lens)] //= 2
    qsl = np.concatenate([[0], np.cumsum(lens)])
    si = rng.permutation(PRE_N)[:S]
    si[rng.random(S) < 0.2] = -1
    hi = rng.random(S) < 0.6
    return qsl, si, hi


def _check_random_prefill(seed):
    rng = np.random.default_rng(100 + seed)
    qsl, si, hi = _random_layout(rng, PRE_T, len(PRE_SI))
    d, j, o, pool, o_ref, pool_ref = run_prefill("f32", "gqa", seed=seed, qsl=qsl, si=si,
                                                 hi=hi)
    report(f"prefill o [random {seed}]", rel_rmse(o, o_ref), BUDGET["f32"]["pre_o"])
    report(f"prefill state [random {seed}]", state_err(pool, pool_ref, d["pool"]),
           BUDGET["f32"]["pre_s"])
    np.testing.assert_array_equal(as_f64(o)[qsl[-1]:], 0.0)
    for s, slot in enumerate(si):
        if slot < 0:
            np.testing.assert_array_equal(as_f64(o)[qsl[s]:qsl[s + 1]], 0.0)
    live = {int(x) for x, n in zip(si, np.diff(qsl)) if x >= 0 and n > 0}
    untouched = [s for s in range(PRE_N) if s not in live]
    if untouched:
        assert_untouched(pool, j["pool"], untouched)


def test_prefill_random_layout_sampled():
    _check_random_prefill(0)


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(1, 13))
def test_prefill_random_layout_exhaustive(seed):
    _check_random_prefill(seed)


# ---------------------------------------------------------------------------------------
# decode
# ---------------------------------------------------------------------------------------

DEC_N = GDN_N
DEC_SI = np.array([5, -1, 0, 7, 2, -1])
DEC_UNTOUCHED = [1, 3, 4, 6, 19]


def run_decode(cfg, shape, seed=9, l2norm=True):
    act, state = CFGS[cfg]
    sh = SHAPES[shape]
    rng = np.random.default_rng(seed)
    B = len(DEC_SI)
    d = make_gdn_inputs(rng, B, sh["H"], sh["HV"], sh["K"], sh["V"], DEC_N, act, state,
                        l2norm=l2norm)
    j = jnp_inputs(d, act, state)
    o, pool = j_decode(j["q"], j["k"], j["v"], a=j["a"], b=j["b"], A_log=j["A_log"],
                       dt_bias=j["dt_bias"], ssm_state=j["pool"], state_indices=i32(DEC_SI),
                       use_qk_l2norm=l2norm)
    assert o.dtype == act and pool.dtype == state
    o_ref, pool_ref = decode_f64(d["q"], d["k"], d["v"], d["a"], d["b"], d["A_log"],
                                 d["dt_bias"], d["pool"], DEC_SI, use_qk_l2norm=l2norm)
    return d, j, o, pool, o_ref, pool_ref


@pytest.mark.parametrize("cfg,shape", RECUR_CASES)
def test_decode(cfg, shape):
    d, j, o, pool, o_ref, pool_ref = run_decode(cfg, shape)
    report(f"decode o [{cfg},{shape}]", rel_rmse(o, o_ref), BUDGET[cfg]["dec_o"])
    assert written_slots(pool_ref, d["pool"]) == sorted(s for s in DEC_SI if s >= 0)
    report(f"decode state [{cfg},{shape}]", state_err(pool, pool_ref, d["pool"]),
           BUDGET[cfg]["dec_s"])
    assert not np.any(as_f64(o)[[1, 5]]), "padding rows must output zero"
    assert_untouched(pool, j["pool"], DEC_UNTOUCHED)


def test_decode_l2norm_off():
    d, j, o, pool, o_ref, pool_ref = run_decode("f32", "gqa", l2norm=False)
    report("decode o [l2norm off]", rel_rmse(o, o_ref), BUDGET["f32"]["dec_o"])
    report("decode state [l2norm off]", state_err(pool, pool_ref, d["pool"]), BUDGET["f32"]["dec_s"])


# ---------------------------------------------------------------------------------------
# speculative decode (verify step)
# ---------------------------------------------------------------------------------------

SPEC_M = 4  # num_spec = 3
SPEC_N = GDN_N
# rows: q=4 acc=2; q=1 acc=3 (0 drafts now); padding (2 tokens); q=3 acc=4; q=2 acc=1;
# q=0 (empty row). Tokens [12, 14) are covered by no row.
SPEC_QSL = np.array([0, 4, 5, 7, 10, 12, 12])
SPEC_ACC = np.array([2, 3, 1, 4, 1, 2])
SPEC_IDX = np.array([[3, 8, 0, 11],
                     [4, 1, 9, 13],
                     [-1, -1, -1, -1],
                     [15, 2, 7, 10],
                     [6, 12, 17, 19],
                     [5, 14, 16, 18]])
SPEC_T = 14


def run_spec(cfg, shape, seed=10):
    act, state = CFGS[cfg]
    sh = SHAPES[shape]
    rng = np.random.default_rng(seed)
    d = make_gdn_inputs(rng, SPEC_T, sh["H"], sh["HV"], sh["K"], sh["V"], SPEC_N, act, state)
    j = jnp_inputs(d, act, state)
    o, pool = j_spec(j["q"], j["k"], j["v"], a=j["a"], b=j["b"], A_log=j["A_log"],
                     dt_bias=j["dt_bias"], ssm_state=j["pool"],
                     query_start_loc=i32(SPEC_QSL), spec_state_indices=i32(SPEC_IDX),
                     num_accepted_tokens=i32(SPEC_ACC))
    assert o.dtype == act and pool.dtype == state
    o_ref, pool_ref = spec_f64(d["q"], d["k"], d["v"], d["a"], d["b"], d["A_log"],
                               d["dt_bias"], d["pool"], SPEC_QSL, SPEC_IDX, SPEC_ACC)
    return d, j, o, pool, o_ref, pool_ref


def _spec_written_and_untouched():
    written = set()
    for i, (lo, hi) in enumerate(zip(SPEC_QSL[:-1], SPEC_QSL[1:])):
        if SPEC_IDX[i, 0] >= 0:
            written |= {int(s) for s in SPEC_IDX[i, : hi - lo]}
    return sorted(written), [s for s in range(SPEC_N) if s not in written]


@pytest.mark.parametrize("cfg,shape", RECUR_CASES)
def test_spec(cfg, shape):
    d, j, o, pool, o_ref, pool_ref = run_spec(cfg, shape)
    written, untouched = _spec_written_and_untouched()
    b = BUDGET[cfg]
    o_bound, s_bound = b["dec_o"], b["dec_s"]
    if cfg == "bf16_state":
        # token t of a row read a state stored (rounded) t times before its own step,
        # and its stored state carries t+1 roundings; q <= 4 -> at most 4 roundings:
        # state sqrt(4) * BF16_ONE_ROUNDING; output: its own bf16 rounding (dec_o)
        # plus up to 3 state roundings, sqrt(1 + 3) * BF16_ONE_ROUNDING.
        s_bound = math.sqrt(SPEC_M) * BF16_ONE_ROUNDING
        o_bound = math.sqrt(1 + SPEC_M - 1) * BF16_ONE_ROUNDING
    report(f"spec o [{cfg},{shape}]", rel_rmse(o, o_ref), o_bound)
    assert written_slots(pool_ref, d["pool"]) == written
    report(f"spec state [{cfg},{shape}]", state_err(pool, pool_ref, d["pool"]), s_bound)
    assert not np.any(as_f64(o)[5:7]), "padding row must output zero"
    assert not np.any(as_f64(o)[12:]), "uncovered tokens must output zero"
    # columns past each row's q, the padding row's and the empty row's slots, and
    # unnamed slots: all bit-identical
    assert_untouched(pool, j["pool"], untouched)


def test_spec_zero_drafts_equals_decode():
    """A spec row with 0 drafts is a plain decode from column acc-1 (written to col 0)."""
    rng = np.random.default_rng(11)
    sh = SHAPES["gqa"]
    d = make_gdn_inputs(rng, SPEC_T, sh["H"], sh["HV"], sh["K"], sh["V"], GDN_N, F32, F32)
    j = jnp_inputs(d, F32, F32)
    idx = np.full(SPEC_IDX.shape, -1)
    idx[:3] = [[0, 1, 2, 3], [4, 5, 6, 7], [8, -1, -1, -1]]
    acc = np.array([3, 1, 1, 1, 1, 1])
    qsl = np.array([0, 1, 2, 3, 3, 3, 3])
    o1, p1 = j_spec(j["q"], j["k"], j["v"], a=j["a"], b=j["b"], A_log=j["A_log"],
                    dt_bias=j["dt_bias"], ssm_state=j["pool"], query_start_loc=i32(qsl),
                    spec_state_indices=i32(idx), num_accepted_tokens=i32(acc))
    # decode reads and writes in place, so stage the accepted state in column 0 first
    pool = j["pool"].at[0].set(j["pool"][2])
    B = len(DEC_SI)
    o2, p2 = j_decode(j["q"][:B], j["k"][:B], j["v"][:B], a=j["a"][:B], b=j["b"][:B],
                      A_log=j["A_log"], dt_bias=j["dt_bias"], ssm_state=pool,
                      state_indices=i32([0, 4, 8, -1, -1, -1]), use_qk_l2norm=True)
    np.testing.assert_allclose(np.asarray(o1)[:3], np.asarray(o2)[:3], rtol=1e-6, atol=1e-7)
    assert not np.any(np.asarray(o1)[3:])
    np.testing.assert_allclose(np.asarray(p1)[[0, 4, 8]], np.asarray(p2)[[0, 4, 8]],
                               rtol=1e-6, atol=1e-7)
    assert_untouched(p1, j["pool"], [1, 2, 3, 5, 6, 7, 9])


def test_spec_all_accepted_equals_prefill():
    """A spec row whose drafts are all accepted ends where a prefill of its tokens does."""
    rng = np.random.default_rng(12)
    sh = SHAPES["gqa"]
    d = make_gdn_inputs(rng, PRE_T, sh["H"], sh["HV"], sh["K"], sh["V"], GDN_N, F32, F32)
    j = jnp_inputs(d, F32, F32)
    idx = np.full(SPEC_IDX.shape, -1)
    idx[0] = [0, 1, 2, 3]
    o1, p1 = j_spec(j["q"][:SPEC_T], j["k"][:SPEC_T], j["v"][:SPEC_T], a=j["a"][:SPEC_T],
                    b=j["b"][:SPEC_T], A_log=j["A_log"], dt_bias=j["dt_bias"],
                    ssm_state=j["pool"], query_start_loc=i32([0, 4, 4, 4, 4, 4, 4]),
                    spec_state_indices=i32(idx), num_accepted_tokens=i32(np.ones(6)))
    g, beta = j_gating(j["a"], j["b"], A_log=j["A_log"], dt_bias=j["dt_bias"])
    S = len(PRE_SI)
    o2, p2 = j_chunk(j["q"], j["k"], j["v"], g=g, beta=beta, ssm_state=j["pool"],
                     query_start_loc=i32([0] + [4] * S), state_indices=i32([0] + [-1] * (S - 1)),
                     has_initial_state=jnp.ones(S, bool), use_qk_l2norm=True)
    assert rel_rmse(np.asarray(o1)[:4], np.asarray(o2)[:4]) <= 1e-5
    assert rel_rmse(np.asarray(p1)[3], np.asarray(p2)[0]) <= 1e-5


# ---------------------------------------------------------------------------------------
# token-scan oracle
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("path", ["prefill", "decode", "spec"])
def test_token_scan_oracle(path):
    """The lax.scan oracle (whole pool as carry) against float64, f32 everywhere."""
    sh = SHAPES["gqa"]
    rng = np.random.default_rng(13)
    if path == "prefill":
        T, N = PRE_T, PRE_N
    elif path == "decode":
        T, N = len(DEC_SI), DEC_N
    else:
        T, N = SPEC_T, SPEC_N
    d = make_gdn_inputs(rng, T, sh["H"], sh["HV"], sh["K"], sh["V"], N, F32, F32)
    j = jnp_inputs(d, F32, F32)
    g, beta = j_gating(j["a"], j["b"], A_log=j["A_log"], dt_bias=j["dt_bias"])
    g64, beta64 = gating_f64(d["a"], d["b"], d["A_log"], d["dt_bias"])
    if path == "prefill":
        plan = R.scan_plan_prefill(PRE_QSL, PRE_SI, PRE_HI, T)
        o_ref, pool_ref = prefill_f64(d["q"], d["k"], d["v"], g64, beta64, d["pool"],
                                      PRE_QSL, PRE_SI, PRE_HI)
    elif path == "decode":
        plan = R.scan_plan_decode(DEC_SI)
        o_ref, pool_ref = decode_f64(d["q"], d["k"], d["v"], d["a"], d["b"], d["A_log"],
                                     d["dt_bias"], d["pool"], DEC_SI)
    else:
        plan = R.scan_plan_spec(SPEC_QSL, SPEC_IDX, SPEC_ACC, T)
        o_ref, pool_ref = spec_f64(d["q"], d["k"], d["v"], d["a"], d["b"], d["A_log"],
                                   d["dt_bias"], d["pool"], SPEC_QSL, SPEC_IDX, SPEC_ACC)
    read, write, reset = plan
    assert read.dtype == np.int32 and write.dtype == np.int32 and reset.dtype == bool
    o, pool = j_scan(j["q"], j["k"], j["v"], g=g, beta=beta, ssm_state=j["pool"],
                     read_slot=i32(read), write_slot=i32(write), reset=jnp.asarray(reset))
    report(f"token scan o [{path}]", rel_rmse(o, o_ref), 1e-5)
    report(f"token scan state [{path}]", state_err(pool, pool_ref, d["pool"]), 1e-5)
    pad = (read < 0) | (write < 0)
    assert not np.any(as_f64(o)[pad])
    # slots the plan never writes are bit-identical
    untouched = [s for s in range(N) if s not in set(write[write >= 0].tolist())]
    assert_untouched(pool, j["pool"], untouched)


def test_token_scan_agrees_with_chunk():
    """Oracle vs chunked prefill on the same f32 inputs: two independent f32 evaluations."""
    sh = SHAPES["gqa"]
    rng = np.random.default_rng(14)
    d = make_gdn_inputs(rng, PRE_T, sh["H"], sh["HV"], sh["K"], sh["V"], PRE_N, F32, F32)
    j = jnp_inputs(d, F32, F32)
    g, beta = j_gating(j["a"], j["b"], A_log=j["A_log"], dt_bias=j["dt_bias"])
    o1, p1 = j_chunk(j["q"], j["k"], j["v"], g=g, beta=beta, ssm_state=j["pool"],
                     query_start_loc=i32(PRE_QSL), state_indices=i32(PRE_SI),
                     has_initial_state=jnp.asarray(PRE_HI), use_qk_l2norm=True)
    read, write, reset = R.scan_plan_prefill(PRE_QSL, PRE_SI, PRE_HI, PRE_T)
    o2, p2 = j_scan(j["q"], j["k"], j["v"], g=g, beta=beta, ssm_state=j["pool"],
                    read_slot=i32(read), write_slot=i32(write), reset=jnp.asarray(reset))
    live = [int(x) for x, n in zip(PRE_SI, np.diff(PRE_QSL)) if x >= 0 and n > 0]
    assert rel_rmse(o1, o2) <= 1e-5
    assert rel_rmse(np.asarray(p1)[live], np.asarray(p2)[live]) <= 1e-5
    np.testing.assert_array_equal(bits(p1)[PRE_UNTOUCHED], bits(p2)[PRE_UNTOUCHED])


@pytest.mark.parametrize("path", ["decode"])
def test_bf16_pool_rounds_like_the_oracle(path):
    """With a bf16 pool, decode stores a rounded state per token and the next step reads it.

    The oracle's carry *is* the bf16 pool, so it rounds after every token by construction.
    The reference must agree with it far more closely than one bf16 rounding (~1.6e-3).
    Residual differences are rare one-ulp flips of ties near a rounding boundary (the two
    evaluate the same math in different op orders). Spec rows differ on purpose: see
    test_bf16_pool_spec_carries_f32.
    """
    act, state = CFGS["bf16_state"]
    sh = SHAPES["gqa"]
    rng = np.random.default_rng(15)
    T = SPEC_T if path == "spec" else len(DEC_SI)
    d = make_gdn_inputs(rng, T, sh["H"], sh["HV"], sh["K"], sh["V"], GDN_N, act, state)
    j = jnp_inputs(d, act, state)
    if path == "spec":
        o1, p1 = j_spec(j["q"], j["k"], j["v"], a=j["a"], b=j["b"], A_log=j["A_log"],
                        dt_bias=j["dt_bias"], ssm_state=j["pool"],
                        query_start_loc=i32(SPEC_QSL), spec_state_indices=i32(SPEC_IDX),
                        num_accepted_tokens=i32(SPEC_ACC))
        plan = R.scan_plan_spec(SPEC_QSL, SPEC_IDX, SPEC_ACC, T)
    else:
        o1, p1 = j_decode(j["q"], j["k"], j["v"], a=j["a"], b=j["b"], A_log=j["A_log"],
                          dt_bias=j["dt_bias"], ssm_state=j["pool"],
                          state_indices=i32(DEC_SI), use_qk_l2norm=True)
        plan = R.scan_plan_decode(DEC_SI)
    g, beta = j_gating(j["a"], j["b"], A_log=j["A_log"], dt_bias=j["dt_bias"])
    read, write, reset = plan
    o2, p2 = j_scan(j["q"], j["k"], j["v"], g=g, beta=beta, ssm_state=j["pool"],
                    read_slot=i32(read), write_slot=i32(write), reset=jnp.asarray(reset))
    w = sorted(set(write[write >= 0].tolist()))
    err_s = rel_rmse(as_f64(p1)[w], as_f64(p2)[w])
    print(f"{path}: o {rel_rmse(o1, o2):.2e} state {err_s:.2e}")
    assert err_s <= 1e-4
    assert rel_rmse(o1, o2) <= 1e-4
    np.testing.assert_array_equal(bits(p1), bits(j["pool"].at[np.array(w)].set(p1[np.array(w)])))


def test_bf16_pool_spec_carries_f32():
    """A spec row carries its state in f32 between tokens: each stored state is one bf16
    rounding of the f32-pool result (not a compounding of roundings along the row), so the
    row's last state equals a prefill of the same tokens up to that one rounding."""
    act, _ = CFGS["bf16_state"]
    sh = SHAPES["gqa"]
    rng = np.random.default_rng(16)
    d = make_gdn_inputs(rng, SPEC_T, sh["H"], sh["HV"], sh["K"], sh["V"], GDN_N, act, jnp.float32)
    j = jnp_inputs(d, act, jnp.float32)
    kw = dict(a=j["a"], b=j["b"], A_log=j["A_log"], dt_bias=j["dt_bias"], query_start_loc=i32(SPEC_QSL),
              spec_state_indices=i32(SPEC_IDX), num_accepted_tokens=i32(SPEC_ACC))
    pool16 = j["pool"].astype(jnp.bfloat16)
    # Same starting values in both pools: the f32 pool holds the bf16 values exactly.
    o32, p32 = j_spec(j["q"], j["k"], j["v"], ssm_state=pool16.astype(jnp.float32), **kw)
    o16, p16 = j_spec(j["q"], j["k"], j["v"], ssm_state=pool16, **kw)
    np.testing.assert_array_equal(np.asarray(o16), np.asarray(o32))
    expect = np.asarray(p32.astype(jnp.bfloat16).astype(jnp.float32))
    got = np.asarray(p16.astype(jnp.float32))
    assert np.mean(got != expect) <= 1e-3


# --- empty batches ------------------------------------------------------------------------------


@pytest.mark.parametrize("T_,S_,N_", [(0, 0, 3), (0, 2, 3), (3, 0, 3), (2, 2, 0), (0, 0, 0)])
def test_empty_batches_called_directly(T_, S_, N_):
    """The reference called directly (not through gdn_jax.ops) on a batch of no tokens, no rows or
    an empty pool (every row padding): zero outputs, pools bit-identical, as the kernels do. Its
    gathers have no empty form, so this once failed at trace time."""
    Hh, HVh, Kh, Vh, Dh, Wh = 1, 2, 4, 4, 8, 4
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.normal(size=(T_, Dh)), F32)
    w = jnp.asarray(rng.normal(size=(Dh, Wh)), F32)
    conv = jnp.asarray(rng.normal(size=(N_, Wh, Dh)), F32)
    ssm = jnp.asarray(rng.normal(size=(N_, HVh, Kh, Vh)), F32)
    q = jnp.asarray(rng.normal(size=(T_, Hh, Kh)), F32)
    v = jnp.asarray(rng.normal(size=(T_, HVh, Vh)), F32)
    gt = jnp.asarray(rng.normal(size=(T_, HVh)), F32)
    qsl = jnp.full((S_ + 1,), 0, jnp.int32).at[-1].set(T_ if S_ else 0)
    idx = jnp.arange(S_, dtype=jnp.int32) if N_ else jnp.full((S_,), -1, jnp.int32)
    gates = dict(A_log=jnp.zeros((HVh,)), dt_bias=jnp.zeros((HVh,)))
    calls = {
        "conv_fwd": (conv, lambda: R.causal_conv1d_fwd(
            x, weight=w, bias=None, conv_state=conv, query_start_loc=qsl, state_indices=idx,
            has_initial_state=jnp.ones((S_,), bool))),
        "conv_update": (conv, lambda: R.causal_conv1d_update(
            x, weight=w, bias=None, conv_state=conv, state_indices=idx, query_start_loc=qsl,
            num_accepted_tokens=jnp.ones((S_,), jnp.int32))),
        "chunk": (ssm, lambda: R.chunk_gated_delta_rule(
            q, q, v, g=-jnp.abs(gt), beta=jax.nn.sigmoid(gt), ssm_state=ssm, query_start_loc=qsl,
            state_indices=idx, has_initial_state=jnp.ones((S_,), bool))),
        "spec": (ssm, lambda: R.fused_sigmoid_gating_delta_rule_update_spec(
            q, q, v, a=gt, b=gt, **gates, ssm_state=ssm, query_start_loc=qsl,
            spec_state_indices=jnp.stack([idx, idx], axis=1), num_accepted_tokens=jnp.ones((S_,), jnp.int32))),
        "token_scan": (ssm, lambda: R.gdn_token_scan(
            q, q, v, g=-jnp.abs(gt), beta=jax.nn.sigmoid(gt), ssm_state=ssm,
            read_slot=jnp.full((T_,), -1, jnp.int32), write_slot=jnp.full((T_,), -1, jnp.int32),
            reset=jnp.zeros((T_,), bool))),
    }
    if T_ == S_:  # decode: one token per row
        calls["decode"] = (ssm, lambda: R.fused_sigmoid_gating_delta_rule_update(
            q, q, v, a=gt, b=gt, **gates, ssm_state=ssm, state_indices=idx))
    for name, (before, call) in calls.items():
        out, pool = call()
        assert out.shape[0] == T_ and not np.any(np.asarray(out)), name
        np.testing.assert_array_equal(np.asarray(pool), np.asarray(before), err_msg=name)
