"""Hidden-state capture for EAGLE-3 data (`--hidden-states-dir`): the file of every request
holds its prompt's hidden states at the asked layers and the final norm's input, equal to
transformers' `output_hidden_states` on the same weights, with the prefix cache cold and warm,
with chunked prefill and at --tp-size 2."""

from __future__ import annotations

import fcntl
from pathlib import Path

import openai
import pytest
import torch
import transformers
from safetensors.torch import load_file

import tierserve
from tests.conftest import Server, eventually, http, random_prompts
from tierserve import LLM, SamplingParams, TierserveError
from tierserve.engine.hidden_states import HiddenStatesWriter, default_layers

GREEDY = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
DEMO_DIR = Path(tierserve.__file__).parent / "demo_model"


def reference(path: Path, prompt: list[int]) -> tuple[torch.Tensor, ...]:
    """transformers' hidden states: [0] the embeddings, [k] decoder layer k − 1's output, the
    last one after the final norm."""
    model = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    with torch.no_grad():
        out = model(torch.tensor([prompt]), output_hidden_states=True)
    return tuple(h[0] for h in out.hidden_states), model.model.norm


def unlocked(path: str) -> bool:
    """Whether the file's lock can be taken now, as speculators takes it."""
    with open(path + ".lock") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        return True


def check_file(path: str, prompt: list[int], checkpoint: Path, layers: tuple[int, ...]) -> None:
    tensors = load_file(path)
    assert tensors["token_ids"].tolist() == prompt
    hidden = tensors["hidden_states"]
    want, norm = reference(checkpoint, prompt)
    assert hidden.shape == (len(prompt), len(layers) + 1, want[0].shape[-1])
    assert hidden.dtype == torch.float32  # the model's dtype
    for slot, k in enumerate(layers):
        torch.testing.assert_close(hidden[:, slot], want[k], atol=1e-4, rtol=1e-4)
    with torch.no_grad():  # the last slot is the final norm's input
        torch.testing.assert_close(norm(hidden[:, -1]), want[-1], atol=1e-4, rtol=1e-4)
    assert unlocked(path)  # written whole, its lock released (the reader removes it)


@pytest.mark.parametrize(
    ("family", "kw"),
    [
        ("llama", {}),
        ("deepseek-v3", {}),
        ("llama", {"chunked_prefill_size": 16}),
        ("llama", {"tp_size": 2}),
    ],
)
def test_captured_hidden_states_equal_transformers_cold_and_warm(checkpoints, tmp_path, family, kw):
    checkpoint = checkpoints[family]
    shared = random_prompts(1, [40], seed=1)[0]
    first, second = shared + [5, 6, 7], shared + [9, 10]  # the second's prefix is cached
    layers = (0, 1)
    with LLM(
        str(checkpoint),
        device="cpu",
        hidden_states_dir=str(tmp_path / "hs"),
        hidden_states_layers="0,1",
        **kw,
    ) as llm:
        outs = [llm.generate(p, GREEDY)[0] for p in (first, second)]
        again = llm.generate(first, GREEDY)[0]  # all of it cached
    for out, prompt in ((outs[0], first), (outs[1], second), (again, first)):
        assert out.hidden_states_path == str(tmp_path / "hs" / f"{out.request_id}.safetensors")
        check_file(out.hidden_states_path, prompt, checkpoint, layers)
    assert again.token_ids == outs[0].token_ids  # capture does not change what is generated


def test_default_layers_are_eagle3s_and_bad_layers_are_refused(checkpoints, tmp_path):
    assert default_layers(32) == (2, 16, 29)
    path = str(checkpoints["llama"])
    for layers, needle in (("0,9", r"\[0, 2\]"), ("a,b", "layer ids like")):
        with pytest.raises(TierserveError, match=needle):
            LLM(path, device="cpu", hidden_states_dir=str(tmp_path), hidden_states_layers=layers)
    with pytest.raises(TierserveError, match="give both"):
        LLM(path, device="cpu", hidden_states_layers="0")
    blocked = tmp_path / "file"
    blocked.write_text("not a directory")
    with pytest.raises(TierserveError, match=f"{blocked} is not a directory"):
        LLM(path, device="cpu", hidden_states_dir=str(blocked / "hs"))


