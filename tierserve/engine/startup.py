"""What a server decides before it allocates anything: the model directory and its config, the
device, the dtype, the context length and the KV plan (device pool, host tier, RAM checks).

`Engine` builds from it; `tierserve serve --dry-run` prints it and stops. Any refusal is a
TierserveError naming the flag, raised before a byte of weights or KV is allocated.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from tierserve.args import EngineArgs
from tierserve.cache import check_pool_size
from tierserve.engine.kv_plan import KVPlan, check_cpu_ram, size_host_tier
from tierserve.errors import TierserveError
from tierserve.layers import DecodeWorkspace, onednn_dtypes, packed_head_bytes, resolve_backend
from tierserve.model_config import ModelConfig, read_hf_config, text_config
from tierserve.models import (
    Eagle3Config,
    QuantConfig,
    check_nextn,
    checkpoint_sizes,
    describe_backends,
    draft_numel,
    draft_path_for,
    model_class,
    nextn_layers,
)
from tierserve.sizing import DraftSize, KVSpec, device_pool_bytes
from tierserve.storage import EXTRA_FIELD, StorageConfig, backend_class
from tierserve.utils import COMPUTE_DTYPES, torch_dtype

CPU_DEFAULT_POOL_TOKENS = 32768

logger = logging.getLogger("tierserve")


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise TierserveError("device cuda requested but CUDA is not available", field="device")
    return torch.device(name)


def resolve_dtype(name: str, cfg: ModelConfig, device: torch.device) -> torch.dtype:
    if name != "auto":
        dtype = torch_dtype(name)
        if device.type == "cpu" and dtype == torch.bfloat16 and dtype not in onednn_dtypes():
            # Served as asked, but not without a word: nothing else says why it is slow.
            logger.warning(
                "--dtype bfloat16 on a CPU where oneDNN has no bf16 GEMM (it needs AVX-512 or "
                "AVX-NE-CONVERT): the linears run torch's fallback, and the demo model's "
                "offline batch took 5.5x as long as in float32 on an AVX2-only EPYC. "
                "--dtype float32 (auto's choice on CPU) is the faster one here"
            )
        return dtype
    if device.type == "cpu":
        return torch.float32  # CPU matmuls in half precision are slow and less exact
    checkpoint = cfg.torch_dtype or ""
    return torch_dtype(checkpoint) if checkpoint in COMPUTE_DTYPES else torch.bfloat16


@dataclass(frozen=True)
class Startup:
    model_path: str
    config: ModelConfig
    device: torch.device
    dtype: torch.dtype
    context_length: int
    weight_bytes: int  # on the node
    plan: KVPlan
    storage: StorageConfig | None = None
    # One rank's share of a token's forward pass: 2 FLOPs per parameter (every expert of a MoE
    # counted, so estimates from it err slow).
    flops_per_token: float = 0.0
    attention_backend: str = "torch"  # resolved: never "auto"
    # The draft model's directory (an MTP layer's: the model's own) and its kind, "eagle3" or
    # "nextn"; its KV is the pool's last layer.
    draft_path: str | None = None
    draft_kind: str | None = None
    # Rank 0's choice, so every rank (another node's too) runs the warm-up or none does.
    warm_up: bool = False

    @classmethod
    def from_args(cls, args: EngineArgs) -> Startup:
        model_path = args.model_dir
        if model_path is None or not Path(model_path).is_dir():
            raise TierserveError(f"model directory not found: {model_path}", field="model")
        cfg = ModelConfig.from_dir(model_path)
        # Checked before anything is sized or started, and so by --dry-run too: without a
        # vocabulary the engine failed in oneDNN after loading.
        if cfg.vocab_size == 0:
            raise TierserveError("model config lacks 'vocab_size'", field="vocab_size")
        model_class(cfg.architecture)  # an architecture tierserve has no model for
        device = resolve_device(args.device)
        dtype = resolve_dtype(args.dtype, cfg, device)
        model_dtype = str(dtype).removeprefix("torch.")
        kv_dtype = model_dtype if args.kv_cache_dtype == "auto" else args.kv_cache_dtype
        # With DP attention a rank holds KV for its attention group's share of the heads.
        spec = KVSpec.from_model(cfg, kv_dtype, args.page_size, tp=args.attention_tp_size)
        node_numel, node_bytes, rank_bytes = weight_sizes(args, model_path, cfg, device, dtype)
        draft, kind, size = None, _draft_kind(args, model_path), None
        if kind is not None:
            draft, (split, whole) = _draft(args, kind, model_path, cfg)
            # Its weights, and its KV as one more layer of every page, before anything is sized.
            spec = dataclasses.replace(spec, num_layers=spec.num_layers + 1)
            node_numel += split + whole * args.tp_size
            node_bytes += (split + whole * args.tp_size) * dtype.itemsize
            rank_bytes += (-(-split // args.tp_size) + whole) * dtype.itemsize
            size = DraftSize(
                DRAFT_NAMES[kind],
                (split + whole) * dtype.itemsize,
                kind == "nextn",
                args.num_speculative_tokens + 1,
                draft,
            )
        extra = _fp32_extra(cfg, dtype.itemsize) + packed_head_bytes(
            cfg.tie_word_embeddings, cfg.vocab_size, cfg.hidden_size, device, dtype
        )
        weight_bytes = node_bytes + extra
        rank_weights = rank_bytes + extra // args.tp_size
        storage = _storage_config(args)
        backend = resolve_backend(args.attention_backend, device)
        # Only the torch backend keeps a decode workspace (on CPU); the CPU kernel reads pages.
        width = dtype.itemsize if backend == "torch" else 0
        weights = (weight_bytes, rank_weights)
        plan = _kv_plan(args, device, spec, weights, width, storage, (size, cfg.vocab_size))
        quant = QuantConfig.read(text_config(read_hf_config(Path(model_path))))
        if quant is not None:
            on = describe_backends(quant, device, args.quantized_activations)
            plan = dataclasses.replace(plan, quantization=f"{quant.describe()}: {on}")
        context = _context_length(args, cfg)
        flops = 2.0 * node_numel / args.tp_size
        return cls(
            model_path, cfg, device, dtype, context, weight_bytes, plan, storage, flops, backend,
            draft, kind, not args.skip_server_warmup,
        )  # fmt: skip


# What the start-up table calls each kind of draft model.
DRAFT_NAMES = {"eagle3": "EAGLE-3 draft", "nextn": "MTP layer"}


def _draft_kind(args: EngineArgs, model_path: str) -> str | None:
    """The kind of draft model the flags ask for ("eagle3", "nextn"; None: none). SGLang's
    EAGLE means the model's own MTP layer when it ships one and no draft is given."""
    algorithm = args.speculative_algorithm
    if algorithm == "EAGLE" and args.speculative_draft_model_path is None:
        return "nextn" if nextn_layers(model_path) else "eagle3"
    return {"EAGLE3": "eagle3", "EAGLE": "eagle3", "NEXTN": "nextn"}.get(algorithm or "")


