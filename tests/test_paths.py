"""Serving steps (gdn_jax.paths): semantics against the float64 oracle, path equivalences,
one executable per bucket, in-place updates, and bad batches that leave the cache intact.

Every test runs on ``impl="reference"`` and on the native kernels of every available ISA
(see serve_helpers.IMPLS for the switch that turns the native params on).
"""
from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gdn_jax
from gdn_jax.batch import PAD_SLOT_ID, ROW_PREFILL, ROW_SPEC, BatchMetadata, Request, build_batch
from gdn_jax.config import GDNCache, GDNConfig, GDNParams
from gdn_jax.paths import STEP_KINDS, GDNAttention
from gdn_jax import paths
from serve_helpers import (IMPLS, IMPLS_STRUCTURAL, budget, cache_bits, impl_context, oracle_sequence,
                           oracle_step, random_inputs, rel_rmse, to_np64)

F32, BF16 = jnp.float32, jnp.bfloat16

# Tiny shapes: D = 2*H*K + HV*V.
CFG = GDNConfig(1, 2, 16, 16, num_spec=3, act_dtype=F32)                       # D = 64, L = 6
CFG0 = GDNConfig(1, 2, 16, 16, num_spec=0, act_dtype=F32)                      # spec off, L = 3
CFG_X = GDNConfig(2, 4, 16, 32, num_spec=2, act_dtype=BF16, conv_state_layout="DS")   # GQA, bf16, DS
CFG_BS = GDNConfig(1, 2, 32, 16, num_spec=1, act_dtype=BF16, state_dtype=BF16, conv_width=3)
T, S, N = 72, 6, 24          # token bucket (> one 64-token chunk), row bucket, pool slots



def attention(cfg, impl) -> GDNAttention:
    """The GDNAttention the functional forms use (one per (config, impl)): compilations are shared."""
    return paths._attention(cfg, impl)


def _params(cfg, seed=0):
    return GDNParams.random(cfg, jax.random.PRNGKey(seed), conv_bias=cfg is CFG_X)


def garbage_cache(cfg, rng, n=N, nan_slots=()):
    """A cache full of stale contents (random; NaN in ``nan_slots``)."""
    conv = rng.standard_normal(cfg.conv_state_shape(n)).astype(np.float32)
    ssm = (0.3 * rng.standard_normal(cfg.ssm_state_shape(n))).astype(np.float32)
    for s in nan_slots:
        conv[s] = np.nan
        ssm[s] = np.nan
    # Through a jitted cast so that the pools are XLA-owned buffers (an array made from NumPy
    # memory may alias it, and such a buffer cannot be donated).
    own = jax.jit(lambda c, s: (c.astype(cfg.act_dtype) * 1, s.astype(cfg.state_dtype) * 1))
    conv, ssm = own(conv, ssm)
    return GDNCache(conv_state=conv, ssm_state=ssm)


class Engine:
    """A cache, params and a GDNAttention; runs steps from per-request inputs."""

    def __init__(self, cfg, impl, *, seed=0, cache=None, n=N, t=T, s=S):
        self.cfg, self.impl, self.n, self.t, self.s = cfg, impl, n, t, s
        self.attn = attention(cfg, impl)
        self.params = _params(cfg)
        self.cache = GDNCache.create(cfg, n) if cache is None else cache

    def build(self, reqs):
        return build_batch(reqs, num_slots=self.n, num_spec=self.cfg.num_spec, token_bucket=self.t,
                           row_bucket=self.s)

    def step(self, reqs, per_req, path="gdn_attention_core", check=None):
        """per_req: list of (x, b, a) per request. Returns (hb, [out_i], (x, b, a) packed)."""
        hb = self.build(reqs)
        x, b, a = (hb.pack([p[j] for p in per_req]) if reqs else
                   np.zeros((self.t,) + shape, self.cfg.act_dtype)
                   for j, shape in enumerate([(self.cfg.D,), (self.cfg.HV,), (self.cfg.HV,)]))
        pre = cache_bits(self.cache) if check else None
        out, self.cache = getattr(self.attn, path)(jnp.asarray(x), jnp.asarray(b), jnp.asarray(a), self.params,
                                                   self.cache, hb)
        out = np.asarray(out)
        if check:
            check_against_oracle(self.cfg, self.params, pre, hb, x, b, a, out, self.cache, impl=self.impl)
        return hb, hb.unpack(out), (x, b, a)

    def commit(self, rows):
        """rows: list of (slots tuple, acc)."""
        idx = np.full((self.s, self.cfg.spec_cols), PAD_SLOT_ID, np.int32)
        acc = np.ones((self.s,), np.int32)
        for r, (slots, a) in enumerate(rows):
            idx[r] = slots
            acc[r] = a
        self.cache = self.attn.commit_accepted(self.cache, idx, acc)


def _bits_equal(a, b) -> bool:
    a, b = np.asarray(a), np.asarray(b)
    return a.shape == b.shape and a.dtype == b.dtype and a.tobytes() == b.tobytes()


def check_against_oracle(cfg, params, pre, hb, x, b, a, out, cache, impl=None):
    """One step vs the float64 oracle: outputs per request within budget, padding tokens
    zero, conv pool exact, SSM slots written within budget, every other slot bit-identical.
    ``impl``: the implementation whose conv outputs feed the oracle's recurrence (bf16)."""
    pre_conv, pre_ssm = pre
    ref_out, ref_conv, ref_ssm = oracle_step(cfg, params, to_np64(pre_conv), to_np64(pre_ssm), hb.requests,
                                             hb.token_slices, x, b, a, conv_impl=impl,
                                             conv_pool=jnp.asarray(pre_conv))
    out64 = to_np64(out)
    assert not np.any(out64[hb.num_tokens:]), "bucket padding tokens must give zero output"
    for i, (rq, (lo, hi)) in enumerate(zip(hb.requests, hb.token_slices)):
        err = rel_rmse(out64[lo:hi], ref_out[lo:hi])
        assert err <= budget(cfg, "out"), f"request {i} ({rq.kind}, n={hi - lo}): output rel rmse {err:.2e}"
    conv = np.asarray(cache.conv_state)
    np.testing.assert_array_equal(to_np64(conv), ref_conv, err_msg="conv pool differs from the oracle")
    ssm = np.asarray(cache.ssm_state)
    written = {}
    for rq, (lo, hi) in zip(hb.requests, hb.token_slices):
        slots = tuple(rq.slots)
        if rq.kind == "spec":
            for t in range(hi - lo):
                written[slots[t]] = "state_decode"
        else:
            written[slots[0]] = "state_prefill" if rq.kind == "prefill" else "state_decode"
    for s_ in range(ssm.shape[0]):
        if s_ in written:
            err = rel_rmse(to_np64(ssm[s_]), ref_ssm[s_])
            assert err <= budget(cfg, written[s_]), f"slot {s_}: state rel rmse {err:.2e}"
        else:
            assert _bits_equal(ssm[s_], pre_ssm[s_]), f"slot {s_} is not named but changed"
            assert _bits_equal(conv[s_], pre_conv[s_]), f"slot {s_} is not named but its conv state changed"


def _inputs(cfg, rng, reqs):
    return [random_inputs(cfg, r.num_tokens, rng) for r in reqs]


# --- config / params / cache ----------------------------------------------------------------


