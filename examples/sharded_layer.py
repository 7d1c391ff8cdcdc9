"""One GDN layer served three ways, printing that they agree:

1. one device: :class:`gdn_jax.layer.GatedDeltaNetLayer`;
2. a forced 4-device CPU mesh, data 2 x tensor 2: :class:`gdn_jax.sharding.ShardedGatedDeltaNetLayer`;
3. two local processes joined by ``jax.distributed`` (CPU collectives), tensor parallel
   across them (tp = 2), each reading only its key heads from the checkpoint.

The loop: a tiny random Qwen3-Next checkpoint is written; 4 requests are prefilled in one
step, then decode 6 tokens each, each new token's hidden state made from the last output
(so any disagreement would compound). Each way runs in its own process (XLA flags and
jax.distributed are per process) and saves its outputs; the driver compares them.

    PYTHONPATH=. python examples/sharded_layer.py
"""
from __future__ import annotations

import argparse
import os
import shutil
import socket
import subprocess
import sys
import tempfile

HERE = os.path.abspath(__file__)
MESH_DEVICES = 4


def _parse():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--role", choices=["driver", "single", "mesh", "dist"], default="driver")
    ap.add_argument("--ckpt")
    ap.add_argument("--out")
    ap.add_argument("--process-id", type=int, default=0)
    ap.add_argument("--port", type=int, default=0)
    return ap.parse_args()


ARGS = _parse()
if ARGS.role == "mesh":   # before jax is imported
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               f" --xla_force_host_platform_device_count={MESH_DEVICES}").strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from gdn_jax import GDNCache, GDNConfig, Request, build_batch  # noqa: E402
from gdn_jax import sharding as sh  # noqa: E402
from gdn_jax.checkpoint import load_layer_params, save_checkpoint  # noqa: E402
from gdn_jax.layer import GatedDeltaNetLayer, GDNLayerConfig, GDNLayerParams  # noqa: E402

CONFIG = GDNLayerConfig(hidden_size=128, core=GDNConfig(4, 8, 32, 32, act_dtype=jnp.float32))
LAYER, SLOTS, T, S = 0, 4, 64, 4                # slots per data shard, token / row buckets per data shard
PROMPTS = (11, 23, 5, 17)                       # tokens of the 4 requests
DECODE_STEPS = 6


# --- the loop, written once against a tiny engine interface -----------------------------------


def serve(step, rng):
    """prefill all requests, then DECODE_STEPS decode steps; -> [num requests, 1 + steps, hidden]."""
    H = CONFIG.hidden_size
    prompts = [rng.standard_normal((n, H)).astype(np.float32) for n in PROMPTS]
    reqs = [Request.prefill(slot_of(i), n) for i, n in enumerate(PROMPTS)]
    outs = step("prefill", reqs, prompts)
    last = [o[-1] for o in outs]
    history = [last]
    for _ in range(DECODE_STEPS):
        # The next token's hidden state from the last output: any disagreement compounds.
        hidden = [(x / np.sqrt(np.mean(x * x) + 1e-6))[None, :].astype(np.float32) for x in last]
        outs = step("decode", [Request.decode(slot_of(i)) for i in range(len(PROMPTS))], hidden)
        last = [o[0] for o in outs]
        history.append(last)
    return np.stack([np.stack(h) for h in history], axis=1)


def slot_of(i, dp=2):
    """Request i's global slot: spread over two data shards of SLOTS slots each."""
    return (i % dp) * SLOTS + i // dp


def run_single(path):
    layer = GatedDeltaNetLayer(CONFIG)
    params = load_layer_params(path, LAYER, CONFIG)
    cache = [GDNCache.create(CONFIG.core, 2 * SLOTS)]

    def step(kind, reqs, per_req):
        hb = build_batch(reqs, num_slots=2 * SLOTS, token_bucket=2 * T, row_bucket=2 * S)
        out, cache[0] = getattr(layer, kind)(jnp.asarray(hb.pack(per_req)), params, cache[0], hb)
        return hb.unpack(out)

    return serve(step, np.random.default_rng(0))


