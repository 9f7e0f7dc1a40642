"""What a Hugging Face checkpoint's config.json says, reduced to what the engine and the planner
need: `ModelConfig` (and its MoE and sliding-window fields), read by the one reader of config.json.
`EngineArgs` (args.py) is what the user says; this is what the checkpoint says.
"""

from __future__ import annotations

import json
import math
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tierserve.errors import TierserveError


def text_config(raw: Mapping[str, Any]) -> Mapping[str, Any]:
    """Multimodal checkpoints (Kimi-K2.5, Qwen-VL…) nest the language model's config."""
    nested = raw.get("text_config")
    return nested if isinstance(nested, Mapping) else raw


def read_hf_config(path: str | Path) -> dict[str, Any]:
    """config.json of a checkpoint directory (or the file itself), as a dict."""
    path = Path(path)
    config_path = path / "config.json" if path.is_dir() else path
    if not config_path.exists():
        raise TierserveError(f"no config.json in {path!s}", field="model")
    try:
        raw = json.loads(config_path.read_text())
    except (OSError, ValueError) as err:
        raise TierserveError(f"cannot read {config_path}: {err}", field="model") from err
    if not isinstance(raw, dict):
        raise TierserveError(f"{config_path} is not a JSON object", field="model")
    return raw


# The language model of a multimodal checkpoint whose text_config names no architecture.
TEXT_MODEL_TYPES = {
    "deepseek_v3": "DeepseekV3ForCausalLM",
    "kimi_k2": "DeepseekV3ForCausalLM",  # Kimi-K2.5's text model is Kimi-K2's
    "deepseek_v2": "DeepseekV2ForCausalLM",
}

# Past any real model (the largest have ~100 layers and vocabularies of ~10^6): a larger value
# is a broken config, and refusing it keeps every product of sizes a finite float.
CONFIG_INT_MAX = 2**40
MAX_LAYERS = 10_000  # the deepest real models have ~130
SILU_NAMES = ("silu", "swish")  # transformers' ACT2FN names for it


def config_int(raw: Mapping[str, Any], key: str, default: int | None = None) -> int:
    """An int field of config.json, named in the error when it is missing or wrong."""
    value = raw.get(key)
    if value is None:
        if default is None:
            raise TierserveError(f"model config lacks {key!r}", field=key)
        return default
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= CONFIG_INT_MAX:
        message = f"model config {key!r} must be an int in [0, 2**40], got {value!r}"
        raise TierserveError(message, key)
    return value


