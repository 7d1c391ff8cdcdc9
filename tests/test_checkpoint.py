"""gdn_jax.checkpoint and gdn_jax.safetensors_io: reading checkpoints as transformers writes them.

* the safetensors reader against the safetensors package (f32, f16) and torch (bf16);
* Qwen3-Next's interleaved in_proj rows undone exactly (against transformers' own
  fix_query_key_value_ordering on the same weights);
* one tensor-parallel shard's read equals the matching slices of the whole layer;
* every mistake names the file, the key and what was expected;
* save_checkpoint writes what transformers loads (its layer then equals ours).
"""
from __future__ import annotations

import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gdn_jax import GDNConfig
from gdn_jax.checkpoint import (Checkpoint, CheckpointError, gdn_layer_indices, load_layer_config, load_layer_params,
                                load_layers, save_checkpoint)
from gdn_jax.layer import MODEL_FAMILIES, GDNLayerConfig, GDNLayerParams
from gdn_jax.safetensors_io import SafetensorsFile, save_file

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
import hf_models as hf  # noqa: E402


@pytest.fixture(scope="module")
def next_ckpt(tmp_path_factory):
    spec = hf.TinyModel("qwen3_next", H=2, HV=6, K=16, V=32, shard_size="30KB")
    model = hf.build_model(spec, seed=3)
    return spec, model, hf.save(model, tmp_path_factory.mktemp("next"), spec)


@pytest.fixture(scope="module")
def q35_ckpt(tmp_path_factory):
    spec = hf.TinyModel("qwen3_5", H=4, HV=8, K=32, V=16)
    model = hf.build_model(spec, seed=4).to(torch.bfloat16)
    return spec, model, hf.save(model, tmp_path_factory.mktemp("q35"), spec)


def _copy(src, tmp_path):
    dst = tmp_path / "ck"
    shutil.copytree(src, dst)
    return dst


# --- the safetensors reader ---------------------------------------------------------------------


def test_reader_matches_safetensors_and_torch(tmp_path):
    from safetensors.numpy import save_file as st_save
    from safetensors.torch import save_file as st_torch_save

    rng = np.random.default_rng(0)
    arrays = {"a": rng.standard_normal((5, 3)).astype(np.float32), "b": rng.standard_normal(7).astype(np.float16),
              "empty": np.zeros((0, 4), np.float32)}
    st_save(arrays, str(tmp_path / "np.safetensors"))
    f = SafetensorsFile(tmp_path / "np.safetensors")
    for k, v in arrays.items():
        np.testing.assert_array_equal(f.read(k), v)
        assert f.dtype(k) == v.dtype and f.shape(k) == v.shape
    np.testing.assert_array_equal(f.read("a", rows=[(3, 5), (0, 1)]), arrays["a"][[3, 4, 0]])
    np.testing.assert_array_equal(f.read("a", cols=(1, 3)), arrays["a"][:, 1:3])
    np.testing.assert_array_equal(f.read("a", rows=[(3, 5)], cols=(2, 3)), arrays["a"][3:5, 2:3])
    t = torch.randn(6, 4).to(torch.bfloat16)
    st_torch_save({"w": t}, str(tmp_path / "bf.safetensors"))
    got = SafetensorsFile(tmp_path / "bf.safetensors").read("w")
    assert got.dtype == jnp.bfloat16
    np.testing.assert_array_equal(got.astype(np.float32), t.float().numpy())
    # and our writer's files read back in the safetensors package (f32) and torch (bf16)
    save_file({"x": arrays["a"], "y": got}, tmp_path / "ours.safetensors")
    from safetensors.torch import load_file
    back = load_file(str(tmp_path / "ours.safetensors"))
    np.testing.assert_array_equal(back["x"].numpy(), arrays["a"])
    assert torch.equal(back["y"], t)


