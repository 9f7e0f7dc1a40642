"""A checkpoint's compressed-tensors quantization config, read once and torch-free (the plan
and the API process read it too): which linears are quantized, and how.

compressed-tensors (llm-compressor's output; Kimi-K2.5's routed experts) writes, under
`quantization_config` (at the top or under `text_config`): `quant_method: compressed-tensors`,
`format` (also per config group in 0.20), `config_groups` each with `targets` (a module class,
"Linear", or `re:` patterns of module names) and `weights` (`num_bits`, `type`, `symmetric`,
`strategy`, `group_size`), and `ignore` (names or `re:` patterns left dense). Served here:
`pack-quantized` int4 and int8, `group` and `channel` strategies, symmetric and asymmetric,
weights only. Activation quantization, float formats (nvfp4, mxfp4, fp8 groups), sparsity and
other formats are refused by name at start and in `--dry-run`.

Names are matched as the checkpoint names modules, without a multimodal prefix (Kimi-K2.5's
`language_model.`), which is how its `ignore` list names them.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from tierserve.errors import TierserveError
from tierserve.layers import QuantScheme

FORMAT = "pack-quantized"


@dataclass(frozen=True)
class QuantConfig:
    groups: tuple[tuple[tuple[str, ...], QuantScheme], ...]  # (targets, scheme), in order
    ignore: tuple[str, ...]

    @classmethod
    def read(cls, hf: Mapping[str, Any]) -> QuantConfig | None:
        """The text config's compressed-tensors quantization; None for none (or another
        method, which the loader reads as before: fp8 blocks)."""
        quant = hf.get("quantization_config")
        if not isinstance(quant, dict) or quant.get("quant_method") != "compressed-tensors":
            return None
        groups = quant.get("config_groups")
        if not isinstance(groups, dict) or not groups:
            raise refused("config_groups must be an object of one or more groups")
        top_format = quant.get("format", FORMAT)
        read = tuple(_group(name, g, top_format) for name, g in groups.items())
        ignore = quant.get("ignore") or []
        if not isinstance(ignore, list) or not all(isinstance(i, str) for i in ignore):
            raise refused("ignore must be a list of module names and re: patterns")
        return cls(read, tuple(ignore))

    def scheme_for(self, name: str) -> QuantScheme | None:
        """The scheme of the linear the checkpoint names `name`; None: dense."""
        if any(_matches(pattern, name) for pattern in self.ignore):
            return None
        for targets, scheme in self.groups:
            if any(t == "Linear" or _matches(t, name) for t in targets):
                return scheme
        return None

    def describe(self) -> str:
        schemes = sorted({s.describe() for _, s in self.groups})
        return f"compressed-tensors {FORMAT} {', '.join(schemes)}"


def _matches(pattern: str, name: str) -> bool:
    if pattern.startswith("re:"):
        return re.match(pattern[3:], name) is not None
    return pattern == name or name.endswith("." + pattern)


def refused(why: str) -> TierserveError:
    return TierserveError(
        f"quantization_config (compressed-tensors): {why}; tierserve serves {FORMAT} int4 and "
        "int8 weights (group or channel scales, symmetric or asymmetric) with dense activations",
        field="model",
    )


def _group(name: str, group: Any, top_format: str) -> tuple[tuple[str, ...], QuantScheme]:
    if not isinstance(group, dict):
        raise refused(f"config group {name} must be an object")
    fmt = group.get("format") or top_format
    if fmt != FORMAT:
        raise refused(f"config group {name} has format {fmt!r}, not served")
    for acts in ("input_activations", "output_activations"):
        if group.get(acts):
            raise refused(f"config group {name} quantizes {acts}, not served")
    w = group.get("weights")
    targets = group.get("targets")
    if not isinstance(w, dict) or not isinstance(targets, list) or not targets:
        raise refused(f"config group {name} needs weights and targets")
    kind, bits, strategy = w.get("type", "int"), w.get("num_bits"), w.get("strategy")
    if kind != "int" or bits not in (4, 8):
        raise refused(f"config group {name} has {bits}-bit {kind} weights, not served")
    if strategy not in ("group", "channel"):
        raise refused(f"config group {name} has strategy {strategy!r}, not served")
    size = w.get("group_size") if strategy == "group" else None
    if strategy == "group" and (not isinstance(size, int) or size <= 0 or size % 8):
        raise refused(f"config group {name} has group_size {size!r}, not a multiple of 8")
    if w.get("actorder") not in (None, "weight", "static"):
        raise refused(f"config group {name} has actorder {w.get('actorder')!r}, not served")
    symmetric = w.get("symmetric", True)
    if not isinstance(symmetric, bool):
        raise refused(f"config group {name} has symmetric {symmetric!r}, not true or false")
    return tuple(map(str, targets)), QuantScheme(bits, size, symmetric)
