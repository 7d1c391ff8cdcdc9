"""gdn_jax.ops.linear and merged_linear (the layer's projections): native (every ISA here) against
float64."""
import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gdn_jax
from f64_math import bf16_round, rel_rmse
from gdn_jax.ops import PackedLinearWeight, linear, merged_linear, pack_linear_weight

ISAS = gdn_jax.available_isas()
DTYPES = [jnp.float32, jnp.bfloat16]


def _bf16_steps(got, ref):
    """Signed distance in bf16 steps of each output from the correctly rounded ref (same sign)."""
    a = np.asarray(got, np.float32).view(np.int32) >> 16
    b = bf16_round(ref, np.float32).view(np.int32) >> 16
    return np.abs(a.astype(np.int64) - b.astype(np.int64))


def _check(y, ref, out_dtype):
    assert y.dtype == out_dtype and y.shape == ref.shape
    got = np.asarray(y, np.float64)
    if out_dtype == jnp.float32:
        assert rel_rmse(got, ref) <= 1e-6
    else:
        # One rounding of the f32 sum: within one bf16 step of the exact value (f32 summation
        # error can only matter where the exact value is tiny against the largest output).
        big = np.abs(ref) >= 1e-4 * np.abs(ref).max()
        assert np.all(_bf16_steps(got, ref)[big] <= 1)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("x_dtype", DTYPES)
