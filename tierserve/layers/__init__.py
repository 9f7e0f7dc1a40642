"""The model's building blocks: attention backends over the paged pool, MLA, MoE, parallel
linears, rotary embeddings, the sampler."""

from tierserve.lazy import lazy_exports

# What outsiders import from this package, and the module that defines each (loaded on
# first use: tierserve/lazy.py).
EXPORTS = {
    "ATTENTION_BACKENDS": "backends",
    "AttentionBackend": "attention",
    "ColumnParallelLinear": "parallel",
    "Constraint": "sampler",
    "DPAttention": "data_parallel",
    "DecodeWorkspace": "decode_workspace",
    "ForwardBatch": "batch",
    "GatedMLP": "mlp",
    "MLA": "mla",
    "MLAConfig": "mla",
    "History": "sampler",
    "MoE": "moe",
    "MoEConfig": "moe",
    "PackedColumnLinear": "parallel",
    "ParallelLMHead": "parallel",
    "RMSNorm": "norm",
    "RotaryEmbedding": "rotary",
    "RowParallelLinear": "parallel",
    "SeqSpan": "batch",
    "TPGroup": "parallel",
    "VocabParallelEmbedding": "parallel",
    "adjust_logits": "sampler",
    "attention_group": "parallel",
    "building_attention": "parallel",
    "dp_attention": "data_parallel",
    "resolve_backend": "backends",
    "inverse_frequencies": "rotary",
    "rotary_for": "rotary",
    "filtered_probs": "sampler",
    "greedy_tokens": "sampler",
    "sample": "sampler",
    "set_dp_attention": "data_parallel",
    "load_unpacked": "parallel",
    "long_tensor": "batch",
    "pack_for_cpu": "parallel",
    "packed_by_name": "parallel",
    "page_table": "batch",
    "bound_primitive_caches": "cpu_linear",
    "onednn_dtypes": "cpu_linear",
    "packs_linears": "cpu_linear",
    "packed_head_bytes": "cpu_linear",
    "set_tp_group": "parallel",
    "shard_size": "parallel",
    "shards_by_name": "parallel",
    "softmax_scale": "mla",
    "token_logprobs": "sampler",
    "tp_group": "parallel",
}
__all__ = list(EXPORTS)
__getattr__ = lazy_exports(__name__, EXPORTS)
