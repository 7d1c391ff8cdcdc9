"""Loading GDN layers from Hugging Face checkpoints on disk (Qwen3-Next, Qwen3.5), and writing them.

A checkpoint directory as transformers writes it: ``config.json`` and ``model.safetensors``,
or sharded ``model-*.safetensors`` files with ``model.safetensors.index.json``. Keys
``model.layers.{i}.linear_attn.*``, or ``model.language_model.layers.{i}.linear_attn.*`` in
the multimodal Qwen3.5 checkpoints. The GDN layers are those whose ``layer_types`` entry is
``linear_attention`` (without ``layer_types``: every layer but each ``full_attention_interval``-th).

Layouts (``[out, in]`` rows, G = HV / H value heads per key head):

* Qwen3-Next: ``in_proj_qkvz`` rows interleaved per key-head group g,
  ``[q_g (K) | k_g (K) | v_g (G*V) | z_g (G*V)]``, and ``in_proj_ba`` as ``[b_g (G) | a_g (G)]``;
  undone here, once, into the core's plain ``[q | k | v]`` order plus z, b, a.
* Qwen3.5: flat ``in_proj_qkv`` ``[q | k | v]``, ``in_proj_z``, ``in_proj_b``, ``in_proj_a``.
* Both: ``conv1d.weight [D, 1, W]`` in ``[q | k | v]`` order, ``A_log``, ``dt_bias`` [HV],
  ``norm.weight`` [V], ``out_proj.weight [hidden, HV*V]``.

Tensors are read memory-mapped (:mod:`gdn_jax.safetensors_io`); ``key_heads=(h0, h1)`` reads
only the rows of key-head groups ``[h0, h1)``, what one tensor-parallel shard needs. Every
mistake raises :class:`CheckpointError` naming the file, the key and what was expected.
"""
from __future__ import annotations

import dataclasses
import json
import os
from typing import Iterable, Optional, Sequence

import jax.numpy as jnp
import numpy as np

from .config import GDNConfig, GDNParams
from .layer import MODEL_FAMILIES, GDNLayerConfig, GDNLayerParams
from .safetensors_io import SafetensorsFile, save_file

__all__ = ["CheckpointError", "Checkpoint", "load_layer_config", "load_layer_params", "load_layers",
           "gdn_layer_indices", "save_checkpoint"]

_ACT = (np.dtype(jnp.float32), np.dtype(jnp.bfloat16))
_PREFIXES = ("model.language_model.layers.{}.linear_attn.", "model.layers.{}.linear_attn.")


class CheckpointError(ValueError):
    """A checkpoint that does not fit what gdn_jax expects (the message names file and key)."""


