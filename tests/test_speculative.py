"""Speculative decoding with NGRAM drafts against plain decoding: the proposer, greedy outputs
token for token on tiny Llama and Qwen3 checkpoints and the demo model (a mixed workload: chunked
prefill, the radix cache, stop strings, logprobs, a grammar, penalties), the sampled distribution
(with a biased rule that must fail), aborts mid-verification, the flags and the metrics."""

from __future__ import annotations

import json
import math
from collections import Counter
from pathlib import Path

import pytest
import torch

from tests.conftest import random_prompts
from tierserve import LLM, SamplingParams, TierserveError
from tierserve.args import EngineArgs
from tierserve.engine.metrics import engine_metrics
from tierserve.sampling_params import StructuredOutput
from tierserve.speculative import NgramProposer, verify

DEMO = Path(__file__).resolve().parent.parent / "tierserve" / "demo_model"


def test_the_proposer_takes_what_followed_the_longest_latest_match():
    p = NgramProposer(1, 3)
    assert p.propose([1, 2, 3, 9, 1, 2, 3, 8, 7, 1, 2, 3], 2) == (8, 7)  # the latest of two
    assert p.propose([5, 6, 7, 5, 6], 3) == (7, 5, 6)
    assert p.propose([9, 1, 2, 9, 5, 1, 2], 1) == (9,)  # [1, 2] beats [2]'s later match
    assert p.propose([4, 4, 4], 3) == (4,)  # a match that runs into the suffix: what is there
    assert p.propose([1, 2, 3, 4], 2) == ()  # nothing recurs
    assert NgramProposer(2, 3).propose([1, 5, 1], 2) == ()  # [1] alone is under the minimum
    assert p.propose([1, 2, 1], 0) == ()
    # What the scheduler hands it: the tail of prompt + output, never the whole joined.
    from tierserve.engine.request import Request

    req = Request("r", 0, [1, 2, 3, 4], SamplingParams(), output_ids=[5, 6])
    assert req.last_ids(3) == [4, 5, 6] and req.last_ids(1) == [6]
    assert req.last_ids(10) == req.all_ids == [1, 2, 3, 4, 5, 6]


def _workload(seed: int) -> list[tuple[list[int], SamplingParams]]:
    """Prompts that repeat themselves (drafts get accepted) and random ones (drafts get
    rejected), two sharing a long prefix (the radix cache), long ones (chunked prefill),
    penalties, biases and min_tokens (each draft row adjusted by its own history), and a
    grammar (each draft row masked in its own state)."""
    g = torch.Generator().manual_seed(seed)
    motif = torch.randint(3, 200, (24,), generator=g).tolist()
    randoms = random_prompts(3, [7, 90, 150], seed=seed)
    greedy = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    logprobs = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, logprobs=2)
    penalised = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, presence_penalty=1)
    biased = SamplingParams(
        max_tokens=24, temperature=0, min_tokens=10, repetition_penalty=1.3,
        frequency_penalty=0.5, logit_bias=((motif[1], 3.0), (motif[2], -2.0)),
    )  # fmt: skip
    grammar = SamplingParams(
        max_tokens=12, temperature=0, structured_output=StructuredOutput("regex", "(ab|cd)+")
    )
    return [
        (motif * 4, greedy),
        (motif * 3 + motif[:5], logprobs),
        (motif * 4 + [7, 8], greedy),  # shares motif * 4 with the first
        *[(p, greedy) for p in randoms],
        (randoms[1] + randoms[1], greedy),
        (motif * 2, penalised),
        (motif * 3, biased),
        (motif * 2, grammar),
    ]


def _run(llm: LLM, work: list[tuple[list[int], SamplingParams]]):
    outs = llm.generate([p for p, _ in work], [s for _, s in work])
    again = llm.generate([p for p, _ in work[:3]], [s for _, s in work[:3]])  # radix hits
    return outs + again


