"""Serving steps against the sum of their kernels, measured in one run (issue 20, item 2).

At Qwen3-Next-80B per-layer shapes (H=16, HV=32, K=V=128, D=8192, W=4, bf16 activations):
decode B=1 and B=8, spec 8 rows x 4 tokens (f32 and bf16 state), prefill T=2048 and 8192 (f32
state), and the mixed step over a 2048-token bucket (a 2040-token prefill and 8 decode rows). Per case, in turns (one call of each, over and over, so that all see the same machine):

* step:     GDNAttention.<kind>_with_status (the native step: one call that checks the batch first);
* composed: the same step as the op composition it replaced (paths._run_ops: the kernels one by
            one, masked indices, outputs summed; native ops);
* kernels:  each kernel of the step as its own jitted op call on the same shapes (conv update +
            recurrence; conv update + spec recurrence; conv + gating + chunk), and their sum;
* empty:    an empty jitted call (a donated [1] array returned): the fixed cost of one dispatch.

Cold state: the decode and spec pools are 4x the LLC within a memory cap (`roofline.COLD_BYTES`) and
every call takes the next disjoint slot set. Prints medians (ms) and the ratios step / kernels and
step / (kernels + empty); with --repeats R, the median over R runs of each median (and of each 10th
percentile: on a shared host the low percentile is the steadier estimate of a call's own cost), the
ratios paired per round (a round's calls run within milliseconds of each other, so a slowly drifting
load cancels), and the same for the process CPU time of each call (all threads; not inflated by waiting for a core).

    PYTHONPATH=. python benchmarks/step_overhead.py [--cases decode_b1,prefill_2048] [--repeats 3]
"""
from __future__ import annotations

import argparse
import json
import re
import time

import jax
import jax.numpy as jnp
import numpy as np

from gdn_jax import GDNAttention, GDNCache, GDNConfig, GDNParams, Request, build_batch, ops, paths, zeros_pool
from gdn_jax.batch import batch_status

import roofline

H, HV, K, V, W = 16, 32, 128, 128, 4
D = 2 * H * K + HV * V


def _cfg(num_spec, state_dtype):
    return GDNConfig(num_k_heads=H, num_v_heads=HV, head_k_dim=K, head_v_dim=V, conv_width=W, num_spec=num_spec,
                     state_dtype=state_dtype, act_dtype=jnp.bfloat16)


def _rnd(rng, shape, dtype=jnp.bfloat16):
    return jnp.asarray(rng.standard_normal(shape, dtype=np.float32), dtype)


class Cycle:
    """A no-argument call of fn(*fixed, cache, batch) threading the donated cache and cycling batches."""

    def __init__(self, fn, fixed, cache, batches, cache_pos):
        self.fn, self.fixed, self.cache, self.batches, self.pos, self.i = fn, fixed, cache, batches, cache_pos, 0

    def __call__(self):
        args = list(self.fixed)
        args.insert(self.pos, self.cache)
        args.append(self.batches[self.i % len(self.batches)])
        out = self.fn(*args)
        self.cache = out[1]
        self.i += 1
        jax.block_until_ready(out)


def composed(cfg, kind):
    """The step as the op composition of before (native ops, masked, summed)."""

    def step(x, b, a, params, cache, batch):
        st = batch_status(batch, num_tokens=x.shape[0], num_slots=cache.num_slots, kinds=paths.STEP_KINDS[kind],
                          impl="native")
        out, cache, op_st = paths._run_ops(cfg, "native", kind, x, b, a, params, cache,
                                           paths._neutralise(batch, st[0] == 0))
        return out, cache, jnp.where(st[0] != 0, st, op_st)

    return jax.jit(step, donate_argnames="cache")


