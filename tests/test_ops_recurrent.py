"""Decode and spec-verify recurrence (gated delta rule with fused gating).

Every native ISA available here is held to tests/f64_math.py (an independent float64
evaluation of the contract) with FLA's relative RMSE at the contract's budget, plus exact
properties: padding, untouched slots, in-place updates, split invariance, spec/decode
agreement, donation, and refusal of bad batches with the cache unchanged.

Error budgets (contract.md, "Accuracy budget"), measured on the slots and rows the step
writes (an untouched slot would dilute the metric):
  f32 act, f32 state:  output, state <= 1e-5
  bf16 act, f32 state: output <= 2e-3, state <= 1e-4
  bf16 state: the stored state is one RNE rounding of the f32 state per token (the state
    stays f32 between the tokens of a row). One rounding has relative error <= 2**-9 per
    element, so rel_rmse(state, f64) <= 2**-9 + (the f32-state budget); and the stored
    value must equal bf16_round(f64) except for rare (<= 0.1 %) one-ulp flips where the f64
    value lies within f32 error of a rounding midpoint (a second rounding per token, e.g.
    re-reading the bf16 slot between the tokens of a row, flips a large fraction). The
    output is computed from the f32 state, so it keeps the budget of its activation dtype.
"""
from __future__ import annotations

import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gdn_jax

sys.path.insert(0, os.path.dirname(__file__))
from f64_math import bf16_round, decode_f64, rel_rmse, spec_f64  # noqa: E402

ISAS = gdn_jax.available_isas() if gdn_jax.native_available() else []
pytestmark = pytest.mark.skipif(not ISAS, reason="native extension not built")

BF16 = jnp.bfloat16
F32 = jnp.float32
ONE_ROUNDING = 2.0**-9

# (act dtype, state dtype) -> (output budget, state budget vs f64)
BUDGET = {
    (F32, F32): (1e-5, 1e-5),
    (BF16, F32): (2e-3, 1e-4),
    (F32, BF16): (1e-5, ONE_ROUNDING + 1e-5),
    (BF16, BF16): (2e-3, ONE_ROUNDING + 1e-4),
}
DTYPES = list(BUDGET)
DT_IDS = ["act_f32-state_f32", "act_bf16-state_f32", "act_f32-state_bf16", "act_bf16-state_bf16"]


# --- inputs ------------------------------------------------------------------------------------


def _as(x, dtype):
    """(jax array in dtype, float64 numpy of exactly its values)."""
    x = np.asarray(x, np.float64)
    if dtype == BF16:
        x = bf16_round(x)
    return jnp.asarray(x, dtype), x


def make_inputs(rng, T, H, HV, K, V, N, act, state, l2norm=True, state_std=0.1):
    """Realistic scales: Qwen-like A_log (A in [1, 16]) and dt_bias (dt in [1e-3, 0.1])."""
    q = rng.standard_normal((T, H, K))
    k = rng.standard_normal((T, H, K))
    if not l2norm:  # the caller normalised them: keep |k| about 1 so the recurrence is stable
        q = q / np.sqrt(K)
        k = k / np.sqrt(K)
    v = rng.standard_normal((T, HV, V))
    a = rng.standard_normal((T, HV))
    b = rng.standard_normal((T, HV))
    A_log = np.log(rng.uniform(1.0, 16.0, HV)).astype(np.float32)
    dt_bias = np.log(np.expm1(rng.uniform(1e-3, 0.1, HV))).astype(np.float32)
    pool = rng.standard_normal((N, HV, K, V)) * state_std
    j, n = {}, {}
    for name, x, dt in (("q", q, act), ("k", k, act), ("v", v, act), ("a", a, act), ("b", b, act),
                        ("A_log", A_log, F32), ("dt_bias", dt_bias, F32), ("ssm_state", pool, state)):
        j[name], n[name] = _as(x, dt)
    return j, n


def _copy(x):
    return jnp.array(np.asarray(x), dtype=x.dtype)


def decode(j, idx, *, jit=False, scale=None, l2norm=True, eps=1e-6, impl="native"):
    def f(q, k, v, a, b, A_log, dt_bias, st, idx):
        return gdn_jax.fused_sigmoid_gating_delta_rule_update(
            q, k, v, a=a, b=b, A_log=A_log, dt_bias=dt_bias, ssm_state=st, state_indices=idx, scale=scale,
            use_qk_l2norm=l2norm, l2norm_eps=eps, impl=impl)
    if jit:
        f = jax.jit(f)
    return f(j["q"], j["k"], j["v"], j["a"], j["b"], j["A_log"], j["dt_bias"], j["ssm_state"],
             jnp.asarray(idx, jnp.int32))


