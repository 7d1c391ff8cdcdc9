"""The GDN layer against transformers' own Qwen3-Next / Qwen3.5 layers, from checkpoints that
transformers wrote (save_pretrained, single and sharded files).

Several sequences in one mixed batch: a prefill of each, then a step that holds a
continuation chunk, a decode row and a short chunk, then decode steps. transformers runs
each sequence alone with its own cache; outputs and final caches must agree.
"""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

import hf_models as hf  # noqa: E402
from gdn_jax import GDNCache, Request, build_batch  # noqa: E402
from gdn_jax.checkpoint import load_layer_config, load_layer_params  # noqa: E402
from gdn_jax.layer import GatedDeltaNetLayer  # noqa: E402

from serve_helpers import NATIVE_READY  # noqa: E402

# The core is checked on every ISA by the op and path tests; here the layer runs on the
# reference and on the kernels a user gets (the selected ISA).
IMPLS = ["reference"] + (["native"] if NATIVE_READY else [])


def rrmse(x, ref):
    x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
    return float(np.sqrt(np.mean((x - ref) ** 2) / np.mean(ref ** 2)))


SPECS = {
    # GQA 2, K < V, sharded files (each tensor alone in a file or two)
    "next": hf.TinyModel("qwen3_next", H=2, HV=4, K=16, V=32, shard_size="40KB"),
    # GQA 3, K > V, the multimodal wrapper (model.language_model.* keys, text_config)
    "3.5": hf.TinyModel("qwen3_5", H=2, HV=6, K=32, V=16),
}
LAYER = 1
# Per sequence: the token counts of each step (0 = not in that step).
PLAN = {"A": [13, 7, 1, 1, 1], "B": [5, 1, 1, 1, 1], "C": [1, 3, 1, 1, 1]}
SLOTS = {"A": 5, "B": 0, "C": 2}
NUM_SLOTS = 6


@pytest.fixture(scope="module", params=sorted(SPECS))
def checkpoint(request, tmp_path_factory):
    spec = SPECS[request.param]
    model = hf.build_model(spec, seed=len(request.param))
    path = hf.save(model, tmp_path_factory.mktemp(f"hf_{spec.model_type}"), spec)
    return spec, model, path


def _run_plan(layer, params, cfg, runner_for, inputs):
    """Run PLAN through our layer (mixed batches) and transformers (per sequence)."""
    cache = GDNCache.create(cfg.core, NUM_SLOTS)
    ours = {s: [] for s in PLAN}
    theirs = {s: [] for s in PLAN}
    pos = {s: 0 for s in PLAN}
    for step in range(len(PLAN["A"])):
        reqs, xs, names = [], [], []
        for s, counts in PLAN.items():
            n = counts[step]
            x = inputs[s][pos[s]:pos[s] + n]
            if step == 0:
                reqs.append(Request.prefill(SLOTS[s], n, id=s))
            elif n == 1:
                reqs.append(Request.decode(SLOTS[s], id=s))
            else:
                reqs.append(Request.prefill(SLOTS[s], n, has_initial_state=True, id=s))
            xs.append(x)
            names.append(s)
            theirs[s].append(runner_for[s](x))
            pos[s] += n
        batch = build_batch(reqs, num_slots=NUM_SLOTS, token_bucket=32, row_bucket=4)
        h = jnp.asarray(batch.pack(xs, dtype=np.float32), cfg.act_dtype)
        run = layer.decode if all(r.kind == "decode" for r in reqs) else layer.mixed
        out, cache = run(h, params, cache, batch)
        assert not np.any(np.asarray(out, np.float32)[batch.num_tokens:]), "bucket padding tokens must be zero"
        for s, o in zip(names, batch.unpack(np.asarray(out, np.float32))):
            ours[s].append(o)
    return ours, theirs, cache


