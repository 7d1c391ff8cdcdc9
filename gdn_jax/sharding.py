"""GDN sharded over a ``jax.sharding.Mesh``: tensor parallelism over whole key-head groups
(axis ``"model"``) and data parallelism over requests and cache slots (axis ``"data"``).

Runs on JAX's own engine: ``shard_map`` around the unsharded traceable step (the native
custom calls then run once per shard on its local arrays), XLA collectives for the
reductions (the batch status over "data", and in the layer the out_proj sum over "model"),
``jax.distributed`` for several processes. Nothing here moves a pool between devices.

**Model axis (tp).** Shard ``r`` of ``tp`` owns key heads ``[r*H/tp, (r+1)*H/tp)``, their
value heads ``[r*HV/tp, (r+1)*HV/tp)`` (value head h uses key head h // G, so a key-head
group's value heads are contiguous), the q, k, v (and z) channels of those heads, their
``A_log`` / ``dt_bias`` entries, their heads of the SSM state and their channels of the
conv state. ``tp`` must divide H (whole groups; ``ValueError`` naming tp and H otherwise:
uneven groups would need padding, as vLLM's head_partition does, and are not supported).
Each shard's core sees a plain local ``[q_r | k_r | v_r]``: globally the conv channels are
kept in **shard-major order** ``[q_0 k_0 v_0 | q_1 k_1 v_1 | ...]`` (:func:`qkv_channel_order`),
so that a contiguous 1/tp slice of D is one shard's channels. The conv weight and the conv
state use that order; the layer's in_proj rows are permuted to it once at load time, so the
projection produces it directly. A caller with plain-order activations converts them with
:func:`to_shard_major` (a gather of activations, never of a pool).

**Data axis (dp).** Data shard ``d`` owns cache slots ``[d*N, (d+1)*N)`` of the global pool
(``N`` = slots per data shard) and the requests living in them. Its batch names **local**
slot ids ``0..N-1`` (global slot ``g`` = ``d*N + local``): :func:`build_sharded_batch` routes
requests named by global slots and converts. Token arrays are ``[dp*T, ...]`` with shard ``d``'s
bucket at rows ``[d*T, (d+1)*T)``; batch fields carry a leading ``[dp]`` axis.

**Validation stays global.** Every shard checks its own batch, and a batch refused anywhere
runs as an all-padding batch on every shard: nothing is written anywhere and every cache
comes back bit-identical. A status depends on the batch metadata alone, which the shards of
a data row share, so only data shards need to agree: with dp > 1 one tiny all-reduce over
"data" *before any op runs*; with dp = 1 none, and the layer step's only collective is its
out_proj sum. Status vectors here are
``int32[5] = (code, row, value, aux, data_shard)`` of the first failing data shard (row,
value and aux as in the unsharded step, in that shard's local terms).

Shapes in the docstrings: global (what the caller holds), with ``dp`` data shards of T
tokens, S rows and N slots each.
"""
from __future__ import annotations

import dataclasses
import functools
import inspect
from typing import Any, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from . import _checks, paths
from .batch import (PAD_SLOT_ID, ROW_PAD, ROW_SPEC, BatchMetadata, _validated_slots, batch_status, build_batch,
                    status_message)
from .checkpoint import load_layer_params
from .config import GDNCache, GDNConfig, GDNParams
from .layer import (LAYER_STEPS, PACKED_PROJECTIONS, GDNLayerConfig, GDNLayerParams, _zero_padding, gated_rms_norm,
                    in_projection, out_projection)
from .ops import PackedLinearWeight, pack_linear_weight

__all__ = [
    "DATA",
    "MODEL",
    "make_mesh",
    "mesh_shape",
    "shard_map",
    "local_config",
    "qkv_channel_order",
    "to_shard_major",
    "from_shard_major",
    "place",
    "create_cache",
    "ShardedHostBatch",
    "build_sharded_batch",
    "ShardedGDNAttention",
    "ShardedGatedDeltaNetLayer",
    "shard_core_params",
    "shard_layer_params",
    "load_sharded_layer_params",
    "sharded_status_message",
    "check_sharded_status",
    "host_value",
]

DATA, MODEL = "data", "model"


# ---------------------------------------------------------------------------------------
# mesh and shard_map
# ---------------------------------------------------------------------------------------


def make_mesh(tp: int = 1, dp: int = 1, devices=None) -> Mesh:
    """A ``(dp, tp)`` mesh with axes ``("data", "model")`` over ``devices`` (default: the
    first dp*tp of ``jax.devices()``, every process's devices under jax.distributed).

    Devices of one process are adjacent along "model" when tp fits in a process, so the
    out_proj reduction stays inside a process where it can.
    """
    tp, dp = _positive("tp", tp), _positive("dp", dp)
    devs = list(jax.devices() if devices is None else devices)
    if len(devs) < tp * dp:
        raise ValueError(f"make_mesh: dp*tp = {dp}*{tp} = {dp * tp} devices needed, {len(devs)} available")
    return Mesh(np.array(devs[:tp * dp], dtype=object).reshape(dp, tp), (DATA, MODEL))


def mesh_shape(mesh: Mesh) -> tuple[int, int]:
    """(dp, tp) of a mesh with the axes ``"data"`` and ``"model"``, in either order (size 1 allowed:
    :func:`make_mesh` makes them); ValueError naming the axes otherwise."""
    if not isinstance(mesh, Mesh):
        raise TypeError(f"mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}")
    if set(mesh.axis_names) != {DATA, MODEL}:
        raise ValueError(f"mesh axes must be {DATA!r} and {MODEL!r} (size 1 allowed; gdn_jax.sharding.make_mesh(tp, dp) "
                         f"makes such a mesh), got {tuple(mesh.axis_names)}")
    shape = dict(mesh.shape)
    return int(shape[DATA]), int(shape[MODEL])


