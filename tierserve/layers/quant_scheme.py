"""A quantized weight's scheme: bits, group, symmetry. Torch-free, so that what reads a
checkpoint's config (`tierserve plan`, the API process) does not load torch."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class QuantScheme:
    """One config group's weights: `group_size` None is one scale per output row (channel)."""

    num_bits: int
    group_size: int | None
    symmetric: bool

    def groups(self, in_features: int) -> int:
        return 1 if self.group_size is None else in_features // self.group_size

    def describe(self) -> str:
        group = "channel" if self.group_size is None else f"g{self.group_size}"
        return f"int{self.num_bits} {group} {'sym' if self.symmetric else 'asym'}"