def spec(j, qsl, sidx, acc, *, jit=False, scale=None, l2norm=True, eps=1e-6, impl="native"):
    def f(q, k, v, a, b, A_log, dt_bias, st, qsl, sidx, acc):
        return gdn_jax.fused_sigmoid_gating_delta_rule_update_spec(
            q, k, v, a=a, b=b, A_log=A_log, dt_bias=dt_bias, ssm_state=st, query_start_loc=qsl,
            spec_state_indices=sidx, num_accepted_tokens=acc, scale=scale, use_qk_l2norm=l2norm,
            l2norm_eps=eps, impl=impl)
    if jit:
        f = jax.jit(f)
    return f(j["q"], j["k"], j["v"], j["a"], j["b"], j["A_log"], j["dt_bias"], j["ssm_state"],
             jnp.asarray(qsl, jnp.int32), jnp.asarray(sidx, jnp.int32), jnp.asarray(acc, jnp.int32))


def f64_decode(n, idx, scale=None, l2norm=True, eps=1e-6):
    return decode_f64(n["q"], n["k"], n["v"], n["a"], n["b"], n["A_log"], n["dt_bias"], n["ssm_state"],
                      np.asarray(idx), scale=scale, use_qk_l2norm=l2norm, eps=eps)


def f64_spec(n, qsl, sidx, acc, scale=None, l2norm=True, eps=1e-6):
    return spec_f64(n["q"], n["k"], n["v"], n["a"], n["b"], n["A_log"], n["dt_bias"], n["ssm_state"],
                    np.asarray(qsl), np.asarray(sidx), np.asarray(acc), scale=scale, use_qk_l2norm=l2norm, eps=eps)


def f64(x):
    return np.asarray(jnp.asarray(x, F32), np.float64)


def _bf16_quantum(x):
    """Spacing of the bf16 values around |x| (8 significant bits)."""
    _, e = np.frexp(np.abs(x))
    return np.exp2(np.maximum(e - 8, -133).astype(np.float64))


def check_state(st, ref, slots, state_dtype, budget, what=""):
    """Budget on the written slots; for a bf16 pool also 'exactly one rounding': each stored
    value is bf16_round of the exact state, except for rare one-ulp flips where the exact
    value lies within f32 error of a rounding midpoint."""
    slots = sorted(set(int(s) for s in slots))
    got, want = f64(st)[slots], ref[slots]
    err = rel_rmse(got, want)
    assert err <= budget, f"{what} state rel_rmse {err:.3g} > {budget:.3g}"
    if state_dtype == BF16:
        flips = got != bf16_round(want)
        assert flips.mean() <= 1e-3, f"{what} {flips.mean():.3g} of the bf16 state is not RNE(exact state)"
        # a flipped value is still a neighbour of the exact one: half a quantum plus f32 error
        # (absolute, on the scale of the state: cancellation makes it large relative to a
        # small element)
        slack = 1e-5 * np.sqrt(np.mean(want**2))
        excess = np.abs(got - want)[flips] - 0.5 * _bf16_quantum(want[flips])
        assert np.all(excess <= slack), f"{what} bf16 state off by more than a rounding: {excess.max():.3g}"
    return err


def check_untouched(st_new, st_old, written):
    keep = np.setdiff1d(np.arange(st_old.shape[0]), np.asarray(sorted(set(int(s) for s in written)), int))
    a = np.asarray(st_new).view(np.uint8).reshape(st_old.shape[0], -1)
    b = np.asarray(st_old).view(np.uint8).reshape(st_old.shape[0], -1)
    assert np.array_equal(a[keep], b[keep]), "a slot the batch does not name changed"


# --- decode ------------------------------------------------------------------------------------


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtypes", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("G", [1, 2], ids=["HV=H", "HV=2H"])
@pytest.mark.parametrize("l2norm", [True, False], ids=["l2norm", "no_l2norm"])
def test_decode_accuracy(isa, dtypes, G, l2norm):
    act, state = dtypes
    rng = np.random.default_rng([G, int(l2norm), DTYPES.index(dtypes)])
    B, H, K, V, N = 5, 2, 32, 48, 9
    j, n = make_inputs(rng, B, H, H * G, K, V, N, act, state, l2norm=l2norm)
    idx = np.array([7, 0, -1, 3, 5], np.int32)
    old = np.asarray(j["ssm_state"]).copy()
    with gdn_jax.use_isa(isa):
        o, st = decode(j, idx, jit=True, l2norm=l2norm)
    assert o.dtype == act and o.shape == (B, H * G, V) and st.dtype == state
    ro, rs = f64_decode(n, idx, l2norm=l2norm)
    live = idx != -1
    ob, sb = BUDGET[dtypes]
    err = rel_rmse(f64(o)[live], ro[live])
    assert err <= ob, f"output rel_rmse {err:.3g} > {ob:.3g}"
    check_state(st, rs, idx[live], state, sb)
    assert np.all(f64(o)[~live] == 0)
    check_untouched(st, old, idx[live])


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("KV", [(16, 16), (32, 48), (64, 80), (20, 24), (128, 128), (32, 160)],
                         ids=lambda kv: f"K{kv[0]}V{kv[1]}")