def device_grid(mesh: Mesh) -> np.ndarray:
    """The mesh's devices as a ``[dp, tp]`` array indexed by (data shard, model shard), whatever the
    order of the mesh's axes."""
    mesh_shape(mesh)
    names = tuple(mesh.axis_names)
    return np.transpose(np.asarray(mesh.devices), (names.index(DATA), names.index(MODEL)))


def _positive(name, v) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
        raise ValueError(f"{name} must be a positive int, got {v!r}")
    return int(v)


@functools.lru_cache(maxsize=1)
def _shard_map_impl():
    """(shard_map, name of its replication-check flag) for the installed jax (0.5.3 .. 0.11)."""
    fn = getattr(jax, "shard_map", None)
    if fn is None:
        from jax.experimental.shard_map import shard_map as fn
    params = inspect.signature(fn).parameters
    return fn, ("check_vma" if "check_vma" in params else "check_rep")


def shard_map(f, *, mesh: Mesh, in_specs, out_specs):
    """``shard_map`` of the installed jax with its replication check off (the custom calls
    carry no replication rule; every output spec here names its axes explicitly)."""
    fn, flag = _shard_map_impl()
    return fn(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, **{flag: False})


# ---------------------------------------------------------------------------------------
# per-shard channel order
# ---------------------------------------------------------------------------------------


