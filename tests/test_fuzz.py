"""Property-based batches (hypothesis) through every serving step, jitted with the cache
donated, on the reference and on the native kernels of every ISA.

Each case is a random batch metadata, valid by construction and then (half the time) edited
at random: slots out of range or repeated, padding rows in odd places (and owning tokens),
``query_start_loc`` values, accepted counts, row kinds, ``has_initial_state``, junk in the
columns a row does not use. A plain-Python reading of the batch rules (``_verdict``, written
from the contract, independent of gdn_jax's checks) says whether the batch is valid. Valid:
the step must match the token-scan oracle (serve_helpers.token_scan_step), with every slot
it does not name bit-identical. Invalid: it must raise InvalidBatchError with both pools
bit-identical to before. Failures print the batch and the input seed (hypothesis notes) and
hypothesis's reproduction blob.

Default: a short run (~1 min); GDN_JAX_SLOW=1: many more examples, a second bucket and a
second config (GQA, conv bias, W = 3, "DS" layout); GDN_FUZZ_EXAMPLES=n sets the examples per test.
"""
from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, note, settings
from hypothesis import strategies as st

import gdn_jax
from gdn_jax.batch import PAD_SLOT_ID, ROW_DECODE, ROW_PAD, ROW_PREFILL, ROW_SPEC, BatchMetadata
from gdn_jax.config import GDNCache, GDNConfig, GDNParams
from gdn_jax.paths import STEP_KINDS
from gdn_jax import paths
from serve_helpers import (IMPLS, SMALL_CFG, SMALL_N, SMALL_S, SMALL_T, budget, cache_bits, impl_context, random_inputs, rel_rmse, to_np64,
                           token_scan_step)

