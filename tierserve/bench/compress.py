"""A dense checkpoint written as compressed-tensors pack-quantized, by the format's own
compressor (the `compressed-tensors` package, a dev dependency imported only here): the
quantized checkpoints tests and benchmarks serve, laid out as llm-compressor writes them."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

from safetensors.torch import load_file, save_file

# The checkpoint's nn.Linear weights, as llm-compressor's `targets: ["Linear"]` finds them
# (a router's gate is no Linear in transformers' MoE models).
LINEAR = re.compile(r"_proj(_with_mqa)?\.weight$")


def compress(
    dense: Path,
    out: Path,
    bits: int,
    group: int | None,
    symmetric: bool,
    ignore: tuple[str, ...] = ("lm_head",),
) -> Path:
    """`dense`'s checkpoint with every linear but `ignore` quantized by compressed-tensors'
    PackedQuantizationCompressor, and the quantization_config it documents."""
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.config import CompressionFormat
    from compressed_tensors.quantization import (
        QuantizationArgs,
        QuantizationConfig,
        QuantizationScheme,
        QuantizationStrategy,
        QuantizationType,
    )
    from compressed_tensors.quantization.utils.helpers import calculate_qparams

    # The enums' members: their models keep the values ("int", "group", "pack-quantized").
    strategy = QuantizationStrategy.GROUP if group else QuantizationStrategy.CHANNEL
    args = QuantizationArgs(num_bits=bits, type=QuantizationType.INT, symmetric=symmetric,
                            strategy=strategy, group_size=group)  # fmt: skip
    scheme = QuantizationScheme(
        targets=["Linear"], weights=args, format=CompressionFormat.pack_quantized
    )
    out.mkdir(parents=True, exist_ok=True)
    for f in dense.iterdir():
        if f.name != "model.safetensors":
            shutil.copy(f, out / f.name)
    tensors = {}
    for name, w in load_file(str(dense / "model.safetensors")).items():
        module = name.removesuffix(".weight")
        if not (LINEAR.search(name) and w.dim() == 2) or _ignored(module, ignore):
            tensors[name] = w
            continue
        rows = w.float().reshape(w.shape[0], -1, group or w.shape[1])
        scale, zero = calculate_qparams(rows.amin(-1), rows.amax(-1), args)
        state = {"weight": w.float(), "weight_scale": scale, "weight_zero_point": zero}
        for key, t in PackedQuantizationCompressor.compress(state, scheme).items():
            tensors[f"{module}.{key}"] = t.contiguous()
    save_file(tensors, str(out / "model.safetensors"))
    quant = QuantizationConfig(config_groups={"group_0": scheme}, format="pack-quantized",
                               ignore=list(ignore)).model_dump(exclude_none=True)  # fmt: skip
    quant["quant_method"] = "compressed-tensors"
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"] = quant
    (out / "config.json").write_text(json.dumps(config, indent=1))
    return out


def _ignored(module: str, ignore: tuple[str, ...]) -> bool:
    """compressed-tensors' `ignore`: a module's name, or `re:` and a pattern it matches."""
    return any(
        re.match(p[3:], module) if p.startswith("re:") else module.split(".")[-1] == p
        for p in ignore
    )
