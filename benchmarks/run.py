"""Benchmarks at Qwen3-Next-80B per-layer shapes (H=16, HV=32, K=V=128, D=8192, W=4, bf16
activations), everything jitted with the caches donated, as a user calls it:

* ops: each op alone, native kernels against the pure-jnp reference (impl="reference");
* layer: the serving steps (conv + gating + recurrence: GDNAttention.decode / spec_decode /
  prefill) against the fastest pure-JAX version we know (../shared/bench/jnp_baseline, same
  cases, cold state pools larger than the LLC), measured in the same run;
* roofline: this machine's copy bandwidth and f32 FMA peak, measured here; decode/spec rows
  report state GB/s and its fraction of the copy bandwidth, prefill rows GFLOP/s (the chunked
  algorithm's flops) and the fraction of the FMA peak.

    python benchmarks/run.py            # everything (several minutes on 2 cores)
    python benchmarks/run.py --quick    # smoke run (CI-sized)

Writes benchmarks/out/results.json and prints Markdown tables (median ms, tokens/s, ratios).
The machine is shared and noisy: quote medians and ratios from one run.
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


def case_decode_pool(rng, B, N, impl):
    """Decode with a fixed pool size N (bf16 state), to show the cost does not grow with N."""
    sb = HV * K * V * 2
    q, k = rnd(rng, (B, H, K), jnp.bfloat16), rnd(rng, (B, H, K), jnp.bfloat16)
    v = rnd(rng, (B, HV, V), jnp.bfloat16)
    a, b = rnd(rng, (B, HV), jnp.bfloat16), rnd(rng, (B, HV), jnp.bfloat16)
    A_log = jnp.log(jnp.linspace(1, 16, HV, dtype=jnp.float32))
    dt = jnp.zeros((HV,), jnp.float32)
    pool = jnp.zeros((N, HV, K, V), jnp.bfloat16)
    idx = jnp.arange(B, dtype=jnp.int32) * (N // B)
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
        # Cost independent of the pool size (native only: the reference is not the point here).
        ("decode_pool", "B=8 N=64 bf16", lambda r, i: case_decode_pool(r, 8, 64, i)),
        ("decode_pool", "B=8 N=2048 bf16", lambda r, i: case_decode_pool(r, 8, 2048, i)),
    ]
    return out


# --- roofline ---------------------------------------------------------------------------------


def copy_bandwidth_gbs(nbytes=256 << 20, reps=5):
    """Median copy bandwidth (read + write bytes) of a 2-thread memcpy-like copy (numpy, halves)."""
    import concurrent.futures as cf

    src = np.ones(nbytes // 4, np.float32)
    dst = np.empty_like(src)
    half = src.size // 2
    ts = []
    with cf.ThreadPoolExecutor(2) as ex:
        for _ in range(reps):
            t0 = time.perf_counter()
            list(ex.map(lambda sl: np.copyto(dst[sl], src[sl]), [slice(0, half), slice(half, None)]))
            ts.append(time.perf_counter() - t0)
    return 2 * nbytes / statistics.median(ts) / 1e9


def fma_peak_gflops(threads):
    from gdn_jax import _ffi

    return max(_ffi._gdn_ffi.fma_peak_gflops(threads, 0.3) for _ in range(3))


# --- layer: serving steps against the fast pure-JAX baseline ---------------------------------------

BASELINE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), os.pardir, "shared", "bench",
                        "jnp_baseline", "bench_jnp_baseline.py")
# The fastest baseline variant per case on this kind of machine (its RESULTS.md).
BASELINE_VARIANT = {"decode": "loop", "spec": "loop_tok", "prefill": "fused_c32", "prefill_seq": "fused_c32_seq"}


def load_baseline():
    import importlib.util

    path = os.path.abspath(BASELINE)
    if not os.path.exists(path):
        return None
    spec = importlib.util.spec_from_file_location("bench_jnp_baseline", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def layer_step(kind, state_dtype, requests_sets, T, S, num_spec, N, target):
    """Median ms of GDNAttention.<kind> cycling through batches with disjoint slots (cold state)."""
    from gdn_jax import GDNAttention, GDNCache, GDNConfig, GDNParams, build_batch

    cfg = GDNConfig(num_k_heads=H, num_v_heads=HV, head_k_dim=K, head_v_dim=V, conv_width=W, num_spec=num_spec,
                    state_dtype=state_dtype, act_dtype=jnp.bfloat16)
    attn = GDNAttention(cfg, impl="native")
    params = GDNParams.random(cfg, jax.random.key(0))
    cache = GDNCache.create(cfg, num_slots=N)
    batches = [build_batch(r, num_slots=N, num_spec=num_spec, token_bucket=T, row_bucket=S).metadata
               for r in requests_sets]
    rng = np.random.default_rng(0)
    x = rnd(rng, (T, cfg.D), jnp.bfloat16)
    a, b = rnd(rng, (T, HV), jnp.bfloat16), rnd(rng, (T, HV), jnp.bfloat16)
    fn = getattr(attn, f"{kind}_with_status")
    state = {"cache": cache, "i": 0}

    def call():
        out, state["cache"], st = fn(x, b, a, params, state["cache"], batches[state["i"] % len(batches)])
        state["i"] += 1
        return out, st

    for _ in range(2):
        jax.block_until_ready(call())
    times = []
    t_end = time.perf_counter() + target
    while len(times) < 5 or (time.perf_counter() < t_end and len(times) < 200):
        t0 = time.perf_counter()
        jax.block_until_ready(call())
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def layer_cases(quick):
    from gdn_jax import Request

    f32, bf16 = jnp.float32, jnp.bfloat16
    slot_b = lambda sd: HV * K * V * jnp.dtype(sd).itemsize  # noqa: E731
    out = []
    for B in ((8,) if quick else (1, 8, 32)):
        for sd, sname in ((f32, "fp32"),) if quick else ((f32, "fp32"), (bf16, "bf16")):
            N = pool_slots(slot_b(sd), B, True) + B
            sets = [[Request.decode(s * B + i) for i in range(B)] for s in range(N // B)]
            out.append(dict(case=f"decode_b{B}", state=sname, tokens=B, state_bytes=2 * B * slot_b(sd),
                            ours=lambda sets=sets, B=B, N=N, sd=sd, t=None: layer_step("decode", sd, sets, B, B, 0, N, t),
                            base=("decode", (B,), sname)))
    if not quick:
        for sd, sname in ((f32, "fp32"), (bf16, "bf16")):
            Sr, Q = 8, 4
            N = pool_slots(slot_b(sd), Sr * Q, True) + Sr * Q
            accs = [1, 2, 3, 4]
            sets = [[Request.spec(tuple(range((s * Sr + i) * Q, (s * Sr + i + 1) * Q)), Q, num_accepted=accs[i % 4])
                     for i in range(Sr)] for s in range(N // (Sr * Q))]
            out.append(dict(case="spec_8x4", state=sname, tokens=Sr * Q, state_bytes=Sr * (1 + Q) * slot_b(sd),
                            ours=lambda sets=sets, N=N, sd=sd, t=None: layer_step("spec_decode", sd, sets, 32, 8, 3, N, t),
                            base=("spec", (Sr, Q), sname)))
    for lens in (([512],) if quick else ([512], [2048], [8192], [512] * 4)):
        T = sum(lens)
        name = f"prefill_{lens[0]}" if len(lens) == 1 else f"prefill_{len(lens)}x{lens[0]}"
        sets = [[Request.prefill(i, n) for i, n in enumerate(lens)]]
        out.append(dict(case=name, state="fp32", tokens=T,
                        flops=HV * sum((n + 63) // 64 for n in lens) * 8.2e6 * (K * V) / (128 * 128),
                        ours=lambda sets=sets, T=T, S=len(lens), t=None: layer_step("prefill", f32, sets, T, S, 0,
                                                                                   S + 2, t),
                        base=("prefill", (lens,), "fp32")))
    return out


def run_layer(quick, target, bw, peak):
    bl = load_baseline()
    if bl is None:
        print(f"(no jnp baseline at {os.path.abspath(BASELINE)}: layer rows without it)")
    c = bl.Cfg() if bl else None
    rows = []
    for case in layer_cases(quick):
        ours = case["ours"](t=target)
        row = dict(case=case["case"], state=case["state"], ours_ms=ours, tokens_per_s=case["tokens"] / ours * 1e3)
        if "state_bytes" in case:
            row["state_gbs"] = case["state_bytes"] / ours / 1e6
            row["frac_copy_bw"] = row["state_gbs"] / bw
        if "flops" in case:
            row["gflops"] = case["flops"] / ours / 1e6
            row["frac_fma_peak"] = row["gflops"] / peak
        if bl is not None:
            kind, args, sname = case["base"]
            if kind == "decode":
                r = bl.time_decode(c, args[0], sname, BASELINE_VARIANT["decode"], target)
            elif kind == "spec":
                r = bl.time_spec(c, args[0], args[1], sname, BASELINE_VARIANT["spec"], target)
            else:
                v = BASELINE_VARIANT["prefill_seq" if len(args[0]) > 1 else "prefill"]
                r = bl.time_prefill(c, args[0], sname, v, target)
            row["jnp_baseline_ms"] = r["median_ms"]
            row["speedup_vs_jnp_baseline"] = r["median_ms"] / ours
        rows.append(row)
        extra = f"  jnp {row['jnp_baseline_ms']:9.3f} ms  x{row['speedup_vs_jnp_baseline']:.2f}" if bl else ""
        print(f"[layer] {row['case']:14s} {row['state']:5s} gdn_jax {ours:9.3f} ms{extra}", flush=True)
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="a few small cases (smoke test)")
    ap.add_argument("--impls", default="native,reference")
    ap.add_argument("--sections", default="roofline,ops,layer")
    ap.add_argument("--target-s", type=float, default=1.0, help="seconds of timed calls per case")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "out", "results.json"))
    args = ap.parse_args()
    impls = args.impls.split(",")
    target = 0.2 if args.quick else args.target_s
    env = dict(machine=platform.machine(), processor=platform.processor(), cpus=os.cpu_count(),
               isa=gdn_jax.selected_isa(), cpu_features=gdn_jax.cpu_features(), jax=jax.__version__)
    print(f"# gdn_jax benchmarks  isa={env['isa']}  cpus={env['cpus']}  jax={env['jax']}", flush=True)
    sections = args.sections.split(",")
    bw = copy_bandwidth_gbs() if "roofline" in sections or "layer" in sections else float("nan")
    peak = fma_peak_gflops(os.cpu_count() or 1)
    env.update(copy_bandwidth_gbs=bw, fma_peak_gflops=peak)
    print(f"# roofline: copy bandwidth {bw:.1f} GB/s (read+write, 2 threads), f32 FMA peak {peak:.1f} GFLOP/s "
          f"({env['isa']}, {os.cpu_count()} threads)", flush=True)
    rows = []
    all_cases = cases(args.quick) if "ops" in sections else []
    for n, (op, label, make) in enumerate(all_cases, 1):
        row = dict(op=op, case=label)
        for impl in impls:
            if op == "decode_pool" and impl != "native":
                continue
            rng = np.random.default_rng(0)
            fn, fargs, didx, tokens, work = make(rng, impl)
            med, p10, p90 = timeit(fn, fargs, donate_idx=didx, target_s=target)
            row[impl] = dict(median_ms=med, p10_ms=p10, p90_ms=p90, tokens_per_s=tokens / med * 1e3)
            row["work"] = work
            del fn, fargs
        if "native" in row and "reference" in row:
            row["speedup_vs_reference"] = row["reference"]["median_ms"] / row["native"]["median_ms"]
        rows.append(row)
        cols = "  ".join(f"{i} {row[i]['median_ms']:9.3f} ms" for i in impls if i in row)
        sp = f"  x{row['speedup_vs_reference']:.1f}" if "speedup_vs_reference" in row else ""
        print(f"[{n}/{len(all_cases)}] {op:12s} {label:12s} {cols}{sp}", flush=True)
    layer = run_layer(args.quick, target, bw, peak) if "layer" in sections else []
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(dict(env=env, rows=rows, layer=layer), f, indent=1)
    print("\n| op | case | " + " | ".join(f"{i} median ms" for i in impls) + " | native tok/s | native vs reference |")
    print("|---|---|" + "---:|" * (len(impls) + 2))
    for r in rows:
        cells = " | ".join(f"{r[i]['median_ms']:.3f}" if i in r else "-" for i in impls)
        tok = f"{r['native']['tokens_per_s']:.0f}" if "native" in r else ""
        sp = f"{r['speedup_vs_reference']:.1f}x" if "speedup_vs_reference" in r else ""
        print(f"| {r['op']} | {r['case']} | {cells} | {tok} | {sp} |")
    if layer:
        print("\n| layer case | state | gdn_jax ms | tok/s | jnp baseline ms | vs jnp | state GB/s (% copy bw) | GFLOP/s (% FMA peak) |")
        print("|---|---|---:|---:|---:|---:|---:|---:|")
        for r in layer:
            base = f"{r['jnp_baseline_ms']:.3f} | {r['speedup_vs_jnp_baseline']:.2f}x" if "jnp_baseline_ms" in r else "- | -"
            gbs = f"{r['state_gbs']:.1f} ({100 * r['frac_copy_bw']:.0f}%)" if "state_gbs" in r else ""
            gf = f"{r['gflops']:.1f} ({100 * r['frac_fma_peak']:.0f}%)" if "gflops" in r else ""
            print(f"| {r['case']} | {r['state']} | {r['ours_ms']:.3f} | {r['tokens_per_s']:.0f} | {base} | {gbs} | {gf} |")


if __name__ == "__main__":
    main()
