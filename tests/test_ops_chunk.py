"""chunk_gated_delta_rule (chunked WY prefill): native kernels (every ISA here) against the
float64 evaluation of the contract (tests/f64_math.py), plus the varlen / slot / safety rules.

Budgets (contract.md, rel RMSE vs float64): f32 act + f32 state: output and final state <= 1e-5;
bf16 act + f32 state: output <= 3e-3, final state <= 2e-3. A bf16 state pool adds exactly one
bf16 rounding of the final state per call (the kernel keeps an f32 working state and rounds
once when it writes the slot back), so its final-state bound is the f32-state budget plus the
size of that one rounding, measured on the same values: rel_rmse(bf16_round(ref), ref). The
output does not see the pool's dtype except through the initial state, which the float64
evaluation reads as the same (exact bf16) values, so the output budget is unchanged.
"""
import contextlib
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gdn_jax
from f64_math import bf16_round, gating_f64, prefill_f64, rel_rmse

ISAS = gdn_jax.available_isas()
F32, BF16 = jnp.float32, jnp.bfloat16
BUDGET = {  # (output, final state) for an f32 state pool
    F32: (1e-5, 1e-5),
    BF16: (3e-3, 2e-3),
}


def _round(x, dtype):
    return bf16_round(x) if dtype == BF16 else np.asarray(np.asarray(x, np.float32), np.float64)


def _gates(rng, T, HV, strong=False):
    """g (log decay) and beta from the contract's gating, as exact f32 values."""
    a = rng.normal(size=(T, HV))
    b = rng.normal(size=(T, HV)) * 2.0
    if strong:  # decays of -5 .. -40 per token: e^Gc underflows inside a chunk
        A_log = np.log(rng.uniform(4.0, 16.0, size=HV))
        dt_bias = np.full(HV, 1.0)
    else:  # realistic: g mostly in [-2, 0]
        A_log = np.log(rng.uniform(1.0, 16.0, size=HV))
        dt_bias = np.full(HV, -4.0)
    g, beta = gating_f64(a, b, A_log, dt_bias)
    return np.float32(g).astype(np.float64), np.float32(beta).astype(np.float64)


def _problem(seed, T, H, HV, K, V, N, act, state, strong=False, qk_scale=1.0):
    rng = np.random.default_rng(seed)
    q = _round(rng.normal(size=(T, H, K)) * qk_scale, act)
    k = _round(rng.normal(size=(T, H, K)) * qk_scale, act)
    v = _round(rng.normal(size=(T, HV, V)), act)
    g, beta = _gates(rng, T, HV, strong)
    pool = _round(rng.normal(size=(N, HV, K, V)) * 0.3, state)
    return q, k, v, g, beta, pool


