"""Subprocess worker of tests/test_sharding.py (XLA flags and jax.distributed stay in here).

    python tests/sharding_worker.py mesh [--impl native|reference] [--meshes 2x1,4x1,2x2]
        one process, 4 forced CPU devices; each mesh "TPxDP" runs the serving sequence
    python tests/sharding_worker.py dist --process-id I --num-processes 2 --port P
        one of two processes joined by jax.distributed (CPU collectives), tp = 2 across them
    python tests/sharding_worker.py hlo
        the compiled sharded steps: no all-gather, no pool-sized copy, pools aliased in place

The sequence (prefill across a chunk boundary, decode, two spec steps, commit_accepted, a
mixed step, a refused step and a refused commit, a step after them) runs on the sharded
engine and, on the same requests, on the unsharded :class:`gdn_jax.GDNAttention` (native)
and the unsharded reference. After every step each process checks the shards it holds:
outputs and both pools within 1e-6 relative RMSE of the unsharded native engine (f32), the
outputs within the contract's f32 budget of the reference; after a refused step every pool
shard is bit-identical to before. Prints one line per check; exits 1 on the first failure.
"""
from __future__ import annotations

import argparse
import os
import sys


def _setup(devices: int):
    flags = os.environ.get("XLA_FLAGS", "")
    os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={devices}".strip()


MODE = sys.argv[1] if len(sys.argv) > 1 else "mesh"
if MODE in ("mesh", "hlo", "packed", "misuse"):
    _setup(4)

import dataclasses  # noqa: E402
import re  # noqa: E402
import tempfile  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import gdn_jax  # noqa: E402
from gdn_jax import sharding as sh  # noqa: E402
from gdn_jax.batch import Request, build_batch  # noqa: E402
from gdn_jax.config import GDNCache, GDNConfig, GDNParams  # noqa: E402
from gdn_jax import paths  # noqa: E402

F32 = jnp.float32
CFG = GDNConfig(4, 8, 16, 16, num_spec=2, act_dtype=F32)           # D = 256, G = 2
CFG_DS = GDNConfig(4, 8, 16, 32, num_spec=2, act_dtype=F32, conv_state_layout="DS", conv_width=3)
CFG_G3 = GDNConfig(4, 12, 16, 16, num_spec=2, act_dtype=F32)       # G = 3 (--model-type qwen3_5)
N, T, S = 8, 96, 4           # per data shard: slots, token bucket, row bucket
TOL = 1e-6                   # the bound against the unsharded engine (f32)
HIDDEN, LAYER = 64, 1        # the layer's hidden size; its index in the test checkpoint
REF_TOL = 1e-5               # contract.md's f32 budget (relative RMSE) for the reference


def fail(msg):
    print("FAIL", msg, flush=True)
    sys.exit(1)


# --- comparing the shards this process holds ------------------------------------------------


def rel_rmse_local(arr: jax.Array, expect: np.ndarray) -> float:
    """Relative RMSE of the shards of ``arr`` this process holds against the same slices of
    the global ``expect``."""
    num = den = 0.0
    for shard in arr.addressable_shards:
        got = np.asarray(shard.data, np.float64)
        ref = np.asarray(expect[shard.index], np.float64)
        if got.shape != ref.shape:
            fail(f"shard {shard.index}: shape {got.shape} vs {ref.shape}")
        num += float(np.sum((got - ref) ** 2))
        den += float(np.sum(ref ** 2))
    if not np.isfinite(num):
        return float("inf")
    return float(np.sqrt(num / den)) if den > 0 else float(np.sqrt(num))


def local_bits(arr: jax.Array) -> list:
    return [(shard.index, np.array(shard.data)) for shard in arr.addressable_shards]


def same_bits(before, arr) -> bool:
    after = dict((str(i), d) for i, d in local_bits(arr))
    return all(np.array_equal(d.view(np.uint8), after[str(i)].view(np.uint8)) for i, d in before)


def check(what, value, tol):
    print(f"  {what}: rel RMSE {value:.2e} (<= {tol:g})", flush=True)
    if not value <= tol:
        fail(what)


# --- engines: the core (mixed_qkv, b, a) or the whole layer (hidden) --------------------------


LAYER_NAMES = {"gdn_attention_core": "mixed"}       # core step kind -> layer step name


