"""Validation: static mistakes raise at trace time naming the argument; bad batches are
refused by the kernels (and by the reference path's jnp mirror) with the same status and
nothing written."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gdn_jax
from gdn_jax import _checks

H, HV, K, V, W = 2, 4, 16, 16, 4
D = 2 * H * K + HV * V


def _qkv(T, dtype=jnp.float32):
    z = lambda *s: jnp.zeros(s, dtype)  # noqa: E731
    return z(T, H, K), z(T, H, K), z(T, HV, V)


def _gates(T, dtype=jnp.float32):
    return dict(a=jnp.zeros((T, HV), dtype), b=jnp.zeros((T, HV), dtype),
                A_log=jnp.zeros((HV,), jnp.float32), dt_bias=jnp.zeros((HV,), jnp.float32))


# --- static checks ---------------------------------------------------------------------------


def test_hv_not_multiple_of_h():
    q, k, _ = _qkv(3)
    v = jnp.zeros((3, 3, V))
    with pytest.raises(ValueError, match=r"HV=3 must be a positive multiple of key heads H=2"):
        gdn_jax.fused_sigmoid_gating_delta_rule_update(
            q, k, v, a=jnp.zeros((3, 3)), b=jnp.zeros((3, 3)), A_log=jnp.zeros(3), dt_bias=jnp.zeros(3),
            ssm_state=jnp.zeros((4, 3, K, V)), state_indices=jnp.arange(3, dtype=jnp.int32))


def test_state_shape_named():
    q, k, v = _qkv(2)
    with pytest.raises(ValueError, match=r"ssm_state must be \[N, HV, K, V\] = \[N, 4, 16, 16\]"):
        gdn_jax.fused_sigmoid_gating_delta_rule_update(
            q, k, v, **_gates(2), ssm_state=jnp.zeros((4, HV, V, K + 16)), state_indices=jnp.arange(2, dtype=jnp.int32))


def test_index_dtype_named():
    q, k, v = _qkv(2)
    with pytest.raises(TypeError, match="state_indices must have dtype int32, got int64|state_indices must have dtype int32"):
        gdn_jax.fused_sigmoid_gating_delta_rule_update(
            q, k, v, **_gates(2), ssm_state=jnp.zeros((4, HV, K, V)),
            state_indices=np.arange(2, dtype=np.int64).astype(np.float32))


def test_mixed_activation_dtypes_named():
    q, k, v = _qkv(2)
    with pytest.raises(TypeError, match=r"k must have the dtype of q \(float32\), got bfloat16"):
        gdn_jax.chunk_gated_delta_rule(
            q, k.astype(jnp.bfloat16), v, g=jnp.zeros((2, HV)), beta=jnp.zeros((2, HV)),
            ssm_state=jnp.zeros((4, HV, K, V)), query_start_loc=jnp.array([0, 2], jnp.int32),
            state_indices=jnp.array([0], jnp.int32), has_initial_state=jnp.array([True]))


def test_unsupported_dtype_named():
    with pytest.raises(TypeError, match="a must have dtype float32, bfloat16, got float16"):
        gdn_jax.fused_gdn_gating(jnp.zeros((2, HV), jnp.float16), jnp.zeros((2, HV), jnp.float16),
                                 A_log=jnp.zeros(HV), dt_bias=jnp.zeros(HV))


@pytest.mark.parametrize("K,V", [(20, 16), (16, 24), (8, 16)])
def test_chunk_head_dims_must_be_multiples_of_16(K, V):
    """Head dims the chunk kernel's 16-lane steps do not cover raise naming the dim (it had
    written past its rows at K = 20), from the op and, for a caller of the raw target, from the
    handler before the kernel runs; the reference path and the recurrence take them."""
    from gdn_jax import _native
    T = 3
    q, k, v = jnp.ones((T, H, K)), jnp.ones((T, H, K)), jnp.ones((T, HV, V))
    g, beta = jnp.zeros((T, HV)), jnp.full((T, HV), 0.5)
    chunk_args = dict(g=g, beta=beta, ssm_state=jnp.zeros((4, HV, K, V)), query_start_loc=jnp.array([0, T], jnp.int32),
                      state_indices=jnp.array([0], jnp.int32), has_initial_state=jnp.array([False]))
    name, bad = ("K", K) if K % 16 else ("V", V)
    with pytest.raises(ValueError, match=rf"multiples of 16 in \[16, 256\], got {name}={bad} "):
        gdn_jax.chunk_gated_delta_rule(q, k, v, **chunk_args, impl="native")
    o, _ = gdn_jax.chunk_gated_delta_rule(q, k, v, **chunk_args, impl="reference")
    assert o.shape == (T, HV, V)
    o, _ = gdn_jax.fused_sigmoid_gating_delta_rule_update(
        q, k, v, **_gates(T), ssm_state=jnp.zeros((4, HV, K, V)), state_indices=jnp.arange(T, dtype=jnp.int32),
        impl="native")
    assert o.shape == (T, HV, V)
    with pytest.raises(Exception, match=rf"must be multiples of 16 in \[16, 256\] for the chunked prefill, "
                                        rf"got K={K}, V={V}"):
        jax.block_until_ready(_native.chunk(
            q, k, v, g, beta, chunk_args["ssm_state"], chunk_args["query_start_loc"], chunk_args["state_indices"],
            chunk_args["has_initial_state"], scale=0.25, eps=1e-6, l2norm=True))


@pytest.mark.parametrize("K,V", [(272, 16), (16, 512)])
def test_native_head_dims_at_most_256(K, V):
    q, k, v = jnp.ones((2, H, K)), jnp.ones((2, H, K)), jnp.ones((2, HV, V))
    name, bad = ("K", K) if K > 256 else ("V", V)
    with pytest.raises(ValueError, match=rf"head dims K, V up to 256, got {name}={bad} "):
        gdn_jax.fused_sigmoid_gating_delta_rule_update(
            q, k, v, **_gates(2), ssm_state=jnp.zeros((4, HV, K, V)), state_indices=jnp.arange(2, dtype=jnp.int32),
            impl="native")


def test_conv_layout_and_shapes_named():
    x = jnp.zeros((5, D))
    w = jnp.zeros((D, W))
    qsl = jnp.array([0, 5], jnp.int32)
    idx = jnp.array([0], jnp.int32)
    hs = jnp.array([False])
    with pytest.raises(ValueError, match="conv_state_layout must be 'SD'"):
        gdn_jax.causal_conv1d_fwd(x, weight=w, bias=None, conv_state=jnp.zeros((2, 3, D)), query_start_loc=qsl,
                                  state_indices=idx, has_initial_state=hs, conv_state_layout="TD")
    with pytest.raises(ValueError, match=r"conv_state \(DS layout\) must be \[N, D, L\]"):
        gdn_jax.causal_conv1d_fwd(x, weight=w, bias=None, conv_state=jnp.zeros((2, 3, D)), query_start_loc=qsl,
                                  state_indices=idx, has_initial_state=hs, conv_state_layout="DS")
    with pytest.raises(ValueError, match="conv_state length L=2 must be at least W-1=3"):
        gdn_jax.causal_conv1d_fwd(x, weight=w, bias=None, conv_state=jnp.zeros((2, 2, D)), query_start_loc=qsl,
                                  state_indices=idx, has_initial_state=hs)
    with pytest.raises(ValueError, match=r"query_start_loc must be \[S \+ 1\]"):
        gdn_jax.causal_conv1d_fwd(x, weight=w, bias=None, conv_state=jnp.zeros((2, 3, D)),
                                  query_start_loc=jnp.array([0, 2, 5], jnp.int32), state_indices=idx,
                                  has_initial_state=hs)
    with pytest.raises(ValueError, match="activation must be 'silu' or None"):
        gdn_jax.causal_conv1d_fwd(x, weight=w, bias=None, conv_state=jnp.zeros((2, 3, D)), query_start_loc=qsl,
                                  state_indices=idx, has_initial_state=hs, activation="gelu")
    with pytest.raises(ValueError, match="conv width W = weight.shape\\[1\\] must be 2, 3 or 4, got 5"):
        gdn_jax.causal_conv1d_fwd(x, weight=jnp.zeros((D, 5)), bias=None, conv_state=jnp.zeros((2, 4, D)),
                                  query_start_loc=qsl, state_indices=idx, has_initial_state=hs)


def test_static_errors_raise_under_jit_too():
    q, k, v = _qkv(2)
    f = jax.jit(lambda q: gdn_jax.fused_sigmoid_gating_delta_rule_update(
        q, k, v, **_gates(2), ssm_state=jnp.zeros((4, HV, K, V)), state_indices=jnp.arange(3, dtype=jnp.int32)))
    with pytest.raises(ValueError, match=r"state_indices must be \[B\]"):
        f(q)


@pytest.mark.parametrize("impl", ["native", "reference"])
@pytest.mark.parametrize("kw,exc,msg", [
    (dict(use_qk_l2norm="no"), TypeError, "use_qk_l2norm must be a bool, got 'no'"),
    (dict(use_qk_l2norm=1), TypeError, "use_qk_l2norm must be a bool"),
    (dict(l2norm_eps=-1e-6), ValueError, "l2norm_eps must be > 0"),
    (dict(l2norm_eps=0.0), ValueError, "l2norm_eps must be > 0"),
    (dict(scale=float("nan")), ValueError, "scale must be finite"),
    (dict(scale="x"), TypeError, "scale must be a number"),
])
def test_qk_arguments_refused_alike_on_both_paths(impl, kw, exc, msg):
    """The reference took use_qk_l2norm="no" as True and any eps; the native call raised a bare
    int() error. Both refuse now, naming the argument."""
    q, k, v = _qkv(2)
    with pytest.raises(exc, match=msg):
        gdn_jax.fused_sigmoid_gating_delta_rule_update(q, k, v, **_gates(2), ssm_state=jnp.zeros((4, HV, K, V)),
                                                       state_indices=jnp.arange(2, dtype=jnp.int32), impl=impl, **kw)


@pytest.mark.parametrize("impl", ["native", "reference"])
@pytest.mark.parametrize("name", ["scale", "l2norm_eps"])
def test_traced_static_arguments_refused_by_name(impl, name):
    """scale and l2norm_eps select the compiled program: a traced value is refused alike (the
    reference used to trace it, the native call failed with a tracer conversion error)."""
    q, k, v = _qkv(2)
    f = jax.jit(lambda x: gdn_jax.chunk_gated_delta_rule(
        q, k, v, g=jnp.zeros((2, HV)), beta=jnp.zeros((2, HV)), ssm_state=jnp.zeros((4, HV, K, V)),
        query_start_loc=jnp.array([0, 2], jnp.int32), state_indices=jnp.array([1], jnp.int32),
        has_initial_state=jnp.array([False]), impl=impl, **{name: x}))
    with pytest.raises(TypeError, match=f"{name} must be a concrete number"):
        f(jnp.float32(1e-3))


# --- data checks: kernel status == jnp mirror, nothing written ---------------------------


def _status_pair(fn):
    outs = {impl: fn(impl) for impl in ("native", "reference")}
    return outs


BAD_SPEC = {
    "slot out of range": ([0, 1, 2], [[0, 1], [8, 9]], [1, 1], "slot 8 \\(column 0\\) is outside"),
    "negative slot": ([0, 1, 2], [[0, 1], [-3, 5]], [1, 1], "slot -3 \\(column 0\\) is outside"),
    "slot twice": ([0, 1, 2], [[2, 3], [2, 5]], [1, 1], "slot 2 is also named by row 0"),
    "slot twice in used columns": ([0, 1, 3], [[2, 3], [4, 2]], [1, 1], "slot 2 is also named by row 0"),
    "slot twice via accepted column": ([0, 1, 2], [[2, 3], [4, 5]], [1, 2], None),
    "slot twice in one row": ([0, 1, 3], [[2, 3], [4, 4]], [1, 1], "row 1: slot 4 is named by two of its used columns"),
    "slot twice in one row via accepted column": ([0, 1, 2], [[2, 3], [4, 4]], [1, 2],
                                                  "row 1: slot 4 is named by two of its used columns"),
    "slot repeated in an unused column": ([0, 1, 2], [[2, 3], [4, 4]], [1, 1], None),
    "accepted zero": ([0, 1, 2], [[0, 1], [2, 3]], [0, 1], "num_accepted_tokens = 0 is outside \\[1, 2\\]"),
    "accepted too many": ([0, 1, 2], [[0, 1], [2, 3]], [1, 3], "num_accepted_tokens = 3 is outside \\[1, 2\\]"),
    "row too long": ([0, 3, 3], [[0, 1], [2, 3]], [1, 1], "3 tokens, more than the 2"),
    "qsl decreasing": ([0, 2, 1], [[0, 1], [2, 3]], [1, 1], "must be non-decreasing"),
    "qsl past T": ([0, 1, 4], [[0, 1], [2, 3]], [1, 1], "is past the number of tokens T = 3"),
    "qsl start": ([1, 2, 3], [[0, 1], [2, 3]], [1, 1], "query_start_loc\\[0\\] must be 0"),
}


@pytest.mark.parametrize("case", sorted(BAD_SPEC))
def test_spec_batch_refused_identically(case):
    qsl, idx, acc, pattern = BAD_SPEC[case]
    T, N = 3, 6
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.normal(size=s), jnp.float32) for s in ((T, H, K), (T, H, K), (T, HV, V)))
    pool = jnp.asarray(rng.normal(size=(N, HV, K, V)), jnp.float32)
    before = np.asarray(pool).copy()
    statuses = {}
    for impl in ("native", "reference"):
        o, st, status = gdn_jax.ops.fused_sigmoid_gating_delta_rule_update_spec_with_status(
            q, k, v, **_gates(T), ssm_state=pool, query_start_loc=jnp.asarray(qsl, jnp.int32),
            spec_state_indices=jnp.asarray(idx, jnp.int32), num_accepted_tokens=jnp.asarray(acc, jnp.int32),
            impl=impl)
        statuses[impl] = np.asarray(status)
        if pattern is None:
            # Legal: row 1 reads column acc-1 = 1 (slot 5), row 0 uses only slot 2; or row 1 uses
            # only column 0 (one token, acc 1), so its column 1 is not named.
            assert statuses[impl][0] == 0
            continue
        np.testing.assert_array_equal(np.asarray(st), before)
        assert not np.any(np.asarray(o))
    if pattern is None:
        return
    assert statuses["native"][0] != 0
    np.testing.assert_array_equal(statuses["native"], statuses["reference"])
    msg = _checks.status_message("op", statuses["native"])
    assert re_search(pattern, msg), msg
    with pytest.raises(gdn_jax.InvalidBatchError, match=pattern):
        gdn_jax.fused_sigmoid_gating_delta_rule_update_spec(
            q, k, v, **_gates(T), ssm_state=pool, query_start_loc=jnp.asarray(qsl, jnp.int32),
            spec_state_indices=jnp.asarray(idx, jnp.int32), num_accepted_tokens=jnp.asarray(acc, jnp.int32),
            impl="native")


def re_search(pattern, s):
    import re

    return re.search(pattern, s) is not None


@pytest.mark.parametrize("idx,qsl,pattern", [
    ([0, 9], [0, 2, 4], "slot 9"),
    ([5, 5], [0, 2, 4], "slot 5 is also named by row 0"),
    ([-2, 1], [0, 2, 4], "slot -2"),
    ([0, 1], [0, 3, 2], "non-decreasing"),
    ([0, 1], [0, 2, 5], "past the number of tokens"),
])
def test_prefill_batch_refused_identically(idx, qsl, pattern):
    T, N = 4, 6
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.normal(size=(T, D)), jnp.float32)
    cs = jnp.asarray(rng.normal(size=(N, W - 1, D)), jnp.float32)
    before = np.asarray(cs).copy()
    sts = []
    for impl in ("native", "reference"):
        y, cs2, st = gdn_jax.ops.causal_conv1d_fwd_with_status(
            x, weight=jnp.ones((D, W)), bias=None, conv_state=cs, query_start_loc=jnp.asarray(qsl, jnp.int32),
            state_indices=jnp.asarray(idx, jnp.int32), has_initial_state=jnp.array([True, False]), impl=impl)
        np.testing.assert_array_equal(np.asarray(cs2), before)
        assert not np.any(np.asarray(y))
        sts.append(np.asarray(st))
    assert sts[0][0] != 0
    np.testing.assert_array_equal(sts[0], sts[1])
    assert re_search(pattern, _checks.status_message("causal_conv1d_fwd", sts[0]))


def test_bad_batch_is_reported_when_the_output_is_dropped(capfd):
    """The report rides on the op's cache, which a caller keeps: a jitted function that uses
    only the updated caches (the conv update of a layer whose output it discards, a decode
    warm-up) still reports a refused batch instead of XLA dropping the report as dead code."""
    rng = np.random.default_rng(3)
    T, N = 2, 4
    cs = jnp.asarray(rng.normal(size=(N, W - 1, D)), jnp.float32)
    pool = jnp.asarray(rng.normal(size=(N, HV, K, V)), jnp.float32)
    q, k = (jnp.ones((T, H, K)) for _ in range(2))
    v = jnp.ones((T, HV, V))
    bad = jnp.array([1, 7], jnp.int32)
    calls = {
        "causal_conv1d_update": lambda idx: gdn_jax.causal_conv1d_update(
            jnp.ones((T, D)), weight=jnp.ones((D, W)), bias=None, conv_state=cs, state_indices=idx)[1],
        "causal_conv1d_fwd": lambda idx: gdn_jax.causal_conv1d_fwd(
            jnp.ones((T, D)), weight=jnp.ones((D, W)), bias=None, conv_state=cs,
            query_start_loc=jnp.array([0, 1, 2], jnp.int32), state_indices=idx,
            has_initial_state=jnp.array([True, True]))[1],
        "chunk_gated_delta_rule": lambda idx: gdn_jax.chunk_gated_delta_rule(
            q, k, v, g=jnp.zeros((T, HV)), beta=jnp.zeros((T, HV)), ssm_state=pool,
            query_start_loc=jnp.array([0, 1, 2], jnp.int32), state_indices=idx,
            has_initial_state=jnp.array([True, True]))[1],
        "fused_sigmoid_gating_delta_rule_update": lambda idx: gdn_jax.fused_sigmoid_gating_delta_rule_update(
            q, k, v, **_gates(T), ssm_state=pool, state_indices=idx)[1],
        "fused_sigmoid_gating_delta_rule_update_spec": lambda idx: gdn_jax.fused_sigmoid_gating_delta_rule_update_spec(
            q, k, v, **_gates(T), ssm_state=pool, query_start_loc=jnp.array([0, 1, 2], jnp.int32),
            spec_state_indices=idx[:, None], num_accepted_tokens=jnp.ones((2,), jnp.int32))[1],
    }
    for op, call in calls.items():
        out = jax.jit(call)(bad)
        np.testing.assert_array_equal(np.asarray(out), np.asarray(cs if op.startswith("causal") else pool))
        expected = _checks.status_message(op, np.array([4, 1, 7, 0]))
        assert expected in capfd.readouterr().err.splitlines(), op


def _jit_conv_update_bad_slot(impl):
    T, N = 2, 4
    x = jnp.ones((T, D), jnp.float32)
    cs = jnp.asarray(np.random.default_rng(2).normal(size=(N, W - 1, D)), jnp.float32)
    before = np.asarray(cs).copy()
    g = jax.jit(lambda x, cs, idx: gdn_jax.causal_conv1d_update(
        x, weight=jnp.ones((D, W)), bias=None, conv_state=cs, state_indices=idx, impl=impl), donate_argnums=(1,))
    return g, x, cs, before


@pytest.mark.parametrize("impl", ["native", "reference"])
def test_bad_batch_under_jit_with_donation_keeps_cache(impl, capfd):
    """Under jit the op cannot raise without losing the donated cache: it writes nothing,
    returns the cache unchanged and reports the error on stderr, from the native report
    call (no host callback, so the call keeps JAX's fast dispatch path)."""
    f, x, cs, before = _jit_conv_update_bad_slot(impl)
    y, cs2 = f(x, cs, jnp.array([1, 7], jnp.int32))
    np.testing.assert_array_equal(np.asarray(cs2), before)
    assert not np.any(np.asarray(y))
    err = capfd.readouterr().err
    expected = _checks.status_message("causal_conv1d_update", np.array([4, 1, 7, 0]))
    assert expected in err.splitlines()
    # A good batch afterwards reports nothing.
    y, cs3 = f(x, cs2, jnp.array([1, 3], jnp.int32))
    jax.block_until_ready(cs3)
    assert "invalid batch" not in capfd.readouterr().err


def test_native_report_formats_every_code_like_python(capfd):
    """The stderr line of the native report call is the eager error message, for every code."""
    for code in sorted(_checks.STATUS_MESSAGES) + [99]:
        status = np.array([code, 3, -5, 11], np.int32)
        f = jax.jit(lambda x, s: gdn_jax.ops.report_status("copy_slots", s, x))
        jax.block_until_ready(f(jnp.zeros(3), jnp.asarray(status)))
        assert capfd.readouterr().err.splitlines() == [_checks.status_message("copy_slots", status)]


def test_jitted_ops_have_no_host_callback():
    """Error reporting must not put a host callback (or any effect) into a jitted op: either
    takes JAX's jit call off its C++ fast path (~0.2 ms a call, a whole decode step)."""
    T, N = 2, 4
    q, k, v = _qkv(T)
    fn = lambda q, k, v, st: gdn_jax.fused_sigmoid_gating_delta_rule_update(  # noqa: E731
        q, k, v, **_gates(T), ssm_state=st, state_indices=jnp.array([0, 2], jnp.int32))
    st = jnp.zeros((N, HV, K, V))
    assert not jax.make_jaxpr(fn)(q, k, v, st).effects
    hlo = jax.jit(fn).lower(q, k, v, st).compile().as_text()
    assert "xla_ffi_python_cpu_callback" not in hlo and "gdn_jax_report" in hlo


def test_bad_batch_under_jit_off_cpu_path_logs_from_callback(monkeypatch):
    """Without the native report call (a non-CPU backend, no extension) the error is logged
    from a host callback taken only on an error."""
    monkeypatch.setattr(gdn_jax.ops, "native_available", lambda: False)
    f, x, cs, before = _jit_conv_update_bad_slot("reference")
    with pytest.warns(RuntimeWarning, match="slot 7"):
        y, cs2 = f(x, cs, jnp.array([1, 7], jnp.int32))
        jax.effects_barrier()
    np.testing.assert_array_equal(np.asarray(cs2), before)


# --- empty batches: no tokens or no rows write nothing, on both paths -------------------------


@pytest.mark.parametrize("impl", ["native", "reference"])
def test_empty_batches_write_nothing(impl):
    """The reference's gathers have no empty form: with T = 0 or S = 0 it must not run them, and
    return what the kernels do (zeros, the pools unchanged, status OK)."""
    rng = np.random.default_rng(5)
    w = jnp.asarray(rng.normal(size=(D, W)), jnp.float32)
    ops = gdn_jax.ops
    for T, S, N in ((0, 0, 4), (0, 2, 4), (3, 0, 4), (3, 2, 0)):   # N = 0: an empty pool, padding rows
        ssm = jnp.asarray(rng.normal(size=(N, HV, K, V)), jnp.float32)
        conv = jnp.asarray(rng.normal(size=(N, W - 1 + 1, D)), jnp.float32)
        q, k = (jnp.ones((T, H, K)) for _ in range(2))
        v, x = jnp.ones((T, HV, V)), jnp.ones((T, D))
        qsl = jnp.zeros((S + 1,), jnp.int32)
        idx = jnp.arange(S, dtype=jnp.int32) if N else jnp.full((S,), -1, jnp.int32)
        runs = {
            "conv_fwd": lambda: ops.causal_conv1d_fwd_with_status(
                x, weight=w, bias=None, conv_state=conv, query_start_loc=qsl, state_indices=idx,
                has_initial_state=jnp.ones((S,), bool), impl=impl),
            "conv_update": lambda: ops.causal_conv1d_update_with_status(
                x, weight=w, bias=None, conv_state=conv, state_indices=idx, query_start_loc=qsl,
                num_accepted_tokens=jnp.ones((S,), jnp.int32), impl=impl),
            "chunk": lambda: ops.chunk_gated_delta_rule_with_status(
                q, k, v, g=jnp.zeros((T, HV)), beta=jnp.zeros((T, HV)), ssm_state=ssm, query_start_loc=qsl,
                state_indices=idx, has_initial_state=jnp.ones((S,), bool), impl=impl),
            "spec": lambda: ops.fused_sigmoid_gating_delta_rule_update_spec_with_status(
                q, k, v, **_gates(T), ssm_state=ssm, query_start_loc=qsl,
                spec_state_indices=jnp.stack([idx, idx + S if N else idx], axis=1),
                num_accepted_tokens=jnp.ones((S,), jnp.int32),
                impl=impl),
        }
        if T == S:  # decode: one token per row
            runs["decode"] = lambda: ops.fused_sigmoid_gating_delta_rule_update_with_status(
                q, k, v, **_gates(T), ssm_state=ssm, state_indices=idx, impl=impl)
        for name, run in runs.items():
            out, pool, status = run()
            before = conv if name.startswith("conv") else ssm
            assert np.asarray(status).tolist() == [0, 0, 0, 0], (name, T, S)
            assert out.shape[0] == T and not np.any(np.asarray(out)), (name, T, S)
            np.testing.assert_array_equal(np.asarray(pool), np.asarray(before), err_msg=f"{name} T={T} S={S}")


def test_native_and_reference_statuses_agree_on_random_corruptions():
    """Random edits of valid batches (several at once: slots out of range or repeated, bad
    accepted counts and lengths, non-monotone query_start_loc) for the spec, conv update,
    prefill and copy_slots checks: the kernels and the jnp mirrors report the same (code, row,
    value, aux), i.e. the same first failure of the same row."""
    rng = np.random.default_rng(11)
    T, N, S, C = 10, 12, 3, 3
    q, k = (jnp.ones((T, H, K)) for _ in range(2))
    v, x = jnp.ones((T, HV, V)), jnp.ones((T, D))
    pool = jnp.zeros((N, HV, K, V))
    conv = jnp.zeros((N, W - 1 + C - 1, D))
    w = jnp.ones((D, W))
    ops = gdn_jax.ops
    vals = np.array([-2, -1, 0, 1, 2, 3, 5, 7, 11, 12])
    codes = set()
    for trial in range(150):
        qsl = np.array([0, 2, 3, 5], np.int32)
        idx = rng.permutation(N)[:S * C].reshape(S, C).astype(np.int32)
        acc = np.array([1, 2, 3], np.int32)
        for _ in range(int(rng.integers(1, 4))):
            which = int(rng.integers(3))
            if which == 0:
                idx[rng.integers(S), rng.integers(C)] = rng.choice(vals)
            elif which == 1:
                acc[rng.integers(S)] = rng.choice(vals)
            else:
                qsl[1 + rng.integers(S)] = rng.integers(-1, T + 2)
        args = dict(query_start_loc=jnp.asarray(qsl), num_accepted_tokens=jnp.asarray(acc))
        got = {}
        for impl in ("native", "reference"):
            st = [ops.fused_sigmoid_gating_delta_rule_update_spec_with_status(
                      q, k, v, **_gates(T), ssm_state=pool, spec_state_indices=jnp.asarray(idx), impl=impl, **args)[2],
                  ops.causal_conv1d_update_with_status(
                      x, weight=w, bias=None, conv_state=conv, state_indices=jnp.asarray(idx[:, 0]), impl=impl,
                      **args)[2],
                  ops.causal_conv1d_fwd_with_status(
                      x, weight=w, bias=None, conv_state=conv, query_start_loc=jnp.asarray(qsl),
                      state_indices=jnp.asarray(idx[:, 0]), has_initial_state=jnp.ones((S,), bool), impl=impl)[2],
                  ops.copy_slots_with_status(pool, src=jnp.asarray(idx[:, 1]), dst=jnp.asarray(idx[:, 0]),
                                             impl=impl)[1]]
            got[impl] = [np.asarray(s).tolist() for s in st]
        assert got["native"] == got["reference"], (trial, qsl, idx, acc, got)
        codes.update(s[0] for s in got["native"])
    assert {0, 2, 4, 5, 6, 7, 9, 10} <= codes, codes


@pytest.mark.parametrize("impl", ["native", "reference"])
def test_int64_indices_beyond_int32_are_refused_not_wrapped(impl):
    """Called eagerly with NumPy int64 indices (a torch engine's), jit converts them to int32 and
    wraps 2**32 + 1 into slot 1: the ops refuse such values naming the argument, take int64 in range."""
    if impl == "native" and not gdn_jax.native_available():
        pytest.skip("native extension not built")
    T, N = 2, 4
    q, k, v = _qkv(T)
    pool = jnp.ones((N, HV, K, V))
    big = np.array([0, 2 ** 32 + 1], np.int64)
    with pytest.raises(ValueError, match="state_indices holds 4294967297, outside int32"):
        gdn_jax.fused_sigmoid_gating_delta_rule_update(q, k, v, **_gates(T), ssm_state=pool, state_indices=big,
                                                       impl=impl)
    with pytest.raises(ValueError, match="src holds -4294967295"):
        gdn_jax.copy_slots(pool, src=np.array([-(2 ** 32) + 1, 0]), dst=np.array([1, 2]), impl=impl)
    o, pool2 = gdn_jax.fused_sigmoid_gating_delta_rule_update(q, k, v, **_gates(T), ssm_state=pool,
                                                              state_indices=np.array([0, 3], np.int64), impl=impl)
    after = np.asarray(pool2)   # slot 3 decayed (g = -softplus(0)), slot 1 untouched
    assert np.all(after[3] < 1) and np.all(after[1] == 1)
