"""A model's weights as sizing sees them: parameters by component, and bytes by the dtype each
component is stored in.

Quantized checkpoints rarely quantize everything. Kimi-K2-Thinking and K2.5 keep routed experts in
int4 (compressed-tensors, groups of 32 with a bf16 scale each) and attention, shared experts,
dense layers and embeddings in bf16; gpt-oss quantizes only its experts (mxfp4); DeepSeek-V3's
fp8 covers the linear layers but not the embeddings. So parameters are counted in three groups,
each with its own dtype read from `quantization_config`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from tierserve.errors import TierserveError
from tierserve.model_config import ModelConfig, config_int, routes_to_experts, text_config
from tierserve.models import QuantConfig
from tierserve.utils import COMPUTE_DTYPES, DTYPES, format_gb

# Weight dtypes by their short names: the float ones from the one table, and packed integers.
WEIGHT_DTYPE_BYTES: dict[str, float] = {
    **{d.short: float(d.bytes) for d in DTYPES.values()},
    "int8": 1.0,
    "int4": 0.5,
    "fp4": 0.5,
}
GROUPS = ("experts", "other", "embeddings")  # routed experts; everything else; embed + lm_head


# --- parameters ---------------------------------------------------------------------------


def _attention_params(model: ModelConfig) -> int:
    hidden, heads = model.hidden_size, model.num_heads
    if not model.kv_lora_rank:  # MHA/GQA: q, o + k, v
        return (
            2 * hidden * heads * model.head_dim + 2 * hidden * model.num_kv_heads * model.head_dim
        )
    q_rank, nope, v_dim = model.q_lora_rank, model.qk_nope_head_dim, model.v_head_dim
    rope, kv_rank = model.qk_rope_head_dim, model.kv_lora_rank
    q_out = heads * (nope + rope)
    q = q_rank * (hidden + 1 + q_out) if q_rank else hidden * q_out
    kv = hidden * (kv_rank + rope) + kv_rank + kv_rank * heads * (nope + v_dim)
    return q + kv + heads * v_dim * hidden


def _dense_layers(raw: Mapping[str, Any], layers: int) -> int:
    """Layers with a plain MLP rather than experts (DeepSeek's first_k_dense_replace, Qwen-MoE's
    mlp_only_layers and decoder_sparse_step)."""
    first_dense = config_int(raw, "first_k_dense_replace", 0)
    only = raw.get("mlp_only_layers") or ()
    if not isinstance(only, list | tuple) or not all(isinstance(i, int) for i in only):
        message = f"model config 'mlp_only_layers' must be a list of ints, got {only!r}"
        raise TierserveError(message, "mlp_only_layers")
    qwen = "decoder_sparse_step" in raw
    step = config_int(raw, "decoder_sparse_step" if qwen else "moe_layer_freq", 1) or 1
    return sum(not routes_to_experts(i, first_dense, step, only, qwen) for i in range(layers))


def _num_experts(raw: Mapping[str, Any]) -> int:
    keys = ("n_routed_experts", "num_experts", "num_local_experts")
    return next((config_int(raw, k) for k in keys if raw.get(k)), 0)


@dataclass(frozen=True)
class _MLPShape:
    """A config's MLP side: dense layers, routed and shared experts."""

    hidden: int
    layers: int
    inter: int
    experts: int  # routed experts per MoE layer (0: a dense model)
    dense: int  # layers with a plain MLP
    expert_inter: int
    shared: int  # shared experts' intermediate size, all together

    @classmethod
    def of(cls, config: Mapping[str, Any]) -> _MLPShape:
        raw, model = text_config(config), ModelConfig.from_dict(config)
        layers, inter = model.num_layers, model.intermediate_size
        experts = _num_experts(raw)
        dense = layers if not experts else _dense_layers(raw, layers)
        expert_inter = config_int(raw, "moe_intermediate_size", 0) or inter
        shared = config_int(raw, "n_shared_experts", 0) * expert_inter
        shared += config_int(raw, "shared_expert_intermediate_size", 0)
        return cls(model.hidden_size, layers, inter, experts, dense, expert_inter, shared)

    @property
    def moe_layers(self) -> int:
        return self.layers - self.dense

    @property
    def dense_params(self) -> int:
        """The dense MLP layers' and the shared experts' parameters."""
        return 3 * self.hidden * (self.dense * self.inter + self.moe_layers * self.shared)