class Family:
    """What differs between the core and the layer: config, params, inputs, step names."""

    def __init__(self, what, cfg, ckpt=None):
        self.what, self.cfg, self.ckpt = what, cfg, ckpt
        self.core = cfg if what == "core" else cfg.core
        self._unsharded = {}

    def params(self, seed):
        if self.what == "core":
            return GDNParams.random(self.cfg, jax.random.PRNGKey(seed))
        from gdn_jax.checkpoint import load_layer_params
        return load_layer_params(self.ckpt, LAYER, self.cfg)

    def unsharded(self, impl):
        """One engine per impl, shared across meshes (compiled once per shape)."""
        if impl not in self._unsharded:
            from gdn_jax.layer import GatedDeltaNetLayer
            self._unsharded[impl] = (paths._attention(self.cfg, impl) if self.what == "core"
                                     else GatedDeltaNetLayer(self.cfg, impl))
        return self._unsharded[impl]

    def sharded(self, mesh, impl):
        if self.what == "core":
            return sh.ShardedGDNAttention(self.cfg, mesh, impl)
        return sh.ShardedGatedDeltaNetLayer(self.cfg, mesh, impl)

    def shard_params(self, engine, params):
        if self.what == "core":
            return engine.shard_params(params)
        return engine.load_params(self.ckpt, LAYER)          # each process reads its own key heads

    def name(self, kind):
        return kind if self.what == "core" else LAYER_NAMES.get(kind, kind)

    def inputs(self, reqs, rng):
        widths = (self.cfg.D, self.cfg.HV, self.cfg.HV) if self.what == "core" else (self.cfg.hidden_size,)
        return [tuple(rng.standard_normal((r.num_tokens, w)).astype(np.float32) for w in widths) for r in reqs]


class Unsharded:
    """The single-device engine over dp*N slots, fed global slots."""

    def __init__(self, fam, impl, params, dp):
        self.fam, self.dp = fam, dp
        self.engine = fam.unsharded(impl)
        self.params = params
        self.cache = GDNCache.create(fam.core, dp * N)

    def build(self, reqs):
        return build_batch(reqs, num_slots=self.dp * N, num_spec=self.fam.core.num_spec, token_bucket=self.dp * T,
                           row_bucket=self.dp * S)

    def step(self, kind, reqs, inputs):
        hb = self.build(reqs)
        packed = [jnp.asarray(hb.pack([p[j] for p in inputs])) for j in range(len(inputs[0]))]
        out, self.cache = getattr(self.engine, self.fam.name(kind))(*packed, self.params, self.cache, hb)
        return hb.unpack(out)

    def commit(self, reqs, accepted):
        hb = self.build(reqs)
        acc = np.ones((hb.row_bucket,), np.int32)
        for i, r in enumerate(hb.rows):
            acc[r] = accepted[i]
        self.cache = self.engine.commit_accepted(self.cache, hb.metadata.state_indices, acc)


class Sharded:
    """The sharded engine on a mesh, fed the same global slots."""

    def __init__(self, fam, impl, params, mesh):
        self.fam, self.mesh = fam, mesh
        self.dp, self.tp = sh.mesh_shape(mesh)
        self.engine = fam.sharded(mesh, impl)
        self.params = fam.shard_params(self.engine, params)
        self.cache = self.engine.create_cache(N)
        self.order = sh.qkv_channel_order(fam.core, self.tp)

    def build(self, reqs):
        return sh.build_sharded_batch(reqs, num_slots=N, num_data=self.dp, num_spec=self.fam.core.num_spec,
                                      token_bucket=T, row_bucket=S)

    def pack(self, hb, inputs):
        packed = [hb.pack([p[j] for p in inputs]) for j in range(len(inputs[0]))]
        if self.fam.what == "core":
            packed[0] = packed[0][:, self.order]          # plain -> shard-major channels
        return packed

    def step(self, kind, reqs, inputs):
        hb = self.build(reqs)
        out, self.cache = getattr(self.engine, self.fam.name(kind))(*self.pack(hb, inputs), self.params, self.cache,
                                                                     hb)
        return hb, out

    def stacked_acc(self, hb, accepted):
        acc = np.ones((self.dp, hb.row_bucket), np.int32)
        for i, (d, j) in enumerate(hb.placement):
            acc[d, hb.shards[d].rows[j]] = accepted[i]
        return acc

    def commit(self, reqs, accepted):
        hb = self.build(reqs)
        self.cache = self.engine.commit_accepted(self.cache, hb.metadata.state_indices,
                                                 self.stacked_acc(hb, accepted))

    def expected_cache(self, ref_cache):
        """The unsharded pools in this engine's global layout (channels shard-major)."""
        axis = 2 if self.fam.core.conv_state_layout == "SD" else 1
        conv = np.take(np.asarray(ref_cache.conv_state), self.order, axis=axis)
        return conv, np.asarray(ref_cache.ssm_state)


# --- the sequence ---------------------------------------------------------------------------


