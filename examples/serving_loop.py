"""Continuous batching over a small Qwen3-Next-shaped model loaded from a checkpoint (`make demo`).

The GDN layers come from a Hugging Face checkpoint directory, read by the same loader a user
points at a downloaded model (gdn_jax.checkpoint). Without ``--checkpoint`` the demo writes a
tiny random Qwen3-Next checkpoint on first run (no network) and loads that. Each GDN layer is
a residual block ``h + GatedDeltaNetLayer(rms_norm(h))`` (in_proj -> conv + gating +
recurrence -> gated RMSNorm -> out_proj); the token embedding and the logits head are the
demo's own (the checkpoint's full-attention layers, MLPs and embeddings are not gdn_jax's).

Requests arrive, are prefilled in chunks, then decode one token per step (plain rows) or
verify drafts (speculative rows, with a toy acceptance rule), and finish; their cache slots
are reused. Every step is ONE jitted call over the whole stack (prefill, decode and spec rows
together, every layer's cache donated), compiled once for the (tokens, rows) bucket.

The native kernels and the pure-jnp reference run in lockstep on the same inputs: the
closing table gives tokens/s for each, and the run fails (exit 1) if they disagree. The native
model's projection weights are packed once after loading (GDNLayerParams.packed, bf16 models),
the reference's stay in Hugging Face's layout, so the check also covers the packing.

    PYTHONPATH=. python examples/serving_loop.py                       # the demo
    PYTHONPATH=. python examples/serving_loop.py --checkpoint DIR      # a model on disk
    PYTHONPATH=. python examples/serving_loop.py --quick               # a few seconds of compute
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import gdn_jax
from gdn_jax import checkpoint as ckpt
from gdn_jax.batch import BatchBuilder, Request
from gdn_jax.config import GDNCache, GDNConfig
from gdn_jax.layer import GatedDeltaNetLayer, GDNLayerConfig, GDNLayerParams
from gdn_jax.paths import check_status

VOCAB = 512
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# --- the checkpoint and the model around the GDN layers --------------------------------------


def write_demo_checkpoint(path: str, quick: bool, seed: int) -> None:
    """A tiny random Qwen3-Next checkpoint: 3 GDN layers and one full-attention layer (bf16)."""
    if quick:
        core = GDNConfig(num_k_heads=1, num_v_heads=2, head_k_dim=32, head_v_dim=32)
        hidden = 64
    else:   # Qwen3-Next's proportions (HV = 2H, K = V), scaled down
        core = GDNConfig(num_k_heads=2, num_v_heads=4, head_k_dim=64, head_v_dim=64)
        hidden = 256
    cfg = GDNLayerConfig(hidden_size=hidden, core=core, model_type="qwen3_next")
    keys = jax.random.split(jax.random.PRNGKey(seed), 3)
    layers = {i: GDNLayerParams.random(cfg, k) for i, k in enumerate(keys)}
    ckpt.save_checkpoint(path, cfg, layers, num_hidden_layers=4)


def _rms(x, eps=1e-6):
    x = x.astype(jnp.float32)
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps)


class Model:
    """Embedding -> GDN blocks (residual) -> logits; one jitted call per step, caches donated."""

    def __init__(self, cfg: GDNLayerConfig, emb, layers: list, impl: str, num_slots: int):
        self.cfg, self.emb, self.layers = cfg, emb, layers
        self.gdn = GatedDeltaNetLayer(cfg, impl)
        self.caches = [GDNCache.create(cfg.core, num_slots) for _ in layers]
        self._step = jax.jit(self._stack, donate_argnames="caches")

    def _stack(self, tokens, layers, caches, batch):
        h = self.emb[tokens]
        new, statuses = [], []
        for lp, cache in zip(layers, caches):
            out, cache, st = self.gdn.apply("mixed", _rms(h).astype(self.cfg.act_dtype), lp, cache, batch)
            h = h + out.astype(jnp.float32)
            new.append(cache)
            statuses.append(st)
        return _rms(h) @ self.emb.T, new, jnp.stack(statuses)

    def step(self, tokens, batch):
        """tokens [T] int32 -> logits [T, VOCAB] f32; every layer's cache updated in place."""
        logits, self.caches, statuses = self._step(tokens, self.layers, self.caches, batch)
        for i, st in enumerate(np.asarray(statuses)):   # a refused batch changed no layer's cache
            check_status(f"layer {i}", st, caches=self.caches[i])
        return logits

    def compiled_count(self) -> int:
        return self._step._cache_size()


# --- the serving loop ------------------------------------------------------------------------