def test_decode_head_dims(isa, KV):
    """Full 32-column blocks, a 16-column tail, K, V that are not multiples of 16, and V = 160 (with
    enough rows for the threads a 128-column block and a 32-column one on AVX-512:
    test_decode_split_invariance; on two or more threads the three rows here are cut into 32-column
    pieces)."""
    K, V = KV
    rng = np.random.default_rng(K * 1000 + V)
    B, H, HV, N = 3, 1, 2, 4
    for act, state in ((F32, F32), (BF16, BF16)):
        j, n = make_inputs(rng, B, H, HV, K, V, N, act, state)
        idx = np.array([2, 0, 3], np.int32)
        with gdn_jax.use_isa(isa):
            o, st = decode(j, idx)
        ro, rs = f64_decode(n, idx)
        ob, sb = BUDGET[(act, state)]
        assert rel_rmse(f64(o), ro) <= ob
        check_state(st, rs, idx, state, sb)
        check_untouched(st, np.asarray(j["ssm_state"]), idx)


@pytest.mark.parametrize("isa", ISAS)
def test_decode_custom_scale_and_eps(isa):
    rng = np.random.default_rng(11)
    B, H, HV, K, V, N = 4, 2, 4, 32, 32, 6
    j, n = make_inputs(rng, B, H, HV, K, V, N, F32, F32)
    idx = np.array([1, 4, 0, 5], np.int32)
    for scale, eps, l2 in ((0.37, 1e-5, True), (1.0, 1e-6, False), (None, 1e-2, True)):
        with gdn_jax.use_isa(isa):
            o, st = decode(j, idx, scale=scale, eps=eps, l2norm=l2)
        ro, rs = f64_decode(n, idx, scale=scale, eps=eps, l2norm=l2)
        assert rel_rmse(f64(o), ro) <= 1e-5, (scale, eps, l2)
        check_state(st, rs, idx, F32, 1e-5)
    # the arguments reach the kernel: a different scale or eps changes the output
    with gdn_jax.use_isa(isa):
        o1, _ = decode(j, idx, scale=0.37)
        o2, _ = decode(j, idx, scale=0.38)
        o3, _ = decode(j, idx, eps=1.0)
    assert not np.array_equal(np.asarray(o1), np.asarray(o2))
    assert rel_rmse(f64(o3), f64_decode(n, idx, eps=1.0)[0]) <= 1e-5


@pytest.mark.parametrize("isa", ISAS)
def test_decode_qwen_shape(isa):
    """Qwen3-Next per-layer heads (H=16, HV=32, K=V=128), bf16 activations, f32 state."""
    rng = np.random.default_rng(3)
    B, H, HV, K, V, N = 3, 16, 32, 128, 128, 5
    j, n = make_inputs(rng, B, H, HV, K, V, N, BF16, F32)
    idx = np.array([4, 1, 2], np.int32)
    with gdn_jax.use_isa(isa):
        o, st = decode(j, idx, jit=True)
    ro, rs = f64_decode(n, idx)
    assert rel_rmse(f64(o), ro) <= 2e-3
    check_state(st, rs, idx, F32, 1e-4)


