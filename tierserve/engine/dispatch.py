"""Which attention group runs a request, under data-parallel attention (rank 0 decides).

Every group has its own radix tree, so a prefix hits only in the group that holds it. SGLang's
own dispatcher places by load alone (`--load-balance-method round_robin`, `total_requests`,
`total_tokens`), so a conversation's next turn lands on its prefix's group only by chance.
`cache_aware`, the default, is sglang-router's rule for the same choice between workers:

- the groups are out of balance when the most loaded one runs more than `BALANCE_ABS` requests
  more than the least loaded one and more than `BALANCE_REL` × its load; then the least loaded
  group takes the request;
- otherwise the group whose tree holds the longest prefix of the prompt takes it, if that prefix
  is more than `CACHE_THRESHOLD` of the prompt; else the group with the smallest tree (the most
  room to cache), the least loaded of those that tie.

Like the router, rank 0 keeps its own approximate tree per group (the prompts it sent there, at
`BLOCK` token granularity, least recently used dropped past `MAX_BLOCKS`) rather than asking the
groups. A prompt equal to one still in flight goes where that one went, under every method,
unless the groups are out of balance: the `n` choices of a request share its group and its
prefill.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from tierserve.args import LOAD_BALANCE_METHODS

# sglang-router 0.3.2's defaults for cache_aware.
CACHE_THRESHOLD = 0.3
BALANCE_ABS = 64
BALANCE_REL = 1.5
BLOCK = 16
MAX_BLOCKS = 1 << 20


class PrefixIndex:
    """The prompts sent to one group, as hashes of their BLOCK-token prefixes."""

    def __init__(self, max_blocks: int = MAX_BLOCKS) -> None:
        self.blocks: OrderedDict[int, None] = OrderedDict()
        self.max_blocks = max_blocks

    def match(self, ids: list[int]) -> int:
        """Tokens of `ids`' longest prefix held here (whole blocks)."""
        matched = 0
        for key in _prefix_keys(ids):
            if key not in self.blocks:
                break
            matched += BLOCK
        return matched

    def insert(self, ids: list[int]) -> None:
        for key in _prefix_keys(ids):
            self.blocks[key] = None
            self.blocks.move_to_end(key)
        while len(self.blocks) > self.max_blocks:
            self.blocks.popitem(last=False)


def _prefix_keys(ids: list[int]) -> list[int]:
    """One key per whole block of `ids`, each naming the whole prefix up to it."""
    keys, key = [], 0
    for start in range(0, len(ids) - BLOCK + 1, BLOCK):
        key = hash((key, tuple(ids[start : start + BLOCK])))
        keys.append(key)
    return keys


@dataclass
class _InFlight:
    group: int
    tokens: int
    prompt_key: int | None  # None: not counted under its prompt (its siblings went elsewhere)


@dataclass
class Dispatcher:
    groups: int
    method: str = "cache_aware"
    requests: list[int] = field(init=False)  # in flight per group
    placed: list[int] = field(init=False)  # since the start, per group
    tokens: list[int] = field(init=False)  # their prompt and output tokens so far, per group
    trees: list[PrefixIndex] = field(init=False)
    _in_flight: dict[str, _InFlight] = field(default_factory=dict, init=False)
    _prompts: dict[int, tuple[int, int]] = field(default_factory=dict, init=False)
    _turn: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        assert self.method in LOAD_BALANCE_METHODS, self.method
        self.requests = [0] * self.groups
        self.placed = [0] * self.groups
        self.tokens = [0] * self.groups
        self.trees = [PrefixIndex() for _ in range(self.groups)]

    def place(self, rid: str, prompt_ids: list[int]) -> int:
        """The group for a new request."""
        prompt_key = hash(tuple(prompt_ids))
        sibling = self._prompts.get(prompt_key)
        if self._imbalanced():
            group = _least(self.requests)
        elif sibling is not None:
            group = sibling[0]
        else:
            group = self._choose(prompt_ids)
        self.trees[group].insert(prompt_ids)
        self.requests[group] += 1
        self.placed[group] += 1
        self.tokens[group] += len(prompt_ids)
        joins = sibling is not None and sibling[0] == group
        self._in_flight[rid] = _InFlight(
            group, len(prompt_ids), prompt_key if joins or sibling is None else None
        )
        if sibling is None:
            self._prompts[prompt_key] = (group, 1)
        elif joins:
            self._prompts[prompt_key] = (group, sibling[1] + 1)
        return group

    def group_of(self, rid: str) -> int | None:
        found = self._in_flight.get(rid)
        return found.group if found is not None else None

    def advanced(self, rid: str) -> None:
        """One more output token of `rid`."""
        found = self._in_flight.get(rid)
        if found is not None:
            found.tokens += 1
            self.tokens[found.group] += 1

    def finished(self, rid: str) -> None:
        """`rid` finished or was aborted: its group is that much less loaded."""
        found = self._in_flight.pop(rid, None)
        if found is None:
            return
        self.requests[found.group] -= 1
        self.tokens[found.group] -= found.tokens
        if found.prompt_key is None:
            return
        group, count = self._prompts[found.prompt_key]
        if count > 1:
            self._prompts[found.prompt_key] = (group, count - 1)
        else:
            del self._prompts[found.prompt_key]

    def busy(self, group: int) -> bool:
        return self.requests[group] > 0

    def _choose(self, prompt_ids: list[int]) -> int:
        if self.method == "round_robin":
            self._turn += 1
            return (self._turn - 1) % self.groups
        if self.method == "total_tokens":
            return _least(self.tokens)
        if self.method == "total_requests":
            return _least(self.requests)
        matches = [tree.match(prompt_ids) for tree in self.trees]
        best = max(range(self.groups), key=lambda g: (matches[g], -self.requests[g]))
        if matches[best] > CACHE_THRESHOLD * len(prompt_ids):
            return best
        return min(range(self.groups), key=lambda g: (len(self.trees[g].blocks), self.requests[g]))

    def _imbalanced(self) -> bool:
        most, least = max(self.requests), min(self.requests)
        return most - least > BALANCE_ABS and most > BALANCE_REL * least


def _least(values: list[int]) -> int:
    return min(range(len(values)), key=lambda g: values[g])