@pytest.mark.parametrize("impl", IMPLS)
def test_layer_matches_transformers_f32(checkpoint, impl):
    spec, model, path = checkpoint
    cfg = load_layer_config(path)
    assert cfg.act_dtype == np.dtype(np.float32)
    assert cfg.model_type == ("qwen3_next" if spec.model_type == "qwen3_next" else "qwen3_5")
    params = load_layer_params(path, LAYER, cfg)
    layer = GatedDeltaNetLayer(cfg, impl=impl)
    rng = np.random.default_rng(7)
    inputs = {s: rng.standard_normal((sum(c), spec.hidden)).astype(np.float32) for s, c in PLAN.items()}
    runners = {s: hf.HFLayerRunner(model, LAYER) for s in PLAN}
    ours, theirs, cache = _run_plan(layer, params, cfg, runners, inputs)
    for s in PLAN:
        for step, (o, t) in enumerate(zip(ours[s], theirs[s])):
            assert rrmse(o, t) <= 1e-5, (s, step, rrmse(o, t))
        slot = SLOTS[s]
        assert rrmse(np.asarray(cache.ssm_state[slot]), runners[s].ssm_state()) <= 1e-5, s
        # raw in_proj outputs: equal up to the two libraries' f32 matmul summation orders
        assert rrmse(np.asarray(cache.conv_state[slot]), runners[s].conv_state()) <= 1e-6, s


@pytest.mark.parametrize("impl", IMPLS)
def test_layer_matches_transformers_bf16(checkpoint, impl, tmp_path):
    """bf16 weights and activations, against transformers run in f32 on the same bf16 weights
    and inputs (the truth), over every token of the plan.

    The core's own budget (contract.md: 2e-3 - 3e-3 with exact bf16 inputs) is tested by the
    op tests; the layer adds bf16 roundings of its own (in_proj outputs, the conv output,
    the norm's two casts, out_proj), placed where transformers places them, and its RMSNorm
    magnifies the error of a head whose output is small. So the layer is held to
    transformers' own bf16 error on the same inputs: at most 1.5x it, and below 1.2e-2
    (measured here: ours 0.0055-0.0088, transformers' 0.0060-0.0104, over three seeds).
    Per-token errors are not compared: a token whose q and k are nearly orthogonal turns
    one-ulp differences of the conv output into large relative changes, either way.
    """
    import torch

    spec, _, _ = checkpoint
    bf = hf.build_model(spec, seed=11).to(torch.bfloat16)
    path = hf.save(bf, tmp_path / "bf16", spec)
    cfg = load_layer_config(path)
    assert cfg.act_dtype == np.dtype(jnp.bfloat16)
    params = load_layer_params(path, LAYER, cfg)
    assert params.in_proj_qkv.dtype == jnp.bfloat16, "bf16 weights stay bf16"
    truth_model = hf.build_model(spec, seed=11).to(torch.bfloat16).float()   # the same bf16 values, run in f32
    layer = GatedDeltaNetLayer(cfg, impl=impl)
    rng = np.random.default_rng(8)
    # inputs that are exact bf16 values, so every side starts from the same numbers
    inputs = {s: np.asarray(jnp.asarray(rng.standard_normal((sum(c), spec.hidden)), jnp.bfloat16), np.float32)
              for s, c in PLAN.items()}
    hf_runners = {s: hf.HFLayerRunner(bf, LAYER) for s in PLAN}
    ours, hf_bf16, cache = _run_plan(layer, params, cfg, hf_runners, inputs)
    truth_runners = {s: hf.HFLayerRunner(truth_model, LAYER) for s in PLAN}
    truth = {s: [truth_runners[s](inputs[s][sum(PLAN[s][:i]):sum(PLAN[s][:i + 1])]) for i in range(len(PLAN[s]))]
             for s in PLAN}
    cat = lambda d: np.concatenate([x for s in PLAN for x in d[s]])  # noqa: E731
    ours_err, their_err = rrmse(cat(ours), cat(truth)), rrmse(cat(hf_bf16), cat(truth))
    assert ours_err <= min(1.5 * their_err, 1.2e-2), (ours_err, their_err)
    for s in PLAN:
        t = truth_runners[s].ssm_state()
        ours_s, their_s = rrmse(np.asarray(cache.ssm_state[SLOTS[s]]), t), rrmse(hf_runners[s].ssm_state(), t)
        assert ours_s <= min(1.5 * their_s, 1e-2), (s, ours_s, their_s)