def _draft(
    args: EngineArgs, kind: str, model_path: str, cfg: ModelConfig
) -> tuple[str, tuple[int, int]]:
    """The draft's directory, checked against the target, and its parameters (split over the
    ranks, whole on every rank). An EAGLE-3 draft runs whole on every rank; an MTP layer is
    split as the target's layers, but for its input projection and norms."""
    if kind == "nextn":
        if QuantConfig.read(text_config(read_hf_config(Path(model_path)))) is not None:
            message = (
                "--speculative-algorithm NEXTN over a compressed-tensors checkpoint is not "
                "served yet (its MTP layer loads dense only); use NGRAM or EAGLE3"
            )
            raise TierserveError(message, "speculative_algorithm")
        given = args.speculative_draft_model_path
        if given is not None and Path(given).resolve() != Path(model_path).resolve():
            message = (
                "--speculative-algorithm NEXTN drafts with the MTP layer of the model's own "
                f"checkpoint; --speculative-draft-model-path {given} is not it"
            )
            raise TierserveError(message, "speculative_draft_model_path")
        numels = check_nextn(model_path, cfg)
        if args.enable_dp_attention:  # its experts span every rank: all groups in lockstep
            message = "--speculative-algorithm NEXTN with --enable-dp-attention is not built yet"
            raise TierserveError(message, "enable_dp_attention")
        return model_path, numels
    draft = draft_path_for(args.speculative_draft_model_path, model_path)
    eagle = Eagle3Config.from_dir(draft, cfg)
    eagle.check_target(cfg, draft)
    eagle.check_weights(draft, cfg)
    return draft, (0, draft_numel(draft))


