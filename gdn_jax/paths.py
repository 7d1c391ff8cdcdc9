"""Serving steps of one GDN attention layer: prefill, decode, spec decode, the mixed step
(``gdn_attention_core``) and ``commit_accepted``, jit-compiled with the cache donated.

Every step has the signature ::

    step(mixed_qkv [T, D], b [T, HV], a [T, HV], params, cache, batch) -> (output [T, HV, V], cache)

* ``mixed_qkv``: token-major conv inputs ``[q heads | k heads | v heads]``, act dtype.
* ``b``, ``a``: the raw gate inputs (beta = sigmoid(b), g = -exp(A_log) softplus(a + dt_bias)).
* ``params``: :class:`gdn_jax.config.GDNParams`; ``cache``: :class:`gdn_jax.config.GDNCache`
  (donated: use only the cache a step returns); ``batch``:
  :class:`gdn_jax.batch.BatchMetadata` (or a :class:`gdn_jax.batch.HostBatch` on the host
  wrappers).
* ``output``: the core attention output ``[T, HV, V]`` (act dtype), zero for padding rows and
  for tokens past ``batch.query_start_loc[S]``.

One compiled program per (T, S) bucket serves every mix of rows: row kinds, lengths, slots
and accepted counts are data. The config is bound statically by :class:`GDNAttention`.

How a step runs. Natively (the CPU): one native call (``gdn_jax_step``,
ffi/src/handlers/step.cc) that first checks the batch (the check of ``batch_status``), then
runs conv + gating + chunk for the prefill rows and conv update + recurrence for the decode
and spec rows, each kernel writing only its rows' tokens of the one output; nothing else of
size T x D or pool size is compiled around it. The reference (``_run_ops``, each pool flowing
through the ops once, so XLA updates it in place):

1. ``causal_conv1d_fwd`` over every row, non-prefill rows masked to PAD_SLOT_ID; then
   ``causal_conv1d_update`` (rolling buffer, ``num_accepted_tokens``) over every row, prefill
   rows masked. The two outputs cover disjoint tokens and are summed.
2. q, k, v are split from the conv output.
3. ``fused_gdn_gating`` + ``chunk_gated_delta_rule`` for the prefill rows, then
   ``fused_sigmoid_gating_delta_rule_update_spec`` for decode rows (1 token, accepted 1,
   slots ``[slot, -1, ...]``) and spec rows. The outputs are summed.

Errors. Shape/dtype mistakes raise ValueError/TypeError at trace time (nothing is donated
then). A bad batch (data) is caught by :func:`gdn_jax.batch.batch_status`'s check inside the
step (natively: inside the step call) *before any op runs*: the step then writes nothing,
returns zeros and the cache unchanged (the same buffers), and a nonzero status.
``*_with_status`` return that status; the plain host wrappers check it and raise
:class:`gdn_jax.InvalidBatchError` whose ``caches`` holds the returned, unchanged cache, so a
caller who donated its cache keeps serving. The step's validation covers every check the
kernels make (and more: row kinds, one slot across all ops), so the ops' (or the native step
call's) own statuses can only fire if the two disagree; they are reported too.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from . import _checks
from . import _native
from . import ops
from .batch import (PAD_SLOT_ID, ROW_DECODE, ROW_PAD, ROW_PREFILL, ROW_SPEC, BatchMetadata, HostBatch,
                    _kinds_mask_bits, batch_status, status_message)
from .config import GDNCache, GDNConfig, GDNParams

__all__ = [
    "STEP_KINDS",
    "GDNAttention",
    "prefill",
    "decode",
    "spec_decode",
    "gdn_attention_core",
    "commit_accepted",
    "check_status",
]

# Row kinds each step takes. "spec_decode" takes decode rows too: a spec-enabled engine
# decodes through the spec path (a row with 0 drafts).
STEP_KINDS = {
    "prefill": (ROW_PAD, ROW_PREFILL),
    "decode": (ROW_PAD, ROW_DECODE),
    "spec_decode": (ROW_PAD, ROW_DECODE, ROW_SPEC),
    "gdn_attention_core": (ROW_PAD, ROW_PREFILL, ROW_DECODE, ROW_SPEC),
}


def _first_error(*statuses):
    out = jnp.zeros((4,), jnp.int32)
    for st in reversed(statuses):
        out = jnp.where(st[0] != 0, st, out)
    return out


def _check_inputs(config: GDNConfig, mixed_qkv, b, a, params, cache, batch) -> int:
    if not isinstance(params, GDNParams):
        raise TypeError(f"params must be a GDNParams, got {type(params).__name__}")
    if not isinstance(cache, GDNCache):
        raise TypeError(f"cache must be a GDNCache, got {type(cache).__name__}")
    if not isinstance(batch, BatchMetadata):
        raise TypeError(f"batch must be a BatchMetadata (HostBatch.metadata), got {type(batch).__name__}")
    T = _checks.check_rank("mixed_qkv", mixed_qkv, 2, "[T, D]")[0]
    _checks.check_shape("mixed_qkv", mixed_qkv, (T, config.D), f"[T, D] with D = 2*H*K + HV*V = {config.D}")
    _checks.check_dtype("mixed_qkv", mixed_qkv, (config.act_dtype,), f"{config.act_dtype.name} (config.act_dtype)")
    _checks.check_shape("b", b, (T, config.HV), "[T, HV]")
    _checks.check_same_dtype("b", b, "mixed_qkv", mixed_qkv)
    _checks.check_shape("a", a, (T, config.HV), "[T, HV]")
    _checks.check_same_dtype("a", a, "mixed_qkv", mixed_qkv)
    params.validate(config)
    cache.validate(config)
    batch.check_shapes(config.num_spec)
    return T


def _run_ops(config: GDNConfig, impl: str, kind: str, x, b, a, params: GDNParams, cache: GDNCache,
             batch: BatchMetadata):
    """The ops of one step on a validated batch: (out [T, HV, V], cache, first op status). The
    reference path (native steps: _run_native), and the composition the native call is tested against."""
    kinds = STEP_KINDS[kind]
    has_prefill = ROW_PREFILL in kinds
    has_recurrent = ROW_DECODE in kinds or ROW_SPEC in kinds
    spec_cols = config.spec_cols if ROW_SPEC in kinds else 1
    rk = batch.row_kind
    idx = batch.state_indices
    col0 = idx[:, 0]
    qsl = batch.query_start_loc
    pre = rk == ROW_PREFILL
    rec = (rk == ROW_DECODE) | (rk == ROW_SPEC)
    pad = jnp.int32(PAD_SLOT_ID)
    conv, ssm = cache.conv_state, cache.ssm_state
    common_conv = dict(weight=params.conv_weight, bias=params.conv_bias, activation=config.activation,
                       conv_state_layout=config.conv_state_layout, impl=impl)
    common_rule = dict(scale=config.scale, use_qk_l2norm=config.use_qk_l2norm, l2norm_eps=config.l2norm_eps,
                       impl=impl)
    statuses = []
    y = None
    if has_prefill:
        y_p, conv, st = ops.causal_conv1d_fwd_with_status(
            x, conv_state=conv, query_start_loc=qsl, state_indices=jnp.where(pre, col0, pad),
            has_initial_state=batch.has_initial_state, **common_conv)
        statuses.append(st)
        y = y_p
    if has_recurrent:
        acc = jnp.where(rk == ROW_SPEC, batch.num_accepted_tokens, 1)
        y_r, conv, st = ops.causal_conv1d_update_with_status(
            x, conv_state=conv, state_indices=jnp.where(rec, col0, pad), num_accepted_tokens=acc,
            query_start_loc=qsl, **common_conv)
        statuses.append(st)
        y = y_r if y is None else y + y_r
    q, k, v = config.split_qkv(y)
    out = None
    if has_prefill:
        g, beta = ops.fused_gdn_gating(a, b, A_log=params.A_log, dt_bias=params.dt_bias, impl=impl)
        o_p, ssm, st = ops.chunk_gated_delta_rule_with_status(
            q, k, v, g=g, beta=beta, ssm_state=ssm, query_start_loc=qsl,
            state_indices=jnp.where(pre, col0, pad), has_initial_state=batch.has_initial_state, _mixed_qkv=y,
            **common_rule)
        statuses.append(st)
        out = o_p
    if has_recurrent:
        cols = jnp.arange(spec_cols, dtype=jnp.int32)[None, :]
        # Decode rows: [slot, -1, ...]; spec rows: their block-table row; others: padding.
        keep = (rec[:, None] & (cols == 0)) | ((rk == ROW_SPEC)[:, None] & (cols > 0))
        spec_idx = jnp.where(keep, idx[:, :spec_cols], pad)
        acc = jnp.where(rk == ROW_SPEC, batch.num_accepted_tokens, 1)
        o_r, ssm, st = ops.fused_sigmoid_gating_delta_rule_update_spec_with_status(
            q, k, v, a=a, b=b, A_log=params.A_log, dt_bias=params.dt_bias, ssm_state=ssm, query_start_loc=qsl,
            spec_state_indices=spec_idx, num_accepted_tokens=acc, _mixed_qkv=y, **common_rule)
        statuses.append(st)
        out = o_r if out is None else out + o_r
    return out, GDNCache(conv_state=conv, ssm_state=ssm), _first_error(*statuses)


def _run_native(config: GDNConfig, kind: str, x, b, a, params: GDNParams, cache: GDNCache, batch: BatchMetadata,
                status):
    """The native step: one call (ffi/src/handlers/step.cc) that runs nothing on a nonzero
    ``status``, else checks the batch itself and runs the kernels of the step's row kinds,
    each writing its rows' tokens of the one output: (out [T, HV, V], cache, status)."""
    ops._check_native_head_dims(config.K, config.V, chunked=True)
    out, conv, ssm, status = _native.step(
        x, a, b, params.A_log, params.dt_bias, params.conv_weight, params.conv_bias, cache.conv_state,
        cache.ssm_state, batch.query_start_loc, batch.state_indices, batch.row_kind, batch.has_initial_state,
        batch.num_accepted_tokens, status, silu=config.activation == "silu",
        layout=_checks.check_layout(config.conv_state_layout), scale=config.resolved_scale,
        eps=config.l2norm_eps, l2norm=config.use_qk_l2norm, allowed_kinds=_kinds_mask_bits(STEP_KINDS[kind]))
    return out, GDNCache(conv_state=conv, ssm_state=ssm), status