def local_config(config: GDNConfig, tp: int) -> GDNConfig:
    """The config one of ``tp`` model shards runs: H/tp key heads, HV/tp value heads.

    Raises ValueError naming tp and H when tp does not divide H (shards own whole key-head
    groups).
    """
    tp = _positive("tp", tp)
    if config.H % tp:
        raise ValueError(f"tp={tp} does not divide the key heads H={config.H}: every model shard owns whole "
                         f"key-head groups (H/tp key heads and their HV/tp value heads); choose tp among the "
                         f"divisors of H")
    return dataclasses.replace(config, num_k_heads=config.H // tp, num_v_heads=config.HV // tp)


@functools.lru_cache(maxsize=64)
def _order(H: int, HV: int, K: int, V: int, tp: int) -> np.ndarray:
    hk, hk_r, hv_r = H * K, H * K // tp, HV * V // tp
    parts = []
    for r in range(tp):
        parts += [np.arange(r * hk_r, (r + 1) * hk_r),                    # q of shard r
                  hk + np.arange(r * hk_r, (r + 1) * hk_r),               # k
                  2 * hk + np.arange(r * hv_r, (r + 1) * hv_r)]           # v
    order = np.concatenate(parts).astype(np.int32)
    order.setflags(write=False)
    return order


def qkv_channel_order(config: GDNConfig, tp: int) -> np.ndarray:
    """int32 [D]: the plain channel (``[q heads | k heads | v heads]``) at each position of the
    shard-major order ``[q_0 k_0 v_0 | q_1 k_1 v_1 | ...]``: ``shard_major = plain[..., order]``.
    Built once per (dims, tp) and cached."""
    local_config(config, tp)
    return _order(config.H, config.HV, config.K, config.V, int(tp))


def to_shard_major(x, config: GDNConfig, tp: int, axis: int = -1):
    """Plain-order channels (mixed_qkv [T, D], conv weight [D, W], ...) -> shard-major."""
    return jnp.take(x, jnp.asarray(qkv_channel_order(config, tp)), axis=axis)


def from_shard_major(x, config: GDNConfig, tp: int, axis: int = -1):
    """Inverse of :func:`to_shard_major` (NumPy in, NumPy out; for checks and exports)."""
    inv = np.argsort(qkv_channel_order(config, tp))
    return np.take(np.asarray(x), inv, axis=axis)


# ---------------------------------------------------------------------------------------
# placement and specs
# ---------------------------------------------------------------------------------------


def place(host, mesh: Mesh, spec: P) -> jax.Array:
    """A global array with ``spec`` on ``mesh`` from a host array every process holds whole;
    each process copies only the slices of its own devices (works under jax.distributed)."""
    host = np.asarray(host)
    # dtype: a process without a shard of the array cannot infer it (older jax has no argument).
    extra = {"dtype": host.dtype} if _callback_takes_dtype() else {}
    return jax.make_array_from_callback(host.shape, NamedSharding(mesh, spec), lambda idx: host[idx], **extra)


@functools.lru_cache(maxsize=1)
def _callback_takes_dtype() -> bool:
    return "dtype" in inspect.signature(jax.make_array_from_callback).parameters


def _conv_state_spec(config: GDNConfig) -> P:
    return P(DATA, None, MODEL) if config.conv_state_layout == "SD" else P(DATA, MODEL, None)


def cache_specs(config: GDNConfig) -> GDNCache:
    """PartitionSpecs of the pools: slots over "data", channels / value heads over "model"."""
    return GDNCache(conv_state=_conv_state_spec(config), ssm_state=P(DATA, MODEL))


def core_param_specs(params: GDNParams) -> GDNParams:
    return GDNParams(A_log=P(MODEL), dt_bias=P(MODEL), conv_weight=P(MODEL),
                     conv_bias=None if params.conv_bias is None else P(MODEL))


BATCH_SPECS = BatchMetadata(*(P(DATA),) * 6)


def create_cache(config: GDNConfig, mesh: Mesh, num_slots: int) -> GDNCache:
    """Zero pools created sharded (each device allocates only its block; nothing is
    gathered): conv_state ``[dp*N, L, D]`` ("SD"; "DS": ``[dp*N, D, L]``) with channels in
    shard-major order, ssm_state ``[dp*N, HV, K, V]``. ``num_slots`` = N, per data shard."""
    _, tp = mesh_shape(mesh)
    local = local_config(config, tp)
    N = _positive("num_slots", num_slots)
    # Each device makes its own block (GDNCache.create: huge pages on the native CPU path).
    make = jax.jit(shard_map(lambda: GDNCache.create(local, N), mesh=mesh, in_specs=(), out_specs=cache_specs(config)))
    return make()


def _place_tree(host, specs, mesh: Mesh):
    return jax.tree_util.tree_map(lambda x, s: place(x, mesh, s), host, specs)


def _core_to_shard_major(core: GDNParams, order: np.ndarray) -> GDNParams:
    """Host core params with the conv weight (and bias) rows in shard-major order."""
    return dataclasses.replace(core, conv_weight=core.conv_weight[order],
                               conv_bias=None if core.conv_bias is None else core.conv_bias[order])


def shard_core_params(params: GDNParams, config: GDNConfig, mesh: Mesh) -> GDNParams:
    """Full (plain-order) core params -> sharded: conv weight/bias rows in shard-major order
    over "model", A_log / dt_bias split by value head."""
    params.validate(config)
    order = qkv_channel_order(config, mesh_shape(mesh)[1])
    host = _core_to_shard_major(jax.tree_util.tree_map(np.asarray, params), order)
    return _place_tree(host, core_param_specs(params), mesh)


# ---------------------------------------------------------------------------------------
# host side: requests with global slots -> one batch per data shard
# ---------------------------------------------------------------------------------------


@dataclasses.dataclass
class ShardedHostBatch:
    """One step's batches, one per data shard, with the same (T, S) bucket.

    Attributes:
      shards: per data shard, the :class:`HostBatch` of its requests (local slot ids).
      metadata: :class:`BatchMetadata` whose fields carry a leading ``[dp]`` axis (NumPy).
      placement: per request (caller's order), ``(data shard, index in that shard's batch)``.
      token_bucket, row_bucket: T and S of every shard.
    """

    shards: tuple
    metadata: BatchMetadata
    placement: tuple
    token_bucket: int
    row_bucket: int

    @property
    def num_data(self) -> int:
        return len(self.shards)

    def pack(self, per_request: Sequence[Any], dtype=None) -> np.ndarray:
        """Per-request token arrays (caller's order) -> ``[dp*T, ...]`` (shard d at rows [d*T, (d+1)*T))."""
        if len(per_request) != len(self.placement):
            raise ValueError(f"pack: got {len(per_request)} arrays for {len(self.placement)} requests")
        arrs = [np.asarray(a) for a in per_request]
        if not arrs:
            raise ValueError("pack: no requests, so the trailing shape is unknown; build zeros directly")
        dt = dtype if dtype is not None else arrs[0].dtype
        out = []
        for d, hb in enumerate(self.shards):
            mine = [arrs[i] for i, (dd, _) in enumerate(self.placement) if dd == d]
            out.append(hb.pack(mine, dtype=dt) if mine else
                       np.zeros((self.token_bucket,) + arrs[0].shape[1:], dt))
        return np.concatenate(out, axis=0)

    def unpack(self, tokens) -> list:
        """A ``[dp*T, ...]`` step output -> per-request arrays (caller's order)."""
        t = np.asarray(tokens)
        T = self.token_bucket
        parts = [hb.unpack(t[d * T:(d + 1) * T]) for d, hb in enumerate(self.shards)]
        return [parts[d][j] for d, j in self.placement]


def build_sharded_batch(requests, *, num_slots: int, num_data: int, num_spec: int = 0, token_bucket,
                        row_bucket) -> ShardedHostBatch:
    """Route requests named by **global** slots to their data shards and build each shard's
    batch with local slot ids (global slot ``g`` lives in shard ``g // num_slots`` as local
    slot ``g % num_slots``). Every shard gets the smallest bucket that fits the largest shard.

    Args: as :func:`gdn_jax.build_batch`, with ``num_slots`` = N per data shard and
      ``num_data`` = dp. Raises ValueError naming the request (its index in ``requests``)
      and the global slot for everything :func:`gdn_jax.build_batch` refuses (a slot outside
      ``[0, dp*N)``, one named twice, ...) and for a request whose slots span two data
      shards.
    """
    N, dp = _positive("num_slots", num_slots), _positive("num_data", num_data)
    requests = tuple(requests)
    # build_batch's rules on the global slots first, so that an error names the caller's
    # request and slot (not a shard's); the shards' own builds below then only lay them out.
    slot_rows = _validated_slots(requests, dp * N, num_spec, bound=f"dp*N = {dp * N}")
    groups = [[] for _ in range(dp)]
    placement = []
    for i, (rq, slots) in enumerate(zip(requests, slot_rows)):
        owners = {s // N for s in slots if s != PAD_SLOT_ID}  # -1: a spec row's unused column
        if len(owners) != 1:
            raise ValueError(f"request {i} (id={rq.id!r}): slots {slots} span data shards {sorted(owners)}; a "
                             f"request's slots must lie in one shard's range [d*N, (d+1)*N), N = {N}")
        d = owners.pop()
        placement.append((d, len(groups[d])))
        groups[d].append(dataclasses.replace(rq, slots=tuple(s if s == PAD_SLOT_ID else s - d * N for s in slots)))
    # One bucket for all shards: the one the fullest shard needs.
    need_t = max(sum(int(r.num_tokens) for r in g) for g in groups)
    need_s = max(len(g) for g in groups)
    T = _fit(token_bucket, need_t, "tokens")
    S = _fit(row_bucket, need_s, "rows")
    shards = tuple(build_batch(g, num_slots=N, num_spec=num_spec, token_bucket=T, row_bucket=S) for g in groups)
    meta = jax.tree_util.tree_map(lambda *xs: np.stack([np.asarray(x) for x in xs]),
                                  *[hb.metadata for hb in shards])
    return ShardedHostBatch(shards=shards, metadata=meta, placement=tuple(placement), token_bucket=T, row_bucket=S)


def _fit(buckets, need, what) -> int:
    if isinstance(buckets, (int, np.integer)):
        return int(buckets)      # build_batch reports an overflow, naming the bucket
    fits = sorted(int(b) for b in buckets if int(b) >= need)
    return fits[0] if fits else max(int(b) for b in buckets)


# ---------------------------------------------------------------------------------------
# global status (inside shard_map)
# ---------------------------------------------------------------------------------------


def _shard_status(status, dp: int):
    """int32[4] -> int32[5]: this shard's status and its data shard."""
    d = jax.lax.axis_index(DATA) if dp > 1 else jnp.zeros((), jnp.int32)
    return jnp.concatenate([status.astype(jnp.int32), d[None].astype(jnp.int32)])


def _global_status(status, dp: int):
    """int32[4] per shard -> int32[5] (status, data shard) of the first failing data shard, the
    same on every shard. A status is a function of the batch metadata alone, which every shard
    of a data row holds whole (replicated over "model"): the model shards of a row reach the
    same verdict by themselves, so the agreement needs only "data": one all-reduce of dp*5
    int32 over it (each data shard fills its row; one latency-bound call beats a pmin followed
    by a psum), and none at all when dp = 1."""
    mine = _shard_status(status, dp)
    if dp == 1:
        return mine
    table = jax.lax.psum(jnp.zeros((dp, 5), jnp.int32).at[mine[4]].set(mine), DATA)
    bad = table[:, 0] != 0
    return jnp.where(jnp.any(bad), table[jnp.argmax(bad)], 0)


def host_value(x) -> np.ndarray:
    """A replicated global array on the host (its first local copy: works when the array
    spans devices of other processes, where ``np.asarray`` refuses)."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        return np.asarray(x.addressable_shards[0].data)
    return np.asarray(x)


def sharded_status_message(op: str, status) -> Optional[str]:
    """Text of a sharded status ``int32[5]``, or None if OK."""
    st = host_value(status).reshape(-1)
    msg = status_message(op, st[:4])
    if msg is None:
        return None
    return msg.replace(f"gdn_jax.{op}: ", f"gdn_jax.{op} (data shard {int(st[4])}): ", 1)


def check_sharded_status(op: str, status, caches=None) -> None:
    """Raise :class:`gdn_jax.InvalidBatchError` (``.caches`` = the unchanged caches) on an error."""
    msg = sharded_status_message(op, status)
    if msg:
        raise _checks.InvalidBatchError(msg, caches=caches)


def _squeeze_batch(batch: BatchMetadata) -> BatchMetadata:
    """A data shard's block of the stacked batch ([1, ...] fields) -> its own BatchMetadata."""
    return jax.tree_util.tree_map(lambda x: x[0], batch)


# ---------------------------------------------------------------------------------------
# the sharded core
# ---------------------------------------------------------------------------------------


def _agreed_step(config: GDNConfig, impl: str, kind: str, dp: int, x, b, a, params, cache, batch):
    """The unsharded step on one shard under a batch check every shard agrees on:
    ``(out, cache, status int32[5])``. dp = 1: the step's own check is already global (every
    shard holds the whole batch), so no collective. dp > 1: check locally and agree over
    "data" *before any op runs*; the agreed verdict goes in as the step's checked status (a
    batch refused anywhere runs nothing anywhere).
    The kernels' own statuses need no second agreement: they pass every batch the check
    passes (tests/test_fuzz.py holds the steps to that) and the all-padding batch; a shard
    whose kernels disagreed anyway reports its own status rather than none."""
    if dp == 1:
        out, cache, st = paths._step(config, impl, kind, x, b, a, params, cache, batch)
        return out, cache, _shard_status(st, 1)
    st = batch_status(batch, num_tokens=x.shape[0], num_slots=cache.num_slots, kinds=paths.STEP_KINDS[kind],
                      impl=impl)
    st = _global_status(st, dp)
    out, cache, op_st = paths._step(config, impl, kind, x, b, a, params, cache, batch, checked=st[:4])
    return out, cache, jnp.where(st[0] != 0, st, _shard_status(op_st, dp))


def _core_shard(config: GDNConfig, impl: str, kind: str, dp: int, x, b, a, params, cache, batch):
    """One shard's step (_agreed_step on its block of the stacked batch)."""
    return _agreed_step(config, impl, kind, dp, x, b, a, params, cache, _squeeze_batch(batch))


def _commit_shard(config: GDNConfig, impl: str, dp: int, cache, spec_state_indices, num_accepted_tokens):
    idx, acc = spec_state_indices[0], num_accepted_tokens[0]
    if dp == 1:     # paths._commit checks before it writes, and every shard reaches the same verdict
        cache, st = paths._commit(config, impl, cache, idx, acc)
        return cache, _shard_status(st, 1)
    S = idx.shape[0]
    live = idx[:, 0] != PAD_SLOT_ID
    # The check paths._commit makes (a spec step of zero-length rows), made here first so
    # that every data shard can refuse before any shard writes.
    meta = BatchMetadata(query_start_loc=jnp.zeros((S + 1,), jnp.int32), state_indices=idx,
                         row_kind=jnp.where(live, ROW_SPEC, ROW_PAD).astype(jnp.int32),
                         has_initial_state=jnp.ones((S,), bool), num_accepted_tokens=acc,
                         num_tokens=jnp.zeros((), jnp.int32))
    st = batch_status(meta, num_tokens=0, num_slots=cache.num_slots, kinds=(ROW_PAD, ROW_SPEC), impl=impl)
    st = _global_status(st, dp)
    ok = st[0] == 0
    cache, op_st = paths._commit(config, impl, cache, jnp.where(ok, idx, PAD_SLOT_ID), jnp.where(ok, acc, 1))
    return cache, jnp.where(st[0] != 0, st, _shard_status(op_st, dp))     # as in _agreed_step


def _place_if_host(x, mesh, spec):
    return x if isinstance(x, jax.Array) else place(x, mesh, spec)


def _place_batch(batch, mesh):
    meta = batch.metadata if isinstance(batch, ShardedHostBatch) else batch
    if not isinstance(meta, BatchMetadata):
        raise TypeError(f"batch must be a ShardedHostBatch or a stacked BatchMetadata, got {type(batch).__name__}")
    dp = mesh_shape(mesh)[0]
    if isinstance(batch, ShardedHostBatch) and batch.num_data != dp:
        raise ValueError(f"batch was built for num_data={batch.num_data} data shards, the mesh has dp={dp} "
                         f"(build_sharded_batch(..., num_data={dp}))")
    meta = meta.host_checked()
    check_stacked_batch(meta, dp, None)  # before placing: P("data") cannot split another leading size
    return jax.tree_util.tree_map(lambda x: _place_if_host(x, mesh, P(DATA)), meta)


def check_stacked_batch(batch, dp: int, num_spec: Optional[int]) -> None:
    """A stacked batch (every field with a leading ``[dp]`` axis, one block per data shard):
    ValueError / TypeError naming the field at trace time. A batch stacked for another dp would
    leave data shards' requests out (shard_map splits the leading axis)."""
    if not isinstance(batch, BatchMetadata):
        raise TypeError(f"batch must be a ShardedHostBatch or a stacked BatchMetadata, got {type(batch).__name__}")
    for f in dataclasses.fields(BatchMetadata):
        x = getattr(batch, f.name)
        if len(getattr(x, "shape", ())) < 1 or x.shape[0] != dp:
            raise ValueError(f"batch.{f.name} must carry a leading [dp] = [{dp}] axis (one block per data shard: "
                             f"build_sharded_batch(..., num_data={dp})), got shape {tuple(getattr(x, 'shape', ()))}")
    jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype), batch).check_shapes(num_spec)


