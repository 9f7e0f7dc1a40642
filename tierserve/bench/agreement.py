"""How closely one engine follows another, token by token: teacher-forced greedy agreement
(used for fp8 KV against full precision, in tests/test_kv_dtype.py and
benchmarks/fp8_agreement.py)."""

from __future__ import annotations

from tierserve.engine import LLM
from tierserve.sampling_params import SamplingParams

# Story openings the demo model (trained on Shakespeare) continues with conviction.
PROMPTS = [
    "Once upon a time", "The weather today", "In a small village", "She opened the door and",
    "The king said", "It was a dark night", "My dear friend", "The old man walked",
    "When the sun rose", "He looked at her", "There was once a", "The children played",
    "In the morning", "A letter came", "The ship sailed", "Long ago in",
]  # fmt: skip


def greedy_agreement(reference: LLM, candidate: LLM, prompts: list[str], steps: int) -> float:
    """At each of `steps` greedy steps of `reference`, given its history so far, the share of
    steps where `candidate` picks the same next token. Run freely, one different token would
    change everything after it; given the same history, each step is judged on its own."""
    greedy = SamplingParams(max_tokens=steps, temperature=0, ignore_eos=True)
    one = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    agree = 0
    for prompt, ref in zip(prompts, reference.generate(prompts, greedy), strict=True):
        ids = candidate.tokenizer(prompt).input_ids
        histories = [ids + ref.token_ids[:i] for i in range(steps)]
        outs = candidate.generate(histories, [one] * steps)  # prefix hits make these cheap
        agree += sum(o.token_ids[0] == t for o, t in zip(outs, ref.token_ids, strict=True))
    return agree / (steps * len(prompts))