def sequence(dp):
    """[(kind, requests, accepted-or-None)] with global slots; shard d's local slot l = d*N + l."""
    s = lambda d, l: (d % dp) * N + l  # noqa: E731
    A = (s(0, 1), s(0, 3), s(0, 5))
    B = (s(1, 2), s(1, 6), s(1, 7))
    return [
        ("prefill", [Request.prefill(s(0, 1), 70), Request.prefill(s(1, 2), 9), Request.prefill(s(1, 4), 5)]),
        ("decode", [Request.decode(s(0, 1)), Request.decode(s(1, 2)), Request.decode(s(1, 4))]),
        ("spec_decode", [Request.spec(A, 3), Request.spec(B, 2), Request.decode(s(1, 4))]),
        ("spec_decode", [Request.spec(A, 3, num_accepted=2), Request.spec(B, 1, num_accepted=2)]),
        ("commit_accepted", [Request.spec(A, 3), Request.spec(B, 1)], [3, 1]),
        ("gdn_attention_core", [Request.prefill(s(0, 0), 20), Request.decode(s(0, 1)), Request.spec(B, 3),
                                Request.prefill(s(1, 4), 6, has_initial_state=True)]),
    ]


def run_sequence(fam, impl, mesh, *, with_reference=True, seed=0):
    dp, tp = sh.mesh_shape(mesh)
    print(f"[{fam.what} {impl}] tp={tp} dp={dp} layout={fam.core.conv_state_layout} process {jax.process_index()}",
          flush=True)
    params = fam.params(seed)
    rng = np.random.default_rng(seed)
    shd = Sharded(fam, impl, params, mesh)
    ref = Unsharded(fam, impl, params, dp)
    oracle = Unsharded(fam, "reference", params, dp) if with_reference and impl == "native" else None
    for n, item in enumerate(sequence(dp)):
        kind, reqs = item[0], item[1]
        if kind == "commit_accepted":
            for e in (shd, ref) + ((oracle,) if oracle else ()):
                e.commit(reqs, item[2])
        else:
            inputs = fam.inputs(reqs, rng)
            hb, out = shd.step(kind, reqs, inputs)
            check(f"step {n} {kind}: out vs unsharded", rel_rmse_local(out, hb.pack(ref.step(kind, reqs, inputs))),
                  TOL)
            if oracle:
                check(f"step {n} {kind}: out vs reference",
                      rel_rmse_local(out, hb.pack(oracle.step(kind, reqs, inputs))), REF_TOL)
        conv, ssm = shd.expected_cache(ref.cache)
        check(f"step {n} {kind}: conv_state vs unsharded", rel_rmse_local(shd.cache.conv_state, conv), TOL)
        check(f"step {n} {kind}: ssm_state vs unsharded", rel_rmse_local(shd.cache.ssm_state, ssm), TOL)
    refused_steps(fam, shd, ref, rng, dp)
    if fam.what == "layer":
        padding_rows_zero(fam, shd, rng, dp)


def padding_rows_zero(fam, shd, rng, dp):
    """As the unsharded layer: bucket padding tokens output zeros even where their hidden values
    are not finite (NaN, inf, -inf on every data shard's padding), and a refused batch outputs
    zeros everywhere."""
    reqs = [Request.prefill((d % dp) * N + 3, 4 + d) for d in range(dp)]
    hb = shd.build(reqs)
    (h,) = shd.pack(hb, fam.inputs(reqs, rng))
    h = np.array(h)
    qsl = np.asarray(hb.metadata.query_start_loc)
    real = np.zeros(h.shape[0], bool)
    for d in range(dp):
        real[d * T:d * T + qsl[d, -1]] = True
    h[~real] = np.array([np.nan, np.inf, -np.inf])[np.arange(int((~real).sum())) % 3][:, None]
    place = lambda a: sh._place_if_host(a, shd.mesh, shd.engine._array_specs[0])  # noqa: E731
    out, shd.cache, status = shd.engine.prefill_with_status(place(h), shd.params, shd.cache,
                                                            sh._place_batch(hb, shd.mesh))
    out = np.asarray(out)
    if int(np.asarray(status)[0]) != 0 or not np.all(np.isfinite(out[real])) or np.any(out[~real]):
        fail(f"padding rows: status {np.asarray(status)}, padding out {out[~real][:2]}")
    meta = hb.metadata
    idx = meta.state_indices.copy()
    idx[0, 0, 0] = N                                    # past the shard's slots: refused everywhere
    bad = type(meta)(**{**{f: getattr(meta, f) for f in meta.__dataclass_fields__}, "state_indices": idx})
    out, shd.cache, status = shd.engine.prefill_with_status(place(np.full_like(h, np.nan)), shd.params, shd.cache,
                                                            sh._place_batch(bad, shd.mesh))
    if int(np.asarray(status)[0]) == 0 or np.any(np.asarray(out)):
        fail(f"refused step: status {np.asarray(status)}, output not all zero")
    print("  padding rows and a refused step output zeros (non-finite hidden there)", flush=True)


