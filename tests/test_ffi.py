"""FFI plumbing: ISA dispatch controls, target registration, in-place aliasing, impl choice."""
import os
import platform
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gdn_jax
from gdn_jax import _ffi, ops

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run_py(code, **env):
    full_env = dict(os.environ, PYTHONPATH=ROOT, **env)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=full_env, timeout=120)


X86 = platform.machine().lower() in ("x86_64", "amd64")
BEST_FIRST = ["amx", "avx512bf16", "avx512", "avx2", "neon_bf16", "neon", "generic"]


def test_available_isas_well_formed():
    isas = gdn_jax.available_isas()
    assert len(set(isas)) == len(isas)
    assert gdn_jax.selected_isa() in isas
    assert set(isas) <= set(BEST_FIRST) | {"amx_model"}
    # Real back ends best first, generic last among them; the test ISA amx_model (the AMX
    # kernels on the software tile model) comes after generic, on every x86 build.
    real = [i for i in isas if i != "amx_model"]
    assert real == sorted(real, key=BEST_FIRST.index)
    assert real[-1] == "generic"
    assert ("amx_model" in isas) == X86
    if X86:
        assert isas[-1] == "amx_model" and isas[-2] == "generic"
    # The best available ISA is chosen by default (unless the environment forces one), never
    # the model.
    if not os.environ.get("GDN_JAX_ISA"):
        assert gdn_jax.selected_isa() == isas[0]
        assert gdn_jax.selected_isa() != "amx_model"


def test_isas_follow_cpu_features():
    feats = set(gdn_jax.cpu_features().split())
    isas = set(gdn_jax.available_isas())
    assert ("avx2" in isas) == ({"avx2", "fma"} <= feats)
    assert ("avx512" in isas) == ({"avx512f", "avx512bw", "avx512dq", "avx512vl"} <= feats)
    assert ("avx512bf16" in isas) == ({"avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512bf16"} <= feats)
    # amx: the CPU set and nothing in the way (OS tile state, Linux permission).
    amx_cpu = {"amx_tile", "amx_bf16", "avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512bf16"} <= feats
    blocked = {"amx_os_disabled", "amx_permission_denied"} & feats
    assert ("amx" in isas) == (amx_cpu and not blocked)
    assert not blocked or amx_cpu  # a refusal is only reported for a CPU that has AMX


def test_amx_unavailable_says_why():
    """Without AMX here, selecting it fails with the reason, and the best ISA stays selected
    (avx512bf16 on an AMX CPU whose tile permission Linux refused)."""
    if "amx" in gdn_jax.available_isas():
        pytest.skip("AMX is usable on this machine")
    before = gdn_jax.selected_isa()
    feats = set(gdn_jax.cpu_features().split())
    if not X86:
        pattern = "not built for this architecture"
    elif "amx_permission_denied" in feats:
        pattern = "Linux refused tile data permission"
    elif "amx_os_disabled" in feats:
        pattern = "does not enable tile state"
    else:
        pattern = "lacks a feature it needs \\(AMX-TILE, AMX-BF16"
    with pytest.raises(ValueError, match=pattern):
        gdn_jax.set_isa("amx")
    assert gdn_jax.selected_isa() == before


@pytest.mark.skipif(not X86, reason="amx_model is built on x86 only")
def test_amx_model_is_selectable_but_never_default():
    r = _run_py("import gdn_jax; print(gdn_jax.selected_isa())", GDN_JAX_ISA="amx_model")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "amx_model"
    r = _run_py("import gdn_jax; print(gdn_jax.selected_isa())", GDN_JAX_ISA="")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() != "amx_model"


def test_use_isa_switches_and_restores():
    before = gdn_jax.selected_isa()
    with gdn_jax.use_isa("generic"):
        assert gdn_jax.selected_isa() == "generic"
    assert gdn_jax.selected_isa() == before


@pytest.mark.parametrize("name,pattern", [("bogus", "unknown ISA 'bogus'"), ("neon", "not built for this architecture")])
def test_set_isa_rejects_clearly(name, pattern):
    if name in gdn_jax.available_isas():
        pytest.skip(f"{name} is available on this machine")
    before = gdn_jax.selected_isa()
    with pytest.raises(ValueError, match=pattern):
        gdn_jax.set_isa(name)
    assert gdn_jax.selected_isa() == before


def test_set_isa_missing_cpu_feature():
    feats = set(gdn_jax.cpu_features().split())
    candidates = ("avx512bf16", "avx512", "avx2") if ("amx_tile" in feats or not X86) else ("amx", "avx512bf16", "avx512", "avx2")
    missing = [i for i in candidates if i not in gdn_jax.available_isas()]
    if not missing:
        pytest.skip("this CPU has every x86 ISA")
    with pytest.raises(ValueError, match="lacks a feature"):
        gdn_jax.set_isa(missing[0])


