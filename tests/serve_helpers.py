"""Shared helpers of the serving-layer tests (test_paths.py, test_batch.py, test_examples.py).

* ``IMPLS``: the implementations the serving tests run on, as pytest params. Always
  ``reference``; plus ``native-<isa>`` for every ``gdn_jax.available_isas()`` when the
  extension is built (``GDN_JAX_SERVE_NATIVE=0`` turns them off).
* ``oracle_step``: the float64 evaluation of one serving step, request by request, straight
  from tests/f64_math.py (independent of gdn_jax's metadata encoding and masking).
* small random-input and comparison helpers.
"""
from __future__ import annotations

import contextlib
import functools
import os
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gdn_jax
import f64_math as F

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _native_status() -> tuple[bool, str]:
    if not gdn_jax.native_available():
        return False, "native extension not built"
    if os.environ.get("GDN_JAX_SERVE_NATIVE", "").strip() == "0":
        return False, "GDN_JAX_SERVE_NATIVE=0"
    return True, ""


NATIVE_READY, NATIVE_REASON = _native_status()
ISAS = gdn_jax.available_isas() if gdn_jax.native_available() else []

IMPLS = [pytest.param(("reference", None), id="reference")] + [
    pytest.param(("native", isa), id=f"native-{isa}",
                 marks=pytest.mark.skipif(not NATIVE_READY, reason=NATIVE_REASON))
    for isa in ISAS
]
# Structural checks (compiled HLO, buffer pointers) do not depend on the kernels' numbers.
# Native only: the reference is for correctness and its jnp scatters may copy or convert a pool.
IMPLS_STRUCTURAL = [pytest.param(("native", isa), id=f"native-{isa}") for isa in ISAS[:1]]


@contextlib.contextmanager
def impl_context(impl_isa):
    """``with impl_context(param) as impl:`` selects the ISA for native params."""
    impl, isa = impl_isa
    if isa is None:
        yield impl
    else:
        with gdn_jax.use_isa(isa):
            yield impl


# --- random inputs ----------------------------------------------------------------------------


def random_inputs(cfg, T, rng, scale=1.0):
    """(mixed_qkv [T, D], b [T, HV], a [T, HV]) as NumPy arrays of exact act-dtype values."""
    x = rng.standard_normal((T, cfg.D)).astype(np.float32) * scale
    b = rng.standard_normal((T, cfg.HV)).astype(np.float32)
    a = rng.standard_normal((T, cfg.HV)).astype(np.float32)
    dt = cfg.act_dtype
    return tuple(np.asarray(jnp.asarray(v, dt)) for v in (x, b, a))


def to_np64(x):
    return np.asarray(jnp.asarray(x, jnp.float32), np.float64)


def cache_np(cache):
    """(conv f64, ssm f64) copies of a GDNCache."""
    return to_np64(cache.conv_state), to_np64(cache.ssm_state)


def cache_bits(cache):
    """Exact host copies (original dtype) of both pools."""
    return np.array(cache.conv_state), np.array(cache.ssm_state)


# --- the float64 oracle ------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def _conv_op(cfg, impl, kind):
    """Jitted conv op of one implementation over a 2-row batch (row 0 padding, row 1 the request)."""
    from gdn_jax import ops

    kw = dict(activation=cfg.activation, conv_state_layout=cfg.conv_state_layout, impl=impl)
    if kind == "prefill":
        def f(x, w, bias, conv, qsl, idx, hist):
            return ops.causal_conv1d_fwd_with_status(x, weight=w, bias=bias, conv_state=conv, query_start_loc=qsl,
                                                     state_indices=idx, has_initial_state=hist, **kw)[0]
    else:
        def f(x, w, bias, conv, qsl, idx, acc):
            return ops.causal_conv1d_update_with_status(x, weight=w, bias=bias, conv_state=conv, state_indices=idx,
                                                        num_accepted_tokens=acc, query_start_loc=qsl, **kw)[0]
    return jax.jit(f)


