"""Logprobs of generated and prompt tokens: the model's raw distribution (vLLM's default), equal
to transformers' log_softmax at the same positions, whatever penalties, temperature or the
prefix cache do; and OpenAI's completions (with echo) and chat shapes through a real server,
streamed and not."""

from __future__ import annotations

import openai
import pytest
import torch
import transformers

from tests.conftest import random_prompts
from tierserve import LLM, SamplingParams, TierserveError
from tierserve.outputs import TokenLogprob

PROMPTS = random_prompts(3, [5, 60, 200], seed=41)


def hf_logprobs(llama_dir, prompt: list[int], output: list[int], start: int = -1) -> torch.Tensor:
    """log_softmax of transformers' logits at the positions that predict `output` (or, with
    `start`, every token from that one on): [tokens, vocab]."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(llama_dir).eval()
    ids = torch.tensor([prompt + output])
    first = len(prompt) - 1 if start < 0 else start - 1
    with torch.no_grad():
        logits = hf(ids).logits[0, first:-1].float()
    return logits.log_softmax(-1)


def assert_matches(lps: list[TokenLogprob], ref: torch.Tensor, targets: list[int], k: int) -> None:
    assert [lp.token_id for lp in lps] == targets
    chosen = torch.tensor([lp.logprob for lp in lps])
    rows = torch.arange(len(targets))
    torch.testing.assert_close(chosen, ref[rows, targets], atol=1e-4, rtol=0)
    for step, lp in enumerate(lps):
        values, ids = ref[step].topk(k)
        assert [t for t, _ in lp.top] == ids.tolist()
        torch.testing.assert_close(torch.tensor([v for _, v in lp.top]), values, atol=1e-4, rtol=0)


@pytest.mark.parametrize(
    "extra",
    [
        {"temperature": 0},
        {"temperature": 0.8, "seed": 3, "repetition_penalty": 1.5, "frequency_penalty": 1.0},
    ],
)
def test_logprobs_are_the_raw_distribution(llama_dir, offline, extra):
    params = SamplingParams(max_tokens=12, ignore_eos=True, logprobs=5, **extra)
    for prompt, out in zip(PROMPTS, offline.generate(PROMPTS, params), strict=True):
        ref = hf_logprobs(llama_dir, prompt, out.token_ids)
        assert_matches(out.logprobs, ref, out.token_ids, 5)


def test_without_logprobs_nothing_is_computed(offline):
    out = offline.generate(PROMPTS[0], SamplingParams(max_tokens=4, temperature=0))[0]
    assert out.logprobs == [] and out.prompt_logprobs is None


def test_prompt_logprobs_equal_transformers_with_the_prefix_cache_cold_and_warm(llama_dir):
    """Prompt chunks of 48 tokens; the second and third runs find the prompt cached, and
    still score every position (the cache's hit is not used for them)."""
    llm = LLM(str(llama_dir), max_total_tokens=4096, chunked_prefill_size=48)
    prompt = PROMPTS[2]
    ref = hf_logprobs(llama_dir, prompt, [], start=1)
    params = SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=3)
    cold = llm.generate(prompt, params)[0]
    plain = llm.generate(prompt, SamplingParams(max_tokens=1, temperature=0))[0]
    assert plain.cached_tokens > 0  # the cache would have served this prompt
    warm = llm.generate(prompt, params)[0]
    for out in (cold, warm):
        assert out.prompt_token_ids == prompt and out.prompt_logprobs is not None
        assert_matches(out.prompt_logprobs, ref, prompt[1:], 3)
    assert warm.cached_tokens == 0 and warm.token_ids == cold.token_ids


@pytest.mark.parametrize("bad", [-1, 21, 2.5, True])
def test_logprobs_out_of_range_are_refused(bad):
    with pytest.raises(TierserveError) as err:
        SamplingParams(logprobs=bad)
    assert err.value.field == "logprobs"