def weight_sizes(
    args: EngineArgs, model_path: str, cfg: ModelConfig, device: torch.device, dtype: torch.dtype
) -> tuple[int, int, int]:
    """Parameters the node holds, and the bytes of the node and of one rank (a quantized
    weight's as its backend keeps it): the model split over the ranks, except that each
    attention group under DP attention holds its own copy of the attention side, split over
    its ranks only. MTP layers past the config's layers are skipped."""
    size = checkpoint_sizes(
        model_path, cfg.num_layers, dtype.itemsize, device, args.quantized_activations
    )
    groups, tp, attention_tp = args.dp_groups, args.tp_size, args.attention_tp_size
    rest = size.bytes - size.attention_bytes
    node = size.bytes + size.attention_bytes * (groups - 1)
    rank = -(-rest // tp) + -(-size.attention_bytes // (attention_tp if groups > 1 else tp))
    return size.numel + size.attention_numel * (groups - 1), node, rank


def _fp32_extra(cfg: ModelConfig, itemsize: int) -> int:
    """Bytes beyond the model's dtype for what stays in float32: the MoE routers."""
    moe = cfg.moe
    if moe is None or itemsize >= 4:
        return 0
    routers = sum(moe.is_moe_layer(i) for i in range(cfg.num_layers))
    return routers * moe.num_experts * (cfg.hidden_size + 1) * (4 - itemsize)


def _storage_config(args: EngineArgs) -> StorageConfig | None:
    if args.hicache_storage_backend is None:
        return None
    return StorageConfig.parse(
        args.hicache_storage_backend,
        args.hicache_storage_backend_extra_config,
        args.hicache_storage_prefetch_policy,
    )


def _context_length(args: EngineArgs, cfg: ModelConfig) -> int:
    limit = args.context_length or cfg.max_position_embeddings
    if limit > cfg.max_position_embeddings:
        raise TierserveError(
            f"context_length {limit} exceeds the model's max_position_embeddings "
            f"{cfg.max_position_embeddings}",
            field="context_length",
        )
    if limit < 2:  # the warm-up's decode shape, and any request, need a prompt and a token
        message = f"context_length must be >= 2 (one prompt token and one sampled), got {limit}"
        raise TierserveError(message, field="context_length")
    return limit


def _kv_plan(
    args: EngineArgs,
    device: torch.device,
    spec: KVSpec,
    weights: tuple[int, int],  # bytes on the node, on one rank
    workspace_width: int,  # bytes per element of a decode workspace; 0: the backend has none
    storage: StorageConfig | None,
    draft: tuple[DraftSize | None, int] = (None, 0),  # a draft model, the vocabulary it verifies
) -> KVPlan:
    weight_bytes, rank_weights = weights
    num_pages = check_pool_size(_pool_tokens(args, device, spec, rank_weights), spec.page_size)
    device_tokens = num_pages * spec.page_size
    on_cpu = device.type == "cpu"
    # On CPU the decode workspace keeps a padded copy of the decode batch's KV (bounded), in
    # the compute dtype: with fp8 KV it is 4× the pool's bytes per token in float32.
    per_token = spec.bytes_per_token // spec.dtype_bytes * workspace_width
    workspace = DecodeWorkspace.MAX_PADDING * device_tokens * per_token
    workspace = workspace if on_cpu else 0
    size, vocab = draft
    verify = size.verify_bytes(vocab, args.max_running_requests // args.dp_groups) if size else 0
    plan = KVPlan(
        spec, device_tokens, None, args.hicache_write_policy, workspace, draft=size,
        verify_bytes=verify, weight_bytes_per_rank=rank_weights,
    )  # fmt: skip
    if on_cpu:
        check_cpu_ram(plan, weight_bytes, local_ranks=args.local_ranks)
    host = None
    if args.enable_hierarchical_cache:
        if args.disable_radix_cache:
            raise TierserveError(
                "the hierarchical cache needs the radix cache; drop --disable-radix-cache",
                field="enable_hierarchical_cache",
            )
        # On CPU the weights, the "device" pool and the workspace are host RAM too; a store's
        # client (Mooncake's segment and buffer) is host RAM on any device.
        overhead = (device_tokens * spec.bytes_per_token + workspace + verify) * args.local_ranks
        overhead += weight_bytes  # split among the node's ranks (tensor parallelism)
        store = 0
        if storage is not None:  # each rank's client RAM, and its write and fetch buffers
            _check_page_room(storage, spec.bytes_per_page)
            store = backend_class(storage.backend).ram_bytes(storage.extra)
            store += storage.buffer_bytes(spec.bytes_per_page)
            store *= args.local_ranks
        host = size_host_tier(args, spec, device_tokens, (overhead if on_cpu else 0) + store)
        plan = dataclasses.replace(plan, storage_ram_bytes=store)
    return dataclasses.replace(plan, host=host)


def _check_page_room(storage: StorageConfig, bytes_per_page: int) -> None:
    """A cap below one page kept nothing, and every page still counted as written."""
    room = backend_class(storage.backend).page_room(storage.extra)
    if room is not None and room < bytes_per_page:
        message = (
            f"the {storage.backend} storage config leaves {max(room, 0):,} bytes for pages, "
            f"less than one page ({bytes_per_page:,} bytes): the store would keep nothing"
        )
        raise TierserveError(message, field=EXTRA_FIELD)


def _pool_tokens(args: EngineArgs, device: torch.device, spec: KVSpec, rank_weights: int) -> int:
    if args.max_total_tokens is not None:
        return args.max_total_tokens
    if device.type != "cuda":
        return CPU_DEFAULT_POOL_TOKENS
    free, total = torch.cuda.mem_get_info(device)
    return device_pool_tokens(spec, total, free, rank_weights, args.mem_fraction_static)


def device_pool_tokens(
    spec: KVSpec, gpu_total: int, gpu_free: int, weight_bytes: int, fraction: float
) -> int:
    """Tokens of the device pool `serve` allocates on a card with this much memory: the pool
    bytes `plan` computes too (sizing/pools.py), in whole tokens."""
    budget = device_pool_bytes(gpu_total, gpu_free, weight_bytes, fraction)
    if budget < spec.bytes_per_page:
        in_use = gpu_total - gpu_free
        raise TierserveError(
            f"no room for a KV pool: {gpu_total / 1e9:.1f} GB × {fraction} − "
            f"{in_use / 1e9:.1f} GB in use − {weight_bytes / 1e9:.1f} GB of weights;"
            " raise --mem-fraction-static",
            field="mem_fraction_static",
        )
    return budget // spec.bytes_per_token
