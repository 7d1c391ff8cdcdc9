"""causal_conv1d_fwd / causal_conv1d_update: native kernels (every ISA here) against the
float64 evaluation of the contract (tests/f64_math.py) and against the jnp reference.

Inputs are exact in the activation dtype (bf16 values are bf16-rounded before use), so the
conv state, which only ever holds copies of inputs, must match the float64 model exactly,
and every slot or row the batch does not name must be bit-identical afterwards.
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gdn_jax
from f64_math import bf16_round, conv_fwd_f64, conv_update_f64, rel_rmse
from gdn_jax import _native

ISAS = gdn_jax.available_isas()
DTYPES = [jnp.float32, jnp.bfloat16]
BUDGET = {jnp.float32: 1e-6, jnp.bfloat16: 4e-3}  # contract.md: gating, conv
F32 = jnp.float32


# --- helpers ---------------------------------------------------------------------------------


def _vals(rng, shape, dtype, scale=1.0):
    """Random values exactly representable in `dtype`, as float64."""
    a = rng.normal(size=shape) * scale
    return bf16_round(a) if dtype == jnp.bfloat16 else a.astype(np.float32).astype(np.float64)


def _params(rng, D, W, with_bias):
    w = rng.normal(size=(D, W)).astype(np.float32).astype(np.float64) * 0.5
    b = rng.normal(size=D).astype(np.float32).astype(np.float64) * 0.5 if with_bias else None
    return w, b


def _bits(a):
    a = np.asarray(a)
    return a.view(np.uint16 if a.dtype.itemsize == 2 else np.uint32)


def _f64(a):
    return np.asarray(jnp.asarray(a).astype(F32)).astype(np.float64)


def _pool(rng, N, L, D, layout, dtype):
    return _vals(rng, (N, L, D) if layout == "SD" else (N, D, L), dtype)


@functools.partial(jax.jit, static_argnames=("silu", "layout", "impl"), donate_argnums=1)
def _jfwd(x, cs, w, b, qsl, idx, hi, *, silu, layout, impl):
    return gdn_jax.causal_conv1d_fwd(x, weight=w, bias=b, conv_state=cs, query_start_loc=qsl, state_indices=idx,
                                     has_initial_state=hi, activation="silu" if silu else None,
                                     conv_state_layout=layout, impl=impl)


@functools.partial(jax.jit, static_argnames=("silu", "layout", "impl"), donate_argnums=1)
def _jupd(x, cs, w, b, idx, qsl, acc, *, silu, layout, impl):
    return gdn_jax.causal_conv1d_update(x, weight=w, bias=b, conv_state=cs, state_indices=idx, query_start_loc=qsl,
                                        num_accepted_tokens=acc, activation="silu" if silu else None,
                                        conv_state_layout=layout, impl=impl)


def _fwd_fn(w, b, qsl, idx, hi, silu, layout, impl="native"):
    """prefill under jit with the pool donated (x, pool) -> (y, pool)."""
    args = (jnp.asarray(w, F32), None if b is None else jnp.asarray(b, F32), jnp.asarray(qsl, jnp.int32),
            jnp.asarray(idx, jnp.int32), jnp.asarray(hi, bool))
    return lambda x, cs: _jfwd(x, cs, *args, silu=silu, layout=layout, impl=impl)


def _upd_fn(w, b, idx, silu, layout, qsl=None, acc=None, impl="native"):
    """decode / spec update under jit with the pool donated (x, pool) -> (y, pool)."""
    args = (jnp.asarray(w, F32), None if b is None else jnp.asarray(b, F32), jnp.asarray(idx, jnp.int32),
            None if qsl is None else jnp.asarray(qsl, jnp.int32), None if acc is None else jnp.asarray(acc, jnp.int32))
    return lambda x, cs: _jupd(x, cs, *args, silu=silu, layout=layout, impl=impl)


def _slot_rows(cs, layout):
    """[N, L, D] view of a pool in either layout."""
    cs = np.asarray(cs)
    return cs if layout == "SD" else cs.transpose(0, 2, 1)


def _check_untouched(before, after, layout, written):
    """Every (slot, row) not in `written` ({slot: rows written}) is bit-identical."""
    b, a = _bits(_slot_rows(before, layout)), _bits(_slot_rows(after, layout))
    for n in range(b.shape[0]):
        rows = written.get(n, 0)
        np.testing.assert_array_equal(a[n, rows:], b[n, rows:], err_msg=f"slot {n} rows >= {rows} changed")


# --- prefill -------------------------------------------------------------------------------

# (length, slot, has_initial_state): crosses the 64-token item boundaries, an empty sequence
# (whose slot must not change even without initial state), sequences shorter than W-1 with
# and without initial state (the latter on a stale slot), a padding row; tokens past the
# last sequence are left over.
PREFILL_SEQS = [(70, 3, True), (0, 5, False), (1, 0, True), (2, 6, False), (5, -1, True), (60, 1, False),
                (1, 7, False)]
PREFILL_T, PREFILL_N = 160, 8


def _prefill_case(rng, dtype, layout, D, W, extra_rows=2, seqs=PREFILL_SEQS, T=PREFILL_T, N=PREFILL_N):
    L = W - 1 + extra_rows
    lens = [s[0] for s in seqs]
    qsl = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    idx = np.array([s[1] for s in seqs], np.int32)
    hi = np.array([s[2] for s in seqs], bool)
    x = _vals(rng, (T, D), dtype)
    cs = _pool(rng, N, L, D, layout, dtype)
    return x, cs, qsl, idx, hi, L


def _check_prefill(y, cs_out, x, w, b, cs, qsl, idx, hi, silu, layout, dtype, W, tag):
    yr, csr = conv_fwd_f64(x, w, b, cs, qsl, idx, hi, silu, layout)
    err = rel_rmse(_f64(y), yr)
    assert err <= BUDGET[dtype], f"{tag}: y rel_rmse {err:.2e} > {BUDGET[dtype]:.0e}"
    # The state holds copies of exact inputs: equal to the float64 model, bit for bit.
    np.testing.assert_array_equal(_f64(cs_out), csr, err_msg=f"{tag}: conv_state")
    yb = _f64(y)
    for s in range(len(idx)):
        if idx[s] == -1:
            assert not np.any(yb[qsl[s]:qsl[s + 1]]), f"{tag}: padding row {s} output not zero"
    assert not np.any(yb[qsl[-1]:]), f"{tag}: tokens past query_start_loc[-1] not zero"
    written = {int(idx[s]): W - 1 for s in range(len(idx)) if idx[s] >= 0 and qsl[s + 1] > qsl[s]}
    _check_untouched(jnp.asarray(cs, dtype), cs_out, layout, written)
    return err


@pytest.mark.parametrize("W", [2, 3, 4])
@pytest.mark.parametrize("layout", ["SD", "DS"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_prefill_matches_f64(dtype, layout, W):
    """D = 300: two channel items, the second with a 12-lane tail vector."""
    D = 300
    rng = np.random.default_rng(W * 10 + (layout == "DS"))
    x, cs, qsl, idx, hi, L = _prefill_case(rng, dtype, layout, D, W)
    for with_bias, silu in [(True, True), (False, False)]:
        w, b = _params(rng, D, W, with_bias)
        fn = _fwd_fn(w, b, qsl, idx, hi, silu, layout)
        for isa in ISAS:
            with gdn_jax.use_isa(isa):
                y, cs_out = fn(jnp.asarray(x, dtype), jnp.asarray(cs, dtype))
            assert y.dtype == dtype and cs_out.dtype == dtype
            _check_prefill(y, cs_out, x, w, b, cs, qsl, idx, hi, silu, layout, dtype, W,
                           f"{isa} {jnp.dtype(dtype).name} {layout} W={W} bias={with_bias} silu={silu}")


@pytest.mark.parametrize("dtype", DTYPES)
def test_prefill_small_d_many_short_sequences(dtype):
    """D = 7 (a single partial vector); 40 sequences of 0..4 tokens in one 64-token item."""
    rng = np.random.default_rng(5)
    D, W, N = 7, 4, 48
    lens = rng.integers(0, 5, size=40)
    slots = rng.permutation(N)[:40].astype(np.int32)
    slots[::9] = -1
    seqs = [(int(n), int(s), bool(rng.integers(0, 2))) for n, s in zip(lens, slots)]
    for layout in ("SD", "DS"):
        x, cs, qsl, idx, hi, L = _prefill_case(rng, dtype, layout, D, W, extra_rows=1, seqs=seqs,
                                               T=int(lens.sum()) + 3, N=N)
        w, b = _params(rng, D, W, True)
        fn = _fwd_fn(w, b, qsl, idx, hi, True, layout)
        for isa in ISAS:
            with gdn_jax.use_isa(isa):
                y, cs_out = fn(jnp.asarray(x, dtype), jnp.asarray(cs, dtype))
            _check_prefill(y, cs_out, x, w, b, cs, qsl, idx, hi, True, layout, dtype, W, f"{isa} {layout}")


@pytest.mark.parametrize("dtype", DTYPES)
def test_prefill_ignores_nan_in_stale_slot_and_unread_rows(dtype):
    """Without initial state the slot's old contents are never read (NaN there must not leak),
    and rows >= W-1 of a slot are never read at all."""
    rng = np.random.default_rng(6)
    D, W = 40, 4
    for layout in ("SD", "DS"):
        x, cs, qsl, idx, hi, L = _prefill_case(rng, dtype, layout, D, W)
        rows = _slot_rows(cs, layout)  # a view: writes go to cs
        for s, (n, slot, init) in enumerate(PREFILL_SEQS):
            if slot >= 0 and not init:
                rows[slot] = np.nan
        rows[:, W - 1:] = np.nan
        w, b = _params(rng, D, W, True)
        fn = _fwd_fn(w, b, qsl, idx, hi, True, layout)
        for isa in ISAS:
            with gdn_jax.use_isa(isa):
                y, cs_out = fn(jnp.asarray(x, dtype), jnp.asarray(cs, dtype))
            assert np.all(np.isfinite(_f64(y))), f"{isa} {layout}: NaN leaked into the output"
            yr, csr = conv_fwd_f64(x, w, b, cs, qsl, idx, hi, True, layout)
            assert rel_rmse(_f64(y), yr) <= BUDGET[dtype]
            np.testing.assert_array_equal(_f64(cs_out), csr)  # NaN == NaN here (unread rows kept)


@pytest.mark.parametrize("dtype", DTYPES)
def test_prefill_bits_do_not_depend_on_position_or_split(dtype):
    """One sequence at token offset 0 and at offset 37 (after another sequence) crosses the
    64-token work items at different places; its outputs and final state are bit-identical."""
    rng = np.random.default_rng(7)
    D, W, n = 300, 4, 150
    w, b = _params(rng, D, W, True)
    xs = _vals(rng, (n, D), dtype)
    other = _vals(rng, (37, D), dtype)
    for layout in ("SD", "DS"):
        cs = _pool(rng, 4, W - 1, D, layout, dtype)
        x1 = np.concatenate([xs, np.zeros((40, D))])
        x2 = np.concatenate([other, xs, np.zeros((3, D))])
        f1 = _fwd_fn(w, b, [0, n], [2], [True], True, layout)
        f2 = _fwd_fn(w, b, [0, 37, 37 + n], [0, 2], [False, True], True, layout)
        for isa in ISAS:
            with gdn_jax.use_isa(isa):
                y1, c1 = f1(jnp.asarray(x1, dtype), jnp.asarray(cs, dtype))
                y2, c2 = f2(jnp.asarray(x2, dtype), jnp.asarray(cs, dtype))
            np.testing.assert_array_equal(_bits(y1)[:n], _bits(y2)[37:37 + n])
            np.testing.assert_array_equal(_bits(_slot_rows(c1, layout))[2], _bits(_slot_rows(c2, layout))[2])


# --- decode / spec rolling buffer -------------------------------------------------------------

# (q, slot, num_accepted) with num_spec = 3 (L = W + 2, at most 4 tokens and 4 accepted per row):
# ragged q, acc over [1, 4], a zero-length row (changes nothing), a padding row whose
# num_accepted is out of range (padding rows are not validated and read nothing).
SPEC_ROWS = [(4, 2, 1), (1, 0, 4), (2, 5, 2), (0, 6, 3), (3, -1, 0), (3, 7, 3)]
NUM_SPEC, SPEC_N = 3, 8


def _spec_case(rng, dtype, layout, D, W, rows=SPEC_ROWS, extra_tokens=3):
    L = W - 1 + NUM_SPEC
    qsl = np.concatenate([[0], np.cumsum([r[0] for r in rows])]).astype(np.int32)
    idx = np.array([r[1] for r in rows], np.int32)
    acc = np.array([r[2] for r in rows], np.int32)
    x = _vals(rng, (int(qsl[-1]) + extra_tokens, D), dtype)
    cs = _pool(rng, SPEC_N, L, D, layout, dtype)
    return x, cs, qsl, idx, acc, L


def _check_update(y, cs_out, x, w, b, cs, qsl, idx, acc, silu, layout, dtype, W, tag):
    yr, csr = conv_update_f64(x, w, b, cs, idx, silu, acc, qsl, layout)
    err = rel_rmse(_f64(y), yr)
    assert err <= BUDGET[dtype], f"{tag}: y rel_rmse {err:.2e} > {BUDGET[dtype]:.0e}"
    np.testing.assert_array_equal(_f64(cs_out), csr, err_msg=f"{tag}: conv_state")
    yb = _f64(y)
    for s in range(len(idx)):
        if idx[s] == -1:
            assert not np.any(yb[qsl[s]:qsl[s + 1]]), f"{tag}: padding row {s} output not zero"
    assert not np.any(yb[qsl[-1]:]), f"{tag}: tokens past query_start_loc[-1] not zero"
    written = {int(idx[s]): W - 2 + int(qsl[s + 1] - qsl[s]) for s in range(len(idx))
               if idx[s] >= 0 and qsl[s + 1] > qsl[s]}
    _check_untouched(jnp.asarray(cs, dtype), cs_out, layout, written)
    return err


@pytest.mark.parametrize("W", [2, 3, 4])
@pytest.mark.parametrize("layout", ["SD", "DS"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_spec_update_matches_f64(dtype, layout, W):
    D = 300
    rng = np.random.default_rng(100 + W * 10 + (layout == "DS"))
    x, cs, qsl, idx, acc, L = _spec_case(rng, dtype, layout, D, W)
    for with_bias, silu in [(True, True), (False, False)]:
        w, b = _params(rng, D, W, with_bias)
        fn = _upd_fn(w, b, idx, silu, layout, qsl=qsl, acc=acc)
        for isa in ISAS:
            with gdn_jax.use_isa(isa):
                y, cs_out = fn(jnp.asarray(x, dtype), jnp.asarray(cs, dtype))
            assert y.dtype == dtype and cs_out.dtype == dtype
            _check_update(y, cs_out, x, w, b, cs, qsl, idx, acc, silu, layout, dtype, W,
                          f"{isa} {jnp.dtype(dtype).name} {layout} W={W} bias={with_bias} silu={silu}")


@pytest.mark.parametrize("layout", ["SD", "DS"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_plain_decode_matches_f64(dtype, layout):
    """One token per row, no query_start_loc / num_accepted_tokens; rows of 20 slots, two of
    them padding; L = W - 1 (no spare rows)."""
    rng = np.random.default_rng(8)
    D, W, N, B = 300, 4, 24, 20
    idx = rng.permutation(N)[:B].astype(np.int32)
    idx[[3, 11]] = -1
    x = _vals(rng, (B, D), dtype)
    cs = _pool(rng, N, W - 1, D, layout, dtype)
    w, b = _params(rng, D, W, True)
    fn = _upd_fn(w, b, idx, True, layout)
    for isa in ISAS:
        with gdn_jax.use_isa(isa):
            y, cs_out = fn(jnp.asarray(x, dtype), jnp.asarray(cs, dtype))
        _check_update(y, cs_out, x, w, b, cs, np.arange(B + 1), idx, np.ones(B, np.int32), True, layout,
                      dtype, W, f"{isa} decode {layout}")


@pytest.mark.parametrize("dtype", DTYPES)
def test_update_ignores_nan_outside_the_window(dtype):
    rng = np.random.default_rng(9)
    D, W = 40, 4
    for layout in ("SD", "DS"):
        x, cs, qsl, idx, acc, L = _spec_case(rng, dtype, layout, D, W)
        rows = _slot_rows(cs, layout)
        for (q, slot, a) in SPEC_ROWS:
            if slot >= 0:
                rows[slot, :a - 1] = np.nan
                rows[slot, a - 1 + W - 1:] = np.nan
        w, b = _params(rng, D, W, True)
        fn = _upd_fn(w, b, idx, True, layout, qsl=qsl, acc=acc)
        for isa in ISAS:
            with gdn_jax.use_isa(isa):
                y, cs_out = fn(jnp.asarray(x, dtype), jnp.asarray(cs, dtype))
            assert np.all(np.isfinite(_f64(y))), f"{isa} {layout}: NaN leaked into the output"
            yr, csr = conv_update_f64(x, w, b, cs, idx, True, acc, qsl, layout)
            assert rel_rmse(_f64(y), yr) <= BUDGET[dtype]
            np.testing.assert_array_equal(_f64(cs_out), csr)


@pytest.mark.parametrize("layout", ["SD", "DS"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_paths_agree_bit_for_bit(dtype, layout):
    """prefill(n) + decode(1) == prefill(n+1); prefill(n) + spec(q=3) then a spec step that
    accepted a of those drafts == prefill(n + a) + the same step: identical bits (the state
    holds exact copies and each output is the same fma chain)."""
    rng = np.random.default_rng(10)
    D, W, n = 300, 4, 9
    L = W - 1 + NUM_SPEC
    w, b = _params(rng, D, W, True)
    xs = _vals(rng, (n + 3, D), dtype)
    x_next = _vals(rng, (2, D), dtype)
    cs0 = jnp.asarray(_pool(rng, 2, L, D, layout, dtype), dtype)
    X = lambda a: jnp.asarray(a, dtype)  # noqa: E731
    for isa in ISAS:
        with gdn_jax.use_isa(isa):
            # prefill(m): the first m of the n+3 tokens (one shape, one compile).
            pre = lambda m: _fwd_fn(w, b, [0, m], [1], [False], True, layout)(  # noqa: E731
                X(xs), jnp.array(cs0, copy=True))
            y_n, cs_n = pre(n)
            y_dec, cs_dec = _upd_fn(w, b, [1], True, layout)(X(xs[n:n + 1]), cs_n)
            y_n1, cs_n1 = pre(n + 1)
            np.testing.assert_array_equal(_bits(y_dec)[0], _bits(y_n1)[n])
            np.testing.assert_array_equal(_bits(_slot_rows(cs_dec, layout))[1, :W - 1],
                                          _bits(_slot_rows(cs_n1, layout))[1, :W - 1])
            # Spec: three drafts after prefill(n) (acc = 1, the previous step was a prefill).
            _, cs_n = pre(n)
            y_sp, cs_sp = _upd_fn(w, b, [1], True, layout, qsl=[0, 3], acc=[1])(X(xs[n:n + 3]), cs_n)
            y_n3, _ = pre(n + 3)
            np.testing.assert_array_equal(_bits(y_sp), _bits(y_n3)[n:n + 3])
            for a in (1, 2, 3):
                cs_in = jnp.array(cs_sp, copy=True)
                y_a, cs_a = _upd_fn(w, b, [1], True, layout, qsl=[0, 2], acc=[a])(X(x_next), cs_in)
                _, cs_pa = pre(n + a)
                y_ref, cs_ref = _upd_fn(w, b, [1], True, layout, qsl=[0, 2], acc=[1])(X(x_next), cs_pa)
                np.testing.assert_array_equal(_bits(y_a), _bits(y_ref), err_msg=f"{isa} acc={a}")
                np.testing.assert_array_equal(_bits(_slot_rows(cs_a, layout))[1, :W],
                                              _bits(_slot_rows(cs_ref, layout))[1, :W])


# --- the full grid: exhaustive under GDN_JAX_SLOW=1 / -m slow (conftest), a fixed sample by default

GRID = [(dt, lay, W, D, silu, bias) for dt in DTYPES for lay in ("SD", "DS") for W in (2, 3, 4)
        for D in (1, 7, 16, 17, 256, 257, 513) for silu in (True, False) for bias in (True, False)]
GRID_SAMPLE = [GRID[i] for i in np.random.default_rng(2024).choice(len(GRID), 6, replace=False)]


def _grid_id(case):
    dt, lay, W, D, silu, bias = case
    return f"{jnp.dtype(dt).name}-{lay}-W{W}-D{D}-{'silu' if silu else 'id'}-{'bias' if bias else 'nobias'}"



def _grid_case(dtype, layout, W, D, silu, with_bias):
    rng = np.random.default_rng(D * 7 + W)
    w, b = _params(rng, D, W, with_bias)
    x, cs, qsl, idx, hi, L = _prefill_case(rng, dtype, layout, D, W)
    fn = _fwd_fn(w, b, qsl, idx, hi, silu, layout)
    for isa in ISAS:
        with gdn_jax.use_isa(isa):
            y, cs_out = fn(jnp.asarray(x, dtype), jnp.asarray(cs, dtype))
        _check_prefill(y, cs_out, x, w, b, cs, qsl, idx, hi, silu, layout, dtype, W, f"{isa} fwd")
    x, cs, qsl, idx, acc, L = _spec_case(rng, dtype, layout, D, W)
    fn = _upd_fn(w, b, idx, silu, layout, qsl=qsl, acc=acc)
    for isa in ISAS:
        with gdn_jax.use_isa(isa):
            y, cs_out = fn(jnp.asarray(x, dtype), jnp.asarray(cs, dtype))
        _check_update(y, cs_out, x, w, b, cs, qsl, idx, acc, silu, layout, dtype, W, f"{isa} update")


@pytest.mark.parametrize("case", GRID_SAMPLE, ids=_grid_id)
def test_grid_sampled(case):
    _grid_case(*case)


@pytest.mark.slow
@pytest.mark.parametrize("case", GRID, ids=_grid_id)
def test_grid_exhaustive(case):
    _grid_case(*case)


# --- parameter dtypes -------------------------------------------------------------------------

# (weight dtype, bias dtype or None = no bias): the kernels read the parameters in their own
# dtype, each independently.
PARAM_DTYPES = [(F32, F32), (jnp.bfloat16, jnp.bfloat16), (jnp.bfloat16, F32), (F32, jnp.bfloat16),
                (jnp.bfloat16, None), (F32, None)]


@pytest.mark.parametrize("dtype", DTYPES)
def test_parameter_dtypes(dtype):
    """bf16 or f32 weight and bias (a bf16 model passes its parameters unconverted) holding the
    same bf16-representable values: outputs bit-identical to f32 parameters, and each
    matches the float64 conv; no bias equals a zero bias bit for bit."""
    rng = np.random.default_rng(13)
    D, W = 300, 4
    w, b = (bf16_round(a * 0.5) for a in (rng.normal(size=(D, W)), rng.normal(size=D)))
    xp, csp, qsl, idx, hi, L = _prefill_case(rng, dtype, "SD", D, W)
    xu, csu, qslu, idxu, acc, _ = _spec_case(rng, dtype, "SD", D, W)
    for isa in ISAS:
        want = {}
        for wdt, bdt in PARAM_DTYPES:
            bias = None if bdt is None else jnp.asarray(b, bdt)
            tag = f"{isa} {jnp.dtype(dtype).name} weight {jnp.dtype(wdt).name} bias {bdt and jnp.dtype(bdt).name}"
            with gdn_jax.use_isa(isa):
                yp, csp_out = _jfwd(jnp.asarray(xp, dtype), jnp.asarray(csp, dtype), jnp.asarray(w, wdt), bias,
                                    jnp.asarray(qsl), jnp.asarray(idx), jnp.asarray(hi), silu=True, layout="SD",
                                    impl="native")
                yu, csu_out = _jupd(jnp.asarray(xu, dtype), jnp.asarray(csu, dtype), jnp.asarray(w, wdt), bias,
                                    jnp.asarray(idxu), jnp.asarray(qslu), jnp.asarray(acc), silu=True, layout="SD",
                                    impl="native")
            b_ref = None if bdt is None else b
            _check_prefill(yp, csp_out, xp, w, b_ref, csp, qsl, idx, hi, True, "SD", dtype, W, "prefill " + tag)
            _check_update(yu, csu_out, xu, w, b_ref, csu, qslu, idxu, acc, True, "SD", dtype, W, "update " + tag)
            key = bdt is None
            if key not in want:
                want[key] = (_bits(yp), _bits(yu))
            np.testing.assert_array_equal(_bits(yp), want[key][0], err_msg=f"prefill {tag}: bits differ")
            np.testing.assert_array_equal(_bits(yu), want[key][1], err_msg=f"update {tag}: bits differ")
        # No bias and a zero bias: the same bits.
        with gdn_jax.use_isa(isa):
            y0, _ = _jfwd(jnp.asarray(xp, dtype), jnp.asarray(csp, dtype), jnp.asarray(w, F32), jnp.zeros((D,), F32),
                          jnp.asarray(qsl), jnp.asarray(idx), jnp.asarray(hi), silu=True, layout="SD", impl="native")
        np.testing.assert_array_equal(_bits(y0), want[True][0], err_msg=f"{isa}: no bias != zero bias")


# --- other widths through the raw FFI target (the ops allow W in 2..4) -----------------------


@pytest.mark.parametrize("W", [1, 5, 6])
def test_raw_target_other_widths(W):
    """The kernels' generic path for W outside 2..4 (reachable only through the FFI target)."""
    rng = np.random.default_rng(11 + W)
    D, dtype = 40, jnp.float32
    for layout in ("SD", "DS"):
        x, cs, qsl, idx, hi, L = _prefill_case(rng, dtype, layout, D, W)
        w, b = _params(rng, D, W, True)
        for isa in ISAS:
            with gdn_jax.use_isa(isa):
                y, cs_out, st = _native.conv_fwd(jnp.asarray(x, dtype), jnp.asarray(w, F32), jnp.asarray(b, F32),
                                                 jnp.asarray(cs, dtype), jnp.asarray(qsl), jnp.asarray(idx),
                                                 jnp.asarray(hi), silu=1, layout=int(layout == "DS"))
            assert int(st[0]) == 0
            _check_prefill(y, cs_out, x, w, b, cs, qsl, idx, hi, True, layout, dtype, W, f"{isa} fwd W={W}")
        x, cs, qsl, idx, acc, L = _spec_case(rng, dtype, layout, D, W)
        acc = np.where(idx >= 0, np.minimum(acc, L - W + 2), acc).astype(np.int32)
        for isa in ISAS:
            with gdn_jax.use_isa(isa):
                y, cs_out, st = _native.conv_update(jnp.asarray(x, dtype), jnp.asarray(w, F32), jnp.asarray(b, F32),
                                                    jnp.asarray(cs, dtype), jnp.asarray(qsl), jnp.asarray(idx),
                                                    jnp.asarray(acc), silu=0, layout=int(layout == "DS"))
            assert int(st[0]) == 0
            _check_update(y, cs_out, x, w, b, cs, qsl, idx, acc, False, layout, dtype, W, f"{isa} upd W={W}")