@pytest.mark.parametrize("family", ["llama", "qwen3", "demo"])
def test_greedy_outputs_are_token_identical_with_ngram_drafts(checkpoints, family):
    path = str(DEMO if family == "demo" else checkpoints[family])
    work = _workload(seed=len(family))
    common = {"max_total_tokens": 4096, "chunked_prefill_size": 64}
    reference = LLM(path, **common)
    # A stop string from the request's own output ends it part-way.
    text = reference.generate([work[0][0]], work[0][1])[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    work[0] = (work[0][0], SamplingParams(max_tokens=40, temperature=0, stop=[stop]))
    plain = _run(reference, work)
    assert plain[0].finish_reason == "stop" or not stop.strip()
    llm = LLM(path, speculative_algorithm="NGRAM", **common)
    spec = _run(llm, work)
    for want, got in zip(plain, spec, strict=True):
        assert got.token_ids == want.token_ids
        assert got.text == want.text and got.finish_reason == want.finish_reason
        if want.logprobs:
            for a, b in zip(want.logprobs, got.logprobs, strict=True):
                assert a.token_id == b.token_id and math.isclose(a.logprob, b.logprob, abs_tol=1e-4)
                assert [t for t, _ in a.top] == [t for t, _ in b.top]
    stats = llm.engine.spec_stats
    assert stats.num_drafts > 0 and stats.num_accepted_tokens > 0
    assert stats.num_accepted_tokens < stats.num_draft_tokens  # the random prompts' drafts fail
    assert spec[-3].cached_tokens > 0  # the repeated requests hit the radix cache
    llm.engine.check_accounting()
    assert not llm.engine.scheduler.running and llm.engine.kv.available_pages() > 0


def test_penalised_and_biased_requests_are_drafted_for_with_each_rows_own_history():
    """Presence, frequency and repetition penalties, logit_bias, min_tokens and bad words
    adjust every draft row as plain decoding would have at that token: greedy outputs equal,
    and drafts were verified and kept."""
    prompts = [p for p, _ in _workload(seed=4)[:3]]  # motifs the demo model continues
    # Penalties light enough that the output still repeats itself, so drafts get kept.
    kinds = [
        {"repetition_penalty": 1.02}, {"frequency_penalty": 0.02, "presence_penalty": 0.02},
        {"min_tokens": 12, "logit_bias": ((prompts[0][3], 0.5), (prompts[0][5], -0.5))},
    ]  # fmt: skip
    reference = LLM(str(DEMO), max_total_tokens=2048)
    greedy = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    unbanned = reference.generate([prompts[0]], greedy)[0].token_ids
    banned = unbanned[1:3]  # a pair of its output's first tokens, banned
    kinds.append({"bad_words_token_ids": (tuple(banned),)})
    prompts.append(prompts[0])
    params = [SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, **k) for k in kinds]
    plain = reference.generate(prompts, params)
    llm = LLM(str(DEMO), max_total_tokens=2048, speculative_algorithm="NGRAM")
    spec = llm.generate(prompts, params)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    assert spec[3].token_ids[:2] == unbanned[:2] != spec[3].token_ids[1:3]
    assert not any(spec[3].token_ids[i : i + 2] == banned for i in range(39))
    assert llm.engine.spec_stats.num_accepted_tokens > 0


def test_grammar_requests_mask_every_draft_row_and_keep_their_state():
    """A regex whose output repeats (drafts from the output get kept) and a JSON schema: each
    verify row is masked in the grammar's state after the drafts before it, a refused draft
    token ends the draft, and the outputs equal plain decoding's and match the grammar."""
    import re

    regex = StructuredOutput("regex", "(ab|cd|ef){4,30}")
    schema = StructuredOutput.json(
        {"type": "object", "properties": {"a": {"type": "array", "items": {"enum": [1, 2]},
         "maxItems": 12}}, "required": ["a"], "additionalProperties": False}
    )  # fmt: skip
    prompts = [_workload(seed=4)[0][0], list(range(30, 50)) * 2]
    params = [SamplingParams(max_tokens=60, temperature=0, structured_output=g)
              for g in (regex, schema)]  # fmt: skip
    plain = LLM(str(DEMO), max_total_tokens=2048).generate(prompts, params)
    llm = LLM(str(DEMO), max_total_tokens=2048, speculative_algorithm="NGRAM")
    spec = llm.generate(prompts, params)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    assert re.fullmatch("(ab|cd|ef){4,30}", spec[0].text)
    assert set(json.loads(spec[1].text)) == {"a"}
    assert llm.engine.spec_stats.num_accepted_tokens > 0