@pytest.mark.parametrize("isa", ISAS)
def test_bf16_head_params(isa):
    """A_log and dt_bias in bf16 (as a bf16 model stores them) are read unconverted: decode and
    spec give the same bits as f32 arrays of the same values, which follow float64."""
    rng = np.random.default_rng(15)
    B, H, HV, K, V, N = 4, 2, 4, 32, 48, 12
    j, n = make_inputs(rng, B, H, HV, K, V, N, BF16, F32)
    for name in ("A_log", "dt_bias"):
        n[name] = bf16_round(n[name])
        j[name] = jnp.asarray(n[name], F32)
    idx = np.array([7, 0, -1, 3], np.int32)
    qsl, sidx, acc = np.array([0, 2, 3, 4, 4]), np.array([[1, 2], [4, 5], [8, -1], [-1, -1]]), np.array([2, 1, 1, 1])
    with gdn_jax.use_isa(isa):
        o32, s32 = decode(dict(j, ssm_state=_copy(j["ssm_state"])), idx, jit=True)
        p32 = spec(dict(j, ssm_state=_copy(j["ssm_state"])), qsl, sidx, acc, jit=True)
        assert np.all(np.any(f64(p32[0])[:3] != 0, axis=(1, 2))), "spec batch refused"
        for pa, pd in [(BF16, BF16), (F32, BF16), (BF16, F32)]:
            jb = dict(j, A_log=j["A_log"].astype(pa), dt_bias=j["dt_bias"].astype(pd))
            o, st = decode(dict(jb, ssm_state=_copy(j["ssm_state"])), idx, jit=True)
            assert np.array_equal(f64(o), f64(o32)) and np.array_equal(f64(st), f64(s32)), f"decode {pa} {pd}"
            for got, want in zip(spec(dict(jb, ssm_state=_copy(j["ssm_state"])), qsl, sidx, acc, jit=True), p32):
                assert np.array_equal(f64(got), f64(want)), f"spec {pa} {pd}"
    ro, rs = f64_decode(n, idx)
    live = idx != -1
    assert rel_rmse(f64(o32)[live], ro[live]) <= BUDGET[(BF16, F32)][0]


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("state", [F32, BF16], ids=["state_f32", "state_bf16"])
@pytest.mark.parametrize("V", [128, 160])
def test_decode_split_invariance(isa, state, V):
    """Rows decoded together or one at a time give the same bits: the V split differs (one row is
    cut into 32-column pieces for the threads; a batch takes 128-column blocks on AVX-512)."""
    rng = np.random.default_rng(5)
    B, H, HV, K, N = 6, 1, 2, 32, 8
    j, _ = make_inputs(rng, B, H, HV, K, V, N, BF16, state)
    idx = np.array([3, 6, 0, 1, 7, 2], np.int32)
    with gdn_jax.use_isa(isa):
        o_all, st_all = decode(j, idx)
        for r in range(B):
            jr = {name: (x[r:r + 1] if name in ("q", "k", "v", "a", "b") else x) for name, x in j.items()}
            o_r, st_r = decode(jr, idx[r:r + 1])
            assert np.array_equal(np.asarray(o_r[0]), np.asarray(o_all[r])), f"row {r} output"
            s = idx[r]
            assert np.array_equal(np.asarray(st_r[s]), np.asarray(st_all[s])), f"row {r} state"


@pytest.mark.parametrize("isa", ISAS)
def test_decode_padding_reads_nothing(isa):
    """A padding row's inputs may be garbage (NaN): its output is 0 and no slot changes."""
    rng = np.random.default_rng(8)
    B, H, HV, K, V, N = 4, 2, 4, 32, 48, 5
    j, n = make_inputs(rng, B, H, HV, K, V, N, BF16, F32)
    for name in ("q", "k", "v", "a", "b"):
        x = np.array(j[name].astype(F32))
        x[1] = np.nan
        j[name] = jnp.asarray(x, BF16)
        n[name] = x.astype(np.float64)
    st0 = np.asarray(j["ssm_state"]).copy()
    st0[0] = np.nan  # a stale slot nobody names
    j["ssm_state"] = jnp.asarray(st0)
    n["ssm_state"] = st0.astype(np.float64)
    idx = np.array([2, -1, 4, 3], np.int32)
    with gdn_jax.use_isa(isa):
        o, st = decode(j, idx)
    o = f64(o)
    assert np.all(o[1] == 0) and np.all(np.isfinite(o))
    check_untouched(st, st0, [2, 4, 3])
    ro, _ = f64_decode({**n, "ssm_state": np.nan_to_num(n["ssm_state"])}, idx)
    assert rel_rmse(o, ro) <= 2e-3


@pytest.mark.parametrize("isa", ISAS)
def test_decode_all_padding_and_empty(isa):
    rng = np.random.default_rng(9)
    j, _ = make_inputs(rng, 3, 1, 2, 16, 16, 4, F32, F32)
    st0 = np.asarray(j["ssm_state"]).copy()
    with gdn_jax.use_isa(isa):
        o, st = decode(j, np.array([-1, -1, -1], np.int32))
    assert np.all(np.asarray(o) == 0)
    assert np.array_equal(np.asarray(st), st0)
    j0, _ = make_inputs(rng, 0, 1, 2, 16, 16, 4, F32, F32)
    with gdn_jax.use_isa(isa):
        o, st = decode(j0, np.zeros((0,), np.int32))
    assert o.shape == (0, 2, 16)
    assert np.array_equal(np.asarray(st), np.asarray(j0["ssm_state"]))