SLOW = bool(os.environ.get("GDN_JAX_SLOW"))
settings.register_profile("gdn-default", max_examples=12, deadline=None, print_blob=True, derandomize=True, database=None,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.register_profile("gdn-slow", max_examples=300, deadline=None, print_blob=True, database=None,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
PROFILE = settings.get_profile("gdn-slow" if SLOW else "gdn-default")
if os.environ.get("GDN_FUZZ_EXAMPLES"):          # e.g. a long hunt: GDN_FUZZ_EXAMPLES=5000
    PROFILE = settings(PROFILE, max_examples=int(os.environ["GDN_FUZZ_EXAMPLES"]))

F32 = jnp.float32
CFGS = [SMALL_CFG]
BUCKETS = [(SMALL_T, SMALL_S)]      # (T tokens, S rows)
if SLOW:
    CFGS.append(GDNConfig(2, 4, 16, 32, num_spec=1, act_dtype=F32, conv_width=3, conv_state_layout="DS"))
    BUCKETS.append((72, 6))         # more than one 64-token chunk
N = SMALL_N                         # pool slots
KIND_NAMES = {ROW_PREFILL: "prefill", ROW_DECODE: "decode", ROW_SPEC: "spec"}
STEPS = list(STEP_KINDS)         # prefill, decode, spec_decode, gdn_attention_core


# --- the rules, in plain Python ----------------------------------------------------------------


def _verdict(m: dict, kinds, T: int, C: int):
    """(None, live rows) if the step must accept batch ``m``, else (reason, None).

    Rules (contract.md, "data errors"; paths.py step kinds): query_start_loc starts at 0, never
    decreases, ends <= T; each row's kind is one the step takes and padding iff column 0 is -1;
    decode rows have 1 token; spec rows accept 1..C tokens and have at most C; other live rows
    accept 1; every slot a live row uses (column 0; spec: columns < max(q, acc)) is in [0, N)
    and named by no other row and no other used column of its own.
    """
    qsl, idx, kind, acc = m["qsl"], m["idx"], m["kind"], m["acc"]
    S = len(kind)
    if qsl[0] != 0:
        return "qsl[0] != 0", None
    if any(qsl[i + 1] < qsl[i] for i in range(S)):
        return "qsl decreases", None
    if qsl[S] > T:
        return "qsl past T", None
    owner, rows = {}, []
    for r in range(S):
        k, q, a, c0 = int(kind[r]), int(qsl[r + 1] - qsl[r]), int(acc[r]), int(idx[r, 0])
        if k not in kinds:
            return f"row {r}: kind {k} not taken", None
        if (k == ROW_PAD) != (c0 == PAD_SLOT_ID):
            return f"row {r}: kind {k} vs slot {c0}", None
        if k == ROW_PAD:
            continue
        if k == ROW_DECODE and q != 1:
            return f"row {r}: decode of {q} tokens", None
        if k == ROW_SPEC and not (1 <= a <= C and q <= C):
            return f"row {r}: spec acc {a} / {q} tokens", None
        if k != ROW_SPEC and a != 1:
            return f"row {r}: acc {a} on kind {k}", None
        used = [int(s) for s in idx[r, :max(q, a, 1) if k == ROW_SPEC else 1]]
        for c, s in enumerate(used):
            if not 0 <= s < N:
                return f"row {r}: slot {s} out of range", None
            if s in used[:c]:
                return f"row {r}: slot {s} in two of its columns", None
            if owner.get(s, r) != r:
                return f"row {r}: slot {s} also in row {owner[s]}", None
            owner[s] = r
        rows.append((KIND_NAMES[k], int(qsl[r]), int(qsl[r + 1]), tuple(int(s) for s in idx[r]),
                     a if k == ROW_SPEC else 1, bool(m["hist"][r])))
    return None, rows


# --- strategies --------------------------------------------------------------------------------


def _junk():
    return st.integers(-2, N + 1)


@st.composite
def _batch(draw, step: str, T: int, S: int, C: int):
    """Batch fields of a valid batch for ``step``, then 0-2 random edits."""
    live = [k for k in STEP_KINDS[step] if k != ROW_PAD]
    free = list(draw(st.permutations(range(N))))
    idx = np.full((S, C), PAD_SLOT_ID, np.int32)
    qlen = np.zeros((S,), np.int32)
    kind = np.zeros((S,), np.int32)
    acc = np.ones((S,), np.int32)
    hist = np.array([draw(st.booleans()) for _ in range(S)])
    tokens = 0
    for r in range(S):
        k = draw(st.sampled_from([ROW_PAD] + live))
        n = {ROW_PAD: draw(st.sampled_from([0, 0, 0, 1])), ROW_PREFILL: draw(st.integers(0, T)), ROW_DECODE: 1,
             ROW_SPEC: draw(st.integers(0, C))}[k]
        a = draw(st.integers(1, C)) if k == ROW_SPEC else 1
        need = max(n, a, 1) if k == ROW_SPEC else (0 if k == ROW_PAD else 1)
        if tokens + n > T or len(free) < need:
            k, n, a, need = ROW_PAD, 0, 1, 0
        idx[r] = [free.pop() if c < need else draw(_junk()) for c in range(C)]   # unused columns: junk
        if k == ROW_PAD:
            idx[r, 0] = PAD_SLOT_ID
        kind[r], qlen[r], acc[r] = k, n, a
        tokens += n
    m = dict(qsl=np.concatenate([[0], np.cumsum(qlen)]).astype(np.int32), idx=idx, kind=kind, acc=acc, hist=hist)
    row, bad_slot = st.integers(0, S - 1), st.sampled_from([-2, N, N + 1])
    edit = st.one_of(
        st.tuples(st.just("idx"), row, st.just(0), bad_slot),                  # column 0 out of range
        st.tuples(st.just("idx"), row, st.integers(0, C - 1), st.one_of(bad_slot, _junk())),
        st.tuples(st.just("dup"), row, row),                                   # one slot in two rows
        st.tuples(st.just("qsl"), st.integers(0, S), st.integers(-2, T + 3)),
        st.tuples(st.just("len"), row, st.sampled_from([-2, -1, 1, 2, 3])),   # a row's length
        st.tuples(st.just("acc"), row, st.integers(-1, C + 2)),
        st.tuples(st.just("kind"), row, st.integers(-1, 5)),
        st.tuples(st.just("hist"), row, st.booleans()))
    edits = [draw(edit) for _ in range(draw(st.sampled_from([0, 1, 1, 2])))]
    for e in edits:
        if e[0] == "idx":
            m["idx"][e[1], e[2]] = e[3]
        elif e[0] == "len":                  # row e[1] gets e[2] more tokens, later rows shift
            m["qsl"][e[1] + 1:] += e[2]
        elif e[0] == "dup":
            m["idx"][e[2], 0] = m["idx"][e[1], 0]
        else:
            m[e[0]][e[1]] = e[2]
    return m, edits


def _metadata(m) -> BatchMetadata:
    return BatchMetadata(query_start_loc=m["qsl"], state_indices=m["idx"], row_kind=m["kind"],
                         has_initial_state=m["hist"], num_accepted_tokens=m["acc"],
                         num_tokens=np.asarray(m["qsl"][-1], np.int32))


def _describe(m, edits) -> str:
    return (f"query_start_loc={m['qsl'].tolist()}\nstate_indices={m['idx'].tolist()}\nrow_kind={m['kind'].tolist()}\n"
            f"num_accepted_tokens={m['acc'].tolist()}\nhas_initial_state={m['hist'].astype(int).tolist()}\n"
            f"edits={edits}")


# --- the runs ----------------------------------------------------------------------------------


def _cache(cfg, seed):
    rng = np.random.default_rng(seed)
    conv = rng.standard_normal(cfg.conv_state_shape(N)).astype(np.float32)
    ssm = (0.3 * rng.standard_normal(cfg.ssm_state_shape(N))).astype(np.float32)
    # Through a jitted cast: XLA-owned buffers, which can be donated (NumPy-backed ones may not).
    own = jax.jit(lambda c, s: (c.astype(cfg.act_dtype) * 1, s.astype(cfg.state_dtype) * 1))
    return GDNCache(*own(conv, ssm))


def _bits(x, y) -> bool:
    x, y = np.asarray(x), np.asarray(y)
    return x.dtype == y.dtype and x.shape == y.shape and x.tobytes() == y.tobytes()


def _refused(call, pre, reason):
    with pytest.raises(gdn_jax.InvalidBatchError, match="invalid batch, nothing was written") as ei:
        call()
    post = ei.value.caches
    assert _bits(post.conv_state, pre[0]) and _bits(post.ssm_state, pre[1]), f"refused ({reason}) but a pool changed"


def _check_step(cfg, params, pre, rows, x, b, a, out, cache):
    ref_out, ref_conv, ref_ssm = token_scan_step(cfg, params, pre[0], pre[1], rows, x, b, a)
    out64 = to_np64(out)
    owned = np.zeros((x.shape[0],), bool)
    for kind, lo, hi, *_ in rows:
        owned[lo:hi] = True
        if hi > lo:
            err = rel_rmse(out64[lo:hi], ref_out[lo:hi])
            assert err <= budget(cfg, "out"), f"{kind} row [{lo}, {hi}): output rel rmse {err:.2e}"
    assert not np.any(out64[~owned]), "tokens no live row owns must give zero output"
    np.testing.assert_array_equal(to_np64(cache.conv_state), ref_conv, err_msg="conv pool differs from the oracle")
    ssm = np.asarray(cache.ssm_state)
    written = {}
    for kind, lo, hi, slots, acc, _ in rows:
        for s in (slots[:hi - lo] if kind == "spec" else slots[:1] if hi > lo else ()):
            written[s] = "state_prefill" if kind == "prefill" else "state_decode"
    for s in range(N):
        if s in written:
            err = rel_rmse(to_np64(ssm[s]), to_np64(ref_ssm[s]))
            assert err <= budget(cfg, written[s]), f"slot {s}: state rel rmse {err:.2e}"
        else:
            assert _bits(ssm[s], pre[1][s]), f"slot {s} is not written but changed"


@pytest.mark.parametrize("step", STEPS)
@pytest.mark.parametrize("impl_isa", IMPLS)
@settings(PROFILE)
@given(data=st.data())
def test_fuzz_steps(impl_isa, step, data):
    cfg = data.draw(st.sampled_from(CFGS), label="config")
    T, S = data.draw(st.sampled_from(BUCKETS), label="bucket (T, S)")
    m, edits = data.draw(_batch(step, T, S, cfg.spec_cols), label="batch")
    seed = data.draw(st.integers(0, 2**31 - 1), label="input seed")
    note(_describe(m, edits))
    reason, rows = _verdict(m, STEP_KINDS[step], T, cfg.spec_cols)
    note(f"verdict: {reason or 'valid'}")
    event("refused" if reason else "valid")
    with impl_context(impl_isa) as impl:
        attn = paths._attention(cfg, impl)
        params = GDNParams.random(cfg, jax.random.PRNGKey(seed % 7), conv_bias=len(CFGS) > 1 and cfg is CFGS[1])
        x, b, a = random_inputs(cfg, T, np.random.default_rng(seed))
        cache = _cache(cfg, seed)
        pre = cache_bits(cache)
        run = lambda: getattr(attn, step)(jnp.asarray(x), jnp.asarray(b), jnp.asarray(a), params,  # noqa: E731
                                          cache, _metadata(m))
        if reason:
            _refused(run, pre, reason)
        else:
            out, cache = run()
            _check_step(cfg, params, pre, rows, x, b, a, out, cache)


@st.composite
def _commit_rows(draw, S: int, C: int):
    free = list(draw(st.permutations(range(N))))
    idx = np.full((S, C), PAD_SLOT_ID, np.int32)
    acc = np.ones((S,), np.int32)
    for r in range(S):
        a = draw(st.integers(1, C))
        if draw(st.booleans()) and len(free) >= a:
            idx[r] = [free.pop() if c < a else draw(_junk()) for c in range(C)]
            acc[r] = a
        else:
            idx[r, 1:] = [draw(_junk()) for _ in range(C - 1)]
            acc[r] = draw(st.integers(-1, C + 2))     # ignored on padding rows
    edits = draw(st.one_of(st.just([]), st.lists(st.one_of(
        st.tuples(st.just("idx"), st.integers(0, S - 1), st.integers(0, C - 1), _junk()),
        st.tuples(st.just("acc"), st.integers(0, S - 1), st.integers(-1, C + 2))), min_size=1, max_size=2)))
    for e in edits:
        if e[0] == "idx":
            idx[e[1], e[2]] = e[3]
        else:
            acc[e[1]] = e[2]
    return idx, acc, edits


@pytest.mark.parametrize("impl_isa", IMPLS)
@settings(PROFILE)
@given(data=st.data())
def test_fuzz_commit_accepted(impl_isa, data):
    cfg = data.draw(st.sampled_from(CFGS), label="config")
    S, C = SMALL_S, cfg.spec_cols
    idx, acc, edits = data.draw(_commit_rows(S, C), label="rows")
    seed = data.draw(st.integers(0, 2**31 - 1), label="cache seed")
    note(f"spec_state_indices={idx.tolist()}\nnum_accepted_tokens={acc.tolist()}\nedits={edits}")
    # A commit is validated as a spec step of zero-length rows (paths._commit).
    live = idx[:, 0] != PAD_SLOT_ID
    m = dict(qsl=np.zeros((S + 1,), np.int32), idx=idx, kind=np.where(live, ROW_SPEC, ROW_PAD), acc=acc,
             hist=np.ones((S,), bool))
    reason, rows = _verdict(m, (ROW_PAD, ROW_SPEC), 0, C)
    note(f"verdict: {reason or 'valid'}")
    event("refused" if reason else "valid")
    with impl_context(impl_isa) as impl:
        attn = paths._attention(cfg, impl)
        cache = _cache(cfg, seed)
        pre = cache_bits(cache)
        run = lambda: attn.commit_accepted(cache, idx, acc)  # noqa: E731
        if reason:
            _refused(run, pre, reason)
            return
        cache = run()
    conv, ssm = pre[0].copy(), pre[1].copy()
    W1 = cfg.W - 1
    for _, _, _, slots, a, _ in rows:    # column 0 takes the state and conv window of column a - 1
        ssm[slots[0]] = pre[1][slots[a - 1]]
        win = (slice(a - 1, a - 1 + W1),)
        if cfg.conv_state_layout == "SD":
            conv[slots[0], :W1] = pre[0][slots[0]][win]
        else:
            conv[slots[0], :, :W1] = pre[0][slots[0]][:, a - 1:a - 1 + W1]
    assert _bits(cache.ssm_state, ssm) and _bits(cache.conv_state, conv)