class Live:
    def __init__(self, rid, slots, prompt, max_new, spec):
        self.id, self.slots, self.prompt, self.max_new, self.spec = rid, slots, prompt, max_new, spec
        self.done = 0            # prompt tokens prefilled
        self.generated = []      # accepted output tokens
        self.acc = 1             # num_accepted for the next spec row
        self.next = None         # the next token to feed (after the prompt)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--checkpoint", default=None,
                    help="Hugging Face checkpoint directory (Qwen3-Next / Qwen3.5); default: a tiny random one, "
                         "written on first run under build/")
    ap.add_argument("--layers", type=int, default=None, help="serve only the first N GDN layers")
    ap.add_argument("--num-spec", type=int, default=2, help="draft tokens per speculative step")
    ap.add_argument("--tokens", type=int, default=64, help="token bucket T")
    ap.add_argument("--rows", type=int, default=8, help="row bucket S")
    ap.add_argument("--slots", type=int, default=32, help="cache slots per layer")
    ap.add_argument("--quick", action="store_true", help="tiny shapes and few steps (tests)")
    ap.add_argument("--impls", default="native,reference", help="comma list; the first drives the schedule")
    ap.add_argument("--weights", choices=["packed", "plain"], default="packed",
                    help="the native impl's projection weights: packed once at load (bf16 models; "
                         "GDNLayerParams.packed) or Hugging Face's [out, in] layout")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tol", type=float, default=2e-2, help="max relative RMSE between the impls' logits")
    ap.add_argument("--malloc", choices=["tuned", "system"], default="tuned",
                    help="tuned: gdn_jax.tune_host_malloc() first, as a server would (README.md, Deployment); "
                         "system: glibc's defaults")
    args = ap.parse_args(argv)
    for name, low in (("steps", 1), ("layers", 1), ("num_spec", 0), ("tokens", 3), ("rows", 1), ("slots", 1)):
        v = getattr(args, name)
        if v is not None and v < low:
            ap.error(f"--{name.replace('_', '-')} must be >= {low}, got {v}")
    if args.slots < args.num_spec + 1:
        ap.error(f"--slots must be >= num_spec + 1 = {args.num_spec + 1} (a request takes num_spec + 1 slots), "
                 f"got {args.slots}")
    if not args.tol > 0:
        ap.error(f"--tol must be > 0, got {args.tol}")
    if args.malloc == "tuned":  # before any JAX work: big buffers reused instead of fresh pages each step
        gdn_jax.tune_host_malloc()
    if args.quick:
        args.steps = min(args.steps, 12)
        args.tokens, args.rows, args.slots = 32, 4, 16
    path = args.checkpoint
    if path is None:
        path = os.path.join(ROOT, "build", "demo_checkpoint" + ("_quick" if args.quick else ""))
        if not os.path.exists(os.path.join(path, "config.json")):
            print(f"writing a tiny random Qwen3-Next checkpoint to {path}")
            write_demo_checkpoint(path, args.quick, args.seed)
    cfg = ckpt.load_layer_config(path, num_spec=args.num_spec)
    indices = ckpt.gdn_layer_indices(path)[:args.layers]
    layers = list(ckpt.load_layers(path, cfg, indices, progress=len(indices) > 4).values())
    impls = [s.strip() for s in args.impls.split(",") if s.strip()]
    if "native" in impls and not gdn_jax.native_available():
        print("native extension not built: running the reference only (make build)")
        impls = [i for i in impls if i != "native"] or ["reference"]
    isa = gdn_jax.selected_isa() if "native" in impls else "-"
    pack = args.weights == "packed" and cfg.act_dtype == jnp.bfloat16   # f32 weights are not packed
    print(f"GDN serving loop: {len(layers)} GDN layers {indices} of {path} ({cfg.model_type}, hidden "
          f"{cfg.hidden_size}, H={cfg.H} HV={cfg.HV} K={cfg.K} V={cfg.V}, {cfg.act_dtype.name}), "
          f"num_spec={cfg.core.num_spec}, bucket T={args.tokens} S={args.rows}, {args.slots} slots; impls {impls} "
          f"(native ISA: {isa}, {'packed' if pack else 'plain'} weights)")

    emb = jax.random.normal(jax.random.PRNGKey(args.seed + 1), (VOCAB, cfg.hidden_size), jnp.float32)
    models = {impl: Model(cfg, emb, [p.packed() for p in layers] if pack and impl == "native" else layers, impl,
                          args.slots) for impl in impls}
    builder = BatchBuilder(num_slots=args.slots, num_spec=cfg.core.num_spec, token_bucket=args.tokens,
                           row_bucket=args.rows)
    rng = np.random.default_rng(args.seed)
    C = cfg.core.spec_cols
    free = list(range(args.slots))
    live, next_id, finished = [], 0, 0
    times = {impl: 0.0 for impl in impls}
    compile_s = {impl: 0.0 for impl in impls}
    real_tokens = generated = 0
    worst = 0.0
    kinds = dict(prefill=0, decode=0, spec=0)

    tty = sys.stdout.isatty()
    for step in range(args.steps):
        # arrivals: a request takes num_spec + 1 slots (spec rows index-scatter their states)
        while len(live) < args.rows + 2 and len(free) >= C and rng.random() < 0.5:
            slots = tuple(free.pop(int(rng.integers(len(free)))) for _ in range(C))
            prompt = rng.integers(0, VOCAB, int(rng.integers(4, 2 * args.tokens)))
            live.append(Live(next_id, slots, prompt, int(rng.integers(3, 12)), spec=cfg.core.num_spec > 0 and rng.random() < 0.6))
            next_id += 1
        # schedule this step's rows within the bucket (chunked prefill when the budget runs out)
        reqs, feed, owners, budget = [], [], [], args.tokens
        for r in live:
            if len(reqs) == args.rows or budget == 0:
                break
            if r.done < len(r.prompt):
                n = min(len(r.prompt) - r.done, budget)
                reqs.append(Request.prefill(r.slots[0], n, has_initial_state=r.done > 0, id=r.id))
                feed.append(r.prompt[r.done:r.done + n])
            elif r.spec:
                q = min(1 + int(rng.integers(0, cfg.core.num_spec + 1)), budget)   # 1 + drafts
                drafts = rng.integers(0, VOCAB, q - 1)                        # a toy drafter
                reqs.append(Request.spec(r.slots, q, num_accepted=r.acc, id=r.id))
                feed.append(np.concatenate([[r.next], drafts]))
            else:
                reqs.append(Request.decode(r.slots[0], id=r.id))
                feed.append(np.array([r.next]))
            budget -= reqs[-1].num_tokens
            owners.append(r)
        hb = builder.build(reqs)
        tokens = jnp.asarray(hb.pack(feed, np.int32)) if reqs else jnp.zeros((args.tokens,), jnp.int32)
        meta = hb.metadata.to_device()
        logits = {}
        for impl, model in models.items():
            t0 = time.perf_counter()
            logits[impl] = np.asarray(model.step(tokens, meta))
            dt = time.perf_counter() - t0
            if step == 0:
                compile_s[impl] = dt            # first step: compilation
            else:
                times[impl] += dt
        if step > 0:
            real_tokens += hb.num_tokens
        if len(impls) > 1:
            ref, other = logits[impls[0]][:hb.num_tokens], logits[impls[1]][:hb.num_tokens]
            if hb.num_tokens:
                err = float(np.sqrt(np.mean((ref - other) ** 2)) / max(np.sqrt(np.mean(other ** 2)), 1e-30))
                worst = np.nan if np.isnan(err) or np.isnan(worst) else max(worst, err)
        # advance the requests from the first impl's logits (greedy)
        out = hb.unpack(logits[impls[0]])
        for r, rq, lg, fed in zip(owners, reqs, out, feed):
            kinds[rq.kind] += 1
            pred = lg.argmax(-1)
            if rq.kind == "prefill":
                r.done += rq.num_tokens
                if r.done == len(r.prompt):
                    r.next, r.acc = int(pred[-1]), 1
            elif rq.kind == "spec":
                # toy acceptance: each draft is accepted with probability 0.6 until the first reject
                acc = 1
                while acc < rq.num_tokens and rng.random() < 0.6:
                    acc += 1
                r.generated += [int(t) for t in fed[:acc]]
                r.acc, r.next = acc, int(pred[acc - 1])
            else:
                r.generated.append(r.next)
                r.next = int(pred[-1])
        for r in list(live):
            if len(r.generated) >= r.max_new:
                live.remove(r)
                free.extend(r.slots)
                finished += 1
                generated += len(r.generated)
        line = (f"step {step + 1:3d}/{args.steps}  rows: {sum(q.kind == 'prefill' for q in reqs)} prefill "
                f"{sum(q.kind == 'decode' for q in reqs)} decode {sum(q.kind == 'spec' for q in reqs)} spec  "
                f"tokens {hb.num_tokens:3d}/{args.tokens}  live {len(live):2d}  finished {finished:3d}")
        if tty:
            print("\r" + line, end="", flush=True)
        elif step % 10 == 9 or step == args.steps - 1:
            print(line, flush=True)
    if tty:
        print()

    counts = {impl: m.compiled_count() for impl, m in models.items()}
    print(f"\nrows served: {kinds}; requests finished: {finished}; one executable per impl: {counts}")
    print(f"{'impl':<10} {'compile s':>10} {'steps s':>9} {'tokens':>7} {'tokens/s':>10}")
    for impl in impls:
        tps = real_tokens / times[impl] if times[impl] else float("nan")
        print(f"{impl:<10} {compile_s[impl]:>10.2f} {times[impl]:>9.2f} {real_tokens:>7d} {tps:>10.0f}")
    if len(impls) > 1:
        print(f"speed-up {impls[0]} vs {impls[1]}: {times[impls[1]] / max(times[impls[0]], 1e-9):.1f}x")
        ok = bool(worst <= args.tol)     # False for NaN
        print(f"agreement {impls[0]} vs {impls[1]}: max relative RMSE of the logits {worst:.2e} "
              f"(limit {args.tol:.0e}): {'OK' if ok else 'MISMATCH'}")
        if not ok:
            return 1
    if any(c != 1 for c in counts.values()):
        print("expected one compiled executable per impl")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