def test_env_var_forces_isa():
    r = _run_py("import gdn_jax; print(gdn_jax.selected_isa())", GDN_JAX_ISA="generic")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "generic"


def test_env_var_bad_isa_is_a_clear_error():
    r = _run_py("import gdn_jax", GDN_JAX_ISA="nope")
    assert r.returncode != 0
    assert "GDN_JAX_ISA='nope' cannot be honoured" in r.stderr
    assert "Available here" in r.stderr


def test_ffi_api_versions_are_read_and_compatible_here():
    runtime = _ffi.runtime_ffi_api_version()
    assert runtime is not None and all(isinstance(v, int) for v in runtime)
    module = tuple(_ffi._gdn_ffi.ffi_api_version())
    assert module[0] == runtime[0] and module[1] <= runtime[1]
    assert _ffi.ffi_api_mismatch(module, runtime) is None


@pytest.mark.parametrize("module, runtime, ok", [
    ((0, 1), (0, 1), True), ((0, 1), (0, 4), True), ((0, 3), (0, 1), False), ((0, 2), (1, 0), False),
    ((1, 0), (0, 4), False), ((0, 9), None, True)])
def test_ffi_api_mismatch_rule(module, runtime, ok):
    msg = _ffi.ffi_api_mismatch(module, runtime)
    assert (msg is None) == ok
    if not ok:
        assert f"compiled against the XLA FFI API {module[0]}.{module[1]}" in msg
        assert f"has {runtime[0]}.{runtime[1]}" in msg and "--no-build-isolation" in msg


def test_extension_newer_than_jaxlib_is_refused_cleanly(tmp_path):
    """A module compiled against a newer FFI API than the jaxlib's (a wheel built with newer
    headers, then jax downgraded): XLA would refuse its handlers when the CPU backend starts, and
    then no CPU computation at all would run. gdn_jax does not register them: it warns, naming
    both versions, impl='auto' runs the reference, impl='native' says why, and JAX works."""
    api = tmp_path / "xla" / "ffi" / "api"
    api.mkdir(parents=True)
    (api / "c_api.h").write_text("#define XLA_FFI_API_MAJOR 0\n#define XLA_FFI_API_MINOR 0\n")
    code = f"""
import warnings, jax, jax.numpy as jnp, numpy as np
jax.ffi.include_dir = lambda: {str(tmp_path)!r}   # a jaxlib of FFI API 0.0, older than any
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    import gdn_jax
msgs = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
assert len(msgs) == 1 and "has 0.0, so it cannot register the native kernels" in msgs[0], msgs
assert not gdn_jax.native_available()
a = jnp.asarray(np.linspace(-3, 3, 32).reshape(4, 8), jnp.float32)
kw = dict(A_log=jnp.full(8, 0.5), dt_bias=jnp.full(8, 0.1))
got = gdn_jax.fused_gdn_gating(a, a, **kw)
want = gdn_jax.reference.fused_gdn_gating(a, a, **kw)
for x, y in zip(got, want):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
try:
    gdn_jax.fused_gdn_gating(a, a, impl="native", **kw)
except RuntimeError as e:
    assert "has 0.0" in str(e), e
else:
    raise AssertionError("impl='native' ran")
print(float(jnp.sum(jnp.arange(10.0))))   # the CPU backend still runs
"""
    r = _run_py(code)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "45.0"


def test_use_isa_covers_computations_still_queued_when_the_block_ends():
    """JAX dispatches asynchronously: a computation whose inputs are still being transferred
    is queued, and may run after the use_isa block has ended. It must still run on the
    block's ISA (the generic back end's exp and log1p are libm's, so its gating bits differ
    from the vector back ends')."""
    others = [i for i in gdn_jax.available_isas() if i not in ("generic", "amx_model")]
    if not others:
        pytest.skip("only the generic back end on this CPU")
    rng = np.random.default_rng(5)
    T, HV = 1 << 16, 32
    a = (rng.normal(size=(T, HV)) * 4).astype(np.float32)
    b = (rng.normal(size=(T, HV)) * 4).astype(np.float32)
    f = jax.jit(lambda a, b: gdn_jax.fused_gdn_gating(a, b, A_log=jnp.zeros(HV), dt_bias=jnp.zeros(HV)))
    with gdn_jax.use_isa("generic"):
        expected = [np.asarray(x) for x in f(jnp.asarray(a), jnp.asarray(b))]
    with gdn_jax.use_isa(others[0]):
        other = [np.asarray(x) for x in f(jnp.asarray(a), jnp.asarray(b))]
    assert any(np.any(x != e) for x, e in zip(other, expected)), "back ends agree bit for bit"
    for _ in range(3):
        with gdn_jax.use_isa("generic"):
            out = f(jnp.asarray(a), jnp.asarray(b))  # fresh inputs: queued, not waited for here
        for x, e in zip(out, expected):
            np.testing.assert_array_equal(np.asarray(x), e)