# --- spec verify -------------------------------------------------------------------------------


def spec_batch(rng, S, num_spec, N, q_lens=None, accs=None, pad_rows=(), T_extra=0):
    """Ragged rows with distinct slots across rows; returns (qsl, sidx, acc, T)."""
    M = num_spec + 1
    if q_lens is None:
        q_lens = rng.integers(1, M + 1, S)
    if accs is None:
        accs = rng.integers(1, M + 1, S)
    q_lens, accs = np.asarray(q_lens), np.asarray(accs)
    slots = rng.permutation(N)[: S * M].reshape(S, M).astype(np.int32)
    for r in pad_rows:
        slots[r] = -1
    qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    return qsl, slots, accs.astype(np.int32), int(qsl[-1]) + T_extra


def written_slots(qsl, sidx, acc):
    out = []
    for i in range(sidx.shape[0]):
        if sidx[i, 0] != -1:
            out += [int(s) for s in sidx[i, : qsl[i + 1] - qsl[i]]]
    return out


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtypes", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("G", [1, 2], ids=["HV=H", "HV=2H"])
def test_spec_accuracy(isa, dtypes, G):
    act, state = dtypes
    rng = np.random.default_rng(100 + G)
    S, num_spec, H, K, V = 6, 3, 2, 32, 48
    HV = H * G
    N = S * (num_spec + 1) + 3
    # ragged rows, every acc in [1, num_spec + 1], a padding row, a zero-length row, and
    # tokens past query_start_loc[S]
    q_lens = [4, 1, 3, 2, 0, 4]
    accs = [1, 4, 2, 3, 1, 4]
    qsl, sidx, acc, T = spec_batch(rng, S, num_spec, N, q_lens, accs, pad_rows=(3,), T_extra=2)
    j, n = make_inputs(rng, T, H, HV, K, V, N, act, state)
    old = np.asarray(j["ssm_state"]).copy()
    with gdn_jax.use_isa(isa):
        o, st = spec(j, qsl, sidx, acc, jit=True)
    ro, rs = f64_spec(n, qsl, sidx, acc)
    live_tok = np.zeros(T, bool)
    for i in range(S):
        if sidx[i, 0] != -1:
            live_tok[qsl[i]:qsl[i + 1]] = True
    ob, sb = BUDGET[dtypes]
    err = rel_rmse(f64(o)[live_tok], ro[live_tok])
    assert err <= ob, f"output rel_rmse {err:.3g} > {ob:.3g}"
    assert np.all(f64(o)[~live_tok] == 0), "padding rows and uncovered tokens must be zero"
    w = written_slots(qsl, sidx, acc)
    check_state(st, rs, w, state, sb)
    check_untouched(st, old, w)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("state", [F32, BF16], ids=["state_f32", "state_bf16"])
