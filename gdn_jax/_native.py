"""Thin ``jax.ffi.ffi_call`` wrappers, one per native target. No validation here (ops.py
does it): arguments arrive with checked shapes and dtypes.

Every cache argument is aliased to its result (``input_output_aliases``), so under ``jit``
with the cache donated the kernel updates it in place. Each stateful op also returns a
``status`` int32[4] (see _checks.STATUS_MESSAGES). Stateful ops use vmap_method
"sequential" (correct, but it copies the cache per batch element; fold batches into the
slot axis instead).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from ._ffi import TARGET_PREFIX, require_native

_f32 = jnp.float32
_STATUS = jax.ShapeDtypeStruct((4,), jnp.int32)


def _sds(x, dtype=None):
    return jax.ShapeDtypeStruct(x.shape, x.dtype if dtype is None else dtype)


def zero_pool(shape, dtype):
    """A new zero-filled array [shape] of dtype whose whole 2 MiB pages were advised as
    transparent huge pages before the fill (ffi/src/handlers/pool.cc). A side effect for XLA,
    so two pools of one shape in one program are never merged into one buffer."""
    require_native()
    call = jax.ffi.ffi_call(TARGET_PREFIX + "zero_pool", jax.ShapeDtypeStruct(tuple(shape), dtype),
                            has_side_effect=True)
    return call()


@jax.custom_batching.custom_vmap
def gating(a, b, A_log, dt_bias):
    """(a, b [..., HV]) -> (g, beta [..., HV] f32); the handler takes any leading dims of tokens."""
    require_native()
    call = jax.ffi.ffi_call(TARGET_PREFIX + "gating", (_sds(a, _f32), _sds(a, _f32)))
    return call(a, b, A_log, dt_bias)  # f32 or bf16 each: converted in the handler


@gating.def_vmap
def _gating_vmap(axis_size, in_batched, a, b, A_log, dt_bias):
    """Under vmap: a and b become leading token dims, the one not mapped broadcast (the
    elementwise kernel needs both of one shape); per-element A_log / dt_bias: one call each."""
    def full(x, batched):
        return x if batched else jnp.broadcast_to(x, (axis_size,) + x.shape)

    a_b, b_b, al_b, dt_b = in_batched
    if al_b or dt_b:
        args = tuple(full(x, m) for x, m in zip((a, b, A_log, dt_bias), in_batched))
        out = jax.lax.map(lambda xs: gating(*xs), args)
    else:
        out = gating(full(a, a_b), full(b, b_b), A_log, dt_bias)
    return out, (True, True)


def gated_rms_norm(o, z, weight, eps: float):
    """(o, z [..., V], weight [V], all of o's dtype) -> [..., V]: the layer's gated RMSNorm."""
    require_native()
    call = jax.ffi.ffi_call(TARGET_PREFIX + "gated_rms_norm", _sds(o), vmap_method="sequential")
    return call(o, z, weight, eps=np.float32(eps))


def _conv_params(weight, bias):
    """weight [D, W] and bias [D] as given (f32 or bf16: the kernels read either, so a bf16
    model costs no converted copy per call); no bias is a [0] array."""
    return weight, (jnp.zeros((0,), weight.dtype) if bias is None else bias)


def conv_fwd(x, weight, bias, conv_state, query_start_loc, state_indices, has_initial_state, *, silu, layout):
    require_native()
    call = jax.ffi.ffi_call(
        TARGET_PREFIX + "conv_fwd",
        (_sds(x), _sds(conv_state), _STATUS),
        input_output_aliases={3: 1},
        vmap_method="sequential",
    )
    return call(x, *_conv_params(weight, bias), conv_state, query_start_loc, state_indices, has_initial_state,
                silu=np.int32(silu), layout=np.int32(layout))


def conv_update(x, weight, bias, conv_state, query_start_loc, state_indices, num_accepted, *, silu, layout):
    require_native()
    call = jax.ffi.ffi_call(
        TARGET_PREFIX + "conv_update",
        (_sds(x), _sds(conv_state), _STATUS),
        input_output_aliases={3: 1},
        vmap_method="sequential",
    )
    return call(x, *_conv_params(weight, bias), conv_state, query_start_loc, state_indices, num_accepted,
                silu=np.int32(silu), layout=np.int32(layout))


def _o_sds(v, ssm_state):
    """o [T, HV, V]: v's shape, or from ssm_state when v is the mixed [T, D] qkv array (the
    kernels then read q, k, v from its rows; see ffi/src/handlers/common.h)."""
    if v.ndim == 3:
        return _sds(v)
    return jax.ShapeDtypeStruct((v.shape[0], ssm_state.shape[1], ssm_state.shape[3]), v.dtype)


def recurrent(q, k, v, a, b, A_log, dt_bias, ssm_state, query_start_loc, state_indices, num_accepted,
              *, scale, eps, l2norm):
    """q, k [T, H, K], v [T, HV, V]; or q = k = v = the mixed [T, D] qkv array."""
    require_native()
    call = jax.ffi.ffi_call(
        TARGET_PREFIX + "recurrent",
        (_o_sds(v, ssm_state), _sds(ssm_state), _STATUS),
        input_output_aliases={7: 1},
        vmap_method="sequential",
    )
    return call(q, k, v, a, b, A_log, dt_bias, ssm_state, query_start_loc,
                state_indices, num_accepted, scale=np.float32(scale), eps=np.float32(eps),
                l2norm=np.int32(l2norm))


def chunk(q, k, v, g, beta, ssm_state, query_start_loc, state_indices, has_initial_state, *, scale, eps, l2norm):
    """q, k [T, H, K], v [T, HV, V]; or q = k = v = the mixed [T, D] qkv array."""
    require_native()
    call = jax.ffi.ffi_call(
        TARGET_PREFIX + "chunk",
        (_o_sds(v, ssm_state), _sds(ssm_state), _STATUS),
        input_output_aliases={5: 1},
        vmap_method="sequential",
    )
    return call(q, k, v, g.astype(_f32), beta.astype(_f32), ssm_state, query_start_loc, state_indices,
                has_initial_state, scale=np.float32(scale), eps=np.float32(eps), l2norm=np.int32(l2norm))


def copy_slots(pool, src, dst):
    """pool[dst[i]] = pool[src[i]] in place for rows with dst[i] != -1 -> (pool, status)."""
    require_native()
    call = jax.ffi.ffi_call(
        TARGET_PREFIX + "copy_slots", (_sds(pool), _STATUS), input_output_aliases={0: 0},
        vmap_method="sequential",
    )
    return call(pool, src, dst)


def report(x, status, *, op, templates):
    """x unchanged (aliased, no copy); prints the status message to stderr when status is an error."""
    require_native()
    call = jax.ffi.ffi_call(TARGET_PREFIX + "report", _sds(x), input_output_aliases={0: 0},
                            vmap_method="sequential")
    return call(x, status, op=op, templates=templates)


def batch_status(query_start_loc, state_indices, row_kind, num_accepted_tokens, *, num_tokens, num_slots,
                 allowed_kinds):
    """A serving step's metadata checked in one native call -> status int32[4] (batch.batch_status)."""
    require_native()
    call = jax.ffi.ffi_call(TARGET_PREFIX + "batch_status", _STATUS, vmap_method="sequential")
    return call(query_start_loc, state_indices, row_kind, num_accepted_tokens, num_tokens=np.int64(num_tokens),
                num_slots=np.int64(num_slots), allowed_kinds=np.int32(allowed_kinds))


