"""gdn_jax.tune_host_malloc: glibc reuses big blocks instead of mapping fresh pages.

Process-wide, so each case runs in a child process: a 64 MiB block allocated, written and freed
over and over (NumPy), and a jitted step whose 64 MiB output XLA allocates per call, counted in
page faults per round (ru_minflt, the median of 9 rounds after 20 of warm-up). Left alone, glibc
maps each such block afresh: at least one fault per 2 MiB written (one per 4 KiB without huge
pages). Tuned, the rounds reuse the heap, also for XLA's blocks, which its worker threads allocate.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

import gdn_jax
from gdn_jax import host_memory

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GLIBC = host_memory._glibc() is not None
MIB64 = 64 << 20

CHILD = r"""
import json, resource, sys
import numpy as np
import jax, jax.numpy as jnp
import gdn_jax
tuned = gdn_jax.tune_host_malloc() if sys.argv[1] == "tuned" else None
n = 16 << 20  # f32 elements: 64 MiB

def faults(fn, warmup=20, rounds=9):
    # Median page faults of one round, after the heap grew to the steady state's blocks.
    for _ in range(warmup):
        fn()
    counts = []
    for _ in range(rounds):
        f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        fn()
        counts.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
    return float(np.median(counts))

def numpy_block():
    a = np.empty(n, np.float32)
    a.fill(1.0)
    del a

x = jnp.ones((n,), jnp.float32)
step = jax.jit(lambda x: x * 2.0)

def xla_output():
    y = step(x)
    y.block_until_ready()
    del y

print(json.dumps(dict(tuned=tuned, numpy=faults(numpy_block), xla=faults(xla_output))))
"""


def child(mode):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("GLIBC_TUNABLES", None)
    r = subprocess.run([sys.executable, "-c", CHILD, mode], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not GLIBC, reason="tune_host_malloc sets glibc's malloc; this C library is not glibc")
def test_tuned_malloc_reuses_big_blocks():
    plain, tuned = child("plain"), child("tuned")
    assert plain["tuned"] is None and tuned["tuned"] is True
    # Untuned: each round maps its 64 MiB afresh, at least one fault per 2 MiB page.
    assert plain["numpy"] >= MIB64 / (2 << 20), plain
    assert plain["xla"] >= MIB64 / (2 << 20), plain
    # Tuned: the rounds reuse the heap's pages (a few faults for Python's own objects at most).
    assert tuned["numpy"] < 4, tuned
    assert tuned["xla"] < 4, tuned


@pytest.mark.parametrize("bad", [-1, 2**31, 1.5, "1G", True, None, np.float64(1e6), np.int64(2**31)])
def test_trim_threshold_checked(bad):
    with pytest.raises(ValueError, match="trim_threshold_bytes"):
        gdn_jax.tune_host_malloc(bad)


def test_trim_threshold_takes_numpy_ints():
    glibc = host_memory._glibc() is not None
    assert gdn_jax.tune_host_malloc(np.int64(1 << 30)) is glibc and gdn_jax.tune_host_malloc() is glibc


def test_not_glibc_changes_nothing(monkeypatch):
    monkeypatch.setattr(host_memory, "_glibc", lambda: None)
    assert gdn_jax.tune_host_malloc() is False


def test_refused_setting_raises(monkeypatch):
    class Refusing:
        @staticmethod
        def mallopt(param, value):
            return 0

    monkeypatch.setattr(host_memory, "_glibc", lambda: Refusing())
    with pytest.raises(OSError, match="M_TRIM_THRESHOLD"):
        gdn_jax.tune_host_malloc(1 << 20)
