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
from jax import lax

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


_INT32 = np.iinfo(np.int32)


def host_int32(name: str, x):
    """The host-side half of an index check, for a NumPy / Python value before it reaches jit.

    With x64 off, JAX turns an int64 array into int32 at the jit boundary and wraps values
    outside int32 (2**32 + 1 becomes slot 1) before the traced ``check_index`` sees them: such
    values raise ``ValueError`` naming ``name`` here, and integer arrays come back as int32.
    Other dtypes pass unchanged (a float array reaches ``check_index`` as one and raises
    ``TypeError`` there); jax arrays, tracers and None pass unchanged.
    """
    if x is None or isinstance(x, (jax.Array, jax.core.Tracer)):
        return x
    a = np.asarray(x)
    if a.dtype == np.int32 or a.dtype.kind not in "iu":  # int32: nothing to check or convert
        return a
    if a.size and (int(a.min()) < _INT32.min or int(a.max()) > _INT32.max):
        bad = a[(a < _INT32.min) | (a > _INT32.max)].reshape(-1)[0]
        raise ValueError(f"{name} holds {int(bad)}, outside int32 (indices and counts are int32)")
    return a.astype(np.int32)


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
    if code == 4 and value == PAD_SLOT_ID:  # a live row's used column, not a slot out of range
        template = ("row {row}: column {aux} names PAD_SLOT_ID (-1), but the row uses it (a spec row uses "
                    "columns [0, max(q, num_accepted_tokens))); a used column needs a slot")
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


def pick_first(checks):
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
    return pick_first(checks)


def first_row_failure(checks, S: int):
    """The kernels check rows in order and report a row's first failing check: ``checks`` is a
    list of per-row (failed [S], code, value [S], aux [S]) in the kernel's order."""
    code = jnp.zeros((S,), jnp.int32)
    value = jnp.zeros((S,), jnp.int32)
    aux = jnp.zeros((S,), jnp.int32)
    for bad, c, v, a in reversed(checks):
        code = jnp.where(bad, jnp.int32(c), code)
        value = jnp.where(bad, jnp.asarray(v, jnp.int32), value)
        aux = jnp.where(bad, jnp.asarray(a, jnp.int32), aux)
    any_row, r = _first(code != 0)
    return any_row, _status(code[r], r, value[r], aux[r])


def used_slots(idx2d, live, ncols, N: int):
    """The entries a row uses (columns [0, ncols) of its row of ``idx2d [S, C]``, live rows) and
    the per-row range check of the kernels: (failed, 4, first bad slot, its column). Returns
    (used [S, C], out_of_range [S, C], check)."""
    colid = jnp.arange(idx2d.shape[1], dtype=jnp.int32)
    used = live[:, None] & (colid[None, :] < ncols[:, None])
    out_of_range = used & ((idx2d < 0) | (idx2d >= N))
    col = jnp.argmax(out_of_range, axis=1).astype(jnp.int32)
    val = jnp.take_along_axis(idx2d, col[:, None], axis=1)[:, 0]
    return used, out_of_range, (jnp.any(out_of_range, axis=1), 4, val, col)


def slot_clash(idx2d, used):
    """A slot named twice among the ``used`` entries of ``idx2d [S, C]``, found as the kernels
    find it (validate.cc): sort by (slot, row), the first equal neighbours; code 5 for two rows,
    8 for two columns of one row. O(n log n)."""
    S, C = idx2d.shape
    if S * C < 2:  # one entry cannot clash with anything
        return jnp.bool_(False), jnp.zeros((4,), jnp.int32)
    big = jnp.int32(np.iinfo(np.int32).max)
    rows = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32)[:, None], (S, C)).reshape(-1)
    ss, sr = lax.sort((jnp.where(used, idx2d, big).reshape(-1), rows), num_keys=2)
    clash, j = _first((ss[1:] == ss[:-1]) & (ss[1:] != big))
    return clash, _status(jnp.where(sr[j + 1] == sr[j], 8, 5), sr[j + 1], ss[j + 1], sr[j])


def status_slots_jnp(qsl, idx, T: int, N: int):
    """Mirror of check_slots: query_start_loc, each row's slot in [0, N) or -1, no slot twice."""
    S = idx.shape[0]
    st_qsl = status_qsl_jnp(qsl, T)
    if S == 0:  # no rows: only query_start_loc can be wrong
        return st_qsl
    live = idx != PAD_SLOT_ID
    bad = live & ((idx < 0) | (idx >= N))
    br, i = _first(bad)
    dup, st_dup = slot_clash(idx[:, None], live[:, None])
    return pick_first([(st_qsl[0] != 0, st_qsl), (br, _status(4, i, idx[i], 0)), (dup, st_dup)])


def status_spec_jnp(qsl, idx2d, num_accepted, T: int, N: int, max_tokens: int, max_accepted: int, slot_cols: bool):
    """Mirror of check_spec_rows: slot_cols=False checks only column 0 (conv buffer)."""
    S = idx2d.shape[0]
    st_qsl = status_qsl_jnp(qsl, T)
    if S == 0:
        return st_qsl
    live = idx2d[:, 0] != PAD_SLOT_ID
    q = qsl[1:] - qsl[:-1]
    acc = num_accepted
    ncols = jnp.maximum(q, acc) if slot_cols else jnp.ones((S,), jnp.int32)
    used, _, range_check = used_slots(idx2d, live, ncols, N)
    bad_row, st_row = first_row_failure([
        (live & ((acc < 1) | (acc > max_accepted)), 6, acc, jnp.full((S,), max_accepted)),
        (live & (q > max_tokens), 7, q, jnp.full((S,), max_tokens)),
        range_check], S)
    dup, st_dup = slot_clash(idx2d, used)
    return pick_first([(st_qsl[0] != 0, st_qsl), (bad_row, st_row), (dup, st_dup)])


def status_copy_slots_jnp(src, dst, N: int):
    """Mirror of the copy_slots handler's checks: per row dst then src in range, each dst once,
    and no slot that one row reads while another writes it."""
    S = dst.shape[0]
    if S == 0:
        return jnp.zeros((4,), jnp.int32)
    rows = jnp.arange(S, dtype=jnp.int32)
    live = dst != PAD_SLOT_ID
    n_ = jnp.full((S,), N)
    bad_row, st_row = first_row_failure([(live & ((dst < 0) | (dst >= N)), 9, dst, n_),
                                         (live & ((src < 0) | (src >= N)), 10, src, n_)], S)
    dup, st_dup = slot_clash(dst[:, None], live[:, None])
    # src of row r == dst of another row w
    clash = (src[:, None] == dst[None, :]) & live[:, None] & live[None, :] & (rows[:, None] != rows[None, :]) & \
        (src != dst)[:, None]
    bc, k = _first(clash.reshape(-1))
    r, w = k // S, k % S
    st_rw = _status(5, jnp.maximum(r, w), src[r], jnp.minimum(r, w))
    return pick_first([(bad_row, st_row), (dup, st_dup), (bc, st_rw)])