def _poison_heap():
    """Leave freed NaN-filled memory in the C heap just before a call. The output buffer XLA
    allocates then most likely starts as garbage rather than fresh zero pages, so output rows
    the kernel fails to write (padding rows, tokens past query_start_loc[S]) show up instead
    of passing by luck. (Freeing a large mmapped block raises glibc's mmap threshold, so the
    next blocks come from the heap, which then holds the NaNs.)"""
    for n in (1 << 22, 1 << 20, 1 << 18, 1 << 16, 1 << 14):
        junk = np.full(n // 8, np.nan)
        del junk


def _run(q, k, v, g, beta, pool, qsl, idx, his, act, state, isa, **kw):
    """Native op under jit with the pool donated; returns numpy (o, pool)."""
    fn = jax.jit(functools.partial(gdn_jax.chunk_gated_delta_rule, impl="native", **kw), donate_argnames="ssm_state")
    args = [jnp.asarray(x, act) for x in (q, k, v)]
    named = dict(g=jnp.asarray(g, F32), beta=jnp.asarray(beta, F32), ssm_state=jnp.asarray(pool, state),
                 query_start_loc=jnp.asarray(qsl, jnp.int32), state_indices=jnp.asarray(idx, jnp.int32),
                 has_initial_state=jnp.asarray(his, bool))
    _poison_heap()
    with gdn_jax.use_isa(isa):
        o, st = fn(*args, **named)
        o, st = np.asarray(o), np.asarray(st)
    assert o.dtype == jnp.dtype(act) and st.dtype == jnp.dtype(state)
    return o, st


def _bits(x):
    x = np.asarray(x)
    return x.view(np.uint16 if x.dtype.itemsize == 2 else np.uint32)


def _check(o, st, ref_o, ref_pool, pool_in, qsl, idx, act, state, written):
    """Budgets on output and written slots; padding / uncovered rows zero; others bit-identical."""
    out_b, st_b = BUDGET[act]
    e_o = rel_rmse(o.astype(np.float64), ref_o)
    assert e_o <= out_b, f"output rel RMSE {e_o:.3g} > {out_b}"
    ws = sorted(written)
    ref_w = ref_pool[ws]
    got_w = st[ws].astype(np.float64)
    assert np.all(np.isfinite(got_w))
    e_s = rel_rmse(got_w, ref_w)
    if state == BF16:
        one_rounding = rel_rmse(bf16_round(ref_w), ref_w)
        assert e_s <= st_b + one_rounding, f"state rel RMSE {e_s:.3g} > {st_b} + {one_rounding:.3g}"
    else:
        assert e_s <= st_b, f"state rel RMSE {e_s:.3g} > {st_b}"
    for s in range(len(idx)):
        if idx[s] == -1:
            assert not np.any(o[qsl[s]:qsl[s + 1]]), "padding row output must be zero"
    assert not np.any(o[qsl[-1]:]), "tokens past query_start_loc[S] must be zero"
    pool_in = np.asarray(jnp.asarray(pool_in, state))  # what the kernel was given
    for slot in range(pool_in.shape[0]):
        if slot not in written:
            np.testing.assert_array_equal(_bits(st[slot]), _bits(pool_in[slot]), err_msg=f"slot {slot} touched")
    return e_o, e_s


# One varlen batch: lengths 0, 1, 63, 64, 65, padding (20 tokens), 150 (three chunks), and 7
# tokens past query_start_loc[S]. Slots 7 (zero-length, garbage) and 8 (unnamed) hold NaN.
LENS = [0, 1, 63, 64, 65, 20, 150]
IDX = [7, 2, 5, 0, 9, -1, 3]
HIS = [False, True, False, True, False, True, True]
TAIL = 7


def _batch_pool(pool, state):
    pool = np.array(pool)
    pool[7] = np.nan  # named by a zero-length sequence: must stay untouched
    pool[8] = np.nan  # never named
    pool[5] = np.nan  # has_initial_state False: contents must be ignored
    pool[9] = 1e30 if state == F32 else 3e38  # garbage, ignored as well
    return pool


@functools.lru_cache(maxsize=None)
def _batch_case(H, HV, K, V, act, state, strong):
    qsl = np.concatenate([[0], np.cumsum(LENS)]).astype(np.int32)
    T = int(qsl[-1]) + TAIL
    q, k, v, g, beta, pool = _problem(H * 1000 + HV * 100 + K + V + strong, T, H, HV, K, V, 10, act, state, strong)
    pool = _batch_pool(pool, state)
    ref_o, ref_pool = prefill_f64(q, k, v, g, beta, pool, qsl, IDX, HIS)
    return q, k, v, g, beta, pool, qsl, ref_o, ref_pool


WRITTEN = {2, 5, 0, 9, 3}

CONFIGS = [  # (H, HV, K, V)
    (2, 4, 32, 32),  # GQA, HV = 2H
    (2, 2, 32, 48),  # HV = H, K != V
]


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("act", [F32, BF16], ids=["f32", "bf16"])
@pytest.mark.parametrize("state", [F32, BF16], ids=["stf32", "stbf16"])
@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: "H%dHV%dK%dV%d" % c)
def test_varlen_batch_matches_f64(isa, act, state, cfg):
    q, k, v, g, beta, pool, qsl, ref_o, ref_pool = _batch_case(*cfg, act, state, False)
    o, st = _run(q, k, v, g, beta, pool, qsl, IDX, HIS, act, state, isa)
    _check(o, st, ref_o, ref_pool, pool, qsl, IDX, act, state, WRITTEN)
    if state == BF16:
        # The same pool values held in f32: the kernel must compute the same f32 state and
        # round it exactly once when writing the slot; the output must not change at all.
        o32, st32 = _run(q, k, v, g, beta, pool, qsl, IDX, HIS, act, F32, isa)
        ws = sorted(WRITTEN)
        np.testing.assert_array_equal(_bits(st[ws]), _bits(np.asarray(jnp.asarray(st32[ws], BF16))))
        np.testing.assert_array_equal(_bits(o), _bits(o32))


