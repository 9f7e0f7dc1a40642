"""Sampling parameters, stop conditions, streaming and incremental detokenization."""

from __future__ import annotations

import asyncio
import dataclasses
import types
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

import tierserve
from tests.conftest import random_prompts
from tierserve import LLM, SamplingParams
from tierserve.engine.request import Request
from tierserve.frontend.output import MAX_UNSETTLED, IncrementalDetokenizer, OutputBuilder
from tierserve.layers.sampler import greedy_tokens, sample
from tierserve.outputs import RequestOutput, StepOutput, TokenLogprob
from tierserve.server.pending_outputs import PendingOutputs


@pytest.fixture(scope="module")
def llm(llama_dir) -> LLM:
    return LLM(str(llama_dir), max_total_tokens=4096)


@pytest.fixture(scope="module")
def tokenizer(llm):
    return llm.tokenizer


def test_greedy_takes_the_first_of_tied_maxima_as_argmax_does():
    """Greedy rows (and greedy verification) take NumPy's argmax (float32 on CPU) or `max`
    along the rows, not torch's argmax: the same token in every row, ties, a NaN and rows
    picked out of a larger step's logits included, in float32 and bf16 logits."""
    g = torch.Generator().manual_seed(3)
    logits = torch.randint(0, 4, (64, 4096), generator=g).float()  # many tied maxima a row
    logits[5] = float("-inf")
    logits[6, 100:] = 3.5
    logits[7, 9] = float("nan")
    picked = torch.randn(128, 4096, generator=g)[::2]  # rows a stride apart
    for rows in (logits, logits.bfloat16(), torch.randn(64, 4096, generator=g), picked):
        want = rows.argmax(-1)
        assert torch.equal(greedy_tokens(rows), want)
        assert sample(rows, [SamplingParams(temperature=0)] * 64, [None] * 64) == want.tolist()
    assert greedy_tokens(logits)[6] == 100 and greedy_tokens(logits)[5] == 0


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
    pieces = [detok.add(token) for token in ids] + [detok.flush()]
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == text


def test_detokenizer_shows_an_unfinished_character_at_the_end(llm):
    tok = llm.tokenizer
    ids = tok("你", add_special_tokens=False).input_ids
    assert len(ids) > 1, "expected a character split over tokens"
    detok = IncrementalDetokenizer(tok)
    assert detok.add(ids[0]) == ""
    assert detok.flush() == tok.decode(ids[:1])


# --- the front end: token ids to text, outside the engine step ------------------------------

ALPHABET = "ab c,.的日本語éü🙂\n"


def _steps(ids: list[int]) -> list[StepOutput]:
    """The engine's messages for `ids`, the last one finishing by length."""
    last = len(ids) - 1
    return [StepOutput("r", t, "length" if i == last else None, 3, 0, 0) for i, t in enumerate(ids)]


