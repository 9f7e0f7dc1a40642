"""Engine configuration: one frozen dataclass behind both the CLI flags and `LLM(**kwargs)`.

Every field of `EngineArgs` is a command-line flag (`page_size` <-> `--page-size`) and a keyword
argument of `LLM`; `add_cli_args` and `from_cli` derive the parser from the fields, so the two
cannot drift apart. `EngineArgs` is what the user said; `ModelConfig` is what the checkpoint says.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from tierserve.dtypes import COMPUTE_DTYPES, canonical
from tierserve.errors import TierserveError

DEMO_MODEL_DIR = Path(__file__).parent / "demo_model"


def check_mem_fraction(fraction: float, field: str = "mem_fraction_static", who: str = "") -> None:
    """--mem-fraction-static is a fraction of the card in (0, 1), in tierserve as in SGLang."""
    if not 0 < fraction < 1:  # NaN fails this too
        message = f"{who}mem_fraction_static must be in (0, 1), got {fraction}"
        raise TierserveError(message, field=field)


def default_model() -> str | None:
    """The bundled demo model, when the package ships one."""
    return str(DEMO_MODEL_DIR) if (DEMO_MODEL_DIR / "config.json").exists() else None


def _flag(help: str, **kw: Any) -> Any:
    return {"help": help, **kw}


@dataclass(frozen=True)
class EngineArgs:
    model: str | None = field(
        default=None,
        metadata=_flag(
            "local Hugging Face checkpoint directory (default: the bundled demo model)",
            aliases=["--model-path"],  # SGLang's name
        ),
    )
    tokenizer: str | None = field(
        default=None, metadata=_flag("tokenizer directory (default: the model directory)")
    )
    dtype: str = field(
        default="auto",
        metadata=_flag(
            "weight and KV dtype; auto = float32 on CPU, the checkpoint's dtype on CUDA",
            choices=["auto", *COMPUTE_DTYPES],
        ),
    )
    device: str = field(
        default="auto",
        metadata=_flag("auto = cuda when available", choices=["auto", "cpu", "cuda"]),
    )
    kv_cache_dtype: str = field(
        default="auto",
        metadata=_flag(
            "what every KV tier stores: auto (the model's dtype), bf16, fp16, fp32, fp8_e4m3, "
            "fp8_e5m2 (fp8 = fp8_e4m3, vLLM's name); attention computes in the model's dtype"
        ),
    )
    page_size: int = field(default=16, metadata=_flag("tokens per KV page"))
    max_total_tokens: int | None = field(
        default=None,
        metadata=_flag(
            "device KV pool size in tokens per rank (all requests together); default: derived "
            "from --mem-fraction-static (on CPU: 32768)"
        ),
    )
    mem_fraction_static: float = field(
        default=0.85,
        metadata=_flag("CUDA: fraction of GPU memory for weights + KV pool (as in SGLang)"),
    )
    max_running_requests: int = field(
        default=256,
        metadata=_flag("most requests running (decoded together) at once"),
    )
    chunked_prefill_size: int = field(
        default=2048,
        metadata=_flag("most prompt tokens prefilled in one step; -1 disables chunking"),
    )
    context_length: int | None = field(
        default=None,
        metadata=_flag(
            "the longest request, prompt + output (default: the model's max_position_embeddings)"
        ),
    )
    disable_radix_cache: bool = field(
        default=False, metadata=_flag("turn off prefix sharing between requests")
    )
    enable_hierarchical_cache: bool = field(
        default=False, metadata=_flag("keep KV evicted from the device in a host-RAM tier")
    )
    hicache_ratio: float = field(
        default=2.0,
        metadata=_flag("host tier tokens = this × device pool tokens (used when no size is given)"),
    )
    hicache_size: str | None = field(
        default=None,
        metadata=_flag(
            "host tier size PER RANK, as in SGLang (48GB, 48GiB, 0.5TB; a bare number is "
            "decimal GB), or 'auto' = (available RAM − overhead − margin) / local ranks"
        ),
    )
    hicache_node_size: str | None = field(
        default=None,
        metadata=_flag(
            "host tier size for ALL local ranks together, split evenly (units as above)"
        ),
    )
    hicache_write_policy: str = field(
        default="write_through",
        metadata=_flag(
            "when KV is copied to the host",
            choices=["write_through", "write_through_selective", "write_back"],
        ),
    )
    disable_shared_host_copy: bool = field(
        default=False,
        metadata=_flag(
            "keep one host tier per rank even where ranks hold identical KV (MLA latents, "
            "KV heads replicated when tp > kv_heads); by default such ranks share one copy"
        ),
    )
    hicache_storage_backend: str | None = field(
        default=None,
        metadata=_flag(
            "storage tier under the host tier: file (a local directory several servers may "
            "share, kept across restarts) or mooncake (Mooncake Store); off by default"
        ),
    )
    hicache_storage_backend_extra_config: str | None = field(
        default=None,
        metadata=_flag(
            'JSON for the storage backend and tier, e.g. \'{"path": "/data/kv", '
            '"max_bytes": "200GB"}\' (docs/kv-cache.md lists the keys)'
        ),
    )
    hicache_storage_prefetch_policy: str = field(
        default="best_effort",
        metadata=_flag(
            "how long a request waits for its prefix to be fetched from storage",
            choices=["best_effort", "wait_complete", "timeout"],
        ),
    )
    attention_backend: str = field(
        default="torch", metadata=_flag("attention kernel backend", choices=["torch"])
    )
    seed: int = field(default=0, metadata=_flag("seed for requests that do not give their own"))
    tp_size: int = field(
        default=1,
        metadata=_flag(
            "tensor-parallel ranks (one process each; gloo on CPU, NCCL on CUDA)",
            aliases=["--tp"],
        ),
    )
    nnodes: int = field(default=1, metadata=_flag("nodes the --tp-size ranks span (as SGLang)"))
    node_rank: int = field(default=0, metadata=_flag("this node's index among --nnodes"))
    dist_init_addr: str | None = field(
        default=None,
        metadata=_flag(
            "HOST:PORT of node 0 where the ranks meet (default: 127.0.0.1 and a free port, "
            "one node only)"
        ),
    )

    def __post_init__(self) -> None:
        if self.kv_cache_dtype != "auto":
            canonical(self.kv_cache_dtype, field="kv_cache_dtype", what="KV dtype")
        positive = {
            "page_size": self.page_size,
            "max_running_requests": self.max_running_requests,
        }
        if self.max_total_tokens is not None:
            positive["max_total_tokens"] = self.max_total_tokens
        if self.context_length is not None:
            positive["context_length"] = self.context_length
        for name, value in positive.items():
            if value <= 0:
                raise TierserveError(f"{name} must be > 0, got {value}", field=name)
        if self.chunked_prefill_size == 0 or self.chunked_prefill_size < -1:
            raise TierserveError(
                f"chunked_prefill_size must be > 0 or -1 (off), got {self.chunked_prefill_size}",
                field="chunked_prefill_size",
            )
        if self.hicache_size is not None and self.hicache_node_size is not None:
            raise TierserveError(
                "give --hicache-size (per rank) or --hicache-node-size (per node), not both",
                field="hicache_size",
            )
        if not (0 < self.hicache_ratio < 1e6):  # also refuses nan and inf
            raise TierserveError(
                f"hicache_ratio must be a number in (0, 1e6), got {self.hicache_ratio}",
                field="hicache_ratio",
            )
        host_flags = {
            "hicache_size": self.hicache_size,
            "hicache_node_size": self.hicache_node_size,
            "hicache_ratio": None if self.hicache_ratio == 2.0 else self.hicache_ratio,
            "hicache_write_policy": (
                None if self.hicache_write_policy == "write_through" else self.hicache_write_policy
            ),
            "hicache_storage_backend": self.hicache_storage_backend,
            "hicache_storage_backend_extra_config": self.hicache_storage_backend_extra_config,
        }
        given = [name for name, value in host_flags.items() if value is not None]
        if given and not self.enable_hierarchical_cache:
            # Refused rather than ignored: a user who sized a host tier believes they have one.
            flag = "--" + given[0].replace("_", "-")
            raise TierserveError(
                f"{flag} sizes the host tier, which is off: add --enable-hierarchical-cache",
                field=given[0],
            )
        self._check_distributed()
        check_mem_fraction(self.mem_fraction_static)

    def _check_distributed(self) -> None:
        for name in ("tp_size", "nnodes"):
            if getattr(self, name) <= 0:
                raise TierserveError(f"{name} must be > 0, got {getattr(self, name)}", name)
        if self.tp_size % self.nnodes:
            message = f"tp_size {self.tp_size} does not split evenly over {self.nnodes} nodes"
            raise TierserveError(message, "nnodes")
        if not 0 <= self.node_rank < self.nnodes:
            message = f"node_rank must be in [0, {self.nnodes}), got {self.node_rank}"
            raise TierserveError(message, "node_rank")
        if self.tp_size > 1 and self.hicache_storage_backend is not None:
            message = "the storage tier does not run with --tp-size > 1 yet"
            raise TierserveError(message, "hicache_storage_backend")
        if self.nnodes > 1 and self.dist_init_addr is None:
            message = "several nodes meet at --dist-init-addr HOST:PORT (node 0's address)"
            raise TierserveError(message, "dist_init_addr")

    @property
    def local_ranks(self) -> int:
        """Ranks on this node: they share its host RAM."""
        return self.tp_size // self.nnodes

    @classmethod
    def from_kwargs(cls, model: str | None, **kwargs: Any) -> EngineArgs:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise TierserveError(
                f"unknown engine argument(s) {unknown}; known: {sorted(known)}", field=unknown[0]
            )
        return cls(model=model, **kwargs)

    @staticmethod
    def add_cli_args(
        parser: argparse.ArgumentParser,
        only: tuple[str, ...] | None = None,
        defaults: Mapping[str, Any] | None = None,
    ) -> None:
        """The engine's flags, one definition for `serve`, `batch`, `LLM(**kw)` and, for the
        ones it shares (`only`, with its own `defaults`), `plan`."""
        for f in fields(EngineArgs):
            if only is not None and f.name not in only:
                continue
            meta = dict(f.metadata)
            default = (defaults or {}).get(f.name, f.default)
            flags = ["--" + f.name.replace("_", "-"), *meta.pop("aliases", [])]
            if f.type in ("bool", bool):
                parser.add_argument(*flags, action="store_true", help=meta["help"])
                continue
            kind = {"int": int, "float": float}.get(str(f.type).split(" ")[0], str)
            parser.add_argument(*flags, type=kind, default=default, dest=f.name, **meta)

    @classmethod
    def from_cli(cls, ns: argparse.Namespace) -> EngineArgs:
        return cls(**{f.name: getattr(ns, f.name) for f in fields(cls)})

    def replace(self, **changes: Any) -> EngineArgs:
        return dataclasses.replace(self, **changes)


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
        return layer >= self.first_k_dense_replace and layer % self.moe_layer_freq == 0

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
        for key, value in (("num_attention_heads", heads), ("num_hidden_layers", layers)):
            if value == 0:
                raise TierserveError(f"model config {key!r} must be > 0", key)
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
            vocab_size=config_int(raw, "vocab_size", 0),
            hidden_size=hidden,
            intermediate_size=config_int(raw, "intermediate_size", 0),
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=config_int(raw, "num_key_value_heads", 0) or heads,
            head_dim=config_int(raw, "head_dim", 0) or hidden // heads,
            rms_norm_eps=_config_float(raw, "rms_norm_eps", 1e-6),
            max_position_embeddings=config_int(raw, "max_position_embeddings", 2048),
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