@contextlib.contextmanager
def _forced_chunk_size(size):
    from gdn_jax import _gdn_ffi
    _gdn_ffi.force_chunk_size(size)
    try:
        yield
    finally:
        _gdn_ffi.force_chunk_size(0)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("act", [F32, BF16], ids=["f32", "bf16"])
@pytest.mark.parametrize("chunk_size", [32, 64])
def test_both_chunk_sizes_match_f64(isa, act, chunk_size):
    """Every ISA has both chunk sizes compiled (each picks one per sequence length): each, forced
    for every sequence, meets the budgets on the varlen batch (chunk tails at both sizes)."""
    q, k, v, g, beta, pool, qsl, ref_o, ref_pool = _batch_case(*CONFIGS[0], act, F32, False)
    with _forced_chunk_size(chunk_size):
        o, st = _run(q, k, v, g, beta, pool, qsl, IDX, HIS, act, F32, isa)
    _check(o, st, ref_o, ref_pool, pool, qsl, IDX, act, F32, WRITTEN)


@pytest.mark.parametrize("isa", ISAS)
def test_chunk_size_rule(isa):
    """64 up to 128 tokens, the ISA's size (32 or 64) above; a forced size applies to every length;
    anything but 0, 32, 64 is refused."""
    from gdn_jax import _gdn_ffi
    with gdn_jax.use_isa(isa):
        assert [_gdn_ffi.chunk_size_for(n) for n in (1, 64, 128)] == [64, 64, 64]
        long = _gdn_ffi.chunk_size_for(129)
        assert long in (32, 64) and _gdn_ffi.chunk_size_for(1 << 20) == long
        for forced in (32, 64):
            with _forced_chunk_size(forced):
                assert [_gdn_ffi.chunk_size_for(n) for n in (1, 129, 1 << 20)] == [forced] * 3
        assert _gdn_ffi.forced_chunk_size() == 0
    with pytest.raises(ValueError, match="32, 64 or 0"):
        _gdn_ffi.force_chunk_size(48)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("act", [F32, BF16], ids=["f32", "bf16"])
def test_strong_decay_matches_f64(isa, act):
    """g of -5 .. -40 per token: e^Gc underflows within a chunk; exp is only taken of
    non-positive in-chunk differences, so nothing overflows and the result stays accurate."""
    q, k, v, g, beta, pool, qsl, ref_o, ref_pool = _batch_case(2, 4, 32, 32, act, F32, True)
    assert g.min() < -30
    o, st = _run(q, k, v, g, beta, pool, qsl, IDX, HIS, act, F32, isa)
    _check(o, st, ref_o, ref_pool, pool, qsl, IDX, act, F32, WRITTEN)


@pytest.mark.parametrize("impl_isa", [("native", isa) for isa in ISAS] + [("reference", None)],
                         ids=[f"native-{isa}" for isa in ISAS] + ["reference"])
