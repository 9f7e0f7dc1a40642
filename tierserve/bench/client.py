"""An async streaming load generator for OpenAI-compatible servers (tierserve, SGLang, vLLM).

Per request it records the send time, the arrival time of every non-empty streamed chunk, the
end of the stream, and the token counts and cached tokens the server reports. Two backends:

    generate  the native `POST /generate` route of tierserve and SGLang, with `input_ids`; its
              streamed chunks carry the cumulative `output_ids`, so multi-turn histories are
              extended with the server's exact output ids. A chunk is non-empty when it adds
              output ids (or text, when a server sends no ids).
    openai    `POST /v1/completions` with a token-id prompt, `stream_options.include_usage`
              and `ignore_eos` (vLLM, SGLang, tierserve). The stream carries text only, so
              multi-turn histories are extended with that text re-encoded by the model's
              tokenizer loaded locally (`--tokenizer DIR`, transformers AutoTokenizer,
              add_special_tokens=False); re-encoding can differ from the ids the server sampled,
              which may shorten the prefix a server can reuse. A chunk is non-empty when its
              text is.

Scheduling (see docs/bench.md): at most `max_in_flight` requests in flight; sends spaced by
exponential gaps of mean 1/request_rate (Poisson arrivals; inf = no gaps); trace requests are
sent at their own arrival times. Multi-turn follows SGLang bench_multiturn: a ready queue (popped
at random or FIFO) holds each client's next round, which joins the queue when the previous round
finishes; with `round_barrier`, round r+1 of every client waits until all clients finished r.

One thing at some length: one client, whose two backends share every timing rule.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from tierserve.bench.workloads import Conversation, Request, Workload
from tierserve.errors import TierserveError

BACKENDS = ("generate", "openai")
QUEUE_POLICIES = ("random", "fifo")


@dataclass
class RequestRecord:
    """One request as the client saw it; times are seconds since the run's start."""

    index: int  # order of sending
    client: int  # multi-turn client; the request's index otherwise
    round: int
    group: int
    prompt_len: int
    max_tokens: int
    send: float = 0.0
    chunk_times: list[float] = field(default_factory=list)  # non-empty chunks only
    end: float | None = None
    prompt_tokens: int | None = None  # as the server reports them
    output_tokens: int = 0
    cached_tokens: int | None = None
    error: str | None = None
    prompt: list[int] = field(default_factory=list, repr=False)
    output_ids: list[int] = field(default_factory=list, repr=False)

    @property
    def ok(self) -> bool:
        return self.error is None and self.end is not None and bool(self.chunk_times)

    @property
    def first(self) -> float | None:
        return self.chunk_times[0] if self.chunk_times else None

    def to_dict(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "client": self.client,
            "round": self.round,
            "group": self.group,
            "prompt_len": self.prompt_len,
            "max_tokens": self.max_tokens,
            "send": self.send,
            "chunk_times": self.chunk_times,
            "end": self.end,
            "prompt_tokens": self.prompt_tokens,
            "output_tokens": self.output_tokens,
            "cached_tokens": self.cached_tokens,
            "error": self.error,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RequestRecord:
        return cls(**d)


@dataclass(frozen=True)
class LoadOptions:
    backend: str = "generate"
    max_in_flight: int = 0  # 0: no bound
    request_rate: float = math.inf  # requests per second, Poisson; inf: no gaps
    round_barrier: bool = False
    queue_policy: str = "random"  # multi-turn ready queue, as SGLang's --ready-queue-policy
    seed: int = 0
    temperature: float = 0.0
    model: str | None = None  # the `model` field for the openai backend (default: /v1/models)
    tokenizer: str | None = None  # openai backend, multi-turn: re-encode output text
    timeout_s: float = 1800.0
    flush_before: bool = True  # POST /flush_cache before the measured run

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise TierserveError(f"backend must be one of {BACKENDS}", "backend")
        if self.queue_policy not in QUEUE_POLICIES:
            raise TierserveError(f"queue policy must be one of {QUEUE_POLICIES}", "queue_policy")
        if self.max_in_flight < 0:
            raise TierserveError("max_in_flight must be >= 0 (0: no bound)", "max_in_flight")
        if not self.request_rate > 0:
            raise TierserveError("request_rate must be > 0 (inf: no gaps)", "request_rate")
        if not self.timeout_s > 0:  # NaN too
            raise TierserveError(f"timeout must be > 0 s, got {self.timeout_s}", "timeout")


@dataclass
class RunResult:
    url: str
    options: dict[str, Any]
    workload: dict[str, Any]
    started_at: float  # wall clock (time.time()) of the start
    duration: float  # first send → last completion, seconds
    records: list[RequestRecord]
    server_metrics_before: dict[str, float] | None = None
    server_metrics_after: dict[str, float] | None = None


# --- server helpers -----------------------------------------------------------------------


def parse_prometheus(text: str) -> dict[str, float]:
    """`name{label=value,...}` → value, for every sample of a Prometheus text page."""
    from prometheus_client.parser import text_string_to_metric_families

    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
            values[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return values


async def scrape_metrics(client: httpx.AsyncClient, url: str) -> dict[str, float] | None:
    """The server's /metrics, or None when it has none that tierserve understands."""
    try:
        r = await client.get(f"{url}/metrics", timeout=10)
        if r.status_code != 200:
            return None
        values = parse_prometheus(r.text)
    except (httpx.HTTPError, ValueError):
        return None
    return values if any(k.startswith("tierserve_") for k in values) else None


async def flush_cache(client: httpx.AsyncClient, url: str) -> bool:
    """POST /flush_cache (tierserve, SGLang); vLLM's dev-mode /reset_prefix_cache as fallback."""
    for route in ("/flush_cache", "/reset_prefix_cache"):
        try:
            r = await client.post(f"{url}{route}", timeout=60)
            if r.status_code == 200:
                return True
        except httpx.HTTPError:
            pass
    return False


async def served_model(client: httpx.AsyncClient, url: str) -> str | None:
    try:
        r = await client.get(f"{url}/v1/models", timeout=10)
        data = r.json().get("data") or []
        return data[0]["id"] if data else None
    except (httpx.HTTPError, ValueError, KeyError):
        return None


# --- one request --------------------------------------------------------------------------


class _Sender:
    def __init__(self, client: httpx.AsyncClient, url: str, opts: LoadOptions, t0: float) -> None:
        self.client, self.url, self.opts, self.t0 = client, url, opts, t0
        self.tokenizer: Any = None  # a transformers tokenizer, where output text is re-encoded
        self.model = opts.model
        self.need_ids = False  # multi-turn histories need the output ids
        self.saw_ids = False

    def now(self) -> float:
        return time.perf_counter() - self.t0

    def payload(self, prompt: list[int], max_tokens: int) -> tuple[str, dict[str, Any]]:
        if self.opts.backend == "generate":
            params = {
                "max_new_tokens": max_tokens,
                "temperature": self.opts.temperature,
                "ignore_eos": True,
            }
            body = {"input_ids": prompt, "sampling_params": params, "stream": True}
            return f"{self.url}/generate", body
        body = {
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": self.opts.temperature,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if self.model is not None:
            body["model"] = self.model
        return f"{self.url}/v1/completions", body

    async def send(self, rec: RequestRecord) -> RequestRecord:
        url, body = self.payload(rec.prompt, rec.max_tokens)
        text = ""
        rec.send = self.now()
        try:
            async with self.client.stream("POST", url, json=body) as resp:
                if resp.status_code != 200:
                    detail = (await resp.aread()).decode(errors="replace")[:300]
                    rec.error = f"HTTP {resp.status_code}: {detail}"
                    if "StringOrArray" in detail:  # sglang-router's schema for `prompt`
                        rec.error += " (a router takes text prompts only: use --backend generate)"
                    return rec
                async for line in resp.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        break
                    arrived = self.now()
                    chunk = json.loads(data)
                    if self.opts.backend == "generate":
                        text = self._native_chunk(rec, chunk, arrived, text)
                    else:
                        text = self._openai_chunk(rec, chunk, arrived, text)
            rec.end = self.now()
        except (httpx.HTTPError, ValueError) as err:
            rec.error = f"{type(err).__name__}: {err}"
            return rec
        if self.opts.backend == "openai":
            rec.output_ids = self._encode(text) if self.tokenizer is not None else []
        elif self.need_ids and not self.saw_ids:
            rec.error = (
                "the /generate stream carries no output ids, which multiturn needs (SGLang: "
                "--skip-tokenizer-init or --return-token-ids; or use --backend openai)"
            )
            return rec
            if not rec.output_tokens:
                rec.output_tokens = len(rec.chunk_times)
        if not rec.chunk_times:
            rec.error = "the stream carried no output"
        return rec

    def _native_chunk(
        self, rec: RequestRecord, chunk: dict[str, Any], arrived: float, text: str
    ) -> str:
        ids = chunk.get("output_ids", chunk.get("token_ids"))  # SGLang names them either way
        new_text = chunk.get("text") or ""
        meta = chunk.get("meta_info") or {}
        if ids is not None:
            self.saw_ids = True
            prev = rec.output_ids
            total = meta.get("completion_tokens")
            if total is not None:
                cumulative = len(ids) == total
            else:
                cumulative = len(ids) >= len(prev) and ids[: len(prev)] == prev
            ids = list(ids) if cumulative else prev + list(ids)
            grew = len(ids) > len(prev)
            rec.output_ids = ids
        else:
            grew = len(new_text) > len(text)
        if grew:
            rec.chunk_times.append(arrived)
        rec.prompt_tokens = meta.get("prompt_tokens", rec.prompt_tokens)
        rec.cached_tokens = meta.get("cached_tokens", rec.cached_tokens)
        rec.output_tokens = meta.get("completion_tokens", len(rec.output_ids))
        return new_text

    def _openai_chunk(
        self, rec: RequestRecord, chunk: dict[str, Any], arrived: float, text: str
    ) -> str:
        if "error" in chunk:
            raise ValueError(f"server error in stream: {chunk['error']}")
        choices = chunk.get("choices") or []
        delta = (choices[0].get("text") or "") if choices else ""
        if delta:
            rec.chunk_times.append(arrived)
        usage = chunk.get("usage")
        if usage:
            rec.prompt_tokens = usage.get("prompt_tokens")
            rec.output_tokens = usage.get("completion_tokens") or 0
            details = usage.get("prompt_tokens_details") or {}
            rec.cached_tokens = details.get("cached_tokens")
        return text + delta

    def _encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False).input_ids


def _load_tokenizer(path: str | None) -> Any:
    if path is None:
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


# --- schedules ----------------------------------------------------------------------------


async def _run_requests(
    sender: _Sender, requests: list[Request], opts: LoadOptions, rng: random.Random
) -> list[RequestRecord]:
    sem = asyncio.Semaphore(opts.max_in_flight) if opts.max_in_flight else None
    tasks: list[asyncio.Task] = []
    clock = 0.0

    async def one(rec: RequestRecord) -> RequestRecord:
        try:
            return await sender.send(rec)
        finally:
            if sem is not None:
                sem.release()

    for i, req in enumerate(requests):
        if req.arrival is not None:
            clock = req.arrival
        elif i and math.isfinite(opts.request_rate):
            clock += rng.expovariate(opts.request_rate)
        wait = clock - sender.now()
        if wait > 0:
            await asyncio.sleep(wait)
        if sem is not None:
            await sem.acquire()
        rec = RequestRecord(
            index=i,
            client=req.index,
            round=0,
            group=req.group,
            prompt_len=len(req.prompt),
            max_tokens=req.output_len,
            prompt=req.prompt,
        )
        tasks.append(asyncio.create_task(one(rec)))
    return list(await asyncio.gather(*tasks))


async def _run_conversations(
    sender: _Sender, convs: list[Conversation], opts: LoadOptions, rng: random.Random
) -> list[RequestRecord]:
    outputs: dict[int, list[list[int]]] = {c.client: [] for c in convs}
    by_client = {c.client: c for c in convs}
    ready: list[tuple[int, int]] = [(c.client, 0) for c in convs]
    held: list[tuple[int, int]] = []  # round barrier: next rounds waiting for the others
    finished_in_round: dict[int, int] = {}
    alive = {c.client for c in convs}  # a failed round ends its conversation
    records: list[RequestRecord] = []
    in_flight = 0
    wake = asyncio.Event()
    tasks: set[asyncio.Task] = set()

    def release_barrier(round_: int) -> None:
        expected = sum(1 for c in convs if c.client in alive and c.rounds > round_)
        if finished_in_round.get(round_, 0) >= expected:
            ready.extend(held)
            held.clear()

    def done(rec: RequestRecord) -> None:
        nonlocal in_flight
        in_flight -= 1
        conv = by_client[rec.client]
        if rec.ok:
            outputs[rec.client].append(rec.output_ids)
            if rec.round + 1 < conv.rounds:
                (held if opts.round_barrier else ready).append((rec.client, rec.round + 1))
            finished_in_round[rec.round] = finished_in_round.get(rec.round, 0) + 1
        else:
            alive.discard(rec.client)
        if opts.round_barrier:
            release_barrier(rec.round)
        wake.set()

    async def one(rec: RequestRecord) -> None:
        done(await sender.send(rec))

    total = sum(c.rounds for c in convs)
    sent = 0
    while True:
        if not ready or (opts.max_in_flight and in_flight >= opts.max_in_flight):
            if in_flight == 0 and not ready and not held:
                break
            wake.clear()
            await wake.wait()
            continue
        pick = rng.randrange(len(ready)) if opts.queue_policy == "random" else 0
        client, round_ = ready.pop(pick)
        conv = by_client[client]
        prompt = conv.prompt(round_, outputs[client])
        rec = RequestRecord(
            index=sent,
            client=client,
            round=round_,
            group=0,
            prompt_len=len(prompt),
            max_tokens=conv.output_len,
            prompt=prompt,
        )
        records.append(rec)
        in_flight += 1
        sent += 1
        task = asyncio.create_task(one(rec))
        tasks.add(task)
        task.add_done_callback(tasks.discard)
        if sent < total and math.isfinite(opts.request_rate):
            await asyncio.sleep(rng.expovariate(opts.request_rate))
    if tasks:
        await asyncio.gather(*tasks)
    return records


# --- a whole run --------------------------------------------------------------------------


async def run_load_async(url: str, workload: Workload, opts: LoadOptions) -> RunResult:
    url = url.rstrip("/")
    if opts.backend == "openai" and workload.multiturn and opts.tokenizer is None:
        raise TierserveError(
            "multiturn over the openai backend re-encodes the output text: give --tokenizer DIR "
            "(or use --backend generate with tierserve or SGLang)",
            "tokenizer",
        )
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    timeout = httpx.Timeout(opts.timeout_s, connect=30)
    async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
        if opts.flush_before:
            await flush_cache(client, url)
        before = await scrape_metrics(client, url)
        t0 = time.perf_counter()
        started_at = time.time()
        sender = _Sender(client, url, opts, t0)
        if opts.backend == "openai":
            sender.tokenizer = await asyncio.to_thread(_load_tokenizer, opts.tokenizer)
            if sender.model is None:
                sender.model = await served_model(client, url)
        rng = random.Random(opts.seed)
        sender.need_ids = workload.multiturn
        if workload.multiturn:
            records = await _run_conversations(sender, workload.conversations, opts, rng)
        else:
            records = await _run_requests(sender, workload.requests, opts, rng)
        after = await scrape_metrics(client, url)
    ends = [r.end for r in records if r.end is not None]
    sends = [r.send for r in records]
    duration = (max(ends) - min(sends)) if ends and sends else 0.0
    options = {k: getattr(opts, k) for k in opts.__dataclass_fields__}
    workload_info = {"kind": workload.kind, **workload.params}
    return RunResult(url, options, workload_info, started_at, duration, records, before, after)


def run_load(url: str, workload: Workload, opts: LoadOptions) -> RunResult:
    return asyncio.run(run_load_async(url, workload, opts))


async def _warmup_async(url: str, opts: LoadOptions, prompts: list[list[int]]) -> None:
    async with httpx.AsyncClient(timeout=httpx.Timeout(300, connect=30)) as client:
        sender = _Sender(client, url.rstrip("/"), opts, time.perf_counter())
        if opts.backend == "openai" and sender.model is None:
            sender.model = await served_model(client, url.rstrip("/"))
        for i, p in enumerate(prompts):
            rec = RequestRecord(i, i, 0, 0, len(p), 4, prompt=p)
            rec = await sender.send(rec)
            if rec.error:
                raise TierserveError(f"warm-up request failed: {rec.error}", "url")
        await flush_cache(client, url.rstrip("/"))


def warmup(url: str, opts: LoadOptions, prompts: list[list[int]]) -> None:
    """Send a few short requests one by one (first-call costs), then empty the cache."""
    asyncio.run(_warmup_async(url, opts, prompts))
