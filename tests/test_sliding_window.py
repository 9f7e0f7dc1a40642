"""Sliding-window attention (Mistral; Qwen2/Qwen3 layers from max_window_layers on) against
Hugging Face transformers on the same random-init weights, on every cache path: prefill,
chunked prefill, a cached prefix read back from the device pool or the host tier, decode."""

from __future__ import annotations

import itertools
import json
import shutil
from pathlib import Path

import pytest
import torch
import transformers

from tests.conftest import make_checkpoint, random_prompts
from tests.test_models import chunked_logits, hf_greedy
from tierserve import LLM, SamplingParams, TierserveError
from tierserve.model_config import ModelConfig

WINDOW = 16
FAMILIES = ["mistral", "qwen2", "qwen3"]
# Qwen: layer 0 full, layer 1 windowed (max_window_layers=1); Mistral: both layers windowed.
QWEN_WINDOWS = dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1)
EXPECTED_WINDOWS = {
    "mistral": (WINDOW, WINDOW),
    "qwen2": (None, WINDOW),
    "qwen3": (None, WINDOW),
}
PROMPT_LENGTHS = [64, 80, 49, 72]  # each at least 3 windows
MAX_NEW = 24


def make_windowed(path: Path, family: str) -> Path:
    if family == "mistral":
        return make_checkpoint(path, family, sliding_window=WINDOW)
    return make_checkpoint(path, family, **QWEN_WINDOWS)


@pytest.fixture(scope="module")
def windowed(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("windowed")
    return {f: make_windowed(root / f, f) for f in FAMILIES}


def without_window(src: Path, dst: Path) -> Path:
    """The same weights with full attention in every layer."""
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    config["sliding_window"] = None
    if "use_sliding_window" in config:  # Qwen: transformers rebuilds all-full layer_types
        config["use_sliding_window"] = False
        config.pop("layer_types", None)
    (dst / "config.json").write_text(json.dumps(config))
    return dst


# --- reading config.json ----------------------------------------------------------------------


def hf_layer_windows(config: transformers.PretrainedConfig) -> tuple[int | None, ...]:
    """Each layer's window as transformers' modeling code picks it."""
    if config.model_type == "mistral":  # every layer, layer_types or not
        return (config.sliding_window,) * config.num_hidden_layers
    if config.model_type == "llama":  # no windows
        return (None,) * config.num_hidden_layers
    return tuple(
        config.sliding_window if t == "sliding_attention" else None for t in config.layer_types
    )


@pytest.mark.parametrize(
    "config",
    [
        transformers.MistralConfig(num_hidden_layers=3, sliding_window=4096),
        transformers.MistralConfig(num_hidden_layers=3, sliding_window=None),
        transformers.Qwen2Config(num_hidden_layers=4, use_sliding_window=True, max_window_layers=2),
        transformers.Qwen2Config(num_hidden_layers=4, sliding_window=128),  # off by default
        transformers.Qwen3Config(num_hidden_layers=4, use_sliding_window=True, max_window_layers=0),
        transformers.Qwen3Config(
            num_hidden_layers=3,
            use_sliding_window=True,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        ),
        transformers.LlamaConfig(num_hidden_layers=2),
    ],
    ids=lambda c: c.model_type,
)
def test_layer_windows_are_those_transformers_uses(config):
    assert ModelConfig.from_dict(config.to_dict()).layer_windows == hf_layer_windows(config)


QWEN_BASE = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2",
             "num_attention_heads": 4, "hidden_size": 64, "num_hidden_layers": 4}  # fmt: skip


@pytest.mark.parametrize(
    ("extra", "windows"),
    [
        # Qwen2.5 as published: a window given but switched off, no layer_types.
        ({"sliding_window": 131072, "use_sliding_window": False, "max_window_layers": 2}, None),
        # An older Qwen config switched on: windows from max_window_layers on.
        ({"sliding_window": 64, "use_sliding_window": True, "max_window_layers": 2},
         (None, None, 64, 64)),
        # No use_sliding_window at all: Qwen2Config's default (off).
        ({"sliding_window": 64}, None),
        # A Mistral-style config (no use_sliding_window): every layer.
        ({"model_type": "mistral", "sliding_window": 64}, (64,) * 4),
        # Mistral's model reads only sliding_window: not layer_types, not use_sliding_window.
        ({"model_type": "mistral", "sliding_window": 8, "layer_types": ["full_attention"] * 4},
         (8,) * 4),
        ({"model_type": "mistral", "sliding_window": 8, "use_sliding_window": False}, (8,) * 4),
        # No model_type: layer_types, then use_sliding_window, as for Qwen.
        ({"model_type": None, "sliding_window": 8,
          "layer_types": ["full_attention", "sliding_attention"] * 2}, (None, 8) * 2),
        ({"model_type": None, "sliding_window": 8, "use_sliding_window": False}, None),
    ],
)  # fmt: skip
def test_layer_windows_from_config_json(extra, windows):
    cfg = ModelConfig.from_dict({**QWEN_BASE, **extra})
    assert cfg.layer_windows == (windows or (None,) * 4)
    assert [cfg.window(i) for i in range(4)] == list(windows or (None,) * 4)


