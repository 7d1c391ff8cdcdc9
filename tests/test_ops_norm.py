"""gated_rms_norm (the layer's norm per value head): native (every ISA here) and reference against
float64, against transformers' Qwen3NextRMSNormGated, and against each other."""
import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gdn_jax
from f64_math import bf16_round, gated_norm_f64, rel_rmse
from gdn_jax.ops import gated_rms_norm

ISAS = gdn_jax.available_isas()
IMPLS = ["reference"] + ISAS


def _run(impl_isa, o, z, w, eps=1e-6):
    impl = "reference" if impl_isa == "reference" else "native"
    fn = jax.jit(lambda o_, z_, w_: gated_rms_norm(o_, z_, weight=w_, eps=eps, impl=impl))
    with contextlib.nullcontext() if impl_isa == "reference" else gdn_jax.use_isa(impl_isa):
        return fn(o, z, w)


def _inputs(rng, shape, dtype):
    # heads at several scales, one small enough for eps to matter
    scale = np.array([1e-3, 0.1, 1.0, 3.0])[np.arange(np.prod(shape[:-1])) % 4].reshape(shape[:-1] + (1,))
    o = bf16_round(rng.standard_normal(shape) * scale)
    z = bf16_round(rng.standard_normal(shape) * 3.0)
    w = bf16_round(1 + 0.3 * rng.standard_normal(shape[-1]))
    return tuple(jnp.asarray(x, dtype) for x in (o, z, w)), (o, z, w)


@pytest.mark.parametrize("impl_isa", IMPLS)
# [T, HV, V] at V = 128 (whole vectors) and 40 (a tail), one row, and more leading dims
@pytest.mark.parametrize("shape", [(7, 4, 128), (5, 3, 40), (1, 1, 16), (2, 3, 2, 32)])
def test_f32_matches_f64(impl_isa, shape):
    (o, z, w), (o64, z64, w64) = _inputs(np.random.default_rng(len(shape) + shape[-1]), shape, jnp.float32)
    got = _run(impl_isa, o, z, w)
    assert got.dtype == jnp.float32 and got.shape == shape
    assert rel_rmse(np.asarray(got, np.float64), gated_norm_f64(o64, z64, w64, 1e-6)) <= 1e-6


@pytest.mark.parametrize("impl_isa", ISAS)
@pytest.mark.parametrize("shape", [(64, 4, 128), (9, 3, 40)])
def test_bf16_native_matches_reference(impl_isa, shape):
    """The same casts in the same places: equal but where the f32 row scale (its sum order,
    rsqrt) moves n across a bf16 rounding boundary (measured: none here, 5.6e-6 of the outputs
    at [2048, 32, 128], at most 2 steps, the second from m's rounding)."""
    (o, z, w), (o64, z64, w64) = _inputs(np.random.default_rng(shape[-1]), shape, jnp.bfloat16)
    got = np.asarray(_run(impl_isa, o, z, w), np.float32)
    want = np.asarray(_run("reference", o, z, w), np.float32)
    steps = np.abs(got.view(np.int32) - want.view(np.int32)) >> 16
    assert np.all(steps <= 2) and np.mean(steps > 0) <= 1e-3
    # three bf16 roundings (n, weight * n, the output) against the exact norm
    assert rel_rmse(got.astype(np.float64), gated_norm_f64(o64, z64, w64, 1e-6)) <= 4e-3


