"""Trace-time validation of shapes, dtypes and layouts, and decoding of kernel status codes.

Static mistakes raise ``ValueError``/``TypeError`` naming the argument and what was expected,
before anything is dispatched. Data-dependent mistakes are found by the kernels before any
write and come back as a status vector ``int32[4] = (code, row, value, aux)``; the codes
mirror ``ffi/src/validate.h``.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

ACT_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))
STATE_DTYPES = ACT_DTYPES
CONV_LAYOUTS = ("SD", "DS")
ACTIVATIONS = ("silu", None, "identity")
PAD_SLOT_ID = -1


def _shape(x) -> tuple:
    return tuple(getattr(x, "shape", ()))


def check_rank(name: str, x, rank: int, expected: str) -> tuple:
    shape = _shape(x)
    if len(shape) != rank:
        raise ValueError(f"{name} must be {expected} (rank {rank}), got shape {shape}")
    return shape


def check_shape(name: str, x, shape: tuple, expected: str) -> None:
    if _shape(x) != tuple(shape):
        raise ValueError(f"{name} must be {expected} = {tuple(shape)}, got shape {_shape(x)}")


_SUB_BYTE = ("int4", "uint4", "int2", "uint2", "int1", "uint1", "float4_e2m1fn")


def check_byte_dtype(name: str, dtype) -> None:
    """Pools are moved and zeroed as whole slots of bytes; XLA packs narrower types (int4 ...)
    two or more to a byte, which a slot's byte range cannot address."""
    dt = np.dtype(dtype)
    bits = getattr(jax.dtypes, "itemsize_bits", None)
    narrow = bits(dt) < 8 if bits is not None else dt.name in _SUB_BYTE
    if narrow:
        raise TypeError(f"{name}: dtype {dt.name} is narrower than a byte; pools take dtypes of 8 bits or more")


def check_dtype(name: str, x, allowed, what: str | None = None) -> jnp.dtype:
    dt = jnp.dtype(x.dtype)
    allowed = tuple(jnp.dtype(a) for a in allowed)
    if dt not in allowed:
        names = ", ".join(a.name for a in allowed)
        raise TypeError(f"{name} must have dtype {what or names}, got {dt.name}")
    return dt


def check_same_dtype(name: str, x, ref_name: str, ref) -> None:
    if jnp.dtype(x.dtype) != jnp.dtype(ref.dtype):
        raise TypeError(f"{name} must have the dtype of {ref_name} ({jnp.dtype(ref.dtype).name}), got {jnp.dtype(x.dtype).name}")


def check_index(name: str, x, shape: tuple, expected: str) -> None:
    check_shape(name, x, shape, expected)
    check_dtype(name, x, (jnp.int32,), "int32")


def check_bool(name: str, x, shape: tuple, expected: str) -> None:
    check_shape(name, x, shape, expected)
    check_dtype(name, x, (jnp.bool_,), "bool")


def check_heads(H: int, HV: int) -> int:
    if H <= 0 or HV % H != 0:
        raise ValueError(f"value heads HV={HV} must be a positive multiple of key heads H={H} (GQA: HV % H == 0)")
    return HV // H


def check_activation(activation) -> bool:
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be 'silu' or None, got {activation!r}")
    return activation == "silu"


def check_layout(layout: str) -> int:
    if layout not in CONV_LAYOUTS:
        raise ValueError(f"conv_state_layout must be 'SD' ([N, L, D]) or 'DS' ([N, D, L]), got {layout!r}")
    return CONV_LAYOUTS.index(layout)


def conv_state_dims(conv_state, layout: str, D: int) -> tuple[int, int]:
    """(N, L) of a conv-state pool, checking it against D and the layout."""
    shape = check_rank("conv_state", conv_state, 3, "[N, L, D]" if layout == "SD" else "[N, D, L]")
    if layout == "SD":
        N, L, d = shape
        if d != D:
            raise ValueError(f"conv_state (SD layout) must be [N, L, D] with D={D}, got shape {shape}")
    else:
        N, d, L = shape
        if d != D:
            raise ValueError(f"conv_state (DS layout) must be [N, D, L] with D={D}, got shape {shape}")
    return N, L


def check_qkv(q, k, v) -> tuple[int, int, int, int, int]:
    """q, k [T, H, K], v [T, HV, V] of one activation dtype; returns (T, H, K, HV, V)."""
    T, H, K = check_rank("q", q, 3, "[T, H, K]")
    check_shape("k", k, (T, H, K), "[T, H, K] like q")
    Tv, HV, V = check_rank("v", v, 3, "[T, HV, V]")
    if Tv != T:
        raise ValueError(f"v must be [T, HV, V] with T={T} like q, got shape {_shape(v)}")
    check_dtype("q", q, ACT_DTYPES)
    check_same_dtype("k", k, "q", q)
    check_same_dtype("v", v, "q", q)
    check_heads(H, HV)
    return T, H, K, HV, V


