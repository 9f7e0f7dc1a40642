"""EAGLE-3 draft models: one Llama decoder layer that reads the target's hidden states.

Checkpoints in the speculators format vLLM loads (config `speculators_model_type: eagle3`, the
layer in `transformer_layer_config`; weights `fc`, `layers.0.*`, `norm`, `lm_head`, `d2t`,
optionally `embed_tokens`) and SGLang's EAGLE-3 format (a Llama config naming
`LlamaForCausalLMEagle3`, weights under `midlayer.*`). `norm_before_residual` defaults as each
engine defaults it: true for speculators configs (vLLM), false for SGLang's; a draft that names
it is read as written.

At row t the layer takes the embedding of token t + 1 and `fc` of the target's auxiliary hidden
states at t, (or, at a later draft step, its own output at t − 1); its attention's KV is one more
layer of the target's paged pool (`layer_id` = the target's layer count), so every cache tier
carries it with the target's. It predicts token t + 2 over its draft vocabulary; `d2t` maps a
draft id d to the target id d + d2t[d].
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch
from safetensors.torch import load_file
from torch import nn

from tierserve.args import DEMO_MODEL_DIR
from tierserve.errors import TierserveError
from tierserve.layers import (
    AttentionBackend,
    ColumnParallelLinear,
    GatedMLP,
    RMSNorm,
    VocabParallelEmbedding,
    building_attention,
    pack_for_cpu,
    rotary_for,
    tp_group,
)
from tierserve.model_config import ModelConfig
from tierserve.models.decoder import CausalLM
from tierserve.models.llama import LlamaAttention
from tierserve.models.loader import fill, materialize, tensor_headers, tensor_shapes

FIELD = "speculative_draft_model_path"


@dataclass(frozen=True)
class Eagle3Config:
    layer: ModelConfig  # the draft's decoder layer (its hidden size is the target's)
    aux_layers: tuple[int, ...]  # target layer ids whose inputs it reads (capture ids)
    draft_vocab_size: int
    norm_before_residual: bool
    norm_before_fc: bool = False  # one RMSNorm over the concatenated auxiliary states
    norm_output: bool = False  # later steps take the normed output (EAGLE 3.1)

    @classmethod
    def from_dir(cls, path: str | Path, target: ModelConfig) -> Eagle3Config:
        file = Path(path) / "config.json"
        try:
            raw = json.loads(file.read_text())
        except (OSError, ValueError) as err:
            message = f"EAGLE-3 draft {path}: no readable config.json ({err})"
            raise TierserveError(message, FIELD) from None
        # Each field's type is checked here: the draft is built in the engine core, where a
        # TypeError ended the process with a traceback instead of a refusal naming the field.
        if not isinstance(raw, dict):
            kind = type(raw).__name__
            message = f"EAGLE-3 draft {path}: config.json must be a JSON object, got a {kind}"
            raise TierserveError(message, FIELD)
        speculators = raw.get("speculators_model_type") is not None
        if speculators and raw["speculators_model_type"] != "eagle3":
            kind = raw["speculators_model_type"]
            raise TierserveError(f"draft {path} is a {kind!r} speculator, not eagle3", FIELD)
        layer_raw = raw.get("transformer_layer_config", raw) if speculators else raw
        _of(path, "transformer_layer_config", layer_raw, dict, "a JSON object")
        try:
            layer = ModelConfig.from_dict({**layer_raw, "architectures": ["LlamaForCausalLM"]})
        except TierserveError as err:  # the draft's flag, not the target's --model
            raise TierserveError(f"EAGLE-3 draft {path}: {err.message}", FIELD) from None
        layer = dataclasses.replace(
            layer,
            max_position_embeddings=max(
                layer.max_position_embeddings, target.max_position_embeddings
            ),
            vocab_size=layer.vocab_size or target.vocab_size,
            # Its one layer sits at pool layer `target.num_layers`: its window, by that id.
            layer_windows=layer.layer_windows * (target.num_layers + 1),
        )
        eagle = _of(path, "eagle_config", raw.get("eagle_config") or {}, dict, "a JSON object")
        key = "eagle_aux_hidden_state_layer_ids"
        aux = raw.get(key) or eagle.get(key)
        if aux is not None and not (
            isinstance(aux, list) and all(_is_int(k) for k in aux)
        ):  # SGLang's and vLLM's form: a list of ints, one per layer read
            message = f"EAGLE-3 draft {path}: {key} must be a list of layer ids, got "
            raise TierserveError(message + json.dumps(aux), FIELD)
        n = target.num_layers
        aux = tuple(aux) if aux else (2, n // 2, n - 3)  # vLLM's and SGLang's default
        if layer.num_layers != 1:
            message = f"draft {path} has {layer.num_layers} layers; one is served"
            raise TierserveError(message, FIELD)
        flags = {
            name: _of(path, name, _given(raw.get(name), default), bool, "true or false")
            for name, default in (
                ("fc_norm", False),
                ("norm_before_residual", speculators),
                ("norm_before_fc", False),
                ("norm_output", False),
            )
        }
        if flags["fc_norm"]:
            raise TierserveError(f"draft {path}: fc_norm drafts are not served yet", FIELD)
        draft_vocab = raw.get("draft_vocab_size") or layer.vocab_size
        if not _is_int(draft_vocab) or draft_vocab < 1:
            message = f"EAGLE-3 draft {path}: draft_vocab_size must be an integer > 0, got "
            raise TierserveError(message + json.dumps(draft_vocab), FIELD)
        return cls(
            layer=layer,
            aux_layers=aux,
            draft_vocab_size=draft_vocab,
            norm_before_residual=flags["norm_before_residual"],
            norm_before_fc=flags["norm_before_fc"],
            norm_output=flags["norm_output"],
        )

    def check_target(self, target: ModelConfig, path: str) -> None:
        """A draft reads the target's hidden states and shares its KV pages: refuse one whose
        sizes do not fit."""
        lay = self.layer
        if target.kv_lora_rank:
            arch = target.architecture
            message = f"an EAGLE-3 draft over an MLA target ({arch}) is not served yet"
            raise TierserveError(message, FIELD)
        checks = [
            ("hidden_size", lay.hidden_size, target.hidden_size),
            ("num_key_value_heads", lay.num_kv_heads, target.num_kv_heads),
            ("head_dim", lay.head_dim, target.head_dim),
            ("vocab_size", lay.vocab_size, target.vocab_size),
        ]
        for name, mine, theirs in checks:
            if mine != theirs:
                message = f"draft {path}: {name} {mine} does not match the target's {theirs}"
                raise TierserveError(message, FIELD)
        bad = [k for k in self.aux_layers if not 0 <= k <= target.num_layers]
        if bad:
            message = (
                f"draft {path}: eagle_aux_hidden_state_layer_ids {bad} outside the target's "
                f"[0, {target.num_layers}]"
            )
            raise TierserveError(message, FIELD)
        if self.draft_vocab_size > target.vocab_size:  # its ids past the target's vocabulary
            message = (
                f"draft {path}: draft_vocab_size {self.draft_vocab_size} is larger than the "
                f"target's vocabulary ({target.vocab_size})"
            )
            raise TierserveError(message, FIELD)

    def check_d2t(self, d2t: torch.Tensor, target: ModelConfig, path: str | Path) -> None:
        """Every draft id must map to a target id: one past the vocabulary failed only in
        the warm-up's first draft, an IndexError that ended the engine core."""
        self._check_d2t_shape(list(d2t.shape), path)
        if d2t.dtype not in _INT_DTYPES.values():
            message = f"draft {path}: d2t must be an integer tensor, got {d2t.dtype}"
            raise TierserveError(message, FIELD)
        ids = d2t.long() + torch.arange(len(d2t), device=d2t.device)
        bad = ((ids < 0) | (ids >= target.vocab_size)).nonzero()
        if len(bad):
            first = int(bad[0])
            message = (
                f"draft {path}: d2t maps draft id {first} to {int(ids[first])}, outside the "
                f"target's vocabulary [0, {target.vocab_size})"
            )
            raise TierserveError(message, FIELD)

    def check_weights(self, path: str | Path, target: ModelConfig) -> None:
        """What `check_target` cannot see in config.json, read from model.safetensors without
        reading a weight (for --dry-run too): its `d2t` table."""
        file = Path(path) / "model.safetensors"
        entry = tensor_headers(file).get("d2t")
        if entry is None:  # offsets of 0: a draft over the whole target vocabulary
            return
        dtype = _INT_DTYPES.get(entry["dtype"])
        if dtype is None:
            message = f"draft {path}: d2t must be an integer tensor, got {entry['dtype']}"
            raise TierserveError(message, FIELD)
        self._check_d2t_shape(entry["shape"], path)  # before its bytes are read
        start, end = entry["data_offsets"]
        if end - start != self.draft_vocab_size * dtype.itemsize:  # before reading them
            message = f"draft {path}: d2t holds {end - start} bytes, not {entry['shape']} {dtype}"
            raise TierserveError(message, FIELD)
        with file.open("rb") as f:
            f.seek(8 + int.from_bytes(f.read(8), "little") + start)
            data = bytearray(f.read(end - start))
        self.check_d2t(torch.frombuffer(data, dtype=dtype), target, path)

    def _check_d2t_shape(self, shape: list[int], path: str | Path) -> None:
        if shape != [self.draft_vocab_size]:
            message = (
                f"draft {path}: d2t has shape {shape}, not [draft_vocab_size] = "
                f"[{self.draft_vocab_size}]"
            )
            raise TierserveError(message, FIELD)