@pytest.mark.parametrize("method", ["NGRAM", "EAGLE3"])
def test_tensor_parallel_ranks_draft_and_verify_the_same_tokens(checkpoints, method):
    """Two rank processes over gloo: each schedules the same drafts (n-gram: the same tokens;
    EAGLE-3, the demo model's shipped draft: its attention and MLP split as the target's, its
    head whole on every rank) and verifies them on the same gathered logits, so greedy outputs
    equal one process's without speculation. Under DP attention (two groups of one rank) each
    group drafts and verifies its own requests, the draft alone in its group, while the
    target's MLPs span both."""
    path = str(checkpoints["llama"] if method == "NGRAM" else DEMO)
    work = _workload(seed=5)
    prompts, params = [p for p, _ in work], [s for _, s in work]
    want = [o.token_ids for o in LLM(path, max_total_tokens=4096).generate(prompts, params)]
    spec = {"speculative_algorithm": method, "tp_size": 2, "device": "cpu"}
    for layout in ({}, {"dp_size": 2, "enable_dp_attention": True}):  # tp 2; tp 2 / dp 2
        with LLM(path, max_total_tokens=4096, **spec, **layout) as llm:
            assert [o.token_ids for o in llm.generate(prompts, params)] == want, layout
            assert llm.engine.spec_stats.num_accepted_tokens > 0


def _chi_square_p_value(counts: Counter, probs: torch.Tensor) -> float:
    """Pearson's test of `counts` against `probs` (bins with expected count < 5 pooled)."""
    total = sum(counts.values())
    expected = probs * total
    big = expected >= 5
    observed = torch.tensor([counts.get(i, 0) for i in range(len(probs))], dtype=torch.float64)
    obs = torch.cat([observed[big], observed[~big].sum().view(1)])
    exp = torch.cat([expected[big], expected[~big].sum().view(1)])
    keep = exp > 0
    stat = float((((obs - exp) ** 2) / exp)[keep].sum())
    dof = int(keep.sum()) - 1
    # Wilson-Hilferty: the chi-square tail through a normal, ample at these degrees of freedom.
    z = ((stat / dof) ** (1 / 3) - (1 - 2 / (9 * dof))) / math.sqrt(2 / (9 * dof))
    return 0.5 * math.erfc(z / math.sqrt(2))


@pytest.mark.parametrize("biased", [False, True])
def test_sampled_tokens_keep_the_targets_distribution_and_a_biased_rule_does_not(biased):
    """At temperature 0.8 over a 12-token vocabulary, the first token a verified two-token draft
    emits is distributed as the target's filtered distribution: 2,500 seeded draws pass a
    chi-square test at p > 0.001; accepting a draft token with probability sqrt(p) instead of p
    (a rule that over-keeps drafts) fails it."""
    logits = torch.tensor([[2.0, 1.5, 1.0, 0.5, 0.2, 0.0, -0.3, -0.5, -1.0, -1.2, -2.0, -3.0]] * 3)
    params = SamplingParams(temperature=0.8, top_p=0.95)
    from tierserve.layers import filtered_probs

    target = filtered_probs(logits[:1], [params])[0].double()
    g = torch.Generator().manual_seed(7)
    rule = (lambda u, p: u < math.sqrt(p)) if biased else (lambda u, p: u < p)
    first, second = Counter(), Counter()
    for _ in range(2_500):
        out = verify(logits, (3, 0), params, g, rule)
        first[out[0]] += 1
        if out[0] == 3 and len(out) > 1:
            second[out[1]] += 1
    p_first = _chi_square_p_value(first, target)
    if biased:
        assert p_first < 1e-6
    else:
        assert p_first > 1e-3
        assert _chi_square_p_value(second, target) > 1e-3  # the next row, given a kept draft


def test_greedy_verification_keeps_the_drafts_the_argmax_confirms():
    logits = torch.full((4, 6), -5.0)
    for row, token in enumerate([2, 4, 1, 5]):
        logits[row, token] = 5.0
    greedy = SamplingParams(temperature=0)
    assert verify(logits, (2, 4, 1), greedy, None) == [2, 4, 1, 5]  # all kept, plus the bonus
    assert verify(logits, (2, 3, 1), greedy, None) == [2, 4]  # the second is wrong
    assert verify(logits, (0, 4, 1), greedy, None) == [2]


