"""Sharded GDN (gdn_jax.sharding) against the unsharded engine and the reference.

The multi-device cases run in subprocesses (tests/sharding_worker.py) so that the forced
device count and jax.distributed never leak into this process: one process with 4 forced
CPU devices (tp = 2, tp = 4, data 2 x tp 2), two processes joined by jax.distributed with
CPU collectives (tp = 2 across them), and the compiled HLO of every sharded step. The
worker checks each step's outputs and pools against the single-device engine and exits
non-zero on the first mismatch; its log is shown on failure.

In-process tests cover the host-side pieces (channel order, slot routing, errors).
"""
from __future__ import annotations

import os
import pathlib
import socket
import subprocess
import sys

import numpy as np
import pytest

import gdn_jax
from gdn_jax import sharding as sh
from gdn_jax.batch import Request
from gdn_jax.config import GDNConfig

ROOT = pathlib.Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests" / "sharding_worker.py"

needs_native = pytest.mark.skipif(not gdn_jax.native_available(), reason="native extension not built")


def _env():
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    env.pop("XLA_FLAGS", None)
    env.setdefault("JAX_PLATFORMS", "cpu")
    return env


def _run(*args, timeout=600):
    proc = subprocess.run([sys.executable, str(WORKER), *args], env=_env(), capture_output=True, text=True,
                          timeout=timeout)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0 and proc.stdout.rstrip().endswith("OK"), log[-6000:]
    return log


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


# --- subprocess cases ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny random Qwen3-Next checkpoint (interleaved in_proj rows) the layer cases load.
    Its config is the worker's (CFG, HIDDEN, LAYER); the loader refuses any mismatch."""
    import jax
    from gdn_jax.checkpoint import save_checkpoint
    from gdn_jax.layer import GDNLayerConfig, GDNLayerParams

    path = str(tmp_path_factory.mktemp("gdn_shard_ckpt"))
    cfg = GDNLayerConfig(hidden_size=64, core=GDNConfig(4, 8, 16, 16, num_spec=2, act_dtype=np.float32))
    save_checkpoint(path, cfg, {1: GDNLayerParams.random(cfg, jax.random.PRNGKey(7))})
    return path


@needs_native
def test_layer_mesh_tp2_tp4_data2_tp2_match_unsharded_layer_and_reference(checkpoint):
    """4 forced devices: tp = 2, tp = 4 and data 2 x tp 2, each process reading its shards
    from the checkpoint, against the single-device layer (and, for 2 x 2, its reference)."""
    _run("mesh", "--what", "layer", "--ckpt", checkpoint, "--meshes", "2x1,4x1,2x2")


@needs_native
def test_layer_mesh_qwen3_5_three_value_heads_per_key_head():
    """A Qwen3.5 checkpoint (separate in_proj_qkv / z / b / a) with G = 3 on tp = 2, tp = 4 and
    data 2 x tp 2 meshes, each process reading its shards, against the single-device layer (and, for
    2 x 2, its reference)."""
    _run("mesh", "--what", "layer", "--model-type", "qwen3_5", "--meshes", "2x1,4x1,2x2")


@needs_native
def test_layer_mesh_with_its_axes_the_other_way_round(checkpoint):
    """A mesh whose axes are ("model", "data"): load_params placed shard 1's rows on model shard
    0's devices (the devices reshaped as if the axes were (data, model)), a wrong layer."""
    _run("mesh", "--what", "layer", "--ckpt", checkpoint, "--meshes", "2x2r", "--reference-on", "none")


@needs_native
@pytest.mark.parametrize("what", ["layer", "core"])
def test_mistakes_on_a_mesh_are_refused_naming_them(checkpoint, what):
    """A batch built for another dp (data shards' requests dropped), weights or pools the layer did
    not lay out (jit re-sharded them by position), a mesh without a data axis, global shapes."""
    log = _run("misuse", "--what", what, "--ckpt", checkpoint)
    assert log.count(" OK") >= 8, log