def _step(config: GDNConfig, impl: str, kind: str, mixed_qkv, b, a, params, cache, batch, checked=None):
    """Traceable step: (out [T, HV, V], cache, status int32[4]). Runs nothing on a bad batch.
    ``checked`` (int32[4], optional): the verdict of a check of this batch already made, possibly
    agreed with other shards (nonzero: nothing runs, this status is returned). The native step
    still makes its own check inside its one call; the reference path does not check again."""
    T = _check_inputs(config, mixed_qkv, b, a, params, cache, batch)
    if ops.resolve_impl(impl) == "native":
        # The step call runs batch_status's own check (check_step_batch) before anything else:
        # a separate batch_status call would only repeat it (3-15% of a decode step's CPU).
        status_in = jnp.zeros((4,), jnp.int32) if checked is None else checked
        return _run_native(config, kind, mixed_qkv, b, a, params, cache, batch, status_in)
    status = checked if checked is not None else batch_status(batch, num_tokens=T, num_slots=cache.num_slots,
                                                              kinds=STEP_KINDS[kind], impl=impl)
    # A refused batch runs as an all-padding batch: every op then reads and writes nothing and
    # outputs zeros. Data masking instead of a lax.cond keeps the program straight-line.
    out, new_cache, op_status = _run_ops(config, impl, kind, mixed_qkv, b, a, params, cache,
                                         _neutralise(batch, status[0] == 0))
    return out, new_cache, jnp.where(status[0] != 0, status, op_status)