@pytest.mark.parametrize("V", [64, 40])
def test_spec_in_place(isa, state, V):
    """The start column acc-1 is also written (by token acc-1): read once, then overwritten.
    V=64: the other slots are written with non-temporal stores; V=40 (not a multiple of 16):
    plain stores throughout, an f32 state continues from the slot it just wrote."""
    rng = np.random.default_rng(21)
    H, HV, K, N = 1, 2, 32, 12
    qsl = np.array([0, 4, 7, 8], np.int32)
    sidx = np.array([[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]], np.int32)
    acc = np.array([2, 3, 1], np.int32)  # row 0 reads slot 1, row 1 slot 6, row 2 slot 8: all rewritten
    j, n = make_inputs(rng, 8, H, HV, K, V, N, F32, state)
    with gdn_jax.use_isa(isa):
        o, st = spec(j, qsl, sidx, acc)
    ro, rs = f64_spec(n, qsl, sidx, acc)
    assert rel_rmse(f64(o), ro) <= 1e-5
    check_state(st, rs, [0, 1, 2, 3, 4, 5, 6, 8], state, BUDGET[(F32, state)][1])
    check_untouched(st, np.asarray(j["ssm_state"]), [0, 1, 2, 3, 4, 5, 6, 8])


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("state", [F32, BF16], ids=["state_f32", "state_bf16"])
def test_spec_long_rows(isa, state):
    """Rows longer than the kernel's token group (8): the state carries over in f32."""
    rng = np.random.default_rng(31)
    num_spec, H, HV, K, V = 11, 2, 4, 32, 48
    M = num_spec + 1
    N = 3 * M
    qsl = np.array([0, 12, 21, 30], np.int32)
    sidx = np.arange(3 * M, dtype=np.int32).reshape(3, M)[[2, 0, 1]]
    acc = np.array([12, 1, 9], np.int32)
    j, n = make_inputs(rng, 30, H, HV, K, V, N, F32, state)
    with gdn_jax.use_isa(isa):
        o, st = spec(j, qsl, sidx, acc)
    ro, rs = f64_spec(n, qsl, sidx, acc)
    assert rel_rmse(f64(o), ro) <= 1e-5
    check_state(st, rs, written_slots(qsl, sidx, acc), state, BUDGET[(F32, state)][1])


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("state", [F32, BF16], ids=["state_f32", "state_bf16"])
def test_spec_all_rejected_equals_decode(isa, state):
    """Spec steps whose drafts are all rejected (acc = 1 next step) follow plain decode
    bit for bit: the accepted token's output and the state in column 0."""
    rng = np.random.default_rng(41)
    S, num_spec, H, HV, K, V = 3, 3, 2, 4, 32, 48
    M = num_spec + 1
    N = S * M + 2
    steps = 4
    _, n0 = make_inputs(rng, 1, H, HV, K, V, N, BF16, state)
    pool_spec = jnp.asarray(n0["ssm_state"], state)
    pool_dec = pool_spec
    sidx = rng.permutation(N)[: S * M].reshape(S, M).astype(np.int32)
    qsl = np.arange(0, S * M + 1, M, dtype=np.int32)
    acc = np.ones(S, np.int32)
    with gdn_jax.use_isa(isa):
        for _ in range(steps):
            js, _ = make_inputs(rng, S * M, H, HV, K, V, N, BF16, state)
            js["A_log"], js["dt_bias"] = _as(n0["A_log"], F32)[0], _as(n0["dt_bias"], F32)[0]
            js["ssm_state"] = pool_spec
            o_s, pool_spec = spec(js, qsl, sidx, acc)
            first = qsl[:-1]
            jd = {name: (x[first] if name in ("q", "k", "v", "a", "b") else x) for name, x in js.items()}
            jd["ssm_state"] = pool_dec
            o_d, pool_dec = decode(jd, sidx[:, 0])
            assert np.array_equal(np.asarray(o_s)[first], np.asarray(o_d))
            assert np.array_equal(np.asarray(pool_spec)[sidx[:, 0]], np.asarray(pool_dec)[sidx[:, 0]])


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("state", [F32, BF16], ids=["state_f32", "state_bf16"])
def test_spec_steps_follow_f64(isa, state):
    """A few verify steps with random acceptance, each step's pool fed to the next."""
    rng = np.random.default_rng(51)
    S, num_spec, H, HV, K, V = 4, 2, 1, 2, 32, 32
    M = num_spec + 1
    N = S * M
    sidx = rng.permutation(N).reshape(S, M).astype(np.int32)
    _, n0 = make_inputs(rng, 1, H, HV, K, V, N, F32, state)
    pool = jnp.asarray(n0["ssm_state"], state)
    acc = np.ones(S, np.int32)
    with gdn_jax.use_isa(isa):
        for step in range(4):
            q_lens = rng.integers(1, M + 1, S)
            qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
            j, n = make_inputs(rng, int(qsl[-1]), H, HV, K, V, N, F32, state)
            j["ssm_state"], n["ssm_state"] = pool, f64(pool)
            o, pool = spec(j, qsl, sidx, acc)
            ro, rs = f64_spec(n, qsl, sidx, acc)
            assert rel_rmse(f64(o), ro) <= 1e-5, step
            check_state(pool, rs, written_slots(qsl, sidx, acc), state, BUDGET[(F32, state)][1])
            acc = np.array([rng.integers(1, ql + 1) for ql in q_lens], np.int32)


# --- donation and bad batches ------------------------------------------------------------------


