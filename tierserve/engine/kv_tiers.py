"""The KV tiers behind the device pool, built from the start-up plan: the host tier (under
tensor parallelism, the node's one shared copy where ranks hold the same bytes) and the
storage tier (its namespace, this rank's shard and the ranks' roles)."""

from __future__ import annotations

import torch

from tierserve.args import EngineArgs
from tierserve.cache import HostShare, HostTier, PagedKV, TransferFactory, open_share
from tierserve.distributed import Ranks
from tierserve.engine.kv_plan import KVPlan
from tierserve.engine.startup import Startup
from tierserve.models import model_fingerprint
from tierserve.storage import Namespace, PrefetchRates, RankRoles, StorageTier, shard_of


def host_tier(
    pool: PagedKV,
    plan: KVPlan,
    args: EngineArgs,
    ranks: Ranks | None,
    transfer: TransferFactory,
    storage: StorageTier | None,
) -> HostTier:
    assert plan.host is not None
    pages = plan.host.tokens_per_rank // plan.spec.page_size
    share = _host_share(plan, pages, args, ranks)
    cuda = pool.device.type == "cuda"
    host_pool = PagedKV(
        plan.spec,
        pages,
        torch.device("cpu"),
        host_tier=True,
        pin_memory=cuda,
        buffer=share.buffer() if share is not None else None,
    )
    backend = transfer(pool, host_pool)
    if ranks is not None:
        backend.writes_host = share is None or share.writer
        if cuda:  # copies land at times that differ between ranks
            backend.agree = ranks.bus.all_true
    return HostTier(host_pool, args.hicache_write_policy, backend, storage=storage, share=share)


def _host_share(
    plan: KVPlan, pages: int, args: EngineArgs, ranks: Ranks | None
) -> HostShare | None:
    """The node's one copy of KV that this rank's group of ranks holds identically."""
    if ranks is None or plan.host is None or plan.host.sharing == 1:
        return None
    group, writer = plan.spec.share_group(ranks.rank, args.local_ranks)
    name = f"tierserve-{ranks.session}-{group}"
    nbytes = pages * plan.spec.bytes_per_page
    return open_share(name, nbytes, ranks.rank == writer, ranks.bus.group_barrier)


def storage_tier(startup: Startup, args: EngineArgs, ranks: Ranks | None) -> StorageTier:
    assert startup.storage is not None
    cfg, plan = startup.storage, startup.plan
    rank = ranks.rank if ranks is not None else 0
    salt = cfg.namespace
    if startup.draft_path is not None:  # pages hold the draft's KV too: its store is its own
        salt += f"|{startup.draft_kind}:" + model_fingerprint(startup.draft_path)
    fingerprint = model_fingerprint(startup.model_path, salt)
    shard = shard_of(plan.spec, rank % args.attention_tp_size)
    rates = PrefetchRates.make(
        cfg.prefetch_read_bytes_per_s,
        cfg.prefetch_recompute_tokens_per_s,
        startup.flops_per_token,
        startup.device.type,
    )
    roles = _storage_roles(plan, args, ranks)
    return StorageTier(cfg, Namespace(fingerprint, plan.spec, shard), rates, roles)


def _storage_roles(plan: KVPlan, args: EngineArgs, ranks: Ranks | None) -> RankRoles:
    if ranks is None:
        return RankRoles()
    sharing = plan.host.sharing if plan.host is not None else 1
    tp, local = args.attention_tp_size, args.local_ranks
    return RankRoles.of(plan.spec, ranks.rank, tp, local, sharing, ranks.bus.all_min)
