"""Batch metadata of a serving step, its host-side builder and its device-side validation.

A step holds S rows (the row bucket) over T tokens (the token bucket). Both are static
shapes; everything else (how many rows of each kind, their lengths, slots, accepted
counts, how many tokens are real) is *data*, so one compiled program serves every mix of
prefill, decode and speculative rows that fits the bucket.

Row kinds (``row_kind``):

* ``ROW_PAD`` (0): padding; its column-0 slot is ``PAD_SLOT_ID`` (-1), it has no tokens.
* ``ROW_PREFILL`` (1): a (chunk of a) prompt. Slot ``state_indices[r, 0]``; starts from
  that slot if ``has_initial_state[r]`` else from zeros; writes its final state there.
* ``ROW_DECODE`` (2): one token continuing from slot ``state_indices[r, 0]``.
* ``ROW_SPEC`` (3): a speculative verify row of 1 + drafts tokens (at most num_spec + 1)
  over the slots ``state_indices[r, :]`` with ``num_accepted_tokens[r]`` (see contract.md).

Host side: :class:`Request` records (one per request in the step) go through
:func:`build_batch` (or a :class:`BatchBuilder` holding the static facts), which orders
and pads them into a :class:`HostBatch` and raises ``ValueError`` naming the request and
the value for every mistake, before anything is dispatched. :func:`from_vllm_metadata`
converts vLLM's GDN attention metadata fields.

Device side: :func:`batch_status` re-checks a :class:`BatchMetadata` inside the jitted
step (a batch may be built by other means) and returns a status vector; the steps run
nothing when it is not zero. :func:`status_message` turns it into text.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Iterable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from . import _checks, _native, ops

__all__ = [
    "PAD_SLOT_ID",
    "ROW_PAD",
    "ROW_PREFILL",
    "ROW_DECODE",
    "ROW_SPEC",
    "ROW_KIND_NAMES",
    "BatchMetadata",
    "Request",
    "HostBatch",
    "BatchBuilder",
    "build_batch",
    "from_vllm_metadata",
    "batch_status",
    "status_message",
]

PAD_SLOT_ID = _checks.PAD_SLOT_ID
ROW_PAD, ROW_PREFILL, ROW_DECODE, ROW_SPEC = 0, 1, 2, 3
ROW_KIND_NAMES = {ROW_PAD: "padding", ROW_PREFILL: "prefill", ROW_DECODE: "decode", ROW_SPEC: "spec"}
_KIND_OF_NAME = {v: k for k, v in ROW_KIND_NAMES.items()}


# ---------------------------------------------------------------------------------------
# the device pytree
# ---------------------------------------------------------------------------------------


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class BatchMetadata:
    """Per-step metadata, all int32/bool arrays of static shape (S rows, num_spec + 1 cols).

    Rows are contiguous in token order: row r owns tokens
    ``[query_start_loc[r], query_start_loc[r+1])``; tokens past ``query_start_loc[S]``
    are bucket padding (zero output).

    Attributes:
      query_start_loc: [S + 1] int32, non-decreasing, starts at 0, ends <= T.
      state_indices: [S, num_spec + 1] int32. Column 0 is the row's conv slot and its
        non-speculative SSM slot; columns 1.. are the spec rows' per-token SSM slots
        (ignored for other kinds). PAD_SLOT_ID (-1) in column 0 = padding row.
      row_kind: [S] int32, ROW_PAD / ROW_PREFILL / ROW_DECODE / ROW_SPEC.
      has_initial_state: [S] bool; read for prefill rows only (False: start from zeros,
        the slot's stale contents are ignored).
      num_accepted_tokens: [S] int32; for spec rows in [1, num_spec + 1] (how many tokens of
        the row's previous step were accepted; 1 after a prefill or a plain decode); 1 for
        every other row.
      num_tokens: [] int32, the number of real tokens (== query_start_loc[S]); informative.
    """

    query_start_loc: Any
    state_indices: Any
    row_kind: Any
    has_initial_state: Any
    num_accepted_tokens: Any
    num_tokens: Any

    @property
    def num_rows(self) -> int:
        """S, the row bucket (static)."""
        return int(self.row_kind.shape[0])

    @property
    def num_spec(self) -> int:
        return int(self.state_indices.shape[1]) - 1

    @property
    def slots(self):
        """[S] column-0 slots."""
        return self.state_indices[:, 0]

    @property
    def query_lens(self):
        return self.query_start_loc[1:] - self.query_start_loc[:-1]

    def mask(self, *kinds: int):
        """[S] bool: rows whose kind is one of ``kinds``."""
        xp = np if isinstance(self.row_kind, np.ndarray) else jnp
        m = xp.zeros(self.row_kind.shape, bool)
        for k in kinds:
            m = m | (self.row_kind == k)
        return m

    def check_shapes(self, num_spec: Optional[int] = None) -> "BatchMetadata":
        """Raise ValueError/TypeError naming the field on a shape/dtype mistake (trace time)."""
        S = _checks.check_rank("batch.row_kind", self.row_kind, 1, "[S]")[0]
        _checks.check_index("batch.row_kind", self.row_kind, (S,), "[S]")
        _checks.check_index("batch.query_start_loc", self.query_start_loc, (S + 1,), "[S + 1]")
        cols = _checks.check_rank("batch.state_indices", self.state_indices, 2, "[S, num_spec + 1]")[1]
        if num_spec is not None and cols != num_spec + 1:
            raise ValueError(f"batch.state_indices must be [S, num_spec + 1] = [{S}, {num_spec + 1}] for "
                             f"num_spec={num_spec}, got shape {tuple(self.state_indices.shape)}")
        _checks.check_index("batch.state_indices", self.state_indices, (S, cols), "[S, num_spec + 1]")
        _checks.check_bool("batch.has_initial_state", self.has_initial_state, (S,), "[S]")
        _checks.check_index("batch.num_accepted_tokens", self.num_accepted_tokens, (S,), "[S]")
        _checks.check_index("batch.num_tokens", self.num_tokens, (), "[] (a scalar)")
        return self

    @classmethod
    def empty(cls, num_rows: int, num_spec: int = 0) -> "BatchMetadata":
        """A batch of S padding rows (NumPy arrays)."""
        S = int(num_rows)
        return cls(query_start_loc=np.zeros((S + 1,), np.int32),
                   state_indices=np.full((S, num_spec + 1), PAD_SLOT_ID, np.int32),
                   row_kind=np.zeros((S,), np.int32), has_initial_state=np.zeros((S,), bool),
                   num_accepted_tokens=np.ones((S,), np.int32), num_tokens=np.zeros((), np.int32))

    def host_checked(self) -> "BatchMetadata":
        """The same metadata with its NumPy / Python index fields as int32, after refusing values
        outside int32 (ValueError naming the field): jit would wrap them into valid-looking slots.
        jax arrays pass unchanged."""
        return dataclasses.replace(self, **{
            f: _checks.host_int32(f"batch.{f}", getattr(self, f))
            for f in ("query_start_loc", "state_indices", "row_kind", "num_accepted_tokens", "num_tokens")})

    def to_device(self) -> "BatchMetadata":
        """The same metadata as jax arrays (one transfer per field)."""
        return jax.tree_util.tree_map(jnp.asarray, self.host_checked())


# ---------------------------------------------------------------------------------------
# device-side validation
# ---------------------------------------------------------------------------------------

# Codes 1..10 are the kernels' (gdn_jax._checks.STATUS_MESSAGES); the step's own start at 16.
CODE_ROW_KIND = 16
CODE_PAD_MISMATCH = 17
CODE_DECODE_LEN = 18
CODE_ACC_NOT_SPEC = 19
CODE_COMMIT_COLUMN = 20

_STEP_MESSAGES = {
    CODE_ROW_KIND: "row {row}: row_kind {value} ({kind}) is not one this step takes ({allowed})",
    CODE_PAD_MISMATCH: "row {row}: row_kind {value} ({kind}) does not match its column-0 slot {aux} "
                       "(padding rows have kind 0 and slot -1, live rows a slot >= 0)",
    CODE_DECODE_LEN: "row {row}: a decode row has {value} tokens; it must have exactly 1",
    CODE_ACC_NOT_SPEC: "row {row}: num_accepted_tokens = {value} on a {kind} row; only spec rows take "
                       "a value other than 1",
    CODE_COMMIT_COLUMN: "row {row}: the accepted column {aux} names slot {value}, which is not a valid slot",
}


def _kinds_mask_bits(kinds: Iterable[int]) -> int:
    bits = 0
    for k in kinds:
        bits |= 1 << int(k)
    return bits


def status_message(op: str, status) -> Optional[str]:
    """Text of a step status vector ``int32[4] = (code, row, value, aux)``, or None if OK."""
    st = np.asarray(status).reshape(-1)
    code, row, value, aux = (int(v) for v in st[:4])
    if code == 0:
        return None
    if code not in _STEP_MESSAGES:
        return _checks.status_message(op, st[:4])
    allowed = ", ".join(n for k, n in ROW_KIND_NAMES.items() if aux >> k & 1)
    kind = ROW_KIND_NAMES.get(aux if code == CODE_ACC_NOT_SPEC else value, "unknown kind")
    detail = _STEP_MESSAGES[code].format(row=row, value=value, aux=aux, allowed=allowed, kind=kind)
    return f"gdn_jax.{op}: invalid batch, nothing was written: {detail}"


def batch_status(batch: BatchMetadata, *, num_tokens: int, num_slots: int, kinds: Sequence[int],
                 impl: str = "auto"):
    """Device-side validation of a whole step; returns status ``int32[4]`` (0 = OK).

    Traceable (used inside the jitted steps, before any op runs). Checks, reporting the
    first failing row: ``query_start_loc`` (starts at 0, non-decreasing, ends <= T); each
    row's kind is one of ``kinds`` and matches its column-0 slot (-1 iff padding); decode
    rows have 1 token; spec rows have ``num_accepted_tokens`` in [1, num_spec + 1] and at
    most num_spec + 1 tokens, other rows accept 1; every slot the step reads or writes
    (column 0 of prefill/decode rows, columns ``< max(q, acc)`` of spec rows) is in
    [0, N); and no slot is named by two rows.

    ``impl``: "auto" | "native" | "reference", as for the ops. The native form is one custom
    call with the same answer (ffi/src/validate.cc, ``check_step_batch``); the jnp form below
    runs everywhere.
    """
    if ops.resolve_impl(impl) == "native":
        return _native.batch_status(batch.query_start_loc, batch.state_indices, batch.row_kind,
                                    batch.num_accepted_tokens, num_tokens=int(num_tokens), num_slots=int(num_slots),
                                    allowed_kinds=_kinds_mask_bits(kinds))
    qsl, idx = batch.query_start_loc, batch.state_indices
    kind, acc = batch.row_kind, batch.num_accepted_tokens
    S, C = idx.shape
    T, N = int(num_tokens), int(num_slots)
    st_qsl = _checks.status_qsl_jnp(qsl, T)
    if S == 0:  # no rows: only query_start_loc can be wrong
        return st_qsl
    q = qsl[1:] - qsl[:-1]
    col0 = idx[:, 0]
    allowed_bits = _kinds_mask_bits(kinds)
    known = (kind >= 0) & (kind <= ROW_SPEC)
    kind_ok = known & ((jnp.int32(allowed_bits) >> jnp.clip(kind, 0, 31)) & 1).astype(bool)
    is_pad = kind == ROW_PAD
    is_spec = kind == ROW_SPEC
    live = known & ~is_pad
    pad_bad = (is_pad & (col0 != PAD_SLOT_ID)) | (live & (col0 == PAD_SLOT_ID))
    dec_len_bad = (kind == ROW_DECODE) & (q != 1)
    acc_bad_spec = is_spec & ((acc < 1) | (acc > C))
    acc_bad_other = live & ~is_spec & (acc != 1)
    len_bad_spec = is_spec & (q > C)
    ncols = jnp.where(is_spec, jnp.maximum(jnp.maximum(q, acc), 1), 1)
    used, out_of_range, range_check = _checks.used_slots(idx, live, ncols, N)

    # Per row: the first failing check, in this order.
    checks = [
        (~kind_ok, CODE_ROW_KIND, kind, jnp.full((S,), allowed_bits, jnp.int32)),
        (pad_bad, CODE_PAD_MISMATCH, kind, col0),
        (acc_bad_spec, 6, acc, jnp.full((S,), C, jnp.int32)),
        (acc_bad_other, CODE_ACC_NOT_SPEC, acc, kind),
        (dec_len_bad, CODE_DECODE_LEN, q, jnp.zeros((S,), jnp.int32)),
        (len_bad_spec, 7, q, jnp.full((S,), C, jnp.int32)),
        range_check,
    ]
    any_row, st_row = _checks.first_row_failure(checks, S)
    # One slot named twice (two rows, or two used columns of one): sort, compare neighbours.
    clash, st_dup = _checks.slot_clash(idx, used & ~out_of_range)
    return _checks.pick_first([(st_qsl[0] != 0, st_qsl), (any_row, st_row), (clash, st_dup)])


# ---------------------------------------------------------------------------------------
# host side: requests -> HostBatch
# ---------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Request:
    """What the batch builder needs to know about one request in a step.

    Attributes:
      kind: "prefill", "decode" or "spec".
      num_tokens: tokens of this request in the step (decode: 1; spec: 1 + drafts).
      slots: the request's slots: ``(slot,)`` for prefill/decode, the num_spec + 1 slots of
        its spec block-table row for spec (column 0 = conv slot and the accepted-state
        slot; the columns from max(num_tokens, num_accepted) on are not used this step and
        may hold -1). An int is taken as ``(slot,)``.
      has_initial_state: prefill only: continue from the slot (a later chunk of a chunked
        prefill, or a prefix-cache hit) instead of starting from zeros.
      num_accepted: spec only: tokens of the previous step accepted, in [1, num_spec + 1]
        (1 after a prefill or a plain decode).
      id: anything that names the request in error messages.
    """

    kind: str
    num_tokens: int
    slots: Any
    has_initial_state: bool = False
    num_accepted: int = 1
    id: Any = None

    @classmethod
    def prefill(cls, slot: int, num_tokens: int, *, has_initial_state: bool = False, id: Any = None) -> "Request":
        return cls("prefill", num_tokens, (slot,), has_initial_state=has_initial_state, id=id)

    @classmethod
    def decode(cls, slot: int, *, id: Any = None) -> "Request":
        return cls("decode", 1, (slot,), has_initial_state=True, id=id)

    @classmethod
    def spec(cls, slots: Sequence[int], num_tokens: int, *, num_accepted: int = 1, id: Any = None) -> "Request":
        return cls("spec", num_tokens, tuple(slots), has_initial_state=True, num_accepted=num_accepted, id=id)


@dataclasses.dataclass
class HostBatch:
    """A built batch: the metadata plus the host-side bookkeeping to pack and unpack tokens.

    Attributes:
      metadata: :class:`BatchMetadata` of NumPy arrays (``jit`` transfers them; call
        ``metadata.to_device()`` to do it once up front).
      requests: the requests in the caller's order.
      rows: ``rows[i]`` = the row of request i.
      token_slices: ``token_slices[i] = (start, end)``, request i's tokens in the bucket.
      num_tokens: real tokens; ``token_bucket`` (T) and ``row_bucket`` (S): the bucket.
    """

    metadata: BatchMetadata
    requests: tuple
    rows: tuple
    token_slices: tuple
    num_tokens: int
    token_bucket: int
    row_bucket: int

    def pack(self, per_request: Sequence[Any], dtype=None) -> np.ndarray:
        """Stack per-request token arrays (``[n_i, ...]``, caller's order) into ``[T, ...]``.

        Bucket padding tokens are zero.
        """
        if len(per_request) != len(self.requests):
            raise ValueError(f"pack: got {len(per_request)} arrays for {len(self.requests)} requests")
        arrs = [np.asarray(a) for a in per_request]
        if not arrs:
            raise ValueError("pack: no requests, so the trailing shape is unknown; build zeros directly")
        tail = arrs[0].shape[1:]
        dt = dtype if dtype is not None else arrs[0].dtype
        out = np.zeros((self.token_bucket,) + tail, dt)
        for i, (a, (lo, hi)) in enumerate(zip(arrs, self.token_slices)):
            if a.shape != (hi - lo,) + tail:
                raise ValueError(f"pack: {_name(self.requests[i], i)} needs an array of shape "
                                 f"{(hi - lo,) + tail}, got {a.shape}")
            out[lo:hi] = a
        return out

    def unpack(self, tokens) -> list:
        """Split a ``[T, ...]`` step output into per-request arrays (caller's order)."""
        t = np.asarray(tokens)
        return [t[lo:hi] for lo, hi in self.token_slices]

    def token_row(self) -> np.ndarray:
        """[T] int32: the row of every token, -1 for bucket padding tokens."""
        qsl = np.asarray(self.metadata.query_start_loc)
        out = np.full((self.token_bucket,), -1, np.int32)
        for r in range(self.row_bucket):
            out[qsl[r]:qsl[r + 1]] = r
        return out


def _name(req, i) -> str:
    rid = getattr(req, "id", None)
    kind = getattr(req, "kind", "?")
    return f"request {i}" + (f" (id={rid!r}, {kind})" if rid is not None else f" ({kind})")


def _is_int(x) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


def _pick_bucket(what: str, need: int, buckets) -> int:
    if _is_int(buckets):
        if need > int(buckets):
            raise ValueError(f"the step needs {need} {what} but the {what} bucket holds {int(buckets)}")
        return int(buckets)
    options = sorted(int(b) for b in buckets)
    for b in options:
        if need <= b:
            return b
    raise ValueError(f"the step needs {need} {what} but the largest {what} bucket holds {options[-1] if options else 0}")


_ORDER = {"decode": 0, "spec": 1, "prefill": 2}


def _validated_slots(reqs: Sequence[Request], N: int, num_spec: int, bound: Optional[str] = None) -> list:
    """Each request checked (build_batch's rules, errors naming it by its index in ``reqs``):
    its slots as a tuple of ints. ``bound``: how an error writes N."""
    if not _is_int(num_spec) or num_spec < 0:
        raise ValueError(f"num_spec must be an int >= 0, got {num_spec!r}")
    bound = str(N) if bound is None else bound
    C = num_spec + 1
    seen: dict[int, int] = {}
    slot_rows = []
    for i, rq in enumerate(reqs):
        nm = _name(rq, i)
        kind = getattr(rq, "kind", None)
        if kind not in _ORDER:
            raise ValueError(f"{nm}: kind must be 'prefill', 'decode' or 'spec', got {kind!r}")
        n = getattr(rq, "num_tokens", None)
        if not _is_int(n) or n < 1:
            raise ValueError(f"{nm}: num_tokens must be an int >= 1, got {n!r}")
        slots = rq.slots
        slots = (slots,) if _is_int(slots) else tuple(slots)
        if not all(_is_int(s) for s in slots):
            raise ValueError(f"{nm}: slots must be ints, got {slots!r}")
        slots = tuple(int(s) for s in slots)
        acc = rq.num_accepted
        if not _is_int(acc):
            raise ValueError(f"{nm}: num_accepted must be an int, got {acc!r}")
        if kind == "spec":
            if num_spec == 0:
                raise ValueError(f"{nm}: a spec row needs a config with num_spec > 0 (spec decoding is off)")
            if n > C:
                raise ValueError(f"{nm}: a spec row has at most num_spec + 1 = {C} tokens (1 + drafts), got {n}")
            if not 1 <= acc <= C:
                raise ValueError(f"{nm}: num_accepted must be in [1, num_spec + 1 = {C}], got {acc}")
            if len(slots) != C:
                raise ValueError(f"{nm}: a spec row names num_spec + 1 = {C} slots (its block-table row), "
                                 f"got {len(slots)}: {slots!r}")
            if not rq.has_initial_state:
                raise ValueError(f"{nm}: a spec row always continues from its slots; has_initial_state must be "
                                 f"True (use a prefill row for a new request)")
        else:
            if kind == "decode" and n != 1:
                raise ValueError(f"{nm}: a decode row has exactly 1 token, got {n} (use prefill or spec)")
            if kind == "decode" and not rq.has_initial_state:
                raise ValueError(f"{nm}: a decode row always continues from its slot; has_initial_state must be "
                                 f"True (a first token is a prefill of 1 token)")
            if acc != 1:
                raise ValueError(f"{nm}: num_accepted must be 1 on a {kind} row (only spec rows take "
                                 f"accepted counts), got {acc}")
            if len(slots) != 1:
                raise ValueError(f"{nm}: a {kind} row names exactly one slot, got {len(slots)}: {slots!r}")
        used_cols = max(n, acc) if kind == "spec" else 1
        for c, s in enumerate(slots):
            if c >= used_cols:  # a spec row's column it does not use this step: never read or written
                if s != PAD_SLOT_ID and not 0 <= s < N:
                    raise ValueError(f"{nm}: slot {s} (column {c}, unused by this row's {n} tokens and "
                                     f"num_accepted {acc}) must be {PAD_SLOT_ID} or in [0, {bound})")
                continue
            if not 0 <= s < N:
                where = f"slot {s}" if len(slots) == 1 else f"slot {s} (column {c})"
                raise ValueError(f"{nm}: {where} is outside [0, {bound})")
            if s in slots[:c]:
                raise ValueError(f"{nm}: slot {s} is named by columns {slots.index(s)} and {c}; each token's "
                                 f"state needs a slot of its own (a slot may be named once per step)")
            if s in seen and seen[s] != i:
                j = seen[s]
                raise ValueError(f"{nm}: slot {s} is also named by {_name(reqs[j], j)}; a slot may be named "
                                 f"once per step")
            seen[s] = i
        slot_rows.append(slots)
    return slot_rows


def build_batch(requests: Sequence[Request], *, num_slots: int, num_spec: int = 0,
                token_bucket, row_bucket, reorder: bool = True) -> HostBatch:
    """Validate requests and lay them out as one padded step (host side, NumPy).

    Args:
      requests: the step's requests (:class:`Request` or any object with the same fields).
      num_slots: N, slots in the cache pools.
      num_spec: draft tokens per spec step of the config (0 = spec decoding off).
      token_bucket, row_bucket: T and S, an int or a sequence of sizes (the smallest that
        fits is used; each distinct (T, S) is one compiled program).
      reorder: put decode rows first, then spec rows, then prefill rows (vLLM's order;
        stable within a kind). False keeps the caller's order.
    Returns:
      :class:`HostBatch`.
    Raises:
      ValueError naming the request (index, id) and the bad value: unknown kind, a
      row without tokens, a decode row with other than 1 token, a spec row when num_spec is
      0 or with more than num_spec + 1 tokens, a wrong number of slots, a slot outside
      [0, N) (a spec row's unused columns may also hold -1), a slot named twice in the step
      (unused columns are not counted: nothing reads or writes them), num_accepted outside
      [1, num_spec + 1] (or not 1 on a non-spec row), has_initial_state=False on a
      decode/spec row, or a step larger than the bucket.
    """
    N = int(num_slots)
    if N <= 0:
        raise ValueError(f"num_slots must be positive, got {num_slots!r}")
    reqs = tuple(requests)
    slot_rows = _validated_slots(reqs, N, num_spec)
    order = sorted(range(len(reqs)), key=(lambda i: _ORDER[reqs[i].kind]) if reorder else (lambda i: 0))
    total = sum(int(r.num_tokens) for r in reqs)
    T = _pick_bucket("tokens", total, token_bucket)
    S = _pick_bucket("rows", len(reqs), row_bucket)
    meta = BatchMetadata.empty(S, num_spec)
    qsl = meta.query_start_loc
    rows = [0] * len(reqs)
    slices = [(0, 0)] * len(reqs)
    pos = 0
    for r, i in enumerate(order):
        rq = reqs[i]
        n = int(rq.num_tokens)
        rows[i] = r
        slices[i] = (pos, pos + n)
        pos += n
        qsl[r + 1] = pos
        meta.state_indices[r, :len(slot_rows[i])] = slot_rows[i]
        meta.row_kind[r] = _KIND_OF_NAME[rq.kind]
        meta.has_initial_state[r] = bool(rq.has_initial_state)
        meta.num_accepted_tokens[r] = int(rq.num_accepted)
    qsl[len(reqs) + 1:] = pos
    meta.num_tokens = np.asarray(pos, np.int32)
    return HostBatch(metadata=meta, requests=reqs, rows=tuple(rows), token_slices=tuple(slices),
                     num_tokens=pos, token_bucket=T, row_bucket=S)


@dataclasses.dataclass(frozen=True)
class BatchBuilder:
    """:func:`build_batch` with the static facts bound (from a config and a pool size).

    Example::

        builder = BatchBuilder(num_slots=64, num_spec=config.num_spec, token_bucket=256, row_bucket=32)
        hb = builder.build([Request.prefill(3, 100), Request.decode(7), ...])
    """

    num_slots: int
    num_spec: int = 0
    token_bucket: Any = 256
    row_bucket: Any = 32
    reorder: bool = True

    @classmethod
    def for_config(cls, config, *, num_slots: int, token_bucket, row_bucket, reorder: bool = True) -> "BatchBuilder":
        """``config``: a GDNConfig or a GDNLayerConfig (its ``core``)."""
        return cls(num_slots=num_slots, num_spec=getattr(config, "core", config).num_spec, token_bucket=token_bucket,
                   row_bucket=row_bucket, reorder=reorder)

    def build(self, requests: Sequence[Request]) -> HostBatch:
        return build_batch(requests, num_slots=self.num_slots, num_spec=self.num_spec,
                           token_bucket=self.token_bucket, row_bucket=self.row_bucket, reorder=self.reorder)


# ---------------------------------------------------------------------------------------
# vLLM metadata
# ---------------------------------------------------------------------------------------


def from_vllm_metadata(*, num_slots: int, num_spec: int, token_bucket, row_bucket,
                       non_spec_query_start_loc=None, non_spec_state_indices=None, num_decodes: int = 0,
                       has_initial_state=None, spec_sequence_masks=None, spec_query_start_loc=None,
                       spec_state_indices=None, num_accepted_tokens=None) -> HostBatch:
    """Convert the fields of vLLM's ``GDNAttentionMetadata`` (vllm_cpu_reference.md §3).

    Tokens keep vLLM's order (the order of ``mixed_qkv``: the batch's rows in order, spec and
    non-spec tokens interleaved as ``spec_sequence_masks`` says), so the step's output rows
    line up with vLLM's ``core_attn_out``.

    Args (NumPy / torch-like arrays, host side):
      non_spec_query_start_loc: [n_non_spec + 1] (0-based cumsum over the non-spec rows).
      non_spec_state_indices: [n_non_spec] (block_table[~mask, 0]).
      num_decodes: leading non-spec rows that are decodes (1 token, prior state).
      has_initial_state: [n_non_spec] bool (None: every non-decode row starts from zeros).
      spec_sequence_masks: [num_reqs] bool or None (no spec rows).
      spec_query_start_loc: [n_spec + 1]; spec_state_indices: [n_spec, num_spec + 1];
      num_accepted_tokens: [n_spec].
    Zero-length non-spec rows (vLLM's trailing padding) are dropped. vLLM relabels non-spec
    decodes as prefills when spec rows exist; they become prefill rows with an initial
    state here too (the same math).
    """
    def arr(x, dt):
        return None if x is None else np.asarray(x).astype(dt)

    ns_qsl = arr(non_spec_query_start_loc, np.int64)
    ns_idx = arr(non_spec_state_indices, np.int64)
    hist = arr(has_initial_state, bool)
    mask = arr(spec_sequence_masks, bool)
    sp_qsl = arr(spec_query_start_loc, np.int64)
    sp_idx = arr(spec_state_indices, np.int64)
    acc = arr(num_accepted_tokens, np.int64)
    for name, qsl in (("non_spec_query_start_loc", ns_qsl), ("spec_query_start_loc", sp_qsl)):
        if qsl is None:
            continue
        if qsl.ndim != 1 or len(qsl) == 0 or qsl[0] != 0:
            raise ValueError(f"from_vllm_metadata: {name} must be a 1-D cumsum starting at 0, got {qsl.tolist()}")
        if np.any(np.diff(qsl) < 0):
            i = int(np.argmax(np.diff(qsl) < 0))
            raise ValueError(f"from_vllm_metadata: {name} must be non-decreasing: {name}[{i + 1}] = {qsl[i + 1]} < "
                             f"{name}[{i}] = {qsl[i]}")
    n_ns = 0 if ns_qsl is None else len(ns_qsl) - 1
    n_sp = 0 if sp_qsl is None else len(sp_qsl) - 1
    if hist is not None and hist.shape != (n_ns,):
        raise ValueError(f"from_vllm_metadata: has_initial_state must have one entry per non-spec row ({n_ns}), "
                         f"got shape {hist.shape} (vLLM's per-request array restricted to ~spec_sequence_masks)")
    if sp_idx is not None and sp_idx.ndim != 2:
        raise ValueError(f"from_vllm_metadata: spec_state_indices must be [n_spec, num_spec + 1], got shape "
                         f"{sp_idx.shape}")
    if mask is None:
        if n_sp:
            raise ValueError("from_vllm_metadata: spec rows given without spec_sequence_masks")
        mask = np.zeros((n_ns,), bool)
    if int(mask.sum()) != n_sp or len(mask) - int(mask.sum()) != n_ns:
        raise ValueError(f"from_vllm_metadata: spec_sequence_masks has {int(mask.sum())} spec and "
                         f"{len(mask) - int(mask.sum())} non-spec rows, but the query_start_locs describe "
                         f"{n_sp} and {n_ns}")
    if n_ns and (ns_idx is None or len(ns_idx) < n_ns):
        raise ValueError(f"from_vllm_metadata: non_spec_state_indices needs {n_ns} entries")
    if n_sp and (sp_idx is None or sp_idx.shape[0] < n_sp or acc is None or len(acc) < n_sp):
        raise ValueError(f"from_vllm_metadata: spec_state_indices [n_spec, num_spec+1] and num_accepted_tokens "
                         f"[n_spec] need {n_sp} rows")
    if not 0 <= num_decodes <= n_ns:
        raise ValueError(f"from_vllm_metadata: num_decodes={num_decodes} is outside [0, {n_ns}]")
    reqs = []
    i_ns = i_sp = 0
    for r, is_spec in enumerate(mask):
        if is_spec:
            n = int(sp_qsl[i_sp + 1] - sp_qsl[i_sp])
            reqs.append(Request("spec", n, tuple(int(s) for s in sp_idx[i_sp]), has_initial_state=True,
                                num_accepted=int(acc[i_sp]), id=f"vllm row {r}"))
            i_sp += 1
        else:
            n = int(ns_qsl[i_ns + 1] - ns_qsl[i_ns])
            if n > 0:
                slot = int(ns_idx[i_ns])
                if i_ns < num_decodes and n_sp == 0:
                    reqs.append(Request("decode", n, (slot,), has_initial_state=True, id=f"vllm row {r}"))
                else:
                    init = i_ns < num_decodes or (hist is not None and bool(hist[i_ns]))
                    reqs.append(Request("prefill", n, (slot,), has_initial_state=init, id=f"vllm row {r}"))
            i_ns += 1
    return build_batch(reqs, num_slots=num_slots, num_spec=num_spec, token_bucket=token_bucket,
                       row_bucket=row_bucket, reorder=False)
