"""Offline throughput: tierserve vs transformers' batched `generate`, same model, one run.

64 prompts of 64–512 random tokens, 128 greedy output tokens each (EOS ignored). Prints output
tokens/s of both and the ratio. Default model: the bundled demo model, else a random-init model
of the same shape made on the fly.

    .venv/bin/python benchmarks/offline_throughput.py [--model DIR] [--num-prompts 64]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch
import transformers

from tierserve import LLM, SamplingParams
from tierserve.args import default_model


def random_init_model(path: Path) -> str:
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=4096,
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=6,
        num_attention_heads=8,
        num_key_value_heads=2,
        max_position_embeddings=1024,
    )
    transformers.LlamaForCausalLM(cfg).save_pretrained(path)
    tok = transformers.PreTrainedTokenizerFast(
        tokenizer_object=__import__("tokenizers").Tokenizer(
            __import__("tokenizers").models.WordLevel({"<unk>": 0}, unk_token="<unk>")
        ),
        unk_token="<unk>",
    )
    tok.save_pretrained(path)
    return str(path)


def make_prompts(n: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(64, 513, (n,), generator=g).tolist()
    return [torch.randint(3, vocab, (length,), generator=g).tolist() for length in lengths]


def run_tierserve(model: str, prompts: list[list[int]], out_len: int) -> float:
    llm = LLM(model)
    params = SamplingParams(max_tokens=out_len, temperature=0, ignore_eos=True)
    llm.generate(prompts[:2], SamplingParams(max_tokens=4, temperature=0))  # warm-up
    llm.engine.flush_cache()  # random prompts share nothing; start cold anyway
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    assert all(len(o.token_ids) == out_len for o in outs)
    return len(prompts) * out_len / elapsed


def run_transformers(model: str, prompts: list[list[int]], out_len: int, batch: int) -> float:
    hf = transformers.AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None
    hf.generation_config.pad_token_id = 0
    start = time.perf_counter()
    for i in range(0, len(prompts), batch):
        group = prompts[i : i + batch]
        longest = max(len(p) for p in group)
        ids = torch.tensor([[0] * (longest - len(p)) + p for p in group])  # left padding
        mask = torch.tensor([[0] * (longest - len(p)) + [1] * len(p) for p in group])
        with torch.inference_mode():
            out = hf.generate(
                input_ids=ids, attention_mask=mask, max_new_tokens=out_len, do_sample=False
            )
        assert out.shape[1] == longest + out_len
    return len(prompts) * out_len / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--hf-batch-size", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or default_model() or random_init_model(Path(tmp))
        vocab = transformers.AutoConfig.from_pretrained(model).vocab_size
        prompts = make_prompts(args.num_prompts, vocab, args.seed)
        ours = run_tierserve(model, prompts, args.output_len)
        theirs = run_transformers(model, prompts, args.output_len, args.hf_batch_size)
    print(f"model: {model}  threads: {torch.get_num_threads()}  prompts: {len(prompts)}")
    print(f"tierserve     {ours:8.1f} output tok/s")
    print(
        f"transformers  {theirs:8.1f} output tok/s (batched generate, batch {args.hf_batch_size})"
    )
    print(f"ratio         {ours / theirs:8.2f}x")


if __name__ == "__main__":
    main()
