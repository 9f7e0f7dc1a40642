"""The engine: tokenizer, model, KV cache and scheduler behind add_request / step.

One synchronous loop, driven through the typed messages of core_messages.py: by the offline `LLM` in
its caller's process, and by the engine core process (core.py) for the server. One thing at
some length: the engine's life (build, take messages, step, follow rank 0, close), each part a
few short methods.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from typing import TYPE_CHECKING, Any

import msgspec
import torch

from tierserve.args import EngineArgs
from tierserve.cache import KVCacheManager, PagedKV, TransferFactory, default_transfer, pair_keys
from tierserve.core_messages import (
    AbortRequest,
    AddRequest,
    CoreInfo,
    EngineInput,
    FlushCache,
    GroupReport,
    PrepareGrammars,
    decode_report,
    encode,
)
from tierserve.distributed import (
    NodeStart,
    Pinned,
    Ranks,
    describe_wait,
    global_rank,
    pin_rank,
    start_node,
)
from tierserve.engine.dp_groups import AttentionGroups
from tierserve.engine.hidden_states import HiddenStateCapture
from tierserve.engine.host_heap import keep_freed_heap
from tierserve.engine.kv_plan import startup_table
from tierserve.engine.kv_tiers import host_tier, storage_tier
from tierserve.engine.request import Request
from tierserve.engine.runner import ChunkResult, ModelRunner
from tierserve.engine.scheduler import ScheduledChunk, Scheduler, SchedulerConfig
from tierserve.engine.startup import Startup, resolve_device
from tierserve.engine.warm_up import warm_up
from tierserve.errors import TierserveError
from tierserve.frontend import RequestPreparer, eos_token_id, lazy_tokenizer
from tierserve.layers import ATTENTION_BACKENDS
from tierserve.model_config import ModelConfig
from tierserve.models import CausalLM, load_draft, load_model, load_mtp
from tierserve.outputs import StepOutput, TokenLogprob
from tierserve.sampling_params import SamplingParams
from tierserve.speculative import DraftModelProposer, Proposer, SpecStats, proposer_for

if TYPE_CHECKING:
    from tierserve.storage import StorageTier

logger = logging.getLogger("tierserve")


class Engine:
    def __init__(
        self,
        args: EngineArgs,
        transfer: TransferFactory = default_transfer,
        serving: bool = False,
        node: NodeStart | None = None,
    ) -> None:
        """`serving`: an API process shares this node (the engine core's); it may get cores
        of its own (distributed/placement.py). `node`: what this process, the node's first,
        decided and started before it loaded torch (the engine core's); `args` are its."""
        # The node's first process places the node's ranks; the others get its lists in args.
        local_rank = global_rank(args) % args.local_ranks
        if local_rank == 0 and node is None:
            node = start_node(args, serving, spawn_ranks=False)
        args = node.args if node is not None else args
        self.args = args
        self._closed = False
        self.storage: StorageTier | None = None  # opened before the weights (below)
        spawned = node.ranks if node is not None else None
        # Tensor parallelism: every rank joins here; rank 0 decides every size, and checks it
        # for the whole node, before any rank's weights or KV take memory.
        pinned: Pinned | None = None
        try:
            pinned = self._pinned = pin_rank(args, local_rank)
            device = resolve_device(args.device)
            if device.type == "cpu":
                keep_freed_heap()  # a step's activations are host memory: keep them mapped
            self.ranks = Ranks.start(args, device, spawned) if args.tp_size > 1 else None
        except BaseException:
            if spawned is not None and not spawned.closing.is_set():
                spawned.release(wait_s=0.0)  # failed before Ranks.start claimed the group
            if pinned is not None:
                pinned.release()
            raise
        decide = lambda: Startup.from_args(args)  # noqa: E731
        try:
            self.startup = startup = self.ranks.agree(decide) if self.ranks else decide()
        except TierserveError:
            if self.ranks is not None:
                self.ranks.close()  # the other ranks refuse too: see them out before exiting
            self._pinned.release()
            raise
        try:
            cfg, self.device, self.dtype = startup.config, startup.device, startup.dtype
            self.model_config, self.context_length = cfg, startup.context_length
            self.kv_plan = plan = startup.plan
            placed = node.placement.describe() if node is not None else None
            waits = describe_wait(os.environ)  # what this process's libgomp read
            table = startup_table(plan, args.dp_groups, placed, waits)
            logger.info("KV cache plan:\n%s", table)
            # Loaded where text is read (offline prompts, grammars): a core never loads it.
            tokenizer_dir = args.tokenizer_dir
            assert tokenizer_dir is not None  # Startup found the model directory
            self._tokenizer = lazy_tokenizer(tokenizer_dir)
            self.eos_token_ids = set(cfg.eos_token_ids)
            eos = eos_token_id(tokenizer_dir, self._tokenizer)
            if eos is not None:
                self.eos_token_ids.add(eos)
            # Before the weights: a store that cannot be reached refuses the start at no cost.
            self.storage = storage_tier(startup, args, self.ranks) if startup.storage else None
            model = load_model(
                startup.model_path, cfg, self.dtype, self.device, args.quantized_activations
            )
            pages = plan.device_tokens // plan.spec.page_size
            pool = PagedKV(plan.spec, pages, self.device, compute_dtype=self.dtype)
            host = None
            if plan.host is not None:
                host = host_tier(pool, plan, args, self.ranks, transfer, self.storage)
            proposer = self._proposer(startup, model, pool)
            drafts = proposer if isinstance(proposer, DraftModelProposer) else None
            keys = pair_keys(cfg.vocab_size) if drafts else None
            self.kv = KVCacheManager(pool, not args.disable_radix_cache, host, keys)
            # Under DP attention the running cap is the node's, split among the groups (SGLang).
            running = args.max_running_requests // args.dp_groups
            sched_cfg = SchedulerConfig(
                running, args.chunked_prefill_size, self.context_length, args.num_speculative_tokens
            )
            self.scheduler = Scheduler(sched_cfg, self.kv, proposer)
            self.spec_stats = SpecStats()
            attn = ATTENTION_BACKENDS[startup.attention_backend](pool, cfg.num_layers)
            attn.adopt(model)
            logger.info("attention backend: %s", startup.attention_backend)
            writes = self.ranks is None or self.ranks.group_leader
            self.capture = HiddenStateCapture.of(args, cfg, self.dtype, writes)
            self.runner = ModelRunner(
                model, attn, args.page_size, self.device, self.capture.layers, drafts
            )
            self._requests: dict[str, Request] = {}
            self._default_generator = torch.Generator().manual_seed(args.seed)
            # Data-parallel attention: this rank's attention group; rank 0 places requests
            # on the groups and keeps what each group last reported.
            dp = self.ranks.dp if self.ranks is not None else None
            self.dp_rank = dp.group_rank if dp is not None else 0
            self.groups: AttentionGroups | None = None
            if dp is not None and self.ranks is not None and self.ranks.leader:
                self.groups = AttentionGroups(dp.groups, args.load_balance_method)
            self.peak_running = 0  # the node's most requests running in one step
            self._scheduled = 0  # requests the last step ran on this rank
            self.info = CoreInfo(
                pid=os.getpid(),
                model_path=startup.model_path,
                tokenizer_path=args.tokenizer_dir or startup.model_path,
                context_length=self.context_length,
                vocab_size=cfg.vocab_size,
                eos_token_ids=sorted(self.eos_token_ids),
                num_pages=self.kv.num_pages,
                page_size=self.kv.page_size,
                hidden_states_dir=args.hidden_states_dir,
                hidden_state_bytes_per_token=self.capture.bytes_per_token,
                api_cores=node.placement.api if node is not None else (),
            )
            self.preparer = RequestPreparer(self.info, self._tokenizer)
            self.grammars = self.preparer.grammars
            if startup.warm_up:
                warm_up(self)
            if self.ranks is not None:  # ready when every rank is: rank 0 serves only then
                self.ranks.bus.barrier()
        except BaseException:
            # The other ranks may wait in a collective this rank will never reach: end them
            # now rather than after the collective's timeout, and leave the group.
            if self.ranks is not None:
                self.ranks.kill()
            self._pinned.release()
            self.abandon_storage()
            raise

    def _proposer(self, startup: Startup, model: CausalLM, pool: PagedKV) -> Proposer | None:
        """The flags' proposer; a draft model with an attention backend of its own (its decode
        workspace holds the draft's layer only)."""
        if startup.draft_path is None:
            return proposer_for(self.args)
        load = load_mtp if startup.draft_kind == "nextn" else load_draft
        draft = load(startup.draft_path, model, self.dtype, self.device)
        assert startup.plan.draft is not None  # planned with its draft model
        logger.info("%s: %s", startup.plan.draft.name, startup.draft_path)
        attn = ATTENTION_BACKENDS[startup.attention_backend](pool, pool.spec.num_layers)
        attn.adopt(draft)
        steps = self.args.speculative_num_steps or 0
        return DraftModelProposer(draft, attn, steps, startup.context_length - 1)

    @staticmethod
    def vocab_size_of(model_path: str) -> int:
        return ModelConfig.from_dir(model_path).vocab_size

    @property
    def tokenizer(self) -> Any:  # a transformers PreTrainedTokenizerBase, loaded on first use
        return self._tokenizer()

    # --- requests --------------------------------------------------------------------------

    def add_request(
        self, prompt: str | list[int], params: SamplingParams, request_id: str | None = None
    ) -> str:
        req = self.make_request(prompt, params, request_id, self.preparer.next_arrival())
        self.submit(req)
        return req.rid

    def next_arrival(self) -> int:
        return self.preparer.next_arrival()

    def make_request(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        request_id: str | None,
        arrival: int,
    ) -> Request:
        return self._request(self.preparer.prepare(prompt, params, request_id, arrival))

    def _request(self, message: AddRequest) -> Request:
        """The scheduler's request for `message`: its stop ids, its generator, its grammar."""
        params = message.params
        generator = self._default_generator
        if params.seed is not None:
            generator = torch.Generator().manual_seed(params.seed)
        grammar = self.grammars.matcher(message.grammar) if message.grammar else None
        return Request(
            rid=message.rid,
            arrival=message.arrival,
            prompt_ids=message.prompt_ids,
            params=params,
            stop_ids=frozenset(params.stop_token_ids)
            | (frozenset() if params.ignore_eos else frozenset(self.eos_token_ids)),
            generator=generator,
            prompt_text=message.prompt_text,
            grammar=grammar,
            message=message,
            captures=self.args.hidden_states_dir is not None
            and params.return_hidden_states is not False,
        )

    def submit(self, req: Request) -> None:
        groups = self.groups
        if req.rid in self._requests or (groups is not None and groups.holds(req.rid)):
            raise TierserveError(f"request id {req.rid!r} is already in flight", "request_id")
        if groups is not None and req.message is not None:
            group = groups.place(req.rid, req.prompt_ids)
            req.message = msgspec.structs.replace(req.message, dp_rank=group)
            if group != self.dp_rank:  # that group's ranks take it from the bus
                self._announce(req.message)
                return
        self._requests[req.rid] = req
        self.scheduler.add(req)
        if req.message is not None:  # every request but a test's hand-made one
            self._announce(req.message)
        else:
            assert self.ranks is None, "requests reach a tensor-parallel engine as messages"

    def handle(self, message: EngineInput) -> dict[str, int | str] | None:
        """Apply one message (the core's inbox and the tensor-parallel bus carry the same)."""
        if isinstance(message, AddRequest):
            if self.groups is None and message.dp_rank != self.dp_rank:
                return None  # another attention group's request
            self.submit(self._request(message))
        elif isinstance(message, AbortRequest):
            self.abort(message.rid)
        elif isinstance(message, PrepareGrammars):
            self.grammars.prepare()
            self._announce(message)
            if self.ranks is not None and self.ranks.leader:
                # Now: an idle leader's next exchange is the step that adds the request, and
                # the other ranks would import inside it.
                self.ranks.bus.exchange()
        else:
            return self.flush_cache()
        return None

    def abort(self, request_id: str) -> None:
        req = self._requests.pop(request_id, None)
        if req is not None and not req.finished:
            self.scheduler.finish(req, "abort")
            self._announce(AbortRequest(request_id))
        elif self.groups is not None and self.groups.holds(request_id):
            self._announce(AbortRequest(request_id))  # another group runs it
        if self.groups is not None:
            self.groups.dispatcher.finished(request_id)

    def has_unfinished(self) -> bool:
        if self.groups is not None:  # every group's requests, as rank 0 placed them
            return self.scheduler.has_work() or self.groups.busy()
        return self.scheduler.has_work()

    def decoding_only(self) -> bool:
        """Requests run and every one only decodes: no prompt left to prefill, none queued."""
        s = self.scheduler
        return bool(s.running) and not s.waiting and all(r.remaining == 1 for r in s.running)

    def num_waiting(self) -> int:
        """Requests queued for admission: in every attention group under DP attention."""
        if self.groups is not None:
            return self.groups.waiting
        return len(self.scheduler.waiting)

    # --- the loop --------------------------------------------------------------------------

    def step(self) -> list[StepOutput]:
        """Run one batch; returns the token of every request that sampled one. With tensor
        parallelism rank 0 first tells the other ranks what arrived since the last step."""
        if self.ranks is not None:
            self.ranks.bus.exchange(step=True)
        outputs = self._step()
        if self.ranks is not None and self.ranks.dp is not None:
            outputs = self._collect(outputs, self._scheduled)
        return outputs

    def _step(self) -> list[StepOutput]:
        chunks = self.scheduler.schedule()
        self._scheduled = len(chunks)
        self.peak_running = max(self.peak_running, len(self.scheduler.running))
        if not chunks and self.ranks is not None and self.ranks.dp is not None:
            self.runner.step([])  # the other groups' MLP collectives need this rank too
        if not chunks:
            if self.storage is not None and self.scheduler.waited_for_storage:
                # Every admissible request waits for a storage prefetch: let the fetchers run
                # rather than spin.
                self.storage.reads.wait(0.01)
                return []
            if self.scheduler.waiting and not self.scheduler.running:
                # Admission with nothing running always fits (requests are checked against the
                # pool at submission); reaching here is a bug, and a loud one beats a hang.
                raise RuntimeError("scheduler admitted nothing with an idle engine")
            return []
        start = time.perf_counter()
        sampled = self.runner.step(chunks)
        if self.storage is not None:
            seconds = time.perf_counter() - start
            self.storage.rates.observe_step([c.num_tokens for c in chunks], seconds)
        return [o for c, t in zip(chunks, sampled, strict=True) for o in self._advance(c, t)]

    def _advance(self, chunk: ScheduledChunk, result: ChunkResult) -> list[StepOutput]:
        """The chunk's tokens appended to its request, one StepOutput each, up to the first
        that finishes it."""
        req = chunk.req
        # A verified draft: the known token and the drafts kept have their KV now.
        kept = len(result.tokens) - 1 if chunk.draft else 0
        self.scheduler.record_computed(req, chunk.num_tokens + kept)
        if chunk.draft:
            self.spec_stats.record(len(chunk.draft), kept)
        if chunk.draft or (result.tokens and self.scheduler.lookahead):
            self.kv.shrink(req.kv, req.num_computed)  # rejected and lookahead slots
        if result.tokens and self.scheduler.proposer is not None:
            req.spec_steps += 1
            req.next_draft = result.draft
        if result.prompt_logprobs:
            req.prompt_logprobs += result.prompt_logprobs
        if result.hidden is not None:
            self.capture.keep(req, result.hidden)
        if chunk.num_tokens > 1:  # share the prompt with requests that arrive meanwhile
            self.kv.cache_prefix(req.kv, req.all_ids)
        outputs = []
        for token, logprob in zip(result.tokens, result.logprobs, strict=True):
            outputs.append(self._append(req, token, logprob))
            if outputs[-1].finish_reason:
                break
        return outputs

    def _append(self, req: Request, token: int, logprob: TokenLogprob | None) -> StepOutput:
        req.output_ids.append(token)
        if req.grammar is not None:
            req.grammar.accept(token)
        self.scheduler.stats.num_generated_tokens += 1
        reason = self._finish_reason(req, token)
        if reason:
            self.scheduler.finish(req, reason)
            del self._requests[req.rid]
        return StepOutput(
            request_id=req.rid,
            token_id=token,
            finish_reason=reason,
            prompt_tokens=len(req.prompt_ids),
            cached_tokens=req.cached_tokens or 0,
            num_preemptions=req.num_preemptions,
            logprob=logprob,
            prompt_logprobs=self._prompt_logprobs(req),
            hidden_states_path=req.hidden_states_path if len(req.output_ids) == 1 else None,
            spec_verify_ct=req.spec_steps,
        )

    @staticmethod
    def _prompt_logprobs(req: Request) -> tuple[TokenLogprob, ...] | None:
        if req.params.prompt_logprobs is None or len(req.output_ids) != 1:
            return None  # sent once, with the first token
        return tuple(req.prompt_logprobs)

    def _finish_reason(self, req: Request, token: int) -> str | None:
        if token in req.stop_ids or (req.grammar is not None and req.grammar.ended):
            return "stop"
        assert req.params.max_tokens is not None  # filled in by Preparer.prepare()
        if len(req.output_ids) >= req.params.max_tokens or req.num_tokens >= self.context_length:
            return "length"
        return None

    def check_accounting(self) -> None:
        self.kv.check_accounting([r.kv for r in self.scheduler.running])

    def abandon_storage(self) -> None:
        """After a failed start or loop: close the store's client, its queued writes lost. What
        fails here is not reported; the failure that brought the engine here is."""
        if self.storage is not None:
            with contextlib.suppress(Exception):
                self.storage.close()

    def close(self, write_timeout_s: float = 5.0) -> None:
        """Rank 0 stops the other ranks first, so that every rank closes its storage at once,
        not one after another: queued writes finish (bounded: a restarted server finds them),
        then the store's client goes (bounded too: storage/tier.py). The process group is left
        whatever fails on the way. Idempotent; `LLM`'s finalizer calls it."""
        if self._closed:
            return
        self._closed = True
        ranks, self.ranks = self.ranks, None
        try:
            self.capture.close(write_timeout_s)
            if ranks is not None and ranks.leader:
                ranks.closing.set()  # the ranks may end while this one closes its storage
                ranks.bus.exchange(stop=True)
            if self.storage is not None:
                self._land_host_copies(tp=ranks is not None)
                self.storage.flush_writes(write_timeout_s)
                self.storage.close()
        except BaseException:
            if ranks is not None:
                ranks.kill()  # a rank that cannot be told to stop would wait until killed
            self._pinned.release()
            raise
        if ranks is not None:
            ranks.close()
        self._pinned.release()

    def _land_host_copies(self, tp: bool) -> None:
        """Copies to the host that the last steps queued, landed and handed to storage, so a
        restarted server finds a request that finished in its final step. Not under TP on a
        GPU, where landings are agreed between ranks that close one at a time."""
        host = self.kv.host
        if host is not None and not (tp and self.device.type == "cuda"):
            host.drain()

    def flush_cache(self) -> dict[str, int | str]:
        """Pages dropped per tier (device, host) and what storage did (nothing); under DP
        attention, summed over the groups, each of which has flushed when this returns."""
        self._announce(FlushCache())
        if self.ranks is None or self.ranks.dp is None or not self.ranks.leader:
            return self.kv.flush()
        self.ranks.bus.exchange()
        flushed: dict[str, int | str] = {}
        try:
            flushed = self.kv.flush()
        finally:  # the other ranks wait in the collect for this rank's report
            self._collect([], flushed=flushed)
        assert self.groups is not None
        return self.groups.flushed()

    # --- data-parallel attention: the groups report to rank 0 ---------------------------------

    def _collect(
        self,
        outputs: list[StepOutput],
        scheduled: int = 0,
        flushed: dict[str, int | str] | None = None,
    ) -> list[StepOutput]:
        """Every group's first rank sends rank 0 its step; rank 0 returns them all, in group
        order (others: [])."""
        assert self.ranks is not None
        mine = None
        if self.ranks.group_leader:
            free = self.kv.allocator.num_free
            used = (self.kv.num_pages - free) * self.kv.page_size
            sched = self.scheduler
            report = GroupReport(
                self.dp_rank,
                outputs,
                scheduled,
                len(sched.running),
                len(sched.waiting),
                used,
                flushed,
                self.spec_stats.counts() if self.dp_rank else [],
            )
            mine = encode(report)
        reports = [decode_report(r) for r in self.ranks.bus.collect(mine) if r is not None]
        if self.groups is None:
            return []
        outputs = self.groups.take(reports, step=flushed is None)
        for now, before in self.groups.spec_gains:  # rank 0's own group counts itself
            self.spec_stats.add_since(now, before)
        self.peak_running = max(self.peak_running, self.groups.running)
        return outputs

    # --- tensor parallelism: ranks other than 0 -----------------------------------------------

    def _announce(self, command: EngineInput) -> None:
        if self.ranks is not None:
            self.ranks.bus.post(command)

    def follow(self) -> None:
        """A rank other than 0: apply what rank 0 announces and step when it steps, until it
        says stop."""
        assert self.ranks is not None and not self.ranks.leader
        while True:
            message = self.ranks.bus.exchange()
            flushed = None
            for command in message.inputs:
                flushed = self.handle(command) or flushed
            if message.stop:
                break
            dp = self.ranks.dp is not None
            if dp and flushed is not None:  # rank 0 collects the groups' flushes at once
                self._collect([], flushed=flushed)
            if message.step:
                outputs = self._step()
                if dp:
                    self._collect(outputs, self._scheduled)
        self.close()
