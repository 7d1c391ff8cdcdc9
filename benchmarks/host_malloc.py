"""What `gdn_jax.tune_host_malloc()` saves: each case timed in a fresh process with glibc's defaults
and with the tuned allocator, the two settings alternated round by round (README.md, Deployment).

Cases at Qwen3-Next-80B shapes (bf16 activations, f32 state): the whole layer's prefill (projections
included), the core's prefill step, the conv and gating ops alone, decode and spec verify (cold
pools, for contrast: their outputs are small). Per case and setting: the median call, page faults
per call (ru_minflt) and the process's peak resident memory, measured after warm-up calls (the
tuned heap grows to the blocks of consecutive calls first); then the median over rounds of the
per-round ratio tuned / system.

    PYTHONPATH=. python benchmarks/host_malloc.py [--rounds 3] [--seconds 3] [--cases layer_prefill_8192,...]

The other benchmarks' `--malloc` flag (`add_malloc_arg`, `apply_malloc`) lives here too.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

CASES = ("layer_prefill_8192", "step_prefill_8192", "step_prefill_2048", "conv_fwd_2048", "gating_8192",
         "decode_b8", "spec_8x4")
WARMUP = 6  # calls before timing: the tuned heap settles within a few calls of the same shapes


def add_malloc_arg(ap):
    ap.add_argument("--malloc", choices=("tuned", "system"), default="tuned",
                    help="tuned (default): glibc as gdn_jax.tune_host_malloc sets it (as run.py); system: its defaults")


def apply_malloc(mode: str) -> str:
    """Tunes glibc's allocator for mode "tuned" (a server's setting: README.md, Deployment); says
    in words what this process runs with. Under glibc's defaults a block above 32 MiB (a prefill
    program's temporaries, a large output) is mapped afresh and faulted in on every call."""
    import gdn_jax

    if mode == "tuned" and gdn_jax.tune_host_malloc():
        return "malloc tuned (gdn_jax.tune_host_malloc)"
    return "malloc: glibc's defaults" + (" (tuning not available here)" if mode == "tuned" else "")


def make_call(name):
    """A no-argument call of the case that blocks on its results."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    sys.path.insert(0, HERE)
    import run
    from gdn_jax import GDNCache, GDNConfig, Request, build_batch
    from gdn_jax.layer import GatedDeltaNetLayer, GDNLayerConfig, GDNLayerParams

    rng = np.random.default_rng(0)
    if name.startswith("layer_prefill_"):
        T = int(name.rsplit("_", 1)[1])
        core = GDNConfig(num_k_heads=run.H, num_v_heads=run.HV, head_k_dim=run.K, head_v_dim=run.V, conv_width=run.W,
                         act_dtype=jnp.bfloat16)
        cfg = GDNLayerConfig(hidden_size=2048, core=core)  # Qwen3-Next-80B
        params = GDNLayerParams.random(cfg, jax.random.key(0))
        meta = build_batch([Request.prefill(0, T)], num_slots=4, token_bucket=T, row_bucket=2).metadata.to_device()
        layer = GatedDeltaNetLayer(cfg, "native")
        h = jnp.asarray(rng.standard_normal((T, cfg.hidden_size)), jnp.bfloat16)
        box = {"cache": GDNCache.create(cfg.core, 4)}

        def call():
            out, box["cache"], st = layer.prefill_with_status(h, params, box["cache"], meta)
            jax.block_until_ready((out, st))

        return call
    if name.startswith("step_prefill_"):
        T = int(name.rsplit("_", 1)[1])
        return run.layer_call("prefill", jnp.float32, [[Request.prefill(0, T)]], T, 1, 0, 3)
    made = {"conv_fwd_2048": lambda: run.case_conv_fwd(rng, [2048], "native"),
            "gating_8192": lambda: run.case_gating(rng, 8192, "native"),
            "decode_b8": lambda: run.case_decode(rng, 8, jnp.float32, "native"),
            "spec_8x4": lambda: run.case_spec(rng, 8, 4, jnp.float32, "native")}[name]()
    fn, args, donated, _, _, turns = made
    args, i = list(args), [0]

    def call():
        if turns:  # a fresh slot set per call (cold state)
            args[turns[0]] = turns[1][i[0] % len(turns[1])]
        i[0] += 1
        out = fn(*args)
        jax.block_until_ready(out)
        if donated is not None:
            args[donated] = out[1]

    return call


def child(name, mode, seconds):
    """Runs in the child process: the settings first, then the case; prints one JSON line."""
    import gdn_jax

    applied = gdn_jax.tune_host_malloc() if mode == "tuned" else False
    call = make_call(name)
    for _ in range(WARMUP):
        call()
    times = []
    f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    t_end = time.perf_counter() + seconds
    while time.perf_counter() < t_end or len(times) < 5:
        t0 = time.perf_counter()
        call()
        times.append(time.perf_counter() - t0)
    faults = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0) / len(times)
    print(json.dumps(dict(case=name, mode=mode, applied=applied, ms=1e3 * statistics.median(times), calls=len(times),
                          faults=faults, rss_mib=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=3.0, help="of timed calls per process (at least 5 calls)")
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--child", nargs=2, metavar=("CASE", "MODE"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        child(args.child[0], args.child[1], args.seconds)
        return 0
    cases = [c for c in args.cases.split(",") if c]
    unknown = [c for c in cases if c not in CASES]
    if unknown:
        ap.error(f"--cases: unknown {unknown}; known: {', '.join(CASES)}")
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("GLIBC_TUNABLES", None)  # the child sets its allocator itself
    rows = {c: {"system": [], "tuned": []} for c in cases}
    for r in range(args.rounds):
        for c in cases:
            for mode in (("system", "tuned") if r % 2 == 0 else ("tuned", "system")):
                p = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", c, mode,
                                    "--seconds", str(args.seconds)], env=env, capture_output=True, text=True)
                if p.returncode != 0:
                    sys.exit(f"{c} ({mode}) failed:\n{p.stderr[-2000:]}")
                res = json.loads(p.stdout.strip().splitlines()[-1])
                rows[c][mode].append(res)
                print(f"[round {r + 1}/{args.rounds}] {c:<20} {mode:<6} {res['ms']:9.3f} ms  "
                      f"{res['faults']:8.0f} faults/call  {res['rss_mib']:6.0f} MiB", flush=True)
    print(f"\n| case | system ms | tuned ms | tuned / system (median of rounds) | faults per call | peak RSS MiB |")
    print("|---|---:|---:|---:|---:|---:|")
    for c in cases:
        s, t = rows[c]["system"], rows[c]["tuned"]
        med = lambda xs, k: statistics.median(x[k] for x in xs)  # noqa: E731
        ratio = statistics.median(b["ms"] / a["ms"] for a, b in zip(s, t))
        print(f"| {c} | {med(s, 'ms'):.3f} | {med(t, 'ms'):.3f} | {ratio:.2f}x | {med(s, 'faults'):.0f} -> "
              f"{med(t, 'faults'):.0f} | {med(s, 'rss_mib'):.0f} -> {med(t, 'rss_mib'):.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