def test_a_capturing_server_speaks_vllms_hidden_states_protocol(checkpoints, tmp_path):
    """What `speculators generate-offline-data` sends: token ids, max_tokens 1,
    return_token_ids; it reads kv_transfer_params.hidden_states_path and waits on its .lock.
    A directory that cannot take the file is a 507 before the request runs."""
    checkpoint, out_dir = checkpoints["llama"], tmp_path / "hs"
    flags = (
        "--device",
        "cpu",
        "--hidden-states-dir",
        str(out_dir),
        "--hidden-states-layers",
        "0,1",
    )
    prompt = random_prompts(1, [30], seed=3)[0]
    with Server(checkpoint, *flags) as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)
        reply = client.completions.create(
            model=checkpoint.name, prompt=prompt, max_tokens=1, temperature=0,
            extra_body={"return_token_ids": True},
        )  # fmt: skip
        choice = reply.choices[0].model_extra
        assert choice["prompt_token_ids"] == prompt and len(choice["token_ids"]) == 1
        path = reply.model_extra["kv_transfer_params"]["hidden_states_path"]
        assert Path(path).parent == out_dir
        assert eventually(lambda: unlocked(path), 30)
        check_file(path, prompt, checkpoint, (0, 1))
        assert server.metrics()["tierserve_hidden_states_files_total{outcome=written}"] == 1

        out_dir.rename(tmp_path / "moved")
        out_dir.write_text("a file where the directory was")
        body = {"model": checkpoint.name, "prompt": prompt, "max_tokens": 1}
        refused = http.post(f"{server.url}/v1/completions", json=body, timeout=30)
        assert refused.status_code == 507
        assert "not a writable directory" in refused.json()["error"]["message"]
        out_dir.unlink()
        (tmp_path / "moved").rename(out_dir)
        again = http.post(f"{server.url}/v1/completions", json=body, timeout=30)
        assert again.status_code == 200 and "kv_transfer_params" in again.json()


def test_ids_that_clean_alike_get_files_of_their_own(tmp_path):
    """ "x/y", "x?y" and "x_y" all wrote x_y.safetensors: each overwrote the last, silently."""
    writer = HiddenStatesWriter(str(tmp_path))
    ids = ["x/y", "x?y", "x_y", "a" * 300, "é", ".hidden"]
    paths = [writer.path_for(rid) for rid in ids]
    assert len(set(paths)) == len(ids)
    assert paths[2].name == "x_y.safetensors"  # a plain id keeps its own name
    assert all(len(p.name) < 255 and not p.name.startswith(".") for p in paths)
    writer.close()


def test_a_reader_holding_an_ids_lock_loses_that_file_but_never_holds_the_engine(tmp_path):
    """An id sent again while a reader still held its earlier file's lock: the engine's thread
    waited on the flock, and every request with it, as long as the reader liked."""
    writer = HiddenStatesWriter(str(tmp_path))
    hidden = torch.zeros(3, 2, 4)
    first = writer.submit("rid", [1, 2, 3], hidden)
    assert first is not None and eventually(lambda: unlocked(first), 30)
    with open(first + ".lock") as reader:
        fcntl.flock(reader, fcntl.LOCK_EX)  # a reader that does not let go
        assert writer.submit("rid", [4, 5, 6], hidden) is None  # at once, not after the reader
        assert writer.failed == 1 and Path(first + ".lock").exists()  # the reader's to remove
    assert load_file(first)["token_ids"].tolist() == [1, 2, 3]  # the earlier file stands
    again = writer.submit("rid", [7, 8, 9], hidden)
    assert again == first and eventually(lambda: unlocked(again), 30)
    assert load_file(again)["token_ids"].tolist() == [7, 8, 9]
    writer.close()


def test_chat_returns_token_ids_and_continues_a_final_message(demo_server):
    client = openai.OpenAI(base_url=f"{demo_server.url}/v1", api_key="x", max_retries=0)
    _chat_switches(client)


def _chat_switches(client: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello"}]
    reply = client.chat.completions.create(
        model=DEMO_DIR.name, messages=messages, max_tokens=4, temperature=0,
        extra_body={"return_token_ids": True, "add_generation_prompt": False,
                    "continue_final_message": True},
    )  # fmt: skip
    prompt_ids = reply.model_extra["prompt_token_ids"]
    assert prompt_ids and len(reply.choices[0].model_extra["token_ids"]) == 4
    opened = client.chat.completions.create(
        model=DEMO_DIR.name, messages=messages, max_tokens=1, extra_body={"return_token_ids": True}
    )
    # Continuing the last message renders it open: fewer ids than closing it and opening a turn.
    assert len(prompt_ids) < len(opened.model_extra["prompt_token_ids"])
    with pytest.raises(openai.BadRequestError, match="add_generation_prompt false"):
        client.chat.completions.create(
            model=DEMO_DIR.name, messages=messages, extra_body={"continue_final_message": True}
        )