def refused_steps(fam, shd, ref, rng, dp):
    """A batch bad only on the last data shard (or a bad commit row there) is refused
    everywhere: InvalidBatchError naming that shard, and every pool shard bit-identical."""
    last = dp - 1
    reqs = [Request.decode(0), Request.decode(last * N + 2), Request.decode(last * N + 4)]
    inputs = fam.inputs(reqs, rng)
    hb = shd.build(reqs)
    meta = hb.metadata
    idx = meta.state_indices.copy()
    r0, r1 = hb.shards[last].rows[-2:]
    idx[last, r1, 0] = idx[last, r0, 0]                 # one slot named by two rows, on shard `last` only
    bad = type(meta)(**{**{f: getattr(meta, f) for f in meta.__dataclass_fields__}, "state_indices": idx})
    before = (local_bits(shd.cache.conv_state), local_bits(shd.cache.ssm_state))
    try:
        shd.engine.decode(*shd.pack(hb, inputs), shd.params, shd.cache, bad)
    except gdn_jax.InvalidBatchError as e:
        if f"data shard {last}" not in str(e) or "also named by row" not in str(e):
            fail(f"refused step: unexpected message {e}")
        shd.cache = e.caches
        print(f"  refused step: {e}", flush=True)
    else:
        fail("a batch with a slot named twice on the last data shard was accepted")
    if not (same_bits(before[0], shd.cache.conv_state) and same_bits(before[1], shd.cache.ssm_state)):
        fail("refused step: a pool shard changed")
    print("  refused step: every pool shard bit-identical", flush=True)

    spec = [Request.spec((0, 3, 5), 3), Request.spec((last * N + 2, last * N + 6, last * N + 7), 3)]
    hb = shd.build(spec)
    acc = shd.stacked_acc(hb, [2, 1])
    acc[last, hb.shards[last].rows[0]] = fam.core.num_spec + 2          # outside [1, num_spec + 1]
    try:
        shd.engine.commit_accepted(shd.cache, hb.metadata.state_indices, acc)
    except gdn_jax.InvalidBatchError as e:
        if f"data shard {last}" not in str(e):
            fail(f"refused commit: unexpected message {e}")
        shd.cache = e.caches
    else:
        fail("a commit with num_accepted_tokens > num_spec + 1 on the last data shard was accepted")
    if not (same_bits(before[0], shd.cache.conv_state) and same_bits(before[1], shd.cache.ssm_state)):
        fail("refused commit: a pool shard changed")
    print("  refused commit_accepted: every pool shard bit-identical", flush=True)

    # The caches handed back keep serving: a valid decode still matches the unsharded engine.
    reqs = reqs[:1] + [Request.decode(last * N + 2)]
    inputs = fam.inputs(reqs, rng)
    hb, out = shd.step("decode", reqs, inputs)
    check("decode after the refusals: out vs unsharded", rel_rmse_local(out, hb.pack(ref.step("decode", reqs, inputs))),
          TOL)
    conv, ssm = shd.expected_cache(ref.cache)
    check("decode after the refusals: ssm_state", rel_rmse_local(shd.cache.ssm_state, ssm), TOL)
    check("decode after the refusals: conv_state", rel_rmse_local(shd.cache.conv_state, conv), TOL)


# --- the compiled program -------------------------------------------------------------------


def hlo_checks(fam):
    """Compiled sharded steps on a 2 x 2 and a 1 x 2 (data x model) mesh: the only collectives
    are one status all-reduce over "data" (none with one data shard) and the layer's one
    out_proj reduction, no pool-sized copy, and the pools come back in the buffers they went in."""
    for dp in (2, 1):
        hlo_checks_on(fam, sh.make_mesh(tp=2, dp=dp))


def data_groups(mesh):
    """The replica groups of an all-reduce over "data" alone: the devices of each model index."""
    devs = np.asarray(mesh.devices)
    return sorted(sorted(int(d.id) for d in devs[:, r]) for r in range(devs.shape[1]))


