"""NEXTN: DeepSeek-V3's MTP layer as a draft. transformers has no MTP module, so the test
writes one from transformers' own parts (a DeepseekV3DecoderLayer, its RMSNorm, a linear
eh_proj) over a tiny DeepSeek-V3 checkpoint, fits it to the target's greedy tokens for a fixed,
seeded number of steps, and saves it as DeepSeek ships it (`model.layers.{n}.*`, with copies of
the embedding and head). Served with it, greedy outputs are the plain ones token for token, and
the fitted layer's acceptance beats a random-init layer's: tierserve's MTP forward is the one
that was fitted."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.conftest import VOCAB, make_checkpoint, randomise_all
from tests.test_eagle3 import _spec_run
from tierserve import LLM, SamplingParams, TierserveError

FIT_STEPS = 60
SEQS, PROMPT, NEW = 12, 6, 42  # fitting data: the target's greedy continuations


def _mtp_parts(hidden: int, eps: float) -> torch.nn.ModuleDict:
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3RMSNorm

    parts = torch.nn.ModuleDict({
        "enorm": DeepseekV3RMSNorm(hidden, eps),
        "hnorm": DeepseekV3RMSNorm(hidden, eps),
        "eh_proj": torch.nn.Linear(2 * hidden, hidden, bias=False),
        "shared_head": torch.nn.ModuleDict({"norm": DeepseekV3RMSNorm(hidden, eps)}),
    })  # fmt: skip
    return parts


def fitting_prompts(vocab: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(2, vocab, (SEQS, PROMPT), generator=g)


def write_mtp_checkpoint(target: Path, out: Path, steps: int, seed: int = 0) -> list[float]:
    """`target` with an MTP layer, fitted for `steps` Adam steps (0: as initialised) to the
    target's greedy continuations of `fitting_prompts(seed)`; the first and last step's loss."""
    import transformers

    model = transformers.DeepseekV3ForCausalLM.from_pretrained(target).eval()
    cfg, n = model.config, model.config.num_hidden_layers
    torch.manual_seed(seed)
    big = transformers.DeepseekV3ForCausalLM(
        transformers.DeepseekV3Config(**{**cfg.to_dict(), "num_hidden_layers": n + 1})
    )
    randomise_all(big.model.layers[n], seed + 1)
    missing = big.load_state_dict(model.state_dict(), strict=False).missing_keys
    assert all(k.startswith(f"model.layers.{n}.") for k in missing)
    layer, parts = big.model.layers[n], _mtp_parts(cfg.hidden_size, cfg.rms_norm_eps)
    prompts = fitting_prompts(cfg.vocab_size, seed)
    with torch.no_grad():
        seqs = model.generate(prompts, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False)
        out_h = model.model(seqs).last_hidden_state  # the final, normed state MTP reads
        labels = model.lm_head(out_h).argmax(-1)[:, 1:]  # the target's token after t + 1
        embeds = model.model.embed_tokens(seqs[:, 1:])
    length = seqs.shape[1] - 1
    positions = torch.arange(length)[None].expand(SEQS, -1)
    mask = torch.full((length, length), float("-inf")).triu(1)[None, None]
    rotary = big.model.rotary_emb
    params = [*layer.parameters(), *parts.parameters()]
    opt = torch.optim.Adam(params, lr=3e-3)
    losses = []
    for _ in range(steps):
        x = parts["eh_proj"](torch.cat([parts["enorm"](embeds), parts["hnorm"](out_h[:, :-1])], -1))
        y = layer(x, attention_mask=mask, position_ids=positions,
                  position_embeddings=rotary(x, positions))  # fmt: skip
        y = y[0] if isinstance(y, tuple) else y
        logits = model.lm_head(parts["shared_head"]["norm"](y))
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    scratch = out.with_name(out.name + "-big")
    big.save_pretrained(scratch)
    weights = load_file(str(scratch / "model.safetensors"))
    shutil.rmtree(scratch)
    prefix = f"model.layers.{n}."
    weights.update({prefix + k: v.detach().clone() for k, v in parts.state_dict().items()})
    weights[prefix + "embed_tokens.weight"] = weights["model.embed_tokens.weight"].clone()
    weights[prefix + "shared_head.head.weight"] = weights["lm_head.weight"].clone()
    out.mkdir(parents=True, exist_ok=True)
    save_file(weights, str(out / "model.safetensors"))
    config = json.loads((target / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 1}))
    for f in target.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "generation")):
            shutil.copy(f, out / f.name)
    return [losses[0], losses[-1]] if losses else []


@pytest.fixture(scope="module")
def mtp_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("mtp")
    target = make_checkpoint(root / "target", "deepseek-v3", seed=3)
    fitted = write_mtp_checkpoint(target, root / "fitted", FIT_STEPS)
    write_mtp_checkpoint(target, root / "random", 0)
    assert fitted[1] < 0.5 * fitted[0], fitted  # the fit took
    return {"target": target, "fitted": root / "fitted", "random": root / "random"}


def test_greedy_outputs_are_identical_with_the_mtp_layer_and_a_fitted_one_is_accepted_more(
    mtp_dirs,
):
    """The prompts the layer was fitted on: served greedily, the target continues them as it
    did for the fit, so a layer computed as it was fitted predicts those continuations."""
    greedy = SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True)
    common = {"max_total_tokens": 2048, "chunked_prefill_size": 32}
    prompts = fitting_prompts(VOCAB).tolist()
    plain = LLM(str(mtp_dirs["fitted"]), **common).generate(prompts, greedy)
    acceptance = {}
    for kind in ("fitted", "random"):
        llm = LLM(str(mtp_dirs[kind]), speculative_algorithm="NEXTN", **common)
        got = llm.generate(prompts, greedy)
        assert [o.token_ids for o in got] == [o.token_ids for o in plain]
        stats = llm.engine.spec_stats
        assert stats.num_drafts > 0
        acceptance[kind] = 1 + stats.num_accepted_tokens / stats.num_drafts
        llm.engine.check_accounting()
    assert acceptance["fitted"] > acceptance["random"] + 0.3, acceptance
    assert acceptance["fitted"] > 1.5, acceptance


def test_two_ranks_draft_as_one_and_the_shared_host_copy_keeps_the_mtp_layers_latent(mtp_dirs):
    """Two ranks over gloo: the MTP layer's heads and experts split as the target's, greedy
    outputs equal to one process's. They hold identical latents, the MTP layer's too, so the
    node keeps one host copy: a prompt whose device pages were evicted by others comes back
    from it with the drafts and accepted tokens of one process without any cache."""
    from tests.test_hicache import random_prompts

    path, greedy = str(mtp_dirs["fitted"]), SamplingParams(max_tokens=24, temperature=0,
                                                            ignore_eos=True)  # fmt: skip
    first = fitting_prompts(VOCAB).tolist()[0]
    base = LLM(path, speculative_algorithm="NEXTN", disable_radix_cache=True, max_total_tokens=1024)
    prompt = first + base.generate([first], greedy)[0].token_ids[:26]  # 2 pages
    want, acceptance = _spec_run(base, [prompt], greedy)
    common = {"tp_size": 2, "device": "cpu", "page_size": 16, "max_total_tokens": 160,
              "enable_hierarchical_cache": True, "hicache_ratio": 8}  # fmt: skip
    batch = fitting_prompts(VOCAB).tolist()[:6]
    plain = [o.token_ids for o in LLM(path, max_total_tokens=1024).generate(batch, greedy)]
    with LLM(path, speculative_algorithm="NEXTN", **common) as llm:
        assert [o.token_ids for o in llm.generate(batch, greedy)] == plain
        assert llm.engine.kv_plan.host.sharing == 2  # one copy for both ranks
        llm.generate([prompt], greedy)
        llm.generate(random_prompts(4, [100], seed=9), greedy)  # its device pages go
        assert _spec_run(llm, [prompt], greedy) == (want, acceptance)
        assert llm.engine.kv.host.stats.host_hit_tokens >= 16  # a page (pair keys: not the last)
    assert acceptance[1] > acceptance[0] // 2  # a fitted layer: most drafts kept


@pytest.mark.parametrize(
    ("model", "kwargs", "words"),
    [
        ("llama", {}, "has none"),
        ("target", {}, "holds no model.layers.3"),
        ("no-nextn", {}, "num_nextn_predict_layers is 0"),
        ("fitted", {"speculative_draft_model_path": "OTHER"}, "is not it"),
    ],
)
def test_nextn_without_an_mtp_layer_is_refused_by_name(
    checkpoints, mtp_dirs, tmp_path, model, kwargs, words
):
    if model == "llama":
        path = checkpoints["llama"]
    elif model == "no-nextn":  # as Kimi-K2's config says
        path = tmp_path / "kimi-like"
        shutil.copytree(mtp_dirs["target"], path)
        config = json.loads((path / "config.json").read_text())
        (path / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 0}))
    else:
        path = mtp_dirs[model]
    kwargs = {k: str(tmp_path) if v == "OTHER" else v for k, v in kwargs.items()}
    with pytest.raises(TierserveError, match=words):
        LLM(str(path), speculative_algorithm="NEXTN", max_total_tokens=1024, **kwargs)


def test_sglangs_eagle_means_the_mtp_layer_and_the_plan_counts_it(mtp_dirs):
    from tierserve.args import EngineArgs
    from tierserve.engine.startup import Startup

    def startup(**kw) -> Startup:
        return Startup.from_args(EngineArgs(model=str(mtp_dirs["fitted"]), max_total_tokens=1024,
                                            device="cpu", **kw))  # fmt: skip

    dp = {"tp_size": 2, "dp_size": 2, "enable_dp_attention": True}  # decided before any rank
    with pytest.raises(TierserveError, match="NEXTN with --enable-dp-attention is not built"):
        startup(speculative_algorithm="NEXTN", **dp)

    vllm = EngineArgs.from_kwargs("m", speculative_config='{"method": "deepseek_mtp", '
                                  '"num_speculative_tokens": 2}')  # fmt: skip
    assert (vllm.speculative_algorithm, vllm.speculative_num_steps) == ("NEXTN", 2)
    plain, mtp = startup(), startup(speculative_algorithm="EAGLE")
    assert mtp.draft_kind == "nextn" and mtp.draft_path == str(mtp_dirs["fitted"])
    weights = load_file(str(mtp_dirs["fitted"] / "model.safetensors"))
    own = [k for k in weights if k.startswith("model.layers.3.")
           and "embed_tokens" not in k and "shared_head.head" not in k]  # fmt: skip
    assert mtp.plan.draft.weight_bytes == sum(weights[k].numel() for k in own) * 4
    assert mtp.weight_bytes - plain.weight_bytes == mtp.plan.draft.weight_bytes
    assert mtp.plan.spec.num_layers == plain.plan.spec.num_layers + 1
    assert mtp.plan.spec.bytes_per_token * 3 == plain.plan.spec.bytes_per_token * 4