@pytest.mark.parametrize("impl_isa", IMPLS)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_matches_transformers(impl_isa, dtype):
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextRMSNormGated

    (o, z, w), (o64, z64, w64) = _inputs(np.random.default_rng(1), (16, 4, 32), jnp.dtype(dtype))
    tdt = getattr(torch, dtype)
    mod = Qwen3NextRMSNormGated(32, eps=1e-6).to(tdt)
    with torch.no_grad():
        mod.weight.copy_(torch.from_numpy(w64.astype(np.float32)))
        want = mod(torch.from_numpy(o64.astype(np.float32)).to(tdt),
                   torch.from_numpy(z64.astype(np.float32)).to(tdt)).float().numpy()
    got = np.asarray(_run(impl_isa, o, z, w), np.float32)
    if dtype == "float32":
        assert rel_rmse(got.astype(np.float64), want.astype(np.float64)) <= 1e-6
    else:   # the same casts in the same places: equal but for a rare one-step rsqrt difference
        assert np.mean(got != want) <= 0.01
        assert rel_rmse(got.astype(np.float64), want.astype(np.float64)) <= 1e-3


def test_weight_cast_to_o_dtype():
    """An f32 weight with bf16 o is cast first, as the reference does (weight.astype(o.dtype))."""
    (o, z, w), _ = _inputs(np.random.default_rng(3), (4, 2, 32), jnp.bfloat16)
    w32 = jnp.asarray(np.asarray(w, np.float32) + 1e-3, jnp.float32)   # not bf16-exact
    for impl_isa in IMPLS:
        got = _run(impl_isa, o, z, w32)
        np.testing.assert_array_equal(np.asarray(got, np.float32),
                                      np.asarray(_run(impl_isa, o, z, w32.astype(jnp.bfloat16)), np.float32))


@pytest.mark.parametrize("impl", ["native", "reference"])
def test_errors_name_the_argument(impl):
    o = jnp.zeros((2, 3, 16), jnp.bfloat16)
    with pytest.raises(ValueError, match=r"o must be \[\.\.\., V\]"):
        gated_rms_norm(jnp.zeros((), jnp.float32), o, weight=o[0, 0], eps=1e-6, impl=impl)
    with pytest.raises(TypeError, match="o must have dtype"):
        gated_rms_norm(o.astype(jnp.int32), o, weight=o[0, 0], eps=1e-6, impl=impl)
    with pytest.raises(ValueError, match="z must be o's shape"):
        gated_rms_norm(o, o[:1], weight=o[0, 0], eps=1e-6, impl=impl)
    with pytest.raises(TypeError, match="z must have"):
        gated_rms_norm(o, o.astype(jnp.float32), weight=o[0, 0], eps=1e-6, impl=impl)
    with pytest.raises(ValueError, match=r"weight must be \[V\], V the last dim of o = \(16,\)"):
        gated_rms_norm(o, o, weight=o[0], eps=1e-6, impl=impl)
    with pytest.raises(ValueError, match="eps must be > 0"):
        gated_rms_norm(o, o, weight=o[0, 0], eps=0.0, impl=impl)


@pytest.mark.skipif(not gdn_jax.native_available(), reason="native extension not built")
def test_handler_refuses_bad_buffers():
    """The FFI handler checks what ops.gated_rms_norm checks first (a direct ffi_call bypasses it)."""
    from gdn_jax._ffi import TARGET_PREFIX
    o = jnp.zeros((2, 16), jnp.float32)

    def run(out, *args, eps=1e-6):
        call = jax.ffi.ffi_call(TARGET_PREFIX + "gated_rms_norm", out)
        jax.block_until_ready(call(*args, eps=np.float32(eps)))
    sds = jax.ShapeDtypeStruct
    with pytest.raises(Exception, match="o, z, weight and the result must have one dtype"):
        run(sds((2, 16), jnp.float32), o, o, o[0].astype(jnp.bfloat16))
    with pytest.raises(Exception, match=r"z and the result must be o's shape \[2, 16\]"):
        run(sds((2, 16), jnp.float32), o, o[:1], o[0])
    with pytest.raises(Exception, match=r"weight must be \[V\] = \[16\]"):
        run(sds((2, 16), jnp.float32), o, o, o[0, :8])
    with pytest.raises(Exception, match="eps must be > 0"):
        run(sds((2, 16), jnp.float32), o, o, o[0], eps=0.0)