# --- in place under jit ------------------------------------------------------------------------


@pytest.mark.parametrize("layout", ["SD", "DS"])
def test_donated_pool_updated_in_place(layout):
    rng = np.random.default_rng(12)
    D, W, dtype = 64, 4, jnp.bfloat16
    x, cs, qsl, idx, hi, L = _prefill_case(rng, dtype, layout, D, W)
    w, b = _params(rng, D, W, True)
    pool = jnp.asarray(cs, dtype)
    ptr = pool.unsafe_buffer_pointer()
    y, pool = _fwd_fn(w, b, qsl, idx, hi, True, layout)(jnp.asarray(x, dtype), pool)
    assert pool.unsafe_buffer_pointer() == ptr
    xs, _, sqsl, sidx, sacc, _ = _spec_case(rng, dtype, layout, D, W)
    sacc = np.minimum(sacc, L - W + 2)  # the prefill pool has L = W + 1
    sqsl = np.concatenate([[0], np.cumsum(np.minimum(np.diff(sqsl), L - W + 2))]).astype(np.int32)
    y, pool = _upd_fn(w, b, sidx, True, layout, qsl=sqsl, acc=sacc)(jnp.asarray(xs, dtype), pool)
    assert pool.unsafe_buffer_pointer() == ptr
    y, pool = _upd_fn(w, b, [4, 2], True, layout)(jnp.asarray(xs[:2], dtype), pool)
    assert pool.unsafe_buffer_pointer() == ptr