@pytest.mark.parametrize("w_dtype", DTYPES)
@pytest.mark.parametrize("out_dtype", DTYPES)
@pytest.mark.parametrize("T,n_in,n_out", [(1, 17, 9), (3, 100, 33), (67, 257, 130)])
def test_native_matches_f64(isa, x_dtype, w_dtype, out_dtype, T, n_in, n_out):
    rng = np.random.default_rng(T * 1000 + n_in)
    # bf16-exact values: the same numbers in either dtype, so the f64 product is exact.
    x = bf16_round(rng.normal(size=(T, n_in)))
    w = bf16_round(rng.normal(size=(n_out, n_in)) * 0.05)
    ref = x @ w.T
    with gdn_jax.use_isa(isa):
        fn = jax.jit(lambda x_, w_: linear(x_, w_, out_dtype=out_dtype, impl="native"))
        y = fn(jnp.asarray(x, x_dtype), jnp.asarray(w, w_dtype))
    _check(y, ref, jnp.dtype(out_dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_reference_matches_f64(dtype):
    rng = np.random.default_rng(5)
    x, w = bf16_round(rng.normal(size=(5, 300))), bf16_round(rng.normal(size=(40, 300)))
    y = linear(jnp.asarray(x, dtype), jnp.asarray(w, dtype), impl="reference")
    _check(y, x @ w.T, jnp.dtype(dtype))


def test_default_out_dtype_and_vmap():
    rng = np.random.default_rng(6)
    x = jnp.asarray(bf16_round(rng.normal(size=(3, 4, 40))), jnp.bfloat16)
    w = jnp.asarray(bf16_round(rng.normal(size=(24, 40))), jnp.bfloat16)
    y = jax.vmap(lambda x_: linear(x_, w, impl="native"))(x)
    assert y.dtype == jnp.bfloat16 and y.shape == (3, 4, 24)
    ref = np.einsum("bti,oi->bto", np.asarray(x, np.float64), np.asarray(w, np.float64))
    assert np.all(_bf16_steps(y, ref) <= 1)


@pytest.mark.parametrize("impl", ["native", "reference"])
def test_static_errors_name_the_argument(impl):
    x = jnp.zeros((2, 8), jnp.float32)
    w = jnp.zeros((4, 8), jnp.bfloat16)
    with pytest.raises(ValueError, match="x must be"):
        linear(x[0], w, impl=impl)
    with pytest.raises(ValueError, match="w must be"):
        linear(x, w[:, :7], impl=impl)
    with pytest.raises(ValueError, match="w must be"):
        linear(x, w[0], impl=impl)
    with pytest.raises(TypeError, match="x must have dtype"):
        linear(x.astype(jnp.float16), w, impl=impl)
    with pytest.raises(TypeError, match="w must have dtype"):
        linear(x, w.astype(jnp.int32), impl=impl)
    with pytest.raises(TypeError, match="out_dtype"):
        linear(x, w, out_dtype=jnp.float16, impl=impl)


# --- packed weights (ops.pack_linear_weight) --------------------------------------------------


@pytest.mark.parametrize("isa", ISAS + ["reference"])
@pytest.mark.parametrize("x_dtype", DTYPES)
@pytest.mark.parametrize("out_dtype", DTYPES)
# 520 x 2048: bf16 x past 2 MiB, which the AMX units pack in tile order first.
@pytest.mark.parametrize("T,n_in,n_out", [(1, 17, 9), (8, 64, 50), (13, 100, 48), (67, 257, 130), (520, 2048, 40)])
def test_packed_matches_f64(isa, x_dtype, out_dtype, T, n_in, n_out):
    rng = np.random.default_rng(T * 1000 + n_in + 1)
    x = bf16_round(rng.normal(size=(T, n_in)))
    w = bf16_round(rng.normal(size=(n_out, n_in)) * 0.05)
    wp = pack_linear_weight(jnp.asarray(w, jnp.bfloat16))
    impl = "reference" if isa == "reference" else "native"
    fn = jax.jit(lambda x_, w_: linear(x_, w_, out_dtype=out_dtype, impl=impl))
    if isa == "reference":
        y = fn(jnp.asarray(x, x_dtype), wp)
    else:
        with gdn_jax.use_isa(isa):
            y = fn(jnp.asarray(x, x_dtype), wp)
    _check(y, x @ w.T, jnp.dtype(out_dtype))


@pytest.mark.parametrize("isa", ISAS + ["reference"])
@pytest.mark.parametrize("x_dtype", DTYPES)
# Decode-sized, row blocks, and 520 x 2048 (AMX: x packed once for all parts); 10 weights take
# two native calls (8 per call); an unpacked weight among packed ones; a part of 0 outputs.
@pytest.mark.parametrize("T,n_in,n_outs", [(1, 17, (9, 0, 40)), (8, 64, (50, 16, 1, 33)),
                                           (67, 257, (130, 7) * 5), (520, 2048, (40, 32, 32))])
def test_merged_matches_linear_and_f64(isa, x_dtype, T, n_in, n_outs):
    rng = np.random.default_rng(T + n_in + len(n_outs))
    x = jnp.asarray(bf16_round(rng.normal(size=(T, n_in))), x_dtype)
    w64 = [bf16_round(rng.normal(size=(n, n_in)) * 0.05) for n in n_outs]
    ws = [pack_linear_weight(jnp.asarray(w, jnp.bfloat16)) for w in w64]
    if T == 8:
        ws[1] = jnp.asarray(w64[1], jnp.bfloat16)   # unpacked: its own linear call
    impl = "reference" if isa == "reference" else "native"
    merged = jax.jit(lambda x_, ws_: merged_linear(x_, ws_, impl=impl))
    alone = jax.jit(lambda x_, w_: linear(x_, w_, impl=impl))
    with contextlib.nullcontext() if isa == "reference" else gdn_jax.use_isa(isa):
        ys = merged(x, ws)
        singles = [alone(x, w) for w in ws]
    assert isinstance(ys, tuple) and len(ys) == len(ws)
    x64 = np.asarray(x, np.float64)
    for y, y1, w in zip(ys, singles, w64):
        if w.shape[0] == 0:
            assert y.shape == (T, 0) and y.dtype == jnp.dtype(x_dtype)
        else:
            _check(y, x64 @ w.T, jnp.dtype(x_dtype))
        np.testing.assert_array_equal(np.asarray(y, np.float32), np.asarray(y1, np.float32))   # bit for bit


@pytest.mark.skipif(not gdn_jax.native_available(), reason="native extension not built")
def test_merged_is_one_native_call():
    """Packed weights of one x in one custom call: what the layer's in_proj relies on."""
    x = jnp.zeros((4, 32), jnp.bfloat16)
    ws = [pack_linear_weight(jnp.zeros((n, 32), jnp.bfloat16)) for n in (48, 16, 8, 8)]
    hlo = jax.jit(lambda x_, ws_: merged_linear(x_, ws_, impl="native")).lower(x, ws).as_text()
    assert hlo.count("@gdn_jax_linear_packed(") == 1


@pytest.mark.parametrize("impl", ["native", "reference"])
def test_merged_errors_name_the_argument(impl):
    x = jnp.zeros((2, 8), jnp.bfloat16)
    wp = pack_linear_weight(jnp.zeros((20, 8), jnp.bfloat16))
    with pytest.raises(TypeError, match="ws must be a non-empty list or tuple"):
        merged_linear(x, [], impl=impl)
    with pytest.raises(TypeError, match="ws must be a non-empty list or tuple"):
        merged_linear(x, wp, impl=impl)
    other = pack_linear_weight(jnp.zeros((4, 7), jnp.bfloat16))
    with pytest.raises(ValueError, match=r"(ws\[1\]|w) must be packed from .* in=8"):
        merged_linear(x, [wp, other], impl=impl)
    with pytest.raises(TypeError, match="out_dtype must be float32 or bfloat16"):
        merged_linear(x, [wp, wp], out_dtype=jnp.int32, impl=impl)


@pytest.mark.parametrize("n_out,n_in", [(1, 1), (9, 17), (32, 64), (33, 3)])
def test_pack_layout_and_round_trip(n_out, n_in):
    rng = np.random.default_rng(n_out + n_in)
    w = jnp.asarray(rng.normal(size=(n_out, n_in)), jnp.bfloat16)
    wp = pack_linear_weight(w)
    nb, np_ = -(-n_out // 16), -(-n_in // 2)
    assert wp.shape == (n_out, n_in) and wp.dtype == jnp.bfloat16 and wp.data.shape == (nb, np_, 16, 2)
    d, w64 = np.asarray(wp.data, np.float64), np.asarray(w, np.float64)
    for o, i in [(0, 0), (n_out - 1, n_in - 1), (n_out // 2, n_in // 3)]:
        assert d[o // 16, i // 2, o % 16, i % 2] == w64[o, i]
    full = np.zeros((nb * 16, np_ * 2))
    full[:n_out, :n_in] = w64
    np.testing.assert_array_equal(d.transpose(0, 2, 1, 3).reshape(nb * 16, np_ * 2), full)   # zero padding
    np.testing.assert_array_equal(np.asarray(wp.unpack(), np.float64), w64)
    leaves, tree = jax.tree_util.tree_flatten(wp)   # a pytree: data is the leaf, the shape static
    assert len(leaves) == 1 and jax.tree_util.tree_unflatten(tree, leaves).shape == (n_out, n_in)


def test_packed_under_vmap():
    rng = np.random.default_rng(7)
    x = jnp.asarray(bf16_round(rng.normal(size=(3, 4, 40))), jnp.bfloat16)
    w = bf16_round(rng.normal(size=(24, 40)))
    wp = pack_linear_weight(jnp.asarray(w, jnp.bfloat16))
    y = jax.vmap(lambda x_: linear(x_, wp, impl="native"))(x)
    assert y.dtype == jnp.bfloat16 and y.shape == (3, 4, 24)
    assert np.all(_bf16_steps(y, np.einsum("bti,oi->bto", np.asarray(x, np.float64), w)) <= 1)


@pytest.mark.parametrize("impl", ["native", "reference"])
def test_packed_errors_name_the_argument(impl):
    x = jnp.zeros((2, 8), jnp.bfloat16)
    w = jnp.zeros((20, 8), jnp.bfloat16)
    with pytest.raises(TypeError, match="w must be bfloat16 to be packed"):
        pack_linear_weight(w.astype(jnp.float32))
    with pytest.raises(ValueError, match="w must be"):
        pack_linear_weight(w[0])
    wp = pack_linear_weight(w)
    with pytest.raises(ValueError, match="w must be packed from .* in=7"):
        linear(x[:, :7], wp, impl=impl)
    with pytest.raises(ValueError, match=r"w.data must be \[ceil\(out / 16\)"):
        linear(x, PackedLinearWeight(wp.data[:1], wp.shape), impl=impl)
    with pytest.raises(TypeError, match="w.data must have dtype bfloat16"):
        linear(x, PackedLinearWeight(wp.data.astype(jnp.float32), wp.shape), impl=impl)


@pytest.mark.skipif(not gdn_jax.native_available(), reason="native extension not built")
@pytest.mark.parametrize("target,w,message", [
    ("linear", jnp.zeros((3, 4), jnp.int32), "gdn_jax.linear: w must be float32 or bfloat16"),
    ("linear", jnp.zeros((3, 5), jnp.float32), r"gdn_jax.linear: w must be \[out, in\] with in = 4"),
    ("linear_packed", jnp.zeros((1, 2, 16, 2), jnp.float32), "gdn_jax.linear_packed: the packed w must be bfloat16"),
    ("linear_packed", jnp.zeros((2, 2, 16, 2), jnp.bfloat16),
     r"gdn_jax.linear_packed: the packed w must be \[ceil\(out / 16\), ceil\(in / 2\), 16, 2\] = \[1, 2, 16, 2\]"),
])
def test_handlers_refuse_bad_buffers(target, w, message):
    """The FFI handlers check what ops.linear checks first (a direct jax.ffi.ffi_call bypasses it)."""
    from gdn_jax._ffi import TARGET_PREFIX
    call = jax.ffi.ffi_call(TARGET_PREFIX + target, jax.ShapeDtypeStruct((2, 3), jnp.float32))
    with pytest.raises(Exception, match=message):
        jax.block_until_ready(call(jnp.zeros((2, 4), jnp.float32), w))


@pytest.mark.skipif(not gdn_jax.native_available(), reason="native extension not built")
def test_packed_handler_refuses_bad_parts():
    """gdn_jax_linear_packed with several parts: counts, dtypes and shapes, the part named."""
    from gdn_jax._ffi import TARGET_PREFIX
    x = jnp.zeros((2, 4), jnp.bfloat16)
    w = jnp.zeros((1, 2, 16, 2), jnp.bfloat16)
    f32, bf16 = (jax.ShapeDtypeStruct((2, 3), t) for t in (jnp.float32, jnp.bfloat16))

    def run(outs, *ws):
        jax.block_until_ready(jax.ffi.ffi_call(TARGET_PREFIX + "linear_packed", outs)(x, *ws))
    with pytest.raises(Exception, match="needs 1 to 8 packed w and as many results, got 2 w and 1 results"):
        run([f32], w, w)
    with pytest.raises(Exception, match="needs 1 to 8 packed w and as many results, got 9 w"):
        run([f32] * 9, *[w] * 9)
    with pytest.raises(Exception, match=r"every result must have the first one's dtype \(result 1\)"):
        run([f32, bf16], w, w)
    with pytest.raises(Exception, match=r"the packed w 1 must be \[ceil\(out / 16\)"):
        run([f32, f32], w, jnp.zeros((2, 2, 16, 2), jnp.bfloat16))
    with pytest.raises(Exception, match="the result 1 must be \\[T, out\\] with T = 2"):
        run([f32, jax.ShapeDtypeStruct((3, 3), jnp.float32)], w, w)


@pytest.mark.parametrize("impl", ["native", "reference"])
@pytest.mark.parametrize("packed", [False, True], ids=["plain", "packed"])
def test_no_tokens(impl, packed):
    """T = 0 gives [0, out] on every path (the packed reference's reshape(T, -1) had divided by 0)."""
    w = jnp.ones((8, 12), jnp.bfloat16)
    w = pack_linear_weight(w) if packed else w
    x = jnp.zeros((0, 12), jnp.bfloat16)
    assert linear(x, w, impl=impl).shape == (0, 8)
    assert [y.shape for y in merged_linear(x, [w, w], impl=impl)] == [(0, 8), (0, 8)]
