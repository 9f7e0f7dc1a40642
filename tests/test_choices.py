"""`n` > 1 and batched prompts through a real server (conftest's `server` and `client`) with
the official openai client: each choice equals a single request with its seed (seed + i for
sample i), the prompt is prefilled once (the engine's counters show it), usage counts it once,
streamed and not."""

from __future__ import annotations

from collections import defaultdict

import openai
import pytest

from tests.conftest import random_prompts
from tierserve import LLM, SamplingParams

PAGE = 16


def single(offline: LLM, prompt, seed: int, max_tokens: int = 8) -> str:
    params = SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=seed, ignore_eos=True)
    return offline.generate(prompt, params)[0].text


def test_n_samples_share_one_prefill_and_equal_seeded_singles(server, client, offline, llama_dir):
    prompt = random_prompts(1, [300], seed=51)[0]
    before = server.metrics()
    got = client.completions.create(
        model=llama_dir.name, prompt=prompt, n=8, max_tokens=8, temperature=1.0, seed=7,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    after = server.metrics()
    assert [c.index for c in got.choices] == list(range(8))
    assert [c.text for c in got.choices] == [single(offline, prompt, 7 + i) for i in range(8)]
    assert len({c.text for c in got.choices}) > 1  # the seeds differ, so do the samples
    assert got.usage.prompt_tokens == len(prompt) and got.usage.completion_tokens == 64
    prompted = after["tierserve_prompt_tokens_total"] - before["tierserve_prompt_tokens_total"]
    cached = (
        after["tierserve_cached_tokens_total{tier=device}"]
        - before["tierserve_cached_tokens_total{tier=device}"]
    )
    assert prompted == 8 * len(prompt)
    assert prompted - cached <= len(prompt) + 7 * PAGE  # computed once, plus a page each


def test_a_batch_of_prompts_keeps_openais_order(client, offline, llama_dir):
    prompts = ["Once upon a time", "The server sent"]
    got = client.completions.create(
        model=llama_dir.name, prompt=prompts, n=2, max_tokens=6, temperature=1.0, seed=3,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    want = [single(offline, p, 3 + i, 6) for p in prompts for i in range(2)]
    assert [c.text for c in got.choices] == want
    assert got.usage.completion_tokens == 4 * 6


def test_streamed_choices_carry_their_index(client, offline, llama_dir):
    prompt = random_prompts(1, [40], seed=52)[0]
    chunks = client.completions.create(
        model=llama_dir.name, prompt=prompt, n=3, max_tokens=8, temperature=1.0, seed=11,
        stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
    )  # fmt: skip
    texts: dict[int, str] = defaultdict(str)
    usage = None
    for ch in chunks:
        for c in ch.choices:
            texts[c.index] += c.text
        usage = ch.usage or usage
    assert [texts[i] for i in range(3)] == [single(offline, prompt, 11 + i) for i in range(3)]
    assert usage.prompt_tokens == len(prompt) and usage.completion_tokens == 24


def test_a_seed_at_the_top_of_its_range_wraps_for_the_later_choices(client, offline, llama_dir):
    """Sample i uses seed + i within [0, 2**63): at the top, the second choice is seed 0's, not
    a refusal of a seed the client never sent."""
    top = 2**63 - 1
    got = client.completions.create(
        model=llama_dir.name, prompt="Once upon a time", n=2, max_tokens=6, temperature=1.0,
        seed=top, extra_body={"ignore_eos": True},
    )  # fmt: skip
    want = [single(offline, "Once upon a time", s, 6) for s in (top, 0)]
    assert [c.text for c in got.choices] == want


def test_chat_takes_n(client, llama_dir):
    got = client.chat.completions.create(
        model=llama_dir.name, messages=[{"role": "user", "content": "hello"}], n=3,
        max_tokens=5, temperature=1.0, seed=5, extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert [c.index for c in got.choices] == [0, 1, 2]
    assert all(c.message.role == "assistant" for c in got.choices)
    assert got.usage.completion_tokens == 15


@pytest.mark.parametrize("kw", [{"n": 0}, {"n": 129}, {"n": 64, "prompt": ["a", "b", "c"]}])
def test_too_many_choices_are_refused(client, llama_dir, kw):
    with pytest.raises(openai.BadRequestError):
        client.completions.create(
            **{"model": llama_dir.name, "prompt": "hi", "max_tokens": 2, **kw}
        )
