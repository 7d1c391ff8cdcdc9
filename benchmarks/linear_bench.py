"""The layer's projection alone: packed weights, Hugging Face's [out, in] layout, XLA's dot.

Times ``gdn_jax.ops.linear`` with bf16 x and w at a projection shape (default Qwen3-Next-80B's
in_proj, [12352 x 2048]) for several token counts: the native kernel on packed weights
(``pack_linear_weight``, gdn_jax_linear_packed), on the [out, in] weights (gdn_jax_linear) and
XLA's dot (``impl="reference"``). The three are timed in turn within each round and the rounds
repeat, so each ratio is of medians taken under the same load; the table is the median of the
round medians. The packed kernel's rate is given against the bf16 dot-product peak and its weight
stream against the read bandwidth, both probed natively in the same run (roofline.py; the
bandwidth as the best of a probe before and one after the table): decode-sized T is bound by the
stream, prefill-sized T by the dots. The calls cycle over copies of w that hold at least 4x the
last-level cache together (--cold-bytes), so that w comes from memory, as each layer's weights do
in a model's forward: one copy of in_proj (48 MiB, 1.5x a 32 MiB LLC) read over and over is partly
served from the LLC. glibc's allocator is tuned as a server runs it (--malloc, as layer_breakdown.py):
under its defaults an output above 32 MiB (in_proj's from T = 2048) is faulted in on every call.

    PYTHONPATH=. python benchmarks/linear_bench.py                       # T = 1, 8, 64, 512
    PYTHONPATH=. python benchmarks/linear_bench.py --tokens 8 --out 5120 --in 5120 --rounds 5
    PYTHONPATH=. python benchmarks/linear_bench.py --quick               # small shapes, a smoke run
"""
from __future__ import annotations

import argparse
import itertools
import os
import statistics
import sys

import jax
import jax.numpy as jnp
import numpy as np

import gdn_jax
import roofline  # benchmarks/ is the script's directory
from gdn_jax.ops import linear, pack_linear_weight
from host_malloc import add_malloc_arg, apply_malloc
from layer_breakdown import median_ms

LAYOUTS = ("packed", "plain", "xla")


def _sig3(v: float) -> str:
    """Three significant digits without an exponent: a 4 us call on a fast host reads 0.00412, not 0.00."""
    return np.format_float_positional(v, precision=3, unique=False, fractional=False, trim="-")


def _share(value: float, roofline: float) -> str:
    """value as a % of its roofline; above 100% the probe undercounts, and the cell says so (as report.py)."""
    share = 100 * value / roofline
    return f"above the probe ({share:.0f}%): probe wrong" if share > 100 else _sig3(share)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", default="1,8,64,512", help="comma list of T")
    ap.add_argument("--out", type=int, default=12352, dest="n_out")
    ap.add_argument("--in", type=int, default=2048, dest="n_in")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=1.0, help="per timing (XLA's slow cases: 3 calls at least)")
    ap.add_argument("--cold-bytes", type=int, default=roofline.COLD_BYTES,
                    help="the calls cycle over copies of w holding at least this many bytes (0: one copy)")
    ap.add_argument("--quick", action="store_true")
    add_malloc_arg(ap)
    args = ap.parse_args(argv)
    if args.quick:
        args.tokens, args.n_out, args.n_in, args.rounds, args.seconds = "1,9", 100, 70, 1, 0.05
        args.cold_bytes = 2 * args.n_out * args.n_in * 2  # two copies: the cycling runs
    if not gdn_jax.native_available():
        print("the native extension is not built (make build)")
        return 1
    malloc_text = apply_malloc(args.malloc)
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
               "?") if sys.platform.startswith("linux") else "?"
    print(f"projection [{args.n_out} x {args.n_in}] bf16 on {cpu}, ISA {gdn_jax.selected_isa()}, jax "
          f"{jax.__version__}, {malloc_text}", flush=True)
    threads = os.cpu_count() or 1
    probe_bytes = (1 << 22) if args.quick else roofline.PROBE_BYTES
    read_gbs = [roofline.bandwidth_gbs("read", probe_bytes)]
    fma_peak = roofline.fma_peak_gflops(threads)
    dot_peak, dot_source = roofline.bf16_dot_peak(gdn_jax.selected_isa(), threads, fma_peak)
    if dot_peak is None:  # a module built without the bf16 probe: said so in dot_source
        dot_peak = fma_peak
    print(f"bf16 peak {dot_peak:.1f} GFLOP/s ({dot_source}); read bandwidth {read_gbs[0]:.1f} GB/s (before)",
          flush=True)
    rng = np.random.default_rng(0)
    w_np = rng.standard_normal((args.n_out, args.n_in)) * 0.02
    w_bytes = args.n_out * args.n_in * 2
    copies = max(1, -(-args.cold_bytes // w_bytes))
    plain = [jnp.asarray(w_np, jnp.bfloat16) for _ in range(copies)]  # distinct buffers, same values
    weights = {"packed": [pack_linear_weight(w) for w in plain], "plain": plain, "xla": plain}
    turn = {k: itertools.cycle(range(copies)) for k in LAYOUTS}
    print(f"w cycled over {copies} cop{'y' if copies == 1 else 'ies'} per layout ({copies * w_bytes / 2**20:.1f} "
          f"MiB)", flush=True)
    fns = {k: jax.jit(lambda x, w_, impl=("reference" if k == "xla" else "native"): linear(x, w_, impl=impl))
           for k in LAYOUTS}
    print("| T | packed ms | plain ms | XLA dot ms | packed / plain | packed GFLOP/s | % of bf16 peak | "
          "packed GB/s of w | % of read bandwidth |")
    print("|---|---|---|---|---|---|---|---|---|")
    table = []
    for T in (int(t) for t in args.tokens.split(",")):
        x = jnp.asarray(rng.standard_normal((T, args.n_in)), jnp.bfloat16)
        rounds = {k: [] for k in LAYOUTS}
        for _ in range(args.rounds):
            for k in LAYOUTS:
                rounds[k].append(median_ms(lambda k=k: fns[k](x, weights[k][next(turn[k])]), warmup=1,
                                           min_iters=3, target_s=args.seconds))
        ms = {k: statistics.median(v) for k, v in rounds.items()}
        gflops = 2 * T * args.n_in * args.n_out / ms["packed"] / 1e6
        gbs = args.n_out * args.n_in * 2 / ms["packed"] / 1e6
        table.append((T, ms, gflops, gbs))
        cells = [_sig3(v) for v in (ms["packed"], ms["plain"], ms["xla"], ms["packed"] / ms["plain"], gflops)]
        cells += [_share(gflops, dot_peak), _sig3(gbs), _share(gbs, read_gbs[0])]
        print(f"| {T} | " + " | ".join(cells) + " |", flush=True)
    read_gbs.append(roofline.bandwidth_gbs("read", probe_bytes))
    if read_gbs[1] > read_gbs[0]:
        print(f"read bandwidth after the table {read_gbs[1]:.1f} GB/s: % of read bandwidth against it: "
              + ", ".join(f"T={T} {_share(gbs, read_gbs[1])}" for T, _, _, gbs in table))
    else:
        print(f"read bandwidth after the table {read_gbs[1]:.1f} GB/s (the fractions use {read_gbs[0]:.1f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
