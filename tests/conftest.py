"""Tiny random-init Hugging Face checkpoints, made with `save_pretrained` inside the test run."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch.set_num_threads(min(2, os.cpu_count() or 1))

VOCAB = 320
TRAINING_TEXT = (
    "Once upon a time there was a small cache that wanted to keep every key and value. "
    "The server sent requests; the scheduler batched them; pages moved between tiers. "
    "Héllo wörld, naïve café: ünïcode bytes split across tokens. 你好，世界。 "
) * 8


def make_tokenizer(path: Path, vocab_size: int = VOCAB) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator([TRAINING_TEXT], trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")
    fast.chat_template = (
        "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant:{% endif %}"
    )
    fast.save_pretrained(path)


def make_checkpoint(path: Path, family: str, seed: int = 0, **overrides) -> Path:
    """A 2-layer GQA model of the given family with random weights and our test tokenizer."""
    import transformers

    common = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        initializer_range=0.2,  # spread-out logits: greedy ties between engines are unlikely
        bos_token_id=0,
        eos_token_id=1,
    )
    configs = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM, {}),
        "llama3": (
            transformers.LlamaConfig,
            transformers.LlamaForCausalLM,
            {
                "rope_parameters": {
                    "rope_type": "llama3",
                    "rope_theta": 500000.0,
                    "factor": 8.0,
                    "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 256,
                }
            },
        ),
        "qwen2": (
            transformers.Qwen2Config,
            transformers.Qwen2ForCausalLM,
            {"tie_word_embeddings": True},
        ),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM, {"head_dim": 32}),
    }
    config_cls, model_cls, extra = configs[family]
    torch.manual_seed(seed)
    config = config_cls(**{**common, **extra, **overrides})
    model = model_cls(config).eval()
    if family == "qwen2":  # biases start at zero; make them matter
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                torch.nn.init.normal_(proj.bias, std=0.5)
    model.save_pretrained(path)
    make_tokenizer(path)
    return path


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("ckpt")
    return {f: make_checkpoint(root / f, f) for f in ("llama", "llama3", "qwen2", "qwen3")}


@pytest.fixture(scope="session")
def llama_dir(checkpoints) -> Path:
    return checkpoints["llama"]


def random_prompts(n: int, lengths: list[int], seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randint(2, VOCAB, (lengths[i % len(lengths)],), generator=g).tolist()
        for i in range(n)
    ]
