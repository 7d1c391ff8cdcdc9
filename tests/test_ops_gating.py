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