@pytest.mark.parametrize("method", ["NGRAM", "EAGLE3"])
def test_aborts_during_verification_leave_no_pages_or_requests_held(method):
    """Aborted between steps with drafts in flight (an EAGLE-3 chain's lookahead slots held
    too): no page and no request is left."""
    llm = LLM(str(DEMO), max_total_tokens=4096, speculative_algorithm=method)
    engine = llm.engine
    motif = list(range(40, 70))
    greedy = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
    rids = [engine.add_request(motif * 3 + [i], greedy) for i in range(4)]
    while engine.spec_stats.num_drafts == 0:
        engine.step()
    verified = engine.spec_stats.num_drafts
    for rid in rids:
        engine.abort(rid)
    assert not engine.scheduler.running and not engine.scheduler.waiting
    engine.check_accounting()
    flushed = engine.flush_cache()
    assert verified > 0 and engine.kv.available_pages() == engine.kv.num_pages, flushed


def test_the_spec_decode_counters_are_vllms_names():
    vllm = '{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 1, ' + (
        '"prompt_lookup_max": 3}'
    )
    llm = LLM(str(DEMO), max_total_tokens=2048, speculative_config=vllm)
    args = llm.engine.args
    assert args.speculative_algorithm == "NGRAM" and args.num_speculative_tokens == 2
    work = _workload(seed=4)[:3]  # repeated motifs: drafts the demo model agrees with
    llm.generate([p for p, _ in work], SamplingParams(max_tokens=40, temperature=0))
    families = {f.name: f for f in engine_metrics(llm.engine)}
    stats = llm.engine.spec_stats
    drafts = families["tierserve_spec_decode_num_drafts"].samples[0][1]
    accepted = families["tierserve_spec_decode_num_accepted_tokens"].samples[0][1]
    assert drafts == stats.num_drafts > 0 and accepted == stats.num_accepted_tokens > 0
    samples = families["tierserve_spec_decode_num_accepted_tokens_per_pos"].samples
    per_pos = {tuple(labels): value for labels, value in samples}
    assert set(per_pos) <= {("0",), ("1",)} and sum(per_pos.values()) == accepted
    assert families["tierserve_spec_decode_num_draft_tokens"].samples[0][1] <= 2 * drafts


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"speculative_algorithm": "NGRAM", "speculative_draft_model_path": "d"}, "for EAGLE3"),
        ({"speculative_algorithm": "NGRAM", "speculative_eagle_topk": 4}, "not trees"),
        # 0 once read as the default chain of 1.
        ({"speculative_algorithm": "NGRAM", "speculative_eagle_topk": 0}, "not trees; got 0"),
        ({"speculative_algorithm": "NGRAM", "speculative_num_steps": 0},
         "--speculative-num-steps must be >= 1, got 0"),
        ({"speculative_algorithm": "NGRAM", "speculative_num_steps": 3,
          "speculative_num_draft_tokens": 8}, "does not match"),
        ({"speculative_num_steps": 3}, "add --speculative-algorithm"),
        ({"speculative_config": "{nope"}, "not JSON"),
        ({"speculative_config": '{"method": "medusa"}'}, "method must be"),
        ({"speculative_config": '{"method": "ngram", "k": 3}'}, "unknown key 'k'"),
        ({"speculative_config": '{"method": "ngram"}', "speculative_algorithm": "NGRAM"},
         "not both"),
        # Each was overwritten by the JSON's value or its default, silently.
        ({"speculative_config": '{"method": "ngram"}', "speculative_num_steps": 5},
         r"or --speculative-num-steps \(SGLang's\), not both"),
        ({"speculative_config": '{"method": "ngram"}',
          "speculative_ngram_max_match_window_size": 2}, "not both"),
        ({"speculative_algorithm": "NGRAM", "speculative_ngram_min_match_window_size": 5,
          "speculative_ngram_max_match_window_size": 2}, "1 <= min"),
    ],
)  # fmt: skip
def test_bad_speculative_flags_are_refused_by_name(kwargs, words):
    with pytest.raises(TierserveError, match=words):
        EngineArgs.from_kwargs("m", **kwargs)