def test_openai_shapes_streamed_and_not(llama_dir, offline, client):
    prompt = PROMPTS[1]
    ran = offline.generate(
        prompt, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=3)
    )[0]
    want = [lp.logprob for lp in ran.logprobs]
    c, model, extra = client, llama_dir.name, {"ignore_eos": True}
    kw = dict(model=model, prompt=prompt, max_tokens=6, temperature=0, extra_body=extra)
    whole = c.completions.create(logprobs=3, **kw).choices[0].logprobs
    # A --tp-size server sums its partial products in another order: equal to float noise.
    assert whole.token_logprobs == pytest.approx(want, abs=1e-5)
    # The legacy format keys alternatives by text: pieces that decode alike (partial UTF-8
    # bytes all read "\ufffd") share one key, as in vLLM.
    assert len(whole.tokens) == 6 and all(1 <= len(t) <= 3 for t in whole.top_logprobs)
    assert whole.text_offset[0] == 0
    streamed = [ch.choices[0].logprobs for ch in c.completions.create(
        logprobs=3, stream=True, **kw) if ch.choices and ch.choices[0].logprobs]  # fmt: skip
    assert [v for lp in streamed for v in lp.token_logprobs] == pytest.approx(want, abs=1e-5)

    messages = [{"role": "user", "content": "hello there"}]
    chat = dict(model=model, messages=messages, max_tokens=5, temperature=0, extra_body=extra)
    got = c.chat.completions.create(logprobs=True, top_logprobs=2, **chat)
    content = got.choices[0].logprobs.content
    assert len(content) == 5 and all(len(t.top_logprobs) == 2 for t in content)
    assert all(t.logprob <= 0 and t.bytes == list(t.token.encode()) for t in content)
    chunks = c.chat.completions.create(logprobs=True, top_logprobs=2, stream=True, **chat)
    pieces = [t for ch in chunks if ch.choices and ch.choices[0].logprobs
              for t in ch.choices[0].logprobs.content]  # fmt: skip
    # The second request finds the prompt in the radix cache: its last prompt token runs
    # through the CPU kernel where the first ran SDPA over the whole prompt, a float32 rounding
    # apart (the completions above compare at the same tolerance).
    assert [t.logprob for t in pieces] == pytest.approx([t.logprob for t in content], abs=1e-5)
    with pytest.raises(openai.BadRequestError):
        c.chat.completions.create(top_logprobs=2, **chat)  # without logprobs: true


