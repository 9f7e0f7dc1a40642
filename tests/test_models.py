"""Model code against Hugging Face transformers on the same random-init weights."""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import transformers

from tests.conftest import DEEPSEEK_FAMILIES, modules_after, random_prompts
from tierserve import LLM, SamplingParams
from tierserve.args import default_model
from tierserve.cache.pool import PagedKV
from tierserve.layers.attention import ForwardBatch, SeqSpan, TorchAttention
from tierserve.layers.decode_workspace import DecodeWorkspace
from tierserve.model_config import ModelConfig
from tierserve.models import check_checkpoint
from tierserve.models.loader import load_model
from tierserve.sizing.kv import KVSpec

FAMILIES = ["llama", "llama3", "qwen2", "qwen3", *DEEPSEEK_FAMILIES]
LENGTHS = [3, 9, 16, 17, 40, 64, 129, 300]


def hf_greedy(path, prompts: list[list[int]], max_new: int) -> list[list[int]]:
    """transformers' greedy continuations; kept for the run (checkpoints never change under one
    path), so tests that compare against the same prompts generate them once."""
    key = (str(path), tuple(map(tuple, prompts)), max_new)
    if key not in _HF_GREEDY:
        _HF_GREEDY[key] = _hf_greedy(path, prompts, max_new)
    return [list(out) for out in _HF_GREEDY[key]]


_HF_GREEDY: dict[tuple, list[list[int]]] = {}


def _hf_greedy(path, prompts: list[list[int]], max_new: int) -> list[list[int]]:
    model = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    # No EOS: generate exactly max_new tokens without masking EOS (min_new_tokens would).
    model.generation_config.eos_token_id = None
    outs = []
    for p in prompts:
        ids = torch.tensor([p])
        gen = model.generate(ids, max_new_tokens=max_new, do_sample=False)
        outs.append(gen[0, len(p) :].tolist())
    return outs


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_matches_transformers(checkpoints, family):
    path = checkpoints[family]
    prompts = random_prompts(8, LENGTHS, seed=1)
    llm = LLM(str(path), page_size=16, max_total_tokens=8192)
    outs = llm.generate(prompts, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))
    expected = hf_greedy(path, prompts, 16)
    for out, ref in zip(outs, expected, strict=True):
        assert out.token_ids == ref