def test_one_huge_gate_matches_f64(impl_isa):
    """A few gates far below any other (g = -1e3 .. -1e16, -inf: a past the softplus threshold)
    inside chunks, the first and the last token of one among them. Every decay across them is
    0; the gates after them must keep their decays: next to -1e16 the in-chunk cumsum had
    swallowed them (decays of 1, output errors ~0.8)."""
    impl, isa = impl_isa
    T, H, HV, K, V = 130, 1, 2, 16, 16
    q, k, v, g, beta, pool = _problem(11, T, H, HV, K, V, 2, F32, F32)
    g = g.copy()
    g[10, 0], g[40, 1], g[64, 0], g[95, 1], g[127, 0] = -1e3, -1e8, -1e16, -np.inf, -1e30
    qsl, idx, his = np.array([0, T], np.int32), np.array([1], np.int32), np.array([True])
    ref_o, ref_pool = prefill_f64(q, k, v, g, beta, pool, qsl, idx, his)
    if impl == "native":
        o, st = _run(q, k, v, g, beta, pool, qsl, idx, his, F32, F32, isa)
    else:
        o, st = (np.asarray(x) for x in gdn_jax.chunk_gated_delta_rule(
            *(jnp.asarray(x, F32) for x in (q, k, v)), g=jnp.asarray(g, F32), beta=jnp.asarray(beta, F32),
            ssm_state=jnp.asarray(pool, F32), query_start_loc=jnp.asarray(qsl), state_indices=jnp.asarray(idx),
            has_initial_state=jnp.asarray(his), impl="reference"))
    _check(o, st, ref_o, ref_pool, pool, qsl, idx, F32, F32, {1})


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("K,V", [(64, 64), (16, 256), (256, 16)])
def test_head_dims_f32(isa, K, V):
    T, H, HV, N = 130, 1, 2, 3
    q, k, v, g, beta, pool = _problem(K + V, T, H, HV, K, V, N, F32, F32)
    qsl, idx, his = np.array([0, 70, 130], np.int32), [2, 0], [True, False]
    ref_o, ref_pool = prefill_f64(q, k, v, g, beta, pool, qsl, idx, his)
    o, st = _run(q, k, v, g, beta, pool, qsl, idx, his, F32, F32, isa)
    _check(o, st, ref_o, ref_pool, pool, qsl, idx, F32, F32, {0, 2})


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("act", [F32, BF16], ids=["f32", "bf16"])
def test_no_l2norm_custom_scale(isa, act):
    T, H, HV, K, V, N = 100, 2, 4, 32, 32, 2
    # Without the l2norm, |k| ~ 1 keeps the delta rule contractive (beta |k|^2 < 2).
    q, k, v, g, beta, pool = _problem(5, T, H, HV, K, V, N, act, F32, qk_scale=K ** -0.5)
    qsl, idx, his = np.array([0, 30, 100], np.int32), [1, 0], [True, True]
    ref_o, ref_pool = prefill_f64(q, k, v, g, beta, pool, qsl, idx, his, scale=0.7, use_qk_l2norm=False)
    o, st = _run(q, k, v, g, beta, pool, qsl, idx, his, act, F32, isa, scale=0.7, use_qk_l2norm=False)
    _check(o, st, ref_o, ref_pool, pool, qsl, idx, act, F32, {0, 1})
    # The l2norm path really is different (the flag reaches the kernel).
    o2, _ = _run(q, k, v, g, beta, pool, qsl, idx, his, act, F32, isa, scale=0.7)
    assert rel_rmse(o2.astype(np.float64), ref_o) > 1e-2


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("l2norm", [True, False], ids=["l2norm", "scale"])
def test_outputs_from_a_large_state(isa, l2norm):
    """bf16 activations, sequences of 3 to 300 tokens from initial states 10x the usual scale, so
    that the outputs come mostly from Q S0: the case where rounding S0 to bf16 shows most (on
    avx512bf16 Q S0 and K S0 take bf16 products in sequences over 128 tokens, with q and k as they
    came and their scales applied after: ffi/README.md, "bf16 products with the state"). Each
    sequence's output and final state within the budget, three draws."""
    H, HV, K, V, N = 2, 4, 32, 32, 5
    lens = [3, 129, 300, 40]
    qsl = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    idx, his = [4, 0, 2, 1], [True] * 4
    kw = {} if l2norm else dict(scale=0.7, use_qk_l2norm=False)
    out_budget, state_budget = BUDGET[BF16]
    for seed in range(3):
        q, k, v, g, beta, pool = _problem(40 + seed, int(qsl[-1]), H, HV, K, V, N, BF16, F32,
                                          qk_scale=1.0 if l2norm else K ** -0.5)
        pool = np.float32(pool * 10.0).astype(np.float64)  # exact f32 values, as the kernel reads them
        ref_o, ref_pool = prefill_f64(q, k, v, g, beta, pool, qsl, idx, his, **kw)
        o, st = _run(q, k, v, g, beta, pool, qsl, idx, his, BF16, F32, isa, **kw)
        o = o.astype(np.float64)
        for s, slot in enumerate(idx):
            lo, hi = qsl[s], qsl[s + 1]
            err_o = rel_rmse(o[lo:hi], ref_o[lo:hi])
            err_s = rel_rmse(st[slot].astype(np.float64), ref_pool[slot])
            assert err_o <= out_budget, f"seed {seed}, {hi - lo} tokens: output rel rmse {err_o:.2e}"
            assert err_s <= state_budget, f"seed {seed}, {hi - lo} tokens: state rel rmse {err_s:.2e}"