def check_ssm_state(ssm_state, HV: int, K: int, V: int) -> int:
    shape = check_rank("ssm_state", ssm_state, 4, "[N, HV, K, V]")
    if shape[1:] != (HV, K, V):
        raise ValueError(f"ssm_state must be [N, HV, K, V] = [N, {HV}, {K}, {V}] (k-major), got shape {shape}")
    check_dtype("ssm_state", ssm_state, STATE_DTYPES)
    return shape[0]


def check_gate_params(A_log, dt_bias, HV: int) -> None:
    check_shape("A_log", A_log, (HV,), "[HV]")
    check_dtype("A_log", A_log, ACT_DTYPES)
    check_shape("dt_bias", dt_bias, (HV,), "[HV]")
    check_dtype("dt_bias", dt_bias, ACT_DTYPES)


# --- kernel status --------------------------------------------------------------------------

STATUS_MESSAGES = {
    1: "query_start_loc[0] must be 0, got {value}",
    2: "query_start_loc must be non-decreasing: query_start_loc[{row_plus_1}] = {value} < query_start_loc[{row}] = {aux}",
    3: "query_start_loc[-1] = {value} is past the number of tokens T = {aux}",
    4: "row {row}: slot {value} (column {aux}) is outside [0, N) and is not PAD_SLOT_ID (-1)",
    5: "row {row}: slot {value} is also named by row {aux}; a slot may be named once per step",
    6: "row {row}: num_accepted_tokens = {value} is outside [1, {aux}]",
    7: "row {row}: {value} tokens, more than the {aux} this path allows (num_spec + 1)",
    8: "row {row}: slot {value} is named by two of its used columns; each token's state needs a slot of its "
       "own (a slot may be named once per step)",
    9: "row {row}: dst slot {value} is outside [0, {aux}) and is not PAD_SLOT_ID (-1)",
    10: "row {row}: src slot {value} is outside [0, {aux}) (its dst is not PAD_SLOT_ID)",
}


def status_message(op: str, status) -> str | None:
    """Human-readable message for a kernel status vector, or None when it is OK."""
    code, row, value, aux = (int(v) for v in np.asarray(status).reshape(-1)[:4])
    if code == 0:
        return None
    template = STATUS_MESSAGES.get(code, "unknown status code {code} (row {row}, value {value}, aux {aux})")
    detail = template.format(code=code, row=row, row_plus_1=row + 1, value=value, aux=aux)
    return f"gdn_jax.{op}: invalid batch, nothing was written: {detail}"


class InvalidBatchError(ValueError):
    """A batch that a kernel refused before writing anything; the caches are unchanged.

    ``caches`` holds the (unchanged) caches returned by the step, so that a caller that
    donated them can keep serving.
    """

    def __init__(self, message: str, caches=None):
        super().__init__(message)
        self.caches = caches


# --- the same data checks in jnp, for the reference path ------------------------------------
# They return the status vector the kernels would, so that both implementations refuse the
# same batches and leave the caches unchanged.


def _first(mask):
    """(any, index of the first True) of a 1-D bool array; (False, 0) when it is empty."""
    if mask.shape[0] == 0:  # argmax has no empty form (a batch of 0 rows or 0 slots)
        return jnp.bool_(False), jnp.int32(0)
    return jnp.any(mask), jnp.argmax(mask).astype(jnp.int32)


def _status(code, row, value, aux=0):
    return jnp.stack([jnp.int32(code), jnp.asarray(row, jnp.int32), jnp.asarray(value, jnp.int32),
                      jnp.asarray(aux, jnp.int32)])


def _pick(checks):
    """First failing check of a list of (failed, status) pairs, else zeros."""
    out = jnp.zeros((4,), jnp.int32)
    for failed, st in reversed(checks):
        out = jnp.where(failed, st, out)
    return out


def status_qsl_jnp(qsl, T: int):
    S = qsl.shape[0] - 1
    checks = [(qsl[0] != 0, _status(1, 0, qsl[0]))]
    if S > 0:
        bad, r = _first(qsl[1:] < qsl[:-1])
        checks.append((bad, _status(2, r, qsl[r + 1], qsl[r])))
    checks.append((qsl[S] > T, _status(3, S, qsl[S], T)))
    return _pick(checks)


