"""The model's tokenizer: loaded with transformers by the processes that read or write text, and
only its end-of-sequence id, read from its files, where nothing else is needed.

An engine core or a rank only runs steps on token ids. Loading the tokenizer there imports
transformers' model-config machinery (torch.distributed.tensor, sympy): about two CPU-seconds
per process, for one integer. So the engine reads that integer from the files when they say it
plainly, loads the tokenizer otherwise, and loads it anyway the first time it is needed (a text
prompt offline, the first structured output: xgrammar reads the vocabulary then, as vLLM's
engine builds its grammar backend at the first such request).
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tierserve.errors import TierserveError

# The classes a tokenizer_config.json names for a plain tokenizer.json (transformers 5 calls
# both TokenizersBackend).
_PLAIN_CLASSES = ("PreTrainedTokenizerFast", "TokenizersBackend")
# Model types (config.json) of the families tierserve serves for which AutoTokenizer keeps that
# class. For some others it substitutes the model's own (qwen2's Qwen2Tokenizer): those take
# AutoTokenizer's path. tests/test_tokenizer.py checks this set against transformers' list.
PLAIN_MODEL_TYPES = frozenset(
    {"llama", "mistral", "qwen3", "qwen3_moe", "deepseek_v2", "deepseek_v3"}
)


def load_tokenizer(path: str) -> Any:  # a transformers PreTrainedTokenizerBase
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never reach for a hub
    # A path that is no directory: transformers would read it as a hub repo id and say so. A
    # repo id ("org/name") is still tried, in the local Hugging Face cache only.
    if str(path).startswith(("/", ".", "~")) and not Path(path).expanduser().is_dir():
        raise TierserveError(f"tokenizer directory not found: {path}", field="tokenizer")
    try:
        if _plain_tokenizer(Path(path)):
            from transformers import PreTrainedTokenizerFast

            return PreTrainedTokenizerFast.from_pretrained(path, local_files_only=True)
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except Exception as err:  # a damaged file fails deep inside transformers, of any type
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        message = f"cannot load a tokenizer from {path} ({first}); give --tokenizer DIR"
        raise TierserveError(message, field="tokenizer") from None


def _plain_tokenizer(root: Path) -> bool:
    """Whether AutoTokenizer would load `root` as the class it names, TokenizersBackend: a plain
    class named, no code of its own (auto_map), no Mistral tekken.json it would prefer, a model
    type whose own class it does not put first.

    AutoTokenizer reads the model's config before it looks at the tokenizer's, and that imports
    transformers' model machinery (torch, torch.distributed.tensor, sympy): ~3 CPU-seconds of a
    server's start in its API process, against ~0.8 for loading the class directly."""
    try:
        config = json.loads((root / "tokenizer_config.json").read_text())
        model = json.loads((root / "config.json").read_text())
    except (OSError, ValueError):
        return False
    if not (isinstance(config, dict) and isinstance(model, dict)):
        return False
    # AutoTokenizer checks the config's model_name (where it has one) against its list too.
    types = (model.get("model_type"), model.get("model_name", model.get("model_type")))
    return (
        all(isinstance(t, str) and t in PLAIN_MODEL_TYPES for t in types)
        and config.get("tokenizer_class") in _PLAIN_CLASSES
        and "auto_map" not in config
        and (root / "tokenizer.json").is_file()
        and not (root / "tekken.json").exists()
    )


def lazy_tokenizer(path: str) -> Callable[[], Any]:
    """The tokenizer at `path`, loaded by the first call (later calls return the same one)."""
    return functools.cache(functools.partial(load_tokenizer, path))


def eos_token_id(path: str, tokenizer: Callable[[], Any]) -> int | None:
    """The tokenizer's `eos_token_id`: read from tokenizer_config.json and tokenizer.json when
    they state it without ambiguity, else from `tokenizer()` (which loads it)."""
    read = _eos_from_files(Path(path))
    return read if read is not None else tokenizer().eos_token_id


def _eos_from_files(root: Path) -> int | None:
    """None wherever transformers would have more to say: a special_tokens_map.json beside the
    config, a class that brings its own default, a token missing from tokenizer.json."""
    if (root / "special_tokens_map.json").exists():
        return None
    try:
        config = json.loads((root / "tokenizer_config.json").read_text())
        vocab = json.loads((root / "tokenizer.json").read_text())
    except (OSError, ValueError):
        return None
    token = config.get("eos_token") if isinstance(config, dict) else None
    if isinstance(token, dict):  # an AddedToken, serialised
        token = token.get("content")
    if not isinstance(token, str) or not isinstance(vocab, dict):
        return None
    added, model = vocab.get("added_tokens") or [], vocab.get("model") or {}
    if not isinstance(added, list) or not all(isinstance(t, dict) for t in added):
        return None  # a damaged file: transformers' load gives the error
    ids = {t.get("id") for t in added if t.get("content") == token}
    if not ids:
        model_vocab = model.get("vocab") if isinstance(model, dict) else None
        if isinstance(model_vocab, dict) and token in model_vocab:
            ids = {model_vocab[token]}
    if len(ids) != 1:
        return None
    (found,) = ids
    return found if isinstance(found, int) else None
