"""State pools (gdn_jax.config.zeros_pool, GDNCache.create): zero values, the huge-page hint of
the native pool kernel, and that a donated step keeps the pool's buffer (so the hint lasts).

The hint is read back from the kernel's own view: /proc/self/smaps lists the flags of the
mapping that holds the pool ("hg" = MADV_HUGEPAGE).
"""
from __future__ import annotations

import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gdn_jax
from gdn_jax import GDNAttention, GDNCache, GDNConfig, GDNParams, Request, build_batch, zeros_pool

F32, BF16 = jnp.float32, jnp.bfloat16
NATIVE = jax.default_backend() == "cpu" and gdn_jax.native_available()
THP = "/sys/kernel/mm/transparent_hugepage/enabled"


def vm_flags(address: int) -> set:
    """The VmFlags of the mapping of this process that holds ``address``."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            m = re.match(r"^([0-9a-f]+)-([0-9a-f]+) ", line)
            if m:
                inside = int(m.group(1), 16) <= address < int(m.group(2), 16)
            elif inside and line.startswith("VmFlags:"):
                return set(line.split()[1:])
    raise AssertionError(f"no mapping holds {address:#x}")


def middle(x) -> int:
    return x.unsafe_buffer_pointer() + x.nbytes // 2


@pytest.mark.parametrize("huge_pages", [True, False])
@pytest.mark.parametrize("dtype", [F32, BF16])
@pytest.mark.parametrize("shape", [(3, 5), (2, 4, 16, 16), (64, 32, 64, 64), (0, 8)])
def test_zeros_pool_is_zeros(shape, dtype, huge_pages):
    # Heap memory freed with other contents just before: a small pool may be served from it.
    junk = [jnp.full(shape, 7, dtype) + i for i in range(3)]
    jax.block_until_ready(junk)
    del junk
    x = zeros_pool(shape, dtype, huge_pages=huge_pages)
    assert x.shape == shape and x.dtype == dtype
    assert not np.any(np.asarray(x.astype(F32)))


@pytest.mark.parametrize("shape", [(-1, 4), (2.0, 4), 8, (True, 2)])
def test_zeros_pool_refuses_bad_shapes(shape):
    with pytest.raises(ValueError, match="shape must be a tuple of non-negative ints"):
        zeros_pool(shape, F32)


@pytest.mark.parametrize("dtype", ["int4", "uint4", "float4_e2m1fn"])
def test_pools_narrower_than_a_byte_are_refused(dtype):
    """XLA:CPU packs such types two to a byte while the FFI counts a byte per element: a byte-wise
    fill or slot copy would run past the buffer. Refused in Python and by the native calls."""
    if not hasattr(jnp, dtype):
        pytest.skip(f"this jax has no {dtype}")
    dt = getattr(jnp, dtype)
    with pytest.raises(TypeError, match=f"zeros_pool: dtype {dtype} is narrower than a byte"):
        zeros_pool((4, 8), dt)
    pool = jnp.zeros((4, 8), dt)
    for impl in ("native", "reference") if NATIVE else ("reference",):
        with pytest.raises(TypeError, match=f"pool: dtype {dtype} is narrower than a byte"):
            gdn_jax.ops.copy_slots(pool, src=jnp.array([0], jnp.int32), dst=jnp.array([3], jnp.int32), impl=impl)
    if NATIVE:  # the handlers' own guard, past the Python checks
        from gdn_jax import _native
        with pytest.raises(Exception, match="copy_slots.*narrower than a byte"):
            jax.block_until_ready(_native.copy_slots(pool, jnp.array([0], jnp.int32), jnp.array([3], jnp.int32)))
        with pytest.raises(Exception, match="zeros_pool.*narrower than a byte"):
            jax.block_until_ready(_native.zero_pool((4, 8), np.dtype(dt)))


@pytest.mark.skipif(not NATIVE or not os.path.exists("/proc/self/smaps") or not os.path.exists(THP),
                    reason="the hint is the native CPU path's, read back from Linux's smaps")
def test_zeros_pool_advises_huge_pages():
    # 64 MiB and more: above glibc's largest mmap threshold (32 MiB), so the plain pools get
    # mappings of their own, never heap memory that an earlier pool's hint still covers.
    shape = (64, 16, 128, 128)
    with_hint = zeros_pool(shape, F32)
    plain = zeros_pool(shape, F32, huge_pages=False)
    assert "hg" in vm_flags(middle(with_hint))
    assert "hg" not in vm_flags(middle(plain))
    cfg = GDNConfig(2, 4, 128, 128)  # 256 KiB of f32 state per slot
    assert "hg" in vm_flags(middle(GDNCache.create(cfg, 260).ssm_state))
    assert "hg" not in vm_flags(middle(GDNCache.create(cfg, 260, huge_pages=False).ssm_state))


@pytest.mark.skipif(not NATIVE, reason="native pool kernel")
def test_two_pools_of_one_program_are_two_buffers():
    # The pool kernel has no operands: without its side-effect flag XLA could merge two calls.
    a, b = jax.jit(lambda: (zeros_pool((4, 1024), F32), zeros_pool((4, 1024), F32)))()
    assert a.unsafe_buffer_pointer() != b.unsafe_buffer_pointer()
    a = a.at[0].set(1.0)
    assert not np.any(np.asarray(b))


@pytest.mark.skipif(not NATIVE, reason="native pool kernel and step")
def test_donated_step_keeps_the_pool_buffer():
    cfg = GDNConfig(1, 2, 16, 16, act_dtype=F32)
    attn = GDNAttention(cfg, impl="native")
    params = GDNParams.random(cfg, jax.random.key(0))
    cache = GDNCache.create(cfg, 8)
    ptr = cache.ssm_state.unsafe_buffer_pointer()
    batch = build_batch([Request.decode(3), Request.decode(5)], num_slots=8, token_bucket=2,
                        row_bucket=2).metadata.to_device()
    x = jnp.ones((2, cfg.D), F32)
    ab = jnp.zeros((2, cfg.HV), F32)
    for _ in range(3):
        out, cache = attn.decode(x, ab, ab, params, cache, batch)
    assert cache.ssm_state.unsafe_buffer_pointer() == ptr
    state = np.asarray(cache.ssm_state)
    assert np.any(state[[3, 5]]) and not np.any(np.delete(state, [3, 5], axis=0))


@pytest.mark.parametrize("huge_pages", [True, False])
def test_zeros_pool_dtype_as_jnp_zeros(huge_pages):
    """float64 / int64 pools come out as jnp.zeros makes them (32-bit without jax_enable_x64) on
    both paths; the native one had made 64-bit arrays."""
    for dt in (np.float64, np.int64, np.float32, jnp.bfloat16):
        assert zeros_pool((2, 3), dt, huge_pages=huge_pages).dtype == jax.dtypes.canonicalize_dtype(dt)