def _check_placed(name: str, tree, specs, mesh: Mesh) -> None:
    """The host wrappers take params and caches only as shard_params / load_params / create_cache
    lay them out: jit would re-shard any other array silently, splitting plain-order channels by
    position (a wrong layer, no error)."""
    leaves, _ = jax.tree_util.tree_flatten(tree)
    spec_leaves = jax.tree_util.tree_leaves(specs, is_leaf=lambda x: isinstance(x, P))
    for i, (x, spec) in enumerate(zip(leaves, spec_leaves)):
        want = NamedSharding(mesh, spec)
        if not isinstance(x, jax.Array) or not (x.sharding == want or x.sharding.is_equivalent_to(want, x.ndim)):
            got = type(x).__name__ if not isinstance(x, jax.Array) else x.sharding
            raise ValueError(f"{name}: leaf {i} is not laid out on this mesh as {spec} (got {got}); pass "
                             f"{name} as the layer's shard_params / load_params / create_cache return them")


class _ShardedSteps:
    """Host wrappers shared by the sharded core and layer: place host inputs, run the jitted
    ``*_with_status`` step, raise on a refused batch. Subclasses set ``_array_specs``."""

    _array_specs: tuple = ()
    _array_names: tuple = ()

    def _host(self, kind, *args):
        *arrays, params, cache, batch = args
        m = self.mesh
        _check_placed("params", params, self._param_specs(params), m)
        _check_placed("cache", cache, cache_specs(self._core_local), m)
        placed_batch = _place_batch(batch, m)
        if isinstance(batch, ShardedHostBatch):
            # shard_map hands data shard d the rows [d*R, (d+1)*R) of R = rows / dp; unless R is
            # the batch's T, each shard would read other requests' tokens (no error).
            want = batch.num_data * batch.token_bucket
            for name, x in zip(self._array_names, arrays):
                rows = np.shape(x)[0] if np.ndim(x) else None
                if rows != want:
                    raise ValueError(f"{name} must have dp*T = {batch.num_data}*{batch.token_bucket} = {want} rows "
                                     f"(the batch's tokens as its pack lays them out), got {rows}")
        placed = [_place_if_host(x, m, spec) for x, spec in zip(arrays, self._array_specs)]
        out, cache, status = getattr(self, f"{kind}_with_status")(*placed, params, cache, placed_batch)
        check_sharded_status(kind, status, caches=cache)
        return out, cache

    def commit_accepted(self, cache, spec_state_indices, num_accepted_tokens):
        """Sharded :meth:`gdn_jax.GDNAttention.commit_accepted`: ``spec_state_indices [dp, S, C]``
        (local slot ids, as in the step's stacked batch), ``num_accepted_tokens [dp, S]``."""
        m = self.mesh
        _check_placed("cache", cache, cache_specs(self._core_local), m)
        idx, acc = (x if isinstance(x, jax.Array) else place(_checks.host_int32(n, x), m, P(DATA))
                    for n, x in (("spec_state_indices", spec_state_indices),
                                 ("num_accepted_tokens", num_accepted_tokens)))
        cache, status = self.commit_accepted_with_status(cache, idx, acc)
        check_sharded_status("commit_accepted", status, caches=cache)
        return cache