def _neutralise(batch: BatchMetadata, ok) -> BatchMetadata:
    """``batch`` if ``ok`` else an all-padding batch of the same shapes (traceable)."""
    return BatchMetadata(
        query_start_loc=jnp.where(ok, batch.query_start_loc, 0),
        state_indices=jnp.where(ok, batch.state_indices, PAD_SLOT_ID),
        row_kind=jnp.where(ok, batch.row_kind, ROW_PAD),
        has_initial_state=batch.has_initial_state & ok,
        num_accepted_tokens=jnp.where(ok, batch.num_accepted_tokens, 1),
        num_tokens=jnp.where(ok, batch.num_tokens, 0))


def _commit(config: GDNConfig, impl: str, cache, spec_state_indices, num_accepted_tokens):
    """Traceable commit_accepted: (cache, status int32[4]).

    SSM: ``ssm[col0] = ssm[col acc-1]`` through ops.copy_slots (in place for every pool dtype).
    Conv: the window rows ``[acc-1, acc-1+W-1)`` of the rolling buffer move to rows
    ``[0, W-1)`` through the conv update op itself, run as a spec step of one token with
    ``num_accepted = acc-1`` whose input is the window's last row: by the op's contract it
    rewrites rows ``[0, W-1)`` as ``rows[acc-1, acc-1+W-2) ++ x`` = the window, exactly (the
    state holds raw inputs; the conv output is discarded). The pool stays in the kernel, so a
    bf16 pool is updated in place (a jnp scatter into it would convert the whole pool).
    """
    if not isinstance(cache, GDNCache):
        raise TypeError(f"cache must be a GDNCache, got {type(cache).__name__}")
    cache.validate(config)
    C = config.spec_cols
    S = _checks.check_rank("spec_state_indices", spec_state_indices, 2, "[S, num_spec + 1]")[0]
    _checks.check_index("spec_state_indices", spec_state_indices, (S, C), "[S, num_spec + 1]")
    _checks.check_index("num_accepted_tokens", num_accepted_tokens, (S,), "[S]")
    N = cache.num_slots
    col0 = spec_state_indices[:, 0]
    live = col0 != PAD_SLOT_ID
    acc = num_accepted_tokens
    # Validate like a spec step of zero-length rows: acc in [1, C], columns [0, acc) in range
    # and no slot named by two rows.
    meta = BatchMetadata(query_start_loc=jnp.zeros((S + 1,), jnp.int32), state_indices=spec_state_indices,
                         row_kind=jnp.where(live, ROW_SPEC, ROW_PAD).astype(jnp.int32),
                         has_initial_state=jnp.ones((S,), bool), num_accepted_tokens=acc,
                         num_tokens=jnp.zeros((), jnp.int32))
    status = batch_status(meta, num_tokens=0, num_slots=N, kinds=(ROW_PAD, ROW_SPEC), impl=impl)
    move = live & (acc > 1) & (status[0] == 0)     # acc == 1: already in place
    a1 = jnp.clip(acc - 1, 0, C - 1)

    # SSM state of the last accepted token -> column 0 (a memcpy per row in the native op).
    src = jnp.take_along_axis(spec_state_indices, a1[:, None], axis=1)[:, 0]
    ssm, st_ssm = ops.copy_slots_with_status(cache.ssm_state, src=jnp.where(move, src, PAD_SLOT_ID),
                                             dst=jnp.where(move, col0, PAD_SLOT_ID), impl=impl)

    # Conv window: one-token update with acc-1 whose token is the window's last row.
    slot = jnp.where(move, col0, 0)
    last = jnp.clip(acc + config.W - 3, 0, config.L - 1)           # row acc-1 + W-2
    conv = cache.conv_state
    x = conv[slot, last] if config.conv_state_layout == "SD" else conv[slot, :, last]    # [S, D]
    _, conv, st = ops.causal_conv1d_update_with_status(
        x, weight=jnp.zeros((config.D, config.W), jnp.float32), bias=None, conv_state=conv,
        state_indices=jnp.where(move, col0, PAD_SLOT_ID), num_accepted_tokens=jnp.where(move, acc - 1, 1),
        activation=None, conv_state_layout=config.conv_state_layout, impl=impl)
    st = jnp.where(st_ssm[0] != 0, st_ssm, st)
    return GDNCache(conv_state=conv, ssm_state=ssm), jnp.where(status[0] != 0, status, st)