def conv_outputs_of(cfg, params, impl, conv_pool, rq, lo, hi, x):
    """The conv op's own output for one request's tokens (what the step feeds the recurrence)."""
    kind = "prefill" if rq.kind == "prefill" else "update"
    qsl = np.array([0, lo, hi], np.int32)
    idx = np.array([-1, rq.slots[0]], np.int32)
    extra = (np.array([False, bool(rq.has_initial_state)]) if kind == "prefill" else
             np.array([1, rq.num_accepted if rq.kind == "spec" else 1], np.int32))
    y = _conv_op(cfg, impl, kind)(jnp.asarray(x), params.conv_weight, params.conv_bias, conv_pool, qsl, idx, extra)
    return to_np64(y)[lo:hi]


def oracle_step(cfg, params, conv, ssm, requests, token_slices, x, b, a, conv_impl=None, conv_pool=None):
    """Float64 evaluation of one step, request by request (tests/f64_math.py).

    conv, ssm: f64 pools before the step (conv in cfg's layout). x, b, a: the step's
    [T, ...] inputs. requests / token_slices: HostBatch.requests / .token_slices.
    Returns (out [T, HV, V], conv, ssm) in float64.

    The recurrence's inputs are the conv outputs, which the implementation stores in the act
    dtype. With ``conv_impl`` (and ``conv_pool``, the pre-step pool as a device array) and bf16
    activations, the oracle feeds the recurrence the conv op's own outputs (after checking them
    against the float64 conv within the conv budget), so the recurrence is judged on the inputs
    it really got: the contract's budgets are per op, on the same inputs, and one bf16 ulp of
    a conv output (allowed) moves a decode state by more than the decode-state budget.
    Without it, the float64 conv output rounded to the act dtype is used.
    """
    T = x.shape[0]
    w = to_np64(params.conv_weight)
    bias = None if params.conv_bias is None else to_np64(params.conv_bias)
    A_log, dt_bias = to_np64(params.A_log), to_np64(params.dt_bias)
    silu = cfg.activation == "silu"
    lay = cfg.conv_state_layout
    x64, b64, a64 = to_np64(x), to_np64(b), to_np64(a)
    out = np.zeros((T, cfg.HV, cfg.V))
    conv_new, ssm_new = conv.copy(), ssm.copy()
    bf16 = cfg.act_dtype == np.dtype(jnp.bfloat16)
    kw = dict(scale=cfg.scale, use_qk_l2norm=cfg.use_qk_l2norm, eps=cfg.l2norm_eps)
    for rq, (lo, hi) in zip(requests, token_slices):
        n = hi - lo
        slots = (rq.slots,) if isinstance(rq.slots, (int, np.integer)) else tuple(rq.slots)
        s0 = slots[0]
        xs, bs, as_ = x64[lo:hi], b64[lo:hi], a64[lo:hi]
        qsl = np.array([0, n])
        if rq.kind == "prefill":
            y, cs = F.conv_fwd_f64(xs, w, bias, conv, qsl, [s0], [rq.has_initial_state], silu, layout=lay)
        else:
            acc = rq.num_accepted if rq.kind == "spec" else 1
            y, cs = F.conv_update_f64(xs, w, bias, conv, [s0], silu, num_accepted_tokens=[acc],
                                      query_start_loc=qsl, layout=lay)
        conv_new[s0] = cs[s0]
        if bf16 and conv_impl is not None:
            y_op = conv_outputs_of(cfg, params, conv_impl, conv_pool, rq, lo, hi, x)
            err = F.rel_rmse(y_op, y)
            assert err <= 4e-3, f"{rq.kind} request: conv output rel rmse {err:.2e} > 4e-3"
            y = y_op
        elif bf16:
            y = F.bf16_round(y)
        hk = cfg.H * cfg.K
        q = y[:, :hk].reshape(n, cfg.H, cfg.K)
        k = y[:, hk:2 * hk].reshape(n, cfg.H, cfg.K)
        v = y[:, 2 * hk:].reshape(n, cfg.HV, cfg.V)
        if rq.kind == "prefill":
            g, beta = F.gating_f64(as_, bs, A_log, dt_bias)
            o, pool = F.prefill_f64(q, k, v, g, beta, ssm, qsl, [s0], [rq.has_initial_state], **kw)
            ssm_new[s0] = pool[s0]
        elif rq.kind == "decode":
            o, pool = F.decode_f64(q, k, v, as_, bs, A_log, dt_bias, ssm, [s0], **kw)
            ssm_new[s0] = pool[s0]
        else:
            idx = np.array([slots])
            o, pool = F.spec_f64(q, k, v, as_, bs, A_log, dt_bias, ssm, qsl, idx, np.array([rq.num_accepted]), **kw)
            for t in range(n):
                ssm_new[slots[t]] = pool[slots[t]]
        out[lo:hi] = o
    return out, conv_new, ssm_new


