"""Logprobs of generated tokens: the model's raw distribution (vLLM's default), equal to
transformers' log_softmax at the same positions, whatever penalties or temperature do to the
choice; and OpenAI's completions and chat shapes through a real server, streamed and not."""

from __future__ import annotations

import openai
import pytest
import torch
import transformers

from tests.conftest import Server, random_prompts
from tierserve import LLM, SamplingParams, TierserveError

PROMPTS = random_prompts(3, [5, 60, 200], seed=41)


@pytest.fixture(scope="module")
def llm(llama_dir) -> LLM:
    return LLM(str(llama_dir), max_total_tokens=4096)


def hf_logprobs(llama_dir, prompt: list[int], output: list[int]) -> torch.Tensor:
    """log_softmax of transformers' logits at each generated position: [len(output), vocab]."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(llama_dir).eval()
    ids = torch.tensor([prompt + output])
    with torch.no_grad():
        logits = hf(ids).logits[0, len(prompt) - 1 : -1].float()
    return logits.log_softmax(-1)


@pytest.mark.parametrize(
    "extra",
    [
        {"temperature": 0},
        {"temperature": 0.8, "seed": 3, "repetition_penalty": 1.5, "frequency_penalty": 1.0},
    ],
)
def test_logprobs_are_the_raw_distribution(llama_dir, llm, extra):
    params = SamplingParams(max_tokens=12, ignore_eos=True, logprobs=5, **extra)
    for prompt, out in zip(PROMPTS, llm.generate(PROMPTS, params), strict=True):
        ref = hf_logprobs(llama_dir, prompt, out.token_ids)
        assert [lp.token_id for lp in out.logprobs] == out.token_ids
        chosen = torch.tensor([lp.logprob for lp in out.logprobs])
        torch.testing.assert_close(chosen, ref[torch.arange(12), out.token_ids], atol=1e-4, rtol=0)
        for step, lp in enumerate(out.logprobs):
            values, ids = ref[step].topk(5)
            assert [t for t, _ in lp.top] == ids.tolist()
            torch.testing.assert_close(
                torch.tensor([v for _, v in lp.top]), values, atol=1e-4, rtol=0
            )


def test_without_logprobs_nothing_is_computed(llm):
    out = llm.generate(PROMPTS[0], SamplingParams(max_tokens=4, temperature=0))[0]
    assert out.logprobs == []


@pytest.mark.parametrize("bad", [-1, 21, 2.5, True])
def test_logprobs_out_of_range_are_refused(bad):
    with pytest.raises(TierserveError) as err:
        SamplingParams(logprobs=bad)
    assert err.value.field == "logprobs"


def test_openai_shapes_streamed_and_not(llama_dir, llm):
    prompt = PROMPTS[1]
    offline = llm.generate(
        prompt, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=3)
    )[0]
    want = [lp.logprob for lp in offline.logprobs]
    s = Server(llama_dir, "--max-total-tokens", "4096")
    try:
        c = openai.OpenAI(base_url=f"{s.url}/v1", api_key="x", max_retries=0)
        model, extra = llama_dir.name, {"ignore_eos": True}
        kw = dict(model=model, prompt=prompt, max_tokens=6, temperature=0, extra_body=extra)
        whole = c.completions.create(logprobs=3, **kw).choices[0].logprobs
        assert whole.token_logprobs == pytest.approx(want, abs=1e-6)
        # The legacy format keys alternatives by text: pieces that decode alike (partial UTF-8
        # bytes all read "\ufffd") share one key, as in vLLM.
        assert len(whole.tokens) == 6 and all(1 <= len(t) <= 3 for t in whole.top_logprobs)
        assert whole.text_offset[0] == 0
        streamed = [ch.choices[0].logprobs for ch in c.completions.create(
            logprobs=3, stream=True, **kw) if ch.choices and ch.choices[0].logprobs]  # fmt: skip
        assert [v for lp in streamed for v in lp.token_logprobs] == pytest.approx(want, abs=1e-6)

        messages = [{"role": "user", "content": "hello there"}]
        chat = dict(model=model, messages=messages, max_tokens=5, temperature=0, extra_body=extra)
        got = c.chat.completions.create(logprobs=True, top_logprobs=2, **chat)
        content = got.choices[0].logprobs.content
        assert len(content) == 5 and all(len(t.top_logprobs) == 2 for t in content)
        assert all(t.logprob <= 0 and t.bytes == list(t.token.encode()) for t in content)
        chunks = c.chat.completions.create(logprobs=True, top_logprobs=2, stream=True, **chat)
        pieces = [t for ch in chunks if ch.choices and ch.choices[0].logprobs
                  for t in ch.choices[0].logprobs.content]  # fmt: skip
        assert [t.logprob for t in pieces] == pytest.approx([t.logprob for t in content])
        with pytest.raises(openai.BadRequestError):
            c.chat.completions.create(top_logprobs=2, **chat)  # without logprobs: true
    finally:
        s.stop()
