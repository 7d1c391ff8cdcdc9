"""Chunk size of the chunked prefill, 32 against 64, paired (issue 20, item 4).

The chunk kernel (ffi/src/kernels/chunk.h) is compiled for C = 32 and C = 64; each ISA picks one
for sequences longer than 128 tokens (GDN_CHUNK_LONG in its translation unit) and 64 for shorter
ones. This times `chunk_gated_delta_rule` (native, jitted, pool donated) at Qwen3-Next-80B head
shapes (H=16, HV=32, K=V=128) with the size forced in turn, one call each, the order swapped every
round, so that both see the same machine, and prints per case the medians and the median of the
paired ratios C=32 / C=64 (below 1: 32 is faster), with the algorithm's flops at each size
(run.chunk_flops) as a fraction of the f32 FMA peak measured in the same run. glibc's allocator is
tuned as a server runs it (--malloc, as layer_breakdown.py: the output at T = 8192 is 64 MiB).

    PYTHONPATH=. python benchmarks/chunk_size.py [--isa avx2] [--rounds 15] [--cases 64,128,512,2048,8192,4x512]
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import gdn_jax  # noqa: E402
from gdn_jax import _gdn_ffi, ops  # noqa: E402

import roofline  # noqa: E402
import run  # noqa: E402
from host_malloc import add_malloc_arg, apply_malloc  # noqa: E402

SIZES = (64, 32)


def case(lens, act, init, rng):
    """A jitted chunk call on random inputs of these sequence lengths; returns (call, state)."""
    H, HV, K, V = run.H, run.HV, run.K, run.V
    T, S = sum(lens), len(lens)
    r = lambda shape, dt, s=1.0: jnp.asarray(rng.standard_normal(shape) * s, dt)  # noqa: E731
    q, k, v = r((T, H, K), act), r((T, H, K), act), r((T, HV, V), act)
    g = -jnp.abs(r((T, HV), jnp.float32, 0.1))
    beta = jax.nn.sigmoid(r((T, HV), jnp.float32))
    qsl = jnp.asarray(np.concatenate([[0], np.cumsum(lens)]), jnp.int32)
    idx = jnp.arange(S, dtype=jnp.int32) + 1
    hs = jnp.full((S,), init)
    fn = jax.jit(lambda pool: ops.chunk_gated_delta_rule(
        q, k, v, g=g, beta=beta, ssm_state=pool, query_start_loc=qsl, state_indices=idx, has_initial_state=hs,
        impl="native"), donate_argnums=0)
    return fn, r((S + 2, HV, K, V), jnp.float32, 0.1)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--isa", default=None, help="force an ISA (default: the selected one)")
    ap.add_argument("--rounds", type=int, default=15, help="paired calls per size and case (x4 below 512 tokens)")
    ap.add_argument("--cases", default="64,128,512,2048,8192,4x512",
                    help="sequence lengths; AxB = A sequences of B tokens")
    ap.add_argument("--act", default="bfloat16", choices=("bfloat16", "float32"))
    ap.add_argument("--initial-state", action="store_true", help="every sequence continues from its slot")
    add_malloc_arg(ap)
    args = ap.parse_args()
    malloc_text = apply_malloc(args.malloc)
    if args.isa:
        _gdn_ffi.select_isa(args.isa)
    threads = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    peak = max(roofline.fma_peak_gflops(threads) for _ in range(3))
    act = jnp.dtype(args.act)
    print(f"ISA {gdn_jax.selected_isa()}, jax {jax.__version__}, {threads} threads, f32 FMA peak {peak:.1f} GFLOP/s; "
          f"{malloc_text}; act {act.name}, initial state {args.initial_state}; chunk size used now: "
          f"{run.chunk_size_note()}", flush=True)
    rng = np.random.default_rng(0)
    try:
        for spec in args.cases.split(","):
            lens = [int(spec.split("x")[1])] * int(spec.split("x")[0]) if "x" in spec else [int(spec)]
            fn, pool = case(lens, act, args.initial_state, rng)
            times = {c: [] for c in SIZES}
            rounds = args.rounds * (4 if sum(lens) < 512 else 1)
            for c in SIZES:  # compile once, warm both sizes
                _gdn_ffi.force_chunk_size(c)
                o, pool = fn(pool)
                o.block_until_ready()
            for i in range(rounds):
                for c in SIZES if i % 2 == 0 else SIZES[::-1]:
                    _gdn_ffi.force_chunk_size(c)
                    t = time.perf_counter()
                    o, pool = fn(pool)
                    o.block_until_ready()
                    times[c].append(time.perf_counter() - t)
            ratio = float(np.median(np.array(times[32]) / np.array(times[64])))
            cols = []
            for c in SIZES:
                ms = float(np.median(times[c])) * 1e3
                gf = run.chunk_flops(lens, c) / (ms * 1e-3) / 1e9
                cols.append(f"C={c} {ms:8.2f} ms {gf:6.1f} GFLOP/s ({100 * gf / peak:4.1f}% of peak)")
            print(f"{spec:>8s}: " + "  ".join(cols) + f"  paired 32/64 {ratio:.3f}", flush=True)
    finally:
        _gdn_ffi.force_chunk_size(0)


if __name__ == "__main__":
    main()