def _make_commit(core: GDNConfig, impl: str, mesh: Mesh):
    """jit(shard_map(commit_accepted)) over the local core config, the cache donated."""
    dp, tp = mesh_shape(mesh)
    local = local_config(core, tp)
    c_specs = cache_specs(local)

    def commit(cache, spec_state_indices, num_accepted_tokens):
        cols = core.num_spec + 1
        _checks.check_rank("spec_state_indices", spec_state_indices, 3, "[dp, S, num_spec + 1]")
        S = spec_state_indices.shape[1]
        _checks.check_index("spec_state_indices", spec_state_indices, (dp, S, cols), "[dp, S, num_spec + 1]")
        _checks.check_index("num_accepted_tokens", num_accepted_tokens, (dp, S), "[dp, S]")
        f = shard_map(functools.partial(_commit_shard, local, impl, dp), mesh=mesh,
                      in_specs=(c_specs, P(DATA), P(DATA)), out_specs=(c_specs, P()))
        return f(cache, spec_state_indices, num_accepted_tokens)

    commit.__name__ = "gdn_sharded_commit_accepted"
    return jax.jit(commit, donate_argnames="cache")


class ShardedGDNAttention(_ShardedSteps):
    """:class:`gdn_jax.GDNAttention` over a ``("data", "model")`` mesh.

    Steps (global shapes; dp data shards of T tokens, S rows, N slots)::

        step(mixed_qkv [dp*T, D] shard-major, b [dp*T, HV], a [dp*T, HV], params, cache, batch)
            -> (out [dp*T, HV, V], cache)

    * ``mixed_qkv``: channels in shard-major order (:func:`to_shard_major`), sharded
      ``P("data", "model")``; b, a: value heads over "model"; out likewise.
    * ``params``: from :meth:`shard_params`; ``cache``: from :meth:`create_cache`
      (donated: continue with the returned one); ``batch``: :class:`ShardedHostBatch` or its
      stacked metadata.
    * ``*_with_status``: the jitted functions ``-> (out, cache, status int32[5])``;
      ``commit_accepted(cache, spec_state_indices [dp, S, C], num_accepted_tokens [dp, S])``.
    Host arrays (NumPy) given to the host wrappers are placed with the right sharding.
    """

    def __init__(self, config: GDNConfig, mesh: Mesh, impl: str = "auto"):
        if not isinstance(config, GDNConfig):
            raise TypeError(f"config must be a GDNConfig, got {type(config).__name__}")
        self.config, self.mesh, self.impl = config, mesh, impl
        self.dp, self.tp = mesh_shape(mesh)
        self.local = local_config(config, self.tp)
        for kind in paths.STEP_KINDS:
            setattr(self, f"{kind}_with_status", self._make_step(kind))
        self.commit_accepted_with_status = _make_commit(config, impl, mesh)

    def __repr__(self) -> str:
        return f"ShardedGDNAttention({self.config!r}, dp={self.dp}, tp={self.tp}, impl={self.impl!r})"

    @property
    def _core_local(self) -> GDNConfig:
        return self.local

    @staticmethod
    def _param_specs(params):
        if not isinstance(params, GDNParams):
            raise TypeError(f"params must be the GDNParams of shard_params, got {type(params).__name__}")
        return core_param_specs(params)

    # --- specs ---
    x_spec = P(DATA, MODEL)
    out_spec = P(DATA, MODEL, None)

    def _make_step(self, kind):
        cfg, impl, dp, tp, mesh = self.local, self.impl, self.dp, self.tp, self.mesh
        c_specs = cache_specs(cfg)
        full = self.config

        def step(mixed_qkv, b, a, params, cache, batch):
            n = _checks.check_rank("mixed_qkv", mixed_qkv, 2, "[dp*T, D]")[0]
            _checks.check_shape("mixed_qkv", mixed_qkv, (n, full.D), "[dp*T, D] (D of the whole layer)")
            _checks.check_dtype("mixed_qkv", mixed_qkv, (full.act_dtype,), full.act_dtype.name)
            for name, x in (("b", b), ("a", a)):
                _checks.check_shape(name, x, (n, full.HV), "[dp*T, HV] (HV of the whole layer)")
            if n % dp:
                raise ValueError(f"mixed_qkv has {n} tokens, not a multiple of dp={dp} (dp*T: T per data shard)")
            check_stacked_batch(batch, dp, full.num_spec)
            f = shard_map(functools.partial(_core_shard, cfg, impl, kind, dp), mesh=mesh,
                          in_specs=(self.x_spec, self.x_spec, self.x_spec, core_param_specs(params), c_specs,
                                    BATCH_SPECS),
                          out_specs=(self.out_spec, c_specs, P()))
            return f(mixed_qkv, b, a, params, cache, batch)

        step.__name__ = f"gdn_sharded_{kind}"
        return jax.jit(step, donate_argnames="cache")

    # --- set-up ---
    def create_cache(self, num_slots: int) -> GDNCache:
        """Sharded zero pools, ``num_slots`` per data shard (see :func:`create_cache`)."""
        return create_cache(self.config, self.mesh, num_slots)

    def shard_params(self, params: GDNParams) -> GDNParams:
        """Full plain-order params -> sharded (see :func:`shard_core_params`)."""
        return shard_core_params(params, self.config, self.mesh)

    # --- host wrappers ---
    _array_specs = (x_spec, x_spec, x_spec)
    _array_names = ("mixed_qkv", "b", "a")

    def prefill(self, mixed_qkv, b, a, params, cache, batch):
        return self._host("prefill", mixed_qkv, b, a, params, cache, batch)

    def decode(self, mixed_qkv, b, a, params, cache, batch):
        return self._host("decode", mixed_qkv, b, a, params, cache, batch)

    def spec_decode(self, mixed_qkv, b, a, params, cache, batch):
        return self._host("spec_decode", mixed_qkv, b, a, params, cache, batch)

    def gdn_attention_core(self, mixed_qkv, b, a, params, cache, batch):
        return self._host("gdn_attention_core", mixed_qkv, b, a, params, cache, batch)

    __call__ = gdn_attention_core