class Checkpoint:
    """An opened checkpoint directory: its config and a map from tensor name to file.

    Args:
      path: the directory (``config.json`` + ``model.safetensors`` or the sharded files with
        ``model.safetensors.index.json``).
    """

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        if not os.path.isdir(self.path):
            raise CheckpointError(f"{self.path}: not a directory (expected a Hugging Face checkpoint directory)")
        self.config_file = os.path.join(self.path, "config.json")
        try:
            with open(self.config_file) as f:
                self.raw_config = json.load(f)
        except FileNotFoundError:
            raise CheckpointError(f"{self.config_file}: missing (every Hugging Face checkpoint has one)") from None
        except json.JSONDecodeError as e:
            raise CheckpointError(f"{self.config_file}: not valid JSON ({e})") from None
        if not isinstance(self.raw_config, dict):
            raise CheckpointError(f"{self.config_file}: must hold a JSON object, got a {type(self.raw_config).__name__}")
        model_type = self.raw_config.get("model_type")
        if model_type not in MODEL_FAMILIES:
            raise CheckpointError(f"{self.config_file}: model_type {model_type!r} is not supported; gdn_jax loads "
                                  f"{', '.join(sorted(MODEL_FAMILIES))}")
        self.model_type = model_type
        self.family = MODEL_FAMILIES[model_type]
        text = self.raw_config.get("text_config")
        self.text_config = text if isinstance(text, dict) else self.raw_config
        self._files: dict[str, SafetensorsFile] = {}
        self.weight_map = self._weight_map()

    def _weight_map(self) -> dict[str, str]:
        index = os.path.join(self.path, "model.safetensors.index.json")
        if os.path.exists(index):
            try:
                with open(index) as f:
                    wm = json.load(f)["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise CheckpointError(f"{index}: not a safetensors index (no 'weight_map': {e!r})") from None
            if not isinstance(wm, dict) or not all(isinstance(v, str) for v in wm.values()):
                raise CheckpointError(f"{index}: 'weight_map' must map tensor names to file names, got "
                                      f"{type(wm).__name__} {str(wm)[:80]}")
            return {k: os.path.join(self.path, v) for k, v in wm.items()}
        single = os.path.join(self.path, "model.safetensors")
        if os.path.exists(single):
            return {k: single for k in self._file(single).keys()}
        raise CheckpointError(f"{self.path}: no model.safetensors and no model.safetensors.index.json "
                              f"(found: {', '.join(sorted(os.listdir(self.path))) or 'nothing'})")

    def _file(self, path: str) -> SafetensorsFile:
        if path not in self._files:
            try:
                self._files[path] = SafetensorsFile(path)
            except FileNotFoundError:
                raise CheckpointError(f"{path}: missing (named by model.safetensors.index.json)") from None
            except OSError as e:
                raise CheckpointError(f"{path}: cannot be read as a safetensors file ({e.strerror or e})") from None
            except ValueError as e:
                raise CheckpointError(str(e)) from None
        return self._files[path]

    # --- config ---
    def field(self, name: str, default=None, *, required: bool = True):
        """A field of the (text) config; CheckpointError naming config.json if it is missing."""
        v = self.text_config.get(name, default)
        if v is None and required:
            where = "text_config" if self.text_config is not self.raw_config else "the top level"
            raise CheckpointError(f"{self.config_file}: field {name!r} missing (looked in {where})")
        return v

    def _int_field(self, name: str) -> int:
        v = self.field(name)
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            raise CheckpointError(f"{self.config_file}: field {name!r} must be a positive int, got {v!r}")
        return v

    @property
    def layer_types(self) -> list[str]:
        types = self.field("layer_types", required=False)
        if types is not None:
            if not isinstance(types, list) or not all(isinstance(x, str) for x in types):
                raise CheckpointError(f"{self.config_file}: field 'layer_types' must be a list of strings (one per "
                                      f"layer), got {types!r}"[:300])
            return list(types)
        n = self._int_field("num_hidden_layers")
        interval = self.field("full_attention_interval", 4)
        if isinstance(interval, bool) or not isinstance(interval, int) or interval <= 0:
            raise CheckpointError(f"{self.config_file}: field 'full_attention_interval' must be a positive int, "
                                  f"got {interval!r}")
        return ["linear_attention" if (i + 1) % interval else "full_attention" for i in range(n)]

    @property
    def gdn_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == "linear_attention"]

    # --- tensors ---
    def prefix(self, layer: int) -> str:
        """``model.layers.{layer}.linear_attn.`` or the multimodal ``model.language_model...`` form."""
        types = self.layer_types
        if isinstance(layer, bool) or not isinstance(layer, (int, np.integer)) or not 0 <= layer < len(types):
            raise CheckpointError(f"{self.config_file}: layer {layer!r} out of range: the model has {len(types)} "
                                  f"layers; its GDN layers are {self.gdn_layers}")
        if types[layer] != "linear_attention":
            raise CheckpointError(f"{self.config_file}: layer {layer} is a {types[layer]!r} layer, not a GDN "
                                  f"(linear_attention) layer; the GDN layers are {self.gdn_layers}")
        for p in _PREFIXES:
            if any(k.startswith(p.format(layer)) for k in self.weight_map):
                return p.format(layer)
        raise CheckpointError(f"{self.path}: no tensors of GDN layer {layer} (looked for keys starting with "
                              f"{' or '.join(p.format(layer) for p in _PREFIXES)})")

    def locate(self, key: str) -> SafetensorsFile:
        if key not in self.weight_map:
            raise CheckpointError(f"{self.path}: key {key!r} missing from the checkpoint")
        f = self._file(self.weight_map[key])
        if key not in f:
            raise CheckpointError(f"{f.path}: key {key!r} missing (the index names this file for it)")
        return f

    def has(self, key: str) -> bool:
        return key in self.weight_map

    def read(self, key: str, shape: tuple, why: str, rows: Optional[Sequence[tuple[int, int]]] = None,
             cols: Optional[tuple[int, int]] = None) -> np.ndarray:
        """Tensor ``key`` (or its row ranges, or a column range of a 2-D one) after checking its
        full shape is ``shape``."""
        f = self.locate(key)
        got = f.shape(key)
        if got != tuple(shape):
            raise CheckpointError(f"{f.path}: {key} has shape {list(got)}, expected {list(shape)} ({why})")
        dt = self.stored_dtype(f, key)
        if dt.kind != "f" and dt != np.dtype(jnp.bfloat16):
            raise CheckpointError(f"{f.path}: {key} has dtype {dt}, expected a float type")
        return f.read(key, rows, cols)

    @staticmethod
    def stored_dtype(f: SafetensorsFile, key: str) -> np.dtype:
        """``f.dtype(key)``; a dtype the reader does not take (FP8 of a quantized checkpoint) is a
        CheckpointError naming the file, the key and the dtype."""
        try:
            return f.dtype(key)
        except ValueError as e:
            raise CheckpointError(str(e)) from None