# safetensors' integer dtypes a d2t table may be stored in.
_INT_DTYPES = {"I64": torch.int64, "I32": torch.int32, "I16": torch.int16}


def _given(value: Any, default: bool) -> Any:
    return default if value is None else value


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _of(path: str | Path, name: str, value: Any, kind: type, what: str) -> Any:
    """`value`, a draft config's field `name`, if it is a `kind`; else the refusal naming it."""
    if not isinstance(value, kind):
        message = f"EAGLE-3 draft {path}: {name} must be {what}, got {json.dumps(value)}"
        raise TierserveError(message, FIELD)
    return value


class Eagle3Layer(nn.Module):
    def __init__(self, cfg: Eagle3Config, layer_id: int) -> None:
        super().__init__()
        lay, hidden = cfg.layer, cfg.layer.hidden_size
        self.rotary = rotary_for(lay)
        # Split over the attention group, MLP too: its heads as the target's, whose pages it
        # shares, and under DP attention each group drafts its own requests alone.
        with building_attention():
            self.self_attn = LlamaAttention(lay, layer_id, self.rotary, in_features=2 * hidden)
            self.mlp = GatedMLP(hidden, lay.intermediate_size)
        self.input_layernorm = RMSNorm(hidden, lay.rms_norm_eps)
        self.hidden_norm = RMSNorm(hidden, lay.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(hidden, lay.rms_norm_eps)
        self.norm_before_residual = cfg.norm_before_residual

    def forward(
        self, positions: torch.Tensor, embeds: torch.Tensor, hidden: torch.Tensor,
        attn: AttentionBackend,
    ) -> torch.Tensor:  # fmt: skip
        normed = self.hidden_norm(hidden)
        residual = normed if self.norm_before_residual else hidden
        x = torch.cat([self.input_layernorm(embeds), normed], dim=-1)
        x = residual + self.self_attn(positions, x, attn)
        return x + self.mlp(self.post_attention_layernorm(x))


class Eagle3Draft(nn.Module):
    """`start` takes the target's auxiliary states (rows of a step's batch), `step` its own
    output; both return the layer's output, which the next step reads and `propose` turns
    into draft tokens."""

    final_hidden = False  # step 0 reads the auxiliary layers' states
    d2t: torch.Tensor  # a buffer: each draft token's offset to its target id

    def __init__(self, cfg: Eagle3Config, layer_id: int) -> None:
        super().__init__()
        self.config = cfg
        self.aux_layers = cfg.aux_layers
        hidden = cfg.layer.hidden_size
        with building_attention():
            self.embed_tokens: nn.Module = VocabParallelEmbedding(cfg.layer.vocab_size, hidden)
        # Whole on every rank (as one slice held by all): each rank drafts the same tokens.
        # Column-parallel linears all the same, so that CPU packs them for oneDNN.
        every = tp_group().size
        self.fc = ColumnParallelLinear(len(cfg.aux_layers) * hidden, hidden, False, every)
        self.input_norm = (
            RMSNorm(len(cfg.aux_layers) * hidden, cfg.layer.rms_norm_eps)
            if cfg.norm_before_fc
            else None
        )
        self.layers = nn.ModuleList([Eagle3Layer(cfg, layer_id)])
        self.norm = RMSNorm(hidden, cfg.layer.rms_norm_eps)
        self.lm_head = ColumnParallelLinear(hidden, cfg.draft_vocab_size, False, every)
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.long))

    def start(
        self, aux: torch.Tensor, next_ids: torch.Tensor, positions: torch.Tensor,
        attn: AttentionBackend,
    ) -> torch.Tensor:  # fmt: skip
        """aux: [rows, len(aux_layers) * hidden] -> the layer's output [rows, hidden]."""
        if self.input_norm is not None:
            aux = self.input_norm(aux)
        return self._layer(positions, next_ids, self.fc(aux), attn)

    def step(
        self, previous: torch.Tensor, ids: torch.Tensor, positions: torch.Tensor,
        attn: AttentionBackend,
    ) -> torch.Tensor:  # fmt: skip
        """A later draft step: the last step's output at the row before, and its token."""
        if self.config.norm_output:
            previous = self.norm(previous)
        return self._layer(positions, ids, previous, attn)

    def _layer(
        self, positions: torch.Tensor, ids: torch.Tensor, hidden: torch.Tensor,
        attn: AttentionBackend,
    ) -> torch.Tensor:  # fmt: skip
        return self.layers[0](positions, self.embed_tokens(ids), hidden, attn)

    def propose(self, out: torch.Tensor) -> torch.Tensor:
        """The greedy draft token (a target id) after each row of the layer's output."""
        draft = self.lm_head(self.norm(out)).argmax(dim=-1)
        return draft + self.d2t[draft]


