"""The layer's projection alone: packed weights, Hugging Face's [out, in] layout, XLA's dot.

Times ``gdn_jax.ops.linear`` with bf16 x and w at a projection shape (default Qwen3-Next-80B's
in_proj, [12352 x 2048]) for several token counts: the native kernel on packed weights
(``pack_linear_weight``, gdn_jax_linear_packed), on the [out, in] weights (gdn_jax_linear) and
XLA's dot (``impl="reference"``). The three are timed in turn within each round and the rounds
repeat, so each ratio is of medians taken under the same load; the table is the median of the
round medians.

    PYTHONPATH=. python benchmarks/linear_bench.py                       # T = 1, 8, 64, 512
    PYTHONPATH=. python benchmarks/linear_bench.py --tokens 8 --out 5120 --in 5120 --rounds 5
    PYTHONPATH=. python benchmarks/linear_bench.py --quick               # small shapes, a smoke run
"""
from __future__ import annotations

import argparse
import statistics
import sys

import jax
import jax.numpy as jnp
import numpy as np

import gdn_jax
from gdn_jax.ops import linear, pack_linear_weight
from layer_breakdown import median_ms  # benchmarks/ is the script's directory

LAYOUTS = ("packed", "plain", "xla")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", default="1,8,64,512", help="comma list of T")
    ap.add_argument("--out", type=int, default=12352, dest="n_out")
    ap.add_argument("--in", type=int, default=2048, dest="n_in")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=1.0, help="per timing (XLA's slow cases: 3 calls at least)")
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args(argv)
    if args.quick:
        args.tokens, args.n_out, args.n_in, args.rounds, args.seconds = "1,9", 100, 70, 1, 0.05
    if not gdn_jax.native_available():
        print("the native extension is not built (make build)")
        return 1
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
               "?") if sys.platform.startswith("linux") else "?"
    print(f"projection [{args.n_out} x {args.n_in}] bf16 on {cpu}, ISA {gdn_jax.selected_isa()}, jax "
          f"{jax.__version__}", flush=True)
    rng = np.random.default_rng(0)
    w = jnp.asarray(rng.standard_normal((args.n_out, args.n_in)) * 0.02, jnp.bfloat16)
    weights = {"packed": pack_linear_weight(w), "plain": w, "xla": w}
    fns = {k: jax.jit(lambda x, w_, impl=("reference" if k == "xla" else "native"): linear(x, w_, impl=impl))
           for k in LAYOUTS}
    print("| T | packed ms | plain ms | XLA dot ms | packed / plain | packed GFLOP/s | packed GB/s of w |")
    print("|---|---|---|---|---|---|---|")
    for T in (int(t) for t in args.tokens.split(",")):
        x = jnp.asarray(rng.standard_normal((T, args.n_in)), jnp.bfloat16)
        rounds = {k: [] for k in LAYOUTS}
        for _ in range(args.rounds):
            for k in LAYOUTS:
                rounds[k].append(median_ms(lambda k=k: fns[k](x, weights[k]), warmup=1, min_iters=3,
                                           target_s=args.seconds))
        ms = {k: statistics.median(v) for k, v in rounds.items()}
        gflops = 2 * T * args.n_in * args.n_out / ms["packed"] / 1e6
        gbs = args.n_out * args.n_in * 2 / ms["packed"] / 1e6
        print(f"| {T} | {ms['packed']:.2f} | {ms['plain']:.2f} | {ms['xla']:.2f} | "
              f"{ms['packed'] / ms['plain']:.2f} | {gflops:.1f} | {gbs:.1f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