@pytest.mark.parametrize(
    ("extra", "field"),
    [
        ({"sliding_window": 0}, "sliding_window"),
        ({"sliding_window": -4}, "sliding_window"),
        ({"sliding_window": "4096"}, "sliding_window"),
        ({"sliding_window": 16, "use_sliding_window": "yes"}, "use_sliding_window"),
        ({"sliding_window": 16, "use_sliding_window": True, "max_window_layers": 1.5},
         "max_window_layers"),
        ({"sliding_window": 16, "use_sliding_window": True, "layer_types": "sliding_attention"},
         "layer_types"),
        ({"sliding_window": 16, "use_sliding_window": True,
          "layer_types": ["full_attention", "sliding_attention"]}, "layer_types"),  # 2 of 4
        ({"sliding_window": 16, "use_sliding_window": True,
          "layer_types": ["chunked_attention"] * 4}, "layer_types"),
    ],
)  # fmt: skip
def test_malformed_window_config_is_refused(extra, field):
    with pytest.raises(TierserveError) as err:
        ModelConfig.from_dict({**QWEN_BASE, **extra})
    assert err.value.field == field


# --- against transformers -------------------------------------------------------------------


def test_windows_change_transformers_output(windowed, tmp_path):
    """The comparisons below can fail: past the window, transformers' greedy output with the
    window differs from the same weights' without it."""
    prompts = random_prompts(len(PROMPT_LENGTHS), PROMPT_LENGTHS, seed=82)  # as below
    for family, path in windowed.items():
        assert ModelConfig.from_dir(path).layer_windows == EXPECTED_WINDOWS[family]
        full = without_window(path, tmp_path / family)
        assert ModelConfig.from_dir(full).layer_windows == (None, None)
        with_window, without = hf_greedy(path, prompts, MAX_NEW), hf_greedy(full, prompts, MAX_NEW)
        assert with_window != without, family


@pytest.mark.parametrize("family", FAMILIES)
def test_prefill_and_chunked_prefill_logits_match_transformers(windowed, family):
    """One prefill, then the same prompt in three chunks over scattered pages (each chunk
    after the first attends to earlier chunks read back from the pool)."""
    path = windowed[family]
    prompt = random_prompts(1, [90], seed=81)[0]
    with torch.inference_mode():
        ref = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
        ref_logits = ref(torch.tensor([prompt])).logits[0]
    for bounds in ((0, 90), (0, 37, 50, 90)):
        for (lo, hi), ours in zip(
            itertools.pairwise(bounds), chunked_logits(path, prompt, bounds), strict=True
        ):
            torch.testing.assert_close(ours, ref_logits[lo:hi], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_matches_transformers_through_prefix_and_host_caches(windowed, family):
    """Chunked prefill (chunks of 24 < prompt), a device pool too small for the batch (pages
    go to the host tier and are loaded back), then the same prompts again (prefix hits), then
    follow-ups that extend them (a cached prefix longer than the window, then new tokens)."""
    path = windowed[family]
    prompts = random_prompts(len(PROMPT_LENGTHS), PROMPT_LENGTHS, seed=82)
    llm = LLM(
        str(path),
        page_size=16,
        max_total_tokens=256,
        chunked_prefill_size=24,
        enable_hierarchical_cache=True,
        hicache_ratio=8,
    )
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0, ignore_eos=True)
    expected = hf_greedy(path, prompts, MAX_NEW)
    first = llm.generate(prompts, params)
    assert [o.token_ids for o in first] == expected
    again = llm.generate(prompts, params)
    assert [o.token_ids for o in again] == expected
    assert sum(o.cached_tokens for o in again) > 0
    questions = random_prompts(len(prompts), [10], seed=83)
    follow = [p + o + q for p, o, q in zip(prompts, expected, questions, strict=True)]
    outs = llm.generate(follow, params)
    assert [o.token_ids for o in outs] == hf_greedy(path, follow, MAX_NEW)
    assert sum(o.cached_tokens for o in outs) > 0
    stats = llm.engine.kv.host.stats
    assert stats.load_backs > 0 and stats.host_hit_tokens > 0
    llm.engine.check_accounting()


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_matches_transformers_with_the_radix_cache_off(windowed, family):
    """Decode rows of different lengths in one step (the workspace groups them) with no
    cache sharing: the window is the mask's business alone."""
    path = windowed[family]
    prompts = random_prompts(6, [64, 3, 17, 100, 48, 33], seed=84)
    llm = LLM(str(path), page_size=16, max_total_tokens=4096, disable_radix_cache=True)
    outs = llm.generate(prompts, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))
    assert [o.token_ids for o in outs] == hf_greedy(path, prompts, 40)
