"""fused_gdn_gating: native (every ISA here) and reference against the float64 math."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gdn_jax
from f64_math import bf16_round, gating_f64, rel_rmse

ISAS = gdn_jax.available_isas()


def _inputs(rng, T, HV, dtype):
    a = rng.normal(size=(T, HV)) * 3.0
    b = rng.normal(size=(T, HV)) * 3.0
    a[0, 0] = 25.0  # softplus linear branch (x > 20)
    a[-1, -1] = -30.0  # deep negative: softplus ~ exp(x)
    if dtype == jnp.bfloat16:
        a, b = bf16_round(a), bf16_round(b)
    A_log = np.log(rng.uniform(1.0, 16.0, size=HV))
    dt_bias = rng.normal(size=HV) * 0.5
    return a, b, A_log, dt_bias


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("T,HV", [(7, 32), (33, 5), (1, 1), (64, 48)])
def test_native_matches_f64(isa, dtype, T, HV):
    rng = np.random.default_rng(T * 100 + HV)
    a, b, A_log, dt_bias = _inputs(rng, T, HV, dtype)
    ga, gb = gating_f64(a, b, A_log, dt_bias)
    with gdn_jax.use_isa(isa):
        fn = jax.jit(lambda a_, b_: gdn_jax.fused_gdn_gating(
            a_, b_, A_log=jnp.asarray(A_log, jnp.float32), dt_bias=jnp.asarray(dt_bias, jnp.float32), impl="native"))
        g, beta = fn(jnp.asarray(a, dtype), jnp.asarray(b, dtype))
    assert g.dtype == jnp.float32 and beta.dtype == jnp.float32
    # Inputs are exact in both dtypes, outputs f32: one f32 rounding of each result.
    assert rel_rmse(np.asarray(g), ga) <= 1e-6
    assert rel_rmse(np.asarray(beta), gb) <= 1e-6
    np.testing.assert_allclose(np.asarray(g), ga, rtol=2e-6, atol=1e-30)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_reference_matches_native(dtype):
    rng = np.random.default_rng(3)
    a, b, A_log, dt_bias = _inputs(rng, 20, 32, dtype)
    args = (jnp.asarray(a, dtype), jnp.asarray(b, dtype))
    kw = dict(A_log=jnp.asarray(A_log, jnp.float32), dt_bias=jnp.asarray(dt_bias, dtype))
    gn, bn = gdn_jax.fused_gdn_gating(*args, **kw, impl="native")
    gr, br = gdn_jax.fused_gdn_gating(*args, **kw, impl="reference")
    np.testing.assert_allclose(np.asarray(gn), np.asarray(gr), rtol=3e-6, atol=1e-30)
    np.testing.assert_allclose(np.asarray(bn), np.asarray(br), rtol=3e-6, atol=1e-30)


def test_vmap_broadcasts():
    rng = np.random.default_rng(4)
    a = jnp.asarray(rng.normal(size=(3, 5, 8)), jnp.float32)
    b = jnp.asarray(rng.normal(size=(3, 5, 8)), jnp.float32)
    A_log = jnp.zeros((8,), jnp.float32)
    dt = jnp.zeros((8,), jnp.float32)
    g, beta = jax.vmap(lambda x, y: gdn_jax.fused_gdn_gating(x, y, A_log=A_log, dt_bias=dt, impl="native"))(a, b)
    ga, gb = gating_f64(np.asarray(a).reshape(15, 8), np.asarray(b).reshape(15, 8), np.zeros(8), np.zeros(8))
    assert rel_rmse(np.asarray(g).reshape(15, 8), ga) <= 1e-6
    assert rel_rmse(np.asarray(beta).reshape(15, 8), gb) <= 1e-6


@pytest.mark.parametrize("mapped", ["a", "b", "a, A_log", "dt_bias", "a, b, nested"])
def test_vmap_of_some_arguments(mapped):
    """vmap over some of the arguments only: the unmapped a or b is broadcast, per-element A_log
    or dt_bias take one call each; native equals the reference, and float64 gates."""
    rng = np.random.default_rng(6)
    B, T, HV = 3, 5, 8
    full = {"a": rng.normal(size=(B, T, HV)), "b": rng.normal(size=(B, T, HV)),
            "A_log": rng.normal(size=(B, HV)), "dt_bias": rng.normal(size=(B, HV))}
    names = ("a", "b", "A_log", "dt_bias")
    axes = tuple(0 if n in mapped else None for n in names)
    args = [jnp.asarray(full[n] if n in mapped else full[n][0], jnp.float32) for n in names]
    if "nested" in mapped:
        args = [jnp.stack([x, 2 * x]) if ax == 0 else x for x, ax in zip(args, axes)]

    def f(impl):
        fn = jax.vmap(lambda a, b, al, dt: gdn_jax.fused_gdn_gating(a, b, A_log=al, dt_bias=dt, impl=impl),
                      in_axes=axes)
        return jax.jit(jax.vmap(fn, in_axes=axes) if "nested" in mapped else fn)(*args)

    (gn, bn), (gr, br) = f("native"), f("reference")
    np.testing.assert_allclose(np.asarray(gn), np.asarray(gr), rtol=3e-6, atol=1e-30)
    np.testing.assert_allclose(np.asarray(bn), np.asarray(br), rtol=3e-6, atol=1e-30)
    if "nested" not in mapped:
        for i in range(B):
            ga, gb = gating_f64(*(np.asarray(full[n][i] if n in mapped else full[n][0], np.float32) for n in names))
            assert rel_rmse(np.asarray(gn[i]), ga) <= 1e-6 and rel_rmse(np.asarray(bn[i]), gb) <= 1e-6


@pytest.mark.parametrize("isa", ISAS)
def test_bf16_head_params(isa):
    """A_log and dt_bias in bf16 (as a bf16 model stores them) are read unconverted: the same
    bits as f32 arrays of the same values, and the float64 gates of those values."""
    rng = np.random.default_rng(5)
    a, b, A_log, dt_bias = _inputs(rng, 9, 32, jnp.bfloat16)
    A_log, dt_bias = bf16_round(A_log), bf16_round(dt_bias)
    ga, gb = gating_f64(a, b, A_log, dt_bias)
    args = (jnp.asarray(a, jnp.bfloat16), jnp.asarray(b, jnp.bfloat16))
    outs = {}
    with gdn_jax.use_isa(isa):
        for pa, pd in [(jnp.float32, jnp.float32), (jnp.bfloat16, jnp.bfloat16), (jnp.float32, jnp.bfloat16)]:
            fn = jax.jit(lambda a_, b_, A, d: gdn_jax.fused_gdn_gating(a_, b_, A_log=A, dt_bias=d, impl="native"))
            outs[(pa, pd)] = fn(*args, jnp.asarray(A_log, pa), jnp.asarray(dt_bias, pd))
    g32, b32 = outs[(jnp.float32, jnp.float32)]
    assert rel_rmse(np.asarray(g32), ga) <= 1e-6 and rel_rmse(np.asarray(b32), gb) <= 1e-6
    for key, (g, beta) in outs.items():
        np.testing.assert_array_equal(np.asarray(g), np.asarray(g32), err_msg=f"g with params {key}")
        np.testing.assert_array_equal(np.asarray(beta), np.asarray(b32), err_msg=f"beta with params {key}")
