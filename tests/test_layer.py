"""gdn_jax.layer: the whole GDN layer over hidden states.

Numbers: the layer against a float64 composition (NumPy projections and gated norm around
the float64 core oracle of serve_helpers), native and reference, through prefill, decode
and spec rows in one mixed batch; the gated norm against transformers' own module.
Structure: one executable for every mix, caches updated in place, a refused batch writes
nothing, static mistakes name the argument. (tests/test_layer_hf.py compares with
transformers' whole layer from checkpoints it wrote.)
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import f64_math as F
from gdn_jax import GDNCache, GDNConfig, InvalidBatchError, Request, build_batch
from gdn_jax.layer import PACK_BA_MIN_TOKENS, GatedDeltaNetLayer, GDNLayerConfig, GDNLayerParams
from gdn_jax.checkpoint import load_layer_params, save_checkpoint
from gdn_jax.ops import PackedLinearWeight, pack_linear_weight
from serve_helpers import IMPLS, NATIVE_READY, cache_bits, impl_context, oracle_step, to_np64

HIDDEN = 48
# Structural tests: the native kernels of the selected ISA in the default run; the reference
# (held to the same numbers by test_layer_step_matches_f64, but ~10-30 s of compilation per
# step) in the slow run, or by default when the extension is not built.
NATIVE_FIRST = IMPLS[1:2] + [
    pytest.param(IMPLS[0].values[0], id="reference", marks=[pytest.mark.slow] if NATIVE_READY else [])]


def make_cfg(act=jnp.float32, num_spec=2, H=2, HV=4):
    return GDNLayerConfig(hidden_size=HIDDEN, core=GDNConfig(num_k_heads=H, num_v_heads=HV, head_k_dim=16,
                                                             head_v_dim=32, num_spec=num_spec, act_dtype=act))


def layer_oracle(cfg, params, cache_np, hb, hidden):
    """Float64 layer step: NumPy in_proj -> serve_helpers.oracle_step (core) -> norm -> out_proj."""
    p = jax.tree_util.tree_map(to_np64, params)
    h = to_np64(hidden)
    T = h.shape[0]
    mixed, z, b, a = h @ p.in_proj_qkv.T, h @ p.in_proj_z.T, h @ p.in_proj_b.T, h @ p.in_proj_a.T
    o, conv, ssm = oracle_step(cfg.core, params.core, *cache_np, hb.requests, hb.token_slices, mixed, b, a)
    y = F.gated_norm_f64(o, z.reshape(T, cfg.HV, cfg.V), p.norm_weight, cfg.rms_norm_eps).reshape(T, cfg.Z)
    out = y @ p.out_proj.T
    out[hb.num_tokens:] = 0
    return out, conv, ssm


def _mixed_requests():
    return [Request.prefill(0, 9), Request.decode(4), Request.prefill(6, 5, has_initial_state=True),
            Request.spec((8, 9, 10), 3, num_accepted=2)]


# Packed projections (GDNLayerParams.packed) exist for bf16 weights only; with them a bucket of
# PACK_BA_MIN_TOKENS tokens or more also packs in_proj_b / _a into in_proj's one call.
STEP_CASES = [pytest.param(p.values[0], act, packed, bucket,
                           id=f"{p.id}-{act}" + ("-packed" if packed else "") + (f"-T{bucket}" if bucket != 24 else ""),
                           marks=[pytest.mark.slow] if (p.id == "reference" and act == "bfloat16") else [])
              for p in IMPLS for act in ("float32", "bfloat16") for packed in (False, True)
              for bucket in ((24, PACK_BA_MIN_TOKENS) if packed else (24,))
              if act == "bfloat16" or not packed]


@pytest.mark.parametrize("impl_isa,act,packed,bucket", STEP_CASES)
def test_layer_step_matches_f64(impl_isa, act, packed, bucket):
    cfg = make_cfg(jnp.dtype(act))
    rng = np.random.default_rng(2)
    params = GDNLayerParams.random(cfg, jax.random.key(3))
    N = 12
    conv0 = (0.5 * rng.standard_normal(cfg.core.conv_state_shape(N))).astype(np.float32)
    ssm0 = (0.1 * rng.standard_normal(cfg.core.ssm_state_shape(N))).astype(np.float32)
    cache = GDNCache(conv_state=jnp.asarray(conv0, cfg.act_dtype), ssm_state=jnp.asarray(ssm0))
    start = (to_np64(cache.conv_state), to_np64(cache.ssm_state))
    hb = build_batch(_mixed_requests(), num_slots=N, num_spec=2, token_bucket=bucket, row_bucket=6)
    hidden = jnp.asarray(rng.standard_normal((bucket, HIDDEN)), cfg.act_dtype)
    want, conv, ssm = layer_oracle(cfg, params, start, hb, hidden)
    with impl_context(impl_isa) as impl:
        out, cache = GatedDeltaNetLayer(cfg, impl).mixed(hidden, params.packed() if packed else params, cache, hb)
    tol = 1e-5 if act == "float32" else 8e-3   # bf16: projections, conv, core, norm and out_proj round
    assert F.rel_rmse(to_np64(out), want) <= tol
    assert not np.any(np.asarray(out, np.float32)[hb.num_tokens:])
    touched = [0, 4, 6, 8, 9, 10]
    assert F.rel_rmse(to_np64(cache.ssm_state)[touched], ssm[touched]) <= (1e-5 if act == "float32" else 1e-2)


@pytest.mark.skipif(not NATIVE_READY, reason="native extension not built")
@pytest.mark.parametrize("bucket", [24, PACK_BA_MIN_TOKENS])
def test_packed_in_proj_is_one_call(bucket):
    """With packed weights in_proj is one gdn_jax_linear_packed call (qkv and z; b and a too from
    PACK_BA_MIN_TOKENS tokens, else [out, in] calls of their own), out_proj another."""
    cfg = make_cfg(jnp.dtype(jnp.bfloat16))
    params = GDNLayerParams.random(cfg, jax.random.key(3)).packed()
    cache = GDNCache.create(cfg.core, 12)
    hb = build_batch(_mixed_requests(), num_slots=12, num_spec=2, token_bucket=bucket, row_bucket=6)
    hidden = jnp.zeros((bucket, HIDDEN), jnp.bfloat16)
    hlo = GatedDeltaNetLayer(cfg, "native").mixed_with_status.lower(hidden, params, cache, hb.metadata).as_text()
    assert hlo.count("@gdn_jax_linear_packed(") == 2
    assert hlo.count("@gdn_jax_linear(") == (0 if bucket >= PACK_BA_MIN_TOKENS else 2)


def _one_prefill(impl, seed, n):
    """(layer, params, cache of 8 slots, a batch of one n-token prefill in an 8-token bucket)."""
    cfg = make_cfg()
    hb = build_batch([Request.prefill(1, n)], num_slots=8, num_spec=2, token_bucket=8, row_bucket=2)
    return (GatedDeltaNetLayer(cfg, impl), GDNLayerParams.random(cfg, jax.random.key(seed)),
            GDNCache.create(cfg.core, 8), hb)


@pytest.mark.parametrize("impl_isa", NATIVE_FIRST)
def test_refused_batch_keeps_every_slot(impl_isa):
    with impl_context(impl_isa) as impl:
        layer, params, cache, hb = _one_prefill(impl, 4, 6)
        h = jnp.ones((8, HIDDEN), jnp.float32)
        _, cache = layer.prefill(h, params, cache, hb)
        before = cache_bits(cache)
        bad = dataclasses.replace(hb.metadata, state_indices=np.array([[9, -1, -1], [-1, -1, -1]], np.int32))   # 9 >= N
        with pytest.raises(InvalidBatchError, match="slot") as e:
            layer.prefill(h, params, cache, bad)
        after = cache_bits(e.value.caches)
        np.testing.assert_array_equal(before[0], after[0])
        np.testing.assert_array_equal(before[1], after[1])
        out, _ = layer.prefill(h, params, e.value.caches, hb)   # the returned cache serves on
        assert np.all(np.isfinite(np.asarray(out)))


@pytest.mark.parametrize("impl_isa", NATIVE_FIRST)
def test_padding_tokens_output_zero_whatever_their_hidden_values(impl_isa):
    """Bucket padding (tokens past query_start_loc[S]) and a refused batch output zeros even when
    the hidden values there are not finite: the core's zero times silu(z) was NaN."""
    with impl_context(impl_isa) as impl:
        layer, params, cache, hb = _one_prefill(impl, 5, 5)
        h = np.ones((8, HIDDEN), np.float32)
        h[5:] = np.array([np.nan, np.inf, -np.inf])[:, None]
        out, cache = layer.prefill(jnp.asarray(h), params, cache, hb)
        out = np.asarray(out)
        assert np.all(np.isfinite(out[:5])) and not np.any(out[5:]), out[5:]
        bad = dataclasses.replace(hb.metadata, state_indices=np.array([[9, -1, -1], [-1, -1, -1]], np.int32))
        o2, _, status = layer.prefill_with_status(jnp.full((8, HIDDEN), np.nan, jnp.float32), params, cache, bad)
        assert int(status[0]) != 0 and not np.any(np.asarray(o2))