def _config_float(raw: Mapping[str, Any], key: str, default: float) -> float:
    value = raw.get(key, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise TierserveError(f"model config {key!r} must be a finite number, got {value!r}", key)
    return float(value)


def _config_of_type(raw: Mapping[str, Any], key: str, kind: type, default: Any) -> Any:
    value = raw.get(key, default)
    if value is None:
        return default
    if not isinstance(value, kind):
        message = f"model config {key!r} must be a {kind.__name__}, got {value!r}"
        raise TierserveError(message, key)
    return value


def routes_to_experts(
    layer: int, first_dense: int, step: int, mlp_only: Collection[int] = (), qwen: bool = False
) -> bool:
    """Whether decoder layer `layer` is a mixture of experts rather than a plain MLP. DeepSeek:
    from first_k_dense_replace on, every moe_layer_freq-th layer; Qwen-MoE: layer i when
    (i + 1) % decoder_sparse_step == 0, unless mlp_only_layers names it."""
    return layer >= first_dense and layer not in mlp_only and (layer + qwen) % step == 0


@dataclass(frozen=True)
class MoEFields:
    """A DeepSeek-style mixture of experts as config.json describes it (V3 and Kimi-K2: sigmoid
    scores, "noaux_tc"; V2: softmax, "greedy" or "group_limited_greedy")."""

    num_experts: int
    top_k: int
    moe_intermediate_size: int
    n_shared_experts: int
    scoring: str
    topk_method: str
    n_group: int
    topk_group: int
    norm_topk_prob: bool
    routed_scaling_factor: float
    first_k_dense_replace: int
    moe_layer_freq: int

    def is_moe_layer(self, layer: int) -> bool:
        return routes_to_experts(layer, self.first_k_dense_replace, self.moe_layer_freq)

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any], architecture: str) -> MoEFields | None:
        experts = config_int(raw, "n_routed_experts", 0)
        if not experts:
            return None
        v3 = architecture != "DeepseekV2ForCausalLM"
        scoring = _config_of_type(raw, "scoring_func", str, "sigmoid" if v3 else "softmax")
        method = _config_of_type(raw, "topk_method", str, "noaux_tc" if v3 else "greedy")
        known = {"sigmoid": ("noaux_tc",), "softmax": ("greedy", "group_limited_greedy")}
        if method not in known.get(scoring, ()):
            message = f"unsupported MoE routing: scoring_func {scoring!r}, topk_method {method!r}"
            raise TierserveError(message, "topk_method")
        fields_ = cls(
            num_experts=experts,
            top_k=config_int(raw, "num_experts_per_tok"),
            moe_intermediate_size=config_int(raw, "moe_intermediate_size"),
            n_shared_experts=config_int(raw, "n_shared_experts", 0),
            scoring=scoring,
            topk_method=method,
            n_group=config_int(raw, "n_group", 1) or 1,
            topk_group=config_int(raw, "topk_group", 1) or 1,
            norm_topk_prob=bool(raw.get("norm_topk_prob", False)),
            routed_scaling_factor=_config_float(raw, "routed_scaling_factor", 1.0),
            first_k_dense_replace=config_int(raw, "first_k_dense_replace", 0),
            moe_layer_freq=config_int(raw, "moe_layer_freq", 1) or 1,
        )
        eligible = fields_.topk_group * (experts // fields_.n_group)
        if experts % fields_.n_group or not 0 < fields_.top_k <= eligible:
            message = (
                f"{experts} routed experts in {fields_.n_group} groups, {fields_.topk_group} "
                f"eligible: cannot pick top {fields_.top_k}"
            )
            raise TierserveError(message, "n_group")
        return fields_


# Layer types of config.json's `layer_types` that attend as the Llama family does.
LAYER_TYPES = ("full_attention", "sliding_attention")


def _layer_windows(raw: Mapping[str, Any], layers: int) -> tuple[int | None, ...]:
    """Each layer's sliding window (keys within `window` positions of the query, itself
    included), None for full attention; as transformers' Mistral, Qwen2 and Qwen3 read it."""
    window = None if raw.get("sliding_window") is None else config_int(raw, "sliding_window")
    if window == 0:  # would leave a query nothing to attend to, not even itself
        raise TierserveError("model config 'sliding_window' must be > 0, got 0", "sliding_window")
    model_type = raw.get("model_type")
    if window is not None and model_type == "mistral":  # transformers' Mistral reads nothing else
        return (window,) * layers
    # Qwen2/3 configs drop the window unless use_sliding_window (which defaults to false).
    use = _config_of_type(raw, "use_sliding_window", bool, model_type not in ("qwen2", "qwen3"))
    if window is None or not use:
        return (None,) * layers
    types = _config_of_type(raw, "layer_types", list, None)
    if types is not None:
        if len(types) != layers or any(t not in LAYER_TYPES for t in types):
            message = f"model config 'layer_types' must be {layers} of {LAYER_TYPES}, got {types!r}"
            raise TierserveError(message, "layer_types")
        return tuple(window if t == "sliding_attention" else None for t in types)
    if "use_sliding_window" in raw:  # an older Qwen config: windows from max_window_layers on
        first = config_int(raw, "max_window_layers", 28)  # transformers' default
        return tuple(window if i >= first else None for i in range(layers))
    return (window,) * layers  # a Mistral-style config: every layer


@dataclass(frozen=True)
class ModelConfig:
    """What a Hugging Face config.json says, reduced to what the engine and the planner need.

    The one reader of config.json: nested `text_config` is unwrapped here, for both."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    tie_word_embeddings: bool
    attention_bias: bool
    qk_norm: bool
    torch_dtype: str | None
    eos_token_ids: tuple[int, ...]
    # MLA (DeepSeek-V2/V3, Kimi-K2): one latent of kv_lora_rank + qk_rope_head_dim per token.
    kv_lora_rank: int = 0
    qk_rope_head_dim: int = 0
    q_lora_rank: int = 0  # 0: queries projected directly (DeepSeek-V2-Lite)
    qk_nope_head_dim: int = 0
    v_head_dim: int = 0
    moe: MoEFields | None = None
    # Per layer: the sliding window in tokens, or None (full attention). Empty: none anywhere.
    layer_windows: tuple[int | None, ...] = ()

    def window(self, layer: int) -> int | None:
        """Layer `layer`'s sliding window, None where it attends to the whole context."""
        return self.layer_windows[layer] if self.layer_windows else None

    @property
    def rope_dim(self) -> int:
        """Dimensions the rotary embedding turns: MLA rotates only its rope part."""
        return self.qk_rope_head_dim if self.kv_lora_rank else self.head_dim

    @property
    def attention(self) -> str:
        if self.kv_lora_rank:
            return "MLA"
        if self.num_kv_heads == self.num_heads:
            return "MHA"
        return "MQA" if self.num_kv_heads == 1 else "GQA"

    @classmethod
    def from_dir(cls, path: str | Path) -> ModelConfig:
        return cls.from_dict(read_hf_config(path))

    @classmethod
    def from_dict(cls, config: Mapping[str, Any]) -> ModelConfig:
        if not isinstance(config, Mapping):
            raise TierserveError("model config is not a JSON object", field="model")
        raw = text_config(config)
        archs = _config_of_type(raw, "architectures", list, None)
        if not archs and raw is not config:  # a nested text model named only by its type
            archs = [TEXT_MODEL_TYPES.get(str(raw.get("model_type")), "")]
        archs = archs or config.get("architectures")
        if not isinstance(archs, list) or not all(isinstance(a, str) for a in archs):
            archs = [""]
        heads = config_int(raw, "num_attention_heads")
        hidden = config_int(raw, "hidden_size")
        layers = config_int(raw, "num_hidden_layers")
        vocab = config_int(raw, "vocab_size", 0)
        positions = config_int(raw, "max_position_embeddings", 2048)
        sizes = {"num_attention_heads": heads, "num_hidden_layers": layers, "hidden_size": hidden,
                 "vocab_size": vocab, "max_position_embeddings": positions}  # fmt: skip
        for key, value in sizes.items():
            # A model of no vocabulary or context served nothing, or crashed in oneDNN.
            if value == 0 and key in raw:  # a vocabulary a plan of the KV alone leaves out
                raise TierserveError(f"model config {key!r} must be > 0", key)
        if layers > MAX_LAYERS:  # a tuple per layer is made before any weight is read
            message = f"model config 'num_hidden_layers' must be at most {MAX_LAYERS:,}"
            raise TierserveError(message, "num_hidden_layers")
        act = raw.get("hidden_act", "silu")
        if act not in SILU_NAMES:  # every model here gates its MLP with SiLU
            message = f"model config hidden_act {act!r} is not supported: tierserve's MLPs use silu"
            raise TierserveError(message, "hidden_act")
        rope = _config_of_type(raw, "rope_parameters", dict, None)
        rope = rope or _config_of_type(raw, "rope_scaling", dict, None) or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        eos = raw.get("eos_token_id", config.get("eos_token_id"))
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        dtype = raw.get("dtype") or raw.get("torch_dtype") or config.get("torch_dtype")
        if config_int(raw, "kv_lora_rank", 0):  # MLA: every head dimension is needed
            for key in ("qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim"):
                if not config_int(raw, key, 0):
                    raise TierserveError(f"an MLA model config needs {key!r} > 0", key)
        return cls(
            architecture=archs[0] if archs else "",
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=config_int(raw, "intermediate_size", 0),
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=config_int(raw, "num_key_value_heads", 0) or heads,
            head_dim=config_int(raw, "head_dim", 0) or hidden // heads,
            rms_norm_eps=_config_float(raw, "rms_norm_eps", 1e-6),
            max_position_embeddings=positions,
            rope_theta=_config_float(rope, "rope_theta", _config_float(raw, "rope_theta", 1e4)),
            rope_scaling=None if rope_type == "default" else {**rope, "rope_type": rope_type},
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            # Qwen2 has biases on q/k/v but says so only through its model type.
            attention_bias=bool(raw.get("attention_bias", raw.get("model_type") == "qwen2")),
            qk_norm=raw.get("model_type") == "qwen3",
            torch_dtype=dtype if isinstance(dtype, str) else None,
            eos_token_ids=tuple(e for e in eos_ids if isinstance(e, int)),
            kv_lora_rank=config_int(raw, "kv_lora_rank", 0),
            qk_rope_head_dim=config_int(raw, "qk_rope_head_dim", 0),
            q_lora_rank=config_int(raw, "q_lora_rank", 0),
            qk_nope_head_dim=config_int(raw, "qk_nope_head_dim", 0),
            v_head_dim=config_int(raw, "v_head_dim", 0),
            moe=MoEFields.from_dict(raw, archs[0] if archs else ""),
            layer_windows=_layer_windows(raw, layers),
        )