@settings(
    max_examples=60,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(
    text=st.text(alphabet=ALPHABET, min_size=1, max_size=60),
    picks=st.lists(st.tuples(st.integers(0, 59), st.integers(1, 6)), max_size=4),
    absent=st.lists(st.text(alphabet="xyz", min_size=1, max_size=8), max_size=3),
)
def test_output_builder_matches_cutting_the_whole_text(tokenizer, text, picks, absent):
    """Deltas joined are the whole text cut before the stop string that ends first (the
    first listed of those that end together: vLLM's rule, what reading one character at a time
    gives); no delta shows text a later stop removes; the output ends at the token that
    completed the stop."""
    ids = tokenizer(text, add_special_tokens=False).input_ids
    full = tokenizer.decode(ids, skip_special_tokens=True)
    stops = [full[i : i + n] for i, n in picks if full[i : i + n]] + absent
    builder = OutputBuilder(_request(SamplingParams(stop=stops)), tokenizer)
    outs = [o for o in map(builder.add, _steps(ids)) if o is not None]
    hits = [(i + len(s), k, i) for k, s in enumerate(stops) if (i := full.find(s)) >= 0]
    expected = full[: min(hits)[2]] if hits else full
    shown = ""
    for out in outs:
        shown += out.text_delta
        assert expected.startswith(shown)
    last = outs[-1]
    assert last.finished and shown == last.text == expected
    assert last.finish_reason == ("stop" if hits else "length")
    assert last.token_ids == ids[: len(outs)] and last.num_output_tokens == len(outs)
    if hits:  # the first token after which the settled text holds a stop string
        settled = [tokenizer.decode(ids[:j]).rstrip("\ufffd") for j in range(1, len(ids) + 1)]
        first = next(j for j, t in enumerate(settled, 1) if any(s in t for s in stops))
        assert len(outs) == first
        assert builder.stopped_here == (first < len(ids))


@pytest.mark.parametrize("min_tokens", [0, 3, 6])
@pytest.mark.parametrize("stops", [["e"], ["e", "z" * 20]])
def test_a_stop_string_in_the_first_min_tokens_does_not_end_the_request(
    tokenizer, min_tokens, stops
):
    """vLLM's rule (its test_min_tokens_with_stop): a stop string counts only in text made
    after the first min_tokens tokens; here every one ended the request at its first "e". A
    long stop string holds text back: the "e" the first min_tokens made, still held when the
    checks began, cut the output inside that text."""
    ids = tokenizer(" is Lee, and I'm a student in the college", add_special_tokens=False)
    ids = ids.input_ids
    builder = OutputBuilder(_request(SamplingParams(stop=stops, min_tokens=min_tokens)), tokenizer)
    outs = [o for o in map(builder.add, _steps(ids)) if o is not None]
    full, made = tokenizer.decode(ids), tokenizer.decode(ids[:min_tokens])
    assert outs[-1].finish_reason == "stop" and len(outs) > min_tokens
    assert outs[-1].text == full[: full.index("e", len(made))]


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_the_stop_token_that_ends_a_request_is_not_in_its_text(tokenizer, skip_special_tokens):
    """As in vLLM: a stop_token_ids token (here a plain newline) and EOS end the request
    without their text; a special token's text is otherwise kept only when asked for."""
    ids = tokenizer("one two\nthree", add_special_tokens=False).input_ids
    newline = tokenizer.convert_tokens_to_ids("Ċ")
    cut = ids.index(newline) + 1
    params = SamplingParams(stop_token_ids=(newline,), skip_special_tokens=skip_special_tokens)
    builder = OutputBuilder(_request(params), tokenizer)
    steps = [StepOutput("r", t, None, 3, 0, 0) for t in ids[: cut - 1]]
    outs = [builder.add(st) for st in [*steps, StepOutput("r", newline, "stop", 3, 0, 0)]]
    assert outs[-1].text == "one two" and outs[-1].token_ids == ids[:cut]
    eos = tokenizer.eos_token_id
    for keep, ended_by in ((False, True), (True, False)):
        builder = OutputBuilder(_request(SamplingParams(skip_special_tokens=not keep)), tokenizer)
        special = StepOutput("r", eos, "stop" if ended_by else None, 3, 0, 0)
        steps = [StepOutput("r", ids[0], None, 3, 0, 0), special]
        if not ended_by:
            steps.append(StepOutput("r", ids[1], "length", 3, 0, 0))
        text = [builder.add(st) for st in steps][-1].text
        shown = tokenizer.decode([eos]) in text
        assert shown == (keep and not ended_by), text


def _request(params: SamplingParams) -> Request:
    return Request(rid="r", arrival=0, prompt_ids=[1], params=params)


def test_output_builder_drops_tokens_sampled_after_a_stop(tokenizer):
    ids = tokenizer("one two three four", add_special_tokens=False).input_ids
    builder = OutputBuilder(_request(SamplingParams(stop=["two"])), tokenizer)
    outs = [builder.add(s) for s in _steps(ids)]
    done = [o for o in outs if o is not None]
    assert done[-1].finish_reason == "stop" and done[-1].text == "one "
    assert outs[len(done) :] == [None] * (len(ids) - len(done))  # the engine's late tokens


def test_outputs_a_consumer_has_not_taken_come_out_as_one(tokenizer):
    """The server's hand-over of a request's outputs (PendingOutputs): those put while its
    consumer is behind come out as one, with the text, tokens and logprobs of taking them one
    by one, the first output's prompt fields and the last one's state; an error put after
    them comes next."""
    ids = tokenizer("one two three four five", add_special_tokens=False).input_ids
    last = len(ids) - 1
    steps = [
        StepOutput("r", t, "length" if i == last else None, 3, 0, 0, TokenLogprob(t, -0.5))
        for i, t in enumerate(ids)
    ]
    params = SamplingParams(logprobs=0)
    one_by_one = list(map(OutputBuilder(_request(params), tokenizer).add, steps))

    async def taken() -> list[RequestOutput | BaseException]:
        pending, builder = PendingOutputs(), OutputBuilder(_request(params), tokenizer)
        for step in steps[:3]:
            pending.put(builder.add(step))
        first = await pending.get()
        for step in steps[3:]:
            pending.put(builder.add(step))
        pending.put(RuntimeError("the engine failed"))
        return [first, await pending.get(), await pending.get()]

    first, rest, error = asyncio.run(taken())
    assert first.new_token_ids == ids[:3] and not first.finished
    assert first.text_delta == "".join(o.text_delta for o in one_by_one[:3])
    assert first.prompt_token_ids == [1] and first.num_output_tokens == 3
    assert rest.new_token_ids == ids[3:] and rest.finished and rest.finish_reason == "length"
    assert first.text_delta + rest.text_delta == one_by_one[-1].text == rest.text
    assert [lp.token_id for lp in first.new_logprobs + rest.new_logprobs] == ids
    assert isinstance(error, RuntimeError)


def test_a_stream_interval_wakes_its_consumer_every_n_tokens(tokenizer):
    """--stream-interval 3 (vLLM's semantics): the first token is taken at once, then the
    consumer sleeps until three more have joined, and the last output wakes it whatever the
    count; the chunks hold every token once, in order."""
    ids = tokenizer("one two three four five six seven eight", add_special_tokens=False)
    ids = ids.input_ids[:8]
    steps = [StepOutput("r", t, "length" if i == 7 else None, 3, 0, 0) for i, t in enumerate(ids)]

    async def asleep(task: asyncio.Task) -> bool:
        for _ in range(5):  # loop turns, not time: a woken get() is done after one
            await asyncio.sleep(0)
        return not task.done()

    async def taken() -> list[RequestOutput | BaseException]:
        pending, builder = PendingOutputs(3), OutputBuilder(_request(SamplingParams()), tokenizer)
        got = []
        for chunk in (steps[:1], steps[1:4], steps[4:7], steps[7:]):
            task = asyncio.create_task(pending.get())
            for step in chunk[:-1]:
                pending.put(builder.add(step))
                assert await asleep(task), "the consumer woke before three tokens joined"
            pending.put(builder.add(chunk[-1]))
            got.append(await task)
        return got

    got = asyncio.run(taken())
    assert [o.new_token_ids for o in got] == [ids[:1], ids[1:4], ids[4:7], ids[7:]]
    assert [o.finished for o in got] == [False, False, False, True]
    whole = OutputBuilder(_request(SamplingParams()), tokenizer)
    *_, last = [whole.add(step) for step in steps]
    assert "".join(o.text_delta for o in got) == last.text


def test_special_tokens_kept_for_a_parser_but_never_the_stop_token():
    """skip_special_tokens false (what Kimi's and DeepSeek's tool parsers ask): a special
    token's text is in the output, the EOS that ends the request is not."""
    tokenizer = AutoTokenizer.from_pretrained(Path(tierserve.__file__).parent / "demo_model")
    ids = tokenizer("hi <|assistant|> there", add_special_tokens=False).input_ids
    marker = tokenizer.convert_tokens_to_ids("<|assistant|>")
    assert marker in ids
    steps = [StepOutput("r", t, None, 3, 0, 0) for t in ids]
    steps.append(StepOutput("r", tokenizer.eos_token_id, "stop", 3, 0, 0))
    texts = {}
    for skip in (True, False):
        builder = OutputBuilder(_request(SamplingParams(skip_special_tokens=skip)), tokenizer)
        *_, last = [builder.add(step) for step in steps]
        texts[skip] = last.text
        assert last.finish_reason == "stop" and tokenizer.eos_token not in last.text
    assert "<|assistant|>" in texts[False] and "<|assistant|>" not in texts[True]
    assert texts[False].replace("<|assistant|>", "") == texts[True]


def test_detokenizer_window_is_bounded_under_stray_bytes(tokenizer):
    """A model emitting bytes that never complete a character must not make each token's
    decode longer: they are released as U+FFFD after MAX_UNSETTLED tokens."""
    ids = tokenizer("日", add_special_tokens=False).input_ids
    stray = [ids[1]] * 50 + tokenizer(" fine", add_special_tokens=False).input_ids
    detok = IncrementalDetokenizer(tokenizer)
    pieces = []
    for t in stray:
        pieces.append(detok.add(t))
        assert len(detok._unsettled) <= MAX_UNSETTLED
    text = "".join(pieces) + detok.flush()
    assert text == "\ufffd" * 50 + " fine" == tokenizer.decode(stray)


def test_slow_tokenizers_detokenize_the_same_way(tokenizer):
    """Without a Rust backend (`_tokenizer`), the decode-window path gives the same text."""
    text = "naïve café 日本語 🙂 done"
    ids = tokenizer(text, add_special_tokens=False).input_ids
    slow = IncrementalDetokenizer(types.SimpleNamespace(decode=tokenizer.decode))
    assert slow._stream is None
    pieces = [slow.add(t) for t in ids]
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) + slow.flush() == text


