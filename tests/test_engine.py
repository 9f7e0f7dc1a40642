"""Scheduler and cache paths: identical greedy outputs whichever path computes them."""

from __future__ import annotations

import itertools
import threading

import pytest
import torch

from tests.conftest import random_prompts
from tierserve import LLM, SamplingParams, TierserveError

GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
LENGTHS = [5, 18, 33, 64, 100, 150, 7, 250, 61, 90]


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return random_prompts(10, LENGTHS, seed=11)


@pytest.fixture(scope="module")
def reference(llama_dir, prompts) -> list[list[int]]:
    llm = LLM(str(llama_dir), page_size=1, disable_radix_cache=True, chunked_prefill_size=-1)
    return [o.token_ids for o in llm.generate(prompts, GREEDY)]


def run_twice(llm: LLM, prompts) -> list[list[int]]:
    """Second pass sees the first pass's prefixes in the cache."""
    first = [o.token_ids for o in llm.generate(prompts, GREEDY)]
    second = [o.token_ids for o in llm.generate(prompts, GREEDY)]
    assert first == second
    return second


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("radix", [True, False])
@pytest.mark.parametrize("chunk", [-1, 32])
def test_outputs_equal_across_cache_paths(llama_dir, prompts, reference, page_size, radix, chunk):
    llm = LLM(
        str(llama_dir),
        page_size=page_size,
        disable_radix_cache=not radix,
        chunked_prefill_size=chunk,
        max_total_tokens=8192,
    )
    assert run_twice(llm, prompts) == reference
    stats = llm.engine.scheduler.stats
    if radix:
        assert stats.num_cached_tokens > 0
    else:
        assert stats.num_cached_tokens == 0
    llm.engine.check_accounting()
    assert not llm.engine.scheduler.running


@pytest.mark.parametrize("page_size", [1, 16])
def test_preemption_keeps_outputs(llama_dir, prompts, reference, page_size):
    # Room for a few requests only: decodes run out of pages and the newest are preempted.
    llm = LLM(str(llama_dir), page_size=page_size, max_total_tokens=640, chunked_prefill_size=64)
    outs = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == reference
    stats = llm.engine.scheduler.stats
    assert stats.num_preemptions > 0
    assert stats.num_recomputed_tokens > 0
    assert sum(o.num_preemptions for o in outs) == stats.num_preemptions
    kv = llm.engine.kv
    assert kv.allocator.num_free + kv.cached_pages() == kv.num_pages
    llm.engine.check_accounting()


@pytest.mark.parametrize("page_size", [1, 16])
def test_shared_prefix_is_reported_cached(llama_dir, page_size):
    shared = random_prompts(1, [512], seed=5)[0]
    tails = random_prompts(2, [20, 37], seed=6)
    llm = LLM(str(llama_dir), page_size=page_size, max_total_tokens=4096)
    params = SamplingParams(max_tokens=4, temperature=0)
    first = llm.generate(shared + tails[0], params)[0]
    second = llm.generate(shared + tails[1], params)[0]
    assert first.cached_tokens == 0
    assert second.cached_tokens >= 512 - page_size
    assert second.prompt_tokens == 512 + 37


def test_concurrent_requests_share_a_prompt_prefilled_earlier(llama_dir):
    """A prompt's pages go into the tree after prefill, before the request finishes."""
    shared = random_prompts(1, [256], seed=7)[0]
    llm = LLM(str(llama_dir), page_size=16, max_total_tokens=4096, chunked_prefill_size=128)
    engine = llm.engine
    first = engine.add_request(shared + [3, 4], SamplingParams(max_tokens=50, ignore_eos=True))
    for _ in range(3):  # two prefill chunks, then decoding
        engine.step()
    second = engine.add_request(shared + [5, 6], SamplingParams(max_tokens=2))
    done = {}
    while engine.has_unfinished():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    assert done[first].cached_tokens == 0
    assert done[second].cached_tokens == 256
    engine.check_accounting()