def check_status(op: str, status, caches=None) -> None:
    """Raise :class:`gdn_jax.InvalidBatchError` (with ``caches``) if ``status`` is an error.

    Reads the status on the host (a device sync).
    """
    msg = status_message(op, np.asarray(status))
    if msg:
        raise _checks.InvalidBatchError(msg, caches=caches)


def _unwrap(batch):
    """The BatchMetadata of a HostBatch or a BatchMetadata, its host index fields checked
    (``BatchMetadata.host_checked``); anything else as it is (the step's checks name it)."""
    batch = batch.metadata if isinstance(batch, HostBatch) else batch
    return batch.host_checked() if isinstance(batch, BatchMetadata) else batch


class GDNAttention:
    """The jitted serving steps of one GDN layer configuration.

    ``GDNAttention(config, impl)`` compiles (lazily, once per (T, S) bucket and dtype set)::

        attn.prefill(mixed_qkv, b, a, params, cache, batch)            -> (out, cache)
        attn.decode(...)                                               -> (out, cache)
        attn.spec_decode(...)                                          -> (out, cache)
        attn.gdn_attention_core(...)   (also attn(...))                -> (out, cache)
        attn.commit_accepted(cache, spec_state_indices, num_accepted)  -> cache

    Shapes: mixed_qkv [T, D], b and a [T, HV], out [T, HV, V]. ``cache`` is donated to every
    step: the input cache's buffers are reused for the returned cache (deleted on the
    caller's side), so always continue with the returned one.

    Row kinds each step takes: prefill: prefill rows; decode: decode rows; spec_decode:
    decode and spec rows; gdn_attention_core: all. Padding rows everywhere. A row of another
    kind is an invalid batch.

    The plain methods are host wrappers: they accept a :class:`HostBatch` or a
    :class:`BatchMetadata`, run the jitted ``*_with_status`` function and raise
    :class:`gdn_jax.InvalidBatchError` (``.caches`` = the returned, unchanged cache) if the
    step refused the batch; that check reads the status on the host. The
    ``*_with_status`` attributes are the ``jax.jit`` objects themselves (``.lower()``,
    ``._cache_size()``) returning ``(out, cache, status int32[4])`` (commit: ``(cache,
    status)``); use them to keep steps asynchronous and check statuses later
    (:func:`check_status`). :meth:`apply` is the un-jitted traceable step, to compose inside
    a larger jitted function (for example a stack of layers whose caches are donated
    together).

    Args:
      config: :class:`GDNConfig` (static).
      impl: "auto" | "native" | "reference", passed to every op.
    """

    def __init__(self, config: GDNConfig, impl: str = "auto"):
        if not isinstance(config, GDNConfig):
            raise TypeError(f"config must be a GDNConfig, got {type(config).__name__}")
        ops.resolve_impl(impl)  # validates the name
        self.config = config
        self.impl = impl
        for kind in STEP_KINDS:
            setattr(self, f"{kind}_with_status", self._make_jit(kind))
        cfg = config

        def commit_accepted_with_status(cache, spec_state_indices, num_accepted_tokens):
            return _commit(cfg, impl, cache, spec_state_indices, num_accepted_tokens)

        self.commit_accepted_with_status = jax.jit(commit_accepted_with_status, donate_argnames="cache")

    def _make_jit(self, kind: str):
        cfg, impl = self.config, self.impl

        def step(mixed_qkv, b, a, params, cache, batch):
            return _step(cfg, impl, kind, mixed_qkv, b, a, params, cache, batch)

        step.__name__ = f"gdn_{kind}"
        step.__qualname__ = step.__name__
        return jax.jit(step, donate_argnames="cache")

    def __repr__(self) -> str:
        return f"GDNAttention({self.config!r}, impl={self.impl!r})"

    def apply(self, kind: str, mixed_qkv, b, a, params, cache, batch):
        """Un-jitted traceable step ``kind`` (a key of STEP_KINDS): (out, cache, status)."""
        if kind not in STEP_KINDS:
            raise ValueError(f"kind must be one of {tuple(STEP_KINDS)}, got {kind!r}")
        return _step(self.config, self.impl, kind, mixed_qkv, b, a, params, cache, _unwrap(batch))

    def _host(self, kind: str, mixed_qkv, b, a, params, cache, batch):
        fn = getattr(self, f"{kind}_with_status")
        out, cache, status = fn(mixed_qkv, b, a, params, cache, _unwrap(batch))
        check_status(kind, status, caches=cache)
        return out, cache

    def prefill(self, mixed_qkv, b, a, params, cache, batch):
        """Varlen (chunked) prefill: every live row is a prefill row. -> (out [T, HV, V], cache)"""
        return self._host("prefill", mixed_qkv, b, a, params, cache, batch)

    def decode(self, mixed_qkv, b, a, params, cache, batch):
        """Decode: every live row is one token continuing from its column-0 slot. -> (out, cache)"""
        return self._host("decode", mixed_qkv, b, a, params, cache, batch)

    def spec_decode(self, mixed_qkv, b, a, params, cache, batch):
        """Speculative verify step over spec rows (and decode rows = 0 drafts). -> (out, cache)"""
        return self._host("spec_decode", mixed_qkv, b, a, params, cache, batch)

    def gdn_attention_core(self, mixed_qkv, b, a, params, cache, batch):
        """The mixed step: prefill, decode and spec rows in one call. -> (out, cache)"""
        return self._host("gdn_attention_core", mixed_qkv, b, a, params, cache, batch)

    __call__ = gdn_attention_core

    def commit_accepted(self, cache, spec_state_indices, num_accepted_tokens):
        """Move each row's accepted state into its column-0 slot (leaving spec mode).

        For every row ``i`` with ``spec_state_indices[i, 0] != -1`` and ``acc =
        num_accepted_tokens[i]``: SSM slot ``spec_state_indices[i, 0]`` := slot
        ``spec_state_indices[i, acc-1]``, and rows ``[0, W-1)`` of its conv buffer := rows
        ``[acc-1, acc-1+W-1)``. Afterwards the request continues with ``num_accepted = 1``
        (plain decode, or spec). In place (the cache is donated): an index-scatter of the SSM
        states (ops.copy_slots, a memcpy per row) and the conv update op for the windows.
        Call it once per verify step: a second call with the same ``acc > 1`` moves the conv
        window again (``acc = 1`` leaves a row as it is).

        Args:
          cache: GDNCache (donated). spec_state_indices: [S, num_spec + 1] int32 (the
          rows of the step that just ran; -1 in column 0 = skip). num_accepted_tokens: [S]
          int32 in [1, num_spec + 1].
        Returns: the cache. Raises InvalidBatchError (``.caches`` = unchanged cache) on a
        bad row.
        """
        cache, status = self.commit_accepted_with_status(
            cache, _checks.host_int32("spec_state_indices", spec_state_indices),
            _checks.host_int32("num_accepted_tokens", num_accepted_tokens))
        check_status("commit_accepted", status, caches=cache)
        return cache

    def compiled_count(self) -> dict:
        """Entries of each step's jit cache (``_cache_size``): one per call signature seen (shapes,
        dtypes, and whether an argument came as NumPy or a jax array), so at least the number of
        programs compiled; XLA may compile fewer (the same program serves NumPy and device
        metadata of one bucket). Feed one kind of metadata to count compilations."""
        out = {}
        for kind in list(STEP_KINDS) + ["commit_accepted"]:
            fn = getattr(self, f"{kind}_with_status")
            out[kind] = fn._cache_size() if hasattr(fn, "_cache_size") else None
        return out


