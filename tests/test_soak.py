"""A long soak of the serving loop: requests arrive and leave, chunked prefills, plain and
speculative decode rows, spec -> plain switches through commit_accepted, token and row bucket
changes, and now and then a refused batch. Every ``check_every`` steps the step is checked
against the token-scan oracle (serve_helpers.token_scan_step); after the warm-up the number of
compiled programs, the memory mappings and the resident memory must stay flat.

pytest: a short default run; the 20,000-step runs are ``slow`` (GDN_JAX_SLOW=1 or -m slow).
Command (prints the numbers docs/reliability.md records):

    PYTHONPATH=. python -m tests.test_soak --steps 20000 --impl native
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))   # serve_helpers, when run as a command

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

import gdn_jax  # noqa: E402
from gdn_jax import paths  # noqa: E402
from gdn_jax.batch import PAD_SLOT_ID, BatchBuilder, Request  # noqa: E402
from gdn_jax.config import GDNCache, GDNParams  # noqa: E402
from serve_helpers import (SMALL_CFG, SMALL_N, budget, compile_counter, mapping_count, random_inputs,  # noqa: E402
                           rel_rmse, rss_bytes, to_np64, token_scan_step)

TOKEN_BUCKETS, ROW_BUCKETS = (16, 32), (2, 4)
MAPS_SLACK = 16                  # thread stacks and allocator arenas; a compiled program maps ~45
RSS_SLACK = 64 << 20             # bytes


class _Req:
    def __init__(self, slots, prompt, gen):
        self.slots, self.prompt_left, self.gen_left = slots, prompt, gen
        self.mode, self.acc, self.prefilled = "prefill", 1, False


def _rows(hb):
    """The token-scan oracle's rows of a built batch (from its requests, not its metadata)."""
    return [(rq.kind, lo, hi, tuple(rq.slots), rq.num_accepted if rq.kind == "spec" else 1, rq.has_initial_state)
            for rq, (lo, hi) in zip(hb.requests, hb.token_slices)]


def _same_bits(cache, pre) -> bool:
    return (np.asarray(cache.conv_state).tobytes() == pre[0].tobytes()
            and np.asarray(cache.ssm_state).tobytes() == pre[1].tobytes())