def _slot_checks(slots, used, rows, cols, N: int):
    """slots/used/rows/cols: flat arrays of the slots a batch names; range and distinctness
    (two rows, or two used columns of one row, naming one slot)."""
    bad_range = used & ((slots < 0) | (slots >= N))
    br, i = _first(bad_range)
    n = slots.shape[0]
    same = (slots[:, None] == slots[None, :]) & used[:, None] & used[None, :]
    # Report the later row of the first clash, as the kernel does (it sorts by slot then row);
    # within one row the later column.
    pos = jnp.arange(n)
    later_col = (rows[:, None] == rows[None, :]) & (pos[:, None] > pos[None, :])
    later = same & ((rows[:, None] > rows[None, :]) | later_col)
    flat = later.reshape(-1)
    bd, j = _first(flat)
    a_, b_ = j // max(n, 1), j % max(n, 1)
    code = jnp.where(rows[a_] == rows[b_], 8, 5)
    return [(br, _status(4, rows[i], slots[i], cols[i])), (bd, _status(code, rows[a_], slots[a_], rows[b_]))]


def status_slots_jnp(qsl, idx, T: int, N: int):
    S = idx.shape[0]
    if S == 0:  # no rows: only query_start_loc can be wrong
        return status_qsl_jnp(qsl, T)
    rows = jnp.arange(S, dtype=jnp.int32)
    checks = [(status_qsl_jnp(qsl, T)[0] != 0, status_qsl_jnp(qsl, T))]
    checks += _slot_checks(idx, idx != PAD_SLOT_ID, rows, jnp.zeros_like(rows), N)
    return _pick(checks)


def status_spec_jnp(qsl, idx2d, num_accepted, T: int, N: int, max_tokens: int, max_accepted: int, slot_cols: bool):
    """Mirror of check_spec_rows: slot_cols=False checks only column 0 (conv buffer)."""
    S, C = idx2d.shape
    st_qsl = status_qsl_jnp(qsl, T)
    if S == 0:
        return st_qsl
    live = idx2d[:, 0] != PAD_SLOT_ID
    q = qsl[1:] - qsl[:-1]
    rows = jnp.arange(S, dtype=jnp.int32)
    bad_acc, ra = _first(live & ((num_accepted < 1) | (num_accepted > max_accepted)))
    bad_len, rl = _first(live & (q > max_tokens))
    # The kernel checks rows in order, acc before length, so report the earliest row.
    acc_first = bad_acc & (~bad_len | (ra <= rl))
    checks = [(st_qsl[0] != 0, st_qsl),
              (acc_first, _status(6, ra, num_accepted[ra], max_accepted)),
              (bad_len, _status(7, rl, q[rl], max_tokens)),
              (bad_acc, _status(6, ra, num_accepted[ra], max_accepted))]
    if slot_cols:
        ncols = jnp.maximum(q, num_accepted)
        colid = jnp.arange(C, dtype=jnp.int32)
        used = live[:, None] & (colid[None, :] < ncols[:, None])
        checks += _slot_checks(idx2d.reshape(-1), used.reshape(-1), jnp.repeat(rows, C),
                               jnp.tile(colid, S), N)
    else:
        checks += _slot_checks(idx2d[:, 0], live, rows, jnp.zeros_like(rows), N)
    return _pick(checks)


def status_copy_slots_jnp(src, dst, N: int):
    """Mirror of the copy_slots handler's checks: slots in range, each dst once, and no slot
    that one row reads while another writes it."""
    S = dst.shape[0]
    if S == 0:
        return jnp.zeros((4,), jnp.int32)
    rows = jnp.arange(S, dtype=jnp.int32)
    live = dst != PAD_SLOT_ID
    bad_dst, i = _first(live & ((dst < 0) | (dst >= N)))
    bad_src, j = _first(live & ((src < 0) | (src >= N)))
    checks = [(bad_dst, _status(9, rows[i], dst[i], N)), (bad_src, _status(10, rows[j], src[j], N))]
    checks += _slot_checks(dst, live, rows, jnp.zeros_like(rows), N)[1:]
    # src of row r == dst of another row w
    clash = (src[:, None] == dst[None, :]) & live[:, None] & live[None, :] & (rows[:, None] != rows[None, :]) & \
        (src != dst)[:, None]
    bc, k = _first(clash.reshape(-1))
    r, w = k // max(S, 1), k % max(S, 1)
    checks.append((bc, _status(5, jnp.maximum(r, w), src[r], jnp.minimum(r, w))))
    return _pick(checks)
