"""A Hugging Face Llama checkpoint written as GGUF Q4_0 for llama.cpp, with llama.cpp's own
gguf-py (`GGUFWriter`, `quants.quantize`): `convert_hf_to_gguf.py` refuses tokenizers it does
not know by hash, the bundled demo's among them.

Every linear of the decoder is Q4_0 (blocks of 32 values, one scale each: the arithmetic
closest to compressed-tensors' int4 g32); the embedding and the LM head stay bf16, as the
compressed-tensors checkpoint leaves the head; norms float32. q and k are permuted from
Hugging Face's half-split rotary layout to llama.cpp's interleaved one, as its converter does.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """HF's rotate-half q/k rows as llama.cpp's LLAMA rope reads them (pairs interleaved)."""
    return (
        w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    )


def write_gguf_q4_0(model_dir: Path, out: Path, llama_cpp: Path, q4: bool = True) -> Path:
    """`model_dir` (a LlamaForCausalLM in safetensors) as `out`, a GGUF Q4_0 file (`q4`
    False: its linears bf16, to check the conversion against the checkpoint's greedy tokens)."""
    sys.path.insert(0, str(llama_cpp / "gguf-py"))
    import gguf  # llama.cpp's own, from the source tree its server was built from

    cfg = json.loads((model_dir / "config.json").read_text())
    tok = json.loads((model_dir / "tokenizer.json").read_text())
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hidden, vocab = cfg["hidden_size"], cfg["vocab_size"]
    w = gguf.GGUFWriter(str(out), "llama")
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_dimension_count(hidden // heads)
    w.add_rope_freq_base(float(cfg.get("rope_theta", 10000.0)))
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_vocab_size(vocab)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_0)
    _add_tokenizer(w, gguf, tok, vocab, cfg)
    names = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }
    per_layer = {
        "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
        "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down",
    }  # fmt: skip
    with safe_open(str(model_dir / "model.safetensors"), "pt") as f:
        for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
            t = f.get_tensor(name).float().numpy()
            if name in names and t.ndim == 1:  # the final norm
                w.add_tensor(names[name], t.astype(np.float32))
                continue
            if name in names:
                w.add_tensor(names[name], _bf16(t, gguf), raw_dtype=gguf.GGMLQuantizationType.BF16)
                continue
            layer, rest = name.removeprefix("model.layers.").split(".", 1)
            part, kind = rest.rsplit(".", 1)
            target = f"blk.{layer}.{per_layer[part]}.{kind}"
            if t.ndim == 1:
                w.add_tensor(target, t.astype(np.float32))
                continue
            if part.endswith("q_proj"):
                t = _permute(t, heads)
            elif part.endswith("k_proj"):
                t = _permute(t, kv_heads)
            if not q4:
                w.add_tensor(target, _bf16(t, gguf), raw_dtype=gguf.GGMLQuantizationType.BF16)
                continue
            packed = gguf.quants.quantize(t, gguf.GGMLQuantizationType.Q4_0)
            w.add_tensor(target, packed, raw_dtype=gguf.GGMLQuantizationType.Q4_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def _bf16(t: np.ndarray, gguf: object) -> np.ndarray:
    """bf16 bits as gguf-py stores them (uint16 words)."""
    return torch.from_numpy(t).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)


def _add_tokenizer(w: object, gguf: object, tok: dict, vocab: int, cfg: dict) -> None:
    """The checkpoint's byte-level BPE as llama.cpp's "gpt2" vocabulary, padded to the
    embedding's rows with unused tokens (its vocabulary size must equal them)."""
    by_id = {i: t for t, i in tok["model"]["vocab"].items()}
    added = {a["id"]: a["content"] for a in tok.get("added_tokens", [])}
    by_id.update(added)
    tokens, types = [], []
    for i in range(vocab):
        if i in by_id:
            tokens.append(by_id[i])
            types.append(gguf.TokenType.CONTROL if i in added else gguf.TokenType.NORMAL)
        else:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"].get("merges", [])]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(cfg.get("bos_token_id", 0))
    w.add_eos_token_id(cfg.get("eos_token_id", 1))
