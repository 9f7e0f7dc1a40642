"""Continuous batching: each step decodes every running request and fills the rest of the
token budget with (chunks of) prompts, admitted first come, first served while KV allows.

The budget (`chunked_prefill_size`) counts the decode rows beside a step's prompt chunks, as
SGLang's mixed chunks and vLLM's max_num_batched_tokens do, down to half of it for prompts: a
step under load then has the same number of tokens whatever its mix. On CPU that matters: a
oneDNN GEMM of a row count it has not seen yet builds its kernel first (2.5 ms at 2,048 rows of
the demo model, 4 of them a layer), and with the budget for prompts alone every step of a burst
was a new count, the first 64-stream burst after start at ~0.86x the third.

When decode runs out of pages the newest running request is preempted and waits at the front of
the queue. With a host tier its KV is offloaded there and loaded back when it resumes; without
one its own pages are freed and recomputed later (its cached prefix survives in the tree).

A step observes landed tier copies first, then decides, then issues the step's batched copies.
A request admitted with a host hit runs once its load is readable (at once on CPU and CUDA; some
steps later with a slow transfer backend); others keep running meanwhile.
"""

from __future__ import annotations

import bisect
from collections import deque
from dataclasses import dataclass

from tierserve.cache import KVCacheManager
from tierserve.engine.request import Request, Status
from tierserve.sizing import pages_for
from tierserve.speculative import Proposer


@dataclass(frozen=True)
class SchedulerConfig:
    max_running_requests: int
    chunked_prefill_size: int  # tokens per prefilling step, decode rows included; -1: off
    context_length: int
    num_speculative_tokens: int = 0  # drafted per decoding request per step


@dataclass
class ScheduledChunk:
    """`num_tokens` of `req`'s known tokens, then `draft`: proposed tokens after them (a
    speculative verification; their KV slots are allocated like the known ones'). A chunk that
    reaches the sequence's end samples at its last known token and at every draft token."""

    req: Request
    num_tokens: int
    draft: tuple[int, ...] = ()

    @property
    def samples(self) -> bool:
        """True when this chunk reaches the end of the sequence, so its last logits are used."""
        return self.req.num_computed + self.num_tokens == self.req.num_tokens

    @property
    def num_rows(self) -> int:
        """Rows of the step's batch: the known tokens and the draft."""
        return self.num_tokens + len(self.draft)

    @property
    def sampled_rows(self) -> int:
        """How many of the chunk's last rows sample a token."""
        return 1 + len(self.draft) if self.samples else 0


@dataclass
class SchedulerStats:
    num_preemptions: int = 0
    num_offload_preemptions: int = 0  # of those, KV kept on the host instead of dropped
    num_recomputed_tokens: int = 0  # tokens computed again after a preemption
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_generated_tokens: int = 0
    num_steps: int = 0  # batches run
    steps_with_copies_in_flight: int = 0
    steps_waiting_on_load: int = 0  # a request waited for its load-back while others ran