def oracle_sequence(cfg, params, x, b, a):
    """Float64 outputs and final (conv rows [0, W-1), ssm) of ONE fresh prefill of x."""
    from gdn_jax.batch import Request

    N = 1
    conv = np.zeros(cfg.conv_state_shape(N))
    ssm = np.zeros(cfg.ssm_state_shape(N))
    n = x.shape[0]
    out, conv, ssm = oracle_step(cfg, params, conv, ssm, [Request.prefill(0, n)], [(0, n)], x, b, a)
    return out, conv[0], ssm[0]


# --- budgets (contract.md, relative RMSE vs float64) --------------------------------------------


def budget(cfg, what: str) -> float:
    """what: 'out' | 'state_prefill' | 'state_decode'."""
    f32 = cfg.act_dtype == np.dtype(jnp.float32) and cfg.state_dtype == np.dtype(jnp.float32)
    if f32:
        return 1e-5
    if cfg.state_dtype == np.dtype(jnp.float32):
        return {"out": 3e-3, "state_prefill": 2e-3, "state_decode": 1e-4}[what]
    # bf16 state: one bf16 rounding per stored state on top (~2**-9 relative).
    return {"out": 4e-3, "state_prefill": 4e-3, "state_decode": 4e-3}[what]


def rel_rmse(out, ref) -> float:
    return F.rel_rmse(np.asarray(out, np.float64), np.asarray(ref, np.float64))



# --- process health: compilations, memory mappings, resident memory ----------------------------

BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


def _unregister_duration_listener(listener):
    # Public from jax 0.8.1 on; the older releases of the supported range (0.5.3-0.8.0) have only
    # the private form.
    unregister = getattr(jax.monitoring, "unregister_event_duration_listener", None)
    if unregister is None:
        from jax._src import monitoring
        unregister = monitoring._unregister_event_duration_listener_by_callback
    unregister(listener)


@contextlib.contextmanager
def compile_counter():
    """``with compile_counter() as names:`` collects the name of every function XLA compiles
    inside the block (jax.monitoring's backend-compile event)."""
    names = []

    def listener(event, duration, **kw):
        if event == BACKEND_COMPILE_EVENT:
            names.append(kw.get("fun_name", "?"))

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        yield names
    finally:
        _unregister_duration_listener(listener)


def mapping_count() -> int:
    """Lines of /proc/self/maps: the process's memory mappings (the kernel caps them at
    vm.max_map_count; each compiled XLA:CPU program adds some)."""
    with open("/proc/self/maps") as f:
        return sum(1 for _ in f)