def test_max_running_requests_is_respected(llama_dir, prompts, reference):
    llm = LLM(str(llama_dir), max_running_requests=2)
    engine = llm.engine
    for p in prompts:
        engine.add_request(p, GREEDY)
    seen = 0
    while engine.has_unfinished():
        engine.step()
        seen = max(seen, len(engine.scheduler.running))
    assert seen == 2


def test_a_prefilling_steps_budget_counts_its_decode_rows(llama_dir, prompts):
    """--chunked-prefill-size counts the decode rows beside a step's prompt chunks (SGLang's
    mixed chunks): while prompts wait, every step carries exactly the budget's tokens, so the
    CPU's GEMMs see one row count; with more decode rows than half the budget, prompts still
    get half. Outputs are those of unchunked prefill."""
    budget, params = 24, SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
    whole = LLM(str(llama_dir), chunked_prefill_size=-1, disable_radix_cache=True)
    reference = [o.token_ids for o in whole.generate(prompts, params)]
    llm = LLM(str(llama_dir), chunked_prefill_size=budget, disable_radix_cache=True)
    engine, steps = llm.engine, []
    schedule = engine.scheduler.schedule

    def recorded() -> list:
        chunks = schedule()
        waiting = bool(engine.scheduler.waiting) or any(
            c.req.num_computed + c.num_tokens < len(c.req.prompt_ids) for c in chunks
        )
        prompt = sum(c.num_tokens for c in chunks if c.num_rows > 1)
        steps.append((sum(c.num_rows for c in chunks), prompt, waiting))
        return chunks

    engine.scheduler.schedule = recorded
    # 20 requests: more decode rows than half the budget while prompts still wait
    rids = [engine.add_request(p, params) for p in [*prompts, *prompts]]
    outputs: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for o in engine.step():
            outputs.setdefault(o.request_id, []).append(o.token_id)
    full = [(rows - prompt, prompt) for rows, prompt, waiting in steps if prompt and waiting]
    assert all(prompt == max(budget - decode, budget // 2) for decode, prompt in full)
    assert sum(decode + prompt == budget for decode, prompt in full) >= 10
    assert any(decode > budget // 2 for decode, _ in full)  # prompts kept half the budget
    assert [outputs[r] for r in rids] == [*reference, *reference]


def test_the_offline_llm_on_a_cpu_host_prefills_vllms_offline_budget(offline, llama_dir):
    """An LLM that leaves --chunked-prefill-size alone on a CPU-only host takes vLLM's offline
    CPU budget, 4096 tokens a tensor-parallel rank; the server's default stays 2048, a CUDA
    host keeps it offline too, and a value given is kept."""
    from tierserve.args import EngineArgs
    from tierserve.engine.llm import offline_chunk

    cpu_host = not torch.cuda.is_available()
    assert offline.args.chunked_prefill_size == (4096 if cpu_host else 2048)
    assert offline_chunk(EngineArgs.from_kwargs("m", device="cpu", tp_size=2)) == 8192
    assert EngineArgs.from_kwargs("m").chunked_prefill_size == 2048  # serve, batch
    assert LLM(str(llama_dir), chunked_prefill_size=64).args.chunked_prefill_size == 64


def test_flush_cache_frees_every_page(llama_dir, prompts):
    llm = LLM(str(llama_dir), max_total_tokens=4096)
    llm.generate(prompts, GREEDY)
    assert llm.engine.kv.cached_pages() > 0
    llm.engine.flush_cache()
    assert llm.engine.kv.allocator.num_free == llm.engine.kv.num_pages


# --- bad input ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def small_llm(llama_dir) -> LLM:
    return LLM(str(llama_dir), context_length=512, max_total_tokens=1024)


@pytest.mark.parametrize(
    ("prompt", "params", "field", "words"),
    [
        ("", SamplingParams(), "prompt", "empty"),
        ([], SamplingParams(), "prompt", "empty"),
        ([1, 99999], SamplingParams(), "prompt", "[0, 320)"),
        ([1] * 500, SamplingParams(max_tokens=20), "max_tokens", "context length 512"),
        ([True, False], SamplingParams(), "prompt", "[0, 320)"),  # ran as ids 1 and 0
    ],
)
def test_bad_prompts_raise_one_typed_error(small_llm, prompt, params, field, words):
    with pytest.raises(TierserveError) as err:
        small_llm.generate([prompt], params)
    assert err.value.field == field
    assert words in str(err.value)
    assert not small_llm.engine.has_unfinished()


@pytest.mark.parametrize(
    ("prompts", "params", "field"),
    [
        (b"abc", None, "prompt"),  # was read as token ids
        ({"a": 1}, None, "prompt"),  # was read as its keys
        (["ok", 5], None, "prompt"),
        ("\x00\ud800", None, "prompt"),  # tokenizers' TypeError
        (["a"], {"max_tokens": 2}, "params"),  # an AttributeError deep in the engine
        (["a"], [None], "params"),
        (["a"], [SamplingParams(), SamplingParams()], "params"),  # zip's ValueError
    ],
)
def test_prompts_and_params_of_the_wrong_kind_raise_one_typed_error(
    small_llm, prompts, params, field
):
    with pytest.raises(TierserveError) as err:
        small_llm.generate(prompts, params)
    assert err.value.field == field
    assert not small_llm.engine.has_unfinished()


def test_generate_from_several_threads_runs_each_call_whole(small_llm):
    """Calls from threads take turns: each got an internal RuntimeError but one, or would
    have waited for outputs another thread's steps took."""
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    want = small_llm.generate([[5, 6, 7], [8, 9]], params)
    results: list = []
    start = threading.Barrier(4)

    def call() -> None:
        start.wait()
        try:
            results.append(small_llm.generate([[5, 6, 7], [8, 9]], params))
        except Exception as err:  # reported below as what went wrong
            results.append(err)

    threads = [threading.Thread(target=call) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)  # a hang bound, far past four small calls
    assert len(results) == 4
    for got in results:
        assert [o.token_ids for o in got] == [o.token_ids for o in want], got


def test_open_streams_and_a_generate_between_them_keep_their_own_outputs(small_llm):
    """Two streams read in turns, and a generate while a stream is open: whichever call
    stepped the engine dropped the others' tokens, and a stream whose request another call
    finished stepped an idle engine for ever."""
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    want = [o.text for o in small_llm.generate([[5, 6, 7], [8, 9]], params)]
    a, b = small_llm.generate_stream([5, 6, 7], params), small_llm.generate_stream([8, 9], params)
    read: list[list[str]] = [[], []]
    for da, db in itertools.zip_longest(a, b):
        read[0].append(da or "")
        read[1].append(db or "")
    assert ["".join(r) for r in read] == want
    stream = small_llm.generate_stream([5, 6, 7], params)
    first = next(stream)
    assert small_llm.generate([[8, 9]], params)[0].text == want[1]  # finishes the stream's too
    assert first + "".join(stream) == want[0]
    assert not small_llm.engine.has_unfinished()


def test_an_interrupted_generate_leaves_nothing_running(small_llm, monkeypatch):
    """A Ctrl-C mid-generate left its requests in the engine, taking KV and steps in every
    later call, their outputs thrown away."""
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    want = small_llm.generate([[5, 6, 7]], params)
    step, steps = small_llm.engine.step, itertools.count()

    def interrupted_third_step():
        if next(steps) == 2:
            raise KeyboardInterrupt
        return step()

    monkeypatch.setattr(small_llm.engine, "step", interrupted_third_step)
    with pytest.raises(KeyboardInterrupt):
        small_llm.generate([[5, 6, 7]] * 4, params)
    monkeypatch.undo()
    assert not small_llm.engine.has_unfinished()
    small_llm.engine.check_accounting()
    assert small_llm.generate([[5, 6, 7]], params)[0].token_ids == want[0].token_ids


def test_a_model_that_is_no_path_is_refused_by_name():
    with pytest.raises(TierserveError, match="model must be a checkpoint directory's path"):
        LLM(123)  # a TypeError from pathlib


def test_a_closed_llm_says_so(llama_dir):
    llm = LLM(str(llama_dir), max_total_tokens=1024)
    llm.close()
    for call in (lambda: llm.generate("hi"), lambda: next(llm.generate_stream("hi"))):
        with pytest.raises(TierserveError, match="this LLM is closed"):
            call()


def test_a_bad_prompt_in_a_batch_queues_nothing(small_llm):
    with pytest.raises(TierserveError):
        small_llm.generate([[5, 6, 7], [1] * 600], SamplingParams(max_tokens=4))
    assert not small_llm.engine.has_unfinished()
    small_llm.engine.check_accounting()


def test_request_larger_than_the_pool_is_refused(llama_dir):
    llm = LLM(str(llama_dir), max_total_tokens=64, page_size=16)
    with pytest.raises(TierserveError, match="KV pool of 64 tokens"):
        llm.generate([[5] * 60], SamplingParams(max_tokens=10))


@pytest.mark.parametrize(
    ("kwargs", "field", "limit"),
    [
        ({"max_tokens": 0}, "max_tokens", ">= 1"),
        ({"max_tokens": -3}, "max_tokens", ">= 1"),
        ({"temperature": -0.1}, "temperature", ">= 0"),
        ({"top_p": 0.0}, "top_p", "(0, 1]"),
        ({"top_p": 1.5}, "top_p", "(0, 1]"),
        ({"top_k": -2}, "top_k", "[0, 2**31)"),
        ({"min_p": 2.0}, "min_p", "[0, 1]"),
        ({"top_k": 2**31}, "top_k", "[0, 2**31)"),
        ({"ignore_eos": "yes"}, "ignore_eos", "true or false"),
        ({"skip_special_tokens": None}, "skip_special_tokens", "true or false"),
        # Each was accepted as something else: True as id 1, 5.7 as 5, "1_0" as 10, and of
        # two spellings of one id the last silently won; a list of ints was a TypeError.
        ({"stop_token_ids": [True]}, "stop_token_ids", "integers"),
        ({"logit_bias": {5.7: 1}}, "logit_bias", "token ids, got 5.7"),
        ({"logit_bias": {"1_0": 1}}, "logit_bias", "token ids, got '1_0'"),
        ({"logit_bias": {"100": 1, "0100": 2}}, "logit_bias", "a token id twice"),
        ({"logit_bias": {"5": "a", "05": 1}}, "logit_bias", "a token id twice"),  # no sort error
        ({"logit_bias": [1]}, "logit_bias", "[-100, 100]"),
    ],
)
def test_bad_sampling_params_name_field_and_limit(kwargs, field, limit):
    with pytest.raises(TierserveError) as err:
        SamplingParams(**kwargs)
    assert err.value.field == field
    assert limit in str(err.value)


def test_engine_flags_are_llm_kwargs(llama_dir):
    from tierserve.args import EngineArgs

    with pytest.raises(TierserveError, match="unknown engine argument"):
        LLM(str(llama_dir), page_sise=16)
    with pytest.raises(TierserveError) as err:
        LLM(str(llama_dir), page_size=0)
    assert err.value.field == "page_size"
    with pytest.raises(TierserveError, match="max_position_embeddings 2048"):
        LLM(str(llama_dir), context_length=4096)
    # what argparse refuses for a flag, by name, not a TypeError or torch's RuntimeError
    wrong = {"tp_size": "2"}, {"page_size": True}, {"disable_radix_cache": 1}, {"device": "gpu"}
    wrong += {"seed": 2**70}, {"seed": -1}, {"tp_size": 10**20}  # torch's overflow, a tuple's
    for kwargs in wrong:
        with pytest.raises(TierserveError, match="must be") as err:
            LLM(str(llama_dir), **kwargs)
        assert err.value.field == next(iter(kwargs))
    assert EngineArgs.from_kwargs("m", speculative_algorithm=None, context_length=None)


def test_cli_flags_and_llm_kwargs_are_one_config():
    import argparse

    from tierserve.args import EngineArgs

    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    ns = parser.parse_args(
        ["--model-path", "m", "--page-size", "8", "--enable-hierarchical-cache"]
        + ["--hicache-size", "4GB"]
    )
    assert EngineArgs.from_cli(ns) == EngineArgs.from_kwargs(
        "m", page_size=8, enable_hierarchical_cache=True, hicache_size="4GB"
    )


@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_a_step_carries_draft_tokens_and_samples_each_as_one_by_one_decoding(
    llama_dir, prompts, backend
):
    """A request's step may hold tokens after its known ones (a speculative draft): the step
    samples at its last known token and at each draft token, in one forward and one sampler
    call, beside a plain decode row of another request. A correct draft gives the tokens that
    decoding them one by one gives; a wrong draft token changes nothing before it, and the
    verifier keeps only the tokens up to the target's own at the first wrong one."""
    from tierserve.engine.scheduler import ScheduledChunk

    llm = LLM(str(llama_dir), max_total_tokens=4096, attention_backend=backend)
    a, b = prompts[1], prompts[3]
    ref = [o.token_ids for o in llm.generate([a, b], GREEDY)]
    engine = llm.engine
    for p in (a, b):
        engine.add_request(p, GREEDY)
    while any(not r.output_ids for r in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()  # prefill both: each has sampled its first token
    req_a, req_b = sorted(engine.scheduler.running, key=lambda r: r.arrival)
    assert req_a.output_ids == ref[0][:1] and req_b.output_ids == ref[1][:1]
    for draft, expect in (
        (tuple(ref[0][1:5]), ref[0][1:6]),  # every draft token right: 5 tokens from one step
        ((ref[0][1], ref[0][2], 7, 7), ref[0][1:4]),  # right up to the third: 3 agree
    ):
        chunks = [ScheduledChunk(req_b, 1), ScheduledChunk(req_a, 1, draft)]
        for c in chunks:  # the scheduler's job, here by hand: pages for every row
            assert engine.kv.grow(c.req.kv, c.req.num_computed + c.num_rows)
        plain, drafted = engine.runner.step(chunks)
        assert plain.tokens == (ref[1][1],)
        assert drafted.tokens == tuple(expect)


def test_n_samples_offline_as_vllm_each_a_single_request_with_its_seed(small_llm):
    """vLLM's offline `n`: one output per prompt, `outputs` its n samples; sample i equals a
    request of its own with seed + i; the samples after the first start from its prefix in
    the radix cache; only the first scores the prompt."""
    prompt = list(range(3, 99))  # six 16-token pages
    sampled = SamplingParams(max_tokens=8, temperature=1.0, seed=5, n=3, prompt_logprobs=1)
    stats = small_llm.engine.scheduler.stats
    small_llm.engine.flush_cache()
    cached = stats.num_cached_tokens
    (out,) = small_llm.generate([prompt], sampled)
    assert stats.num_cached_tokens - cached >= 2 * 80  # the two later samples' prefix hits
    assert [s.index for s in out.outputs] == [0, 1, 2]
    for i, sample in enumerate(out.outputs):
        alone = small_llm.generate([prompt], SamplingParams(max_tokens=8, temperature=1.0,
                                                            seed=5 + i))[0]  # fmt: skip
        assert sample.token_ids == alone.token_ids and sample.text == alone.text
    assert len({tuple(s.token_ids) for s in out.outputs}) > 1  # sampled apart
    assert out.token_ids == out.outputs[0].token_ids and len(out.prompt_logprobs) == 95
    greedy = small_llm.generate([prompt, [5, 6]], SamplingParams(max_tokens=6, temperature=0, n=2))
    for one in greedy:
        assert one.outputs[0].token_ids == one.outputs[1].token_ids
    for bad in (0, 129, True, 1.5):
        with pytest.raises(TierserveError, match="n must be"):
            SamplingParams(n=bad)
    with pytest.raises(TierserveError, match="one sample"):
        next(small_llm.generate_stream([5, 6], SamplingParams(n=2)))