@pytest.mark.parametrize("isa", ISAS)
def test_donation_updates_in_place(isa):
    rng = np.random.default_rng(61)
    j, n = make_inputs(rng, 3, 2, 4, 32, 32, 6, BF16, F32)
    idx = jnp.asarray([4, -1, 1], jnp.int32)

    def _dec(st, q, k, v, a, b):
        return gdn_jax.fused_sigmoid_gating_delta_rule_update(
            q, k, v, a=a, b=b, A_log=j["A_log"], dt_bias=j["dt_bias"], ssm_state=st, state_indices=idx)

    dec = jax.jit(_dec, donate_argnums=0)
    st = _copy(j["ssm_state"])
    ptr = st.unsafe_buffer_pointer()
    with gdn_jax.use_isa(isa):
        o, st2 = dec(st, j["q"], j["k"], j["v"], j["a"], j["b"])
        st2.block_until_ready()
    assert st.is_deleted()
    assert st2.unsafe_buffer_pointer() == ptr
    ro, rs = f64_decode(n, np.asarray(idx))
    assert rel_rmse(f64(o), ro) <= 2e-3
    check_state(st2, rs, [4, 1], F32, 1e-4)

    # spec: the same buffer survives a verify step too
    qsl = jnp.asarray([0, 2, 3], jnp.int32)
    sidx = jnp.asarray([[0, 2], [5, 3]], jnp.int32)
    accs = jnp.asarray([2, 1], jnp.int32)
    spec_step = jax.jit(lambda st, q, k, v, a, b: gdn_jax.fused_sigmoid_gating_delta_rule_update_spec(
        q, k, v, a=a, b=b, A_log=j["A_log"], dt_bias=j["dt_bias"], ssm_state=st, query_start_loc=qsl,
        spec_state_indices=sidx, num_accepted_tokens=accs), donate_argnums=0)
    with gdn_jax.use_isa(isa):
        o3, st3 = spec_step(st2, j["q"], j["k"], j["v"], j["a"], j["b"])
        st3.block_until_ready()
    assert st3.unsafe_buffer_pointer() == ptr


def _bad_decode_cases(N):
    return {
        "slot_out_of_range": np.array([0, N, 2], np.int32),
        "negative_slot": np.array([0, -2, 2], np.int32),
        "slot_twice": np.array([1, 3, 1], np.int32),
    }


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("case", list(_bad_decode_cases(6)))
def test_decode_bad_batch(isa, case):
    rng = np.random.default_rng(71)
    N = 6
    j, _ = make_inputs(rng, 3, 1, 2, 16, 32, N, BF16, F32)
    idx = _bad_decode_cases(N)[case]
    st0 = np.asarray(j["ssm_state"]).copy()
    with gdn_jax.use_isa(isa):
        with pytest.raises(gdn_jax.InvalidBatchError):
            decode(j, idx)
        # the jitted, donated form returns the cache unchanged and a nonzero status
        f = jax.jit(lambda st, idx: gdn_jax.ops.fused_sigmoid_gating_delta_rule_update_with_status(
            j["q"], j["k"], j["v"], a=j["a"], b=j["b"], A_log=j["A_log"], dt_bias=j["dt_bias"], ssm_state=st,
            state_indices=idx), donate_argnums=0)
        o, st, status = f(_copy(j["ssm_state"]), jnp.asarray(idx))
    assert int(status[0]) != 0
    assert np.array_equal(np.asarray(st), st0)
    assert np.all(np.asarray(o.astype(F32)) == 0)


def _bad_spec_cases(N):
    # (qsl, sidx, acc) with num_spec = 2 (3 columns), T = 7
    ok_qsl = np.array([0, 3, 5, 6], np.int32)
    ok_sidx = np.array([[0, 1, 2], [3, 4, 5], [6, 7, 8]], np.int32)
    ok_acc = np.array([1, 3, 2], np.int32)
    cases = {}

    def mk(name, qsl=ok_qsl, sidx=ok_sidx, acc=ok_acc):
        cases[name] = (np.array(qsl, np.int32), np.array(sidx, np.int32), np.array(acc, np.int32))

    mk("ok")
    mk("slot_out_of_range", sidx=[[0, 1, 2], [3, N, 5], [6, 7, 8]])
    mk("start_slot_out_of_range", sidx=[[0, 1, 2], [3, 4, 5], [6, 7 + N, 8]])  # column acc-1 of row 2
    mk("negative_slot", sidx=[[0, 1, 2], [3, 4, -2], [6, 7, 8]])
    mk("slot_twice_across_rows", sidx=[[0, 1, 2], [3, 4, 5], [6, 1, 8]])
    mk("qsl_not_monotone", qsl=[0, 3, 2, 6])
    mk("qsl_not_starting_at_0", qsl=[1, 3, 5, 6])
    mk("qsl_past_T", qsl=[0, 3, 5, 8])
    mk("num_accepted_0", acc=[1, 0, 2])
    mk("num_accepted_too_big", acc=[1, 4, 2])
    mk("row_too_long", qsl=[0, 4, 5, 6])
    return cases


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("case", list(_bad_spec_cases(12)))
def test_spec_bad_batch(isa, case):
    rng = np.random.default_rng(81)
    N = 12
    j, _ = make_inputs(rng, 7, 1, 2, 16, 32, N, F32, BF16)
    qsl, sidx, acc = _bad_spec_cases(N)[case]
    st0 = np.asarray(j["ssm_state"]).copy()
    with gdn_jax.use_isa(isa):
        if case == "ok":
            o, st = spec(j, qsl, sidx, acc)
            assert not np.array_equal(np.asarray(st), st0)
            return
        with pytest.raises(gdn_jax.InvalidBatchError):
            spec(j, qsl, sidx, acc)
        f = jax.jit(lambda st, qsl, sidx, acc: gdn_jax.ops.fused_sigmoid_gating_delta_rule_update_spec_with_status(
            j["q"], j["k"], j["v"], a=j["a"], b=j["b"], A_log=j["A_log"], dt_bias=j["dt_bias"], ssm_state=st,
            query_start_loc=qsl, spec_state_indices=sidx, num_accepted_tokens=acc), donate_argnums=0)
        o, st, status = f(_copy(j["ssm_state"]), jnp.asarray(qsl), jnp.asarray(sidx), jnp.asarray(acc))
    assert int(status[0]) != 0
    assert np.array_equal(np.asarray(st).view(np.uint16), st0.view(np.uint16))
    assert np.all(np.asarray(o) == 0)