def test_waiting_requests_go_in_arrival_order_not_submission_order(llm):
    """A request that arrived first but finished tokenizing later is still admitted first."""
    engine = llm.engine
    params = SamplingParams(max_tokens=2, temperature=0)
    first_arrival, second_arrival = engine.next_arrival(), engine.next_arrival()
    late = engine.make_request([5, 6, 7], params, "came-second", second_arrival)
    early = engine.make_request([5, 6, 8], params, "came-first", first_arrival)
    engine.submit(late)
    engine.submit(early)
    assert [r.rid for r in engine.scheduler.waiting] == ["came-first", "came-second"]
    while engine.has_unfinished():
        engine.step()
    llm.engine.check_accounting()


def test_include_stop_str_in_output_keeps_what_ended_the_request(tokenizer):
    """vLLM's switch: the stop string, or the stop token's text, stays in the output; either
    way `stop_reason` names it (a string, or the stop_token_ids id; None for EOS)."""
    ids = tokenizer("one two\nthree four", add_special_tokens=False).input_ids
    for include in (False, True):
        params = SamplingParams(stop=["two"], include_stop_str_in_output=include)
        outs = [o for o in map(OutputBuilder(_request(params), tokenizer).add, _steps(ids)) if o]
        assert outs[-1].text == ("one two" if include else "one ")
        assert outs[-1].stop_reason == "two" and outs[-1].outputs[0].stop_reason == "two"
        newline = tokenizer.convert_tokens_to_ids("Ċ")
        cut = ids.index(newline)
        params = SamplingParams(stop_token_ids=(newline,), include_stop_str_in_output=include)
        builder = OutputBuilder(_request(params), tokenizer)
        steps = [StepOutput("r", t, None, 3, 0, 0) for t in ids[:cut]]
        outs = [builder.add(s) for s in [*steps, StepOutput("r", newline, "stop", 3, 0, 0)]]
        assert outs[-1].text == ("one two\n" if include else "one two")
        assert outs[-1].stop_reason == newline
    eos_id = tokenizer.eos_token_id
    eos = StepOutput("r", eos_id, "stop", 3, 0, 0)
    for params, reason in (
        (SamplingParams(stop=["zz"]), None),
        (SamplingParams(stop_token_ids=(eos_id,)), None),  # EOS first, as vLLM checks it
        (SamplingParams(stop_token_ids=(eos_id,), ignore_eos=True), eos_id),
    ):
        builder = OutputBuilder(_request(params), tokenizer, frozenset({eos_id}))
        done = [builder.add(StepOutput("r", ids[0], None, 3, 0, 0)), builder.add(eos)][-1]
        assert done.finish_reason == "stop" and done.stop_reason == reason