def _cfg_desc(ck: Checkpoint, c: GDNLayerConfig, given: bool = False) -> str:
    return (f"{'the given config' if given else 'config.json'}: hidden_size={c.hidden_size}, "
            f"linear_num_key_heads={c.H}, linear_num_value_heads={c.HV}, linear_key_head_dim={c.K}, "
            f"linear_value_head_dim={c.V}, linear_conv_kernel_dim={c.core.W}")


# A GDN layer's tensors (after the layer's prefix) per family; any other key there is refused.
_LAYER_KEYS = {
    "qwen3_next": ("in_proj_qkvz.weight", "in_proj_ba.weight"),
    "qwen3_5": ("in_proj_qkv.weight", "in_proj_z.weight", "in_proj_b.weight", "in_proj_a.weight"),
}
_COMMON_KEYS = ("conv1d.weight", "conv1d.bias", "A_log", "dt_bias", "norm.weight", "out_proj.weight")


def _check_given_config(ck: Checkpoint, c: GDNLayerConfig) -> None:
    """A config given to the loader must describe the checkpoint's layer: a head split whose
    tensor shapes happen to coincide (H=2, K=32 against H=4, K=16) would load as another layer."""
    s = load_layer_config(ck, act_dtype=c.act_dtype)
    for name, want, got in (("hidden_size", s.hidden_size, c.hidden_size), ("linear_num_key_heads", s.H, c.H),
                            ("linear_num_value_heads", s.HV, c.HV), ("linear_key_head_dim", s.K, c.K),
                            ("linear_value_head_dim", s.V, c.V), ("linear_conv_kernel_dim", s.core.W, c.core.W)):
        if want != got:
            raise CheckpointError(f"{ck.config_file}: the given config has {name} = {got}, the checkpoint's "
                                  f"config.json {want}")


