"""Eager (un-jitted) calls of every public op and serving step compile once per static
configuration, and the process's memory mappings stay flat (issue 21: the reference path's
``lax.cond`` compiled a new program on every eager call, ~45 mappings each, until the
process hit the kernel's mapping limit and crashed).

Default: 100 calls per (op, impl), every 10th a refused batch that must raise
InvalidBatchError; ``-m slow`` / GDN_JAX_SLOW=1: 2,000 calls.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gdn_jax
from gdn_jax import ops
from gdn_jax.batch import Request, build_batch
from gdn_jax.config import GDNCache, GDNParams
from serve_helpers import SMALL_CFG, SMALL_N, SMALL_S, SMALL_T, compile_counter, mapping_count, random_inputs

IMPLS = ["reference", pytest.param("native", marks=pytest.mark.skipif(not gdn_jax.native_available(),
                                                                          reason="native extension not built"))]
T, H, K, HV, V, N, W = 4, 1, 16, 2, 16, 6, 4
D = 2 * H * K + HV * V
WARMUP = 12            # calls before the counts are taken (first compile, lazy imports, thread pools)
MAPS_SLACK = 8         # allocator arenas and thread stacks may add a few; the leak added ~45 a call


def _arrays():
    rng = np.random.default_rng(0)
    f = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32)  # noqa: E731
    return dict(q=f(T, H, K), k=f(T, H, K), v=f(T, HV, V), x=f(T, D), w=f(D, W), a=f(T, HV), b=f(T, HV),
                A_log=f(HV), dt_bias=f(HV), conv=f(N, W - 1 + 2, D), ssm=f(N, HV, K, V))


def _op_calls(impl):
    """{op name: call(bad) -> caches}; ``bad`` names a slot twice (the op must raise)."""
    A = _arrays()
    qsl = jnp.asarray([0, 1, 3, 4], jnp.int32)
    hist = jnp.asarray([True, False, True])
    rule = dict(A_log=A["A_log"], dt_bias=A["dt_bias"], impl=impl)

    def idx(bad, good):
        return jnp.asarray([good[0]] * len(good) if bad else good, jnp.int32)

    def gating(bad):
        return ops.fused_gdn_gating(A["a"], A["b"], **rule)

    def conv_fwd(bad):
        return ops.causal_conv1d_fwd(A["x"], weight=A["w"], bias=None, conv_state=A["conv"], query_start_loc=qsl,
                                     state_indices=idx(bad, [0, 2, 4]), has_initial_state=hist,
                                     activation="silu", impl=impl)

    def conv_update(bad):
        return ops.causal_conv1d_update(A["x"], weight=A["w"], bias=A["x"][0], conv_state=A["conv"],
                                        state_indices=idx(bad, [0, 2, 4, 5]), activation=None,
                                        conv_state_layout="SD", impl=impl)

    def conv_update_spec(bad):
        return ops.causal_conv1d_update(A["x"], weight=A["w"], bias=None, conv_state=A["conv"],
                                        state_indices=idx(bad, [0, 2, 4]), query_start_loc=qsl,
                                        num_accepted_tokens=jnp.asarray([1, 3, 2], jnp.int32), impl=impl)

    def chunk(bad):
        return ops.chunk_gated_delta_rule(A["q"], A["k"], A["v"], g=-jnp.abs(A["a"]), beta=jax.nn.sigmoid(A["b"]),
                                          ssm_state=A["ssm"], query_start_loc=qsl, state_indices=idx(bad, [0, 2, 4]),
                                          has_initial_state=hist, impl=impl)

    def recurrent(bad):
        return ops.fused_sigmoid_gating_delta_rule_update(A["q"], A["k"], A["v"], a=A["a"], b=A["b"],
                                                          ssm_state=A["ssm"], state_indices=idx(bad, [0, 1, 2, 3]),
                                                          scale=0.2, **rule)

    def recurrent_spec(bad):
        sidx = jnp.asarray([[0, -1, -1], [1, 2, -1], [1 if bad else 3, 4, 5]], jnp.int32)
        return ops.fused_sigmoid_gating_delta_rule_update_spec(
            A["q"], A["k"], A["v"], a=A["a"], b=A["b"], ssm_state=A["ssm"], query_start_loc=qsl,
            spec_state_indices=sidx, num_accepted_tokens=jnp.asarray([1, 2, 1], jnp.int32), l2norm_eps=1e-5, **rule)

    def copy_slots(bad):
        return ops.copy_slots(A["ssm"], src=jnp.asarray([1, 3], jnp.int32), dst=idx(bad, [0, 2]), impl=impl)

    return dict(gating=gating, conv_fwd=conv_fwd, conv_update=conv_update, conv_update_spec=conv_update_spec,
                chunk=chunk, recurrent=recurrent, recurrent_spec=recurrent_spec, copy_slots=copy_slots)


def _step_calls(impl):
    """The serving steps (functional forms and GDNAttention methods) and commit_accepted."""
    cfg = SMALL_CFG
    params = GDNParams.random(cfg, jax.random.PRNGKey(0))
    reqs = [Request.prefill(0, 3), Request.decode(1), Request.spec((2, 3, 4), 2, num_accepted=2)]
    build = lambda: build_batch(reqs, num_slots=SMALL_N, num_spec=2, token_bucket=SMALL_T,  # noqa: E731
                                row_bucket=SMALL_S)
    hb, bad = build(), build()
    bad.metadata.state_indices[1, 0] = bad.metadata.state_indices[0, 0]
    x, b, a = (jnp.asarray(v) for v in random_inputs(cfg, SMALL_T, np.random.default_rng(1)))
    state = dict(cache=GDNCache.create(cfg, SMALL_N))
    pad = [[-1] * 3] * (SMALL_S - 2)
    sidx = np.array([[2, 3, 4], [-1] * 3] + pad, np.int32)
    bad_sidx = np.array([[2, 3, 4], [2, -1, -1]] + pad, np.int32)
    acc = np.array([2] + [1] * (SMALL_S - 1), np.int32)

    def run(fn):
        def call(is_bad):
            try:
                out, state["cache"] = fn(x, b, a, params, state["cache"], bad if is_bad else hb, config=cfg, impl=impl)
            except gdn_jax.InvalidBatchError as e:
                state["cache"] = e.caches
                raise
        return call

    def commit(is_bad):
        try:
            state["cache"] = gdn_jax.commit_accepted(state["cache"], bad_sidx if is_bad else sidx, acc, config=cfg,
                                                     impl=impl)
        except gdn_jax.InvalidBatchError as e:
            state["cache"] = e.caches
            raise

    return dict(gdn_attention_core=run(gdn_jax.gdn_attention_core), commit_accepted=commit)


def _hammer(call, calls, has_status):
    """Run ``call`` ``calls`` times (every 10th a refused batch when the op has one): the
    compile count and the number of memory mappings after the warm-up and at the end."""
    def one(i):
        bad = has_status and i % 10 == 9
        if bad:
            with pytest.raises(gdn_jax.InvalidBatchError, match="is also named by row"):
                call(True)
        else:
            jax.block_until_ready(call(False))

    for i in range(WARMUP):
        one(i)
    with compile_counter() as compiles:
        maps0 = mapping_count()
        for i in range(WARMUP, calls):
            one(i)
        maps1 = mapping_count()
    return compiles, maps0, maps1


def _check_flat(name, impl, calls):
    table = _op_calls(impl) | _step_calls(impl)
    compiles, maps0, maps1 = _hammer(table[name], calls, has_status=name != "gating")
    assert compiles == [], f"{name} ({impl}): {len(compiles)} compilations after warm-up: {compiles[:3]}"
    assert maps1 - maps0 <= MAPS_SLACK, f"{name} ({impl}): memory mappings grew {maps0} -> {maps1}"


NAMES = ["gating", "conv_fwd", "conv_update", "conv_update_spec", "chunk", "recurrent", "recurrent_spec",
         "copy_slots", "gdn_attention_core", "commit_accepted"]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("name", NAMES)
def test_eager_calls_compile_once(name, impl):
    _check_flat(name, impl, 100)


@pytest.mark.slow
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("name", NAMES)
def test_eager_calls_compile_once_2000(name, impl):
    _check_flat(name, impl, 2000)


def test_cache_keys_static_args():
    """One executable per static configuration: a new scale compiles once more, an equal
    scale given as a 0-d array does not, and the traced path still works inside jit."""
    A = _arrays()
    f = ops.fused_sigmoid_gating_delta_rule_update_with_status.jitted
    kw = dict(a=A["a"], b=A["b"], A_log=A["A_log"], dt_bias=A["dt_bias"], ssm_state=A["ssm"],
              state_indices=jnp.arange(T, dtype=jnp.int32), impl="reference")
    ops.fused_sigmoid_gating_delta_rule_update(A["q"], A["k"], A["v"], scale=0.125, **kw)
    n = f._cache_size()
    o1, _ = ops.fused_sigmoid_gating_delta_rule_update(A["q"], A["k"], A["v"], scale=np.float64(0.125), **kw)
    assert f._cache_size() == n
    ops.fused_sigmoid_gating_delta_rule_update(A["q"], A["k"], A["v"], scale=0.25, **kw)
    assert f._cache_size() == n + 1
    o2, _ = jax.jit(lambda q: ops.fused_sigmoid_gating_delta_rule_update(q, A["k"], A["v"], scale=0.125, **kw))(A["q"])
    # Two compilations of the same math (XLA fuses them differently): the f32 budget.
    np.testing.assert_allclose(np.asarray(o2), np.asarray(o1), rtol=1e-5, atol=1e-6)