@pytest.mark.parametrize("impl_isa", NATIVE_FIRST)
def test_tokens_of_a_padding_row_output_zero(impl_isa):
    """A padding row may own tokens (hand-built metadata; docs/reliability.md): they output zero
    whatever their hidden values, and the real row after them outputs what it does alone."""
    with impl_context(impl_isa) as impl:
        layer, params, cache, hb = _one_prefill(impl, 6, 4)
        h = np.random.default_rng(6).standard_normal((8, HIDDEN)).astype(np.float32)
        alone, _ = layer.prefill(jnp.asarray(h), params, cache, hb)    # prefill(1, 4): tokens [0, 4)
        # Row 0 pads and owns tokens [0, 2); row 1 is the same prefill on tokens [2, 6).
        meta = dataclasses.replace(hb.metadata, query_start_loc=np.array([0, 2, 6], np.int32),
                                   state_indices=np.array([[-1, -1, -1], [1, -1, -1]], np.int32),
                                   row_kind=np.array([0, 1], np.int32), has_initial_state=np.array([False, False]),
                                   num_tokens=np.array(6, np.int32))
        h2 = np.full((8, HIDDEN), np.nan, np.float32)
        h2[1] = np.inf
        h2[2:6] = h[:4]
        out, _, status = layer.prefill_with_status(jnp.asarray(h2), params, GDNCache.create(make_cfg().core, 8), meta)
        out = np.asarray(out)
        assert int(status[0]) == 0
        assert not np.any(out[:2]) and not np.any(out[6:]), out[:2]
        np.testing.assert_allclose(out[2:6], np.asarray(alone)[:4], rtol=1e-6, atol=1e-6)


