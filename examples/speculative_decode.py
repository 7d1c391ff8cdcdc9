"""Speculative decoding with gdn_jax: verify drafts, roll back by index, leave spec mode.

A request owns num_spec + 1 slots (its block-table row). Each verify step feeds the last
accepted token plus drafts; the state after token t goes to slot t, and the next step reads
slot ``num_accepted - 1``: rejecting drafts costs no copy. ``commit_accepted`` moves the
accepted state into slot 0 so the request can continue with plain decode steps.

The outputs of the accepted tokens must equal one prefill over the accepted tokens.

    PYTHONPATH=. python examples/speculative_decode.py [--impl native|reference|auto]
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
    ap.add_argument("--steps", type=int, default=6)
    args = ap.parse_args(argv)
    if args.steps < 1:
        ap.error(f"--steps must be >= 1, got {args.steps}")

    cfg = GDNConfig(num_k_heads=1, num_v_heads=2, head_k_dim=32, head_v_dim=32, num_spec=3,
                    act_dtype=jnp.float32)
    params = GDNParams.random(cfg, jax.random.PRNGKey(0))
    attn = GDNAttention(cfg, impl=args.impl)
    builder = BatchBuilder(num_slots=8, num_spec=cfg.num_spec, token_bucket=32, row_bucket=2)
    cache = GDNCache.create(cfg, num_slots=8)
    slots = (6, 1, 4, 2)                     # the request's block-table row (num_spec + 1 slots)
    rng = np.random.default_rng(0)
    tokens = lambda n: [rng.standard_normal((n, d)).astype(np.float32) for d in (cfg.D, cfg.HV, cfg.HV)]  # noqa

    def run(step_fn, req, inp):
        nonlocal cache
        hb = builder.build([req])
        x, b, a = (jnp.asarray(hb.pack([inp[j]])) for j in range(3))
        out, cache = step_fn(x, b, a, params, cache, hb)
        return hb.unpack(out)[0]

    history, outputs = [], []                # accepted tokens' inputs and their outputs
    prompt = tokens(9)
    outputs.append(run(attn.prefill, Request.prefill(slots[0], 9), prompt))
    history.append(prompt)
    acc = 1
    for step in range(args.steps):
        last = step == args.steps - 1  # accepts a draft, so that commit_accepted below moves a state
        q = int(rng.integers(2 if last else 1, cfg.num_spec + 2))   # 1 verified token + q-1 drafts
        block = tokens(q)
        out = run(attn.spec_decode, Request.spec(slots, q, num_accepted=acc), block)
        acc = int(rng.integers(2 if last else 1, q + 1))     # the target model accepted `acc` tokens
        print(f"verify step {step}: {q} tokens ({q - 1} drafts), accepted {acc}; "
              f"next step resumes from slot {slots[acc - 1]}")
        history.append([v[:acc] for v in block])
        outputs.append(out[:acc])
    cache = attn.commit_accepted(cache, np.array([slots], np.int32), np.array([acc], np.int32))
    print(f"commit_accepted (accepted {acc}): slot {slots[acc - 1]} -> slot {slots[0]}; plain decode from here")
    for _ in range(2):
        tok = tokens(1)
        outputs.append(run(attn.decode, Request.decode(slots[0]), tok))
        history.append(tok)

    # The same accepted tokens, prefilled at once in a fresh cache.
    seq = [np.concatenate([h[j] for h in history]) for j in range(3)]
    n = len(seq[0])
    cache2 = GDNCache.create(cfg, num_slots=8)
    hb = BatchBuilder(num_slots=8, num_spec=cfg.num_spec, token_bucket=-(-n // 64) * 64, row_bucket=1).build(
        [Request.prefill(0, n)])
    ref, cache2 = attn.prefill(*(jnp.asarray(hb.pack([v])) for v in seq), params, cache2, hb)
    ref = np.asarray(ref)[:n]
    got = np.concatenate(outputs)
    err = float(np.sqrt(np.mean((got - ref) ** 2)) / np.sqrt(np.mean(ref ** 2)))
    st, st_ref = np.asarray(cache.ssm_state[slots[0]]), np.asarray(cache2.ssm_state[0])
    st_err = float(np.sqrt(np.mean((st - st_ref) ** 2)) / np.sqrt(np.mean(st_ref ** 2)))
    print(f"{n} accepted tokens vs one prefill: output rel RMSE {err:.1e}, state rel RMSE {st_err:.1e}")
    ok = err <= 1e-5 and st_err <= 1e-5
    print("OK" if ok else "MISMATCH")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
