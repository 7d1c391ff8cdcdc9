"""Benchmarks: each GDN op as a user calls it (jit, caches donated), native kernels against
the pure-jnp reference in the same run, Qwen3-Next-80B per-layer shapes.

    python benchmarks/run.py            # all cases (a few minutes on 2 cores)
    python benchmarks/run.py --quick    # smoke run (CI-sized)

Writes benchmarks/out/results.json and prints a Markdown table (median ms over repeated calls,
tokens/s, native/reference speed-up). The machine is shared and noisy: quote medians and ratios.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import gdn_jax  # noqa: E402
from gdn_jax import ops  # noqa: E402

H, HV, K, V, W = 16, 32, 128, 128, 4
D = 2 * H * K + HV * V
LLC_BYTES = 32 << 20


def timeit(fn, args, *, donate_idx, min_iters=5, target_s=1.0, max_iters=200):
    """Median wall time (ms) of fn(*args) threading the donated cache through the calls."""
    args = list(args)
    out = fn(*args)
    jax.block_until_ready(out)
    if donate_idx is not None:
        args[donate_idx] = out[1]
    times = []
    t_end = time.perf_counter() + target_s
    while len(times) < min_iters or (time.perf_counter() < t_end and len(times) < max_iters):
        t0 = time.perf_counter()
        out = fn(*args)
        jax.block_until_ready(out)
        times.append((time.perf_counter() - t0) * 1e3)
        if donate_idx is not None:
            args[donate_idx] = out[1]
    return statistics.median(times), np.percentile(times, 10), np.percentile(times, 90)


def rnd(rng, shape, dtype, scale=1.0):
    return jnp.asarray(rng.standard_normal(shape, dtype=np.float32) * scale, dtype)


def pool_slots(slot_bytes, used, cold):
    """Enough slots that the pool exceeds the LLC (cold state) when asked."""
    if not cold:
        return max(used, 1)
    return max(used, int(np.ceil(2 * LLC_BYTES / slot_bytes)))


def case_decode(rng, B, state_dtype, impl, cold=True):
    sb = HV * K * V * jnp.dtype(state_dtype).itemsize
    N = pool_slots(sb, B, cold)
    q, k = rnd(rng, (B, H, K), jnp.bfloat16), rnd(rng, (B, H, K), jnp.bfloat16)
    v = rnd(rng, (B, HV, V), jnp.bfloat16)
    a, b = rnd(rng, (B, HV), jnp.bfloat16), rnd(rng, (B, HV), jnp.bfloat16)
    A_log = jnp.log(jnp.linspace(1, 16, HV, dtype=jnp.float32))
    dt = jnp.zeros((HV,), jnp.float32)
    pool = jnp.zeros((N, HV, K, V), state_dtype)
    idx = jnp.asarray(rng.permutation(N)[:B], jnp.int32)
    fn = jax.jit(lambda q, k, v, a, b, pool: ops.fused_sigmoid_gating_delta_rule_update(
        q, k, v, a=a, b=b, A_log=A_log, dt_bias=dt, ssm_state=pool, state_indices=idx, impl=impl), donate_argnums=5)
    return fn, (q, k, v, a, b, pool), 5, B, 2 * B * sb


def case_spec(rng, S, Q, state_dtype, impl, cold=True):
    sb = HV * K * V * jnp.dtype(state_dtype).itemsize
    T = S * Q
    N = pool_slots(sb, S * Q, cold)
    q, k = rnd(rng, (T, H, K), jnp.bfloat16), rnd(rng, (T, H, K), jnp.bfloat16)
    v = rnd(rng, (T, HV, V), jnp.bfloat16)
    a, b = rnd(rng, (T, HV), jnp.bfloat16), rnd(rng, (T, HV), jnp.bfloat16)
    A_log = jnp.log(jnp.linspace(1, 16, HV, dtype=jnp.float32))
    dt = jnp.zeros((HV,), jnp.float32)
    pool = jnp.zeros((N, HV, K, V), state_dtype)
    idx = jnp.asarray(rng.permutation(N)[:S * Q].reshape(S, Q), jnp.int32)
    qsl = jnp.arange(0, T + 1, Q, dtype=jnp.int32)
    acc = jnp.asarray(rng.integers(1, Q + 1, size=S), jnp.int32)
    fn = jax.jit(lambda q, k, v, a, b, pool: ops.fused_sigmoid_gating_delta_rule_update_spec(
        q, k, v, a=a, b=b, A_log=A_log, dt_bias=dt, ssm_state=pool, query_start_loc=qsl, spec_state_indices=idx,
        num_accepted_tokens=acc, impl=impl), donate_argnums=5)
    return fn, (q, k, v, a, b, pool), 5, T, S * sb * (1 + Q)


def case_chunk(rng, lens, state_dtype, impl):
    T = sum(lens)
    S = len(lens)
    q, k = rnd(rng, (T, H, K), jnp.bfloat16), rnd(rng, (T, H, K), jnp.bfloat16)
    v = rnd(rng, (T, HV, V), jnp.bfloat16)
    g = -jnp.abs(rnd(rng, (T, HV), jnp.float32, 0.1))
    beta = jax.nn.sigmoid(rnd(rng, (T, HV), jnp.float32))
    pool = jnp.zeros((S + 2, HV, K, V), state_dtype)
    qsl = jnp.asarray(np.concatenate([[0], np.cumsum(lens)]), jnp.int32)
    idx = jnp.arange(S, dtype=jnp.int32) + 1
    hs = jnp.zeros((S,), bool)
    fn = jax.jit(lambda q, k, v, g, beta, pool: ops.chunk_gated_delta_rule(
        q, k, v, g=g, beta=beta, ssm_state=pool, query_start_loc=qsl, state_indices=idx, has_initial_state=hs,
        impl=impl), donate_argnums=5)
    n_chunks = sum((n + 63) // 64 for n in lens)
    # Chunked algorithm flops per value head: intra (KK^T, solve, W, U) + inter (QK^T, WS, QS, PV, K^T V).
    flops = HV * (n_chunks * 64 * 64 * (2 * K + 64 / 3 + 2 * K + 2 * V + 2 * K + 2 * V)
                  + T * (2 * K * V * 3 + 2 * K * V))
    return fn, (q, k, v, g, beta, pool), 5, T, flops


def case_conv_fwd(rng, lens, impl):
    T, S = sum(lens), len(lens)
    x = rnd(rng, (T, D), jnp.bfloat16)
    w = rnd(rng, (D, W), jnp.bfloat16, 0.5)
    pool = jnp.zeros((S + 2, W - 1, D), jnp.bfloat16)
    qsl = jnp.asarray(np.concatenate([[0], np.cumsum(lens)]), jnp.int32)
    idx = jnp.arange(S, dtype=jnp.int32) + 1
    hs = jnp.ones((S,), bool)
    fn = jax.jit(lambda x, pool: ops.causal_conv1d_fwd(
        x, weight=w, bias=None, conv_state=pool, query_start_loc=qsl, state_indices=idx, has_initial_state=hs,
        impl=impl), donate_argnums=1)
    return fn, (x, pool), 1, T, 2 * T * D * 2


def case_conv_update(rng, B, impl):
    x = rnd(rng, (B, D), jnp.bfloat16)
    w = rnd(rng, (D, W), jnp.bfloat16, 0.5)
    N = max(B, 64)
    pool = jnp.zeros((N, W - 1, D), jnp.bfloat16)
    idx = jnp.asarray(rng.permutation(N)[:B], jnp.int32)
    fn = jax.jit(lambda x, pool: ops.causal_conv1d_update(
        x, weight=w, bias=None, conv_state=pool, state_indices=idx, impl=impl), donate_argnums=1)
    return fn, (x, pool), 1, B, B * D * 2 * (2 * (W - 1) + 2)


def case_gating(rng, T, impl):
    a, b = rnd(rng, (T, HV), jnp.bfloat16), rnd(rng, (T, HV), jnp.bfloat16)
    A_log = jnp.zeros((HV,), jnp.float32)
    dt = jnp.zeros((HV,), jnp.float32)
    fn = jax.jit(lambda a, b: ops.fused_gdn_gating(a, b, A_log=A_log, dt_bias=dt, impl=impl))
    return fn, (a, b), None, T, 0


def cases(quick):
    f32, bf16 = jnp.float32, jnp.bfloat16
    out = [
        ("gating", "T=8192", lambda r, i: case_gating(r, 8192, i)),
        ("conv_update", "B=8", lambda r, i: case_conv_update(r, 8, i)),
        ("conv_fwd", "T=2048", lambda r, i: case_conv_fwd(r, [2048], i)),
        ("decode", "B=8 f32", lambda r, i: case_decode(r, 8, f32, i)),
        ("spec", "8x4 f32", lambda r, i: case_spec(r, 8, 4, f32, i)),
        ("chunk", "T=512 f32", lambda r, i: case_chunk(r, [512], f32, i)),
    ]
    if quick:
        return out
    out += [
        ("conv_update", "B=1", lambda r, i: case_conv_update(r, 1, i)),
        ("conv_update", "B=32", lambda r, i: case_conv_update(r, 32, i)),
        ("conv_fwd", "T=512", lambda r, i: case_conv_fwd(r, [512], i)),
        ("conv_fwd", "T=8192", lambda r, i: case_conv_fwd(r, [8192], i)),
        ("conv_fwd", "4x512", lambda r, i: case_conv_fwd(r, [512] * 4, i)),
        ("decode", "B=1 f32", lambda r, i: case_decode(r, 1, f32, i)),
        ("decode", "B=32 f32", lambda r, i: case_decode(r, 32, f32, i)),
        ("decode", "B=1 bf16", lambda r, i: case_decode(r, 1, bf16, i)),
        ("decode", "B=8 bf16", lambda r, i: case_decode(r, 8, bf16, i)),
        ("decode", "B=32 bf16", lambda r, i: case_decode(r, 32, bf16, i)),
        ("spec", "8x4 bf16", lambda r, i: case_spec(r, 8, 4, bf16, i)),
        ("chunk", "T=2048 f32", lambda r, i: case_chunk(r, [2048], f32, i)),
        ("chunk", "T=8192 f32", lambda r, i: case_chunk(r, [8192], f32, i)),
        ("chunk", "4x512 f32", lambda r, i: case_chunk(r, [512] * 4, f32, i)),
        ("chunk", "T=2048 bf16", lambda r, i: case_chunk(r, [2048], bf16, i)),
    ]
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="a few small cases (smoke test)")
    ap.add_argument("--impls", default="native,reference")
    ap.add_argument("--target-s", type=float, default=1.0, help="seconds of timed calls per case")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "out", "results.json"))
    args = ap.parse_args()
    impls = args.impls.split(",")
    target = 0.2 if args.quick else args.target_s
    env = dict(machine=platform.machine(), processor=platform.processor(), cpus=os.cpu_count(),
               isa=gdn_jax.selected_isa(), cpu_features=gdn_jax.cpu_features(), jax=jax.__version__)
    print(f"# gdn_jax benchmarks  isa={env['isa']}  cpus={env['cpus']}  jax={env['jax']}", flush=True)
    rows = []
    all_cases = cases(args.quick)
    for n, (op, label, make) in enumerate(all_cases, 1):
        row = dict(op=op, case=label)
        for impl in impls:
            rng = np.random.default_rng(0)
            fn, fargs, didx, tokens, work = make(rng, impl)
            med, p10, p90 = timeit(fn, fargs, donate_idx=didx, target_s=target)
            row[impl] = dict(median_ms=med, p10_ms=p10, p90_ms=p90, tokens_per_s=tokens / med * 1e3)
            row["work"] = work
            del fn, fargs
        if "native" in row and "reference" in row:
            row["speedup_vs_reference"] = row["reference"]["median_ms"] / row["native"]["median_ms"]
        rows.append(row)
        cols = "  ".join(f"{i} {row[i]['median_ms']:9.3f} ms" for i in impls)
        sp = f"  x{row['speedup_vs_reference']:.1f}" if "speedup_vs_reference" in row else ""
        print(f"[{n}/{len(all_cases)}] {op:12s} {label:12s} {cols}{sp}", flush=True)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(dict(env=env, rows=rows), f, indent=1)
    print("\n| op | case | " + " | ".join(f"{i} median ms" for i in impls) + " | native tok/s | native vs reference |")
    print("|---|---|" + "---:|" * (len(impls) + 2))
    for r in rows:
        cells = " | ".join(f"{r[i]['median_ms']:.3f}" for i in impls)
        tok = f"{r['native']['tokens_per_s']:.0f}" if "native" in r else ""
        sp = f"{r['speedup_vs_reference']:.1f}x" if "speedup_vs_reference" in r else ""
        print(f"| {r['op']} | {r['case']} | {cells} | {tok} | {sp} |")


if __name__ == "__main__":
    main()