def parameter_groups(config: Mapping[str, Any]) -> dict[str, int]:
    """Parameters from config.json alone, by group (within ~1% of published totals for the
    presets). Leaves out biases and MTP layers."""
    model = ModelConfig.from_dict(config)
    if model.vocab_size == 0:
        raise TierserveError("model config lacks 'vocab_size'", field="vocab_size")
    mlp = _MLPShape.of(config)
    hidden, layers = mlp.hidden, mlp.layers
    other = layers * (_attention_params(model) + 2 * hidden)  # two RMSNorms a layer
    other += mlp.dense_params + mlp.moe_layers * mlp.experts * hidden  # + the routers
    embeddings = model.vocab_size * hidden * (1 if model.tie_word_embeddings else 2)
    return {
        "experts": mlp.moe_layers * mlp.experts * 3 * hidden * mlp.expert_inter,
        "other": other + hidden,  # + the final norm
        "embeddings": embeddings,
    }


def estimate_parameters(config: Mapping[str, Any]) -> int:
    return sum(parameter_groups(config).values())


# --- dtypes -------------------------------------------------------------------------------


def _base_dtype(raw: Mapping[str, Any]) -> str:
    dtype = str(raw.get("torch_dtype") or raw.get("dtype") or "bfloat16")
    return DTYPES[dtype].short if dtype in COMPUTE_DTYPES else "bf16"


def checkpoint_dtypes(config: Mapping[str, Any]) -> dict[str, str]:
    """The dtype of each parameter group, from `quantization_config` (else `torch_dtype`).
    A dtype may carry its per-group scale overhead, e.g. "int4/g32"."""
    raw = text_config(config)
    base = _base_dtype(raw)
    quant = raw.get("quantization_config") or {}
    if not isinstance(quant, Mapping):
        raise TierserveError("model config 'quantization_config' must be an object")
    method = str(quant.get("quant_method", "")).lower()
    weights = _object(_object(_object(quant, "config_groups"), "group_0"), "weights")
    bits = _positive_int(quant.get("bits")) or _positive_int(weights.get("num_bits"))
    group_size = _positive_int(weights.get("group_size"))
    if method == "mxfp4":  # gpt-oss: experts only, 32-value blocks with an 8-bit scale
        return {"experts": "int4/g32", "other": base, "embeddings": base}
    if method == "fp8":
        return {"experts": "fp8", "other": "fp8", "embeddings": base}
    if method == "compressed-tensors":
        read = _compressed_tensors(raw, base)
        if read is not None:
            return read
    if method and bits in (4, 8):
        low = ("int4" if bits == 4 else "int8") + (f"/g{group_size}" if group_size else "")
        # compressed-tensors lists what it leaves alone; attention left alone means only the
        # experts (and any other MLP it does not ignore) are quantized.
        ignore = quant.get("ignore")
        ignored = " ".join(map(str, ignore)) if isinstance(ignore, list | tuple) else ""
        other = base if "attn" in ignored else low
        return {"experts": low, "other": other, "embeddings": base}
    return dict.fromkeys(GROUPS, base)


# Names the loader matches `ignore` and `targets` against, for each group the plan sizes.
_REPRESENTATIVE = {
    "experts": "model.layers.1.mlp.experts.0.gate_proj",
    "other": "model.layers.0.self_attn.o_proj",
}


def _compressed_tensors(raw: Mapping[str, Any], base: str) -> dict[str, str] | None:
    """Each group's dtype as the loader reads the config: its ignore list and targets
    (models/quantization.py), so a plan and a start agree on what is quantized. None where
    tierserve would not load it (an nvfp4 group, a config without targets): the plan still
    sizes it for another engine, by the estimate below."""
    try:
        quant = QuantConfig.read(raw)
    except TierserveError:
        return None
    dtypes = {"embeddings": base}
    for group, name in _REPRESENTATIVE.items():
        scheme = quant.scheme_for(name) if quant is not None else None
        if scheme is None:
            dtypes[group] = base
            continue
        size = f"/g{scheme.group_size}" if scheme.group_size else ""
        dtypes[group] = f"int{scheme.num_bits}{size}"
    return dtypes


