"""gdn_jax: Gated DeltaNet (GDN) attention for JAX on CPU.

The whole GDN layer of Qwen3-Next and Qwen3.5 (:class:`GatedDeltaNetLayer`, loaded from
Hugging Face checkpoints by :mod:`gdn_jax.checkpoint`) around an attention core of native XLA
FFI kernels (AVX512-BF16, AVX-512, portable C++; AMX and NEON back ends) chosen at
run time from the CPU's features, and a pure-jnp reference of every op with the same
signatures. See README.md for the contract (shapes, layouts, numerics).
"""
from ._checks import PAD_SLOT_ID, InvalidBatchError
from ._ffi import available_isas, cpu_features, native_available, selected_isa, set_isa, use_isa
from . import batch, paths, reference
from .batch import BatchBuilder, BatchMetadata, HostBatch, Request, build_batch, from_vllm_metadata
from .config import GDNCache, GDNConfig, GDNParams, zeros_pool
from .host_memory import tune_host_malloc
from .ops import (
    copy_slots,
    causal_conv1d_fwd,
    causal_conv1d_update,
    chunk_gated_delta_rule,
    fused_gdn_gating,
    fused_sigmoid_gating_delta_rule_update,
    fused_sigmoid_gating_delta_rule_update_spec,
)

from .paths import GDNAttention, commit_accepted, decode, gdn_attention_core, prefill, spec_decode
from .layer import GatedDeltaNetLayer, GDNLayerConfig, GDNLayerParams
from . import checkpoint, layer
from .checkpoint import CheckpointError, gdn_layer_indices, load_layer_config, load_layer_params, load_layers
from .sharding import ShardedGatedDeltaNetLayer, ShardedGDNAttention, make_mesh

__version__ = "0.1.0"

__all__ = [
    "CheckpointError",
    "GatedDeltaNetLayer",
    "GDNLayerConfig",
    "GDNLayerParams",
    "checkpoint",
    "gdn_layer_indices",
    "layer",
    "load_layer_config",
    "load_layer_params",
    "load_layers",
    "BatchBuilder",
    "BatchMetadata",
    "GDNAttention",
    "GDNCache",
    "GDNConfig",
    "GDNParams",
    "HostBatch",
    "PAD_SLOT_ID",
    "ShardedGDNAttention",
    "ShardedGatedDeltaNetLayer",
    "make_mesh",
    "Request",
    "batch",
    "build_batch",
    "commit_accepted",
    "copy_slots",
    "decode",
    "from_vllm_metadata",
    "gdn_attention_core",
    "paths",
    "prefill",
    "reference",
    "spec_decode",
    "InvalidBatchError",
    "available_isas",
    "causal_conv1d_fwd",
    "causal_conv1d_update",
    "chunk_gated_delta_rule",
    "cpu_features",
    "fused_gdn_gating",
    "fused_sigmoid_gating_delta_rule_update",
    "fused_sigmoid_gating_delta_rule_update_spec",
    "native_available",
    "selected_isa",
    "set_isa",
    "tune_host_malloc",
    "use_isa",
    "zeros_pool",
]