@needs_native
def test_layer_packed_weights_shard_like_plain_ones():
    """bf16 layer, 2x1 / 4x1 / 2x2 meshes: packed per shard at load == packed on the host; one
    mixed step with packed weights against the same mesh with plain weights."""
    _run("packed")


@needs_native
def test_layer_two_processes_tp2_match_one_process(checkpoint):
    _run_two_processes("--what", "layer", "--ckpt", checkpoint)


@needs_native
def test_layer_compiled_steps_one_reduction_no_gather_pools_in_place(checkpoint):
    """Also the reduce-scatter form (scatter_output=True) against the unsharded layer."""
    _run("hlo", "--what", "layer", "--ckpt", checkpoint)


@needs_native
def test_core_mesh_data2_tp2_matches_unsharded():
    _run("mesh", "--meshes", "2x2", "--reference-on", "none")


def test_core_mesh_data2_tp2_reference_impl_matches_unsharded():
    """impl="reference" on four CPU devices (more than this host's cores): the refused steps
    agree over "data" through the reference path's checked status, and the reference's chunk
    solve no longer waits in jaxlib's trsm, which hung every device's program at once."""
    _run("mesh", "--meshes", "2x2", "--impl", "reference", "--reference-on", "none")


@needs_native
@pytest.mark.slow
@pytest.mark.parametrize("layout", ["SD", "DS"])
def test_core_mesh_tp2_tp4_data2_tp2_match_unsharded_and_reference(layout):
    _run("mesh", "--meshes", "2x1,4x1,2x2", "--reference-on", "2x2", "--layout", layout)


@needs_native
def test_core_compiled_steps_gather_nothing_and_update_pools_in_place():
    _run("hlo")


@needs_native
@pytest.mark.slow
def test_core_compiled_steps_ds_layout():
    _run("hlo", "--layout", "DS")


def _run_two_processes(*extra, timeout=600):
    port = _free_port()
    procs = [subprocess.Popen([sys.executable, str(WORKER), "dist", "--process-id", str(i), "--num-processes", "2",
                               "--port", str(port), *extra], env=_env(), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for i in range(2)]
    logs = []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=timeout)
            logs.append(out)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for i, (p, log) in enumerate(zip(procs, logs)):
        assert p.returncode == 0 and log.rstrip().endswith("OK"), f"process {i}:\n{log[-6000:]}"


@needs_native
@pytest.mark.slow
def test_core_two_processes_tp2_match_one_process():
    _run_two_processes()


@needs_native
@pytest.mark.slow
def test_example_runs_three_ways_and_they_agree():
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / "sharded_layer.py")], env=_env(),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and "they agree" in proc.stdout, (proc.stdout + proc.stderr)[-6000:]


# --- in-process: host-side pieces ------------------------------------------------------------

CFG = GDNConfig(4, 8, 16, 32, num_spec=2)