def step(x, a, b, A_log, dt_bias, weight, bias, conv_state, ssm_state, query_start_loc, state_indices, row_kind,
         has_initial_state, num_accepted, status, *, silu, layout, scale, eps, l2norm, allowed_kinds):
    """One serving step in one call (ffi/src/handlers/step.cc): the caller's batch ``status``
    (int32[4]; nonzero: nothing runs, the output is zero), the step's own check, then gating and
    the conv fused with the chunk for the prefill rows and conv update + recurrence for the
    decode / spec rows, each writing its rows' tokens of one output. x [T, D]; state_indices [S, C].
    -> (o [T, HV, V], conv_state, ssm_state, status int32[4])."""
    require_native()
    T = x.shape[0]
    HV, V = ssm_state.shape[1], ssm_state.shape[3]
    call = jax.ffi.ffi_call(
        TARGET_PREFIX + "step",
        (jax.ShapeDtypeStruct((T, HV, V), x.dtype), _sds(conv_state), _sds(ssm_state), _STATUS,
         _sds(x), jax.ShapeDtypeStruct((2, T, HV), _f32)),    # scratch: y (decode/spec rows' conv), g and beta
        input_output_aliases={7: 1, 8: 2},
        vmap_method="sequential",
    )
    o, conv_state, ssm_state, st, _, _ = call(
        x, a, b, A_log, dt_bias, *_conv_params(weight, bias), conv_state, ssm_state, query_start_loc, state_indices,
        row_kind, has_initial_state, num_accepted, status, silu=np.int32(silu), layout=np.int32(layout),
        scale=np.float32(scale), eps=np.float32(eps), l2norm=np.int32(l2norm), allowed_kinds=np.int32(allowed_kinds))
    return o, conv_state, ssm_state, st


def linear(x, w, out_dtype=None):
    """x [T, in] @ w [out, in].T -> [T, out] in ``out_dtype`` (default x's dtype): f32
    accumulation, one rounding; x and w each f32 or bf16 (w in Hugging Face's layout)."""
    require_native()
    out = jax.ShapeDtypeStruct((x.shape[0], w.shape[0]), x.dtype if out_dtype is None else out_dtype)
    call = jax.ffi.ffi_call(TARGET_PREFIX + "linear", out, vmap_method="sequential")
    return call(x, w)


def linear_packed(x, w_datas, n_outs, out_dtype=None):
    """x [T, in] @ w_i.T -> tuple of [T, n_outs[i]], each w_i packed (ops.pack_linear_weight;
    ``w_datas[i]`` [ceil(n_outs[i] / 16), ceil(in / 2), 16, 2] bf16), 1 to 8 of them in one
    call (x read once); as :func:`linear` otherwise."""
    require_native()
    dt = x.dtype if out_dtype is None else out_dtype
    outs = [jax.ShapeDtypeStruct((x.shape[0], int(n)), dt) for n in n_outs]
    call = jax.ffi.ffi_call(TARGET_PREFIX + "linear_packed", outs, vmap_method="sequential")
    return tuple(call(x, *w_datas))