def test_reader_refuses_malformed_files(tmp_path):
    p = tmp_path / "bad.safetensors"
    p.write_bytes(b"\x05\x00")
    with pytest.raises(ValueError, match="bad.safetensors: not a safetensors file"):
        SafetensorsFile(p)
    header = json.dumps({"w": {"dtype": "F32", "shape": [4, 4], "data_offsets": [0, 64]}}).encode()
    p.write_bytes(len(header).to_bytes(8, "little") + header + b"\0" * 16)   # data cut short
    with pytest.raises(ValueError, match="'w' data_offsets 0..64 do not fit"):
        SafetensorsFile(p)
    for bad, msg in [({"w": {"dtype": "F32", "shape": [2], "data_offsets": [-8, 0]}}, "'w' data_offsets -8..0"),
                     ({"w": {"dtype": "F32", "shape": [2], "data_offsets": [8, 0]}}, "'w' data_offsets 8..0"),
                     ({"w": [1, 2]}, "header entry 'w' is malformed"),
                     ([1, 2], "the safetensors header is a JSON list, not an object")]:
        header = json.dumps(bad).encode()
        p.write_bytes(len(header).to_bytes(8, "little") + header + b"\0" * 64)
        with pytest.raises(ValueError, match=msg):
            SafetensorsFile(p)


def _raw_file(path, entries, data: bytes):
    header = json.dumps(entries).encode()
    path.write_bytes(len(header).to_bytes(8, "little") + header + data)


def test_reader_lists_other_dtypes_and_refuses_only_their_reads(tmp_path):
    """A quantized checkpoint's file holds FP8 tensors beside bf16 ones: the bf16 ones read,
    an FP8 one raises naming the key and its dtype (in a checkpoint: CheckpointError)."""
    w = np.arange(4, dtype=np.float32)
    _raw_file(tmp_path / "model.safetensors",
              {"fp8": {"dtype": "F8_E4M3", "shape": [2, 4], "data_offsets": [0, 8]},
               "model.layers.0.linear_attn.A_log": {"dtype": "F32", "shape": [4], "data_offsets": [8, 24]}},
              bytes(range(8)) + w.tobytes())
    f = SafetensorsFile(tmp_path / "model.safetensors")
    assert sorted(f.keys()) == ["fp8", "model.layers.0.linear_attn.A_log"] and f.dtype_name("fp8") == "F8_E4M3"
    np.testing.assert_array_equal(f.read("model.layers.0.linear_attn.A_log"), w)
    with pytest.raises(ValueError, match="'fp8' is stored as F8_E4M3, a dtype gdn_jax does not read"):
        f.read("fp8")
    # a wrong size is still found for a dtype the reader does not take
    _raw_file(tmp_path / "short.safetensors", {"fp8": {"dtype": "F8_E4M3", "shape": [2, 4], "data_offsets": [0, 7]}},
              bytes(8))
    with pytest.raises(ValueError, match="'fp8' data_offsets 0..7 do not fit shape \\(2, 4\\) F8_E4M3"):
        SafetensorsFile(tmp_path / "short.safetensors")
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3_next", "num_hidden_layers": 1}))
    ck = Checkpoint(tmp_path)
    np.testing.assert_array_equal(ck.read("model.layers.0.linear_attn.A_log", (4,), "A_log"), w)
    with pytest.raises(CheckpointError, match="'fp8' is stored as F8_E4M3"):
        ck.read("fp8", (2, 4), "a test")


@pytest.mark.parametrize("interval", [0, -4, 2.5, "4", True])
def test_bad_full_attention_interval_names_the_field(tmp_path, interval):
    _raw_file(tmp_path / "model.safetensors", {}, b"")
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3_next", "num_hidden_layers": 4,
                                                      "full_attention_interval": interval}))
    with pytest.raises(CheckpointError, match="config.json: field 'full_attention_interval' must be a positive int"):
        Checkpoint(tmp_path).layer_types


# --- loading -------------------------------------------------------------------------------------


def test_config_of_both_families(next_ckpt, q35_ckpt):
    _, _, p = next_ckpt
    c = load_layer_config(p, num_spec=2)
    assert (c.model_type, c.hidden_size, c.H, c.HV, c.K, c.V, c.core.W, c.core.num_spec) == \
        ("qwen3_next", 64, 2, 6, 16, 32, 4, 2)
    assert c.act_dtype == np.dtype(np.float32) and gdn_layer_indices(p) == [0, 1, 2]
    _, _, p = q35_ckpt
    c = load_layer_config(p)
    assert (c.model_type, c.H, c.HV, c.K, c.V) == ("qwen3_5", 4, 8, 32, 16)
    assert c.act_dtype == np.dtype(jnp.bfloat16)


