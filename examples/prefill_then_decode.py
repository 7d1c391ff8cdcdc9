"""Prefill two prompts, then decode them token by token, through gdn_jax's serving steps.

Checks that prefill(n) followed by decodes gives what one prefill of the whole sequence
gives (outputs and final state), and prints the differences.

    PYTHONPATH=. python examples/prefill_then_decode.py [--impl native|reference|auto]
"""
import argparse
import sys

import jax
import jax.numpy as jnp
import numpy as np

from gdn_jax.batch import BatchBuilder, Request
from gdn_jax.config import GDNCache, GDNConfig, GDNParams
from gdn_jax.paths import GDNAttention


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--impl", default="auto")
    ap.add_argument("--decode-steps", type=int, default=6)
    args = ap.parse_args(argv)
    if args.decode_steps < 0:
        ap.error(f"--decode-steps must be >= 0, got {args.decode_steps}")

    # One layer, Qwen3-Next's structure at a small size; f32 activations for a tight check.
    cfg = GDNConfig(num_k_heads=2, num_v_heads=4, head_k_dim=32, head_v_dim=32, act_dtype=jnp.float32)
    params = GDNParams.random(cfg, jax.random.PRNGKey(0))
    attn = GDNAttention(cfg, impl=args.impl)
    rng = np.random.default_rng(0)
    prompts = {3: 20, 5: 33}                   # slot -> prompt length
    total = {s: n + args.decode_steps for s, n in prompts.items()}
    # Buckets: the decode steps, the prompts' prefill, and the whole sequences' prefill (64-token steps).
    whole = -(-sum(total.values()) // 64) * 64
    builder = BatchBuilder(num_slots=8, num_spec=cfg.num_spec, token_bucket=sorted({16, 64, whole}), row_bucket=4)
    seqs = {s: [rng.standard_normal((n, d)).astype(np.float32) for d in (cfg.D, cfg.HV, cfg.HV)]
            for s, n in total.items()}         # per slot: mixed_qkv, b, a of every token

    def run(step_fn, cache, reqs, inputs):
        hb = builder.build(reqs)
        x, b, a = (jnp.asarray(hb.pack([inp[j] for inp in inputs])) for j in range(3))
        out, cache = step_fn(x, b, a, params, cache, hb)     # the cache is donated and updated in place
        return hb.unpack(out), cache

    # 1) prefill both prompts in one step, then decode both, one token per step
    cache = GDNCache.create(cfg, num_slots=8)
    reqs = [Request.prefill(s, n) for s, n in prompts.items()]
    outs, cache = run(attn.prefill, cache, reqs, [[v[:n] for v in seqs[s]] for s, n in prompts.items()])
    got = {s: [o] for s, o in zip(prompts, outs)}
    for t in range(args.decode_steps):
        reqs = [Request.decode(s) for s in prompts]
        inputs = [[v[n + t:n + t + 1] for v in seqs[s]] for s, n in prompts.items()]
        outs, cache = run(attn.decode, cache, reqs, inputs)
        for s, o in zip(prompts, outs):
            got[s].append(o)

    # 2) one prefill of each whole sequence
    ref_cache = GDNCache.create(cfg, num_slots=8)
    reqs = [Request.prefill(s, n) for s, n in total.items()]
    ref, ref_cache = run(attn.prefill, ref_cache, reqs, [seqs[s] for s in total])

    worst = 0.0
    for (s, n), r in zip(total.items(), ref):
        o = np.concatenate(got[s])
        err = float(np.sqrt(np.mean((o - r) ** 2)) / np.sqrt(np.mean(r ** 2)))
        st = np.asarray(cache.ssm_state[s]), np.asarray(ref_cache.ssm_state[s])
        st_err = float(np.sqrt(np.mean((st[0] - st[1]) ** 2)) / np.sqrt(np.mean(st[1] ** 2)))
        print(f"slot {s}: {prompts[s]} prompt + {args.decode_steps} decoded tokens vs one prefill of {n}: "
              f"output rel RMSE {err:.1e}, final state rel RMSE {st_err:.1e}")
        worst = max(worst, err, st_err) if np.isfinite(err + st_err) else np.inf
    ok = worst <= 1e-5     # the contract's f32 budget
    print("OK" if ok else "MISMATCH")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