def test_echo_returns_the_prompt_and_its_logprobs_streamed_and_not(llama_dir, offline, client):
    """lm-eval's loglikelihood request: a batch of token-id prompts, echo, logprobs 1,
    max_tokens 1. Each choice's first token has None, the rest transformers' values; the text
    starts with the prompt."""
    prompts = [PROMPTS[0], PROMPTS[1]]
    kw = dict(model=llama_dir.name, prompt=prompts, max_tokens=1, temperature=0, echo=True)
    whole = client.completions.create(logprobs=1, **kw)
    tokenizer = offline.tokenizer
    for choice, prompt in zip(sorted(whole.choices, key=lambda c: c.index), prompts, strict=True):
        lp = choice.logprobs
        assert len(lp.tokens) == len(prompt) + 1 and lp.token_logprobs[0] is None
        assert lp.top_logprobs[0] is None and lp.text_offset[0] == 0
        ref = hf_logprobs(llama_dir, prompt, [], start=1)
        want = ref[torch.arange(len(prompt) - 1), prompt[1:]].tolist()
        assert lp.token_logprobs[1 : len(prompt)] == pytest.approx(want, abs=1e-4)
        assert choice.text.startswith(tokenizer.decode(prompt))
    streamed = client.completions.create(logprobs=1, stream=True, **kw)
    scored: dict[int, list] = {}
    for chunk in streamed:
        for choice in chunk.choices:
            scored.setdefault(choice.index, []).extend(choice.logprobs.token_logprobs)
    wanted = [c.logprobs.token_logprobs for c in sorted(whole.choices, key=lambda c: c.index)]
    for got, want in zip((scored[i] for i in range(2)), wanted, strict=True):
        # The same values to float noise: the batch each row ran in may differ between runs.
        assert got[0] is None and got[1:] == pytest.approx(want[1:], abs=1e-5)
    text = client.completions.create(model=llama_dir.name, prompt="Hello", echo=True, max_tokens=2)
    assert text.choices[0].text.startswith("Hello") and text.choices[0].logprobs is None
    # n choices of a prompt share its echoed logprobs, built once for the response.
    alone = sorted(whole.choices, key=lambda c: c.index)
    many = client.completions.create(logprobs=1, n=3, **kw)
    assert len(many.choices) == 6
    for choice in many.choices:
        one = alone[choice.index // 3].logprobs
        assert choice.logprobs.tokens == one.tokens
        assert choice.logprobs.text_offset == one.text_offset
        assert choice.logprobs.token_logprobs[1:] == pytest.approx(one.token_logprobs[1:], abs=1e-5)
    scored.clear()
    for chunk in client.completions.create(logprobs=1, n=3, stream=True, **kw):
        for choice in chunk.choices:
            scored.setdefault(choice.index, []).extend(choice.logprobs.token_logprobs)
    assert sorted(scored) == list(range(6))
    for index, got in scored.items():
        assert got[0] is None and got[1:] == pytest.approx(wanted[index // 3][1:], abs=1e-5)


def test_echo_with_max_tokens_zero_scores_the_prompt_only(llama_dir, offline, client):
    """OpenAI's legacy completions (and older lm-evaluation-harness): echo, logprobs and
    max_tokens 0 answer the prompt's logprobs, equal to transformers', and no completion
    token, streamed and not; without echo, max_tokens 0 is a 400."""
    prompt = PROMPTS[1]
    kw = dict(model=llama_dir.name, prompt=prompt, max_tokens=0, echo=True, logprobs=2)
    whole = client.completions.create(**kw)
    choice = whole.choices[0]
    lp = choice.logprobs
    assert len(lp.tokens) == len(prompt) and lp.token_logprobs[0] is None
    ref = hf_logprobs(llama_dir, prompt, [], start=1)
    want = ref[torch.arange(len(prompt) - 1), prompt[1:]].tolist()
    assert lp.token_logprobs[1:] == pytest.approx(want, abs=1e-4)
    assert choice.text == offline.tokenizer.decode(prompt)
    assert choice.finish_reason == "length"
    assert whole.usage.completion_tokens == 0 and whole.usage.prompt_tokens == len(prompt)
    chunks = list(client.completions.create(stream=True, **kw))
    streamed = [t for c in chunks for ch in c.choices for t in ch.logprobs.token_logprobs]
    assert streamed[0] is None and streamed[1:] == pytest.approx(lp.token_logprobs[1:], abs=1e-5)
    assert "".join(ch.text for c in chunks for ch in c.choices) == choice.text
    with pytest.raises(openai.BadRequestError, match="needs echo"):
        client.completions.create(model=llama_dir.name, prompt=prompt, max_tokens=0)


def test_vllms_prompt_logprobs_on_the_openai_routes_equal_transformers(llama_dir, client):
    """vLLM's `prompt_logprobs` (it was refused): per prompt token after the first, its own
    and the k likeliest tokens' logprob, rank and text, as transformers scores them; every
    choice of a prompt carries them; chat puts them at the top; no stream carries them."""
    prompt, k = PROMPTS[1], 3
    ref = hf_logprobs(llama_dir, prompt, [], start=1)
    got = client.completions.create(
        model=llama_dir.name, prompt=prompt, max_tokens=2, n=2, temperature=0,
        extra_body={"prompt_logprobs": k},
    )  # fmt: skip
    scores = got.choices[0].prompt_logprobs
    assert got.choices[1].prompt_logprobs == scores and len(scores) == len(prompt)
    assert scores[0] is None
    for step, (token, entry) in enumerate(zip(prompt[1:], scores[1:], strict=True)):
        row = ref[step]
        mine = entry[str(token)]
        assert mine["logprob"] == pytest.approx(row[token].item(), abs=1e-4)
        lowest = int((row > row[token] + 1e-4).sum()) + 1  # within float32 noise
        highest = int((row > row[token] - 1e-4).sum()) + 1
        assert lowest <= mine["rank"] <= highest
        likeliest = row.topk(k)[1].tolist()
        assert [entry[str(t)]["rank"] for t in likeliest] == list(range(1, k + 1))
        assert len(entry) == k + (token not in likeliest)
    both = client.completions.create(
        model=llama_dir.name, prompt=prompt, max_tokens=1, temperature=0, echo=True,
        logprobs=1, extra_body={"prompt_logprobs": k},
    ).choices[0]  # fmt: skip
    assert both.prompt_logprobs == scores  # the echo's logprobs shows the one it asked for
    assert all(len(top) == 1 for top in both.logprobs.top_logprobs[1:])
    chat = client.chat.completions.create(
        model=llama_dir.name, messages=[{"role": "user", "content": "hi"}], max_tokens=1,
        extra_body={"prompt_logprobs": 0, "return_token_ids": True},
    )  # fmt: skip
    top_level = chat.model_extra
    assert len(top_level["prompt_logprobs"]) == len(top_level["prompt_token_ids"])
    assert all(len(e) == 1 for e in top_level["prompt_logprobs"][1:])  # the token's own
    for extra in ({"prompt_logprobs": 21}, {"prompt_logprobs": -1}, {"prompt_logprobs": True}):
        with pytest.raises(openai.BadRequestError, match="prompt_logprobs"):
            client.completions.create(model=llama_dir.name, prompt="x", max_tokens=1,
                                      extra_body=extra)  # fmt: skip
    with pytest.raises(openai.BadRequestError, match="not streamed"):
        client.completions.create(model=llama_dir.name, prompt="x", max_tokens=1, stream=True,
                                  extra_body={"prompt_logprobs": 1})  # fmt: skip