@pytest.mark.parametrize("family", FAMILIES)
def test_prefill_logits_match_transformers(checkpoints, family):
    path = checkpoints[family]
    cfg = ModelConfig.from_dir(path)
    model = load_model(path, cfg, torch.float32, torch.device("cpu"))
    pool = PagedKV(KVSpec.from_model(cfg, "float32", page_size=8), 64, torch.device("cpu"))
    attn = TorchAttention(pool, cfg.num_layers)
    prompt = random_prompts(1, [200], seed=2)[0]
    slots = torch.arange(len(prompt))
    span = SeqSpan(0, 0, len(prompt), len(prompt), list(range(-(-len(prompt) // 8))))
    batch = ForwardBatch(torch.tensor(prompt), slots, slots, [span])
    with torch.inference_mode():
        attn.prepare(batch)
        ours = model.logits(model(batch.input_ids, batch.positions, attn))
        hf = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
        ref = hf(torch.tensor([prompt])).logits[0]
    assert ours.shape == ref.shape
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)


def chunked_logits(path, prompt: list[int], bounds: tuple[int, ...]) -> list[torch.Tensor]:
    """Each chunk's logits, prefilled `bounds` chunk by chunk over scattered pages of a fresh
    pool: every chunk after the first attends to earlier ones read back from the pool."""
    cfg = ModelConfig.from_dir(path)
    model = load_model(path, cfg, torch.float32, torch.device("cpu"))
    pool = PagedKV(KVSpec.from_model(cfg, "float32", page_size=4), 32, torch.device("cpu"))
    attn = TorchAttention(pool, cfg.num_layers)
    pages = torch.randperm(32)[:23]  # scattered pages: the gather must follow the table
    slots = (pages[:, None] * 4 + torch.arange(4)).flatten()
    out = []
    with torch.inference_mode():
        for lo, hi in itertools.pairwise(bounds):
            span = SeqSpan(0, 0, hi - lo, hi, pages[: -(-hi // 4)].tolist())
            batch = ForwardBatch(
                torch.tensor(prompt[lo:hi]), torch.arange(lo, hi), slots[lo:hi], [span]
            )
            attn.prepare(batch)
            out.append(model.logits(model(batch.input_ids, batch.positions, attn)))
    return out


def test_chunked_prefill_logits_use_the_cached_prefix(checkpoints):
    """Second half attends to the first half read back from the pool (bottom-right mask)."""
    path = checkpoints["llama"]
    prompt = random_prompts(1, [90], seed=3)[0]
    ours = chunked_logits(path, prompt, (0, 50, 90))[-1]
    with torch.inference_mode():
        hf = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
        ref = hf(torch.tensor([prompt])).logits[0, 50:]
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)


def test_sharded_checkpoint_loads(tmp_path, checkpoints):
    src = checkpoints["qwen3"]
    hf = transformers.AutoModelForCausalLM.from_pretrained(src)
    hf.save_pretrained(tmp_path, max_shard_size="100KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / f).write_bytes((src / f).read_bytes())
    prompts = random_prompts(2, [20, 33], seed=4)
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    sharded = LLM(str(tmp_path), max_total_tokens=2048).generate(prompts, params)
    single = LLM(str(src), max_total_tokens=2048).generate(prompts, params)
    assert [o.token_ids for o in sharded] == [o.token_ids for o in single]


def test_long_decode_matches_transformers(checkpoints):
    """Past the torch backend's decode workspace slack, so it is rebuilt mid-generation; the
    CPU kernel over the same 150 steps."""
    path = checkpoints["llama"]
    prompts = random_prompts(3, [10, 70, 33], seed=12)
    for backend in ("torch", "cpu"):
        llm = LLM(str(path), page_size=16, max_total_tokens=4096, attention_backend=backend)
        outs = llm.generate(prompts, SamplingParams(max_tokens=150, temperature=0, ignore_eos=True))
        assert [o.token_ids for o in outs] == hf_greedy(path, prompts, 150), backend
        llm.close()


def _decode_watching_the_workspace(
    path: Path, prompts: list[list[int]], max_tokens: int, watch: Callable[[DecodeWorkspace], None]
) -> list[list[int]]:
    """Greedy outputs of `prompts` decoded together, with `watch(workspace)` after each step
    (the torch backend's: the CPU kernel keeps none)."""
    llm = LLM(str(path), page_size=16, max_total_tokens=4096, attention_backend="torch")
    ws = llm.engine.runner.attn.workspace
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    for p in prompts:
        llm.engine.add_request(p, params)
    outs: dict[str, list[int]] = {}
    while llm.engine.has_unfinished():
        for o in llm.engine.step():
            outs.setdefault(o.request_id, []).append(o.token_id)
        watch(ws)
    return [outs[f"req-{i}"] for i in range(len(prompts))]


def test_decode_workspace_stays_within_twice_the_live_kv(checkpoints):
    """One long and several short sequences decode together: padding every row to the longest
    would hold ~5x their KV; the workspace groups rows and stays within 2x, with equal output."""
    path = checkpoints["llama"]
    prompts = random_prompts(6, [600, 4, 9, 30, 3, 12], seed=13)
    ratios, padded_to_longest = [], []

    def watch(ws: DecodeWorkspace) -> None:
        lens = torch.cat([g.lens for g in ws.groups]) if ws.groups else torch.zeros(0)
        if len(lens) < 2:
            return
        live = int(sum(-(-int(n) // 16) * 16 for n in lens))
        ratios.append(ws.tokens / live)
        padded_to_longest.append(len(lens) * int(lens.max()) / live)

    got = _decode_watching_the_workspace(path, prompts, 40, watch)
    assert ratios and max(ratios) <= DecodeWorkspace.MAX_PADDING, max(ratios)
    assert max(padded_to_longest) > 3  # the case the bound is for did occur
    assert got == hf_greedy(path, prompts, 40)


@pytest.mark.parametrize("family", ["llama", "deepseek-v3"])
def test_decode_bands_attend_each_row_over_its_own_length(checkpoints, family):
    """Rows of one workspace group with lengths far apart are attended in several bands, each
    over its longest row's context only (GQA through SDPA, MLA in the latent space); the
    outputs are transformers'."""
    path = checkpoints[family]
    prompts = random_prompts(4, [200, 160, 120, 100], seed=14)
    banded = []

    def watch(ws: DecodeWorkspace) -> None:
        banded.extend(len(g.bands) for g in ws.groups if len(g.lens) == len(prompts))
        for g in ws.groups:  # every row is in one band, which reaches its whole context
            (a0, *_), (*_, b_end, _) = g.bands[0], g.bands[-1]
            assert (a0, b_end) == (0, len(g.lens))
            for a, b, n in g.bands:
                assert int(g.lens[a:b].max()) == n

    got = _decode_watching_the_workspace(path, prompts, 10, watch)
    assert banded and min(banded) > 1  # one group of four rows, several bands
    assert got == hf_greedy(path, prompts, 10)


@pytest.mark.parametrize("family", ["llama", "deepseek-v3"])
def test_fp8_block_scaled_checkpoints_load_dequantized_and_mtp_is_skipped(
    checkpoints, tmp_path, family
):
    """A checkpoint stored the way DeepSeek-V3 stores one (fp8 blocks + weight_scale_inv, one
    tensor per expert, an MTP layer past num_hidden_layers) loads, and matches transformers on
    the dequantized weights."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    from tierserve.models.loader import dequantize, quantize_fp8_blocks

    source, fp8_dir, ref_dir = checkpoints[family], tmp_path / "fp8", tmp_path / "ref"
    for d in (fp8_dir, ref_dir):
        shutil.copytree(source, d)
    state = load_file(str(source / "model.safetensors"))
    block, quantized, reference = 16, {}, {}
    for name, w in state.items():
        if w.dim() == 2 and "proj" in name:  # linear layers; norms and embeddings stay
            q, scale = quantize_fp8_blocks(w, (block, block))
            quantized[name], quantized[name + "_scale_inv"] = q, scale
            reference[name] = dequantize(q, scale, (block, block))
        else:
            quantized[name] = reference[name] = w
    layers = json.loads((source / "config.json").read_text())["num_hidden_layers"]
    quantized[f"model.layers.{layers}.mlp.up_proj.weight"] = torch.randn(3, 3)  # MTP: skipped
    save_file(quantized, str(fp8_dir / "model.safetensors"))
    save_file(reference, str(ref_dir / "model.safetensors"))
    config = json.loads((fp8_dir / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [block, block]}
    (fp8_dir / "config.json").write_text(json.dumps(config))

    # The dry run's check reads it as the loader does: scales and the MTP layer left out.
    check_checkpoint(fp8_dir, ModelConfig.from_dir(fp8_dir), tp_size=2, attention_size=2)
    prompts = random_prompts(4, [5, 40, 130], seed=9)
    llm = LLM(str(fp8_dir), max_total_tokens=4096)
    outs = llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    assert [o.token_ids for o in outs] == hf_greedy(ref_dir, prompts, 12)
    # The plan counts the parameters the model holds: no scales, no MTP layer.
    assert llm.engine.startup.weight_bytes == sum(t.numel() for t in reference.values()) * 4


def test_a_checkpoint_that_does_not_match_names_the_tensors(checkpoints, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    from tierserve import TierserveError

    broken = tmp_path / "broken"
    shutil.copytree(checkpoints["llama"], broken)
    state = load_file(str(broken / "model.safetensors"))
    del state["model.layers.0.mlp.up_proj.weight"]
    state["model.layers.0.mlp.extra.weight"] = torch.zeros(2)
    save_file(state, str(broken / "model.safetensors"))
    with pytest.raises(TierserveError) as err:
        LLM(str(broken), max_total_tokens=256)
    assert "model.layers.0.mlp.up_proj.weight" in err.value.message
    assert "model.layers.0.mlp.extra.weight" in err.value.message


@pytest.mark.parametrize("family", ["qwen2", "deepseek-v3"])
def test_linears_that_share_an_input_run_as_one_gemm(checkpoints, family):
    """q, k, v (with Qwen2's biases) are one packed weight, gate and up another, MLA's two
    down-projections a third: a decode step runs one GEMM for each, and the packed rows equal
    the checkpoint's tensors side by side."""
    from safetensors.torch import load_file

    path = checkpoints[family]
    llm = LLM(str(path), max_total_tokens=512)
    model = llm.engine.runner.model
    names = {n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    leaves = {n.rpartition(".")[2] for n in names}
    layer = "model.layers.0"
    state = load_file(str(path / "model.safetensors"))
    if family == "qwen2":
        assert not leaves & {"q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"}
        for p in ("weight", "bias"):
            packed = model.get_parameter(f"{layer}.self_attn.qkv_proj.{p}")
            packed = packed.to_dense() if packed.is_mkldnn else packed  # oneDNN's layout
            parts = [state[f"{layer}.self_attn.{x}_proj.{p}"] for x in "qkv"]
            torch.testing.assert_close(packed, torch.cat(parts), rtol=0, atol=0)
    else:
        assert f"{layer}.self_attn.fused_qkv_a_proj_with_mqa" in names
        assert not leaves & {"q_a_proj", "kv_a_proj_with_mqa"}
    calls: list[str] = []
    hooks = [
        m.register_forward_hook(lambda m, *_, n=n: calls.append(n))
        for n, m in model.named_modules()
        if isinstance(m, torch.nn.Linear) and n.startswith(f"{layer}.")
    ]
    llm.generate([list(range(5, 45))], SamplingParams(max_tokens=2, temperature=0))
    for h in hooks:
        h.remove()
    # A prefill, then one decode step, each qkv, o, gate_up, down; MLA adds q_b, and kv_b in
    # the 40-token prefill only (decode attends in the latent space). Its first layer's MLP
    # is dense.
    assert len(calls) == (2 * 4 if family == "qwen2" else 6 + 5), calls


def test_loading_a_model_imports_no_symbolic_shapes(checkpoints):
    """Weights made on the meta device are materialised without torch's empty_like of a meta
    tensor, whose first call imports sympy (~0.5 CPU-seconds of each core's and rank's start);
    a model with buffers (V3's routing bias) and a tied head loads the same way."""
    probe = (
        "import sys, torch\n"
        "from tierserve.model_config import ModelConfig\n"
        "from tierserve.models.loader import load_model\n"
        "for path in sys.argv[1:]:\n"
        "    cfg = ModelConfig.from_dir(path)\n"
        "    model = load_model(path, cfg, torch.float32, torch.device('cpu'))\n"
        "    assert all(not p.is_meta for p in model.state_dict().values())\n"
    )
    paths = [default_model(), str(checkpoints["deepseek-v3"])]
    assert "sympy" not in modules_after(probe, *paths)


# --- checkpoints that cannot run ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"vocab_size": 0}, "vocab_size"),  # oneDNN's RuntimeError when packing the head
        ({"max_position_embeddings": 0}, "max_position_embeddings"),  # served, refused all
        ({"hidden_size": 0}, "hidden_size"),
        ({"num_hidden_layers": 10**11}, "num_hidden_layers"),  # a MemoryError
        ({"hidden_act": "gelu"}, "hidden_act"),  # served as SiLU
    ],
)
def test_a_config_of_no_size_or_past_any_model_is_refused(change, field):
    import json

    from tierserve import TierserveError

    config = json.loads((Path(default_model()) / "config.json").read_text())
    with pytest.raises(TierserveError) as err:
        ModelConfig.from_dict({**config, **change})
    assert err.value.field == field


def _broken_copy(source: Path, into: Path, change: Callable[[dict], None]) -> Path:
    """A copy of `source` whose tensors `change` edits in place (a dict of them)."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(source, into)
    state = load_file(str(into / "model.safetensors"))
    change(state)
    save_file(state, str(into / "model.safetensors"))
    return into


def test_checkpoints_that_served_garbage_or_failed_a_step_are_refused_by_name(
    checkpoints, tmp_path
):
    """A NaN weight served until the first sampled token failed the engine step (503, the
    server gone); an embedding longer than vocab_size was cut to fit and served garbage, and an
    int32 weight was cast to float; a
    tokenizer of more ids than the model's embedding failed the step that embedded one. A
    sharded checkpoint's unreadable index was a JSONDecodeError or a KeyError."""
    import json

    from tierserve import TierserveError

    llama = checkpoints["llama"]
    name = "model.layers.1.self_attn.q_proj.weight"
    nan = _broken_copy(llama, tmp_path / "nan", lambda s: s[name].view(-1)[7].fill_(math.nan))
    with pytest.raises(TierserveError, match=f"{name} holds NaN or infinite values"):
        LLM(str(nan), max_total_tokens=256)
    embed = "model.embed_tokens.weight"

    def longer(state: dict) -> None:
        state[embed] = torch.cat([state[embed], state[embed][:8]])

    wide = _broken_copy(llama, tmp_path / "wide", longer)
    with pytest.raises(TierserveError, match="misshapen") as err:
        LLM(str(wide), max_total_tokens=256)
    assert embed in err.value.message

    def ints(state: dict) -> None:
        state[name] = state[name].to(torch.int32)

    integer = _broken_copy(llama, tmp_path / "int", ints)  # was cast to float: garbage
    with pytest.raises(TierserveError, match="misshapen") as err:
        LLM(str(integer), max_total_tokens=256)
    assert name in err.value.message
    # A model of 300 tokens whose tokenizer (the suite's) has more: a text of merged words
    # tokenizes past it, and is refused; ids within it still run.
    vocab = 300

    def smaller(state: dict) -> None:
        for key in (embed, "lm_head.weight"):
            if key in state:
                state[key] = state[key][:vocab].clone()

    small = _broken_copy(llama, tmp_path / "small", smaller)
    config = json.loads((small / "config.json").read_text())
    (small / "config.json").write_text(json.dumps({**config, "vocab_size": vocab}))
    llm = LLM(str(small), max_total_tokens=256)
    greedy = SamplingParams(max_tokens=2, temperature=0)
    with pytest.raises(TierserveError, match="past the model's vocab_size of 300") as err:
        llm.generate(["the server answers the request"], greedy)
    assert err.value.field == "prompt"
    assert len(llm.generate([[5, 9, 200]], greedy)[0].token_ids) == 2
    llm.close()
    index = small / "model.safetensors.index.json"
    for text, says in (("{not json", "JSONDecodeError"), ('{"metadata": {}}', "weight_map")):
        index.write_text(text)
        with pytest.raises(TierserveError, match=f"cannot read {index}.*{says}"):
            LLM(str(small), max_total_tokens=256)


@pytest.mark.parametrize(
    ("change", "flags", "says"),
    [
        ({"vocab_size": None}, [], "model config lacks 'vocab_size'"),
        ({"architectures": ["GPT2LMHeadModel"]}, [], "unsupported architecture 'GPT2LMHeadModel'"),
        ({}, ["--tokenizer", "/no/such/dir"], "tokenizer directory not found: /no/such/dir"),
    ],
)
def test_a_start_that_cannot_run_is_one_line_and_exit_2_even_in_a_dry_run(
    tmp_path, change, flags, says
):
    """A config without vocab_size was exit 1 with oneDNN's traceback from packing a head of no
    rows; it and an architecture tierserve has no model for passed the dry run; a tokenizer
    path that is no directory was refused in transformers' words for hub repo ids."""
    import json
    import shutil
    import subprocess
    import sys

    model = tmp_path / "model"
    shutil.copytree(default_model(), model)
    config = json.loads((model / "config.json").read_text())
    config = {k: v for k, v in {**config, **change}.items() if v is not None}
    (model / "config.json").write_text(json.dumps(config))
    cmd = [sys.executable, "-m", "tierserve.cli", "serve", "--model", str(model), "--dry-run"]
    done = subprocess.run(cmd + flags, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert says in done.stderr.strip().splitlines()[-1]


@pytest.mark.parametrize(
    ("broken", "flags", "says"),
    [
        ("model.layers.1.mlp.up_proj.weight", [], "missing ['model.layers.1.mlp.up_proj.weight']"),
        ("", ["--tp-size", "3"], "does not split over 3 ranks"),
        ("", ["--tp-size", "2", "--dp-size", "2", "--enable-dp-attention"], "would start"),
    ],
)
def test_the_dry_run_checks_the_checkpoints_tensors_by_their_headers(tmp_path, broken, flags, says):
    """A tensor missing, of another shape, or sizes that do not split over the ranks passed
    the dry run and were refused by a start after its weights were read (its ranks started):
    the dry run fills rank 0's model, built on the meta device, from the headers."""
    import subprocess
    import sys

    def drop(state: dict) -> None:
        state.pop(broken, None)

    model = _broken_copy(Path(default_model()), tmp_path / "model", drop)
    cmd = [sys.executable, "-m", "tierserve.cli", "serve", "--model", str(model), "--dry-run"]
    done = subprocess.run(cmd + flags, capture_output=True, text=True, timeout=120)
    assert "Traceback" not in done.stderr, done.stderr
    if says == "would start":
        assert done.returncode == 0 and says in done.stdout, done.stderr
    else:
        assert done.returncode == 2 and says in done.stderr.strip().splitlines()[-1], done.stderr


def test_a_truncated_checkpoint_is_refused_before_and_at_load(tmp_path):
    """Its header is whole and its tensors are not: the dry run passed it, and the load
    raised safetensors' own error (exit 1, a traceback)."""
    import shutil
    import subprocess
    import sys

    from tierserve import TierserveError

    model = tmp_path / "cut"
    shutil.copytree(default_model(), model)
    with (model / "model.safetensors").open("r+b") as f:
        f.truncate(1_000_000)
    cmd = [sys.executable, "-m", "tierserve.cli", "serve", "--model", str(model), "--dry-run"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert "truncated: 1,000,000 bytes of the" in done.stderr.strip().splitlines()[-1]
    with pytest.raises(TierserveError, match="truncated"):
        LLM(str(model))