def load_draft(
    path: str | Path, target: CausalLM, dtype: torch.dtype, device: torch.device
) -> Eagle3Draft:
    """The draft in `path` for `target` (a CausalLM): its layer's KV is the pool's layer after
    the target's; without its own embeddings it shares the target's."""
    path = Path(path)
    cfg = Eagle3Config.from_dir(path, target.config)
    cfg.check_target(target.config, str(path))
    try:
        weights = load_file(str(path / "model.safetensors"))
    except (OSError, ValueError) as err:
        message = f"EAGLE-3 draft {path}: no readable model.safetensors ({err})"
        raise TierserveError(message, FIELD) from None
    weights = {k.replace("midlayer.", "layers.0.", 1): v for k, v in weights.items()}
    weights.pop("t2d", None)  # target -> draft, for training only
    with torch.device("meta"):
        draft = Eagle3Draft(cfg, target.config.num_layers)
    draft = materialize(draft, device, dtype)
    targets = draft.state_dict(keep_vars=True)
    if "embed_tokens.weight" not in weights:  # shared, as vLLM and SGLang share it
        targets.pop("embed_tokens.weight")
        draft.embed_tokens = target.model.embed_tokens
    if "d2t" not in weights:  # a draft over the whole target vocabulary: offsets of 0
        targets.pop("d2t")
        draft.d2t.zero_()
    fill(draft, targets, weights.items(), f"EAGLE-3 draft {path}", FIELD)
    cfg.check_d2t(draft.d2t, target.config, path)
    layer = cast(Eagle3Layer, draft.layers[0])  # nn.ModuleList's items are typed Module
    fresh = rotary_for(cfg.layer).to(device)
    layer.rotary.cos, layer.rotary.sin = fresh.cos, fresh.sin
    pack_for_cpu(draft)
    return draft.eval()