# --- bad batches -------------------------------------------------------------------------------

BAD_FWD = {
    "slot out of range": ([0, 2, 4], [1, 8], "slot 8 \\(column 0\\) is outside"),
    "negative slot": ([0, 2, 4], [-2, 1], "slot -2 \\(column 0\\) is outside"),
    "slot twice": ([0, 2, 4], [3, 3], "slot 3 is also named by row 0"),
    "qsl decreasing": ([0, 3, 2], [0, 1], "must be non-decreasing"),
    "qsl past T": ([0, 2, 6], [0, 1], "is past the number of tokens T = 5"),
    "qsl start": ([1, 2, 4], [0, 1], "query_start_loc\\[0\\] must be 0"),
}


@pytest.mark.parametrize("case", sorted(BAD_FWD))
@pytest.mark.parametrize("layout", ["SD", "DS"])
def test_prefill_bad_batch_refused(case, layout):
    qsl, idx, pattern = BAD_FWD[case]
    rng = np.random.default_rng(13)
    D, W, N, T, dtype = 20, 4, 8, 5, jnp.float32
    x = jnp.asarray(_vals(rng, (T, D), dtype), dtype)
    cs = _pool(rng, N, W - 1, D, layout, dtype)
    w, b = _params(rng, D, W, True)
    kw = dict(weight=jnp.asarray(w, F32), bias=jnp.asarray(b, F32), query_start_loc=jnp.asarray(qsl, jnp.int32),
              state_indices=jnp.asarray(idx, jnp.int32), has_initial_state=jnp.array([True, False]),
              conv_state_layout=layout)
    # Under jit with the pool donated: nothing written, the pool comes back bit-identical.
    f = jax.jit(lambda x, c: gdn_jax.ops.causal_conv1d_fwd_with_status(x, conv_state=c, **kw), donate_argnums=1)
    y, cs_out, status = f(x, jnp.asarray(cs, dtype))
    assert int(status[0]) != 0
    np.testing.assert_array_equal(_bits(cs_out), _bits(jnp.asarray(cs, dtype)))
    assert not np.any(np.asarray(y))
    # Eagerly: InvalidBatchError naming the problem; the pool is unchanged.
    pool = jnp.asarray(cs, dtype)
    with pytest.raises(gdn_jax.InvalidBatchError, match=pattern):
        gdn_jax.causal_conv1d_fwd(x, conv_state=pool, **kw)
    np.testing.assert_array_equal(np.asarray(pool), cs)


