"""Penalties and biases against transformers' logits processors where one exists
(repetition_penalty, min_tokens, logit_bias) and a reference of OpenAI's formula elsewhere
(presence_penalty, frequency_penalty); then through a real server with the openai client."""

from __future__ import annotations

import types

import pytest
import torch
import transformers

from tests.conftest import http, random_prompts
from tierserve import LLM, SamplingParams, TierserveError
from tierserve.layers.sampler import sample

EOS = 1


@pytest.fixture(scope="module")
def hf(llama_dir) -> transformers.PreTrainedModel:
    return transformers.AutoModelForCausalLM.from_pretrained(llama_dir).eval()


@pytest.fixture(scope="module")
def llm(llama_dir) -> LLM:
    return LLM(str(llama_dir), max_total_tokens=4096)


def hf_generate(hf, prompt: list[int], max_new: int, **kw) -> list[int]:
    out = hf.generate(torch.tensor([prompt]), max_new_tokens=max_new, do_sample=False, **kw)
    return out[0, len(prompt) :].tolist()


PROMPTS = random_prompts(4, [6, 40, 130], seed=31)


@pytest.mark.parametrize("penalty", [1.3, 0.7])
def test_repetition_penalty_equals_transformers(hf, llm, penalty):
    params = SamplingParams(
        max_tokens=24, temperature=0, ignore_eos=True, repetition_penalty=penalty
    )
    ours = [o.token_ids for o in llm.generate(PROMPTS, params)]
    hf.generation_config.eos_token_id = None
    assert ours == [hf_generate(hf, p, 24, repetition_penalty=penalty) for p in PROMPTS]


def test_min_tokens_and_logit_bias_equal_transformers(hf, llm):
    """EOS pushed up by a bias: it may end a request only once min_tokens are generated."""
    params = SamplingParams(max_tokens=20, temperature=0, min_tokens=5, logit_bias={str(EOS): 6.0})
    ours = [o.token_ids for o in llm.generate(PROMPTS, params)]
    ref = [
        hf_generate(hf, p, 20, min_new_tokens=5, sequence_bias={(EOS,): 6.0}, eos_token_id=EOS)
        for p in PROMPTS
    ]
    assert ours == ref
    assert all(len(o) >= 5 for o in ours) and any(o[-1] == EOS for o in ours)


def test_logit_bias_alone_equals_transformers(hf, llm):
    bias = {7: 4.0, 42: -100.0, 100: 3.5}
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, logit_bias=bias)
    ours = [o.token_ids for o in llm.generate(PROMPTS, params)]
    hf.generation_config.eos_token_id = None
    seq = {(k,): v for k, v in bias.items()}
    assert ours == [hf_generate(hf, p, 16, sequence_bias=seq) for p in PROMPTS]
    assert all(42 not in o for o in ours)


def openai_reference(hf, prompt: list[int], steps: int, presence: float, frequency: float):
    """Greedy with OpenAI's formula: logit[j] -= c[j] × frequency + (c[j] > 0) × presence,
    c counting the tokens generated so far."""
    ids, out = list(prompt), []
    for _ in range(steps):
        with torch.no_grad():
            logits = hf(torch.tensor([ids])).logits[0, -1].float()
        for token in set(out):
            logits[token] -= out.count(token) * frequency + presence
        out.append(int(logits.argmax()))
        ids.append(out[-1])
    return out


@pytest.mark.parametrize(("presence", "frequency"), [(1.5, 0.0), (0.0, 1.2), (0.8, 0.6), (-1, 0)])
def test_presence_and_frequency_follow_openais_formula(hf, llm, presence, frequency):
    params = SamplingParams(
        max_tokens=20,
        temperature=0,
        ignore_eos=True,
        presence_penalty=presence,
        frequency_penalty=frequency,
    )
    ours = [o.token_ids for o in llm.generate(PROMPTS[:2], params)]
    assert ours == [openai_reference(hf, p, 20, presence, frequency) for p in PROMPTS[:2]]


def test_penalties_change_something_and_plain_rows_share_the_batch(llm):
    """A penalised row beside plain rows: the plain ones are untouched, the penalised one is
    not the plain answer."""
    plain = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    heavy = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, frequency_penalty=2.0)
    alone = [o.token_ids for o in llm.generate(PROMPTS, plain)]
    mixed = llm.generate(PROMPTS, [plain, heavy, plain, plain])
    assert [mixed[i].token_ids for i in (0, 2, 3)] == [alone[i] for i in (0, 2, 3)]
    assert mixed[1].token_ids != alone[1]


@pytest.mark.parametrize(
    ("kw", "field"),
    [
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": float("nan")}, "frequency_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"min_tokens": 9, "max_tokens": 4}, "min_tokens"),
        ({"logit_bias": {"x": 1}}, "logit_bias"),
        ({"logit_bias": {5: 101}}, "logit_bias"),
        ({"logit_bias": {i: 1.0 for i in range(301)}}, "logit_bias"),
    ],
)
def test_bad_penalties_are_refused_naming_the_field(kw, field):
    with pytest.raises(TierserveError) as err:
        SamplingParams(**kw)
    assert err.value.field == field


def test_the_server_takes_penalties_streamed_and_not(llama_dir, llm, server, client):
    prompt = PROMPTS[1]
    extra = {"repetition_penalty": 1.2, "min_tokens": 3, "ignore_eos": True}
    common = dict(max_tokens=12, temperature=0, presence_penalty=0.5, frequency_penalty=0.4,
                  logit_bias={"7": 3.0})  # fmt: skip
    params = SamplingParams(**{**common, **extra, "logit_bias": {7: 3.0}})
    expected = llm.generate(prompt, params)[0].text
    model = llama_dir.name
    whole = client.completions.create(model=model, prompt=prompt, extra_body=extra, **common)
    assert whole.choices[0].text == expected
    chunks = client.completions.create(
        model=model, prompt=prompt, extra_body=extra, stream=True, **common
    )
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == expected
    native = {
        "input_ids": prompt,
        "sampling_params": {
            "max_new_tokens": 12, "temperature": 0, "presence_penalty": 0.5,
            "frequency_penalty": 0.4, "repetition_penalty": 1.2, "min_new_tokens": 3,
            "logit_bias": {"7": 3.0}, "ignore_eos": True,
        },
    }  # fmt: skip
    reply = http.post(f"{server.url}/generate", json=native, timeout=60)
    assert reply.status_code == 200 and reply.json()["text"] == expected


def test_a_repetition_penalty_near_zero_samples_among_the_tokens_it_pushes_up(server, client):
    """Any positive repetition penalty is valid; one near 0 divides a positive logit past
    float32 (+inf, then NaN in softmax took the engine down). Those tokens tie at the largest
    logit instead: the sample is one of the prompt's tokens whose logit was positive, and the
    server serves on."""
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, 1.0]])
    history = types.SimpleNamespace(prompt_ids=[0, 1, 2], output_ids=[], stop_ids=(), grammar=None)
    params = SamplingParams(temperature=1.0, repetition_penalty=1e-45)
    gens = [torch.Generator().manual_seed(s) for s in range(40)]
    picked = {sample(logits, [params], [g], [history])[0] for g in gens}
    assert picked == {0, 2}  # the seen, positive ones: pushed to +inf, tied
    ask = dict(model="llama", prompt=PROMPTS[0], max_tokens=4, temperature=1.0, seed=0)
    done = client.completions.create(**ask, extra_body={"repetition_penalty": 1e-45})
    assert done.usage.completion_tokens == 4
    assert http.get(f"{server.url}/health", timeout=60).status_code == 200