def _object(parent: Mapping[str, Any], key: str) -> Mapping[str, Any]:
    """A nested object of quantization_config, or {} when it is absent or not an object."""
    value = parent.get(key)
    return value if isinstance(value, Mapping) else {}


def _positive_int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def dtype_bytes(dtype: str) -> float:
    """Bytes per parameter, with a group scale ("int4/g32": one bf16 scale per 32 values)."""
    name, _, group = dtype.partition("/g")
    if name not in WEIGHT_DTYPE_BYTES:
        known = ", ".join(WEIGHT_DTYPE_BYTES)
        raise TierserveError(f"unknown weight dtype {name!r}; known: {known}", "weight_dtype")
    return WEIGHT_DTYPE_BYTES[name] + (2 / int(group) if group else 0)


# --- the model as sizing sees it ------------------------------------------------------------


@dataclass(frozen=True)
class ModelSpec:
    """A model as sizing sees it: KV shape and the bytes of its weights (all ranks together)."""

    name: str
    config: ModelConfig
    weight_bytes: int
    weight_note: str  # where weight_bytes came from, for the reader of the plan
    path: str = ""  # what a server's --model flag should say (HF id or local directory)
    # Of weight_bytes: the attention layers and the embeddings, which data-parallel attention
    # keeps once per attention group (the MLPs and experts stay split over every rank)...
    attention_bytes: int = 0
    # ...and the dense MLPs and shared experts, which vLLM's data parallelism also keeps once
    # per engine (only its routed experts span every worker).
    dense_mlp_bytes: int = 0
    # The multi-token-prediction layers a speculative server adds (num_nextn_predict_layers),
    # not in weight_bytes: their embedding and head are the model's own.
    mtp_bytes: int = 0


def model_spec(
    name: str,
    config: Mapping[str, Any],
    num_parameters: int | None = None,
    weight_dtype: str | None = None,
    weights: int | None = None,
) -> ModelSpec:
    """ModelSpec from config.json. `weights` (bytes, e.g. the checkpoint's size) wins; else the
    parameter groups, scaled to `num_parameters` when the published count is known, each in its
    dtype (`weight_dtype` puts every group in one)."""
    model = ModelConfig.from_dict(config)
    groups = parameter_groups(config)
    total = sum(groups.values())
    scale = num_parameters / total if num_parameters else 1.0
    dtypes: dict[str, str] = (
        dict.fromkeys(GROUPS, weight_dtype) if weight_dtype else checkpoint_dtypes(config)
    )
    size = int(sum(groups[g] * scale * dtype_bytes(dtypes[g]) for g in GROUPS))
    attention = model.num_layers * _attention_params(model) * dtype_bytes(dtypes["other"])
    attention = int((attention + groups["embeddings"] * dtype_bytes(dtypes["embeddings"])) * scale)
    dense = int(_MLPShape.of(config).dense_params * dtype_bytes(dtypes["other"]) * scale)
    mtp = int(_mtp_bytes(config, dtypes))
    if weights is not None:  # the same shares of the bytes given
        shares = [int(weights * part / size) if size else 0 for part in (attention, dense)]
        note = f"{format_gb(weights)} as given"
        return ModelSpec(name, model, weights, note, "", *shares, mtp_bytes=mtp)
    parts = [f"{groups[g] * scale / 1e9:,.1f}B {g} × {dtypes[g]}" for g in GROUPS if groups[g]]
    return ModelSpec(name, model, size, ", ".join(parts), "", attention, dense, mtp)


def _mtp_bytes(config: Mapping[str, Any], dtypes: Mapping[str, str]) -> float:
    """DeepSeek-V3's MTP layers: each `eh_proj`, three norms and a decoder layer with experts
    (as the model's last layer has them)."""
    layers = config_int(text_config(config), "num_nextn_predict_layers", 0)
    if not layers:
        return 0.0
    model, mlp = ModelConfig.from_dict(config), _MLPShape.of(config)
    hidden = model.hidden_size
    other = 2 * hidden * hidden + 5 * hidden + _attention_params(model)
    if mlp.experts:
        experts = mlp.experts * 3 * hidden * mlp.expert_inter
        other += 3 * hidden * mlp.shared + mlp.experts * hidden
    else:
        experts, other = 0, other + 3 * hidden * mlp.inter
    each = experts * dtype_bytes(dtypes["experts"]) + other * dtype_bytes(dtypes["other"])
    return layers * each
