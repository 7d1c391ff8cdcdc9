"""The roofline probes and the decode op, in turn (ffi/README.md, "Limits"): each round runs the native
read-modify-write / read / copy / spec-pattern probes, the old numpy 2-thread copy and the decode op
(cold pool), so that the ratios decode / probe hold on a shared host whose load changes between rounds.

    PYTHONPATH=. python benchmarks/roofline_pair.py --batch 32 --rounds 8
"""
from __future__ import annotations

import argparse
import concurrent.futures as cf
import os
import statistics
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

import jax.numpy as jnp  # noqa: E402

import roofline  # noqa: E402
import run as R  # noqa: E402


def numpy_copy_gbs(nbytes=256 << 20):
    """The roofline before issue #20: numpy copying two halves on two Python threads (read + written)."""
    src = np.ones(nbytes // 4, np.float32)
    dst = np.empty_like(src)
    halves = [slice(0, src.size // 2), slice(src.size // 2, None)]
    with cf.ThreadPoolExecutor(2) as ex:
        list(ex.map(lambda sl: np.copyto(dst[sl], src[sl]), halves))
        t0 = time.perf_counter()
        list(ex.map(lambda sl: np.copyto(dst[sl], src[sl]), halves))
        return 2 * nbytes / (time.perf_counter() - t0) / 1e9


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=8)
    args = ap.parse_args(argv)
    fn, fargs, didx, tokens, work, rot = R.case_decode(np.random.default_rng(0), args.batch, jnp.float32, "native")
    fargs = list(fargs)
    rows = {k: [] for k in (*roofline.BANDWIDTH_MODES, "numpy_copy", "decode")}
    for _ in range(args.rounds):
        for k in roofline.BANDWIDTH_MODES:
            rows[k].append(roofline.bandwidth_gbs(k, reps=3))
        rows["numpy_copy"].append(numpy_copy_gbs())
        st = R.timeit(fn, fargs, donate_idx=didx, tokens=tokens, rotate=rot, target_s=0.3)
        rows["decode"].append(work / st["median_ms"] / 1e6)
    print("GB/s, median (best) over rounds:",
          ", ".join(f"{k} {statistics.median(v):.1f} ({max(v):.1f})" for k, v in rows.items()))
    per = {k: np.asarray(v) for k, v in rows.items()}
    print(f"per round, median: decode / rmw {statistics.median(per['decode'] / per['rmw']):.2f}, decode / numpy "
          f"copy {statistics.median(per['decode'] / per['numpy_copy']):.2f}, rmw / numpy copy "
          f"{statistics.median(per['rmw'] / per['numpy_copy']):.2f}")


if __name__ == "__main__":
    main()