def case(name, rng, with_composed=True):
    """(calls: dict name -> no-arg call, kernels: names summed as 'its kernels'). Names: decode_b<B>_f32|bf16,
    spec_8x4_f32|bf16, prefill_<T> or prefill_<S>x<T> (S sequences of T tokens), mixed_<T>. with_composed=False
    leaves out the op composition (a second cache)."""
    if name.startswith("decode") or name.startswith("spec"):
        sd = jnp.bfloat16 if name.endswith("bf16") else jnp.float32
        if name.startswith("decode"):
            B = int(name.split("_")[1][1:])
            rows, q, kind, num_spec = B, 1, "decode", 0
        else:
            rows, q, kind, num_spec = 8, 4, "spec_decode", 3
        cfg = _cfg(num_spec, sd)
        T = rows * q
        slot_bytes = HV * K * V * jnp.dtype(sd).itemsize
        per_set = rows * (cfg.spec_cols if num_spec else 1)
        N = max(per_set * 2, int(np.ceil(roofline.COLD_BYTES / slot_bytes / per_set)) * per_set)
        sets = []
        for s in range(N // per_set):
            base = s * per_set
            if num_spec:
                reqs = [Request.spec(tuple(range(base + i * cfg.spec_cols, base + (i + 1) * cfg.spec_cols)), q,
                                     num_accepted=1 + i % 4) for i in range(rows)]
            else:
                reqs = [Request.decode(base + i) for i in range(rows)]
            sets.append(build_batch(reqs, num_slots=N, num_spec=num_spec, token_bucket=T, row_bucket=rows))
        metas = [hb.metadata.to_device() for hb in sets]
        x, b, a = _rnd(rng, (T, D)), _rnd(rng, (T, HV)), _rnd(rng, (T, HV))
        params = GDNParams.random(cfg, jax.random.key(0))
        attn = GDNAttention(cfg, impl="native")
        calls = {"step": Cycle(getattr(attn, f"{kind}_with_status"), (x, b, a, params), GDNCache.create(cfg, N),
                               metas, 4)}
        if with_composed:
            calls["composed"] = Cycle(composed(cfg, kind), (x, b, a, params), GDNCache.create(cfg, N), metas, 4)
        # The kernels as ops on the same shapes, their own pools, the same slot sets.
        conv_pool = zeros_pool(cfg.conv_state_shape(N), jnp.bfloat16)
        ssm_pool = zeros_pool(cfg.ssm_state_shape(N), sd)
        col0 = [m.state_indices[:, 0] for m in metas]
        qsl = metas[0].query_start_loc
        acc = metas[0].num_accepted_tokens
        conv = jax.jit(lambda x, pool, idx: ops.causal_conv1d_update(
            x, weight=params.conv_weight, bias=None, conv_state=pool, state_indices=idx, num_accepted_tokens=acc,
            query_start_loc=qsl), donate_argnums=1)
        qh, kh, vh = _rnd(rng, (T, H, K)), _rnd(rng, (T, H, K)), _rnd(rng, (T, HV, V))
        rec = jax.jit(lambda pool, idx: ops.fused_sigmoid_gating_delta_rule_update_spec(
            qh, kh, vh, a=a, b=b, A_log=params.A_log, dt_bias=params.dt_bias, ssm_state=pool, query_start_loc=qsl,
            spec_state_indices=idx, num_accepted_tokens=acc), donate_argnums=0)
        calls["conv_update"] = Cycle(conv, (x,), conv_pool, col0, 1)
        calls["recurrence"] = Cycle(rec, (), ssm_pool, [m.state_indices for m in metas], 0)
        kernels = ("conv_update", "recurrence")
    elif name.startswith("mixed"):
        return mixed_case(name, rng, with_composed)
    else:
        shape = name.split("_")[1]
        S, n = (int(v) for v in shape.split("x")) if "x" in shape else (1, int(shape))
        T = S * n
        cfg = _cfg(0, jnp.float32)
        N = S + 2
        hb = build_batch([Request.prefill(1 + i, n) for i in range(S)], num_slots=N, num_spec=0, token_bucket=T,
                         row_bucket=S)
        meta = hb.metadata.to_device()
        x, b, a = _rnd(rng, (T, D)), _rnd(rng, (T, HV)), _rnd(rng, (T, HV))
        params = GDNParams.random(cfg, jax.random.key(0))
        attn = GDNAttention(cfg, impl="native")
        calls = {"step": Cycle(attn.prefill_with_status, (x, b, a, params), GDNCache.create(cfg, N), [meta], 4)}
        if with_composed:
            calls["composed"] = Cycle(composed(cfg, "prefill"), (x, b, a, params), GDNCache.create(cfg, N), [meta], 4)
        qsl, idx, hs = meta.query_start_loc, meta.state_indices[:, 0], meta.has_initial_state
        conv = jax.jit(lambda x, pool: ops.causal_conv1d_fwd(
            x, weight=params.conv_weight, bias=None, conv_state=pool, query_start_loc=qsl, state_indices=idx,
            has_initial_state=hs), donate_argnums=1)
        gate = jax.jit(lambda a, b: ops.fused_gdn_gating(a, b, A_log=params.A_log, dt_bias=params.dt_bias))
        qh, kh, vh = _rnd(rng, (T, H, K)), _rnd(rng, (T, H, K)), _rnd(rng, (T, HV, V))
        g, beta = gate(a, b)
        chunk = jax.jit(lambda pool: ops.chunk_gated_delta_rule(
            qh, kh, vh, g=g, beta=beta, ssm_state=pool, query_start_loc=qsl, state_indices=idx,
            has_initial_state=hs), donate_argnums=0)
        calls["conv_fwd"] = Cycle(lambda x, pool, _: conv(x, pool), (x,),
                                  zeros_pool(cfg.conv_state_shape(N), jnp.bfloat16), [None], 1)
        calls["gating"] = lambda: jax.block_until_ready(gate(a, b))
        calls["chunk"] = Cycle(lambda pool, _: chunk(pool), (), zeros_pool(cfg.ssm_state_shape(N), jnp.float32),
                               [None], 0)
        kernels = ("conv_fwd", "gating", "chunk")
    return _with_empty(calls), kernels


def mixed_case(name, rng, with_composed=True):
    """gdn_attention_core over a T-token bucket: one prefill row of T - 8 tokens and 8 decode rows
    (f32 state): the step kind whose composition summed two masked outputs of T x D and T x HV x V.
    Its kernels: conv_fwd + conv_update + gating + chunk + recurrence on the rows they own."""
    T = int(name.split("_")[1])
    cfg = _cfg(0, jnp.float32)
    N = 12
    hb = build_batch([Request.prefill(0, T - 8)] + [Request.decode(1 + i) for i in range(8)], num_slots=N,
                     num_spec=0, token_bucket=T, row_bucket=9)
    meta = hb.metadata.to_device()
    x, b, a = _rnd(rng, (T, D)), _rnd(rng, (T, HV)), _rnd(rng, (T, HV))
    params = GDNParams.random(cfg, jax.random.key(0))
    attn = GDNAttention(cfg, impl="native")
    calls = {"step": Cycle(attn.gdn_attention_core_with_status, (x, b, a, params), GDNCache.create(cfg, N), [meta], 4)}
    if with_composed:
        calls["composed"] = Cycle(composed(cfg, "gdn_attention_core"), (x, b, a, params), GDNCache.create(cfg, N),
                                  [meta], 4)
    # Prefill kernels on the prefill tokens, decode kernels on the 8 decode tokens (rows in vLLM's
    # order: decode rows first).
    dec, pre = slice(0, 8), slice(8, T)
    qsl_p = jnp.asarray([0, T - 8], jnp.int32)
    one = jnp.asarray([0], jnp.int32)
    hs = jnp.asarray([False])
    conv = jax.jit(lambda x, pool: ops.causal_conv1d_fwd(
        x, weight=params.conv_weight, bias=None, conv_state=pool, query_start_loc=qsl_p, state_indices=one,
        has_initial_state=hs), donate_argnums=1)
    upd = jax.jit(lambda x, pool: ops.causal_conv1d_update(
        x, weight=params.conv_weight, bias=None, conv_state=pool, state_indices=jnp.arange(1, 9, dtype=jnp.int32)),
        donate_argnums=1)
    gate = jax.jit(lambda a, b: ops.fused_gdn_gating(a, b, A_log=params.A_log, dt_bias=params.dt_bias))
    qh, kh, vh = _rnd(rng, (T - 8, H, K)), _rnd(rng, (T - 8, H, K)), _rnd(rng, (T - 8, HV, V))
    g, beta = gate(a[pre], b[pre])
    chunk = jax.jit(lambda pool: ops.chunk_gated_delta_rule(
        qh, kh, vh, g=g, beta=beta, ssm_state=pool, query_start_loc=qsl_p, state_indices=one,
        has_initial_state=hs), donate_argnums=0)
    qd, kd, vd = _rnd(rng, (8, H, K)), _rnd(rng, (8, H, K)), _rnd(rng, (8, HV, V))
    rec = jax.jit(lambda pool: ops.fused_sigmoid_gating_delta_rule_update(
        qd, kd, vd, a=a[dec], b=b[dec], A_log=params.A_log, dt_bias=params.dt_bias, ssm_state=pool,
        state_indices=jnp.arange(1, 9, dtype=jnp.int32)), donate_argnums=0)
    xp, xd, ap, bp = x[pre], x[dec], a[pre], b[pre]
    calls["conv_fwd"] = Cycle(lambda x, pool, _: conv(x, pool), (xp,),
                              zeros_pool(cfg.conv_state_shape(N), jnp.bfloat16), [None], 1)
    calls["conv_update"] = Cycle(lambda x, pool, _: upd(x, pool), (xd,),
                                 zeros_pool(cfg.conv_state_shape(N), jnp.bfloat16), [None], 1)
    calls["gating"] = lambda: jax.block_until_ready(gate(ap, bp))
    calls["chunk"] = Cycle(lambda pool, _: chunk(pool), (), zeros_pool(cfg.ssm_state_shape(N), jnp.float32), [None], 0)
    calls["recurrence"] = Cycle(lambda pool, _: rec(pool), (), zeros_pool(cfg.ssm_state_shape(N), jnp.float32), [None],
                                0)
    return _with_empty(calls), ("conv_fwd", "conv_update", "gating", "chunk", "recurrence")


def _with_empty(calls):
    empty = jax.jit(lambda z: z, donate_argnums=0)
    box = [jnp.zeros((1,), jnp.int32)]

    def empty_call():
        box[0] = empty(box[0])
        jax.block_until_ready(box[0])

    calls["empty"] = empty_call
    return calls


def measure(calls, target_s, min_iters=7, max_iters=3000):
    """Median ms of each call, the calls taken in turns (order rotated every round)."""
    for c in calls.values():
        for _ in range(2):
            c()
    names = list(calls)
    times = {n: [] for n in names}
    cpu = {n: [] for n in names}
    t_end = time.perf_counter() + target_s
    r = 0
    while r < min_iters or (time.perf_counter() < t_end and r < max_iters):
        for n in names[r % len(names):] + names[:r % len(names)]:
            c0, t0 = time.process_time(), time.perf_counter()
            calls[n]()
            times[n].append((time.perf_counter() - t0) * 1e3)
            cpu[n].append((time.process_time() - c0) * 1e3)
        r += 1
    return ({n: float(np.median(v)) for n, v in times.items()},
            {n: float(np.percentile(v, 10)) for n, v in times.items()}, {n: np.asarray(v) for n, v in times.items()},
            {n: np.asarray(v) for n, v in cpu.items()})


def paired(times, num, den):
    """Median over rounds of num's time / the sum of den's times in the same round: the load a
    shared host adds drifts slowly, and a round's calls run within milliseconds of each other."""
    return float(np.median(times[num] / sum(times[d] for d in den)))


def paired_step_kernels(name, target_s, rng=None, min_iters=7):
    """The step / its kernels ratio of one case, timed in turns (benchmarks/run.py's layer section):
    median over rounds of step / (sum of its kernels) and of step / (kernels + an empty jitted call),
    with the medians (ms) of each call. The paired ratio is the one a shared host does not move: a
    step and its kernels timed minutes apart (ops and layer sections) differ by the host's drift."""
    calls, kernels = case(name, np.random.default_rng(0) if rng is None else rng, with_composed=False)
    med, _, times, _ = measure(calls, target_s, min_iters=min_iters)
    out = dict(case=name, kernels=list(kernels), rounds=int(len(times["step"])), step_ms=med["step"],
               kernel_ms={k: med[k] for k in kernels}, empty_ms=med["empty"],
               step_over_kernels=paired(times, "step", kernels),
               step_over_kernels_plus_empty=paired(times, "step", kernels + ("empty",)))
    return out


CASE_NAME = re.compile(r"decode_b\d+_(f32|bf16)|spec_8x4_(f32|bf16)|prefill_\d+(x\d+)?|mixed_\d+")  # case()'s names
CASES = ["decode_b1_f32", "decode_b8_f32", "decode_b8_bf16", "spec_8x4_f32", "spec_8x4_bf16", "prefill_2048",
         "prefill_8192", "mixed_2048"]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--target", type=float, default=3.0, help="seconds per case and repeat")
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args(argv)
    bad = [n for n in args.cases.split(",") if not CASE_NAME.fullmatch(n)]
    if bad:  # before any case runs: a late IndexError lost the cases timed before it
        ap.error(f"--cases: unknown {bad}; names: decode_b<B>_f32|bf16, spec_8x4_f32|bf16, prefill_<T>, "
                 f"prefill_<S>x<T>, mixed_<T>")
    rng = np.random.default_rng(0)
    results = {}
    print(f"jax {jax.__version__}, ISA {__import__('gdn_jax').selected_isa()}, "
          f"{jax.devices()[0].device_kind}; medians in ms", flush=True)
    for name in args.cases.split(","):
        calls, kernels = case(name, rng)
        target = args.target * (4 if name.startswith(("prefill", "mixed")) else 1)
        both = [measure(calls, target) for _ in range(args.repeats)]
        runs = [m[0] for m in both]
        p10 = {n: float(np.median([m[1][n] for m in both])) for n in calls}
        pairs = (("step", kernels), ("composed", kernels), ("step", ("composed",)),
                 ("step", kernels + ("empty",)))
        pr = {f"{a}/{'+'.join(b)}": float(np.median([paired(m[2], a, b) for m in both])) for a, b in pairs}
        pr_cpu = {f"{a}/{'+'.join(b)}": float(np.median([paired(m[3], a, b) for m in both])) for a, b in pairs}
        cpu_med = {n: float(np.median([np.median(m[3][n]) for m in both])) for n in calls}
        ratio_p10 = p10["step"] / sum(p10[k] for k in kernels)
        med = {n: float(np.median([r[n] for r in runs])) for n in calls}
        ksum = float(np.median([sum(r[k] for k in kernels) for r in runs]))
        ratio = float(np.median([r["step"] / sum(r[k] for k in kernels) for r in runs]))
        ratio_e = float(np.median([r["step"] / (sum(r[k] for k in kernels) + r["empty"]) for r in runs]))
        ratio_c = float(np.median([r["composed"] / sum(r[k] for k in kernels) for r in runs]))
        results[name] = dict(medians=med, kernels=list(kernels), kernel_sum=ksum, step_over_kernels=ratio,
                             step_over_kernels_plus_empty=ratio_e, composed_over_kernels=ratio_c,
                             p10=p10, step_over_kernels_p10=ratio_p10, paired=pr, paired_cpu=pr_cpu,
                             cpu_medians=cpu_med, runs=runs)
        parts = " + ".join(f"{k} {med[k]:.3f}" for k in kernels)
        print(f"{name:15s} step {med['step']:8.3f}  composed {med['composed']:8.3f}  kernels {ksum:8.3f} ({parts})  "
              f"empty {med['empty']:.3f}  step/kernels {ratio:.3f}  step/(kernels+empty) {ratio_e:.3f}  "
              f"composed/kernels {ratio_c:.3f}  | p10: step {p10['step']:.3f} composed {p10['composed']:.3f} "
              f"kernels {sum(p10[k] for k in kernels):.3f} step/kernels {ratio_p10:.3f}", flush=True)
        print("    paired ratios (median over rounds): " + "  ".join(f"{k} {v:.3f}" for k, v in pr.items()), flush=True)
        print("    CPU time (ms): " + "  ".join(f"{k} {v:.3f}" for k, v in cpu_med.items()), flush=True)
        print("    paired CPU-time ratios: " + "  ".join(f"{k} {v:.3f}" for k, v in pr_cpu.items()), flush=True)
        del calls
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