def test_config_validation_and_derived():
    assert (CFG.D, CFG.L, CFG.G, CFG.spec_cols) == (64, 6, 2, 4)
    assert (CFG_X.D, CFG_X.L) == (2 * 2 * 16 + 4 * 32, 5)
    assert hash(CFG) == hash(GDNConfig(1, 2, 16, 16, num_spec=3, act_dtype="float32"))
    assert jax.tree_util.tree_leaves(CFG) == []
    for kw, msg in [(dict(num_v_heads=3), "num_v_heads=3 must be a multiple of num_k_heads=2"),
                    (dict(head_k_dim=20), "head_k_dim must be a multiple of 16"),
                    (dict(conv_width=5), "conv_width must be 2, 3 or 4"),
                    (dict(num_spec=-1), "num_spec must be an int >= 0"),
                    (dict(conv_state_layout="TD"), "conv_state_layout must be 'SD'"),
                    (dict(activation="gelu"), "activation must be 'silu' or None"),
                    (dict(l2norm_eps=0.0), "l2norm_eps must be > 0")]:
        args = dict(num_k_heads=2, num_v_heads=4, head_k_dim=16, head_v_dim=16)
        args.update(kw)
        with pytest.raises(ValueError, match=msg):
            GDNConfig(**args)
    with pytest.raises(TypeError, match="state_dtype must be float32 or bfloat16, got float16"):
        GDNConfig(1, 1, 16, 16, state_dtype=jnp.float16)


def test_params_and_cache_shapes():
    p = GDNParams.random(CFG_X, jax.random.PRNGKey(0), conv_bias=True)
    assert p.A_log.shape == (4,) and p.A_log.dtype == jnp.float32
    assert p.conv_weight.shape == (CFG_X.D, 4) and p.conv_weight.dtype == jnp.bfloat16
    assert p.conv_bias.shape == (CFG_X.D,)
    A = np.exp(np.asarray(p.A_log))
    assert np.all((A >= 1) & (A <= 16))
    dt = np.log1p(np.exp(np.asarray(p.dt_bias, np.float32)))
    assert np.all((dt > 0.9e-3) & (dt < 0.11))
    assert len(jax.tree_util.tree_leaves(p)) == 4
    assert len(jax.tree_util.tree_leaves(GDNParams.random(CFG, jax.random.PRNGKey(0)))) == 3
    c = GDNCache.create(CFG_X, 5)
    assert c.conv_state.shape == (5, CFG_X.D, CFG_X.L) and c.conv_state.dtype == jnp.bfloat16
    assert c.ssm_state.shape == (5, 4, 16, 32) and c.ssm_state.dtype == jnp.float32
    assert c.num_slots == 5
    with pytest.raises(ValueError, match=r"GDNParams.conv_weight must have shape \(64, 4\)"):
        GDNParams(A_log=p.A_log[:2], dt_bias=p.dt_bias[:2], conv_weight=p.conv_weight).validate(CFG)
    with pytest.raises(ValueError, match="GDNParams.A_log must have shape"):
        p.validate(CFG)


# --- semantics against the oracle -------------------------------------------------------------


def _mixed_requests(cfg, rng):
    """A step with every row kind (prefill fresh and continued, decode, ragged spec rows)."""
    C = cfg.spec_cols
    slots = list(rng.permutation(N))
    take = lambda k: tuple(int(slots.pop()) for _ in range(k))  # noqa: E731
    reqs = [Request.prefill(take(1)[0], 9), Request.prefill(take(1)[0], 5, has_initial_state=True),
            Request.decode(take(1)[0])]
    if cfg.num_spec:
        reqs += [Request.spec(take(C), C, num_accepted=C), Request.spec(take(C), 1, num_accepted=2)]
    return reqs


@pytest.mark.parametrize("impl_isa", IMPLS)
@pytest.mark.parametrize("cfg", [CFG, CFG_X, CFG0, CFG_BS], ids=["f32-spec3", "bf16-gqa-DS-bias", "f32-nospec",
                                                                 "bf16state-W3"])
def test_mixed_step_matches_oracle(impl_isa, cfg):
    rng = np.random.default_rng(1)
    with impl_context(impl_isa) as impl:
        eng = Engine(cfg, impl, cache=garbage_cache(cfg, rng))
        for _ in range(2):
            reqs = _mixed_requests(cfg, rng)
            eng.step(reqs, _inputs(cfg, rng, reqs), check=True)