@pytest.mark.parametrize("isa", ISAS)
def test_l2norm_eps_reaches_kernel(isa):
    T, H, HV, K, V, N = 20, 1, 1, 16, 16, 1
    q, k, v, g, beta, pool = _problem(6, T, H, HV, K, V, N, F32, F32, qk_scale=0.05)
    qsl, idx, his = np.array([0, T], np.int32), [0], [True]
    ref_o, ref_pool = prefill_f64(q, k, v, g, beta, pool, qsl, idx, his, eps=1e-2)
    o, st = _run(q, k, v, g, beta, pool, qsl, idx, his, F32, F32, isa, l2norm_eps=1e-2)
    _check(o, st, ref_o, ref_pool, pool, qsl, idx, F32, F32, {0})


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("act,state", [(F32, F32), (BF16, F32), (F32, BF16)], ids=["f32", "bf16", "stbf16"])
@pytest.mark.parametrize("n,m", [(64, 70), (100, 1), (1, 129)])
def test_continuation_equals_one_prefill(isa, act, state, n, m):
    """prefill(n) then prefill(m) from the slot (has_initial_state) == prefill(n + m)."""
    H, HV, K, V, N = 2, 4, 32, 32, 3
    q, k, v, g, beta, pool = _problem(n * 7 + m, n + m, H, HV, K, V, N, act, state)
    whole_o, whole = _run(q, k, v, g, beta, pool, [0, n + m], [1], [False], act, state, isa)
    o1, p1 = _run(q[:n], k[:n], v[:n], g[:n], beta[:n], pool, [0, n], [1], [False], act, state, isa)
    o2, p2 = _run(q[n:], k[n:], v[n:], g[n:], beta[n:], p1, [0, m], [1], [True], act, state, isa)
    ref_o, ref_pool = prefill_f64(q, k, v, g, beta, pool, [0, n + m], [1], [False])
    out_b, st_b = BUDGET[act]
    two_parts = np.concatenate([o1, o2]).astype(np.float64)
    st_ref = ref_pool[1]
    if state == BF16:
        # Part two starts from the state as stored, i.e. rounded once to bf16 after part one:
        # exact against that chain, and within that one rounding of the single prefill.
        _, ref1 = prefill_f64(q[:n], k[:n], v[:n], g[:n], beta[:n], pool, [0, n], [1], [False])
        r1 = rel_rmse(bf16_round(ref1[1]), ref1[1])
        assert rel_rmse(p1[1].astype(np.float64), ref1[1]) <= st_b + r1
        ref_o2, ref2 = prefill_f64(q[n:], k[n:], v[n:], g[n:], beta[n:], p1.astype(np.float64), [0, m], [1], [True])
        assert rel_rmse(o2.astype(np.float64), ref_o2) <= out_b
        r2 = rel_rmse(bf16_round(ref2[1]), ref2[1])
        assert rel_rmse(p2[1].astype(np.float64), ref2[1]) <= st_b + r2
        out_b, st_b = out_b + r1, st_b + r1 + r2
    assert rel_rmse(two_parts, ref_o) <= out_b
    assert rel_rmse(two_parts, whole_o.astype(np.float64)) <= out_b
    assert rel_rmse(p2[1].astype(np.float64), st_ref) <= st_b
    assert rel_rmse(p2[1].astype(np.float64), whole[1].astype(np.float64)) <= st_b
    np.testing.assert_array_equal(_bits(p2[[0, 2]]), _bits(np.asarray(jnp.asarray(pool, state))[[0, 2]]))


@pytest.mark.parametrize("isa", ISAS)
def test_qwen_shape_bf16_smoke(isa):
    """Qwen3-Next head shapes (H=16, HV=32, K=V=128), bf16 activations, f32 state."""
    T, H, HV, K, V, N = 128, 16, 32, 128, 128, 4
    q, k, v, g, beta, pool = _problem(11, T, H, HV, K, V, N, BF16, F32)
    qsl, idx, his = np.array([0, 50, 128], np.int32), [3, 1], [True, False]
    ref_o, ref_pool = prefill_f64(q, k, v, g, beta, pool, qsl, idx, his)
    o, st = _run(q, k, v, g, beta, pool, qsl, idx, his, BF16, F32, isa)
    _check(o, st, ref_o, ref_pool, pool, qsl, idx, BF16, F32, {1, 3})