def load_layer_config(path, *, num_spec: int = 0, state_dtype=jnp.float32, act_dtype=None,
                      conv_state_layout: str = "SD", l2norm_eps: float = 1e-6) -> GDNLayerConfig:
    """The :class:`GDNLayerConfig` of the checkpoint's GDN layers.

    Args:
      path: checkpoint directory (or an opened :class:`Checkpoint`).
      num_spec, state_dtype, conv_state_layout, l2norm_eps: serving choices of the core
        (:class:`GDNConfig`); l2norm_eps 1e-6 is what transformers uses.
      act_dtype: activation dtype; None takes the stored dtype of the first GDN layer's
        projection (float32 or bfloat16; a float16 checkpoint needs it given explicitly).
    """
    ck = path if isinstance(path, Checkpoint) else Checkpoint(path)
    act = ck.field("hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise CheckpointError(f"{ck.config_file}: hidden_act {act!r} is not supported (the GDN conv uses silu)")
    if act_dtype is None:
        layers = ck.gdn_layers
        if not layers:
            raise CheckpointError(f"{ck.config_file}: no linear_attention layer in layer_types {ck.layer_types}")
        key = ck.prefix(layers[0]) + ("in_proj_qkvz.weight" if ck.family == "qwen3_next" else "in_proj_qkv.weight")
        f = ck.locate(key)
        act_dtype = Checkpoint.stored_dtype(f, key)
        if act_dtype not in _ACT:
            raise CheckpointError(f"{f.path}: {key} is stored as {act_dtype}; pass act_dtype= (float32 or bfloat16)")
    try:
        core = GDNConfig(num_k_heads=ck._int_field("linear_num_key_heads"),
                         num_v_heads=ck._int_field("linear_num_value_heads"),
                         head_k_dim=ck._int_field("linear_key_head_dim"),
                         head_v_dim=ck._int_field("linear_value_head_dim"),
                         conv_width=ck._int_field("linear_conv_kernel_dim"), activation="silu", num_spec=num_spec,
                         state_dtype=state_dtype, act_dtype=act_dtype, conv_state_layout=conv_state_layout,
                         l2norm_eps=l2norm_eps)
        return GDNLayerConfig(hidden_size=ck._int_field("hidden_size"), core=core,
                              rms_norm_eps=float(ck.field("rms_norm_eps", 1e-6)), model_type=ck.family)
    except (ValueError, TypeError) as e:
        if isinstance(e, CheckpointError):
            raise
        raise CheckpointError(f"{ck.config_file}: {e}") from None


def gdn_layer_indices(path) -> list[int]:
    """Indices of the checkpoint's GDN (linear_attention) layers."""
    return (path if isinstance(path, Checkpoint) else Checkpoint(path)).gdn_layers


def _shard_rows(c: GDNLayerConfig, h0: int, h1: int):
    """Row ranges of [q | k | v] (plain order, width D) that key-head groups [h0, h1) own."""
    H, K, GV = c.H, c.K, c.G * c.V
    return [(h0 * K, h1 * K), (H * K + h0 * K, H * K + h1 * K), (2 * H * K + h0 * GV, 2 * H * K + h1 * GV)]


def load_layer_params(path, layer: int, config: Optional[GDNLayerConfig] = None, *,
                      key_heads: Optional[tuple[int, int]] = None) -> GDNLayerParams:
    """The weights of GDN layer ``layer`` as :class:`GDNLayerParams` (device arrays).

    Args:
      path: checkpoint directory (or an opened :class:`Checkpoint`).
      layer: the layer index in the model (one of :func:`gdn_layer_indices`).
      config: the layer config (default :func:`load_layer_config` of the checkpoint); its
        act dtype decides the projections' dtype (a stored dtype that differs is cast once).
      key_heads: ``(h0, h1)`` to read only key-head groups ``[h0, h1)`` (one tensor-parallel
        shard): the result then fits ``config.with_key_heads(h1 - h0)``, with the local plain
        channel order ``[q_r | k_r | v_r]``, ``z_r``, ``b_r``, ``a_r``, A_log/dt_bias entries
        ``[h0*G, h1*G)``, the norm weight whole and out_proj's columns ``[h0*G*V, h1*G*V)``.
    """
    ck = path if isinstance(path, Checkpoint) else Checkpoint(path)
    c = load_layer_config(ck) if config is None else config
    if not isinstance(c, GDNLayerConfig):
        raise TypeError(f"config must be a GDNLayerConfig, got {type(c).__name__}")
    if config is not None:
        _check_given_config(ck, c)
    H, HV, K, V, G, W, D, Z, hid = c.H, c.HV, c.K, c.V, c.G, c.core.W, c.D, c.Z, c.hidden_size
    h0, h1 = (0, H) if key_heads is None else key_heads
    if not (isinstance(h0, (int, np.integer)) and isinstance(h1, (int, np.integer)) and 0 <= h0 < h1 <= H):
        raise ValueError(f"key_heads must be (h0, h1) with 0 <= h0 < h1 <= H={H}, got {key_heads!r}")
    n = h1 - h0
    pre = ck.prefix(layer)
    desc = _cfg_desc(ck, c, given=config is not None)
    known = {pre + k for k in _LAYER_KEYS.get(ck.family, ()) + _COMMON_KEYS}
    unknown = sorted(k[len(pre):] for k in ck.weight_map if k.startswith(pre) and k not in known)
    if unknown:  # biases, quantisation scales: reading around them would load another layer
        raise CheckpointError(f"{ck.config_file}: layer {layer} has tensors this loader does not take: "
                              f"{', '.join(unknown)} (a {ck.family} GDN layer has {', '.join(sorted(k[len(pre):] for k in known))})")

    def read(name, shape, why, rows=None):
        return ck.read(pre + name, shape, f"{why}; {desc}", rows)

    if c.model_type != ck.family:
        raise CheckpointError(f"{ck.config_file}: model_type {ck.model_type!r} does not match the config's "
                              f"model_type {c.model_type!r}")
    if ck.family == "qwen3_next":
        blk = 2 * K + 2 * G * V
        qkvz = read("in_proj_qkvz.weight", (H * blk, hid), "2*H*K + 2*HV*V, per key-head group [q|k|v|z]",
                    [(h0 * blk, h1 * blk)]).reshape(n, blk, hid)
        qkv = np.concatenate([qkvz[:, :K].reshape(n * K, hid), qkvz[:, K:2 * K].reshape(n * K, hid),
                              qkvz[:, 2 * K:2 * K + G * V].reshape(n * G * V, hid)], axis=0)
        z = qkvz[:, 2 * K + G * V:].reshape(n * G * V, hid)
        ba = read("in_proj_ba.weight", (2 * HV, hid), "2*HV, per key-head group [b|a]",
                  [(2 * G * h0, 2 * G * h1)]).reshape(n, 2 * G, hid)
        b, a = ba[:, :G].reshape(n * G, hid), ba[:, G:].reshape(n * G, hid)
    else:
        qkv = read("in_proj_qkv.weight", (D, hid), "D = 2*H*K + HV*V", _shard_rows(c, h0, h1))
        z = read("in_proj_z.weight", (Z, hid), "HV*V", [(h0 * G * V, h1 * G * V)])
        b = read("in_proj_b.weight", (HV, hid), "HV", [(h0 * G, h1 * G)])
        a = read("in_proj_a.weight", (HV, hid), "HV", [(h0 * G, h1 * G)])
    conv = read("conv1d.weight", (D, 1, W), "[D, 1, W], channels [q|k|v]", _shard_rows(c, h0, h1)).reshape(-1, W)
    conv_bias = None
    if ck.has(pre + "conv1d.bias"):
        conv_bias = read("conv1d.bias", (D,), "[D]", _shard_rows(c, h0, h1))
    A_log = read("A_log", (HV,), "[HV]", [(h0 * G, h1 * G)])
    dt_bias = read("dt_bias", (HV,), "[HV]", [(h0 * G, h1 * G)])
    norm = read("norm.weight", (V,), "[V] = linear_value_head_dim")
    out = ck.read(pre + "out_proj.weight", (hid, Z), f"[hidden, HV*V]; {desc}",
                  cols=None if key_heads is None else (h0 * G * V, h1 * G * V))

    act = c.act_dtype

    def keep(x):  # the core reads f32 or bf16 parameters as stored
        return jnp.asarray(x if x.dtype in _ACT else x.astype(act))

    params = GDNLayerParams(
        in_proj_qkv=jnp.asarray(qkv, act), in_proj_z=jnp.asarray(z, act), in_proj_b=jnp.asarray(b, act),
        in_proj_a=jnp.asarray(a, act),
        core=GDNParams(A_log=jnp.asarray(A_log, jnp.float32) if A_log.dtype not in _ACT else jnp.asarray(A_log),
                       dt_bias=keep(dt_bias), conv_weight=keep(conv),
                       conv_bias=None if conv_bias is None else keep(conv_bias)),
        norm_weight=jnp.asarray(norm, act), out_proj=jnp.asarray(np.ascontiguousarray(out), act))
    return params.validate(c if key_heads is None else c.with_key_heads(n))


def load_layers(path, config: Optional[GDNLayerConfig] = None, layers: Optional[Iterable[int]] = None,
                *, progress: bool = False) -> dict[int, GDNLayerParams]:
    """``{layer index: GDNLayerParams}`` for ``layers`` (default: every GDN layer).

    ``progress=True`` prints a line per layer (a large model takes a while).
    """
    ck = path if isinstance(path, Checkpoint) else Checkpoint(path)
    c = load_layer_config(ck) if config is None else config
    idx = ck.gdn_layers if layers is None else list(layers)
    out = {}
    for n, i in enumerate(idx):
        out[i] = load_layer_params(ck, i, c)
        if progress:
            print(f"gdn_jax: loaded GDN layer {i} ({n + 1}/{len(idx)}) from {ck.path}", flush=True)
    return out


# The multimodal Qwen3.5 types nest the language model's config (transformers reads the sizes
# only from there) and its weights under model.language_model.
_MULTIMODAL_TEXT_TYPE = {"qwen3_5": "qwen3_5_text", "qwen3_5_moe": "qwen3_5_moe_text"}


def save_checkpoint(path, config: GDNLayerConfig, layers: dict[int, GDNLayerParams], *,
                    num_hidden_layers: Optional[int] = None, model_type: Optional[str] = None) -> None:
    """Write GDN layers as a Hugging Face checkpoint directory (config.json + model.safetensors).

    The layout is that of ``config.model_type`` (Qwen3-Next: interleaved ``in_proj_qkvz`` /
    ``in_proj_ba``; Qwen3.5: flat; for the multimodal ``"qwen3_5"`` and ``"qwen3_5_moe"`` under
    ``model.language_model``, the sizes in a nested ``text_config``). Only the GDN layers'
    tensors are written (the rest of a model is not gdn_jax's); layers not in ``layers`` are
    marked ``full_attention``. Used by the demo to make a checkpoint without a network, and to
    export weights.
    """
    model_type = model_type or config.model_type
    if MODEL_FAMILIES.get(model_type) != config.model_type:
        raise ValueError(f"model_type {model_type!r} is not of the config's family {config.model_type!r}")
    bad = [i for i in layers if isinstance(i, bool) or not isinstance(i, (int, np.integer)) or i < 0]
    if bad or not layers:
        raise ValueError(f"layers must map layer indices >= 0 to GDNLayerParams, got keys {sorted(layers, key=str)}")
    n_layers = num_hidden_layers or max(layers) + 1
    if n_layers <= max(layers):
        raise ValueError(f"num_hidden_layers={n_layers} leaves out layer {max(layers)} of layers: it must be at least "
                         f"{max(layers) + 1}")
    H, K, V, G, hid = config.H, config.K, config.V, config.G, config.hidden_size
    text = {"hidden_size": hid, "linear_num_key_heads": H, "linear_num_value_heads": config.HV,
            "linear_key_head_dim": K, "linear_value_head_dim": V, "linear_conv_kernel_dim": config.core.W,
            "rms_norm_eps": config.rms_norm_eps, "hidden_act": "silu", "num_hidden_layers": n_layers,
            "layer_types": ["linear_attention" if i in layers else "full_attention" for i in range(n_layers)],
            "dtype": config.act_dtype.name}
    if model_type in _MULTIMODAL_TEXT_TYPE:
        cfg = {"model_type": model_type, "text_config": dict(text, model_type=_MULTIMODAL_TEXT_TYPE[model_type])}
        prefix = "model.language_model.layers.{}.linear_attn."
    else:
        cfg = dict(text, model_type=model_type)
        prefix = "model.layers.{}.linear_attn."
    tensors = {}
    for i, p in layers.items():
        p = p.unpacked().validate(config)
        t = {k: np.asarray(v) for k, v in dataclasses.asdict(p).items() if k != "core"}
        pre = prefix.format(i)
        if config.model_type == "qwen3_next":
            qkv = t["in_proj_qkv"]
            q = qkv[:H * K].reshape(H, K, hid)
            k = qkv[H * K:2 * H * K].reshape(H, K, hid)
            v = qkv[2 * H * K:].reshape(H, G * V, hid)
            z = t["in_proj_z"].reshape(H, G * V, hid)
            tensors[pre + "in_proj_qkvz.weight"] = np.concatenate([q, k, v, z], axis=1).reshape(-1, hid)
            b = t["in_proj_b"].reshape(H, G, hid)
            a = t["in_proj_a"].reshape(H, G, hid)
            tensors[pre + "in_proj_ba.weight"] = np.concatenate([b, a], axis=1).reshape(-1, hid)
        else:
            for name in ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"):
                tensors[pre + name + ".weight"] = t[name]
        tensors[pre + "conv1d.weight"] = np.asarray(p.core.conv_weight)[:, None, :]
        if p.core.conv_bias is not None:
            tensors[pre + "conv1d.bias"] = np.asarray(p.core.conv_bias)
        tensors[pre + "A_log"] = np.asarray(p.core.A_log)
        tensors[pre + "dt_bias"] = np.asarray(p.core.dt_bias)
        tensors[pre + "norm.weight"] = t["norm_weight"]
        tensors[pre + "out_proj.weight"] = t["out_proj"]
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