def test_random_params_take_a_core_dtype_and_stay_valid():
    """``dtype`` sets the core's parameters (f32 beside a bf16 model, as checkpoints store them);
    projections and norm weight keep the act dtype, which validate requires."""
    cfg = make_cfg(jnp.bfloat16)
    p = GDNLayerParams.random(cfg, jax.random.key(2), dtype=jnp.float32).validate(cfg)
    assert {p.in_proj_qkv.dtype, p.in_proj_b.dtype, p.norm_weight.dtype, p.out_proj.dtype} == {jnp.dtype(jnp.bfloat16)}
    assert {p.core.A_log.dtype, p.core.dt_bias.dtype, p.core.conv_weight.dtype} == {jnp.dtype(jnp.float32)}


def test_packed_params(tmp_path):
    cfg = make_cfg(jnp.bfloat16)
    params = GDNLayerParams.random(cfg, jax.random.key(8))
    packed = params.packed()
    assert isinstance(packed.in_proj_qkv, PackedLinearWeight) and isinstance(packed.out_proj, PackedLinearWeight)
    assert isinstance(packed.in_proj_b, jax.Array) and isinstance(packed.in_proj_a, jax.Array)
    assert packed.packed().in_proj_qkv is packed.in_proj_qkv
    save_checkpoint(str(tmp_path), cfg, {0: packed})          # written in Hugging Face's layout
    for back in (packed.unpacked(), load_layer_params(str(tmp_path), 0, cfg)):
        for name in ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj"):
            np.testing.assert_array_equal(np.asarray(getattr(back, name), np.float32),
                                          np.asarray(getattr(params, name), np.float32))
    packed.validate(cfg)
    bad = dataclasses.replace(packed, out_proj=pack_linear_weight(params.out_proj[:, :-2]))
    with pytest.raises(ValueError, match=r"GDNLayerParams.out_proj must be packed from shape \(48, 128\)"):
        bad.validate(cfg)
    with pytest.raises(TypeError, match="GDNLayerParams.in_proj_b must be an \\[out, in\\] array"):
        dataclasses.replace(packed, in_proj_b=pack_linear_weight(params.in_proj_b)).validate(cfg)


def test_packing_f32_params_is_refused():
    params = GDNLayerParams.random(make_cfg(jnp.float32), jax.random.key(8))
    with pytest.raises(TypeError, match="GDNLayerParams.in_proj_qkv must be bfloat16 to be packed"):
        params.packed()