def test_donation_keeps_buffer():
    T, H, HV, K, V, N = 70, 2, 4, 32, 32, 4
    q, k, v, g, beta, pool = _problem(12, T, H, HV, K, V, N, F32, F32)
    fn = jax.jit(lambda q, k, v, g, b, s: gdn_jax.chunk_gated_delta_rule(
        q, k, v, g=g, beta=b, ssm_state=s, query_start_loc=jnp.array([0, T], jnp.int32),
        state_indices=jnp.array([2], jnp.int32), has_initial_state=jnp.array([True]), impl="native"),
        donate_argnums=(5,))
    args = [jnp.asarray(x, F32) for x in (q, k, v, g, beta)]
    st = jnp.asarray(pool, F32)
    ptr = st.unsafe_buffer_pointer()
    o, st2 = fn(*args, st)
    st2.block_until_ready()
    assert st.is_deleted()
    assert st2.unsafe_buffer_pointer() == ptr
    ref_o, ref_pool = prefill_f64(q, k, v, g, beta, pool, [0, T], [2], [True])
    assert rel_rmse(np.asarray(st2)[2], ref_pool[2]) <= 1e-5
    np.testing.assert_array_equal(np.asarray(st2)[[0, 1, 3]], pool[[0, 1, 3]])


BAD = {
    "slot out of range": ([0, 2, 4], [0, 6], "slot 6"),
    "negative slot": ([0, 2, 4], [-2, 1], "slot -2"),
    "slot twice": ([0, 2, 4], [3, 3], "slot 3 is also named by row 0"),
    "qsl decreasing": ([0, 3, 2], [0, 1], "non-decreasing"),
    "qsl past T": ([0, 2, 5], [0, 1], "past the number of tokens"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_batch_refused(case):
    qsl, idx, pattern = BAD[case]
    T, H, HV, K, V, N = 4, 1, 2, 16, 16, 6
    q, k, v, g, beta, pool = _problem(13, T, H, HV, K, V, N, F32, F32)
    args = [jnp.asarray(x, F32) for x in (q, k, v)]
    kw = dict(g=jnp.asarray(g, F32), beta=jnp.asarray(beta, F32), query_start_loc=jnp.asarray(qsl, jnp.int32),
              state_indices=jnp.asarray(idx, jnp.int32), has_initial_state=jnp.array([True, False]))
    st = jnp.asarray(pool, F32)
    with pytest.raises(gdn_jax.InvalidBatchError, match=pattern):
        gdn_jax.chunk_gated_delta_rule(*args, ssm_state=st, **kw, impl="native")
    np.testing.assert_array_equal(np.asarray(st), pool)
    # Under jit with the pool donated: nothing written, status reported, output zero.
    fn = jax.jit(lambda q, k, v, s: gdn_jax.ops.chunk_gated_delta_rule_with_status(
        q, k, v, ssm_state=s, **kw, impl="native"), donate_argnums=(3,))
    o, st2, status = fn(*args, jnp.asarray(pool, F32))
    assert int(status[0]) != 0
    np.testing.assert_array_equal(np.asarray(st2), pool)
    assert not np.any(np.asarray(o))


def test_reference_agrees_with_native():
    reference = pytest.importorskip("gdn_jax.reference")
    del reference
    for act in (F32, BF16):
        q, k, v, g, beta, pool, qsl, ref_o, ref_pool = _batch_case(2, 4, 32, 32, act, F32, False)
        o_n, st_n = _run(q, k, v, g, beta, pool, qsl, IDX, HIS, act, F32, ISAS[0])
        o_r, st_r = gdn_jax.chunk_gated_delta_rule(
            jnp.asarray(q, act), jnp.asarray(k, act), jnp.asarray(v, act), g=jnp.asarray(g, F32),
            beta=jnp.asarray(beta, F32), ssm_state=jnp.asarray(pool, F32), query_start_loc=jnp.asarray(qsl),
            state_indices=jnp.asarray(IDX, jnp.int32), has_initial_state=jnp.asarray(HIS), impl="reference")
        _check(np.asarray(o_r), np.asarray(st_r), ref_o, ref_pool, pool, qsl, IDX, act, F32, WRITTEN)
        out_b, st_b = BUDGET[act]
        ws = sorted(WRITTEN)
        assert rel_rmse(o_n.astype(np.float64), np.asarray(o_r, np.float64)) <= 2 * out_b
        assert rel_rmse(st_n[ws], np.asarray(st_r)[ws]) <= 2 * st_b
