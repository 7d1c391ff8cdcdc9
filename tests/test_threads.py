"""Several Python threads running serving steps at once, each on its own cache, give
bit-for-bit the results of the same work run by one thread (the kernels are deterministic
whatever the thread count; the jitted steps and the eager ops are shared between threads).
"""
from __future__ import annotations

import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gdn_jax import ops
from gdn_jax.batch import Request, build_batch
from gdn_jax.config import GDNCache, GDNParams
from gdn_jax import paths
from serve_helpers import IMPLS, SMALL_CFG, SMALL_N, SMALL_S, SMALL_T, impl_context, random_inputs

CFG, T, S, N = SMALL_CFG, SMALL_T, SMALL_S, SMALL_N
THREADS = 4
ROUNDS = 2


def _work(impl, seed):
    """One worker's session on its own cache: prefills, decodes, a spec step, a commit, and an
    eager op call. Returns every output and the final pools as NumPy arrays."""
    rng = np.random.default_rng(seed)
    attn = paths._attention(CFG, impl)
    params = GDNParams.random(CFG, jax.random.PRNGKey(seed))
    cache = GDNCache.create(CFG, N)
    outs = []

    def step(reqs, kind="gdn_attention_core"):
        nonlocal cache
        hb = build_batch(reqs, num_slots=N, num_spec=CFG.num_spec, token_bucket=T, row_bucket=S)
        x, b, a = (jnp.asarray(v) for v in random_inputs(CFG, T, rng))
        out, cache = getattr(attn, kind)(x, b, a, params, cache, hb)
        outs.append(np.asarray(out))

    for _ in range(ROUNDS):
        step([Request.prefill(0, int(rng.integers(1, 9))), Request.prefill(3, int(rng.integers(1, 7)))])
        for _ in range(2):
            step([Request.decode(0), Request.decode(3)], "decode")
        step([Request.spec((0, 1, 2), 3, num_accepted=1), Request.decode(3)])
        step([Request.spec((0, 1, 2), 2, num_accepted=3), Request.prefill(5, 7)])
        cache = attn.commit_accepted(cache, np.array([[0, 1, 2]] + [[-1] * 3] * (S - 1), np.int32),
                                     np.array([2] + [1] * (S - 1), np.int32))
        q = jnp.asarray(rng.standard_normal((2, CFG.H, CFG.K)), jnp.float32)
        v = jnp.asarray(rng.standard_normal((2, CFG.HV, CFG.V)), jnp.float32)
        ab = jnp.asarray(rng.standard_normal((2, CFG.HV)), jnp.float32)
        o, ssm = ops.fused_sigmoid_gating_delta_rule_update(
            q, q, v, a=ab, b=ab, A_log=params.A_log, dt_bias=params.dt_bias, ssm_state=cache.ssm_state,
            state_indices=jnp.asarray([6, 7], jnp.int32), impl=impl)
        cache = GDNCache(conv_state=cache.conv_state, ssm_state=ssm)
        outs.append(np.asarray(o))
    return outs + [np.asarray(cache.conv_state), np.asarray(cache.ssm_state)]


@pytest.mark.parametrize("impl_isa", IMPLS[:2])
def test_threads_match_one_thread(impl_isa):
    with impl_context(impl_isa) as impl:
        alone = [_work(impl, seed) for seed in range(THREADS)]
        results, errors = [None] * THREADS, []
        start = threading.Barrier(THREADS)

        def worker(i):
            try:
                start.wait()
                results[i] = _work(impl, i)
            except BaseException as e:  # reported below, in the test's thread
                errors.append(e)

        threads = [threading.Thread(target=worker, args=(i,)) for i in range(THREADS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=600)
        assert not any(t.is_alive() for t in threads), "a worker thread hangs"
    assert not errors, errors
    for i in range(THREADS):
        assert len(results[i]) == len(alone[i])
        for j, (got, want) in enumerate(zip(results[i], alone[i])):
            assert got.tobytes() == want.tobytes(), f"thread {i}, result {j} differs from the one-thread run"
