"""Where the time of a whole GDN layer step goes: projections, core, gated norm.

For Qwen3-Next-80B and Qwen3.5-27B layer shapes with bf16 weights and activations (f32 SSM
state), times the jitted layer step (GatedDeltaNetLayer, native kernels, cache donated) and
its parts alone, each jitted: in_proj (the four projections), the attention core
(GDNAttention: conv + gating + recurrence / chunk), the gated RMSNorm and out_proj. The
projections' GFLOP/s are compared with this machine's bf16 peak, measured in the same run by
the native probes: the bf16 dot-product peak where the ISA has one (AVX512-BF16's vdpbf16ps,
which the projections' kernel uses for bf16 x and w), else the f32 FMA peak (without a bf16
dot instruction bf16 operands are widened and use the same FMAs).

    PYTHONPATH=. python benchmarks/layer_breakdown.py            # writes benchmarks/LAYER.md
    PYTHONPATH=. python benchmarks/layer_breakdown.py --quick    # small shapes, a smoke run
    PYTHONPATH=. python benchmarks/layer_breakdown.py --compare-xla --prefill-tokens 64  # + XLA's dot
    PYTHONPATH=. python benchmarks/layer_breakdown.py --weights packed   # one weight layout only

The projections run on the native kernels (the layer's impl): with the weights in Hugging
Face's [out, in] layout (gdn_jax_linear) and packed once (GDNLayerParams.packed,
gdn_jax_linear_packed), each case timed with both unless --weights says otherwise.

The calls cycle over copies of the weights and over disjoint slot sets of the state pool, each
holding at least 4x the last-level cache, so that both come from memory as in a model's forward.
Medians of repeated calls after warm-up; the parts are timed one after another in the same
run, so their sum may differ from the step (the step overlaps nothing, but the parts each pay a
dispatch). glibc's allocator is tuned as a server should run it (`gdn_jax.tune_host_malloc`,
README.md, "Deployment"; `--malloc system` keeps glibc's defaults, under which a prefill step's
large temporaries come back as fresh pages on every call: 15-17% of the step at T = 2048 on a Xeon,
benchmarks/LAYER_NOTES.md, "The allocator").
"""
from __future__ import annotations

import argparse
import itertools
import os
import platform
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # as run.py does
import roofline  # noqa: E402
from host_malloc import add_malloc_arg, apply_malloc  # noqa: E402

import gdn_jax
from gdn_jax import GDNCache, GDNConfig, Request, build_batch
from gdn_jax.layer import (GatedDeltaNetLayer, GDNLayerConfig, GDNLayerParams, gated_rms_norm, in_projection,
                           out_projection)
from gdn_jax.paths import GDNAttention

MODELS = {
    # name: (hidden, H, HV, K, V)
    "Qwen3-Next-80B": (2048, 16, 32, 128, 128),
    "Qwen3.5-27B": (5120, 16, 48, 128, 128),
}
QUICK_MODELS = {"tiny-next": (256, 2, 4, 64, 64)}


def median_ms(fn, *, warmup=2, min_iters=5, target_s=2.0):
    for _ in range(warmup):
        jax.block_until_ready(fn())
    times = []
    t_end = time.perf_counter() + target_s
    while len(times) < min_iters or time.perf_counter() < t_end:
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t0)
        if len(times) >= 200:
            break
    return 1e3 * statistics.median(times)


def case_batch(kind: str, n: int, num_slots: int, first_slot: int = 0):
    if kind == "decode":
        reqs = [Request.decode(first_slot + i) for i in range(n)]
        T = max(8, n)
    else:
        reqs = [Request.prefill(first_slot, n)]
        T = n
    return build_batch(reqs, num_slots=num_slots, token_bucket=T, row_bucket=max(2, len(reqs))), T


