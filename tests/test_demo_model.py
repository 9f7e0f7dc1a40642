"""The bundled demo model (tierserve/demo_model/, made by scripts/train_demo_model.py).

It must load in transformers and in tierserve with identical greedy output, stay under the
held-out loss bound its model card states, and write mostly English words.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

import tierserve
from tests.conftest import http

DEMO_DIR = Path(tierserve.__file__).parent / "demo_model"
DATA_DIR = Path(__file__).parent / "data"

# Stated in tierserve/demo_model/README.md; measured there as the loss on tests/data/heldout.txt
# (a slice of Julius Caesar and Twelfth Night, plays the training never saw), plus a margin.
HELDOUT_LOSS_BOUND = 4.3
WORD_RE = re.compile(r"[a-z]+(?:'[a-z]+)*")  # as in scripts/train_demo_model.py
SHIPPED_FILES = {
    "README.md",
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
}


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(DEMO_DIR, local_files_only=True)


@pytest.fixture(scope="module")
def hf_model():
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(DEMO_DIR, local_files_only=True).eval()


_HF_GREEDY: dict[tuple[int, tuple[int, ...], int], list[int]] = {}


def hf_greedy(model, ids: list[int], n: int) -> list[int]:
    """transformers' greedy tokens after `ids`, generated once per model, prompt and length
    (two tests ask for the same "ROMEO:" continuation)."""
    key = (id(model), tuple(ids), n)
    if key not in _HF_GREEDY:
        _HF_GREEDY[key] = _hf_generate(model, ids, n)
    return _HF_GREEDY[key]


def _hf_generate(model, ids: list[int], n: int) -> list[int]:
    import torch

    inputs = torch.tensor([ids])
    with torch.no_grad():
        out = model.generate(
            inputs,
            attention_mask=torch.ones_like(inputs),
            do_sample=False,
            max_new_tokens=n,
            min_new_tokens=n,
        )
    return out[0, len(ids) :].tolist()


def test_folder_is_small_and_complete():
    files = {f.name for f in DEMO_DIR.iterdir()}
    assert files == SHIPPED_FILES  # in particular no checkpoints or optimizer states
    assert sum((DEMO_DIR / f).stat().st_size for f in files) <= 25 * 1024 * 1024
    config = json.loads((DEMO_DIR / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    # Grouped-query attention, so the cache code's head grouping is exercised.
    assert config["num_key_value_heads"] < config["num_attention_heads"]
    assert config["num_attention_heads"] % config["num_key_value_heads"] == 0
    tok_config = json.loads((DEMO_DIR / "tokenizer_config.json").read_text())
    assert "add_generation_prompt" in tok_config["chat_template"]


def test_tokenizer_and_chat_template(tok):
    ids = tok("ROMEO:").input_ids
    assert ids[0] == tok.bos_token_id
    assert tok.decode(ids, skip_special_tokens=True) == "ROMEO:"
    assert tok.eos_token == "<|eos|>" and tok.pad_token_id is not None
    text = tok.apply_chat_template(
        [{"role": "user", "content": "Good morrow."}], add_generation_prompt=True, tokenize=False
    )
    assert text == "<|bos|><|user|>\nGood morrow.\n<|assistant|>\n"


def test_heldout_loss_below_bound(tok, hf_model):
    import torch

    text = (DATA_DIR / "heldout.txt").read_text()
    ids = tok(text).input_ids
    assert len(ids) > 1500
    total, count = 0.0, 0
    with torch.no_grad():
        for start in range(0, len(ids) - 1, 512):
            chunk = torch.tensor([ids[start : start + 513]])
            logits = hf_model(input_ids=chunk[:, :-1]).logits.float()
            total += torch.nn.functional.cross_entropy(
                logits[0], chunk[0, 1:], reduction="sum"
            ).item()
            count += chunk.shape[1] - 1
    loss = total / count
    assert loss < HELDOUT_LOSS_BOUND, f"held-out loss {loss:.3f}"
    card = (DEMO_DIR / "README.md").read_text()
    assert f"held-out loss < {HELDOUT_LOSS_BOUND}" in card


def test_sampled_romeo_is_mostly_words(tok, hf_model):
    import torch

    words = set((DATA_DIR / "shakespeare_words.txt").read_text().split())
    assert 10_000 < len(words) < 100_000
    prompt = torch.tensor([tok("ROMEO:").input_ids])
    torch.manual_seed(0)
    with torch.no_grad():
        out = hf_model.generate(
            prompt,
            attention_mask=torch.ones_like(prompt),
            do_sample=True,
            temperature=0.8,
            top_k=0,
            top_p=1.0,
            max_new_tokens=64,
        )
    text = tok.decode(out[0, prompt.shape[1] :], skip_special_tokens=True)
    found = WORD_RE.findall(text.lower())
    assert len(found) >= 10, text
    known = sum(w in words for w in found) / len(found)
    assert known >= 0.7, f"{known:.0%} known words in {text!r}"


# --- tierserve and transformers agree -------------------------------------------------------

PROMPTS = [
    "ROMEO:",
    "JULIET:\nO Romeo, Romeo! wherefore art thou Romeo?\n",
    None,  # filled with a longer held-out passage below
]


def prompt_ids(tok) -> list[list[int]]:
    passage = (DATA_DIR / "heldout.txt").read_text()[:1200]
    return [tok(p if p is not None else passage).input_ids for p in PROMPTS]


def test_greedy_matches_transformers(tok, hf_model):
    pytest.importorskip("tierserve.engine.llm")
    from tierserve import LLM, SamplingParams

    # Plain-text prompts: eos is never the greedy choice here, so transformers' min_new_tokens
    # (eos suppressed) and tierserve's ignore_eos (eos allowed, does not stop) agree.
    prompts = prompt_ids(tok)
    expected = [hf_greedy(hf_model, ids, 32) for ids in prompts]
    llm = LLM(str(DEMO_DIR))
    outs = llm.generate(prompts, SamplingParams(max_tokens=32, temperature=0, ignore_eos=True))
    assert [list(o.token_ids) for o in outs] == expected


def test_greedy_from_string_prompt_matches_transformers(tok, hf_model):
    pytest.importorskip("tierserve.engine.llm")
    from tierserve import LLM, SamplingParams

    expected = hf_greedy(hf_model, tok("ROMEO:").input_ids, 32)
    llm = LLM(str(DEMO_DIR))
    ids = tok("ROMEO:").input_ids
    outs = llm.generate(
        ["ROMEO:", ids], SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    )
    assert list(outs[1].token_ids) == expected
    assert list(outs[0].token_ids) == expected  # tierserve tokenizes with the bos, as HF does


def test_chat_renders_the_template_once_and_answers_as_transformers(tok, hf_model):
    """vLLM's offline `LLM.chat` and its output shape (`out.outputs[0].text`): the prompt is
    the template's ids with one BOS, and the greedy answer transformers'."""
    from tierserve import LLM, SamplingParams, TierserveError

    conversations = [
        [{"role": "user", "content": "say the"}],
        [{"role": "system", "content": "You answer briefly."}, {"role": "user", "content": "hi"}],
    ]
    llm = LLM(str(DEMO_DIR))
    greedy = SamplingParams(max_tokens=32, temperature=0, logprobs=0)
    outs = llm.chat(conversations, greedy)
    assert llm.chat(conversations[0], greedy)[0].token_ids == outs[0].token_ids  # one, bare
    for conversation, out in zip(conversations, outs, strict=True):
        ids = tok.apply_chat_template(conversation, add_generation_prompt=True)["input_ids"]
        assert out.prompt_token_ids == ids and ids.count(tok.bos_token_id) == 1
        answer = [t for t in out.token_ids if t != tok.eos_token_id]
        assert answer == hf_greedy(hf_model, ids, len(answer))
        (sample,) = out.outputs
        assert (sample.text, sample.token_ids) == (out.text, out.token_ids)
        assert sample.finish_reason == out.finish_reason == "stop"
        assert sample.cumulative_logprob == pytest.approx(sum(t.logprob for t in out.logprobs))
        assert sample.logprobs is not None  # vLLM's shape: by position, then token id
        for token, lp, entry in zip(out.token_ids, out.logprobs, sample.logprobs, strict=True):
            assert entry[token].logprob == lp.logprob and entry[token].rank == lp.rank >= 1
    for bad in ([], [[]], "hi", [{"content": "no role"}]):
        with pytest.raises(TierserveError, match="messages must be a conversation"):
            llm.chat(bad, greedy)
    with pytest.raises(TierserveError, match="may not set 'tokenize'"):
        kwargs = {"tokenize": True}  # a keyword chat() sets itself: the server's refusal
        llm.chat([{"role": "user", "content": "a"}], greedy, chat_template_kwargs=kwargs)


def test_offline_chat_reads_messages_as_the_chat_route_does(demo_server):
    """OpenAI content parts and null content (each a template error offline), vLLM's
    continue_final_message (a TypeError), strict switches ("no" was read as true): the same
    prompt ids as the server's /v1/chat/completions/render, the same refusals."""
    from tierserve import LLM, SamplingParams, TierserveError

    llm = LLM(str(DEMO_DIR))
    one = SamplingParams(max_tokens=1, temperature=0)
    parts = [{"type": "text", "text": "Good "}, {"type": "text", "text": "morrow."}]
    cases = [
        ([{"role": "user", "content": parts}], {}),
        ([{"role": "system", "content": None}, {"role": "user", "content": "hi"}], {}),
        ([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Good"}],
         {"add_generation_prompt": False, "continue_final_message": True}),
    ]  # fmt: skip
    for messages, switches in cases:
        served = http.post(f"{demo_server.url}/v1/chat/completions/render",
                           json={"messages": messages, **switches}, timeout=60)  # fmt: skip
        out = llm.chat(messages, one, **switches)[0]
        assert out.prompt_token_ids == served.json()["token_ids"], messages
    with pytest.raises(TierserveError, match="add_generation_prompt"):
        llm.chat([{"role": "user", "content": "hi"}], one, add_generation_prompt="no")
    with pytest.raises(TierserveError, match=r"messages\.0\.role"):
        llm.chat([{"role": "bogus", "content": "hi"}], one)
    with pytest.raises(TierserveError, match="continue_final_message"):
        llm.chat([{"role": "user", "content": "hi"}], one, continue_final_message=True)
