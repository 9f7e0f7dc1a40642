"""Engine configuration: one frozen dataclass behind both the CLI flags and `LLM(**kwargs)`.

Every field of `EngineArgs` is a command-line flag (`page_size` <-> `--page-size`) and a keyword
argument of `LLM`; `add_cli_args` and `from_cli` derive the parser from the fields, so the two
cannot drift apart. `EngineArgs` is what the user said; `ModelConfig` (model_config.py) is what
the checkpoint says. One thing at some length: the one dataclass, each flag with its help text
and its check.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from tierserve.errors import TierserveError
from tierserve.utils import COMPUTE_DTYPES, canonical

DEMO_MODEL_DIR = Path(__file__).parent / "demo_model"
# SGLang's --load-balance-method values that place requests on attention groups, and the
# prefix-affinity rule sglang-router calls cache_aware (engine/dispatch.py implements them).
LOAD_BALANCE_METHODS = ("cache_aware", "round_robin", "total_requests", "total_tokens")


def check_mem_fraction(
    fraction: float,
    field: str = "mem_fraction_static",
    who: str = "",
    name: str = "mem_fraction_static",
    one_allowed: bool = False,
) -> None:
    """--mem-fraction-static is a fraction of the card in (0, 1), in tierserve as in SGLang;
    SGLang's --hicache-host-memory-fraction may also be 1 (`one_allowed`)."""
    if not (0 < fraction <= 1 if one_allowed else 0 < fraction < 1):  # NaN fails this too
        interval = "(0, 1]" if one_allowed else "(0, 1)"
        raise TierserveError(f"{who}{name} must be in {interval}, got {fraction}", field=field)


def check_host_ratio(ratio: float, name: str = "hicache_ratio") -> None:
    """The host tier's size as a multiple of the device pool's: serve's --hicache-ratio,
    plan's --host-ratio."""
    if not (0 < ratio < 1e6):  # also refuses nan and inf
        message = f"{name} must be a number in (0, 1e6), got {ratio}"
        raise TierserveError(message, field=name)


# Drafted tokens per step unless the line says (tierserve's chain; SGLang's 5 is a tree's).
SPEC_STEPS = 3
# The longest chain served. Each drafted token is one more draft forward per step, spent
# before any is verified: 1,000 steps made a 2-token request take 20 s. A chain keeps its
# k-th token with probability a^k (a: the per-token acceptance, 0.8 at best in practice),
# so tokens past 32 add under 0.1% to what a step keeps; SGLang's and vLLM's recipes use 1-7.
MAX_SPEC_STEPS = 32


def check_speculative_steps(steps: int) -> None:
    """--speculative-num-steps, as serve and plan read it."""
    if steps < 1:
        message = f"--speculative-num-steps must be >= 1, got {steps}"
        raise TierserveError(message, "speculative_num_steps")


MAX_RANKS = 65_536  # past any cluster; larger counts overflowed the placement's tables


