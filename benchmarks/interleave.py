"""What a layer step loses after other work (issue #20, item 3): the same step after each of several
preceding conditions, taken in turn in rounds so that all see the same machine, with per-step wall
time, CPU time and run-queue wait of this process's threads (/proc/self/task/*/schedstat) and the
fork/join counters of the kernels (parallel.h):

  idle          after 0.2 s with nothing to do (the round's start)
  b2b           right after the previous step (back to back)
  matmul        right after a jitted bf16 matmul block (~50 ms, XLA's own threads busy)
  matmul+sleep5 the same, then 5 ms asleep
  sleep50       after 50 ms asleep
  read64        after numpy reads 64 MiB (the LLC evicted, no XLA work)
  fma50         after the native FMA probe ran 50 ms on every CPU (hot cores, no XLA, no memory)
  spin50        after Python spun 50 ms on the caller's thread (no XLA work, no sleep)
  program       the matmul block and the step in ONE jitted program, as a model runs them (wall, CPU
                and wait: nan, they hold the block; the step's time is its handler's)

    PYTHONPATH=. python benchmarks/interleave.py --case decode_b8 --seconds 60

A condition that costs more CPU time than idle points at the caches or the clock; one that costs the
same CPU time but more wall time points at waiting (thread wake-up, run queue). The step's wall time
splits into "to handler" (JAX's dispatch and XLA's launch, up to the step handler's entry), "handler"
(its own wall time, StepTimer) and "return" (from its return to the results in Python); "in fors ms"
is the part of the handler inside the kernels' parallel-fors. glibc's allocator is tuned as a server
runs it (--malloc, as layer_breakdown.py)."""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

import jax.numpy as jnp  # noqa: E402

import run as R  # noqa: E402
from host_malloc import add_malloc_arg, apply_malloc  # noqa: E402
from gdn_jax import Request, _ffi  # noqa: E402

CONDITIONS = ("idle", "b2b", "matmul", "matmul+sleep5", "sleep50", "read64", "fma50", "spin50", "program")


def spin(seconds):
    t_end = time.perf_counter() + seconds
    while time.perf_counter() < t_end:
        pass


def make_case(name):
    if name.startswith("decode_b"):
        B, sd = int(name[len("decode_b"):]), jnp.float32
        N = R.pool_slots(R.HV * R.K * R.V * 4, B, True) + B
        return R.layer_call("decode", sd, [[Request.decode(s * B + i) for i in range(B)] for s in range(N // B)],
                            B, B, 0, N)
    if name.startswith("prefill_"):
        T = int(name[len("prefill_"):])
        return R.layer_call("prefill", jnp.float32, [[Request.prefill(0, T)]], T, 1, 0, 3)
    raise SystemExit(f"unknown case {name} (decode_bB, prefill_T)")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--case", default="decode_b8")
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--conditions", default=",".join(CONDITIONS))
    add_malloc_arg(ap)
    args = ap.parse_args(argv)
    malloc_text = apply_malloc(args.malloc)
    conds = args.conditions.split(",")
    unknown = [c for c in conds if c not in CONDITIONS]
    if unknown:
        ap.error(f"--conditions: unknown {unknown}; known: {', '.join(CONDITIONS)}")
    call = make_case(args.case)
    block, block_ms = R.matmul_block()
    big = np.ones(64 << 18, np.float32)
    fma = _ffi._gdn_ffi.fma_peak_gflops
    cpus = len(os.sched_getaffinity(0))
    before = {"idle": lambda: time.sleep(0.2), "b2b": lambda: None, "matmul": block,
              "matmul+sleep5": lambda: (block(), time.sleep(0.005)), "sleep50": lambda: time.sleep(0.05),
              "read64": lambda: big.sum(), "fma50": lambda: fma(cpus, 0.05), "spin50": lambda: spin(0.05),
              "program": lambda: None}
    program = R.in_program_call(call) if "program" in conds else None
    rec = {c: [] for c in conds}
    snap0, rounds = R._cpu_snapshot(), 0
    t_end = time.perf_counter() + args.seconds
    while rounds == 0 or time.perf_counter() < t_end:  # one round at least
        for c in conds:
            before[c]()
            R._counters()
            r0, w0 = R.threads_ns()
            t0 = time.monotonic_ns()
            (program if c == "program" else call)()
            t1 = time.monotonic_ns()
            r1, w1 = R.threads_ns()
            rec[c].append(((t1 - t0) / 1e6, (r1 - r0) / 1e6, (w1 - w0) / 1e6, R._counters(), (t0, t1)))
        rounds += 1
    fc = R.foreign_cores(snap0, R._cpu_snapshot())
    print(f"# {args.case}: {rounds} rounds, {malloc_text}, matmul block {block_ms:.0f} ms, other processes used "
          f"{fc} cores meanwhile (a loaded host lengthens every row; compare rows, not runs)")
    base = np.median([x[0] for x in rec[conds[0]]]) if conds[0] != "program" else float("nan")
    nan = float("nan")
    print(f"{'condition':14s} {'wall ms':>8s} {'/ ' + conds[0]:>8s} {'to handler us':>13s} {'handler ms':>10s} "
          f"{'return us':>9s} {'cpu ms':>7s} {'rq wait':>8s} {'helper start us':>15s} {'late':>5s} {'join us':>8s} "
          f"{'in fors ms':>10s}")
    for c in conds:
        xs = rec[c]
        fj = R._fork_join([x[3] for x in xs], [x[4] for x in xs]) or {}
        val = lambda k: nan if fj.get(k) is None else fj[k]  # noqa: E731
        wall = nan if c == "program" else np.median([x[0] for x in xs])  # the program's wall holds the block
        cpu = nan if c == "program" else np.median([x[1] for x in xs])
        wait = nan if c == "program" else np.median([x[2] for x in xs])
        print(f"{c:14s} {wall:8.3f} {wall / base:8.2f} {nan if c == 'program' else val('to_handler_us'):13.0f} "
              f"{val('handler_ms'):10.3f} {nan if c == 'program' else val('return_us'):9.0f} {cpu:7.2f} "
              f"{wait:8.2f} {val('helper_start_us'):15.0f} {val('late_helper_frac'):5.2f} "
              f"{val('join_wait_us'):8.0f} {val('job_ms'):10.3f}", flush=True)


if __name__ == "__main__":
    main()