# ---------------------------------------------------------------------------------------
# the sharded layer (gdn_jax.layer): in_proj column-parallel, out_proj row-parallel
# ---------------------------------------------------------------------------------------


def layer_param_specs(params) -> Any:
    """PartitionSpecs of :class:`gdn_jax.layer.GDNLayerParams`: in_proj rows (output
    channels) over "model", out_proj columns over "model", the norm weight replicated. A
    packed projection (``GDNLayerParams.packed``) splits the same way, along its blocks of 16
    rows, or for out_proj its pairs of columns: a shard's rows and columns are whole heads and
    head dims are multiples of 16 (GDNConfig), so no block or pair straddles two shards."""
    rows, cols = P(MODEL, None), P(None, MODEL)

    def spec(name, plain):
        w = getattr(params, name)
        return PackedLinearWeight(P(*plain, None, None), w.shape) if isinstance(w, PackedLinearWeight) else plain

    return GDNLayerParams(in_proj_qkv=spec("in_proj_qkv", rows), in_proj_z=spec("in_proj_z", rows), in_proj_b=rows,
                          in_proj_a=rows, core=core_param_specs(params.core), norm_weight=P(),
                          out_proj=spec("out_proj", cols))


def _packed_names(params) -> list:
    return [n for n in PACKED_PROJECTIONS if isinstance(getattr(params, n), PackedLinearWeight)]