def test_tp_must_divide_key_heads():
    with pytest.raises(ValueError, match=r"tp=3 does not divide the key heads H=4"):
        sh.local_config(CFG, 3)
    local = sh.local_config(CFG, 2)
    assert (local.H, local.HV, local.D) == (2, 4, CFG.D // 2)


def test_channel_order_is_each_shards_plain_qkv():
    """Shard r's block of the shard-major order is the plain [q | k | v] of its heads."""
    tp = 2
    order = sh.qkv_channel_order(CFG, tp)
    assert sorted(order.tolist()) == list(range(CFG.D))
    HK, HVV = CFG.H * CFG.K, CFG.HV * CFG.V
    Dl = CFG.D // tp
    for r in range(tp):
        block = order[r * Dl:(r + 1) * Dl]
        hk, hv = HK // tp, HVV // tp
        np.testing.assert_array_equal(block[:hk], np.arange(r * hk, (r + 1) * hk))
        np.testing.assert_array_equal(block[hk:2 * hk], HK + np.arange(r * hk, (r + 1) * hk))
        np.testing.assert_array_equal(block[2 * hk:], 2 * HK + np.arange(r * hv, (r + 1) * hv))
    x = np.arange(3 * CFG.D, dtype=np.float32).reshape(3, CFG.D)
    np.testing.assert_array_equal(sh.from_shard_major(np.asarray(sh.to_shard_major(x, CFG, tp)), CFG, tp), x)


def test_sharded_batch_routes_global_slots_to_local_ids():
    N, dp = 4, 2
    reqs = [Request.prefill(5, 3), Request.decode(1), Request.spec((6, 7, 4), 2)]
    hb = sh.build_sharded_batch(reqs, num_slots=N, num_data=dp, num_spec=2, token_bucket=8, row_bucket=3)
    assert hb.placement[0][0] == 1 and hb.placement[1][0] == 0 and hb.placement[2][0] == 1
    idx = hb.metadata.state_indices
    assert idx.shape == (dp, 3, 3)
    assert idx[0, hb.shards[0].rows[0], 0] == 1
    spec_row = hb.shards[1].rows[hb.placement[2][1]]
    np.testing.assert_array_equal(idx[1, spec_row], [2, 3, 0])
    per_req = [np.full((r.num_tokens, 2), i + 1.0) for i, r in enumerate(reqs)]
    packed = hb.pack(per_req)
    assert packed.shape == (dp * 8, 2)
    for got, want in zip(hb.unpack(packed), per_req):
        np.testing.assert_array_equal(got, want)


def test_sharded_batch_refuses_a_request_across_shards():
    with pytest.raises(ValueError, match=r"span data shards \[0, 1\]"):
        sh.build_sharded_batch([Request.spec((3, 4, 5), 1)], num_slots=4, num_data=2, num_spec=2, token_bucket=8,
                               row_bucket=2)
    with pytest.raises(ValueError, match=r"slot 8 is outside \[0, dp\*N = 8\)"):
        sh.build_sharded_batch([Request.decode(8)], num_slots=4, num_data=2, token_bucket=8, row_bucket=2)


def test_sharded_batch_errors_name_the_callers_request_and_global_slot():
    """Requests are validated on their global slots in the caller's order before they are routed,
    so an error names what the caller passed, not a shard's local view of it."""
    reqs = [Request.decode(0), Request.decode(1), Request.decode(5, id="A"), Request.prefill(5, 3, id="B")]
    with pytest.raises(ValueError, match=r"request 3 \(id='B', prefill\): slot 5 is also named by request 2 "
                                         r"\(id='A', decode\)"):
        sh.build_sharded_batch(reqs, num_slots=4, num_data=2, token_bucket=8, row_bucket=4)
    with pytest.raises(ValueError, match=r"request 2 \(spec\): a spec row has at most num_spec \+ 1 = 3 tokens"):
        sh.build_sharded_batch([Request.decode(0), Request.decode(1), Request.spec((4, 5, 6), 5)], num_slots=4,
                               num_data=2, num_spec=2, token_bucket=16, row_bucket=4)
    with pytest.raises(ValueError, match="num_spec must be an int >= 0, got None"):
        sh.build_sharded_batch(reqs[:1], num_slots=4, num_data=2, num_spec=None, token_bucket=8, row_bucket=4)


def test_sharded_batch_routes_a_spec_row_with_unused_pad_columns():
    hb = sh.build_sharded_batch([Request.decode(1), Request.spec((6, -1, -1), 1)], num_slots=4, num_data=2,
                                num_spec=2, token_bucket=8, row_bucket=2)
    assert hb.placement == ((0, 0), (1, 0))
    np.testing.assert_array_equal(np.asarray(hb.metadata.state_indices)[1, hb.shards[1].rows[0]], [2, -1, -1])


def test_sharded_status_message_names_the_shard():
    assert sh.sharded_status_message("decode", np.zeros(5, np.int32)) is None
    msg = sh.sharded_status_message("decode", np.array([5, 2, 7, 1, 3], np.int32))
    assert msg.startswith("gdn_jax.decode (data shard 3): invalid batch") and "slot 7" in msg