def test_targets_registered_with_prefix():
    names = set(_ffi._gdn_ffi.registrations())
    assert names == {"gating", "conv_fwd", "conv_update", "recurrent", "chunk", "copy_slots", "report",
                     "batch_status", "step", "bandwidth_probe", "gated_rms_norm", "linear", "linear_packed",
                     "zero_pool"}


def test_impl_resolution():
    assert ops.resolve_impl("auto") == "native"  # CPU backend with the extension built
    assert ops.resolve_impl("reference") == "reference"
    with pytest.raises(ValueError, match="impl must be one of"):
        ops.resolve_impl("fast")


def _conv_case(N=16, L=3, D=40, T=6):
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(T, D)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(D, L + 1)), jnp.float32)
    cs = jnp.asarray(rng.normal(size=(N, L, D)), jnp.float32)
    qsl = jnp.asarray([0, 2, 6], jnp.int32)
    idx = jnp.asarray([3, 7], jnp.int32)
    hs = jnp.asarray([True, False])
    return x, w, cs, qsl, idx, hs


def test_donated_cache_is_updated_in_place():
    x, w, cs, qsl, idx, hs = _conv_case()

    def step(x, cs):
        return gdn_jax.causal_conv1d_fwd(x, weight=w, bias=None, conv_state=cs, query_start_loc=qsl,
                                         state_indices=idx, has_initial_state=hs, impl="native")

    f = jax.jit(step, donate_argnums=(1,))
    ptr = cs.unsafe_buffer_pointer()
    y, cs2 = f(x, cs)
    assert cs.is_deleted()
    assert cs2.unsafe_buffer_pointer() == ptr
    hlo = f.lower(x, cs2).compile().as_text()
    pool = r"f32\[16,3,40\]"
    copies = [l for l in hlo.splitlines() if re.search(pool + r"[^=]*=[^=]*\bcopy\(", l) or
              (re.search(r"=\s*" + pool, l) and " copy(" in l)]
    assert not copies, "\n".join(copies)


def test_parallel_counters_time_the_forks_inside_the_call():
    """The benchmarks' fork/join counters (parallel.h): job_ns is the wall time of the parallel-fors,
    so it is positive when a call forked and never more than the call's own wall time."""
    import time

    counters = _ffi._gdn_ffi.parallel_counters
    x, w, cs, qsl, idx, hs = _conv_case(D=1024, T=128)  # 2 token blocks x 4 channel blocks: 8 items
    f = jax.jit(lambda x, cs: gdn_jax.causal_conv1d_fwd(
        x, weight=w, bias=None, conv_state=cs, query_start_loc=qsl.at[-1].set(128), state_indices=idx,
        has_initial_state=hs, impl="native"), donate_argnums=(1,))
    y, cs = f(x, cs)
    jax.block_until_ready(y)
    counters(True)
    t0 = time.perf_counter()
    y, cs = f(x, cs)
    jax.block_until_ready((y, cs))
    wall_ns = (time.perf_counter() - t0) * 1e9
    c = counters(True)
    assert set(c) >= {"jobs", "helpers", "join_wait_ns", "job_ns"}
    if c["jobs"] == 0:  # a one-thread pool runs every loop inline: nothing forked, nothing timed
        assert c["job_ns"] == 0 and c["helpers"] == 0
    else:
        assert 0 < c["job_ns"] <= wall_ns, (c, wall_ns)
        assert c["join_wait_ns"] <= c["job_ns"], c
    assert counters(False)["job_ns"] == 0  # reset


def test_copy_slots_pool_passes_the_report_call_in_place():
    """copy_slots returns the pool through the native report call: still in place, no copy."""
    pool = jnp.asarray(np.random.default_rng(3).normal(size=(16, 3, 40)), jnp.float32)
    before = np.asarray(pool).copy()
    f = jax.jit(lambda p, s, d: gdn_jax.copy_slots(p, src=s, dst=d, impl="native"), donate_argnums=(0,))
    ptr = pool.unsafe_buffer_pointer()
    src, dst = jnp.asarray([2, 5], jnp.int32), jnp.asarray([9, -1], jnp.int32)
    out = f(pool, src, dst)
    assert out.unsafe_buffer_pointer() == ptr
    expected = before.copy()
    expected[9] = before[2]
    np.testing.assert_array_equal(np.asarray(out), expected)
    hlo = f.lower(out, src, dst).compile().as_text()
    assert "gdn_jax_report" in hlo
    copies = [l for l in hlo.splitlines() if " copy(" in l and "f32[16,3,40]" in l]
    assert not copies, "\n".join(copies)


