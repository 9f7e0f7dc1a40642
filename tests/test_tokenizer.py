"""The end-of-sequence id an engine reads from the tokenizer's files (so that a core or a rank
never loads the tokenizer) is transformers' `eos_token_id`; where the files leave any doubt the
tokenizer is loaded instead, with the same answer."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from tests.conftest import TRAINING_TEXT, make_checkpoint, modules_after
from tierserve import LLM
from tierserve.args import default_model
from tierserve.errors import TierserveError
from tierserve.frontend.tokenizer import (
    PLAIN_MODEL_TYPES,
    _eos_from_files,
    _plain_tokenizer,
    eos_token_id,
    lazy_tokenizer,
    load_tokenizer,
)

FAMILIES = ("llama", "qwen3", "deepseek-v3")


def hf_tokenizer(path: Path) -> Any:
    return AutoTokenizer.from_pretrained(str(path), local_files_only=True)


def hf_eos(path: Path) -> int | None:
    return hf_tokenizer(path).eos_token_id


@pytest.mark.parametrize("family", FAMILIES)
def test_the_files_give_transformers_eos_id_for_the_test_checkpoints(tmp_path, family):
    path = make_checkpoint(tmp_path / family, family)
    assert _eos_from_files(path) is not None  # the cheap path is the one taken
    assert _eos_from_files(path) == hf_eos(path)


def test_the_files_give_transformers_eos_id_for_the_demo_model():
    demo = Path(default_model())
    assert _eos_from_files(demo) == hf_eos(demo) == 1


def _demo_copy(tmp_path: Path) -> Path:
    root = tmp_path / "tok"
    root.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "config.json"):
        shutil.copy(Path(default_model()) / name, root / name)
    return root


def _edit_config(root: Path, **changes: object) -> None:
    path = root / "tokenizer_config.json"
    config = json.loads(path.read_text())
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    path.write_text(json.dumps(config))


@pytest.mark.parametrize("case", ["special-tokens-map", "no-eos", "eos-outside-vocab", "added"])
def test_files_in_doubt_load_the_tokenizer_and_agree_with_it(tmp_path, case):
    root = _demo_copy(tmp_path)
    if case == "special-tokens-map":  # transformers reads it too: let it decide
        (root / "special_tokens_map.json").write_text(json.dumps({"eos_token": "<|pad|>"}))
    elif case == "no-eos":
        _edit_config(root, eos_token=None)
    elif case == "eos-outside-vocab":
        _edit_config(root, eos_token="<|not-a-token|>")
    else:  # an AddedToken, as save_pretrained writes some
        _edit_config(root, eos_token={"content": "<|pad|>", "__type": "AddedToken"})
    loads: list[int] = []
    tokenizer = lazy_tokenizer(str(root))

    def counted():
        loads.append(1)
        return tokenizer()

    got = eos_token_id(str(root), counted)
    assert got == hf_eos(root)
    # Only a plainly stated token skips the load.
    assert loads == ([] if case == "added" else [1]), case


@pytest.mark.parametrize(
    "body",
    [
        {"added_tokens": "<|eos|>"},
        {"added_tokens": ["<|eos|>"]},
        {"added_tokens": [], "model": "bpe"},
        {"added_tokens": [], "model": {"vocab": ["<|eos|>"]}},
        ["not", "an", "object"],
    ],
)
def test_a_tokenizer_json_of_the_wrong_shape_leaves_it_to_transformers(tmp_path, body):
    """Never a traceback from the cheap read: it steps aside, and loading the tokenizer says
    what is wrong in one line."""
    root = _demo_copy(tmp_path)
    (root / "tokenizer.json").write_text(json.dumps(body))
    assert _eos_from_files(root) is None
    with pytest.raises(TierserveError) as err:
        eos_token_id(str(root), lazy_tokenizer(str(root)))
    assert err.value.field == "tokenizer"


def test_a_missing_tokenizer_is_still_refused_by_name(tmp_path):
    with pytest.raises(TierserveError) as err:
        eos_token_id(str(tmp_path), lazy_tokenizer(str(tmp_path)))
    assert err.value.field == "tokenizer" and "--tokenizer" in err.value.message


def test_an_offline_engine_without_a_tokenizer_is_refused_at_construction(tmp_path):
    """Its eos id is stated plainly, so the engine itself would start; the LLM reads text and
    refuses at once, as before the tokenizer became lazy."""
    model = make_checkpoint(tmp_path / "llama", "llama")
    # Enough for the files' reading of the eos id, not for transformers.
    (model / "tokenizer.json").write_text(
        json.dumps({"added_tokens": [{"id": 1, "content": "</s>"}]})
    )
    (model / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    assert _eos_from_files(model) == 1
    with pytest.raises(TierserveError) as err:
        LLM(str(model), max_total_tokens=256)
    assert err.value.field == "tokenizer"


@pytest.mark.parametrize("family", ("demo", *FAMILIES, "qwen2"))
def test_a_plain_tokenizer_is_loaded_directly_and_as_autotokenizer_loads_it(tmp_path, family):
    """A tokenizer_config naming TokenizersBackend (or PreTrainedTokenizerFast) is loaded as
    that class, skipping AutoTokenizer's read of the model's config: the same tokenizer, and
    no torch imported for it (about 3 CPU-seconds of a server's start). A qwen2 model's goes
    through AutoTokenizer, which gives it Qwen2Tokenizer: the same class either way."""
    path = Path(default_model()) if family == "demo" else make_checkpoint(tmp_path / family, family)
    assert _plain_tokenizer(path) == (family != "qwen2")
    plain, auto = load_tokenizer(str(path)), hf_tokenizer(path)
    assert type(plain) is type(auto)
    text = TRAINING_TEXT[:200]
    ids = plain(text).input_ids
    assert ids == auto(text).input_ids and len(ids) > 10
    assert plain.decode(ids) == auto.decode(ids)
    assert plain.decode(ids, skip_special_tokens=True) == text
    assert plain.all_special_tokens == auto.all_special_tokens
    assert (plain.bos_token_id, plain.eos_token_id) == (auto.bos_token_id, auto.eos_token_id)
    chat = [{"role": "user", "content": "hello"}]
    rendered = plain.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert rendered == auto.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    if family == "qwen2":
        assert type(plain).__name__ == "Qwen2Tokenizer"
        return
    probe = "import sys; from tierserve.frontend import load_tokenizer; load_tokenizer(sys.argv[1])"
    assert "torch" not in modules_after(probe, str(path))


def test_the_plain_model_types_are_none_whose_class_autotokenizer_overrides():
    """transformers' list of model types whose hub tokenizer class it replaces by the model's
    own: none of tierserve's plain ones may be on it (an upgrade that adds one fails here)."""
    from transformers.models.auto import tokenization_auto

    overridden = tokenization_auto.MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS
    assert "qwen2" in overridden and not PLAIN_MODEL_TYPES & overridden


@pytest.mark.parametrize(
    "case",
    ["auto-map", "tekken", "model-class", "no-tokenizer-json", "model-type", "model-name",
     "no-config"],
)  # fmt: skip
def test_any_other_tokenizer_is_left_to_autotokenizer(tmp_path, case):
    """Code of its own, a Mistral tekken.json, a model's own class, no tokenizer.json, a model
    type or model name whose class AutoTokenizer substitutes, or no config.json to say the
    type: what AutoTokenizer makes of it is its own decision."""
    root = _demo_copy(tmp_path)
    assert _plain_tokenizer(root)
    if case == "auto-map":
        _edit_config(root, auto_map={"AutoTokenizer": [None, "tok.MyTokenizer"]})
    elif case == "tekken":
        (root / "tekken.json").write_text("{}")
    elif case == "model-class":
        _edit_config(root, tokenizer_class="Qwen2Tokenizer")
    elif case == "no-tokenizer-json":
        (root / "tokenizer.json").unlink()
    elif case in ("model-type", "model-name"):  # a type whose class AutoTokenizer replaces
        config = json.loads((root / "config.json").read_text())
        key = case.replace("-", "_")
        (root / "config.json").write_text(json.dumps({**config, key: "qwen2"}))
    else:
        (root / "config.json").unlink()
    assert not _plain_tokenizer(root)