def test_head_dim_limit():
    """K or V above 256 (the kernel's stack buffers) is refused, not overrun."""
    rng = np.random.default_rng(91)
    j, _ = make_inputs(rng, 1, 1, 1, 16, 272, 1, F32, F32)
    with pytest.raises(Exception, match="256"):
        jax.block_until_ready(decode(j, np.array([0], np.int32)))


# --- against the pure-jnp reference ------------------------------------------------------------


# The reference and the kernel both carry f32 between the tokens of a spec row (one bf16
# rounding per stored state on a bf16 pool).
SPEC_REF_DTYPES = [pytest.param(d, id=i) for d, i in zip(DTYPES, DT_IDS)]


@pytest.mark.parametrize("isa", ISAS[:1])  # the reference is ISA-independent; every ISA meets f64 above
@pytest.mark.parametrize("dtypes", DTYPES, ids=DT_IDS)
def test_native_vs_reference_decode(isa, dtypes):
    act, state = dtypes
    rng = np.random.default_rng(102)
    H, HV, K, V, N = 2, 4, 32, 48, 8
    idx = np.array([3, -1, 0, 5], np.int32)
    j, n = make_inputs(rng, 4, H, HV, K, V, N, act, state)
    ob, sb = BUDGET[dtypes]
    with gdn_jax.use_isa(isa):
        o_n, st_n = decode(j, idx)
    o_r, st_r = decode(j, idx, impl="reference")
    ro, rs = f64_decode(n, idx)
    for o, st in ((o_n, st_n), (o_r, st_r)):
        assert rel_rmse(f64(o), ro) <= ob
        check_state(st, rs, [3, 0, 5], state, sb)
    assert rel_rmse(f64(o_n), f64(o_r)) <= 2 * ob
    check_untouched(st_r, np.asarray(j["ssm_state"]), [3, 0, 5])


@pytest.mark.parametrize("isa", ISAS[:1])  # the reference is ISA-independent; every ISA meets f64 above
@pytest.mark.parametrize("dtypes", SPEC_REF_DTYPES)
def test_native_vs_reference_spec(isa, dtypes):
    act, state = dtypes
    rng = np.random.default_rng(101)
    S, num_spec, H, HV, K, V = 4, 2, 2, 4, 32, 48
    N = S * (num_spec + 1) + 2
    qsl, sidx, acc, T = spec_batch(rng, S, num_spec, N, [3, 1, 2, 3], [1, 3, 2, 1], pad_rows=(2,), T_extra=1)
    j, n = make_inputs(rng, T, H, HV, K, V, N, act, state)
    ob, sb = BUDGET[dtypes]
    with gdn_jax.use_isa(isa):
        o_n, st_n = spec(j, qsl, sidx, acc)
    ro, rs = f64_spec(n, qsl, sidx, acc)
    w = written_slots(qsl, sidx, acc)
    assert rel_rmse(f64(o_n), ro) <= ob
    check_state(st_n, rs, w, state, sb)
    o_r, st_r = spec(j, qsl, sidx, acc, impl="reference")
    check_untouched(st_r, np.asarray(j["ssm_state"]), w)
    assert rel_rmse(f64(o_r), ro) <= ob
    check_state(st_r, rs, w, state, sb)
    assert rel_rmse(f64(o_n), f64(o_r)) <= 2 * ob