def draft_numel(path: str | Path) -> int:
    """Parameters a draft adds (its embeddings are the target's when it has none)."""
    shapes = tensor_shapes(Path(path) / "model.safetensors")
    return sum(math.prod(shape) for shape in shapes.values())


# The draft shipped for the bundled demo model (scripts/train_eagle3_draft.py writes it), and
# the sha256 of the demo weights it was trained on.
SHIPPED_DRAFT = Path(__file__).resolve().parent.parent / "demo_model_eagle3"


def draft_path_for(given: str | None, model_path: str) -> str:
    """The draft to serve `model_path` with: `given`, or the shipped one when the model's
    weights are the demo model's it was trained on; otherwise a refusal naming the flag."""
    if given is not None:
        if not (Path(given) / "config.json").is_file():
            raise TierserveError(f"--speculative-draft-model-path {given}: no config.json", FIELD)
        return given
    if _is_shipped_target(Path(model_path)):
        return str(SHIPPED_DRAFT)
    raise TierserveError(
        "--speculative-algorithm EAGLE3 needs --speculative-draft-model-path: a draft is shipped "
        "only for the bundled demo model",
        FIELD,
    )


def _is_shipped_target(model: Path) -> bool:
    import hashlib

    digest_file = SHIPPED_DRAFT / "target.sha256"
    weights = model / "model.safetensors"
    bundled = DEMO_MODEL_DIR / "model.safetensors"
    if not (digest_file.is_file() and weights.is_file() and bundled.is_file()):
        return False
    if weights.stat().st_size != bundled.stat().st_size:  # never hash a large checkpoint
        return False
    return hashlib.sha256(weights.read_bytes()).hexdigest() == digest_file.read_text().strip()
