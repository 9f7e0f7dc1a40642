"""The model's building blocks: attention backends over the paged pool, MLA, MoE, parallel
linears, rotary embeddings, the sampler."""

from typing import TYPE_CHECKING

from tierserve.utils import lazy_exports

if TYPE_CHECKING:  # what type checkers and IDEs resolve; at run time each loads on first use
    from tierserve.layers.attention import AttentionBackend
    from tierserve.layers.backends import ATTENTION_BACKENDS, resolve_backend
    from tierserve.layers.cpu_linear import (
        bound_primitive_caches,
        onednn_dtypes,
        packed_head_bytes,
        packs_linears,
    )
    from tierserve.layers.data_parallel import DPAttention, dp_attention, set_dp_attention
    from tierserve.layers.decode_workspace import DecodeWorkspace
    from tierserve.layers.forward_batch import ForwardBatch, SeqSpan, long_tensor, page_table
    from tierserve.layers.mla import MLA, MLAConfig, softmax_scale
    from tierserve.layers.mlp import GatedMLP
    from tierserve.layers.moe import Experts, MoE, MoEConfig
    from tierserve.layers.norm import RMSNorm
    from tierserve.layers.parallel import (
        ColumnParallelLinear,
        PackedColumnLinear,
        ParallelLMHead,
        RowParallelLinear,
        TPGroup,
        VocabParallelEmbedding,
        attention_group,
        building_attention,
        load_unpacked,
        mark_shard,
        pack_for_cpu,
        packed_by_name,
        set_tp_group,
        shard_size,
        shards_by_name,
        tp_group,
    )
    from tierserve.layers.quant_scheme import QuantScheme
    from tierserve.layers.quantized import (
        QuantizedWeight,
        backend_for,
        finalize_quantized,
        held_bytes,
        kernel_activations,
        unpack_int32,
    )
    from tierserve.layers.rotary import RotaryEmbedding, inverse_frequencies, rotary_for
    from tierserve.layers.sampler import (
        Constraint,
        History,
        adjust_logits,
        filtered_probs,
        greedy_tokens,
        sample,
        token_logprobs,
    )

# What outsiders import from this package, and the module that defines each (loaded on
# first use: tierserve/utils/lazy.py).
EXPORTS = {
    "ATTENTION_BACKENDS": "backends",
    "AttentionBackend": "attention",
    "ColumnParallelLinear": "parallel",
    "Constraint": "sampler",
    "DPAttention": "data_parallel",
    "DecodeWorkspace": "decode_workspace",
    "ForwardBatch": "forward_batch",
    "GatedMLP": "mlp",
    "MLA": "mla",
    "MLAConfig": "mla",
    "History": "sampler",
    "MoE": "moe",
    "Experts": "moe",
    "MoEConfig": "moe",
    "PackedColumnLinear": "parallel",
    "QuantScheme": "quant_scheme",
    "QuantizedWeight": "quantized",
    "finalize_quantized": "quantized",
    "backend_for": "quantized",
    "held_bytes": "quantized",
    "kernel_activations": "quantized",
    "unpack_int32": "quantized",
    "ParallelLMHead": "parallel",
    "RMSNorm": "norm",
    "RotaryEmbedding": "rotary",
    "RowParallelLinear": "parallel",
    "SeqSpan": "forward_batch",
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
    "long_tensor": "forward_batch",
    "pack_for_cpu": "parallel",
    "packed_by_name": "parallel",
    "page_table": "forward_batch",
    "bound_primitive_caches": "cpu_linear",
    "onednn_dtypes": "cpu_linear",
    "packs_linears": "cpu_linear",
    "packed_head_bytes": "cpu_linear",
    "set_tp_group": "parallel",
    "mark_shard": "parallel",
    "shard_size": "parallel",
    "shards_by_name": "parallel",
    "softmax_scale": "mla",
    "token_logprobs": "sampler",
    "tp_group": "parallel",
}
__getattr__ = lazy_exports(__name__, EXPORTS)