class Soak:
    """The simulated engine. ``run(steps)`` returns the counters and the health numbers."""

    def __init__(self, impl: str, seed: int, *, check_every: int = 50, cfg=SMALL_CFG, n=SMALL_N):
        self.cfg, self.n, self.check_every = cfg, n, check_every
        self.rng = np.random.default_rng(seed)
        self.attn = paths._attention(cfg, impl)
        self.params = GDNParams.random(cfg, jax.random.PRNGKey(seed))
        self.cache = GDNCache.create(cfg, n)
        self.builder = BatchBuilder.for_config(cfg, num_slots=n, token_bucket=TOKEN_BUCKETS, row_bucket=ROW_BUCKETS)
        self.free, self.active = list(range(n)), []
        self.seen = dict(prefill=0, decode=0, spec=0, commit=0, refused=0, finished=0, checked=0,
                         buckets=set())

    def _arrive(self):
        C = self.cfg.spec_cols
        while len(self.active) < 6 and len(self.free) >= C and self.rng.random() < 0.3:
            self.rng.shuffle(self.free)
            slots = tuple(int(self.free.pop()) for _ in range(C))
            self.active.append(_Req(slots, int(self.rng.integers(1, 40)), int(self.rng.integers(1, 24))))

    def _commit_switches(self):
        rows = []
        for r in self.active:
            if r.mode == "spec" and self.rng.random() < 0.08 and len(rows) < max(ROW_BUCKETS):
                rows.append((r.slots, r.acc))
                r.mode, r.acc = "plain", 1
            elif r.mode == "plain" and self.rng.random() < 0.08:
                r.mode, r.acc = "spec", 1
        if rows:
            S, C = max(ROW_BUCKETS), self.cfg.spec_cols
            idx = np.full((S, C), PAD_SLOT_ID, np.int32)
            acc = np.ones((S,), np.int32)
            for i, (slots, a) in enumerate(rows):
                idx[i], acc[i] = slots, a
            self.cache = self.attn.commit_accepted(self.cache, idx, acc)
            self.seen["commit"] += 1

    def _schedule(self):
        reqs, owners, room = [], [], max(TOKEN_BUCKETS)
        for i in self.rng.permutation(len(self.active)):
            r = self.active[i]
            if len(reqs) == max(ROW_BUCKETS) or room == 0 or self.rng.random() < 0.15:
                continue
            if r.mode == "prefill":
                k = int(min(r.prompt_left, self.rng.integers(1, room + 1)))
                rq = Request.prefill(r.slots[0], k, has_initial_state=r.prefilled)
            elif r.mode == "spec":
                q = int(self.rng.integers(1, self.cfg.spec_cols + 1))
                if q > room:
                    continue
                rq = Request.spec(r.slots, q, num_accepted=r.acc)
            else:
                rq = Request.decode(r.slots[0])
            room -= rq.num_tokens
            reqs.append(rq)
            owners.append(r)
        return reqs, owners

    def _advance(self, owners, reqs):
        for r, rq in zip(owners, reqs):
            self.seen[rq.kind] += 1
            if rq.kind == "prefill":
                r.prompt_left -= rq.num_tokens
                r.prefilled = True
                if r.prompt_left == 0:
                    r.mode = "spec" if self.rng.random() < 0.5 else "plain"
            elif rq.kind == "spec":
                r.acc = int(self.rng.integers(1, rq.num_tokens + 1))
                r.gen_left -= r.acc
            else:
                r.gen_left -= 1
        for r in list(self.active):
            if (r.mode != "prefill" and r.gen_left <= 0) or self.rng.random() < 0.003:
                self.active.remove(r)
                self.free.extend(r.slots)
                self.seen["finished"] += 1

    def _refuse(self, hb, x, b, a):
        """The same batch with one slot named twice: refused, the pools bit-identical."""
        meta = hb.metadata
        meta.state_indices[1, 0] = meta.state_indices[0, 0]
        pre = (np.asarray(self.cache.conv_state), np.asarray(self.cache.ssm_state))
        try:
            self.attn.gdn_attention_core(x, b, a, self.params, self.cache, meta)
        except gdn_jax.InvalidBatchError as e:
            self.cache = e.caches
        else:
            raise AssertionError("a batch naming one slot twice was accepted")
        assert _same_bits(self.cache, pre), "a refused batch changed a pool"
        self.seen["refused"] += 1

    def step(self, i: int):
        self._arrive()
        self._commit_switches()
        reqs, owners = self._schedule()
        hb = self.builder.build(reqs)
        self.seen["buckets"].add((hb.token_bucket, hb.metadata.num_rows))
        x, b, a = random_inputs(self.cfg, hb.token_bucket, self.rng)
        xj, bj, aj = jnp.asarray(x), jnp.asarray(b), jnp.asarray(a)
        if i % 97 == 96 and len(reqs) >= 2:
            self._refuse(self.builder.build(reqs), xj, bj, aj)
        check = i % self.check_every == 0
        pre = (np.asarray(self.cache.conv_state), np.asarray(self.cache.ssm_state)) if check else None
        out, self.cache = self.attn.gdn_attention_core(xj, bj, aj, self.params, self.cache, hb)
        if check:
            self._check(hb, pre, x, b, a, out)
        self._advance(owners, reqs)

    def _check(self, hb, pre, x, b, a, out):
        rows = _rows(hb)
        ref_out, ref_conv, ref_ssm = token_scan_step(self.cfg, self.params, pre[0], pre[1], rows, x, b, a)
        out64 = to_np64(out)
        for kind, lo, hi, *_ in rows:
            if hi > lo:
                err = rel_rmse(out64[lo:hi], ref_out[lo:hi])
                assert err <= budget(self.cfg, "out"), f"{kind} row: output rel rmse {err:.2e}"
        assert not np.any(out64[hb.num_tokens:]), "bucket padding tokens must give zero output"
        np.testing.assert_array_equal(to_np64(self.cache.conv_state), ref_conv)
        err = rel_rmse(to_np64(self.cache.ssm_state), to_np64(ref_ssm))
        assert err <= budget(self.cfg, "state_decode"), f"ssm pool rel rmse {err:.2e}"
        self.seen["checked"] += 1

    def run(self, steps: int, warmup: int = 300):
        t0 = time.perf_counter()
        for i in range(min(warmup, steps)):
            self.step(i)
        pools = (np.asarray(self.cache.conv_state), np.asarray(self.cache.ssm_state))
        for T in TOKEN_BUCKETS:   # the oracle's own programs, compiled before the counting starts
            x, b, a = random_inputs(self.cfg, T, self.rng)
            token_scan_step(self.cfg, self.params, *pools, [], x, b, a)
        health = dict(rss_start=rss_bytes(), maps_start=mapping_count(), programs_start=self.programs())
        with compile_counter() as compiles:
            t1 = time.perf_counter()
            for i in range(warmup, steps):
                self.step(i)
            t2 = time.perf_counter()
        health.update(rss_end=rss_bytes(), maps_end=mapping_count(), programs_end=self.programs(),
                      compiles=list(compiles),
                      warmup_s=t1 - t0, run_s=t2 - t1, steps=steps)
        return self.seen, health

    def programs(self) -> int:
        return sum(v or 0 for v in self.attn.compiled_count().values())