def run_sharded(path, mesh):
    dp, _ = sh.mesh_shape(mesh)
    layer = sh.ShardedGatedDeltaNetLayer(CONFIG, mesh)
    params = layer.load_params(path, LAYER)           # each process reads its own key heads only
    cache = [layer.create_cache(2 * SLOTS // dp)]

    def step(kind, reqs, per_req):
        hb = sh.build_sharded_batch(reqs, num_slots=2 * SLOTS // dp, num_data=dp, token_bucket=T, row_bucket=S)
        out, cache[0] = getattr(layer, kind)(hb.pack(per_req), params, cache[0], hb)
        # out is P("data", None): with dp = 1 every process holds all of it.
        full = np.asarray(out) if out.is_fully_addressable else np.asarray(out.addressable_shards[0].data)
        return hb.unpack(full)

    return serve(step, np.random.default_rng(0))


# --- the three ways, each in its own process ----------------------------------------------------


def worker():
    if ARGS.role == "single":
        result = run_single(ARGS.ckpt)
    elif ARGS.role == "mesh":
        result = run_sharded(ARGS.ckpt, sh.make_mesh(tp=2, dp=2))
    else:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(coordinator_address=f"localhost:{ARGS.port}", num_processes=2,
                                   process_id=ARGS.process_id)
        result = run_sharded(ARGS.ckpt, sh.make_mesh(tp=2, dp=1))
        jax.distributed.shutdown()
    np.save(ARGS.out, result)


def _spawn(role, ckpt, out, *extra):
    env = dict(os.environ)
    root = os.path.dirname(os.path.dirname(HERE))
    env["PYTHONPATH"] = os.pathsep.join([root] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    return subprocess.Popen([sys.executable, HERE, "--role", role, "--ckpt", ckpt, "--out", out, *extra], env=env)


def driver():
    tmp = tempfile.mkdtemp(prefix="gdn_sharded_layer_")
    ckpt = os.path.join(tmp, "ckpt")
    save_checkpoint(ckpt, CONFIG, {LAYER: GDNLayerParams.random(CONFIG, jax.random.PRNGKey(0))})
    print(f"checkpoint: {ckpt} (hidden {CONFIG.hidden_size}, H={CONFIG.H}, HV={CONFIG.HV}, K=V={CONFIG.K})")
    files = {w: os.path.join(tmp, f"{w}.npy") for w in ("single", "mesh", "dist0", "dist1")}
    with socket.socket() as s:
        s.bind(("localhost", 0))
        port = s.getsockname()[1]
    for role, names in (("single", ["single"]), ("mesh", ["mesh"])):
        if _spawn(role, ckpt, files[names[0]]).wait() != 0:
            sys.exit(f"the {role} run failed")
    procs = [_spawn("dist", ckpt, files[f"dist{i}"], "--process-id", str(i), "--port", str(port)) for i in range(2)]
    if any(p.wait() != 0 for p in procs):
        sys.exit("the two-process run failed")
    res = {k: np.load(v) for k, v in files.items()}
    base = res["single"]
    print(f"{len(PROMPTS)} requests, prefill + {DECODE_STEPS} decode steps, outputs {base.shape}")
    worst = 0.0
    for name, label in (("mesh", f"{MESH_DEVICES}-device mesh (data 2 x tp 2)"),
                        ("dist0", "2 processes, tp 2 (process 0)"), ("dist1", "2 processes, tp 2 (process 1)")):
        err = float(np.sqrt(np.mean((res[name] - base) ** 2) / np.mean(base ** 2)))
        worst = max(worst, err)
        print(f"  {label:34s} vs 1 device: relative RMSE {err:.1e}")
    ok = worst <= 1e-5      # f32: summation order only (out_proj's psum), compounded over 7 steps
    print("they agree" if ok else "they DISAGREE")
    shutil.rmtree(tmp, ignore_errors=True)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    driver() if ARGS.role == "driver" else worker()