@pytest.mark.parametrize("impl_isa", IMPLS)
@pytest.mark.parametrize("path", ["prefill", "decode", "spec_decode"])
def test_specialised_paths_match_oracle_and_mixed(impl_isa, path):
    rng = np.random.default_rng(2)
    if path == "prefill":
        reqs = [Request.prefill(3, 20), Request.prefill(7, 1, has_initial_state=True), Request.prefill(11, 30)]
    elif path == "decode":
        reqs = [Request.decode(s) for s in (5, 2, 19, 0)]
    else:
        reqs = [Request.spec((1, 2, 3, 4), 4, num_accepted=3), Request.decode(9),
                Request.spec((10, 11, 12, 13), 2, num_accepted=1)]
    inputs = _inputs(CFG, rng, reqs)
    cache0 = garbage_cache(CFG, np.random.default_rng(3))
    with impl_context(impl_isa) as impl:
        a = Engine(CFG, impl, cache=cache0)
        _, out_a, _ = a.step(reqs, inputs, path=path, check=True)
        b = Engine(CFG, impl, cache=garbage_cache(CFG, np.random.default_rng(3)))
        _, out_b, _ = b.step(reqs, inputs, path="gdn_attention_core")
    for oa, ob in zip(out_a, out_b):
        np.testing.assert_allclose(oa, ob, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(np.asarray(a.cache.ssm_state), np.asarray(b.cache.ssm_state), rtol=1e-6, atol=1e-7)
    np.testing.assert_array_equal(np.asarray(a.cache.conv_state), np.asarray(b.cache.conv_state))


@pytest.mark.parametrize("impl_isa", IMPLS)
def test_stale_slot_reuse_equals_fresh(impl_isa):
    """A prefill without initial state ignores the slot's old contents, even NaN."""
    rng = np.random.default_rng(4)
    reqs = [Request.prefill(5, 17), Request.prefill(6, 3)]
    inputs = _inputs(CFG, rng, reqs)
    with impl_context(impl_isa) as impl:
        fresh = Engine(CFG, impl)
        _, out_f, _ = fresh.step(reqs, inputs)
        stale = Engine(CFG, impl, cache=garbage_cache(CFG, rng, nan_slots=(5,)))
        _, out_s, _ = stale.step(reqs, inputs)
    for a, b in zip(out_f, out_s):
        assert _bits_equal(a, b)
    for s_ in (5, 6):
        assert _bits_equal(fresh.cache.ssm_state[s_], stale.cache.ssm_state[s_])
        assert _bits_equal(fresh.cache.conv_state[s_, :CFG.W - 1], stale.cache.conv_state[s_, :CFG.W - 1])


@pytest.mark.parametrize("impl_isa", IMPLS)
@pytest.mark.parametrize("cfg,path", [(CFG0, "decode"), (CFG, "decode"), (CFG, "gdn_attention_core"),
                                      (CFG, "spec_decode")])
def test_prefill_then_decode_equals_longer_prefill(impl_isa, cfg, path):
    rng = np.random.default_rng(5)
    n = 13
    x, b, a = random_inputs(cfg, n + 1, rng)
    with impl_context(impl_isa) as impl:
        one = Engine(cfg, impl)
        _, [o_one], _ = one.step([Request.prefill(4, n + 1)], [(x, b, a)])
        two = Engine(cfg, impl)
        _, [o_p], _ = two.step([Request.prefill(4, n)], [(x[:n], b[:n], a[:n])])
        _, [o_d], _ = two.step([Request.decode(4)], [(x[n:], b[n:], a[n:])], path=path)
    ref_out, ref_conv, ref_ssm = oracle_sequence(cfg, one.params, x, b, a)
    got = np.concatenate([o_p, o_d])
    assert rel_rmse(got, o_one) <= budget(cfg, "out")
    assert rel_rmse(o_d, o_one[n:]) <= budget(cfg, "out")
    assert rel_rmse(got, ref_out) <= budget(cfg, "out")
    assert rel_rmse(two.cache.ssm_state[4], one.cache.ssm_state[4]) <= budget(cfg, "state_prefill")
    assert rel_rmse(two.cache.ssm_state[4], ref_ssm) <= budget(cfg, "state_prefill")
    W1 = cfg.W - 1
    assert _bits_equal(two.cache.conv_state[4, :W1], one.cache.conv_state[4, :W1])


@pytest.mark.parametrize("impl_isa", IMPLS)
def test_chunked_prefill_continuation_equals_one_prefill(impl_isa):
    rng = np.random.default_rng(6)
    cuts = [0, 40, 41, 70]       # chunks of 40, 1 and 29 tokens; the whole crosses the 64-token chunk
    x, b, a = random_inputs(CFG, cuts[-1], rng)
    with impl_context(impl_isa) as impl:
        one = Engine(CFG, impl)
        _, [o_one], _ = one.step([Request.prefill(2, cuts[-1])], [(x, b, a)], path="prefill")
        ch = Engine(CFG, impl, cache=garbage_cache(CFG, rng))
        outs = []
        for i in range(3):
            lo, hi = cuts[i], cuts[i + 1]
            _, [o], _ = ch.step([Request.prefill(2, hi - lo, has_initial_state=i > 0)],
                                [(x[lo:hi], b[lo:hi], a[lo:hi])], path="prefill")
            outs.append(o)
    ref_out, _, ref_ssm = oracle_sequence(CFG, one.params, x, b, a)
    assert rel_rmse(np.concatenate(outs), o_one) <= budget(CFG, "out")
    assert rel_rmse(np.concatenate(outs), ref_out) <= budget(CFG, "out")
    assert rel_rmse(ch.cache.ssm_state[2], ref_ssm) <= budget(CFG, "state_prefill")
    assert _bits_equal(ch.cache.conv_state[2, :3], one.cache.conv_state[2, :3])


# --- speculative decoding ----------------------------------------------------------------------

SLOTS_A = (8, 3, 17, 12)


@pytest.mark.parametrize("impl_isa", IMPLS)
def test_spec_all_rejected_equals_decode(impl_isa):
    """Each step verifies 1 + 3 drafts and accepts only the first token: plain decode."""
    rng = np.random.default_rng(7)
    p, steps, C = 6, 5, CFG.spec_cols
    xp = random_inputs(CFG, p, rng)
    blocks = [random_inputs(CFG, C, rng) for _ in range(steps)]
    with impl_context(impl_isa) as impl:
        sp = Engine(CFG, impl, cache=garbage_cache(CFG, rng))
        dec = Engine(CFG, impl)
        sp.step([Request.prefill(SLOTS_A[0], p)], [xp])
        dec.step([Request.prefill(20, p)], [xp])
        for i, blk in enumerate(blocks):
            _, [o_s], _ = sp.step([Request.spec(SLOTS_A, C, num_accepted=1)], [blk], path="spec_decode")
            _, [o_d], _ = dec.step([Request.decode(20)], [tuple(v[:1] for v in blk)], path="decode")
            assert rel_rmse(o_s[:1], o_d) <= budget(CFG, "out"), i
            assert rel_rmse(sp.cache.ssm_state[SLOTS_A[0]], dec.cache.ssm_state[20]) <= budget(CFG, "state_decode")
            assert _bits_equal(sp.cache.conv_state[SLOTS_A[0], :3], dec.cache.conv_state[20, :3])


@pytest.mark.parametrize("impl_isa", IMPLS)
def test_spec_all_accepted_equals_prefill(impl_isa):
    """Every draft accepted, step after step (ragged block sizes): one prefill of the same tokens."""
    rng = np.random.default_rng(8)
    p, sizes = 7, [4, 2, 4, 1, 3]
    n = p + sum(sizes)
    x, b, a = random_inputs(CFG, n, rng)
    with impl_context(impl_isa) as impl:
        pre = Engine(CFG, impl)
        _, [o_pre], _ = pre.step([Request.prefill(1, n)], [(x, b, a)])
        sp = Engine(CFG, impl, cache=garbage_cache(CFG, rng))
        _, [o0], _ = sp.step([Request.prefill(SLOTS_A[0], p)], [(x[:p], b[:p], a[:p])])
        outs, pos, acc = [o0], p, 1
        for q in sizes:
            _, [o], _ = sp.step([Request.spec(SLOTS_A, q, num_accepted=acc)],
                                [(x[pos:pos + q], b[pos:pos + q], a[pos:pos + q])])
            outs.append(o)
            pos, acc = pos + q, q
        sp.commit([(SLOTS_A, acc)])
    got = np.concatenate(outs)
    assert rel_rmse(got, o_pre) <= budget(CFG, "out")
    ref_out, _, ref_ssm = oracle_sequence(CFG, pre.params, x, b, a)
    assert rel_rmse(got, ref_out) <= budget(CFG, "out")
    assert rel_rmse(sp.cache.ssm_state[SLOTS_A[0]], ref_ssm) <= budget(CFG, "state_prefill")
    assert _bits_equal(sp.cache.conv_state[SLOTS_A[0], :3], pre.cache.conv_state[1, :3])


@pytest.mark.parametrize("impl_isa", IMPLS)
def test_spec_to_plain_decode_through_commit(impl_isa):
    """Random acceptance, then commit_accepted, plain decodes, and back into spec mode: every
    output equals a prefill over the accepted tokens (the request's real history)."""
    rng = np.random.default_rng(9)
    C = CFG.spec_cols
    with impl_context(impl_isa) as impl:
        eng = Engine(CFG, impl, cache=garbage_cache(CFG, rng))
        hist = [random_inputs(CFG, 5, rng)]
        _, [o], _ = eng.step([Request.prefill(SLOTS_A[0], 5)], [hist[0]])
        expect = [o]
        acc = 1
        plan = ["spec"] * 3 + ["commit"] + ["decode"] * 2 + ["spec"] * 2 + ["commit", "decode"]
        for what in plan:
            if what == "commit":
                eng.commit([(SLOTS_A, acc)])
                acc = 1
                continue
            if what == "decode":
                blk = random_inputs(CFG, 1, rng)
                _, [o], _ = eng.step([Request.decode(SLOTS_A[0])], [blk], path="decode")
                hist.append(blk)
                expect.append(o)
                continue
            q = int(rng.integers(1, C + 1))
            blk = random_inputs(CFG, q, rng)
            _, [o], _ = eng.step([Request.spec(SLOTS_A, q, num_accepted=acc)], [blk])
            acc = int(rng.integers(1, q + 1))
            hist.append(tuple(v[:acc] for v in blk))
            expect.append(o[:acc])
    x, b, a = (np.concatenate([h[j] for h in hist]) for j in range(3))
    ref_out, _, ref_ssm = oracle_sequence(CFG, eng.params, x, b, a)
    assert rel_rmse(np.concatenate(expect), ref_out) <= budget(CFG, "out")
    assert rel_rmse(eng.cache.ssm_state[SLOTS_A[0]], ref_ssm) <= budget(CFG, "state_prefill")


@pytest.mark.parametrize("impl_isa", IMPLS)
@pytest.mark.parametrize("cfg", [CFG, CFG_X, CFG_BS], ids=["f32-SD", "bf16-DS", "bf16state"])
def test_commit_accepted_moves_exactly(impl_isa, cfg):
    rng = np.random.default_rng(10)
    C = cfg.spec_cols
    cache = garbage_cache(cfg, rng)
    pre_conv, pre_ssm = cache_bits(cache)
    idx = np.full((S, C), PAD_SLOT_ID, np.int32)
    acc = np.ones((S,), np.int32)
    perm = rng.permutation(N)
    rows = [(tuple(perm[:C]), C), (tuple(perm[C:2 * C]), 1), (tuple(perm[2 * C:3 * C]), 2)]
    for r, (sl, a_) in enumerate(rows):
        idx[r], acc[r] = sl, a_
    with impl_context(impl_isa) as impl:
        cache = attention(cfg, impl).commit_accepted(cache, idx, acc)
    conv, ssm = cache_bits(cache)
    exp_conv, exp_ssm = pre_conv.copy(), pre_ssm.copy()
    W1 = cfg.W - 1
    for sl, a_ in rows:
        exp_ssm[sl[0]] = pre_ssm[sl[a_ - 1]]
        if cfg.conv_state_layout == "SD":
            exp_conv[sl[0], :W1] = pre_conv[sl[0], a_ - 1:a_ - 1 + W1]
        else:
            exp_conv[sl[0], :, :W1] = pre_conv[sl[0], :, a_ - 1:a_ - 1 + W1]
    assert _bits_equal(ssm, exp_ssm)
    assert _bits_equal(conv, exp_conv)


# --- one executable per bucket -----------------------------------------------------------------


def _random_mix(cfg, rng, t=T, s=S):
    C = cfg.spec_cols
    free = list(rng.permutation(N))
    reqs, tokens = [], 0
    for _ in range(int(rng.integers(0, s + 1))):
        kind = rng.choice(["prefill", "decode", "spec"] if cfg.num_spec else ["prefill", "decode"])
        n = {"prefill": int(rng.integers(1, 20)), "decode": 1, "spec": int(rng.integers(1, C + 1))}[kind]
        need = C if kind == "spec" else 1
        if tokens + n > t or len(free) < need:
            continue
        sl = tuple(int(free.pop()) for _ in range(need))
        tokens += n
        if kind == "prefill":
            reqs.append(Request.prefill(sl[0], n, has_initial_state=bool(rng.integers(2))))
        elif kind == "decode":
            reqs.append(Request.decode(sl[0]))
        else:
            reqs.append(Request.spec(sl, n, num_accepted=int(rng.integers(1, C + 1))))
    return reqs


def _unregister_duration_listener(listener):
    # Public from jax 0.8.1 on; the older releases of the supported range (0.5.3-0.8.0) have only
    # the private form.
    unregister = getattr(jax.monitoring, "unregister_event_duration_listener", None)
    if unregister is None:
        from jax._src import monitoring
        unregister = monitoring._unregister_event_duration_listener_by_callback
    unregister(listener)


@pytest.mark.parametrize("impl_isa", IMPLS)
def test_one_executable_serves_every_mix(impl_isa):
    rng = np.random.default_rng(11)
    compiles = []
    listener = lambda event, duration, **kw: compiles.append(event)  # noqa: E731
    with impl_context(impl_isa) as impl:
        eng = Engine(CFG, impl)
        fn = eng.attn.gdn_attention_core_with_status
        eng.step([], [])   # compile (once per bucket) outside the counted loop
        before = fn._cache_size()
        jax.monitoring.register_event_duration_secs_listener(listener)
        try:
            kinds_seen = set()
            for _ in range(20):
                reqs = _random_mix(CFG, rng)
                kinds_seen |= {r.kind for r in reqs}
                eng.step(reqs, _inputs(CFG, rng, reqs))
        finally:
            _unregister_duration_listener(listener)
    assert kinds_seen == {"prefill", "decode", "spec"}
    assert fn._cache_size() == before
    assert [e for e in compiles if e == "/jax/core/compile/backend_compile_duration"] == []


# --- in place: no pool copies, buffers reused --------------------------------------------------

_INSTR = re.compile(r"^\s*(ROOT )?%([\w.\-]+) = (\w+)\[([\d,]*)\][^ ]* ([\w\-]+)\(([^)]*)\)")


def pool_copies(hlo: str, pool_shapes) -> list:
    """Instructions of a compiled HLO text that make a whole-pool pass: a pool-shaped copy,
    convert or bitcast-convert that is materialised (in a non-fused computation, or the root
    of a fusion; inside a fusion an elementwise op feeding a gather is evaluated lazily), a
    pool-shaped dynamic-update-slice outside a fusion, or a fusion rooted in a pool-shaped
    scatter / dynamic-update-slice whose operand is not the fusion's own parameter (that
    would write a fresh pool)."""
    bad, comp, fused = [], None, False
    defs: dict = {}
    for line in hlo.splitlines():
        head = re.match(r"^(ENTRY )?%([\w.\-]+) .*\{\s*$", line)
        if head:
            comp = head.group(2)
            fused = head.group(1) is None and ("fused" in comp or comp.startswith("wrapped_"))
            defs = {}
            continue
        m = _INSTR.match(line)
        if not m:
            continue
        root, name, _, dims, op, args = m.groups()
        defs[name] = op
        shape = tuple(int(d) for d in dims.split(",")) if dims else ()
        if shape not in pool_shapes:
            continue
        if op in ("copy", "convert", "bitcast-convert") and (not fused or root):
            bad.append(line.strip()[:160])
        elif op == "dynamic-update-slice" and not fused:
            bad.append(line.strip()[:160])
        elif op in ("scatter", "dynamic-update-slice") and fused and root:
            first = args.split(",")[0].strip().lstrip("%")
            if defs.get(first) != "parameter":
                bad.append(line.strip()[:160])
    return bad


@pytest.mark.parametrize("impl_isa", IMPLS_STRUCTURAL)
@pytest.mark.parametrize("cfg", [CFG, CFG_X], ids=["f32-SD", "bf16-DS"])
def test_steps_update_pools_in_place(impl_isa, cfg):
    n = 37   # a pool size no other array has
    shapes = {cfg.conv_state_shape(n), cfg.ssm_state_shape(n)}
    rng = np.random.default_rng(12)
    with impl_context(impl_isa) as impl:
        eng = Engine(cfg, impl, n=n, cache=garbage_cache(cfg, rng, n=n))
        reqs = _mixed_requests(cfg, rng)
        hb = eng.build(reqs)
        x, b, a = (jnp.asarray(v) for v in (np.zeros((T, cfg.D)), np.zeros((T, cfg.HV)), np.zeros((T, cfg.HV))))
        x, b, a = x.astype(cfg.act_dtype), b.astype(cfg.act_dtype), a.astype(cfg.act_dtype)
        for kind in STEP_KINDS:
            fn = getattr(eng.attn, f"{kind}_with_status")
            hlo = fn.lower(x, b, a, eng.params, eng.cache, hb.metadata).compile().as_text()
            copies = pool_copies(hlo, shapes)
            assert copies == [], f"{kind}: {copies}"
        ptrs = (eng.cache.conv_state.unsafe_buffer_pointer(), eng.cache.ssm_state.unsafe_buffer_pointer())
        old = eng.cache
        out, new, status = eng.attn.gdn_attention_core_with_status(x, b, a, eng.params, eng.cache, hb.metadata)
        assert int(status[0]) == 0
        assert old.conv_state.is_deleted() and old.ssm_state.is_deleted()
        assert (new.conv_state.unsafe_buffer_pointer(), new.ssm_state.unsafe_buffer_pointer()) == ptrs


@pytest.mark.parametrize("impl_isa", IMPLS_STRUCTURAL)
@pytest.mark.parametrize("cfg", [CFG, CFG_X, CFG_BS], ids=["f32-SD", "bf16-DS", "bf16state"])
def test_commit_accepted_in_place(impl_isa, cfg):
    n = 37
    shapes = {cfg.conv_state_shape(n), cfg.ssm_state_shape(n)}
    with impl_context(impl_isa) as impl:
        attn = attention(cfg, impl)
        cache = garbage_cache(cfg, np.random.default_rng(13), n=n)
        idx = jnp.full((S, cfg.spec_cols), PAD_SLOT_ID, jnp.int32).at[0].set(jnp.arange(cfg.spec_cols))
        acc = jnp.ones((S,), jnp.int32).at[0].set(2)
        hlo = attn.commit_accepted_with_status.lower(cache, idx, acc).compile().as_text()
        ptrs = (cache.conv_state.unsafe_buffer_pointer(), cache.ssm_state.unsafe_buffer_pointer())
        new, status = attn.commit_accepted_with_status(cache, idx, acc)
    assert int(status[0]) == 0
    assert (new.conv_state.unsafe_buffer_pointer(), new.ssm_state.unsafe_buffer_pointer()) == ptrs
    copies = pool_copies(hlo, shapes)
    assert copies == []


def materialised(hlo: str, shapes) -> list:
    """Instructions of a compiled HLO text that write a fresh array of one of ``shapes``: any
    op outside a fused computation (but parameters, tuples, bitcasts) or a fusion's root."""
    out, fused = [], False
    for line in hlo.splitlines():
        head = re.match(r"^(ENTRY )?%([\w.\-]+) .*\{\s*$", line)
        if head:
            comp = head.group(2)
            fused = head.group(1) is None and ("fused" in comp or comp.startswith("wrapped_"))
            continue
        m = _INSTR.match(line)
        if not m:
            continue
        root, _, _, dims, op, _ = m.groups()
        shape = tuple(int(d) for d in dims.split(",")) if dims else ()
        if shape in shapes and op not in ("parameter", "get-tuple-element", "tuple", "bitcast") and (not fused or root):
            out.append(line.strip()[:160])
    return out


@pytest.mark.parametrize("impl_isa", IMPLS_STRUCTURAL)
@pytest.mark.parametrize("cfg", [CFG, CFG_X], ids=["f32-SD", "bf16-DS"])
def test_native_steps_read_qkv_from_the_conv_output(impl_isa, cfg):
    """The recurrent and chunk kernels read q, k, v from the rows of the conv output: no step
    materialises a q or k array [T, H, K] (at T = 8192 the split copies were 128 MiB of fresh
    pages per prefill step)."""
    rng = np.random.default_rng(14)
    with impl_context(impl_isa) as impl:
        eng = Engine(cfg, impl, n=N, cache=garbage_cache(cfg, rng, n=N))
        hb = eng.build(_mixed_requests(cfg, rng))
        x = jnp.zeros((T, cfg.D), cfg.act_dtype)
        b = a = jnp.zeros((T, cfg.HV), cfg.act_dtype)
        for kind in STEP_KINDS:
            fn = getattr(eng.attn, f"{kind}_with_status")
            hlo = fn.lower(x, b, a, eng.params, eng.cache, hb.metadata).compile().as_text()
            assert materialised(hlo, {(T, cfg.H, cfg.K)}) == [], kind
        # The check sees such arrays where they exist: the reference path splits q, k, v.
        ref = attention(cfg, "reference")
        hlo = ref.gdn_attention_core_with_status.lower(x, b, a, eng.params, eng.cache, hb.metadata).compile().as_text()
        assert materialised(hlo, {(T, cfg.H, cfg.K)}) != []


# --- bad batches: a clear error, the cache intact ---------------------------------------------


def _good_batch():
    return build_batch([Request.decode(1), Request.spec((4, 5, 6, 7), 3, num_accepted=2), Request.prefill(3, 5)],
                       num_slots=N, num_spec=3, token_bucket=T, row_bucket=S).metadata


def _edited(field, index, value):
    m = _good_batch()
    getattr(m, field)[index] = value
    return m


BAD_BATCHES = [
    ("slot out of range", _edited("state_indices", (0, 0), N), "row 0: slot 24 \\(column 0\\) is outside \\[0, N\\)"),
    ("negative slot", _edited("state_indices", (2, 0), -2), "row 2: slot -2 \\(column 0\\) is outside"),
    ("slot twice", _edited("state_indices", (2, 0), 5), "row 2: slot 5 is also named by row 1"),
    ("slot twice across kinds", _edited("state_indices", (2, 0), 1), "row 2: slot 1 is also named by row 0"),
    ("slot twice in a spec row", _edited("state_indices", (1, 2), 5),
     "row 1: slot 5 is named by two of its used columns"),
    ("qsl non-monotone", _edited("query_start_loc", 2, 0), "query_start_loc must be non-decreasing"),
    ("qsl past T", _edited("query_start_loc", slice(3, None), T + 1), f"query_start_loc\\[-1\\] = {T + 1} is past"),
    ("qsl start", _edited("query_start_loc", 0, 1), "query_start_loc\\[0\\] must be 0"),
    ("accepted 0", _edited("num_accepted_tokens", 1, 0), "row 1: num_accepted_tokens = 0 is outside \\[1, 4\\]"),
    ("accepted too many", _edited("num_accepted_tokens", 1, 5), "num_accepted_tokens = 5 is outside \\[1, 4\\]"),
    ("spec row too long", _edited("query_start_loc", slice(2, None), 9), "row 1: 8 tokens, more than the 4"),
    ("decode row of 2", _edited("query_start_loc", 1, 2), "row 0: a decode row has 2 tokens"),
    ("accepted on decode", _edited("num_accepted_tokens", 0, 2), "num_accepted_tokens = 2 on a decode row"),
    ("kind of a padding row", _edited("row_kind", 4, ROW_PREFILL), "row 4: row_kind 1 \\(prefill\\) does not match"),
    ("unknown kind", _edited("row_kind", 2, 9), "row 2: row_kind 9 \\(unknown kind\\) is not one this step takes"),
]


@pytest.mark.parametrize("impl_isa", IMPLS)
def test_bad_batches_raise_and_keep_the_cache(impl_isa):
    rng = np.random.default_rng(14)
    with impl_context(impl_isa) as impl:
        eng = Engine(CFG, impl, cache=garbage_cache(CFG, rng))
        x, b, a = (jnp.asarray(v) for v in random_inputs(CFG, T, rng))
        for name, meta, msg in BAD_BATCHES:
            pre = cache_bits(eng.cache)
            donated = eng.cache
            with pytest.raises(gdn_jax.InvalidBatchError, match=msg) as ei:
                eng.attn.gdn_attention_core(x, b, a, eng.params, donated, meta)
            assert "gdn_jax.gdn_attention_core: invalid batch, nothing was written" in str(ei.value), name
            assert donated.ssm_state.is_deleted(), "the cache was donated"
            eng.cache = ei.value.caches
            assert _bits_equal(eng.cache.conv_state, pre[0]) and _bits_equal(eng.cache.ssm_state, pre[1]), name
        # *_with_status: zeros, the same cache buffers, the status.
        ptr = eng.cache.ssm_state.unsafe_buffer_pointer()
        out, eng.cache, st = eng.attn.gdn_attention_core_with_status(x, b, a, eng.params, eng.cache,
                                                                     BAD_BATCHES[0][1])
        assert int(st[0]) == 4 and not np.any(np.asarray(out))
        assert eng.cache.ssm_state.unsafe_buffer_pointer() == ptr
        # a path given a row kind it does not take
        with pytest.raises(gdn_jax.InvalidBatchError, match="row 0: row_kind 2 \\(decode\\) is not one this step "
                                                            "takes \\(padding, prefill\\)") as ei:
            eng.attn.prefill(x, b, a, eng.params, eng.cache, _good_batch())
        eng.cache = ei.value.caches
        with pytest.raises(gdn_jax.InvalidBatchError, match="row 2: row_kind 1 \\(prefill\\) is not one") as ei:
            eng.attn.spec_decode(x, b, a, eng.params, eng.cache, _good_batch())
        eng.cache = ei.value.caches
        # and serving goes on from the returned cache
        reqs = _mixed_requests(CFG, rng)
        eng.step(reqs, _inputs(CFG, rng, reqs), check=True)


def _empty_batch(S_):
    """S_ rows owning no tokens: rows 0 and 1 (when S_ > 1) are a prefill and a spec row
    (acc 2) of zero tokens, the rest padding."""
    m = BatchMetadata.empty(S_, CFG.num_spec)
    if S_ > 1:
        m.row_kind[:2] = [ROW_PREFILL, ROW_SPEC]
        m.state_indices[0, 0] = 2
        m.state_indices[1] = [4, 5, 6, 7]
        m.has_initial_state[:2] = True
        m.num_accepted_tokens[1] = 2
    return m


@pytest.mark.parametrize("impl_isa", IMPLS[:2])
@pytest.mark.parametrize("T_,S_", [(0, 0), (0, 3), (4, 0)])
def test_empty_batches_write_nothing(impl_isa, T_, S_):
    """No tokens or no rows: a zero output, the cache bit-identical, on every path (the
    reference's gathers have no empty form: it must not run them)."""
    rng = np.random.default_rng(15)
    with impl_context(impl_isa) as impl:
        eng = Engine(CFG, impl, cache=garbage_cache(CFG, rng))
        x, b, a = (jnp.asarray(v) for v in random_inputs(CFG, T_, rng))
        for path in ("gdn_attention_core", "prefill", "decode", "spec_decode"):
            m = _empty_batch(S_) if path == "gdn_attention_core" else BatchMetadata.empty(S_, CFG.num_spec)
            pre = cache_bits(eng.cache)
            out, eng.cache, st = getattr(eng.attn, path + "_with_status")(x, b, a, eng.params, eng.cache, m)
            assert np.asarray(st).tolist() == [0, 0, 0, 0], path
            assert out.shape == (T_, CFG.HV, CFG.V) and not np.any(np.asarray(out)), path
            assert _bits_equal(eng.cache.conv_state, pre[0]) and _bits_equal(eng.cache.ssm_state, pre[1]), path
        # A bad query_start_loc is still found with no rows.
        m = BatchMetadata.empty(S_, CFG.num_spec)
        m.query_start_loc[0] = 1
        _, eng.cache, st = eng.attn.gdn_attention_core_with_status(x, b, a, eng.params, eng.cache, m)
        assert np.asarray(st).tolist()[:2] == [1, 0]


@pytest.mark.parametrize("impl_isa", IMPLS[:1])
def test_static_mistakes_raise_before_donation(impl_isa):
    with impl_context(impl_isa) as impl:
        eng = Engine(CFG, impl)
        m = _good_batch()
        x = jnp.zeros((T, CFG.D), F32)
        bad = [((jnp.zeros((T, CFG.D + 1), F32), x[:, :2], x[:, :2]), ValueError, "mixed_qkv must be \\[T, D\\]"),
               ((x.astype(BF16), x[:, :2], x[:, :2]), TypeError, "mixed_qkv must have dtype float32"),
               ((x, x[:, :3], x[:, :2]), ValueError, "b must be \\[T, HV\\]")]
        for args, exc, msg in bad:
            with pytest.raises(exc, match=msg):
                eng.attn.gdn_attention_core(*args, eng.params, eng.cache, m)
            assert not eng.cache.ssm_state.is_deleted()
        with pytest.raises(ValueError, match="batch.state_indices must be \\[S, num_spec \\+ 1\\] = \\[6, 4\\]"):
            eng.attn(x, x[:, :2], x[:, :2], eng.params, eng.cache,
                     BatchMetadata.empty(S, 1))
        with pytest.raises(ValueError, match="GDNCache.conv_state must have shape \\(24, 6, 64\\), got \\(24, 3, 64\\)"):
            eng.attn(x, x[:, :2], x[:, :2], eng.params, GDNCache.create(CFG0, N), m)
        assert not eng.cache.ssm_state.is_deleted()


@pytest.mark.parametrize("impl_isa", IMPLS[:1])
def test_commit_accepted_bad_rows_keep_the_cache(impl_isa):
    attn = attention(CFG, impl_isa[0])
    cache = garbage_cache(CFG, np.random.default_rng(15))
    idx = np.full((S, 4), PAD_SLOT_ID, np.int32)
    acc = np.ones((S,), np.int32)
    idx[0], idx[1] = (1, 2, 3, 4), (5, 6, 7, 8)
    for edit, msg in [(("acc", 0, 5), "row 0: num_accepted_tokens = 5 is outside \\[1, 4\\]"),
                      (("idx", (1, 1), 99), "row 1: slot 99 \\(column 1\\) is outside"),
                      (("idx", (1, 0), 2), "row 1: slot 2 is also named by row 0")]:
        i2, a2 = idx.copy(), acc.copy()
        acc_edit = edit[0] == "acc"
        (a2 if acc_edit else i2)[edit[1]] = edit[2]
        if edit[1] == (1, 1):
            a2[1] = 3   # make column 1 a used column
        if edit[1] == (1, 0):
            a2[0] = 2   # row 0 uses its columns 0 and 1 (slots 1, 2)
        pre = cache_bits(cache)
        with pytest.raises(gdn_jax.InvalidBatchError, match=msg) as ei:
            attn.commit_accepted(cache, i2, a2)
        assert "gdn_jax.commit_accepted: invalid batch" in str(ei.value)
        cache = ei.value.caches
        assert _bits_equal(cache.conv_state, pre[0]) and _bits_equal(cache.ssm_state, pre[1])


@pytest.mark.parametrize("impl_isa", IMPLS[:1])
def test_host_indices_are_checked_before_jit_wraps_or_casts_them(impl_isa):
    """int64 metadata beyond int32 (a torch engine's sentinel) was wrapped by jit into a valid slot
    and written; float indices given to commit_accepted were truncated. Both raise naming the field,
    before anything is donated; a -1 in a used spec column says so in words."""
    attn = attention(CFG, impl_isa[0])
    rng = np.random.default_rng(17)
    cache = garbage_cache(CFG, rng)
    pre = cache_bits(cache)
    idx = np.full((S, 4), PAD_SLOT_ID, np.int64)
    idx[0] = (1, 2, 3, 4)
    acc = np.ones((S,), np.int64)
    with pytest.raises(TypeError, match="spec_state_indices must have dtype int32, got float32"):
        attn.commit_accepted(cache, idx.astype(np.float32), acc)
    with pytest.raises(TypeError, match="num_accepted_tokens must have dtype int32"):
        attn.commit_accepted(cache, idx, acc + 0.6)
    big = idx.copy()
    big[0, 1] = 2 ** 32 + 2
    with pytest.raises(ValueError, match=r"spec_state_indices holds 4294967298, outside int32"):
        attn.commit_accepted(cache, big, acc + 1)
    hb = build_batch([Request.prefill(1, 3)], num_slots=N, num_spec=3, token_bucket=T, row_bucket=S)
    m = hb.metadata
    m.state_indices = m.state_indices.astype(np.int64)
    m.state_indices[0, 0] = 2 ** 32 + 1
    x, b, a = (jnp.asarray(v) for v in random_inputs(CFG, T, rng))
    with pytest.raises(ValueError, match="batch.state_indices holds 4294967297"):
        attn.prefill(x, b, a, _params(CFG), cache, m)
    assert not cache.ssm_state.is_deleted() and _bits_equal(cache.ssm_state, pre[1])
    with pytest.raises(gdn_jax.InvalidBatchError, match=r"row 0: column 1 names PAD_SLOT_ID \(-1\), but the row uses it") as ei:
        attn.commit_accepted(cache, np.where(np.arange(4) == 1, -1, idx), acc + 1)   # acc 2 uses column 1
    cache = attn.commit_accepted(ei.value.caches, idx, acc + 1)   # int64 in range: served
    assert _bits_equal(np.asarray(cache.ssm_state)[1], pre[1][2])


def test_functional_forms():
    rng = np.random.default_rng(16)
    params = _params(CFG)
    reqs = [Request.prefill(0, 4), Request.decode(1)]
    hb = build_batch(reqs, num_slots=N, num_spec=3, token_bucket=T, row_bucket=S)
    x, b, a = (jnp.asarray(v) for v in random_inputs(CFG, T, rng))
    out1, c1 = paths.gdn_attention_core(x, b, a, params, GDNCache.create(CFG, N), hb, config=CFG, impl="reference")
    attn = attention(CFG, "reference")
    out2, c2 = attn.gdn_attention_core(x, b, a, params, GDNCache.create(CFG, N), hb)
    np.testing.assert_array_equal(np.asarray(out1), np.asarray(out2))
    pre = cache_bits(c1)
    c3 = paths.commit_accepted(c1, np.full((S, 4), -1, np.int32), np.ones((S,), np.int32), config=CFG,
                                impl="reference")
    assert _bits_equal(c3.ssm_state, pre[1]) and _bits_equal(c3.conv_state, pre[0])
    with pytest.raises(ValueError, match="kind must be one of"):
        attn.apply("verify", x, b, a, params, c2, hb)


# --- soak: a random serving schedule against the oracle at every step ---------------------------


class _Live:
    """A request in the simulated engine."""

    def __init__(self, rid, slots, prompt, gen):
        self.id, self.slots, self.prompt_left, self.left = rid, slots, prompt, gen
        self.prefilled, self.mode, self.acc = False, "prefill", 1


def _expected_commit(cfg, pre, rows):
    conv, ssm = pre[0].copy(), pre[1].copy()
    W1 = cfg.W - 1
    for sl, a_ in rows:
        ssm[sl[0]] = pre[1][sl[a_ - 1]]
        if cfg.conv_state_layout == "SD":
            conv[sl[0], :W1] = pre[0][sl[0], a_ - 1:a_ - 1 + W1]
        else:
            conv[sl[0], :, :W1] = pre[0][sl[0], :, a_ - 1:a_ - 1 + W1]
    return conv, ssm


def run_soak(cfg, impl, steps, seed, t=T, s=S, n=N):
    """A continuous-batching schedule: arrivals, chunked prefills, decodes, spec steps with
    random acceptance, spec <-> plain switches through commit_accepted, finishes and aborts,
    slot reuse over stale contents, bucket padding, and now and then a bad batch. Every step
    is checked against the float64 oracle (and every commit bit for bit)."""
    rng = np.random.default_rng(seed)
    C = cfg.spec_cols
    eng = Engine(cfg, impl, cache=garbage_cache(cfg, rng, n=n), n=n, t=t, s=s)
    free, active, next_id = list(range(n)), [], 0
    seen = dict(prefill=0, decode=0, spec=0, commit=0, bad=0, finished=0, reused=0)
    used_before = set()
    for step in range(steps):
        while len(active) < s + 2 and len(free) >= C and rng.random() < 0.4:
            rng.shuffle(free)
            slots = tuple(int(free.pop()) for _ in range(C))
            seen["reused"] += slots[0] in used_before
            used_before.update(slots)
            active.append(_Live(next_id, slots, int(rng.integers(1, 2 * t // 3)), int(rng.integers(1, 20))))
            next_id += 1
        commits = []
        for r in active:
            if r.mode == "spec" and rng.random() < 0.1 and len(commits) < s:
                commits.append((r.slots, r.acc))
                r.mode, r.acc = "plain", 1
            elif r.mode == "plain" and cfg.num_spec and rng.random() < 0.1:
                r.mode, r.acc = "spec", 1
        if commits:
            pre = cache_bits(eng.cache)
            eng.commit(commits)
            exp = _expected_commit(cfg, pre, commits)
            assert _bits_equal(eng.cache.conv_state, exp[0]) and _bits_equal(eng.cache.ssm_state, exp[1]), step
            seen["commit"] += 1
        reqs, owners, budget_ = [], [], t
        for i in rng.permutation(len(active)):
            r = active[i]
            if len(reqs) == s or budget_ == 0:
                break
            if rng.random() < 0.1:
                continue   # not scheduled this step
            if r.mode == "prefill":
                k = int(min(r.prompt_left, rng.integers(1, budget_ + 1)))
                reqs.append(Request.prefill(r.slots[0], k, has_initial_state=r.prefilled, id=r.id))
            elif r.mode == "spec":
                q = int(rng.integers(1, C + 1))
                if q > budget_:
                    continue
                reqs.append(Request.spec(r.slots, q, num_accepted=r.acc, id=r.id))
            else:
                reqs.append(Request.decode(r.slots[0], id=r.id))
            budget_ -= reqs[-1].num_tokens
            owners.append(r)
        inputs = _inputs(cfg, rng, reqs)
        if step % 29 == 28 and len(reqs) >= 2:
            hb = eng.build(reqs)
            meta = hb.metadata
            meta.state_indices[1, 0] = meta.state_indices[0, 0]   # one slot named twice
            pre = cache_bits(eng.cache)
            x, b, a = (jnp.asarray(hb.pack([p[j] for p in inputs])) for j in range(3))
            with pytest.raises(gdn_jax.InvalidBatchError, match="is also named by row 0"):
                try:
                    eng.attn.gdn_attention_core(x, b, a, eng.params, eng.cache, meta)
                except gdn_jax.InvalidBatchError as e:
                    eng.cache = e.caches
                    raise
            assert _bits_equal(eng.cache.conv_state, pre[0]) and _bits_equal(eng.cache.ssm_state, pre[1])
            seen["bad"] += 1
        eng.step(reqs, inputs, check=True)
        for r, rq in zip(owners, reqs):
            seen[rq.kind] += 1
            if rq.kind == "prefill":
                r.prompt_left -= rq.num_tokens
                r.prefilled = True
                if r.prompt_left == 0:
                    r.mode = "spec" if cfg.num_spec and rng.random() < 0.6 else "plain"
                    r.acc = 1
            elif rq.kind == "spec":
                r.acc = int(rng.integers(1, rq.num_tokens + 1))
                r.left -= r.acc
            else:
                r.left -= 1
        for r in list(active):
            if (r.mode != "prefill" and r.left <= 0) or rng.random() < 0.005:
                active.remove(r)
                free.extend(r.slots)
                seen["finished"] += 1
    return seen


@pytest.mark.parametrize("impl_isa", IMPLS)
def test_soak_random_schedule(impl_isa):
    with impl_context(impl_isa) as impl:
        seen = run_soak(CFG, impl, steps=300, seed=20)
    assert min(seen.values()) > 0, seen


@pytest.mark.slow
@pytest.mark.parametrize("impl_isa", IMPLS)
@pytest.mark.parametrize("cfg", [CFG, CFG0, CFG_X, CFG_BS], ids=["f32-spec3", "f32-nospec", "bf16-gqa-DS-bias",
                                                                 "bf16state-W3"])
def test_soak_random_schedule_long(impl_isa, cfg):
    """1500 steps per config (deselected by default: GDN_JAX_SLOW=1 or -m slow)."""
    with impl_context(impl_isa) as impl:
        seen = run_soak(cfg, impl, steps=1500, seed=21)
    assert seen["prefill"] and seen["decode"] and seen["finished"] and seen["reused"], seen


# --- the native step: one call, no glue ---------------------------------------------------------

NATIVE_ISAS = [p for p in IMPLS if p.values[0][0] == "native"]


def _interleaved_requests(cfg, rng, kind):
    """Rows of the kinds ``kind`` takes, kinds interleaved (caller's order kept: reorder=False)."""
    C = cfg.spec_cols
    slots = list(rng.permutation(N))
    take = lambda k: tuple(int(slots.pop()) for _ in range(k))  # noqa: E731
    pre = [Request.prefill(take(1)[0], 9, has_initial_state=True), Request.prefill(take(1)[0], 67)]
    dec = [Request.decode(take(1)[0]), Request.decode(take(1)[0])]
    spec = [Request.spec(take(C), C, num_accepted=C), Request.spec(take(C), 1, num_accepted=2)] if cfg.num_spec else []
    rows = {"prefill": pre, "decode": dec, "spec_decode": [dec[0], *spec, dec[1]],
            "gdn_attention_core": [dec[0], pre[0], *spec[:1], pre[1], dec[1], *spec[1:]]}[kind]
    return rows


@pytest.mark.parametrize("impl_isa", NATIVE_ISAS)
@pytest.mark.parametrize("cfg", [CFG, CFG_X, CFG_BS], ids=["f32-SD", "bf16-gqa-DS-bias", "bf16state-W3"])
@pytest.mark.parametrize("kind", list(STEP_KINDS))
def test_native_step_equals_the_op_composition(impl_isa, cfg, kind):
    """The one-call native step gives the bits of the multi-op composition (the kernels one by one,
    masked indices, summed outputs: paths._run_ops) on rows of interleaved kinds, and both are
    within budget of the float64 oracle."""
    rng = np.random.default_rng(21)
    reqs = _interleaved_requests(cfg, rng, kind)
    n_tok = sum(r.num_tokens for r in reqs)
    hb = build_batch(reqs, num_slots=N, num_spec=cfg.num_spec, token_bucket=n_tok + 3, row_bucket=len(reqs) + 2,
                     reorder=False)
    x, b, a = (jnp.asarray(hb.pack(list(v))) for v in zip(*_inputs(cfg, rng, reqs)))
    params = _params(cfg)
    with impl_context(impl_isa) as impl:
        cache = garbage_cache(cfg, rng)
        pre = cache_bits(cache)
        one = jax.jit(lambda *args: paths._step(cfg, impl, kind, *args))
        out1, c1, st1 = one(x, b, a, params, cache, hb.metadata)
        ops_ = jax.jit(lambda x, b, a, p, c, m: paths._run_ops(cfg, impl, kind, x, b, a, p, c, m))
        out2, c2, st2 = ops_(x, b, a, params, cache, hb.metadata)
    assert int(st1[0]) == 0 and int(st2[0]) == 0
    assert _bits_equal(out1, out2), "outputs differ from the op composition"
    assert _bits_equal(c1.conv_state, c2.conv_state) and _bits_equal(c1.ssm_state, c2.ssm_state)
    check_against_oracle(cfg, params, pre, hb, np.asarray(x), np.asarray(b), np.asarray(a), np.asarray(out1), c1,
                         impl=impl)


@pytest.mark.parametrize("impl_isa", NATIVE_ISAS[:1])
def test_native_step_checks_the_batch_itself(impl_isa):
    """The raw step target refuses a bad batch on its own check (the caller's status OK): nothing
    written, a zero output, the status of batch_status; a nonzero caller's status is passed on."""
    from gdn_jax import _native
    from gdn_jax.batch import batch_status
    cfg = CFG
    rng = np.random.default_rng(22)
    params = _params(cfg)
    x, b, a = (jnp.asarray(rng.standard_normal((T, d)), cfg.act_dtype) for d in (cfg.D, cfg.HV, cfg.HV))
    for _, meta, _ in BAD_BATCHES:
        for given in ("ok", "error"):
            with impl_context(impl_isa):
                cache = garbage_cache(cfg, rng)
                pre = cache_bits(cache)
                want = batch_status(meta, num_tokens=T, num_slots=N, kinds=STEP_KINDS["gdn_attention_core"],
                                    impl="reference")
                st_in = jnp.zeros((4,), jnp.int32) if given == "ok" else want

                def run(x, b, a, params, cache, meta, st_in):
                    return paths._run_native(cfg, "gdn_attention_core", x, b, a, params, cache, meta, st_in)
                out, new, st = jax.jit(run)(x, b, a, params, cache, jax.tree.map(jnp.asarray, meta), st_in)
            assert int(want[0]) != 0
            np.testing.assert_array_equal(np.asarray(st), np.asarray(want))
            assert not np.any(np.asarray(out))
            assert all(_bits_equal(u, v) for u, v in zip(cache_bits(new), pre))


def glue(hlo: str, shapes) -> list:
    """Instructions of a compiled HLO text, other than custom calls, that write an array of one of
    ``shapes`` (see materialised)."""
    return [line for line in materialised(hlo, shapes) if " custom-call(" not in line]


@pytest.mark.parametrize("impl_isa", IMPLS_STRUCTURAL)
@pytest.mark.parametrize("cfg", [CFG, CFG_X, CFG_BS], ids=["f32-SD", "bf16-DS", "bf16state"])
def test_native_steps_are_one_call_without_glue(impl_isa, cfg):
    """Each native step compiles to the one step call (which checks the batch itself): no other
    op makes an array of T x D, T x HV x V or pool size (masked outputs summed, converts, copies)."""
    n = 37
    rng = np.random.default_rng(23)
    shapes = {cfg.conv_state_shape(n), cfg.ssm_state_shape(n), (T, cfg.D), (T, cfg.HV, cfg.V),
              (T, cfg.HV * cfg.V)}
    with impl_context(impl_isa) as impl:
        eng = Engine(cfg, impl, n=n, cache=garbage_cache(cfg, rng, n=n))
        hb = eng.build(_mixed_requests(cfg, rng))
        x = jnp.zeros((T, cfg.D), cfg.act_dtype)
        b = a = jnp.zeros((T, cfg.HV), cfg.act_dtype)
        for kind in STEP_KINDS:
            fn = getattr(eng.attn, f"{kind}_with_status")
            hlo = fn.lower(x, b, a, eng.params, eng.cache, hb.metadata).compile().as_text()
            assert glue(hlo, shapes) == [], kind
            calls = re.findall(r'custom_call_target="([\w]+)"', hlo)
            assert calls == ["gdn_jax_step"], (kind, calls)
        # The check sees glue where it exists: the op composition sums two masked outputs.
        comp = jax.jit(lambda x, b, a, p, c, m: paths._run_ops(cfg, impl, "gdn_attention_core", x, b, a, p, c, m))
        hlo = comp.lower(x, b, a, eng.params, eng.cache, hb.metadata).compile().as_text()
        assert glue(hlo, shapes) != []
