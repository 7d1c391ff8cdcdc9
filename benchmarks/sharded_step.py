"""A sharded GDN step on this machine (the core alone, then the whole layer): 1 device vs
2 devices (tp = 2), and the collectives on their own, inside one process and across two
processes (jax.distributed, gloo over loopback), and the layer step across those two.

    PYTHONPATH=. python benchmarks/sharded_step.py                 # everything (a few minutes)
    PYTHONPATH=. python benchmarks/sharded_step.py --quick         # small shapes, few reps
    PYTHONPATH=. python benchmarks/sharded_step.py --json out.json
    PYTHONPATH=. python benchmarks/sharded_step.py --weights packed  # the layer's packed projections

Shapes: Qwen3-Next-80B's GDN layer (hidden 2048, H = 16, HV = 32, K = V = 128, W = 4,
bf16 activations, f32 state): "core" rows time the attention core (conv + gating +
recurrence, ShardedGDNAttention), "layer" rows the whole layer (in_proj -> core -> gated norm
-> out_proj, ShardedGatedDeltaNetLayer), its weights in [out, in] layout or, with --weights
packed, packed as serving loads them (GDNLayerParams.packed; each shard packs its own part).
Cases: decode of B requests, and a prefill of one 512-token request.

Columns, per case (medians over interleaved rounds, milliseconds):

* ``1 dev``: the unsharded GDNAttention / GatedDeltaNetLayer on one device (XLA's intra-op
  pool and our kernels use both cores);
* ``tp=1 mesh``: the sharded step on a 1-device mesh (shard_map, no peer);
* ``tp=2``: the sharded step on 2 devices of one process (each shard half the heads);
* ``psum``: the out_proj reduction alone, ``[T, hidden]`` f32 over the 2 devices, and
  ``status``: the batch-status all-reduce of a dp = 2 mesh alone (int32 [2, 5] over "data",
  once per step there; a mesh with one data shard has none);
* ``layer step 2 proc``: the layer step at tp = 2 between two processes over gloo (one
  device each); ``layer step dp=2 2 proc`` at dp = 2 (each process the case's batch in its
  own slots); ``psum 2 proc`` / ``status 2 proc`` the collectives between them (what a
  2-socket or 2-host deployment pays per layer step, at loopback speed); median and p10.

glibc's allocator is tuned as a server runs it, in both processes of the collective run too
(--malloc, as layer_breakdown.py).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import subprocess
import sys
import time

ROLE = "main"
if "--role" in sys.argv:
    ROLE = sys.argv[sys.argv.index("--role") + 1]
BASE_XLA_FLAGS = os.environ.get("XLA_FLAGS", "")
if ROLE == "main":
    os.environ["XLA_FLAGS"] = (BASE_XLA_FLAGS + " --xla_force_host_platform_device_count=2").strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from gdn_jax import GDNAttention, GDNCache, GDNConfig, Request, build_batch, selected_isa  # noqa: E402
from gdn_jax import sharding as sh  # noqa: E402
from gdn_jax.layer import GatedDeltaNetLayer, GDNLayerConfig, GDNLayerParams  # noqa: E402
from host_malloc import add_malloc_arg, apply_malloc  # noqa: E402

BF16 = jnp.bfloat16


def layer_config(quick):
    if quick:
        return GDNLayerConfig(hidden_size=256, core=GDNConfig(4, 8, 64, 64))
    return GDNLayerConfig(hidden_size=2048, core=GDNConfig(16, 32, 128, 128))


def layer_params(cfg, weights):
    params = GDNLayerParams.random(cfg, jax.random.PRNGKey(0))
    return params.packed() if weights == "packed" else params


def sizes(args):
    """(rounds, slots per data shard) of this run."""
    return (5, 16) if args.quick else (args.rounds, 64)


def cases(quick):
    if quick:
        return [("decode B=8", "decode", [1] * 8), ("prefill 128", "prefill", [128])]
    return [("decode B=1", "decode", [1]), ("decode B=8", "decode", [1] * 8), ("decode B=32", "decode", [1] * 32),
            ("prefill 512", "prefill", [512])]


def requests(kind, lens, first_slot=0):
    if kind == "decode":
        return [Request.decode(first_slot + i) for i in range(len(lens))]
    return [Request.prefill(first_slot + i, n) for i, n in enumerate(lens)]


def bucket(n, lo=8):
    b = lo
    while b < n:
        b *= 2
    return b


class Runner:
    """One jitted call with the cache donated and threaded through; call() -> seconds."""

    def __init__(self, fn, arrays, params, cache, batch):
        self.fn, self.arrays, self.params, self.cache, self.batch = fn, arrays, params, cache, batch

    def __call__(self):
        t = time.perf_counter()
        out, self.cache, status = self.fn(*self.arrays, self.params, self.cache, self.batch)
        out.block_until_ready()
        return time.perf_counter() - t


def step_inputs(what, cfg, kind, lens):
    """(requests, T, S, host arrays in plain channel order): the same in every process."""
    reqs = requests(kind, lens)
    T, S = bucket(sum(lens)), bucket(len(lens), 1)
    rng = np.random.default_rng(0)
    widths = (cfg.hidden_size,) if what == "layer" else (cfg.core.D, cfg.core.HV, cfg.core.HV)
    return reqs, T, S, [rng.standard_normal((T, w)).astype(np.float32).astype(BF16) for w in widths]


def runners(what, cfg, kind, lens, params_full, mesh1, mesh2, num_slots):
    """{column: Runner} for the layer (what="layer") or the core alone (what="core")."""
    reqs, T, S, host = step_inputs(what, cfg, kind, lens)
    unsharded = GatedDeltaNetLayer(cfg) if what == "layer" else GDNAttention(cfg.core)
    hb = build_batch(reqs, num_slots=num_slots, token_bucket=T, row_bucket=S)
    out = {"1 dev": Runner(getattr(unsharded, f"{kind}_with_status"), [jnp.asarray(x) for x in host],
                           params_full if what == "layer" else params_full.core,
                           GDNCache.create(cfg.core, num_slots), hb.metadata.to_device())}
    for name, mesh in (("tp=1 mesh", mesh1), ("tp=2", mesh2)):
        out[name] = sharded_runner(what, cfg, kind, lens, params_full, mesh, num_slots)
    return out, T


def sharded_runner(what, cfg, kind, lens, params_full, mesh, num_slots):
    """The sharded step's Runner on ``mesh`` (works across processes: every process passes the
    same host arrays and places its own shards). Each data shard serves the case's batch in
    its own slots, so a data shard's work is the case's."""
    _, T, S, arrays = step_inputs(what, cfg, kind, lens)
    dp = sh.mesh_shape(mesh)[0]
    reqs = [r for d in range(dp) for r in requests(kind, lens, first_slot=d * num_slots)]
    arrays = [np.concatenate([x] * dp, axis=0) for x in arrays]
    if what == "layer":
        eng = sh.ShardedGatedDeltaNetLayer(cfg, mesh)
    else:       # plain -> shard-major channels, once, outside the timing
        arrays[0] = arrays[0][:, sh.qkv_channel_order(cfg.core, sh.mesh_shape(mesh)[1])]
        eng, params_full = sh.ShardedGDNAttention(cfg.core, mesh), params_full.core
    shb = sh.build_sharded_batch(reqs, num_slots=num_slots, num_data=dp, token_bucket=T, row_bucket=S)
    placed = [sh.place(x, mesh, spec) for x, spec in zip(arrays, eng._array_specs)]
    return Runner(getattr(eng, f"{kind}_with_status"), placed, eng.shard_params(params_full),
                  eng.create_cache(num_slots), sh._place_batch(shb, mesh))


def collective_runners(mesh, data_mesh, T, hidden):
    """The out_proj psum over "model" (``mesh``, tp = 2) and the status all-reduce over "data"
    (``data_mesh``, dp = 2: a mesh with one data shard has none), alone, as the layer runs them."""
    x = sh.place(np.ones((T * 2, hidden), np.float32), mesh, sh.P(sh.MODEL, None))   # [T, hidden] per device
    psum = jax.jit(sh.shard_map(lambda v: jax.lax.psum(v, sh.MODEL), mesh=mesh, in_specs=sh.P(sh.MODEL, None),
                                out_specs=sh.P(sh.MODEL, None)))
    st = sh.place(np.zeros((2, 4), np.int32), data_mesh, sh.P(sh.DATA))
    status = jax.jit(sh.shard_map(lambda s: sh._global_status(s[0], 2)[None], mesh=data_mesh, in_specs=sh.P(sh.DATA),
                                  out_specs=sh.P(sh.DATA)))

    def timer(fn, arg):
        def call():
            t = time.perf_counter()
            fn(arg).block_until_ready()
            return time.perf_counter() - t
        return call

    return {"psum": timer(psum, x), "status": timer(status, st)}


def interleaved_times(calls: dict, rounds: int, warmup: int = 2) -> dict:
    """Seconds of each call per round; the calls take turns each round (the host is shared and noisy)."""
    for _ in range(warmup):
        for c in calls.values():
            c()
    times = {k: [] for k in calls}
    for r in range(rounds):
        order = list(calls) if r % 2 == 0 else list(reversed(calls))
        for k in order:
            times[k].append(calls[k]())
    return times


def interleaved(calls: dict, rounds: int, warmup: int = 2) -> dict:
    """Median seconds per call (interleaved_times)."""
    return {k: float(np.median(v)) for k, v in interleaved_times(calls, rounds, warmup).items()}


def main_role(args):
    cfg = layer_config(args.quick)
    devs = jax.devices()
    mesh1, mesh2 = sh.make_mesh(tp=1, devices=devs[:1]), sh.make_mesh(tp=2, devices=devs[:2])
    data_mesh = sh.make_mesh(tp=1, dp=2, devices=devs[:2])
    params = layer_params(cfg, args.weights)
    rows = []
    rounds, slots = sizes(args)
    for what in args.what.split(","):
        for label, kind, lens in cases(args.quick):
            calls, T = runners(what, cfg, kind, lens, params, mesh1, mesh2, num_slots=slots)
            if what == "layer":
                calls.update(collective_runners(mesh2, data_mesh, T, cfg.hidden_size))
            med = interleaved(calls, rounds)
            row = {"what": what, "case": label, "T": T, "weights": args.weights, **{k: v * 1e3 for k, v in med.items()},
                   "psum_bytes": T * cfg.hidden_size * 4, "load_avg": os.getloadavg()[0]}
            rows.append(row)
            print(f"{what:5s} {label:12s} T={T:4d}  " + "  ".join(f"{k} {v * 1e3:8.3f} ms" for k, v in med.items())
                  + f"  tp=2/1dev {med['tp=2'] / med['1 dev']:.2f}  (load avg {row['load_avg']:.1f})", flush=True)
    return rows


def dist_role(args):
    """Two processes, one device each, over gloo: the layer step at tp = 2 across them and at
    dp = 2 (each process its own batch of the case), and the collectives alone (the psum of
    [T, hidden] f32; the status all-reduce of a dp = 2 mesh)."""
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=f"localhost:{args.port}", num_processes=2,
                               process_id=args.process_id)
    mesh, data_mesh = sh.make_mesh(tp=2), sh.make_mesh(tp=1, dp=2)
    cfg = layer_config(args.quick)
    params = layer_params(cfg, args.weights)      # the same in both processes
    rounds, slots = sizes(args)
    out = {}
    for label, kind, lens in cases(args.quick):
        calls = collective_runners(mesh, data_mesh, bucket(sum(lens)), cfg.hidden_size)
        calls["layer step"] = sharded_runner("layer", cfg, kind, lens, params, mesh, slots)
        calls["layer step dp=2"] = sharded_runner("layer", cfg, kind, lens, params, data_mesh, slots)
        times = interleaved_times(calls, rounds)
        # p10 beside the median: over gloo a call takes either ~0.2-0.5 ms or a scheduler tick
        # (~4 ms here), so the median alone can land on either (docs/scaling.md)
        out[label] = {f"{k} 2 proc{q}": float(np.percentile(times[k], pct)) * 1e3
                      for k in calls for q, pct in (("", 50), (" p10", 10))}
    if args.process_id == 0:
        with open(args.out, "w") as f:
            json.dump(out, f)
    jax.distributed.shutdown()


def two_process_collectives(args):
    with socket.socket() as s:
        s.bind(("localhost", 0))
        port = s.getsockname()[1]
    out = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"gdn_sharded_step_{os.getpid()}.json")
    extra = (["--quick"] if args.quick else ["--rounds", str(args.rounds)]) + ["--malloc", args.malloc,
                                                                             "--weights", args.weights]
    env = dict(os.environ, XLA_FLAGS=BASE_XLA_FLAGS)          # one device per process
    procs = [subprocess.Popen([sys.executable, os.path.abspath(__file__), "--role", "dist", "--process-id", str(i),
                               "--port", str(port), "--out", out, *extra], env=env) for i in range(2)]
    if any(p.wait() != 0 for p in procs):
        raise SystemExit("the two-process collective run failed")
    with open(out) as f:
        result = json.load(f)
    os.remove(out)
    return result


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--role", default="main", choices=["main", "dist"])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--what", default="core,layer", help="core, layer or both (comma-separated)")
    ap.add_argument("--weights", choices=["plain", "packed"], default="plain",
                    help="the layer's projections: [out, in] (plain) or packed (GDNLayerParams.packed)")
    ap.add_argument("--json")
    ap.add_argument("--process-id", type=int, default=0)
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--out")
    add_malloc_arg(ap)
    args = ap.parse_args()
    malloc_text = apply_malloc(args.malloc)
    if args.role == "dist":
        return dist_role(args)
    print(f"CPU: {platform.processor() or platform.machine()}, {os.cpu_count()} cores; jax {jax.__version__}; "
          f"ISA {selected_isa()}; {malloc_text}; layer weights {args.weights}", flush=True)
    rows = main_role(args)
    cross = two_process_collectives(args)
    for row in rows:
        if row["what"] != "layer":
            continue
        row.update(cross[row["case"]])
        print(f"{row['case']:12s} 2 processes: layer step tp=2 {row['layer step 2 proc']:8.3f} ms "
              f"(p10 {row['layer step 2 proc p10']:.3f}), dp=2 {row['layer step dp=2 2 proc']:8.3f} ms "
              f"(p10 {row['layer step dp=2 2 proc p10']:.3f}), psum {row['psum 2 proc']:8.3f} ms "
              f"(p10 {row['psum 2 proc p10']:.3f}; {row['psum_bytes'] / 2**10:.0f} KiB per device), "
              f"status {row['status 2 proc']:.3f} ms (p10 {row['status 2 proc p10']:.3f})", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