# num_spec = 2: L = W + 1, at most L - W + 2 = 3 tokens and 3 accepted per row; T = 5.
BAD_UPD = {
    "slot out of range": ([0, 1, 3], [8, 1], [1, 1], "slot 8 \\(column 0\\) is outside"),
    "negative slot": ([0, 1, 3], [0, -5], [1, 1], "slot -5 \\(column 0\\) is outside"),
    "slot twice": ([0, 1, 3], [4, 4], [1, 1], "slot 4 is also named by row 0"),
    "qsl decreasing": ([0, 3, 2], [0, 1], [1, 1], "must be non-decreasing"),
    "qsl past T": ([0, 3, 6], [0, 1], [1, 1], "is past the number of tokens T = 5"),
    "num_accepted zero": ([0, 1, 3], [0, 1], [1, 0], "num_accepted_tokens = 0 is outside \\[1, 3\\]"),
    "num_accepted too large": ([0, 1, 3], [0, 1], [4, 1], "num_accepted_tokens = 4 is outside \\[1, 3\\]"),
    "row too long": ([0, 1, 5], [0, 1], [1, 1], "4 tokens, more than the 3"),
}


@pytest.mark.parametrize("case", sorted(BAD_UPD))
@pytest.mark.parametrize("layout", ["SD", "DS"])
def test_update_bad_batch_refused(case, layout):
    qsl, idx, acc, pattern = BAD_UPD[case]
    rng = np.random.default_rng(14)
    D, W, N, T, dtype = 20, 4, 8, 5, jnp.bfloat16
    L = W + 1
    x = jnp.asarray(_vals(rng, (T, D), dtype), dtype)
    cs = _pool(rng, N, L, D, layout, dtype)
    w, b = _params(rng, D, W, False)
    kw = dict(weight=jnp.asarray(w, F32), bias=None, query_start_loc=jnp.asarray(qsl, jnp.int32),
              state_indices=jnp.asarray(idx, jnp.int32), num_accepted_tokens=jnp.asarray(acc, jnp.int32),
              conv_state_layout=layout)
    f = jax.jit(lambda x, c: gdn_jax.ops.causal_conv1d_update_with_status(x, conv_state=c, **kw),
                donate_argnums=1)
    y, cs_out, status = f(x, jnp.asarray(cs, dtype))
    assert int(status[0]) != 0
    np.testing.assert_array_equal(_bits(cs_out), _bits(jnp.asarray(cs, dtype)))
    assert not np.any(np.asarray(y.astype(F32)))
    pool = jnp.asarray(cs, dtype)
    with pytest.raises(gdn_jax.InvalidBatchError, match=pattern):
        gdn_jax.causal_conv1d_update(x, conv_state=pool, **kw)
    np.testing.assert_array_equal(_f64(pool), cs)