def test_qwen3_next_deinterleave_matches_transformers(next_ckpt):
    """transformers' own split of the interleaved projections, on the stored weights."""
    spec, model, path = next_ckpt
    cfg = load_layer_config(path)
    params = load_layer_params(path, 2, cfg)
    mod = model.get_submodule(hf.layer_prefix(model, 2))
    h = torch.randn(1, 5, spec.hidden)
    with torch.no_grad():
        q, k, v, z, b, a = mod.fix_query_key_value_ordering(mod.in_proj_qkvz(h), mod.in_proj_ba(h))
        mixed_hf = torch.cat([q.reshape(1, 5, -1), k.reshape(1, 5, -1), v.reshape(1, 5, -1)], -1)[0].double().numpy()
    hn = h[0].double().numpy()
    np.testing.assert_allclose(hn @ np.asarray(params.in_proj_qkv, np.float64).T, mixed_hf, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(hn @ np.asarray(params.in_proj_z, np.float64).T, z[0].reshape(5, -1).double().numpy(),
                               rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(hn @ np.asarray(params.in_proj_b, np.float64).T, b[0].double().numpy(), rtol=1e-5,
                               atol=1e-5)
    np.testing.assert_allclose(hn @ np.asarray(params.in_proj_a, np.float64).T, a[0].double().numpy(), rtol=1e-5,
                               atol=1e-5)
    np.testing.assert_array_equal(np.asarray(params.core.conv_weight), mod.conv1d.weight[:, 0].detach().numpy())
    np.testing.assert_array_equal(np.asarray(params.out_proj), mod.out_proj.weight.detach().numpy())


@pytest.mark.parametrize("which", ["next", "q35"])
def test_shard_read_equals_slices_of_the_whole(which, next_ckpt, q35_ckpt):
    _, _, path = next_ckpt if which == "next" else q35_ckpt
    cfg = load_layer_config(path)
    whole = load_layer_params(path, 1, cfg)
    H, G, K, V = cfg.H, cfg.G, cfg.K, cfg.V
    tp = 2
    for r in range(tp):
        h0, h1 = r * H // tp, (r + 1) * H // tp
        part = load_layer_params(path, 1, cfg, key_heads=(h0, h1))
        rows = np.r_[h0 * K:h1 * K, H * K + h0 * K:H * K + h1 * K, 2 * H * K + h0 * G * V:2 * H * K + h1 * G * V]
        vh = np.arange(h0 * G, h1 * G)
        eq = np.testing.assert_array_equal
        eq(np.asarray(part.in_proj_qkv), np.asarray(whole.in_proj_qkv)[rows])
        eq(np.asarray(part.core.conv_weight), np.asarray(whole.core.conv_weight)[rows])
        eq(np.asarray(part.in_proj_z), np.asarray(whole.in_proj_z)[h0 * G * V:h1 * G * V])
        eq(np.asarray(part.in_proj_b), np.asarray(whole.in_proj_b)[vh])
        eq(np.asarray(part.in_proj_a), np.asarray(whole.in_proj_a)[vh])
        eq(np.asarray(part.core.A_log), np.asarray(whole.core.A_log)[vh])
        eq(np.asarray(part.core.dt_bias), np.asarray(whole.core.dt_bias)[vh])
        eq(np.asarray(part.norm_weight), np.asarray(whole.norm_weight))
        eq(np.asarray(part.out_proj), np.asarray(whole.out_proj)[:, h0 * G * V:h1 * G * V])
        part.validate(cfg.local(tp))
    with pytest.raises(ValueError, match="key_heads must be"):
        load_layer_params(path, 1, cfg, key_heads=(1, 1))


# --- mistakes name the file, the key and what was expected ---------------------------------------


def test_errors_name_file_key_and_expectation(next_ckpt, q35_ckpt, tmp_path):
    _, _, path = next_ckpt
    with pytest.raises(CheckpointError, match="layer 3 is a 'full_attention' layer.*GDN layers are \\[0, 1, 2\\]"):
        load_layer_params(path, 3)
    with pytest.raises(CheckpointError, match="layer 9 out of range: the model has 4 layers"):
        load_layer_params(path, 9)
    with pytest.raises(CheckpointError, match="not a directory"):
        load_layer_config(tmp_path / "nowhere")

    # a config field that disagrees with the tensors
    ck = _copy(path, tmp_path)
    cfg = json.loads((ck / "config.json").read_text())
    cfg["linear_num_value_heads"] = 4
    (ck / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"model-\d+-of-\d+\.safetensors: model\.layers\.0\.linear_attn\."
                                              r"in_proj_qkvz\.weight has shape \[448, 64\], expected \[320, 64\].*"
                                              r"linear_num_value_heads=4"):
        load_layer_params(ck, 0)
    cfg["model_type"] = "llama"
    (ck / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="config.json: model_type 'llama' is not supported"):
        load_layer_config(ck)

    # a missing key, and a file the index names but that is gone
    _, _, p35 = q35_ckpt
    ck = _copy(p35, tmp_path / "b")
    from gdn_jax.safetensors_io import SafetensorsFile as SF
    f = SF(ck / "model.safetensors")
    kept = {k: f.read(k) for k in f.keys() if not k.endswith("layers.1.linear_attn.dt_bias")}
    del f
    save_file(kept, ck / "model.safetensors")
    with pytest.raises(CheckpointError, match="key 'model.language_model.layers.1.linear_attn.dt_bias' missing"):
        load_layer_params(ck, 1)
    ck2 = _copy(path, tmp_path / "c")
    idx = json.loads((ck2 / "model.safetensors.index.json").read_text())
    gone = idx["weight_map"]["model.layers.0.linear_attn.out_proj.weight"]
    os.remove(ck2 / gone)
    with pytest.raises(CheckpointError, match=f"{gone}: missing \\(named by model.safetensors.index.json\\)"):
        load_layer_params(ck2, 0)
    (ck2 / "config.json").unlink()
    with pytest.raises(CheckpointError, match="config.json: missing"):
        load_layer_config(ck2)


def test_malformed_config_and_index_raise_checkpoint_errors(next_ckpt, tmp_path):
    """Wrongly typed JSON (a list for the config, a list for weight_map, layer_types not a list
    of strings) and a shard that is not a file are CheckpointErrors naming the file, not
    AttributeError / TypeError / IsADirectoryError, nor (a string layer_types) no GDN layer."""
    _, _, path = next_ckpt
    ck = _copy(path, tmp_path)
    good_cfg = (ck / "config.json").read_text()
    (ck / "config.json").write_text("[1, 2]")
    with pytest.raises(CheckpointError, match="config.json: must hold a JSON object, got a list"):
        load_layer_config(ck)
    for types in (4, "linear_attention", ["linear_attention", 3]):
        (ck / "config.json").write_text(json.dumps(dict(json.loads(good_cfg), layer_types=types)))
        with pytest.raises(CheckpointError, match="config.json: field 'layer_types' must be a list of strings"):
            gdn_layer_indices(ck)
    (ck / "config.json").write_text(good_cfg)
    index = ck / "model.safetensors.index.json"
    idx = json.loads(index.read_text())
    index.write_text(json.dumps(dict(idx, weight_map=list(idx["weight_map"].items()))))
    with pytest.raises(CheckpointError, match="index.json: 'weight_map' must map tensor names to file names"):
        load_layer_config(ck)
    index.write_text(json.dumps(idx))
    shard = idx["weight_map"]["model.layers.0.linear_attn.out_proj.weight"]
    os.remove(ck / shard)
    os.mkdir(ck / shard)
    with pytest.raises(CheckpointError, match=f"{shard}: cannot be read as a safetensors file"):
        load_layer_params(ck, 0)


def test_a_given_config_must_describe_the_checkpoint(q35_ckpt):
    """H=4, K=32 stored; a config of H=8, K=16 (HV, V the same) gives every tensor the same shape,
    so it loaded as another layer (q/k split at other heads). Now a CheckpointError naming the field."""
    _, _, path = q35_ckpt
    stored = load_layer_config(path)
    wrong = GDNLayerConfig(hidden_size=stored.hidden_size, model_type=stored.model_type,
                           core=GDNConfig(num_k_heads=8, num_v_heads=stored.HV, head_k_dim=16, head_v_dim=stored.V,
                                          act_dtype=stored.act_dtype))
    assert wrong.D == stored.D and wrong.Z == stored.Z
    with pytest.raises(CheckpointError, match="the given config has linear_num_key_heads = 8, the checkpoint's "
                                              "config.json 4"):
        load_layer_params(path, 1, wrong)
    load_layer_params(path, 1, stored)  # the checkpoint's own config: served


def test_unknown_tensors_of_a_layer_are_refused(next_ckpt, tmp_path):
    """Biases or quantisation scales the loader does not take were skipped: the layer loaded as
    another one. Now a CheckpointError listing them (layers without them still load)."""
    _, _, path = next_ckpt
    ck = _copy(path, tmp_path)
    save_file({"model.layers.0.linear_attn.out_proj.bias": np.zeros((64,), np.float32),
               "model.layers.0.linear_attn.in_proj_ba.weight_scale_inv": np.ones((1, 1), np.float32)},
              ck / "extra.safetensors")
    idx = json.loads((ck / "model.safetensors.index.json").read_text())
    idx["weight_map"].update({"model.layers.0.linear_attn.out_proj.bias": "extra.safetensors",
                              "model.layers.0.linear_attn.in_proj_ba.weight_scale_inv": "extra.safetensors"})
    (ck / "model.safetensors.index.json").write_text(json.dumps(idx))
    with pytest.raises(CheckpointError, match=r"layer 0 has tensors this loader does not take: "
                                              r"in_proj_ba\.weight_scale_inv, out_proj\.bias"):
        load_layer_params(ck, 0)
    load_layer_params(ck, 1)


def test_layer_types_from_full_attention_interval(next_ckpt, tmp_path):
    _, _, path = next_ckpt
    ck = _copy(path, tmp_path)
    cfg = json.loads((ck / "config.json").read_text())
    del cfg["layer_types"]
    cfg["full_attention_interval"] = 4
    (ck / "config.json").write_text(json.dumps(cfg))
    assert gdn_layer_indices(ck) == [0, 1, 2]


# --- writing --------------------------------------------------------------------------------------


def test_save_checkpoint_refuses_layers_it_would_hide(tmp_path):
    """A layer past num_hidden_layers would be written but left out of layer_types, and then
    never loaded: refused, as are layer keys that are not indices."""
    core = GDNConfig(num_k_heads=1, num_v_heads=2, head_k_dim=16, head_v_dim=16, act_dtype=jnp.float32)
    cfg = GDNLayerConfig(hidden_size=32, core=core)
    p = GDNLayerParams.random(cfg, jax.random.key(0))
    with pytest.raises(ValueError, match="num_hidden_layers=2 leaves out layer 3 of layers: it must be at least 4"):
        save_checkpoint(tmp_path, cfg, {0: p, 3: p}, num_hidden_layers=2)
    for layers in ({}, {-1: p}, {"0": p}):
        with pytest.raises(ValueError, match="layers must map layer indices >= 0 to GDNLayerParams"):
            save_checkpoint(tmp_path, cfg, layers)
    assert not (tmp_path / "config.json").exists()


@pytest.mark.parametrize("model_type", sorted(MODEL_FAMILIES))
def test_save_checkpoint_config_reads_in_transformers(model_type, tmp_path):
    """transformers' AutoConfig reads our config.json's sizes for every model type we write (a
    multimodal type keeps them in text_config only; flat, they were silently its defaults), and
    our loader reads the checkpoint back."""
    import transformers as tf

    core = GDNConfig(num_k_heads=2, num_v_heads=4, head_k_dim=16, head_v_dim=32, act_dtype=jnp.float32)
    cfg = GDNLayerConfig(hidden_size=64, core=core, model_type=MODEL_FAMILIES[model_type])
    p = GDNLayerParams.random(cfg, jax.random.key(1))
    save_checkpoint(tmp_path, cfg, {1: p}, num_hidden_layers=3, model_type=model_type)
    hf_cfg = tf.AutoConfig.from_pretrained(tmp_path)
    assert hf_cfg.model_type == model_type
    text = hf_cfg.get_text_config()
    assert (text.hidden_size, text.linear_num_key_heads, text.linear_num_value_heads, text.linear_key_head_dim,
            text.linear_value_head_dim, text.num_hidden_layers) == (64, 2, 4, 16, 32, 3)
    assert list(text.layer_types) == ["full_attention", "linear_attention", "full_attention"]
    loaded = load_layers(tmp_path)
    assert list(loaded) == [1]
    for a, b in zip(jax.tree_util.tree_leaves(loaded[1]), jax.tree_util.tree_leaves(p)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("model_type", ["qwen3_next", "qwen3_5"])
def test_save_checkpoint_loads_in_transformers(model_type, tmp_path):
    """Our writer's layout is the one transformers reads: its layer then computes what ours does."""
    import transformers as tf

    core = GDNConfig(num_k_heads=2, num_v_heads=4, head_k_dim=16, head_v_dim=32, act_dtype=jnp.float32)
    cfg = GDNLayerConfig(hidden_size=64, core=core, model_type=model_type)
    layers = {i: GDNLayerParams.random(cfg, k) for i, k in enumerate(jax.random.split(jax.random.key(0), 2))}
    save_checkpoint(tmp_path, cfg, layers, num_hidden_layers=3)
    loaded = load_layers(tmp_path)
    for i in (0, 1):
        for a, b in zip(jax.tree_util.tree_leaves(loaded[i]), jax.tree_util.tree_leaves(layers[i])):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # transformers builds the model from our config.json (plus the sizes of the parts that are
    # not gdn_jax's) and takes the GDN weights from our file
    raw = json.loads((tmp_path / "config.json").read_text())
    text = raw.get("text_config", raw)
    text.update(vocab_size=32, intermediate_size=32, num_attention_heads=2, num_key_value_heads=1, head_dim=16)
    if model_type == "qwen3_next":
        model = tf.Qwen3NextForCausalLM(tf.Qwen3NextConfig(**{k: v for k, v in text.items() if k != "model_type"},
                                                           num_experts=2, num_experts_per_tok=1,
                                                           moe_intermediate_size=16, shared_expert_intermediate_size=16))
    else:
        from transformers.models.qwen3_5 import Qwen3_5Config, Qwen3_5ForConditionalGeneration
        model = Qwen3_5ForConditionalGeneration(Qwen3_5Config(
            text_config={k: v for k, v in text.items() if k != "model_type"},
            vision_config=dict(depth=1, hidden_size=32, intermediate_size=32, num_heads=2, out_hidden_size=64)))
    f = SafetensorsFile(tmp_path / "model.safetensors")
    state = {k: torch.from_numpy(np.array(f.read(k))) for k in f.keys()}
    missing = model.load_state_dict(state, strict=False)
    assert not missing.unexpected_keys, missing.unexpected_keys
    assert not [k for k in missing.missing_keys if ".linear_attn." in k and "layers.2" not in k]
    from gdn_jax import GDNCache, Request, build_batch
    from gdn_jax.layer import GatedDeltaNetLayer

    x = np.random.default_rng(1).standard_normal((6, 64)).astype(np.float32)
    want = hf.HFLayerRunner(model.eval(), 1)(x)
    hb = build_batch([Request.prefill(0, 6)], num_slots=2, token_bucket=8, row_bucket=2)
    out, _ = GatedDeltaNetLayer(cfg, "reference").prefill(jnp.asarray(hb.pack([x])), loaded[1],
                                                           GDNCache.create(core, 2), hb)
    got = np.asarray(out, np.float64)[:6]
    assert np.sqrt(np.mean((got - want) ** 2) / np.mean(want ** 2)) <= 1e-5