@pytest.mark.parametrize(
    ("flags", "words"),
    [
        (["--speculative-num-steps", "1000"], "--speculative-num-steps must be at most 32"),
        (["--speculative-num-draft-tokens", "34"],
         "--speculative-num-draft-tokens must be at most 33"),
        (["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 33}'],
         "--speculative-config num_speculative_tokens must be at most 32"),
    ],
)  # fmt: skip
def test_a_chain_past_32_drafted_tokens_exits_2_naming_its_flag(capsys, flags, words):
    """1,000 steps were served: each step ran 1,000 draft forwards, and a 2-token request
    took 20 s."""
    from tierserve import cli

    algorithm = [] if "--speculative-config" in flags else ["--speculative-algorithm", "NGRAM"]
    code = cli.main(["serve", "--device", "cpu", *algorithm, *flags, "--dry-run"])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith(f"tierserve serve: error: {words}"), err
    assert err.count("\n") == 1, err
    # The bound itself is served: 32 drafted tokens, 33 verified.
    largest = EngineArgs.from_kwargs("m", speculative_algorithm="NGRAM", speculative_num_steps=32)
    assert largest.speculative_num_draft_tokens == 33


def test_the_chain_sizes_follow_from_either_flag():
    steps = EngineArgs.from_kwargs("m", speculative_algorithm="NGRAM")
    assert (steps.speculative_num_steps, steps.speculative_num_draft_tokens) == (3, 4)
    tokens = EngineArgs.from_kwargs(
        "m", speculative_algorithm="NGRAM", speculative_num_draft_tokens=6
    )
    assert tokens.num_speculative_tokens == 5
    assert EngineArgs.from_kwargs("m").num_speculative_tokens == 0
    vllm = '{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3}'
    one_bound = EngineArgs.from_kwargs("m", speculative_config=vllm)
    assert one_bound.speculative_ngram_min_match_window_size == 3  # vLLM: it stands for both
    neither = EngineArgs.from_kwargs("m", speculative_config='{"method": "ngram"}')
    assert neither.speculative_ngram_max_match_window_size == 5  # vLLM's default


def test_a_served_ngram_server_answers_n_and_reports_acceptance(demo_server):
    """A real server with --speculative-algorithm NGRAM: the official client's `n` greedy
    choices equal the shared plain demo server's, /generate's meta_info carries SGLang's spec
    fields, and /metrics vLLM's counters (EAGLE3's served twin: test_eagle3.py)."""
    import openai

    from tests.conftest import Server

    prompt = _workload(seed=4)[0][0]
    plain = openai.OpenAI(base_url=f"{demo_server.url}/v1", api_key="x", max_retries=0)
    want = [c.text for c in plain.completions.create(**served_ask(prompt)).choices]
    flags = ("--device", "cpu", "--max-total-tokens", "4096", "--speculative-algorithm", "NGRAM")
    with Server(DEMO, *flags) as s:
        check_served_spec_fields(s, prompt, want)


def served_ask(prompt: list[int]) -> dict:
    return {"model": "demo_model", "prompt": prompt, "max_tokens": 30, "temperature": 0, "n": 2}


def check_served_spec_fields(s, prompt: list[int], want: list[str]) -> None:
    """`s` answers the official client's `n` greedy choices with `want`, /generate's
    meta_info with SGLang's spec fields, /metrics with vLLM's counters."""
    import openai

    client = openai.OpenAI(base_url=f"{s.url}/v1", api_key="x", max_retries=0)
    assert [c.text for c in client.completions.create(**served_ask(prompt)).choices] == want
    body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": 30, "temperature": 0}}
    meta = s.http.post(f"{s.url}/generate", json=body, timeout=60).json()["meta_info"]
    assert meta["spec_verify_ct"] >= 1
    assert meta["spec_accept_length"] == meta["completion_tokens"] / meta["spec_verify_ct"]
    metrics = s.metrics()
    assert metrics["tierserve_spec_decode_num_drafts_total"] > 0
    assert metrics["tierserve_spec_decode_num_accepted_tokens_total"] > 0


def _one_field_each(prompt: list[int]) -> dict[str, SamplingParams]:
    """A request per SamplingParams field, that field set (greedy unless the field samples),
    the rest at their defaults: what a client may send to a speculative server."""
    greedy = {"max_tokens": 24, "temperature": 0, "ignore_eos": True}
    sampled = {"max_tokens": 24, "temperature": 0.8, "seed": 11, "ignore_eos": True}
    by_field: dict[str, dict] = {
        "max_tokens": {**greedy, "max_tokens": 7},
        "temperature": {**sampled},
        "top_p": {**sampled, "top_p": 0.5},
        "top_k": {**sampled, "top_k": 3},
        "min_p": {**sampled, "min_p": 0.2},
        "seed": {**sampled, "seed": 5},
        "stop": {"max_tokens": 24, "temperature": 0, "stop": ["e"]},
        "stop_token_ids": {"max_tokens": 24, "temperature": 0, "stop_token_ids": [prompt[2]]},
        "ignore_eos": {**greedy},
        "presence_penalty": {**greedy, "presence_penalty": 0.05},
        "frequency_penalty": {**greedy, "frequency_penalty": 0.05},
        "repetition_penalty": {**greedy, "repetition_penalty": 1.05},
        "min_tokens": {"max_tokens": 24, "temperature": 0, "min_tokens": 12},
        "logit_bias": {**greedy, "logit_bias": {prompt[3]: 0.5, prompt[5]: -0.5}},
        "logprobs": {**greedy, "logprobs": 2},
        "prompt_logprobs": {**greedy, "prompt_logprobs": 1},
        "structured_output": {**greedy, "structured_output": StructuredOutput("regex", "(ab|c)+")},
        "return_hidden_states": {**greedy, "return_hidden_states": False},
        "skip_special_tokens": {**greedy, "skip_special_tokens": False},
        "include_stop_str_in_output": {"max_tokens": 24, "temperature": 0, "stop": ["e"],
                                       "include_stop_str_in_output": True},
        # The prompt's own ids, as the request that failed every speculative server did.
        "allowed_token_ids": {**greedy, "allowed_token_ids": prompt[:10]},
        "truncate_prompt_tokens": {**greedy, "truncate_prompt_tokens": 20},
        "bad_words": {**greedy, "bad_words": ["the"]},
        "bad_words_token_ids": {**greedy, "bad_words_token_ids": [prompt[1:3]]},
        "n": {**sampled, "n": 2},
    }  # fmt: skip
    return {name: SamplingParams(**kw) for name, kw in by_field.items()}


@pytest.fixture(scope="module")
def demo_plain() -> LLM:
    return LLM(str(DEMO), max_total_tokens=2048)


@pytest.mark.parametrize("method", ["NGRAM", "EAGLE3"])
def test_every_sampling_field_works_under_each_proposer(demo_plain, method):
    """Every field a request may set, one request each, under n-gram and EAGLE-3 drafts: none
    fails the engine's step (allowed_token_ids did, on every speculative server), greedy ones
    give plain decoding's tokens, sampled ones their seed's tokens again."""
    from dataclasses import fields

    prompt = _workload(seed=4)[0][0]
    cases = _one_field_each(prompt)
    assert set(cases) == {f.name for f in fields(SamplingParams)}  # a new field joins here
    names, params = list(cases), list(cases.values())
    plain = demo_plain.generate([prompt] * len(params), params)
    with LLM(str(DEMO), max_total_tokens=2048, speculative_algorithm=method) as llm:
        spec = llm.generate([prompt] * len(params), params)
        again = llm.generate([prompt] * len(params), params)
        assert llm.engine.spec_stats.num_drafts > 0
        llm.engine.check_accounting()
    for name, p, want, got, got_again in zip(names, params, plain, spec, again, strict=True):
        assert [o.token_ids for o in got.outputs] == [o.token_ids for o in got_again.outputs]
        if p.greedy:
            assert got.token_ids == want.token_ids, name
            assert got.text == want.text and got.finish_reason == want.finish_reason, name
    assert set(spec[names.index("allowed_token_ids")].token_ids) <= set(prompt[:10])