def ranks_per_node(ranks: int, nnodes: int, what: str) -> int:
    """Ranks on each of `nnodes` nodes: they split evenly, in tierserve as in SGLang."""
    if nnodes <= 0 or ranks % nnodes:
        message = f"{what} {ranks} does not split evenly over --nnodes {nnodes}"
        raise TierserveError(message, "nnodes")
    return ranks // nnodes


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
    quantized_activations: str = field(
        default="auto",
        metadata=_flag(
            "what a quantized checkpoint's int4 GEMMs take in: auto = bf16 (torch's int4 CPU "
            "kernel vectorises bf16 only; float32 runs a scalar path 20-80x slower), model = "
            "the model's dtype (exact to its rounding: how tests compare with transformers)",
            choices=["auto", "model"],
        ),
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
        metadata=_flag(
            "most requests running (decoded together) at once; with --enable-dp-attention "
            "for the node, each attention group taking an equal share (as SGLang)"
        ),
    )
    chunked_prefill_size: int = field(
        default=2048,
        metadata=_flag(
            "most tokens in a step that prefills: its prompt chunks plus the decode rows beside "
            "them (as SGLang's mixed chunks count them), at least half for prompts; -1 disables "
            "chunking (default 2048; the offline LLM's on a CPU-only host: 4096 × tp_size, "
            "vLLM's offline CPU default)"
        ),
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
        default="auto",
        metadata=_flag(
            "how long a request waits for its prefix to be fetched from storage (auto: while "
            "reading is estimated faster than recomputing, idle engine or not)",
            choices=["auto", "best_effort", "wait_complete", "timeout"],
        ),
    )
    hicache_io_backend: str = field(
        default="kernel",
        metadata=_flag(
            "SGLang's host-device copy method; both copy whole page runs here: a page-major "
            "page is one contiguous block, with no layers to gather (docs/kv-cache.md)",
            choices=["kernel", "direct"],
        ),
    )
    hicache_mem_layout: str = field(
        default="page_first",
        metadata=_flag(
            "the host tier's layout as SGLang names it: tierserve's pools are page-major "
            "(page_first; page_first_direct is the same here); layer_first is refused",
            choices=["layer_first", "page_first", "page_first_direct"],
        ),
    )
    attention_backend: str = field(
        default="auto",
        metadata=_flag(
            "attention kernels: cpu (paged C++ kernel, CPU only; built by make or on first "
            "use), torch (SDPA over gathered KV; the oracle); auto = cpu on CPU when built, "
            "else torch",
            choices=["auto", "cpu", "torch"],
        ),
    )
    seed: int = field(default=0, metadata=_flag("seed for requests that do not give their own"))
    tp_size: int = field(
        default=1,
        metadata=_flag(
            "tensor-parallel ranks (one process each; gloo on CPU, NCCL on CUDA)",
            aliases=["--tp"],
        ),
    )
    skip_server_warmup: bool = field(
        default=False,
        metadata=_flag(
            "serve without the warm-up (as SGLang's flag): by default the largest decode step "
            "the pool holds and one prefill chunk run before /health answers 200 (the offline "
            "LLM skips it unless asked)"
        ),
    )
    disable_custom_all_reduce: bool = field(
        default=False,
        metadata=_flag(
            "accepted for SGLang's command lines: tierserve has no custom all-reduce, only "
            "torch.distributed's (gloo on CPU, NCCL on CUDA)"
        ),
    )
    num_continuous_decode_steps: int = field(
        default=1,
        metadata=_flag(
            "decode steps run back to back before the engine reads new requests and sends "
            "the tokens (as SGLang): fewer messages per token, tokens streamed N at a time"
        ),
    )
    cpu_omp_threads_bind: str = field(
        default="auto",
        metadata=_flag(
            "CPU cores of each local rank's torch threads, as vLLM's VLLM_CPU_OMP_THREADS_BIND: "
            "auto (CPU-only hosts: the ranks split the cores the process may use, one thread "
            "a core; a GPU host pins nothing), nobind (the off switch), or one list per rank, "
            "0-3|4-7 (the other cores go to the API process); docs/cpu-placement.md"
        ),
    )
    cpu_reserved_cores: int | None = field(
        default=None,
        metadata=_flag(
            "with --cpu-omp-threads-bind auto, cores kept from the ranks for the API process, "
            "its grammar workers and tokenization (as vLLM's VLLM_CPU_NUM_OF_RESERVED_CPU); "
            "default: 1 when serving and every rank keeps at least 2 cores, else 0"
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
    hidden_states_dir: str | None = field(
        default=None,
        metadata=_flag(
            "write every request's prompt hidden states (the --hidden-states-layers and the "
            "final norm's input) to DIR as safetensors, as vLLM's extract_hidden_states does "
            "(EAGLE-3 training data); the path comes back with the request"
        ),
    )
    hidden_states_layers: str | None = field(
        default=None,
        metadata=_flag(
            "comma-separated layer ids to capture, as vLLM counts them (k: the output of "
            "decoder layer k-1; 0 the embeddings); default 2, L/2, L-3"
        ),
    )
    enable_dp_attention: bool = field(
        default=False,
        metadata=_flag(
            "data-parallel attention (as SGLang): --dp-size attention groups of "
            "tp/dp ranks, each with its own requests, scheduler and KV pools; the MLP and MoE "
            "layers stay tensor-parallel over all --tp-size ranks"
        ),
    )
    dp_size: int = field(
        default=1,
        metadata=_flag(
            "attention groups, with --enable-dp-attention (must divide --tp-size); "
            "without it, replicas belong behind a router (docs/distributed.md)",
            aliases=["--dp", "--data-parallel-size"],
        ),
    )
    load_balance_method: str = field(
        default="cache_aware",
        metadata=_flag(
            "how rank 0 places a request on an attention group: cache_aware (the group "
            "whose cache holds its longest prefix, unless the groups are out of balance, "
            "as sglang-router), round_robin, total_requests, total_tokens",
            choices=list(LOAD_BALANCE_METHODS),
        ),
    )

    speculative_algorithm: str | None = field(
        default=None,
        metadata=_flag(
            "speculative decoding (as SGLang): NGRAM drafts from the request's own tokens "
            "(prompt lookup), EAGLE3 drafts from a draft model over the target's hidden "
            "states, NEXTN from DeepSeek-V3's own MTP layer (EAGLE: NEXTN for a model that "
            "ships one and no draft is given, as SGLang; else EAGLE3); one target forward "
            "verifies them. Greedy output is unchanged; sampled output keeps its distribution "
            "(rejection sampling)",
            choices=["EAGLE3", "EAGLE", "NEXTN", "NGRAM"],
        ),
    )
    speculative_draft_model_path: str | None = field(
        default=None,
        metadata=_flag(
            "the EAGLE3 draft's directory (speculators' or SGLang's format); unset, the "
            "draft shipped for the bundled demo model, for that model only"
        ),
    )
    speculative_num_steps: int | None = field(
        default=None,
        metadata=_flag(
            "tokens drafted per step (default 3; SGLang picks 5 for Llama, with a tree)"
        ),
    )
    speculative_eagle_topk: int | None = field(
        default=None,
        metadata=_flag("branches per draft step: 1, a chain (default; SGLang: 4, a tree)"),
    )
    speculative_num_draft_tokens: int | None = field(
        default=None,
        metadata=_flag(
            "tokens a step verifies per request, its last known token included: "
            "--speculative-num-steps + 1 for a chain (default 4; SGLang picks 8, a tree)"
        ),
    )
    speculative_ngram_min_match_window_size: int = field(
        default=1, metadata=_flag("NGRAM: the shortest suffix looked up in the request")
    )
    speculative_ngram_max_match_window_size: int = field(
        default=12, metadata=_flag("NGRAM: the longest suffix looked up (the longest match wins)")
    )
    speculative_config: str | None = field(
        default=None,
        metadata=_flag(
            'vLLM\'s form of the above as JSON: {"method": "ngram", "num_speculative_tokens": '
            '3, "prompt_lookup_min": 1, "prompt_lookup_max": 4} (method eagle3 takes "model")'
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
        if not 0 <= self.seed < 2**63:  # torch's generators take a signed 64-bit seed
            raise TierserveError(f"seed must be in [0, 2**63), got {self.seed}", field="seed")
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
        check_host_ratio(self.hicache_ratio)
        host_flags = {
            "hicache_size": self.hicache_size,
            "hicache_node_size": self.hicache_node_size,
            "hicache_ratio": None if self.hicache_ratio == 2.0 else self.hicache_ratio,
            "hicache_write_policy": (
                None if self.hicache_write_policy == "write_through" else self.hicache_write_policy
            ),
            "hicache_storage_backend": self.hicache_storage_backend,
            "hicache_storage_backend_extra_config": self.hicache_storage_backend_extra_config,
            "hicache_storage_prefetch_policy": (
                None
                if self.hicache_storage_prefetch_policy == "auto"
                else self.hicache_storage_prefetch_policy
            ),
            "hicache_io_backend": None if self.hicache_io_backend == "kernel" else "direct",
            "hicache_mem_layout": (
                None if self.hicache_mem_layout == "page_first" else self.hicache_mem_layout
            ),
        }
        given = [name for name, value in host_flags.items() if value is not None]
        if given and not self.enable_hierarchical_cache:
            # Refused rather than ignored: a user who sized a host tier believes they have one.
            flag = "--" + given[0].replace("_", "-")
            raise TierserveError(
                f"{flag} configures the host tier, which is off: add --enable-hierarchical-cache",
                field=given[0],
            )
        if self.hicache_mem_layout == "layer_first":
            raise TierserveError(
                "--hicache-mem-layout layer_first is not built: tierserve's pools are "
                "page-major (SGLang's page_first), a page's every layer in one block that the "
                "host tier copies, the storage tier stores and the shared host copy maps as "
                "one; use page_first (the default here)",
                field="hicache_mem_layout",
            )
        self._check_distributed()
        self._check_speculative()
        steps = self.num_continuous_decode_steps
        if steps < 1:
            message = f"num_continuous_decode_steps must be >= 1, got {steps}"
            raise TierserveError(message, "num_continuous_decode_steps")
        if steps > 1 and self.enable_dp_attention:
            raise TierserveError(
                "--num-continuous-decode-steps > 1 with --enable-dp-attention is not built: "
                "rank 0 sees the other groups' queues only once a step",
                field="num_continuous_decode_steps",
            )
        if steps > 1 and self.speculative_algorithm is not None:
            raise TierserveError(
                "--num-continuous-decode-steps > 1 with speculative decoding is not built: "
                "each step verifies the draft the step before proposed, through the scheduler",
                field="num_continuous_decode_steps",
            )
        check_mem_fraction(self.mem_fraction_static)
        if self.hidden_states_dir is not None and not self.hidden_states_dir.strip():
            # An empty path would resolve to the working directory only at the first write.
            message = "--hidden-states-dir needs a directory, got an empty path"
            raise TierserveError(message, "hidden_states_dir")
        if self.hidden_states_layers is not None and self.hidden_states_dir is None:
            message = "--hidden-states-layers chooses what --hidden-states-dir captures: give both"
            raise TierserveError(message, "hidden_states_layers")

    def _check_speculative(self) -> None:
        """vLLM's JSON becomes the SGLang flags; then the chain's sizes agree and the parts
        not built yet are refused by name."""
        vllm = self.speculative_config is not None
        if vllm:
            for name, value in vllm_speculative_config(self).items():
                object.__setattr__(self, name, value)
            # Said once, in SGLang's fields: args copied or sent to the core check again.
            object.__setattr__(self, "speculative_config", None)
        algorithm = self.speculative_algorithm
        if algorithm is None:
            given = [f.name for f in fields(self) if f.name.startswith("speculative_")]
            given = [n for n in given if getattr(self, n) != _DEFAULTS[n]]
            if given:
                flag = "--" + given[0].replace("_", "-")
                message = f"{flag} configures speculative decoding: add --speculative-algorithm"
                raise TierserveError(message, given[0])
            return
        if algorithm == "NGRAM" and self.speculative_draft_model_path is not None:
            message = "--speculative-draft-model-path is for EAGLE3; NGRAM drafts need no model"
            raise TierserveError(message, "speculative_draft_model_path")
        topk = self.speculative_eagle_topk
        if topk is not None and topk != 1:
            message = f"--speculative-eagle-topk: only chains (1) are served, not trees; got {topk}"
            raise TierserveError(message, "speculative_eagle_topk")
        steps, tokens = self.speculative_num_steps, self.speculative_num_draft_tokens
        if steps is not None:
            check_speculative_steps(steps)
        bounds = [
            (steps, MAX_SPEC_STEPS, "--speculative-num-steps", "speculative_num_steps"),
            (tokens, MAX_SPEC_STEPS + 1, "--speculative-num-draft-tokens",
             "speculative_num_draft_tokens"),
        ]  # fmt: skip
        if vllm:  # its num_speculative_tokens became the steps above
            name = "--speculative-config num_speculative_tokens"
            bounds[0] = (steps, MAX_SPEC_STEPS, name, "speculative_config")
        for value, most, name, field_name in bounds:
            if value is not None and value > most:
                message = (
                    f"{name} must be at most {most} (a chain of {MAX_SPEC_STEPS} drafted "
                    f"tokens, each one more draft forward per step), got {value}"
                )
                raise TierserveError(message, field_name)
        steps = steps if steps is not None else (tokens - 1 if tokens is not None else SPEC_STEPS)
        tokens = tokens if tokens is not None else steps + 1
        if steps < 1 or tokens != steps + 1:
            message = (
                f"a chain of {steps} drafted tokens verifies {steps + 1} per step: "
                f"--speculative-num-draft-tokens {tokens} does not match (steps must be >= 1)"
            )
            raise TierserveError(message, "speculative_num_draft_tokens")
        object.__setattr__(self, "speculative_num_steps", steps)
        object.__setattr__(self, "speculative_num_draft_tokens", tokens)
        lo = self.speculative_ngram_min_match_window_size
        hi = self.speculative_ngram_max_match_window_size
        if not 1 <= lo <= hi:
            message = f"the n-gram window must satisfy 1 <= min ({lo}) <= max ({hi})"
            raise TierserveError(message, "speculative_ngram_min_match_window_size")

    def _check_distributed(self) -> None:
        for name in ("tp_size", "nnodes"):
            if not 0 < getattr(self, name) <= MAX_RANKS:
                message = f"{name} must be in [1, {MAX_RANKS:,}], got {getattr(self, name)}"
                raise TierserveError(message, name)
        ranks_per_node(self.tp_size, self.nnodes, "tp_size")
        if not 0 <= self.node_rank < self.nnodes:
            message = f"node_rank must be in [0, {self.nnodes}), got {self.node_rank}"
            raise TierserveError(message, "node_rank")
        if self.nnodes > 1 and self.dist_init_addr is None:
            message = "several nodes meet at --dist-init-addr HOST:PORT (node 0's address)"
            raise TierserveError(message, "dist_init_addr")
        self._check_dp_attention()

    def _check_dp_attention(self) -> None:
        """SGLang's rules: D attention groups of tp/D ranks; --dp-size alone means replicas,
        which tierserve runs as separate servers behind a router."""
        if self.dp_size <= 0:
            raise TierserveError(f"dp_size must be > 0, got {self.dp_size}", "dp_size")
        if self.load_balance_method not in LOAD_BALANCE_METHODS:
            other = self.load_balance_method == "follow_bootstrap_room"
            why = " (it places prefill-decode disaggregated requests, which tierserve does not run)"
            raise TierserveError(
                f"load_balance_method {self.load_balance_method!r} is not one of "
                f"{', '.join(LOAD_BALANCE_METHODS)}{why if other else ''}",
                "load_balance_method",
            )
        if not self.enable_dp_attention:
            if self.dp_size > 1:
                raise TierserveError(
                    f"--dp-size {self.dp_size} without --enable-dp-attention means "
                    f"{self.dp_size} replicas of the whole model: run one tierserve server per "
                    "replica behind sglang-router (docs/distributed.md), or add "
                    "--enable-dp-attention for attention groups inside one server",
                    "dp_size",
                )
            return
        if self.tp_size % self.dp_size:
            message = f"--dp-size {self.dp_size} must divide --tp-size {self.tp_size}"
            raise TierserveError(message, "dp_size")
        if self.dp_size == 1:
            raise TierserveError(
                "--enable-dp-attention needs --dp-size > 1 (the attention groups; "
                "usually --dp-size = --tp-size)",
                "dp_size",
            )
        if self.max_running_requests < self.dp_size:
            message = (
                f"max_running_requests {self.max_running_requests} gives each of the "
                f"{self.dp_size} attention groups less than one request"
            )
            raise TierserveError(message, "max_running_requests")

    @property
    def attention_tp_size(self) -> int:
        """Ranks that split one attention group's heads (all of them without DP attention)."""
        return self.tp_size // self.dp_size if self.enable_dp_attention else self.tp_size

    @property
    def dp_groups(self) -> int:
        """Attention groups: each its own scheduler, radix tree and KV pools."""
        return self.dp_size if self.enable_dp_attention else 1

    @property
    def model_dir(self) -> str | None:
        """The checkpoint directory: `--model`, else the bundled demo model."""
        return self.model or default_model()

    @property
    def tokenizer_dir(self) -> str:
        """Where the tokenizer is read: `--tokenizer`, else the checkpoint's directory."""
        path = self.tokenizer or self.model_dir
        if path is None:  # Startup refuses the same before anything loads
            raise TierserveError("no --model given and no bundled demo model", field="model")
        return path

    @property
    def local_ranks(self) -> int:
        """Ranks on this node: they share its host RAM."""
        return ranks_per_node(self.tp_size, self.nnodes, "tp_size")

    @property
    def num_speculative_tokens(self) -> int:
        """Tokens drafted per request per step (0: no speculation)."""
        return self.speculative_num_steps or 0 if self.speculative_algorithm else 0

    @classmethod
    def from_kwargs(cls, model: str | os.PathLike[str] | None, **kwargs: Any) -> EngineArgs:
        if model is not None and not isinstance(model, str | os.PathLike):
            message = f"model must be a checkpoint directory's path, got {model!r}"
            raise TierserveError(message, "model")
        model = None if model is None else os.fspath(model)
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise TierserveError(
                f"unknown engine argument(s) {unknown}; known: {sorted(known)}", field=unknown[0]
            )
        for f in fields(cls):  # what argparse checks for a flag, checked for a keyword
            if f.name not in kwargs:
                continue
            value, choices = kwargs[f.name], f.metadata.get("choices")
            if not _of_type(value, str(f.type)):
                kind = type(value).__name__
                raise TierserveError(f"{f.name} must be {f.type}, got {value!r} ({kind})", f.name)
            if choices and value is not None and value not in choices:
                raise TierserveError(f"{f.name} must be one of {choices}, got {value!r}", f.name)
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


_DEFAULTS = {f.name: f.default for f in fields(EngineArgs)}
# vLLM's --speculative-config keys and the flags they set (method: its own mapping).
_VLLM_KEYS = {
    "num_speculative_tokens": "speculative_num_steps",
    "prompt_lookup_min": "speculative_ngram_min_match_window_size",
    "prompt_lookup_max": "speculative_ngram_max_match_window_size",
    "model": "speculative_draft_model_path",
}
_VLLM_METHODS = {
    "ngram": "NGRAM",
    "eagle3": "EAGLE3",
    "eagle": "EAGLE",
    "deepseek_mtp": "NEXTN",
    "mtp": "NEXTN",
}


def vllm_speculative_config(args: EngineArgs) -> dict[str, Any]:
    """The SGLang flags that vLLM's --speculative-config JSON means; given both, refused."""
    field_name = "speculative_config"
    try:
        raw = json.loads(args.speculative_config or "")
    except json.JSONDecodeError as e:
        raise TierserveError(f"--speculative-config is not JSON: {e}", field_name) from None
    if not isinstance(raw, dict):
        raise TierserveError("--speculative-config must be a JSON object", field_name)
    given = [
        f.name
        for f in fields(args)
        if f.name.startswith("speculative_")
        and f.name != field_name
        and getattr(args, f.name) != _DEFAULTS[f.name]
    ]  # each was overwritten by the JSON's value, or its default, silently
    if given:
        flag = "--" + given[0].replace("_", "-")
        message = f"give --speculative-config (vLLM's) or {flag} (SGLang's), not both"
        raise TierserveError(message, field_name)
    unknown = sorted(set(raw) - {"method", *_VLLM_KEYS})
    if unknown:
        known = ", ".join(["method", *_VLLM_KEYS])
        raise TierserveError(
            f"--speculative-config: unknown key {unknown[0]!r} ({known})", field_name
        )
    method = raw.get("method")
    if method not in _VLLM_METHODS:
        message = (
            f"--speculative-config method must be one of {sorted(_VLLM_METHODS)}, got {method!r}"
        )
        raise TierserveError(message, field_name)
    out: dict[str, Any] = {"speculative_algorithm": _VLLM_METHODS[method]}
    for key, name in _VLLM_KEYS.items():
        if key not in raw:
            continue
        value = raw[key]
        kind = str if key == "model" else int
        if not isinstance(value, kind) or isinstance(value, bool):
            message = (
                f"--speculative-config {key} must be {'a path' if kind is str else 'an integer'}"
            )
            raise TierserveError(message, field_name)
        out[name] = value
    # vLLM: one of the lookup bounds given stands for both, and neither means 5.
    lo, hi = raw.get("prompt_lookup_min"), raw.get("prompt_lookup_max")
    if method == "ngram" and (lo is None or hi is None):
        out[_VLLM_KEYS["prompt_lookup_min"]] = out[_VLLM_KEYS["prompt_lookup_max"]] = lo or hi or 5
    return out


def _of_type(value: Any, annotation: str) -> bool:
    """Whether a Python caller's keyword fits its field as a CLI flag's parsed value would:
    a number for a number (an int for a float, never a bool), a bool for a switch. Text
    fields take what they are given: a size as 48 or "48GB", a folder as a Path."""
    kind, _, optional = annotation.partition(" | ")
    if value is None:
        return optional == "None" or kind == "str"
    if kind == "bool":
        return isinstance(value, bool)
    if kind == "str":
        return True
    return not isinstance(value, bool) and isinstance(value, int if kind == "int" else (int, float))