def test_not_donated_keeps_callers_array():
    x, w, cs, qsl, idx, hs = _conv_case()
    before = np.asarray(cs).copy()
    f = jax.jit(lambda x, cs: gdn_jax.causal_conv1d_fwd(
        x, weight=w, bias=None, conv_state=cs, query_start_loc=qsl, state_indices=idx,
        has_initial_state=hs, impl="native"))
    f(x, cs)
    np.testing.assert_array_equal(np.asarray(cs), before)


def test_results_do_not_depend_on_thread_count(tmp_path):
    """The same program under one CPU (pool of 1) and two CPUs gives identical bits."""
    code = r"""
import sys, numpy as np, jax, jax.numpy as jnp, gdn_jax
rng = np.random.default_rng(1)
T, HV = 512, 48
a = jnp.asarray(rng.normal(size=(T, HV)), jnp.bfloat16); b = jnp.asarray(rng.normal(size=(T, HV)), jnp.bfloat16)
g, beta = jax.jit(lambda a, b: gdn_jax.fused_gdn_gating(a, b, A_log=jnp.zeros(HV), dt_bias=jnp.zeros(HV)))(a, b)
np.save(sys.argv[1], np.concatenate([np.asarray(g).ravel(), np.asarray(beta).ravel()]))
"""
    script = tmp_path / "run.py"
    script.write_text(code)
    outs = []
    for cpus in (["taskset", "-c", "0"], []):
        if cpus and subprocess.run(["which", "taskset"], capture_output=True).returncode != 0:
            pytest.skip("taskset not installed")
        out = tmp_path / f"out{len(outs)}.npy"
        r = subprocess.run(cpus + [sys.executable, str(script), str(out)], capture_output=True, text=True,
                           env=dict(os.environ, PYTHONPATH=ROOT), timeout=120)
        assert r.returncode == 0, r.stderr
        outs.append(np.load(out))
    np.testing.assert_array_equal(outs[0], outs[1])


def test_parallel_counters_time_the_serving_step_handler():
    """StepTimer (parallel.h): one serving step counts one handler call whose entry and return lie on
    Python's monotonic clock inside the call's own wall time and hold its parallel-fors; a plain op is
    no step; a refused batch (early return) still counts."""
    import dataclasses
    import time

    from gdn_jax import GDNAttention, GDNCache, GDNConfig, GDNParams, Request, build_batch

    counters = _ffi._gdn_ffi.parallel_counters
    cfg = GDNConfig(num_k_heads=2, num_v_heads=4, head_k_dim=32, head_v_dim=32)
    attn = GDNAttention(cfg, impl="native")
    params = GDNParams.random(cfg, jax.random.key(0))
    cache = GDNCache.create(cfg, num_slots=8)
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((4, cfg.D)), cfg.act_dtype)
    a = b = jnp.asarray(rng.standard_normal((4, cfg.num_v_heads)), cfg.act_dtype)
    ok = build_batch([Request.decode(i) for i in range(4)], num_slots=8, token_bucket=4, row_bucket=4).metadata
    bad = dataclasses.replace(ok, state_indices=jnp.full_like(ok.state_indices, 1))  # duplicate slots: refused
    out, cache, st = attn.decode_with_status(x, b, a, params, cache, ok)
    jax.block_until_ready((out, st))
    for batch, accepted in ((ok, True), (bad, False)):
        counters(True)
        t0 = time.monotonic_ns()
        out, cache, st = attn.decode_with_status(x, b, a, params, cache, batch)
        jax.block_until_ready((out, cache, st))
        t1 = time.monotonic_ns()
        c = counters(True)
        assert (int(np.asarray(st)[0]) == 0) == accepted, st
        assert c["steps"] == 1, c
        assert t0 <= c["step_entry_ns"] < c["step_exit_ns"] <= t1, (t0, c, t1)
        assert c["step_ns"] == c["step_exit_ns"] - c["step_entry_ns"]
        assert c["job_ns"] <= c["step_ns"], c
    jax.block_until_ready(gdn_jax.fused_gdn_gating(a, b, A_log=params.A_log, dt_bias=params.dt_bias, impl="native"))
    assert counters(True)["steps"] == 0