def _packed_shapes_of(params, config):
    """``params`` with its packed projections' (static) shapes those of ``config``: a shard's
    inside shard_map, the whole layer's for the specs of arrays assembled from shards."""
    shapes = config.projection_shapes()
    return dataclasses.replace(params, **{n: PackedLinearWeight(getattr(params, n).data, shapes[n])
                                          for n in _packed_names(params)})


def shard_layer_params(params, config, mesh: Mesh):
    """Full layer params (plain order, as :func:`gdn_jax.checkpoint.load_layer_params` gives
    them) -> sharded: in_proj_qkv rows and the conv weight permuted to shard-major order
    once, here, so that each shard's projection yields its own plain ``[q_r | k_r | v_r]``.
    Packed projections (``GDNLayerParams.packed``) come back packed, each shard's part packed
    as that shard would pack it."""
    params.validate(config)
    packed = _packed_names(params)
    order = qkv_channel_order(config.core, mesh_shape(mesh)[1])
    host = jax.tree_util.tree_map(np.asarray, params.unpacked())
    host = dataclasses.replace(host, in_proj_qkv=host.in_proj_qkv[order], core=_core_to_shard_major(host.core, order))
    host = dataclasses.replace(host, **{n: pack_linear_weight(getattr(host, n)) for n in packed})
    return _place_tree(host, layer_param_specs(host), mesh)


def load_sharded_layer_params(path, layer: int, config, mesh: Mesh, *, packed: bool = False):
    """Load one layer straight into its shards: each process reads, memory-mapped, only the
    key-head groups of the model shards on its own devices
    (``gdn_jax.checkpoint.load_layer_params(..., key_heads=(h0, h1))``, whose local plain
    order is exactly that shard's block of the shard-major order) and places them with
    ``jax.make_array_from_single_device_arrays``. Nothing is gathered or re-read. ``packed``:
    each shard packs its projections (``GDNLayerParams.packed``; bf16 models)."""
    dp, tp = mesh_shape(mesh)
    local_config(config.core, tp)
    h = config.H // tp
    devices = device_grid(mesh)  # [data shard, model shard], whatever the mesh's axis order
    mine = {r for r in range(tp) for d in range(dp) if devices[d, r].process_index == jax.process_index()}
    if not mine:
        raise ValueError(f"process {jax.process_index()} has no device in the mesh; call load_params only on "
                         f"the processes that serve the layer")
    shards = {}
    for r in sorted(mine):
        p = load_layer_params(path, layer, config, key_heads=(r * h, (r + 1) * h))
        shards[r] = jax.tree_util.tree_map(np.asarray, p.packed() if packed else p)
    any_shard = shards[min(shards)]
    specs = layer_param_specs(_packed_shapes_of(any_shard, config))
    leaves_of = {r: jax.tree_util.tree_leaves(p) for r, p in shards.items()}
    spec_leaves, treedef = jax.tree_util.tree_flatten(specs, is_leaf=lambda x: isinstance(x, P))
    out = []
    for i, spec in enumerate(spec_leaves):
        split = [ax for ax, name in enumerate(spec) if name == MODEL]
        shape = list(leaves_of[min(shards)][i].shape)
        if split:
            shape[split[0]] *= tp
        sharding = NamedSharding(mesh, spec)
        arrays = [jax.device_put(leaves_of[r][i], devices[d, r]) for d in range(dp) for r in range(tp)
                  if devices[d, r].process_index == jax.process_index()]
        out.append(jax.make_array_from_single_device_arrays(tuple(shape), sharding, arrays))
    return jax.tree_util.tree_unflatten(treedef, out)


