"""The field's serving workloads, built in token space from their own seeded generators.

Every generator is a pure function of its arguments: the same arguments give the same token ids,
on any machine. Prompts are lists of token ids drawn uniformly from `TokenSpace` (ids below
`low` are left out, so that special tokens such as BOS/EOS never appear inside a prompt).

    multiturn      SGLang `benchmark/hicache/bench_multiturn.py`: C clients × R rounds
    shared-prefix  SGLang `generated-shared-prefix`: G groups × P prompts behind a system prompt
    random         SGLang/vLLM `random`: lengths drawn from a range (two range semantics)
    trace          Mooncake trace replay: 512-token blocks by hash id, scaled

The multi-turn workload is closed-loop: round r's prompt is round r−1's prompt, then the server's
own output ids, then a new sub-question, so only its first round and its questions are fixed here;
`Conversation.prompt` builds round r from the outputs the server returned (see client.py).

One thing at some length: the workloads, each a short generator over one shared token space.
"""

from __future__ import annotations

import itertools
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from tierserve.errors import TierserveError

TRACE_DIR = Path(__file__).resolve().parents[2].parent / "shared/data/mooncake-traces"
TRACE_BLOCK_TOKENS = 512  # one Mooncake hash id covers this many tokens
RANGE_SEMANTICS = ("sglang", "vllm")


@dataclass(frozen=True)
class TokenSpace:
    """Prompt tokens are drawn uniformly from [low, vocab_size)."""

    vocab_size: int
    low: int = 16

    def __post_init__(self) -> None:
        if self.low < 0 or self.vocab_size - self.low < 2:
            raise TierserveError(
                f"token space [{self.low}, {self.vocab_size}) is empty or too small; "
                "give --vocab-size (the model's vocabulary size)",
                field="vocab_size",
            )

    def draw(self, rng: np.random.Generator, n: int) -> list[int]:
        return rng.integers(self.low, self.vocab_size, size=n).tolist()


@dataclass(frozen=True)
class Request:
    """One independent request (shared-prefix, random, trace)."""

    index: int
    prompt: list[int]
    output_len: int
    arrival: float | None = None  # seconds after the start (trace replay); None: by the rate
    group: int = 0  # shared-prefix group; 0 elsewhere


@dataclass(frozen=True)
class Conversation:
    """One multi-turn client: its first prompt, and one sub-question per later round."""

    client: int
    first: list[int]
    questions: list[list[int]]
    output_len: int

    @property
    def rounds(self) -> int:
        return len(self.questions) + 1

    def prompt(self, round_: int, outputs: list[list[int]]) -> list[int]:
        """Round `round_`'s prompt, given the server's output ids of the rounds before it:
        first + out_0 + q_1 + out_1 + q_2 + ... + out_{r-1} + q_r."""
        if len(outputs) < round_:
            raise ValueError(f"round {round_} needs {round_} earlier outputs, got {len(outputs)}")
        prompt = list(self.first)
        for r in range(round_):
            prompt += outputs[r]
            prompt += self.questions[r]
        return prompt


@dataclass(frozen=True)
class Workload:
    kind: str
    params: dict[str, Any]
    requests: list[Request] = field(default_factory=list)
    conversations: list[Conversation] = field(default_factory=list)

    @property
    def multiturn(self) -> bool:
        return bool(self.conversations)

    @property
    def rounds(self) -> int:
        return max((c.rounds for c in self.conversations), default=1)

    @property
    def num_requests(self) -> int:
        if self.multiturn:
            return sum(c.rounds for c in self.conversations)
        return len(self.requests)

    def kv_tokens(self) -> int:
        """Tokens of KV needed to cache the whole workload at once, shared prefixes counted once
        (for multi-turn: every conversation's final history, outputs included)."""
        if self.multiturn:
            return sum(
                len(c.first) + sum(map(len, c.questions)) + c.rounds * c.output_len
                for c in self.conversations
            )
        # distinct nodes of the prompts' token trie = Σ len − Σ lcp(neighbours in sorted order)
        prompts = sorted(r.prompt for r in self.requests)
        shared = sum(_lcp(a, b) for a, b in itertools.pairwise(prompts))
        return sum(map(len, prompts)) - shared + sum(r.output_len for r in self.requests)

    def max_request_tokens(self) -> int:
        """The longest prompt + output of any one request."""
        if self.multiturn:
            return max(
                len(c.first) + sum(map(len, c.questions)) + c.rounds * c.output_len
                for c in self.conversations
            )
        return max(len(r.prompt) + r.output_len for r in self.requests)

    def input_tokens(self) -> int:
        """Prompt tokens of the whole run (multi-turn: assuming every output is full length)."""
        if self.multiturn:
            total = 0
            for c in self.conversations:
                length = len(c.first)
                for r in range(c.rounds):
                    if r:
                        length += c.output_len + len(c.questions[r - 1])
                    total += length
            return total
        return sum(len(r.prompt) for r in self.requests)