def check_health(seen, health):
    assert health["compiles"] == [], f"compiled after warm-up: {health['compiles'][:5]}"
    assert health["programs_end"] == health["programs_start"], health
    assert health["maps_end"] - health["maps_start"] <= MAPS_SLACK, health
    assert health["rss_end"] - health["rss_start"] <= RSS_SLACK, health
    for k in ("prefill", "decode", "spec", "commit", "refused", "finished", "checked"):
        assert seen[k] > 0, (k, seen)
    assert len(seen["buckets"]) == len(TOKEN_BUCKETS) * len(ROW_BUCKETS), seen["buckets"]


def _impls():
    return ["reference"] + (["native"] if gdn_jax.native_available() else [])


@pytest.mark.parametrize("impl", _impls()[-1:])
def test_soak_short(impl):
    seen, health = Soak(impl, seed=1, check_every=25).run(600, warmup=300)
    check_health(seen, health)


@pytest.mark.slow
@pytest.mark.parametrize("impl", _impls())
def test_soak_20000_steps(impl):
    seen, health = Soak(impl, seed=2, check_every=200).run(20_000, warmup=500)
    check_health(seen, health)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=20_000)
    p.add_argument("--warmup", type=int, default=500)
    p.add_argument("--impl", default="native", choices=["native", "reference", "auto"])
    p.add_argument("--check-every", type=int, default=200)
    p.add_argument("--seed", type=int, default=2)
    args = p.parse_args(argv)
    seen, h = Soak(args.impl, args.seed, check_every=args.check_every).run(args.steps, warmup=args.warmup)
    mib = lambda b: f"{b / 2**20:.1f} MiB"  # noqa: E731
    print(f"soak impl={args.impl} isa={gdn_jax.selected_isa() if gdn_jax.native_available() else '-'} "
          f"steps={h['steps']} warm-up {h['warmup_s']:.1f} s, then {h['run_s']:.1f} s "
          f"({1e3 * h['run_s'] / max(h['steps'] - args.warmup, 1):.2f} ms/step incl. checks)")
    print(f"  RSS {mib(h['rss_start'])} -> {mib(h['rss_end'])}; mappings {h['maps_start']} -> {h['maps_end']}; "
          f"compiled step programs {h['programs_start']} -> {h['programs_end']}; "
          f"compilations after warm-up: {len(h['compiles'])}")
    print(f"  rows: prefill {seen['prefill']}, decode {seen['decode']}, spec {seen['spec']}; commits {seen['commit']}, "
          f"refused batches {seen['refused']}, finished requests {seen['finished']}, oracle checks {seen['checked']}, "
          f"buckets {sorted(seen['buckets'])}")
    check_health(seen, h)
    print("  OK: flat after warm-up")


if __name__ == "__main__":
    main()