def _layer_shard(config, impl: str, kind: str, dp: int, scatter: bool, hidden, params, cache, batch):
    """One shard's layer step: in_proj of its channels, the core step under the global batch
    check (_agreed_step), its gated norm, its partial out_proj in f32 (zero rows for padding
    tokens and a refused batch) and ONE reduction over "model" (psum, or reduce-scatter over
    tokens), rounded once to the act dtype, as the unsharded layer. With dp = 1 that reduction
    is the step's only collective."""
    batch = _squeeze_batch(batch)
    T = hidden.shape[0]
    params = _packed_shapes_of(params, config)
    params.validate(config)
    mixed_qkv, z, b, a = in_projection(config, params, hidden, impl)
    o, cache, status = _agreed_step(config.core, impl, LAYER_STEPS[kind], dp, mixed_qkv, b, a, params.core, cache,
                                    batch)
    y = gated_rms_norm(o, z, params.norm_weight, config.rms_norm_eps, impl).reshape(T, config.Z)
    part = _zero_padding(out_projection(params, y, impl, jnp.float32), batch, status)
    if scatter:
        out = jax.lax.psum_scatter(part, MODEL, scatter_dimension=0, tiled=True)
    else:
        out = jax.lax.psum(part, MODEL)
    return out.astype(hidden.dtype), cache, status


class ShardedGatedDeltaNetLayer(_ShardedSteps):
    """:class:`gdn_jax.layer.GatedDeltaNetLayer` over a ``("data", "model")`` mesh.

    Steps (global shapes; dp data shards of T tokens)::

        layer.prefill / decode / spec_decode / mixed (hidden [dp*T, hidden], params, cache, batch)
            -> (out [dp*T, hidden], cache)
        layer.commit_accepted(cache, spec_state_indices [dp, S, C], num_accepted_tokens [dp, S]) -> cache

    ``hidden`` is split over "data" and replicated over "model" (every model shard projects
    the same tokens onto its own channels); ``out`` likewise after the psum, or, with
    ``scatter_output=True``, sharded over tokens on both axes (``P(("data", "model"))``:
    a reduce-scatter, for a sequence-parallel caller; T must then be a multiple of tp).
    ``params``: :meth:`shard_params` or :meth:`load_params`; ``cache``: :meth:`create_cache`
    (donated). ``*_with_status`` return ``(out, cache, status int32[5])``.
    """

    def __init__(self, config, mesh: Mesh, impl: str = "auto", *, scatter_output: bool = False):
        if not isinstance(config, GDNLayerConfig):
            raise TypeError(f"config must be a GDNLayerConfig, got {type(config).__name__}")
        self.config, self.mesh, self.impl = config, mesh, impl
        self.dp, self.tp = mesh_shape(mesh)
        self.local = config.local(self.tp)
        self.scatter_output = bool(scatter_output)
        self.out_spec = P((DATA, MODEL), None) if scatter_output else P(DATA, None)
        for name in LAYER_STEPS:
            setattr(self, f"{name}_with_status", self._make_step(name))
        self.commit_accepted_with_status = _make_commit(config.core, impl, mesh)

    def __repr__(self) -> str:
        return (f"ShardedGatedDeltaNetLayer({self.config!r}, dp={self.dp}, tp={self.tp}, impl={self.impl!r}, "
                f"scatter_output={self.scatter_output})")

    hidden_spec = P(DATA, None)
    _array_specs = (hidden_spec,)
    _array_names = ("hidden",)

    @property
    def _core_local(self) -> GDNConfig:
        return self.local.core

    @staticmethod
    def _param_specs(params):
        if not isinstance(params, GDNLayerParams):
            raise TypeError(f"params must be the GDNLayerParams of shard_params / load_params, got "
                            f"{type(params).__name__}")
        return layer_param_specs(params)

    def _make_step(self, name):
        cfg, impl, dp, tp, mesh, scatter = self.local, self.impl, self.dp, self.tp, self.mesh, self.scatter_output
        c_specs = cache_specs(cfg.core)
        full = self.config

        def step(hidden, params, cache, batch):
            n = _checks.check_rank("hidden", hidden, 2, "[dp*T, hidden_size]")[0]
            _checks.check_shape("hidden", hidden, (n, full.hidden_size), "[dp*T, hidden_size]")
            _checks.check_dtype("hidden", hidden, (full.act_dtype,), f"{full.act_dtype.name} (config.core.act_dtype)")
            if n % dp:
                raise ValueError(f"hidden has {n} tokens, not a multiple of dp={dp} (dp*T: T per data shard)")
            check_stacked_batch(batch, dp, full.core.num_spec)
            if scatter and (hidden.shape[0] // dp) % tp:
                raise ValueError(f"scatter_output: the token bucket T={hidden.shape[0] // dp} must be a multiple "
                                 f"of tp={tp}")
            f = shard_map(functools.partial(_layer_shard, cfg, impl, name, dp, scatter), mesh=mesh,
                          in_specs=(self.hidden_spec, layer_param_specs(params), c_specs, BATCH_SPECS),
                          out_specs=(self.out_spec, c_specs, P()))
            return f(hidden, params, cache, batch)

        step.__name__ = f"gdn_sharded_layer_{name}"
        return jax.jit(step, donate_argnames="cache")

    def create_cache(self, num_slots: int) -> GDNCache:
        """Sharded zero pools, ``num_slots`` per data shard (see :func:`create_cache`)."""
        return create_cache(self.config.core, self.mesh, num_slots)

    def shard_params(self, params):
        """Full plain-order layer params -> sharded (see :func:`shard_layer_params`)."""
        return shard_layer_params(params, self.config, self.mesh)

    def load_params(self, path, layer: int, *, packed: bool = False):
        """This process's shards of one layer read from a checkpoint (see :func:`load_sharded_layer_params`)."""
        return load_sharded_layer_params(path, layer, self.config, self.mesh, packed=packed)

    def prefill(self, hidden, params, cache, batch):
        return self._host("prefill", hidden, params, cache, batch)

    def decode(self, hidden, params, cache, batch):
        return self._host("decode", hidden, params, cache, batch)

    def spec_decode(self, hidden, params, cache, batch):
        return self._host("spec_decode", hidden, params, cache, batch)

    def mixed(self, hidden, params, cache, batch):
        return self._host("mixed", hidden, params, cache, batch)

    __call__ = mixed