def rss_bytes() -> int:
    """Resident set size of this process (/proc/self/statm)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


# --- the token-scan oracle of one step ----------------------------------------------------------


@functools.lru_cache(maxsize=None)
def _token_scan(scale, use_qk_l2norm, eps):
    from gdn_jax.reference import gdn_token_scan

    return jax.jit(functools.partial(gdn_token_scan, scale=scale, use_qk_l2norm=use_qk_l2norm, l2norm_eps=eps))


def token_scan_step(cfg, params, conv, ssm, rows, x, b, a):
    """One serving step evaluated row by row: the conv in float64 (tests/f64_math.py), the
    recurrence by ``gdn_jax.reference.gdn_token_scan`` (one token at a time, the pool as carry).

    rows: live rows as ``(kind, lo, hi, slots, acc, has_initial_state)`` with kind "prefill",
    "decode" or "spec", tokens [lo, hi), ``slots`` the row's columns (spec: slot of token t in
    column t, start from column acc - 1). conv, ssm: the pools before the step (host arrays).
    Returns (out f64 [T, HV, V], conv f64 in cfg's layout, ssm in the pool dtype); tokens no
    row owns give zero output.
    """
    T = x.shape[0]
    w = to_np64(params.conv_weight)
    bias = None if params.conv_bias is None else to_np64(params.conv_bias)
    silu, lay = cfg.activation == "silu", cfg.conv_state_layout
    x64, conv64 = to_np64(x), to_np64(conv)
    conv_new = conv64.copy()
    y = np.zeros((T, cfg.D))
    read = np.full((T,), -1, np.int32)
    write = np.full((T,), -1, np.int32)
    reset = np.zeros((T,), bool)
    for kind, lo, hi, slots, acc, init in rows:
        n, s0 = hi - lo, slots[0]
        qsl = np.array([0, n])
        if kind == "prefill":
            yy, cs = F.conv_fwd_f64(x64[lo:hi], w, bias, conv64, qsl, [s0], [init], silu, layout=lay)
        else:
            yy, cs = F.conv_update_f64(x64[lo:hi], w, bias, conv64, [s0], silu, num_accepted_tokens=[acc],
                                       query_start_loc=qsl, layout=lay)
        conv_new[s0], y[lo:hi] = cs[s0], yy
        for t in range(n):
            if kind == "spec":
                read[lo + t], write[lo + t] = (slots[acc - 1] if t == 0 else slots[t - 1]), slots[t]
            else:
                read[lo + t] = write[lo + t] = s0
        if kind == "prefill" and n > 0 and not init:  # a zero-length row may start at lo == T
            reset[lo] = True
    # The step stores conv outputs in the act dtype (rounded here in NumPy: no device program).
    y = F.bf16_round(y, np.float32) if cfg.act_dtype == np.dtype(jnp.bfloat16) else y.astype(np.float32)
    hk = cfg.H * cfg.K
    q = y[:, :hk].reshape(T, cfg.H, cfg.K)
    k = y[:, hk:2 * hk].reshape(T, cfg.H, cfg.K)
    v = y[:, 2 * hk:].reshape(T, cfg.HV, cfg.V)
    g, beta = F.gating_f64(to_np64(a), to_np64(b), to_np64(params.A_log), to_np64(params.dt_bias))
    scan = _token_scan(cfg.resolved_scale, cfg.use_qk_l2norm, cfg.l2norm_eps)
    o, pool = scan(q, k, v, g=g.astype(np.float32), beta=beta.astype(np.float32), ssm_state=jnp.asarray(ssm),
                   read_slot=read, write_slot=write, reset=reset)
    return to_np64(o), conv_new, np.asarray(pool)


# One small layer and bucket that the reliability tests (test_eager, test_fuzz, test_threads,
# test_soak) share, so that one pytest process compiles each of its steps once.
SMALL_CFG = gdn_jax.GDNConfig(1, 2, 16, 16, num_spec=2, act_dtype=jnp.float32)
SMALL_T, SMALL_S, SMALL_N = 16, 4, 10      # token bucket, row bucket, pool slots