class Scheduler:
    def __init__(
        self, cfg: SchedulerConfig, kv: KVCacheManager, proposer: Proposer | None = None
    ) -> None:
        self.cfg = cfg
        self.kv = kv
        self.proposer = proposer
        # Slots a sampling chunk reserves past its rows for a draft model's later steps.
        self.lookahead = proposer.lookahead if proposer is not None else 0
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.stats = SchedulerStats()
        self.waited_for_storage = False  # this step left a request out for a prefetch

    def add(self, req: Request) -> None:
        """Queue in arrival order: a request that arrived first but finished tokenizing later
        still goes first (and a preempted one returns ahead of those that came after it)."""
        bisect.insort(self.waiting, req, key=lambda r: r.arrival)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> list[ScheduledChunk]:
        self.kv.poll()
        chunks = []
        running = sorted(self.running, key=lambda r: r.arrival)
        budget = self._prefill_budget(running)
        for req in running:
            if req.status is not Status.RUNNING or not req.kv.ready:
                continue  # preempted to make room for an older request, or still loading
            decoding = req.remaining == 1  # a prompt's last token counts against the budget
            n = 1 if decoding else min(req.remaining, budget)
            draft = self._draft(req) if decoding else ()
            if n == 0 or not self._make_room(req, self._reach(req, n + len(draft))):
                continue
            chunks.append(ScheduledChunk(req, n, draft))
            budget -= 0 if decoding else n
        chunks = [c for c in chunks if c.req.status is Status.RUNNING]
        chunks.extend(self._admit(budget, reserve=len(chunks)))
        self.kv.issue()
        ready = [c for c in chunks if c.req.kv.ready]
        self.stats.num_steps += bool(ready)
        if len(ready) < len(chunks) and ready:
            self.stats.steps_waiting_on_load += 1
        if self.kv.host is not None and self.kv.host.in_flight:
            self.stats.steps_with_copies_in_flight += 1
        # Decode tokens first: attention then treats them as one contiguous block of rows.
        return sorted(ready, key=lambda c: c.num_rows > 1)

    def _draft(self, req: Request) -> tuple[int, ...]:
        """Tokens proposed after `req`'s last one, to verify in this step. Never past
        max_tokens or the context; none where the request may not draft (Request.may_draft)."""
        p = req.params
        if self.proposer is None or not req.may_draft:
            return ()
        room = self.cfg.context_length - req.num_tokens
        if p.max_tokens is not None:
            room = min(room, p.max_tokens - len(req.output_ids))
        k = min(self.cfg.num_speculative_tokens, room - 1)
        if k <= 0:
            return ()
        return self.proposer.draft_for(req, k)

    def _reach(self, req: Request, rows: int) -> int:
        """Tokens of `req` a chunk of `rows` needs slots for: a chunk that samples also
        the lookahead (never past the context)."""
        end = req.num_computed + rows
        if self.lookahead and rows >= req.remaining:
            end = min(end + self.lookahead, self.cfg.context_length)
        return end

    def _prefill_budget(self, running: list[Request]) -> int:
        """Prompt tokens this step may take: the budget less the decode rows beside them (their
        drafts aside), never below half of it, so decode never starves prompts."""
        size = self.cfg.chunked_prefill_size
        if size <= 0:
            return self.cfg.context_length
        decoding = sum(
            r.remaining == 1 and r.status is Status.RUNNING and r.kv.ready for r in running
        )  # the rows the loop below schedules: a request still loading its KV runs later
        return max(size - decoding, size // 2)

    def _make_room(self, req: Request, num_tokens: int) -> bool:
        """Pages for `num_tokens` of `req`, preempting the newest requests until they fit."""
        while not self.kv.grow(req.kv, num_tokens):
            victim = max(self.running, key=lambda r: r.arrival)
            self.preempt(victim)
            if victim is req:
                return False
        return True

    def preempt(self, req: Request) -> None:
        self.stats.num_preemptions += 1
        req.num_preemptions += 1
        if self.kv.offload(req.kv, req.all_ids):
            self.stats.num_offload_preemptions += 1
        req.kv = self.kv.release(req.kv, req.all_ids, keep_in_cache=False)
        self.running.remove(req)
        req.status = Status.WAITING
        self.add(req)

    def _admit(self, budget: int, reserve: int) -> list[ScheduledChunk]:
        chunks: list[ScheduledChunk] = []
        i = 0  # requests waiting for a storage prefetch stay queued; the next may go first
        self.waited_for_storage = False
        while (
            i < len(self.waiting)
            and budget > 0
            and len(self.running) < self.cfg.max_running_requests
        ):
            req = self.waiting[i]
            reusable = req.cacheable_ids
            req.kv = h = self.kv.match(reusable)
            if self.kv.wait_for_storage(reusable, h, busy=bool(self.running or chunks)):
                # Its prefill is this step's work all the same: fetch for the requests that
                # would run next, not for the whole queue (their pages would crowd the host).
                budget -= req.num_tokens - h.computed - h.host_hit
                self.waited_for_storage = True
                req.kv = self.kv.release(h, req.all_ids, keep_in_cache=False)
                i += 1
                continue
            cached = h.computed + h.host_hit
            n = min(req.num_tokens - cached, budget)
            need = pages_for(cached + n, self.kv.page_size) - len(h.pages)
            # Keep a page per running request in hand so admission does not force preemption;
            # and wait, rather than recompute, while the host part cannot be loaded back.
            if need + reserve > self.kv.available_pages() or not self._load_back(req):
                req.kv = self.kv.release(h, req.all_ids, keep_in_cache=False)
                break
            n = min(req.remaining, budget)  # more to compute if the host part stayed behind
            # A request back from preemption verifies the draft it had after the tokens it
            # recomputes (a partial page is not kept), as if it had kept running.
            back = n == req.remaining and bool(req.output_ids)
            draft = self._draft(req) if back else ()
            if not self.kv.grow(h, self._reach(req, n + len(draft))):
                req.kv = self.kv.release(h, req.all_ids, keep_in_cache=False)
                break
            del self.waiting[i]
            self.kv.commit(h, first_admission=req.cached_tokens is None)
            self._start(req, h.cached)
            chunks.append(ScheduledChunk(req, n, draft))
            budget -= n
            reserve += 1
        return chunks

    def _load_back(self, req: Request) -> bool:
        """Load the host part; on failure go ahead without it only when nothing else runs."""
        if not req.kv.host_hit:
            return True
        return self.kv.load_back(req.kv) or not self.running

    def _start(self, req: Request, cached: int) -> None:
        if req.cached_tokens is None:
            req.cached_tokens = cached
            self.stats.num_prompt_tokens += len(req.prompt_ids)
            self.stats.num_cached_tokens += cached
        req.status = Status.RUNNING
        self.running.append(req)

    def record_computed(self, req: Request, num_tokens: int) -> None:
        """Advance `req` by a computed chunk; count tokens it had computed before a preemption."""
        start, end = req.num_computed, req.num_computed + num_tokens
        self.stats.num_recomputed_tokens += max(0, min(end, req.max_computed) - start)
        self.kv.advance(req.kv, num_tokens)
        req.max_computed = max(req.max_computed, end)

    def finish(self, req: Request, reason: str) -> None:
        req.status, req.finish_reason = Status.FINISHED, reason
        req.kv = self.kv.release(req.kv, req.all_ids, keep_in_cache=True)
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