def run_case(name, dims, kind, n, peak, log, compare_xla=False, weights="plain", cold_bytes=roofline.COLD_BYTES):
    hidden, H, HV, K, V = dims
    cfg = GDNLayerConfig(hidden_size=hidden, core=GDNConfig(num_k_heads=H, num_v_heads=HV, head_k_dim=K,
                                                            head_v_dim=V, act_dtype=jnp.bfloat16))
    # From memory, as in a model's forward: the calls cycle over weight copies and over disjoint
    # slot sets of a pool, each holding at least cold_bytes.
    w_elems = sum(o * i for o, i in cfg.projection_shapes().values())  # MACs per token, too
    w_bytes = 2 * w_elems
    copies = [GDNLayerParams.random(cfg, jax.random.key(i)) for i in range(max(1, -(-cold_bytes // w_bytes)))]
    plain = copies[0]
    params_set = [p.packed() for p in copies] if weights == "packed" else copies
    rows = n if kind == "decode" else 1
    n_sets = max(1, -(-cold_bytes // (rows * HV * K * V * 4)))
    num_slots = max(16, n_sets * rows)
    batches = [case_batch(kind, n, num_slots, s * rows) for s in range(n_sets)]
    T = batches[0][1]
    metas = [hb.metadata.to_device() for hb, _ in batches]
    turn = {k: itertools.cycle(range(len(params_set))) for k in ("step", "in", "out")}
    meta_turn = itertools.cycle(range(n_sets))
    params = params_set[0]
    rng = np.random.default_rng(0)
    h = jnp.asarray(rng.standard_normal((T, hidden)), jnp.bfloat16)
    layer = GatedDeltaNetLayer(cfg, "native")
    core = GDNAttention(cfg.core, "native")
    step = layer.prefill_with_status if kind == "prefill" else layer.decode_with_status
    core_step = core.prefill_with_status if kind == "prefill" else core.decode_with_status
    box = {"cache": GDNCache.create(cfg.core, num_slots)}

    def layer_call():
        out, box["cache"], st = step(h, params_set[next(turn["step"])], box["cache"], metas[next(meta_turn)])
        return out

    proj = jax.jit(in_projection, static_argnums=(0, 3))
    mixed, z, b, a = proj(cfg, params, h, "native")

    def core_call():
        o, box["cache"], st = core_step(mixed, b, a, params.core, box["cache"], metas[next(meta_turn)])
        return o

    o = core_call()
    norm = jax.jit(gated_rms_norm, static_argnums=(3, 4))
    outp = jax.jit(out_projection, static_argnums=2)
    y = norm(o, z, params.norm_weight, cfg.rms_norm_eps, "native").reshape(T, cfg.Z)
    t = dict(step=median_ms(layer_call), in_proj=median_ms(lambda: proj(cfg, params_set[next(turn["in"])], h, "native")),
             core=median_ms(core_call),
             norm=median_ms(lambda: norm(o, z, params.norm_weight, cfg.rms_norm_eps, "native")),
             out_proj=median_ms(lambda: outp(params_set[next(turn["out"])], y, "native")))
    xla = None
    if compare_xla:  # XLA's dot (impl="reference", [out, in] weights) in the same run; few calls, seconds each
        quick = dict(warmup=1, min_iters=3, target_s=0.0)
        xla = (median_ms(lambda: proj(cfg, plain, h, "reference"), **quick) +
               median_ms(lambda: outp(plain, y, "reference"), **quick))
        log(f"  {name:<15} {kind} {n} {weights}: projections native {t['in_proj'] + t['out_proj']:.2f} ms, XLA dot "
            f"{xla:.2f} ms ({xla / (t['in_proj'] + t['out_proj']):.1f}x)")
    flops = 2.0 * T * w_elems
    proj_ms = t["in_proj"] + t["out_proj"]
    gflops = flops / (proj_ms * 1e-3) / 1e9
    row = dict(model=name, case=f"{kind} {'B' if kind == 'decode' else 'T'}={n}", weights=weights, tokens=T, **t,
               parts=sum(v for k, v in t.items() if k != "step"), proj_gflops=gflops, proj_peak=gflops / peak,
               xla_proj=xla)
    # ms to the µs: a part of a tiny layer takes a few µs on a fast host (0.00 at two decimals)
    log(f"  {row['model']:<15} {row['case']:<14} {weights:<6} step {t['step']:9.3f} ms  in_proj {t['in_proj']:8.3f}"
        f"  core {t['core']:8.3f}  norm {t['norm']:6.3f}  out_proj {t['out_proj']:8.3f}  projections "
        f"{gflops:6.1f} GFLOP/s = {100 * row['proj_peak']:.0f}% of the bf16 peak")
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--prefill-tokens", type=int, default=512)
    ap.add_argument("--compare-xla", action="store_true", help="also time the projections on XLA's dot")
    ap.add_argument("--weights", choices=["both", "plain", "packed"], default="both",
                    help="the projections' weight layout: [out, in] (plain), packed, or each in turn")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "LAYER.md"))
    add_malloc_arg(ap)
    args = ap.parse_args(argv)
    if not gdn_jax.native_available():
        print("the native extension is not built (make build)")
        return 1
    malloc_text = apply_malloc(args.malloc)
    threads = os.cpu_count() or 1
    from gdn_jax import _ffi

    fma = roofline.fma_peak_gflops(threads)
    bf16_peak, bf16_source = roofline.bf16_dot_peak(gdn_jax.selected_isa(), threads, fma)
    peak = bf16_peak or fma
    peak_text = f"f32 FMA peak {fma:.1f} GFLOP/s, bf16 peak {peak:.1f} GFLOP/s ({bf16_source})"
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    print(f"layer breakdown on {cpu}, {threads} threads, ISA {gdn_jax.selected_isa()}, {peak_text}, jax "
          f"{jax.__version__}, {malloc_text}", flush=True)
    models = QUICK_MODELS if args.quick else MODELS
    layouts = ["plain", "packed"] if args.weights == "both" else [args.weights]
    cases = [(name, dims, kind, n, w) for name, dims in models.items()
             for kind, n in [("decode", 1), ("decode", 8), ("prefill", 64 if args.quick else args.prefill_tokens)]
             for w in layouts]
    rows = []
    for i, (name, dims, kind, n, w) in enumerate(cases):
        print(f"[{i + 1}/{len(cases)}] {name} {kind} {n} {w} weights", flush=True)
        rows.append(run_case(name, dims, kind, n, peak, lambda s: print(s, flush=True), args.compare_xla, w,
                             cold_bytes=(1 << 20) if args.quick else roofline.COLD_BYTES))
    if args.quick:
        return 0
    lines = ["# Layer step breakdown (bf16 weights and activations, f32 state)", "",
             f"`PYTHONPATH=. python benchmarks/layer_breakdown.py` on {cpu}, {threads} threads, ISA "
             f"{gdn_jax.selected_isa()}, jax {jax.__version__}; {malloc_text}; {peak_text}; native probes, same run. "
             "Medians in "
             "ms. `parts` is the sum of the four parts timed alone.", "",
             "| model | case | weights | step | in_proj | core | norm | out_proj | parts | projections GFLOP/s | "
             "% of bf16 peak |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    if args.compare_xla:
        lines[-2] += " projections on XLA's dot |"
        lines[-1] += "---|"
    for r in rows:
        lines.append(f"| {r['model']} | {r['case']} | {r['weights']} | {r['step']:.3f} | {r['in_proj']:.3f} | "
                     f"{r['core']:.3f} | {r['norm']:.3f} | {r['out_proj']:.3f} | {r['parts']:.3f} | "
                     f"{r['proj_gflops']:.1f} | {100 * r['proj_peak']:.0f}% |"
                     + (f" {r['xla_proj']:.2f} |" if args.compare_xla else ""))
    with open(args.out, "w") as f:
        f.write("\n".join(lines) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