def hlo_checks_on(fam, mesh):
    dp = sh.mesh_shape(mesh)[0]
    shd = Sharded(fam, "native", fam.params(1), mesh)
    local = sh.local_config(fam.core, 2)
    pool_shapes = {tuple(local.conv_state_shape(N)), tuple(local.ssm_state_shape(N))}
    out_shape = () if fam.what == "core" else ((T, fam.cfg.hidden_size),)   # the psum of out_proj
    what = f"{fam.what} {fam.core.conv_state_layout} dp={dp}"
    status_groups = data_groups(mesh) if dp > 1 else None
    for kind, reqs, *acc in sequence(dp):
        hb = shd.build(reqs)
        if kind == "commit_accepted":
            idx, acc = (sh.place(v, mesh, sh.P(sh.DATA)) for v in (hb.metadata.state_indices,
                                                                 shd.stacked_acc(hb, acc[0])))
            text = shd.engine.commit_accepted_with_status.lower(shd.cache, idx, acc).compile().as_text()
            inspect_hlo(text, pool_shapes, f"{what} {kind}", status_groups=status_groups)
            continue
        arrays = [sh.place(v, mesh, spec) for v, spec in zip(shd.pack(hb, fam.inputs(reqs, np.random.default_rng(0))),
                                                             shd.engine._array_specs)]
        fn = getattr(shd.engine, f"{fam.name(kind)}_with_status")
        batch = sh._place_batch(hb, mesh)
        compiled = fn.lower(*arrays, shd.params, shd.cache, batch).compile()
        inspect_hlo(compiled.as_text(), pool_shapes, f"{what} {kind}", allowed_reduce=out_shape,
                    status_groups=status_groups)
        ptrs = [s.data.unsafe_buffer_pointer() for p in (shd.cache.conv_state, shd.cache.ssm_state)
                for s in p.addressable_shards]
        _, shd.cache, _ = compiled(*arrays, shd.params, shd.cache, batch)     # the program just inspected
        new = [s.data.unsafe_buffer_pointer() for p in (shd.cache.conv_state, shd.cache.ssm_state)
               for s in p.addressable_shards]
        if ptrs != new:
            fail(f"{what} {kind}: a pool shard moved to a new buffer (not updated in place)")
    print(f"  {what}: every step updates its pool shards in place", flush=True)


def scatter_output_check(fam):
    """The layer with a reduce-scatter of out_proj: tokens sharded over both axes, the same
    values as the unsharded layer, and one reduce-scatter in the program."""
    mesh = sh.make_mesh(tp=2, dp=2)
    params = fam.params(0)
    layer = sh.ShardedGatedDeltaNetLayer(fam.cfg, mesh, "native", scatter_output=True)
    p = layer.load_params(fam.ckpt, LAYER)
    cache = layer.create_cache(N)
    ref = Unsharded(fam, "native", params, 2)
    kind, reqs = sequence(2)[0]
    inputs = fam.inputs(reqs, np.random.default_rng(3))
    hb = sh.build_sharded_batch(reqs, num_slots=N, num_data=2, num_spec=fam.core.num_spec, token_bucket=T,
                                row_bucket=S)
    hidden = sh.place(hb.pack([x[0] for x in inputs]), mesh, layer.hidden_spec)
    batch = sh._place_batch(hb, mesh)
    compiled = layer.prefill_with_status.lower(hidden, p, cache, batch).compile()
    if len(re.findall(r"\breduce-scatter(-start)?\(", compiled.as_text())) != 1:
        fail("scatter_output: the program should hold exactly one reduce-scatter")
    out, cache, status = compiled(hidden, p, cache, batch)
    sh.check_sharded_status("prefill", status)
    if tuple(out.sharding.spec)[:1] != ((sh.DATA, sh.MODEL),) or any(tuple(out.sharding.spec)[1:]):
        fail(f"scatter_output: out is sharded {out.sharding.spec}")
    check("scatter_output prefill: out vs unsharded", rel_rmse_local(out, hb.pack(ref.step(kind, reqs, inputs))), TOL)