def _lcp(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def _positive(**values: float) -> None:
    for name, value in values.items():
        if value <= 0:
            raise TierserveError(f"{name} must be > 0, got {value}", field=name)


# --- multiturn ----------------------------------------------------------------------------


def multiturn(
    space: TokenSpace,
    *,
    clients: int,
    rounds: int,
    request_length: int,
    output_length: int,
    sub_question_length: int = 0,
    seed: int = 0,
) -> Workload:
    """SGLang bench_multiturn in token space. Each client's round 0 is `request_length` tokens;
    each later round appends the server's `output_length` output ids (ignore_eos) and a new
    `sub_question_length`-token question (0 = `request_length`, as in SGLang). Round r's prompt
    is therefore L + r(O+S) tokens, and round r−1's prompt plus its output is a prefix of it."""
    sub = sub_question_length or request_length
    _positive(
        clients=clients,
        rounds=rounds,
        request_length=request_length,
        output_length=output_length,
        sub_question_length=sub,
    )
    rng = np.random.default_rng(seed)
    conversations = [
        Conversation(
            client=i,
            first=space.draw(rng, request_length),
            questions=[space.draw(rng, sub) for _ in range(rounds - 1)],
            output_len=output_length,
        )
        for i in range(clients)
    ]
    params = {
        "clients": clients,
        "rounds": rounds,
        "request_length": request_length,
        "sub_question_length": sub,
        "output_length": output_length,
        "seed": seed,
    }
    return Workload("multiturn", params, conversations=conversations)


# --- shared prefix ------------------------------------------------------------------------


def shared_prefix(
    space: TokenSpace,
    *,
    groups: int,
    prompts_per_group: int,
    system_prompt_len: int,
    question_len: int,
    output_len: int,
    seed: int = 0,
) -> Workload:
    """SGLang generated-shared-prefix: `groups` system prompts of `system_prompt_len` tokens, each
    followed by `prompts_per_group` distinct `question_len`-token questions; every request asks
    for `output_len` tokens; the G·P requests are shuffled (seeded)."""
    _positive(
        groups=groups,
        prompts_per_group=prompts_per_group,
        system_prompt_len=system_prompt_len,
        question_len=question_len,
        output_len=output_len,
    )
    rng = np.random.default_rng(seed)
    items = []
    for g in range(groups):
        system = space.draw(rng, system_prompt_len)
        for _ in range(prompts_per_group):
            items.append((g, system + space.draw(rng, question_len)))
    order = rng.permutation(len(items)).tolist()
    requests = [
        Request(index=i, prompt=items[j][1], output_len=output_len, group=items[j][0])
        for i, j in enumerate(order)
    ]
    params = {
        "groups": groups,
        "prompts_per_group": prompts_per_group,
        "system_prompt_len": system_prompt_len,
        "question_len": question_len,
        "output_len": output_len,
        "seed": seed,
    }
    return Workload("shared-prefix", params, requests=requests)


# --- random -------------------------------------------------------------------------------


def length_range(length: int, ratio: float, semantics: str) -> tuple[int, int]:
    """Inclusive [lo, hi] that a length is drawn from, uniformly.

    sglang (bench_serving --random-range-ratio): [max(floor(L·ratio), 1), L]; ratio in [0, 1];
        ratio 1 is a fixed length L.
    vllm (benchmarks --random-range-ratio):     [max(floor(L·(1−ratio)), 1), ceil(L·(1+ratio))];
        ratio in [0, 1); ratio 0 is a fixed length L.
    """
    if semantics == "sglang":
        if not 0.0 <= ratio <= 1.0:
            raise TierserveError(f"sglang range ratio must be in [0, 1], got {ratio}", "ratio")
        return max(math.floor(length * ratio), 1), length
    if semantics == "vllm":
        if not 0.0 <= ratio < 1.0:
            raise TierserveError(f"vllm range ratio must be in [0, 1), got {ratio}", "ratio")
        return max(math.floor(length * (1 - ratio)), 1), math.ceil(length * (1 + ratio))
    raise TierserveError(f"range semantics must be one of {RANGE_SEMANTICS}", "range_semantics")


def random_requests(
    space: TokenSpace,
    *,
    num_prompts: int,
    input_len: int,
    output_len: int,
    range_ratio: float = 1.0,
    semantics: str = "sglang",
    seed: int = 0,
) -> Workload:
    """`num_prompts` independent prompts of random tokens; input and output lengths each drawn
    uniformly from `length_range(…, range_ratio, semantics)` (default: SGLang's, ratio 1 =
    fixed lengths)."""
    _positive(num_prompts=num_prompts, input_len=input_len, output_len=output_len)
    in_lo, in_hi = length_range(input_len, range_ratio, semantics)
    out_lo, out_hi = length_range(output_len, range_ratio, semantics)
    rng = np.random.default_rng(seed)
    in_lens = rng.integers(in_lo, in_hi + 1, size=num_prompts).tolist()
    out_lens = rng.integers(out_lo, out_hi + 1, size=num_prompts).tolist()
    requests = [
        Request(index=i, prompt=space.draw(rng, n_in), output_len=n_out)
        for i, (n_in, n_out) in enumerate(zip(in_lens, out_lens, strict=True))
    ]
    params = {
        "num_prompts": num_prompts,
        "input_len": input_len,
        "output_len": output_len,
        "range_ratio": range_ratio,
        "range_semantics": semantics,
        "input_range": [in_lo, in_hi],
        "output_range": [out_lo, out_hi],
        "seed": seed,
    }
    return Workload("random", params, requests=requests)


# --- trace --------------------------------------------------------------------------------


def trace_path(name_or_file: str | Path | None) -> Path:
    """A trace file: an explicit path, or a name in the Mooncake folder ("conversation" →
    conversation_trace.jsonl)."""
    if name_or_file is None:
        name_or_file = "conversation"
    path = Path(name_or_file)
    if not path.suffix:
        path = TRACE_DIR / f"{name_or_file}_trace.jsonl"
    if not path.is_file():
        raise TierserveError(f"trace file {path} does not exist; give --trace-file", "trace_file")
    return path


def trace(
    space: TokenSpace,
    *,
    path: str | Path | None = None,
    num_requests: int = 100,
    start: int = 0,
    block_scale: float = 1 / 32,
    length_scale: float = 1 / 32,
    time_scale: float = 1.0,
    seed: int = 0,
    context_length: int | None = None,
) -> Workload:
    """Replay lines [start, start+num_requests) of a Mooncake trace.

    Each hash id becomes a block of round(512·block_scale) tokens drawn from an RNG keyed by
    (seed, id), so equal ids give equal blocks and the trace's prefix sharing is kept. A request's
    prompt is its blocks concatenated and cut to round(input_length·length_scale) tokens (padded
    with tokens unique to the request if its blocks are too short, which happens only when
    length_scale > block_scale); its output is round(output_length·length_scale) tokens (≥ 1);
    it arrives at (timestamp − first timestamp)·time_scale milliseconds after the start.

    With `context_length` (the served model's), a request the context cannot hold after scaling
    keeps its output and loses the end of its prompt (counted as `clipped`), or is left out when
    its output alone does not fit (`skipped`): a benchmark measures the cache, not 400s.
    """
    _positive(
        num_requests=num_requests,
        block_scale=block_scale,
        length_scale=length_scale,
        time_scale=time_scale,
    )
    if start < 0:
        raise TierserveError(f"trace start must be >= 0, got {start}", "trace_start")
    file = trace_path(path)
    rows = []
    with file.open() as f:
        for i, line in enumerate(f):
            if i < start:
                continue
            if len(rows) == num_requests:
                break
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except ValueError:
                    message = f"{file} line {i + 1} is not JSON (a trace has one object a line)"
                    raise TierserveError(message, "trace_file") from None
    if not rows:
        raise TierserveError(f"{file} has no lines from {start}", "trace_start")
    block_tokens = max(1, round(TRACE_BLOCK_TOKENS * block_scale))
    blocks: dict[int, list[int]] = {}

    def block(hash_id: int) -> list[int]:
        if hash_id not in blocks:
            blocks[hash_id] = space.draw(np.random.default_rng([seed, hash_id]), block_tokens)
        return blocks[hash_id]

    t0 = rows[0]["timestamp"]
    requests: list[Request] = []
    clipped = skipped = 0
    for i, row in enumerate(rows):
        n_in = max(1, round(row["input_length"] * length_scale))
        n_out = max(1, round(row["output_length"] * length_scale))
        if context_length is not None and n_in + n_out > context_length:
            if n_out >= context_length:
                skipped += 1
                continue
            n_in, clipped = context_length - n_out, clipped + 1
        prompt: list[int] = []
        for h in row["hash_ids"]:
            if len(prompt) >= n_in:
                break
            prompt += block(h)
        if len(prompt) < n_in:  # 2**32 keeps pad streams apart from block streams
            pad_rng = np.random.default_rng([seed, 2**32 + start + i])
            prompt += space.draw(pad_rng, n_in - len(prompt))
        requests.append(
            Request(
                index=len(requests),
                prompt=prompt[:n_in],
                output_len=n_out,
                arrival=(row["timestamp"] - t0) / 1000.0 * time_scale,
            )
        )
    params = {
        "trace_file": str(file),
        "start": start,
        "num_requests": len(requests),
        "block_scale": block_scale,
        "block_tokens": block_tokens,
        "length_scale": length_scale,
        "time_scale": time_scale,
        "seed": seed,
        "context_length": context_length,
        "clipped": clipped,
        "skipped": skipped,
    }
    if not requests:
        raise TierserveError("every trace request's output exceeds the context", "trace")
    return Workload("trace", params, requests=requests)