# --- native vs the jnp reference ---------------------------------------------------------------


@pytest.mark.parametrize("dtype,layout", [(jnp.float32, "SD"), (jnp.bfloat16, "DS"),
                                          pytest.param(jnp.float32, "DS", marks=pytest.mark.slow),
                                          pytest.param(jnp.bfloat16, "SD", marks=pytest.mark.slow)])
def test_native_matches_reference(dtype, layout):
    """Both implementations are within budget of float64 and of each other; the pools they
    return are identical (copies of exact inputs). Two layout/dtype pairs by default (the
    reference takes seconds to compile), all four when exhaustive."""
    rng = np.random.default_rng(15)
    D, W = 300, 4
    w, b = _params(rng, D, W, True)
    x, cs, qsl, idx, hi, L = _prefill_case(rng, dtype, layout, D, W)
    outs = {impl: _fwd_fn(w, b, qsl, idx, hi, True, layout, impl=impl)(jnp.asarray(x, dtype), jnp.asarray(cs, dtype))
            for impl in ("native", "reference")}
    yr, _ = conv_fwd_f64(x, w, b, cs, qsl, idx, hi, True, layout)
    for impl, (y, _) in outs.items():
        assert rel_rmse(_f64(y), yr) <= BUDGET[dtype], impl
    assert rel_rmse(_f64(outs["native"][0]), _f64(outs["reference"][0])) <= 2 * BUDGET[dtype]
    np.testing.assert_array_equal(_bits(outs["native"][1]), _bits(outs["reference"][1]))

    x, cs, qsl, idx, acc, L = _spec_case(rng, dtype, layout, D, W)
    outs = {impl: _upd_fn(w, b, idx, True, layout, qsl=qsl, acc=acc, impl=impl)(
        jnp.asarray(x, dtype), jnp.asarray(cs, dtype)) for impl in ("native", "reference")}
    yr, _ = conv_update_f64(x, w, b, cs, idx, True, acc, qsl, layout)
    for impl, (y, _) in outs.items():
        assert rel_rmse(_f64(y), yr) <= BUDGET[dtype], impl
    assert rel_rmse(_f64(outs["native"][0]), _f64(outs["reference"][0])) <= 2 * BUDGET[dtype]
    np.testing.assert_array_equal(_bits(outs["native"][1]), _bits(outs["reference"][1]))