def packed_check(ckpt):
    """A bf16 layer's packed projections over 2x1, 4x1 and 2x2 meshes: packed by each shard at
    load and packed on the host by shard_params, the same bits; one mixed step (prefill,
    decode and spec rows) against the same sharded layer with plain weights, where only the
    projections' summation order differs (a shard's blocks split wrongly would be noise)."""
    from gdn_jax.layer import PACKED_PROJECTIONS, GDNLayerConfig
    from gdn_jax.ops import PackedLinearWeight
    cfg = GDNLayerConfig(hidden_size=HIDDEN, core=dataclasses.replace(CFG, act_dtype=jnp.bfloat16),
                         model_type="qwen3_next")
    fam = Family("layer", cfg, ckpt)
    if not os.path.exists(os.path.join(ckpt, "config.json")):
        write_checkpoint(ckpt, cfg)
    full = fam.params(0)
    for spec in ("2x1", "4x1", "2x2"):
        tp, dp = (int(v) for v in spec.split("x"))
        mesh = sh.make_mesh(tp=tp, dp=dp)
        layer = sh.ShardedGatedDeltaNetLayer(cfg, mesh, "native")
        loaded = layer.load_params(ckpt, LAYER, packed=True)
        placed = layer.shard_params(full.packed())
        for name in PACKED_PROJECTIONS:
            a, b = getattr(loaded, name), getattr(placed, name)
            if not isinstance(a, PackedLinearWeight) or not isinstance(b, PackedLinearWeight):
                fail(f"{spec}: {name} is not packed")
            if a.shape != b.shape or not same_bits(local_bits(a.data), b.data):
                fail(f"{spec}: {name} packed per shard differs from packed on the host")
        plain = layer.load_params(ckpt, LAYER)
        reqs = sequence(dp)[-1][1]
        inputs = fam.inputs(reqs, np.random.default_rng(5))
        hb = sh.build_sharded_batch(reqs, num_slots=N, num_data=dp, num_spec=cfg.core.num_spec, token_bucket=T,
                                    row_bucket=S)
        hidden = sh.place(hb.pack([x[0] for x in inputs]).astype(jnp.bfloat16), mesh, layer.hidden_spec)
        out_packed, _ = layer.mixed(hidden, loaded, layer.create_cache(N), hb)
        out_plain, _ = layer.mixed(hidden, plain, layer.create_cache(N), hb)
        if not np.any(np.asarray(out_plain, np.float32)):
            fail(f"{spec}: the mixed step's output is zero")
        check(f"{spec} packed weights: mixed step out vs plain weights",
              rel_rmse_local(out_packed, np.asarray(out_plain, np.float64)), 8e-3)   # bf16 roundings


def expect_error(what, exc, match, fn):
    try:
        fn()
    except exc as e:
        if not re.search(match, str(e)):
            fail(f"{what}: {type(e).__name__} without {match!r}: {e}")
        print(f"  {what}: {type(e).__name__} OK", flush=True)
        return
    except Exception as e:  # noqa: BLE001
        fail(f"{what}: expected {exc.__name__} matching {match!r}, got {type(e).__name__}: {e}")
    fail(f"{what}: accepted, expected {exc.__name__} matching {match!r}")


