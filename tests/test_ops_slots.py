"""copy_slots: the index-scatter rollback op (commit_accepted's SSM move)."""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gdn_jax
from gdn_jax import _checks, ops

IMPLS = ["native", "reference"]


def _pool(dtype, N=9, shape=(3, 4, 5)):
    rng = np.random.default_rng(0)
    return jnp.asarray(rng.normal(size=(N,) + shape), dtype)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_copies_rows_and_leaves_the_rest(impl, dtype):
    pool = _pool(dtype)
    before = np.asarray(pool.astype(jnp.float32))
    src = jnp.asarray([4, -1, 2, 7, 5], jnp.int32)
    dst = jnp.asarray([1, -1, 2, 0, -1], jnp.int32)  # row 2: src == dst (no-op); rows 1, 4 skipped
    out = ops.copy_slots(pool, src=src, dst=dst, impl=impl)
    expect = before.copy()
    expect[1] = before[4]
    expect[0] = before[7]
    np.testing.assert_array_equal(np.asarray(out.astype(jnp.float32)), expect)


@pytest.mark.parametrize("src,dst,pattern", [
    ([1, 2], [3, 3], "slot 3 is also named by row 0"),
    ([1, 3], [3, 5], "slot 3 is also named by row 0"),     # row 1 reads what row 0 writes
    ([1, 9], [3, 4], r"row 1: src slot 9 is outside \[0, 9\) \(its dst is not PAD_SLOT_ID\)"),
    ([1, 2], [3, -5], r"row 1: dst slot -5 is outside \[0, 9\) and is not PAD_SLOT_ID"),
])
def test_bad_rows_refused_identically(src, dst, pattern):
    pool = _pool(jnp.float32)
    before = np.asarray(pool)
    sts = []
    for impl in IMPLS:
        out, st = ops.copy_slots_with_status(pool, src=jnp.asarray(src, jnp.int32), dst=jnp.asarray(dst, jnp.int32),
                                             impl=impl)
        np.testing.assert_array_equal(np.asarray(out), before)
        sts.append(np.asarray(st))
    np.testing.assert_array_equal(sts[0], sts[1])
    assert re.search(pattern, _checks.status_message("copy_slots", sts[0]))
    with pytest.raises(gdn_jax.InvalidBatchError, match=pattern):
        ops.copy_slots(pool, src=jnp.asarray(src, jnp.int32), dst=jnp.asarray(dst, jnp.int32), impl="native")


def test_bf16_pool_in_place_without_a_pass():
    pool = _pool(jnp.bfloat16, N=41)
    src = jnp.asarray([3, 8], jnp.int32)
    dst = jnp.asarray([5, 1], jnp.int32)
    f = jax.jit(lambda p, s, d: ops.copy_slots(p, src=s, dst=d, impl="native"), donate_argnums=0)
    hlo = f.lower(pool, src, dst).compile().as_text()
    assert not [l for l in hlo.splitlines() if "[41,3,4,5]" in l and re.search(r"\b(convert|copy)\(", l)]
    ptr = pool.unsafe_buffer_pointer()
    out = f(pool, src, dst)
    assert out.unsafe_buffer_pointer() == ptr


@pytest.mark.parametrize("impl", IMPLS)
def test_empty_pool(impl):
    """N = 0: padding rows copy nothing (the reference gathered row 0 of no rows), a named slot
    is refused."""
    pool = jnp.zeros((0, 4), jnp.float32)
    out, status = ops.copy_slots_with_status(pool, src=jnp.asarray([-1], jnp.int32), dst=jnp.asarray([-1], jnp.int32),
                                             impl=impl)
    assert out.shape == (0, 4) and int(status[0]) == 0
    _, status = ops.copy_slots_with_status(pool, src=jnp.asarray([0], jnp.int32), dst=jnp.asarray([0], jnp.int32),
                                           impl=impl)
    assert int(status[0]) != 0