def test_static_mistakes_name_the_argument():
    cfg = make_cfg()
    layer = GatedDeltaNetLayer(cfg, "reference")
    params = GDNLayerParams.random(cfg, jax.random.key(5))
    cache = GDNCache.create(cfg.core, 4)
    hb = build_batch([Request.decode(0)], num_slots=4, num_spec=2, token_bucket=4, row_bucket=2)
    with pytest.raises(ValueError, match="hidden must be"):
        layer.decode(jnp.zeros((4, HIDDEN + 1)), params, cache, hb)
    with pytest.raises(TypeError, match="hidden must have dtype float32"):
        layer.decode(jnp.zeros((4, HIDDEN), jnp.bfloat16), params, cache, hb)
    bad = dataclasses.replace(params, in_proj_z=params.in_proj_z[:-1])
    with pytest.raises(ValueError, match=r"GDNLayerParams.in_proj_z must have shape \(128, 48\)"):
        layer.decode(jnp.zeros((4, HIDDEN)), bad, cache, hb)
    with pytest.raises(ValueError, match="kind must be one of"):
        layer.apply("verify", jnp.zeros((4, HIDDEN)), params, cache, hb)
    with pytest.raises(ValueError, match="tp=3 does not divide the key heads H=2"):
        cfg.local(3)
    local = cfg.local(2)
    assert (local.H, local.HV, local.hidden_size) == (1, 2, HIDDEN)


@pytest.mark.parametrize("impl_isa", NATIVE_FIRST)
def test_one_executable_for_every_mix_and_pools_in_place(impl_isa):
    cfg = make_cfg()
    params = GDNLayerParams.random(cfg, jax.random.key(6))
    mixes = [[Request.prefill(0, 7)], [Request.decode(0), Request.prefill(2, 3)],
             [Request.spec((3, 4, 5), 2), Request.decode(0)], [Request.decode(0)],
             [Request.spec((3, 4, 5), 3, num_accepted=2), Request.prefill(6, 9, has_initial_state=True)]]
    with impl_context(impl_isa) as impl:
        layer = GatedDeltaNetLayer(cfg, impl)
        cache = GDNCache.create(cfg.core, 8)
        rng = np.random.default_rng(7)
        for reqs in mixes:
            hb = build_batch(reqs, num_slots=8, num_spec=2, token_bucket=16, row_bucket=4)
            ptrs = (cache.conv_state.unsafe_buffer_pointer(), cache.ssm_state.unsafe_buffer_pointer())
            out, cache = layer(jnp.asarray(rng.standard_normal((16, HIDDEN)), jnp.float32), params, cache,
                               hb.metadata.to_device())
            if impl == "native":
                assert (cache.conv_state.unsafe_buffer_pointer(), cache.ssm_state.unsafe_buffer_pointer()) == ptrs
        assert layer.compiled_count()["mixed"] == 1


@pytest.mark.parametrize("impl_isa", NATIVE_FIRST)
def test_spec_then_commit_then_decode(impl_isa):
    """A spec row, commit_accepted, then plain decode equals decoding the accepted tokens."""
    cfg = make_cfg()
    params = GDNLayerParams.random(cfg, jax.random.key(8))
    rng = np.random.default_rng(9)
    x = jnp.asarray(rng.standard_normal((8, HIDDEN)), jnp.float32)
    with impl_context(impl_isa) as impl:
        layer = GatedDeltaNetLayer(cfg, impl)
        a = GDNCache.create(cfg.core, 8)
        b = GDNCache.create(cfg.core, 8)
        pre = build_batch([Request.prefill(0, 4)], num_slots=8, num_spec=2, token_bucket=8, row_bucket=2)
        h = jnp.zeros((8, HIDDEN), jnp.float32).at[:4].set(x[:4])
        _, a = layer.prefill(h, params, a, pre)
        _, b = layer.prefill(h, params, b, pre)
        spec = build_batch([Request.spec((0, 1, 2), 3)], num_slots=8, num_spec=2, token_bucket=8, row_bucket=2)
        _, a = layer.spec_decode(jnp.zeros((8, HIDDEN)).at[:3].set(x[4:7]), params, a, spec)
        a = layer.commit_accepted(a, np.array([[0, 1, 2], [-1, -1, -1]], np.int32), np.array([2, 1], np.int32))
        for t in (4, 5):   # the two accepted tokens, decoded one by one
            dec = build_batch([Request.decode(0)], num_slots=8, num_spec=2, token_bucket=8, row_bucket=2)
            _, b = layer.decode(jnp.zeros((8, HIDDEN)).at[:1].set(x[t:t + 1]), params, b, dec)
        dec = build_batch([Request.decode(0)], num_slots=8, num_spec=2, token_bucket=8, row_bucket=2)
        nxt = jnp.zeros((8, HIDDEN)).at[:1].set(x[7:8])
        oa, a = layer.decode(nxt, params, a, dec)
        ob, b = layer.decode(nxt, params, b, dec)
    assert F.rel_rmse(to_np64(oa[:1]), to_np64(ob[:1])) <= 1e-5
    assert F.rel_rmse(to_np64(a.ssm_state[0]), to_np64(b.ssm_state[0])) <= 1e-5