def misuse_checks(fam, impl):
    """Mistakes that once ran silently on a mesh (4 devices, tp = dp = 2): a batch built for
    another dp dropped data shards' requests; weights and pools not laid out by the layer were
    re-sharded by jit, splitting plain-order channels by position; a mesh without a "data" axis
    failed late; wrong global shapes were reported as per-shard shapes; token arrays of another
    length than the batch's dp*T split between the shards at other rows than pack put them."""
    from gdn_jax.checkpoint import load_layer_params
    mesh = sh.make_mesh(tp=2, dp=2)
    eng = fam.sharded(mesh, impl)
    params = fam.shard_params(eng, fam.params(0))
    cache = eng.create_cache(N)
    reqs = [Request.prefill(1, 5), Request.prefill(N + 2, 7)]
    width = fam.cfg.D if fam.what == "core" else fam.cfg.hidden_size
    call = eng.prefill

    def arrays(hb):  # the token arrays of a dp = 2 step
        x = np.ones((2 * hb.token_bucket, width), np.float32)
        if fam.what == "core":
            hv = np.ones((2 * hb.token_bucket, fam.cfg.HV), np.float32)
            return [x, hv, hv]
        return [x]

    good = sh.build_sharded_batch(reqs, num_slots=N, num_data=2, num_spec=fam.core.num_spec, token_bucket=T,
                                  row_bucket=S)
    four = sh.build_sharded_batch(reqs, num_slots=N, num_data=4, num_spec=fam.core.num_spec, token_bucket=T,
                                  row_bucket=S)
    expect_error("batch for num_data=4 on dp=2", ValueError, r"built for num_data=4 data shards, the mesh has dp=2",
                 lambda: call(*arrays(four), params, cache, four))
    expect_error("stacked metadata for dp=4", ValueError, r"batch.query_start_loc must carry a leading \[dp\] = \[2\]",
                 lambda: call(*arrays(good), params, cache, four.metadata))
    expect_error("an unstacked batch", ValueError, r"batch\.\w+ must carry a leading \[dp\]",
                 lambda: call(*arrays(good), params, cache, good.shards[0].metadata))
    longer = [np.concatenate([x, x[:16]]) for x in arrays(good)]   # dp*T + 16 rows: shards would misread
    expect_error("token arrays not of the batch's bucket", ValueError,
                 rf"{'hidden' if fam.what == 'layer' else 'mixed_qkv'} must have dp\*T = 2\*{good.token_bucket} = "
                 rf"{2 * good.token_bucket} rows",
                 lambda: call(*longer, params, cache, good))
    if fam.what == "layer":
        full = load_layer_params(fam.ckpt, LAYER, fam.cfg)          # plain order, one device
        expect_error("params not from load_params", ValueError, r"params: leaf \d+ is not laid out on this mesh",
                     lambda: call(*arrays(good), full, cache, good))
        expect_error("hidden of the wrong width", ValueError, r"hidden must be \[dp\*T, hidden_size\]",
                     lambda: call(np.ones((2 * good.token_bucket, width + 1), np.float32), params, cache, good))
    else:
        expect_error("params not from shard_params", ValueError, r"params: leaf \d+ is not laid out on this mesh",
                     lambda: call(*arrays(good), fam.params(0), cache, good))
        expect_error("mixed_qkv of a shard's width", ValueError, r"mixed_qkv must be \[dp\*T, D\]",
                     lambda: call(np.ones((2 * good.token_bucket, width // 2), np.float32), *arrays(good)[1:], params,
                                  cache, good))
    expect_error("a cache not from create_cache", ValueError, r"cache: leaf \d+ is not laid out on this mesh",
                 lambda: call(*arrays(good), params, GDNCache.create(fam.core, 2 * N), good))
    expect_error("commit with num_accepted_tokens [S]", ValueError, r"num_accepted_tokens must be \[dp, S\]",
                 lambda: eng.commit_accepted(cache, good.metadata.state_indices, np.ones((S,), np.int32)))
    expect_error("a mesh without a data axis", ValueError, r"mesh axes must be 'data' and 'model'",
                 lambda: fam.sharded(jax.sharding.Mesh(np.asarray(jax.devices()[:2]), (sh.MODEL,)), impl))
    out, cache = call(*arrays(good), params, cache, good)      # the mistakes above changed nothing
    if not np.all(np.isfinite(np.asarray(out))):
        fail("the good batch after the refused ones gave non-finite output")


def replica_groups(attrs):
    """An HLO collective's replica groups as sorted lists of device ids, from the explicit form
    ``replica_groups={{0,2},{1,3}}`` or the iota form ``replica_groups=[2,2]<=[2,2]T(1,0)``;
    None if neither is there."""
    g = re.search(r"replica_groups=\{((?:\{[\d,]*\},?)*)\}", attrs)
    if g:
        return sorted(sorted(int(v) for v in grp.split(",")) for grp in re.findall(r"\{([\d,]*)\}", g.group(1)))
    g = re.search(r"replica_groups=\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", attrs)
    if not g:
        return None
    shape, dims = ([int(v) for v in x.split(",")] for x in g.groups()[:2])
    ids = np.arange(int(np.prod(dims))).reshape(dims)
    if g.group(3):
        ids = ids.transpose([int(v) for v in g.group(3).split(",")])
    return sorted(sorted(int(v) for v in row) for row in ids.reshape(shape))


def inspect_hlo(text, pool_shapes, what, allowed_reduce=(), status_groups=None):
    """No all-gather / all-to-all / collective-permute / reduce-scatter; all-reduces only of
    one status table over ``status_groups`` (the "data" axis; None: no status all-reduce at
    all) and of ``allowed_reduce`` shapes, exactly once each; no copy or convert of a
    pool-sized array; both pools aliased input -> output."""
    for op in ("all-gather", "all-to-all", "collective-permute", "reduce-scatter"):
        if re.search(rf"\b{op}(-start)?\(", text):
            fail(f"{what}: the compiled step has an {op}")
    big, small = [], 0
    for m in re.finditer(r"= (\w+)\[([\d,]*)\]\{?[\d,]*\}? all-reduce(?:-start)?\(([^\n]*)", text):
        dims = tuple(int(v) for v in m.group(2).split(",") if v)
        if int(np.prod(dims)) > 64:
            big.append(dims)
            if dims not in allowed_reduce:
                fail(f"{what}: an all-reduce of {m.group(1)}{list(dims)}")
            continue
        small += 1
        if status_groups is None:
            fail(f"{what}: a status all-reduce of {m.group(1)}{list(dims)} on a mesh with one data shard "
                 f"(its shards hold the same batch and need no agreement)")
        groups = replica_groups(m.group(3))
        if groups != status_groups:
            fail(f"{what}: a status all-reduce over replica groups {groups}, expected the data axis {status_groups}")
    if sorted(big) != sorted(allowed_reduce):
        fail(f"{what}: all-reduces {big}, expected {list(allowed_reduce)}")
    if status_groups is not None and small != 1:
        fail(f"{what}: {small} status all-reduces, expected one over the data axis (the data shards agree on "
             f"the batch before any op runs; the kernels' statuses need no second agreement)")
    for m in re.finditer(r"= \w+\[([\d,]*)\]\S* (copy|convert)\(", text):
        dims = tuple(int(v) for v in m.group(1).split(",") if v)
        if dims in pool_shapes:
            fail(f"{what}: a {m.group(2)} of a pool-sized array {dims}")
    header = text.splitlines()[0]          # HloModule ..., input_output_alias={ {1}: (6, {}, may-alias), ... }
    if len(re.findall(r"(may|must)-alias", header)) < 2:
        fail(f"{what}: the pools are not aliased input -> output")
    print(f"  {what}: no gather, no pool copy, pools aliased", flush=True)


# --- entry points ---------------------------------------------------------------------------


def write_checkpoint(path, cfg):
    from gdn_jax.checkpoint import save_checkpoint
    from gdn_jax.layer import GDNLayerParams
    save_checkpoint(path, cfg, {LAYER: GDNLayerParams.random(cfg, jax.random.PRNGKey(7))})


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=["mesh", "dist", "hlo", "packed", "misuse", "write-checkpoint"])
    ap.add_argument("--what", choices=["core", "layer"], default="core")
    ap.add_argument("--impl", default="native")
    ap.add_argument("--meshes", default="2x1,4x1,2x2")
    ap.add_argument("--reference-on", default="2x2", help="meshes also checked against the unsharded reference "
                                                          "(comma-separated; 'none')")
    ap.add_argument("--layout", default="SD")
    ap.add_argument("--model-type", default="qwen3_next", choices=["qwen3_next", "qwen3_5"],
                    help="the layer's checkpoint family; qwen3_5 runs a G = 3 config (its own checkpoint "
                         "unless --ckpt names one)")
    ap.add_argument("--ckpt", default=None, help="layer checkpoint directory (written if missing)")
    ap.add_argument("--process-id", type=int, default=0)
    ap.add_argument("--num-processes", type=int, default=2)
    ap.add_argument("--port", type=int, default=0)
    args = ap.parse_args()
    core = CFG if args.layout == "SD" else CFG_DS
    if args.model_type == "qwen3_5":
        core = dataclasses.replace(CFG_G3, conv_state_layout=core.conv_state_layout, conv_width=core.conv_width)
    fam = Family("core", core)
    if args.what == "layer":
        from gdn_jax.layer import GDNLayerConfig
        if args.ckpt is None:
            scratch = tempfile.TemporaryDirectory(prefix="gdn_shard_ckpt_")     # removed at exit
            args.ckpt = scratch.name
        fam = Family("layer", GDNLayerConfig(hidden_size=HIDDEN, core=core, model_type=args.model_type), args.ckpt)
        if args.mode != "dist" and not os.path.exists(os.path.join(fam.ckpt, "config.json")):
            write_checkpoint(fam.ckpt, fam.cfg)
    if args.mode == "write-checkpoint":
        pass
    elif args.mode == "packed":
        with tempfile.TemporaryDirectory(prefix="gdn_shard_ckpt_bf16_") as ckpt:
            packed_check(ckpt)
    elif args.mode == "misuse":
        misuse_checks(fam, args.impl)
    elif args.mode == "mesh":
        for spec in args.meshes.split(","):
            tp, dp = (int(v) for v in spec.rstrip("r").split("x"))
            mesh = sh.make_mesh(tp=tp, dp=dp)
            if spec.endswith("r"):  # the same devices with the axes named the other way round
                mesh = jax.sharding.Mesh(np.asarray(mesh.devices).T, (sh.MODEL, sh.DATA))
            run_sequence(fam, args.impl, mesh, with_reference=spec in args.reference_on.split(","))
    elif args.mode == "dist":
        if "jax_cpu_collectives_implementation" in jax.config.values:
            jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(coordinator_address=f"localhost:{args.port}", num_processes=args.num_processes,
                                   process_id=args.process_id)
        if jax.device_count() != args.num_processes or jax.local_device_count() != 1:
            fail(f"expected one device per process, got {jax.local_device_count()} of {jax.device_count()}")
        run_sequence(fam, args.impl, sh.make_mesh(tp=args.num_processes, dp=1), with_reference=False)
        jax.distributed.shutdown()
    else:
        hlo_checks(fam)
        if fam.what == "layer":
            scatter_output_check(fam)
    print("OK", flush=True)


if __name__ == "__main__":
    main()
