"""Sampling parameters, stop conditions, streaming and incremental detokenization."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.conftest import random_prompts
from tierserve import LLM, SamplingParams
from tierserve.engine.detokenizer import IncrementalDetokenizer
from tierserve.layers.sampler import sample


@pytest.fixture(scope="module")
def llm(llama_dir) -> LLM:
    return LLM(str(llama_dir), max_total_tokens=4096)


def test_filters_that_leave_one_token_are_greedy():
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0))
    greedy = logits.argmax(-1).tolist()
    for params in (
        SamplingParams(temperature=1.0, top_k=1),
        SamplingParams(temperature=1.0, top_p=1e-6),
        SamplingParams(temperature=1.0, min_p=1.0),
    ):
        gens = [torch.Generator().manual_seed(i) for i in range(4)]
        assert sample(logits, [params] * 4, gens) == greedy


def test_top_k_samples_only_the_top_tokens():
    logits = torch.randn(1, 50, generator=torch.Generator().manual_seed(1))
    top3 = set(logits[0].topk(3).indices.tolist())
    gen = torch.Generator().manual_seed(2)
    drawn = {
        sample(logits, [SamplingParams(temperature=5.0, top_k=3)], [gen])[0] for _ in range(200)
    }
    assert drawn == top3


def test_top_p_keeps_the_smallest_set_reaching_p():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    gen = torch.Generator().manual_seed(3)
    params = SamplingParams(temperature=1.0, top_p=0.7)
    drawn = {sample(probs.log(), [params], [gen])[0] for _ in range(300)}
    assert drawn == {0, 1}


def test_seeded_sampling_is_reproducible(llm):
    prompt = random_prompts(1, [12], seed=8)[0]
    a = llm.generate(prompt, SamplingParams(max_tokens=20, temperature=1.0, seed=7))[0]
    b = llm.generate(prompt, SamplingParams(max_tokens=20, temperature=1.0, seed=7))[0]
    c = llm.generate(prompt, SamplingParams(max_tokens=20, temperature=1.0, seed=8))[0]
    assert a.token_ids == b.token_ids
    assert a.token_ids != c.token_ids


def test_max_tokens_and_stop_token_ids(llm):
    prompt = random_prompts(1, [10], seed=9)[0]
    full = llm.generate(prompt, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))[0]
    assert len(full.token_ids) == 12 and full.finish_reason == "length"
    stop_id = full.token_ids[5]
    cut = llm.generate(
        prompt,
        SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, stop_token_ids=(stop_id,)),
    )[0]
    first = full.token_ids.index(stop_id)
    assert cut.token_ids == full.token_ids[: first + 1]
    assert cut.finish_reason == "stop"


def test_eos_stops_unless_ignored(llm):
    # 80 × 40 tokens at a high temperature over a 320-token vocabulary: EOS comes up ~10 times.
    eos = llm.tokenizer.eos_token_id
    prompts = random_prompts(80, [6, 11, 23], seed=10)
    params = SamplingParams(max_tokens=40, temperature=1.5, seed=1)
    outs = llm.generate(prompts, params)
    stopped = [o for o in outs if o.finish_reason == "stop"]
    assert stopped, "no sample hit EOS; pick another seed"
    assert all(o.token_ids[-1] == eos for o in stopped)
    assert all(eos not in o.token_ids[:-1] for o in outs)
    ignoring = llm.generate(prompts, dataclasses.replace(params, ignore_eos=True))
    assert all(len(o.token_ids) == 40 and o.finish_reason == "length" for o in ignoring)
    # Same seed, same samples: each stopped output continues past its EOS when EOS is ignored.
    for kept, cut in zip(ignoring, outs, strict=True):
        assert kept.token_ids[: len(cut.token_ids)] == cut.token_ids


def _boundary_stop(llm: LLM, ids: list[int], text: str) -> tuple[str, int]:
    """A 2-character stop string made of the last char of one token and the first of the next."""
    tok = llm.tokenizer
    for j in range(1, len(ids)):
        head = tok.decode(ids[:j])
        if "\ufffd" in head or len(head) < 1 or not text.startswith(head):
            continue
        stop = text[len(head) - 1 : len(head) + 1]
        if len(stop) == 2 and text.find(stop) == len(head) - 1:
            return stop, len(head) - 1
    pytest.skip("no token boundary with a unique stop string in this sample")


def test_stop_string_across_token_boundary_is_not_emitted(llm):
    prompt = "Once upon a time the"
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    full = llm.generate(prompt, params)[0]
    stop, at = _boundary_stop(llm, full.token_ids, full.text)
    cut = llm.generate(prompt, SamplingParams(max_tokens=40, temperature=0, stop=[stop]))[0]
    assert cut.text == full.text[:at]
    assert cut.finish_reason == "stop"
    streamed = "".join(
        llm.generate_stream(prompt, SamplingParams(max_tokens=40, temperature=0, stop=[stop]))
    )
    assert streamed == cut.text


def test_stream_yields_the_same_text_as_generate(llm):
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    deltas = list(llm.generate_stream("The scheduler batched", params))
    assert len(deltas) > 1
    assert "".join(deltas) == llm.generate("The scheduler batched", params)[0].text
    llm.engine.check_accounting()


def test_stream_abandoned_early_frees_its_request(llm):
    stream = llm.generate_stream("The server", SamplingParams(max_tokens=50, ignore_eos=True))
    next(stream)
    stream.close()
    assert not llm.engine.has_unfinished()
    llm.engine.check_accounting()


def test_detokenizer_never_emits_half_a_character(llm):
    tok = llm.tokenizer
    text = "你好，世界。 naïve café"
    ids = tok(text, add_special_tokens=False).input_ids
    assert any("\ufffd" in tok.decode([i]) for i in ids), "expected a split UTF-8 character"
    detok = IncrementalDetokenizer(tok)
    pieces = []
    for i, token in enumerate(ids):
        detok.add(token)
        pieces.append(detok.delta(finished=i == len(ids) - 1))
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == text


def test_detokenizer_shows_an_unfinished_character_at_the_end(llm):
    tok = llm.tokenizer
    ids = tok("你", add_special_tokens=False).input_ids
    assert len(ids) > 1, "expected a character split over tokens"
    detok = IncrementalDetokenizer(tok)
    detok.add(ids[0])
    assert detok.delta(finished=False) == ""
    assert detok.delta(finished=True) == tok.decode(ids[:1])