@functools.lru_cache(maxsize=64)
def _attention(config: GDNConfig, impl: str) -> GDNAttention:
    return GDNAttention(config, impl)


def prefill(mixed_qkv, b, a, params, cache, batch, *, config: GDNConfig, impl: str = "auto"):
    """Functional form of :meth:`GDNAttention.prefill` (one cached GDNAttention per (config, impl))."""
    return _attention(config, impl).prefill(mixed_qkv, b, a, params, cache, batch)


def decode(mixed_qkv, b, a, params, cache, batch, *, config: GDNConfig, impl: str = "auto"):
    """Functional form of :meth:`GDNAttention.decode`."""
    return _attention(config, impl).decode(mixed_qkv, b, a, params, cache, batch)


def spec_decode(mixed_qkv, b, a, params, cache, batch, *, config: GDNConfig, impl: str = "auto"):
    """Functional form of :meth:`GDNAttention.spec_decode`."""
    return _attention(config, impl).spec_decode(mixed_qkv, b, a, params, cache, batch)


def gdn_attention_core(mixed_qkv, b, a, params, cache, batch, *, config: GDNConfig, impl: str = "auto"):
    """Functional form of :meth:`GDNAttention.gdn_attention_core` (the mixed step)."""
    return _attention(config, impl).gdn_attention_core(mixed_qkv, b, a, params, cache, batch)


def commit_accepted(cache, spec_state_indices, num_accepted_tokens, *, config: GDNConfig, impl: str = "auto"):
    """Functional form of :meth:`GDNAttention.commit_accepted`."""
    return _attention(config, impl).commit_accepted(cache, spec_state_indices, num_accepted_tokens)
