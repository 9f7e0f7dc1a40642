"""Rank 0's view of the attention groups under data-parallel attention: where each request went
(the dispatcher), what each group reported after the last step, and the node's figures built
from those reports (docs/distributed.md#data-parallel-attention)."""

from __future__ import annotations

from tierserve.core_messages import GroupReport
from tierserve.engine.dispatch import Dispatcher
from tierserve.outputs import StepOutput


class AttentionGroups:
    def __init__(self, groups: int, method: str) -> None:
        self.dispatcher = Dispatcher(groups, method)
        self.reports = [GroupReport(g) for g in range(groups)]
        self.idle_steps = [0] * groups  # steps a group joined with nothing of its own to run
        self.placed_since_report = 0  # queued on a group after its last report
        # Each group's speculation counters as last reported, and (now, before) pairs of those
        # that reported in the last step: rank 0 adds the gains to the node's counters.
        self._spec_seen: list[list[int]] = [[] for _ in range(groups)]
        self.spec_gains: list[tuple[list[int], list[int]]] = []

    def holds(self, rid: str) -> bool:
        """Whether `rid` is in flight on some group."""
        return self.dispatcher.group_of(rid) is not None

    def place(self, rid: str, prompt_ids: list[int]) -> int:
        self.placed_since_report += 1
        return self.dispatcher.place(rid, prompt_ids)

    def take(self, reports: list[GroupReport], step: bool) -> list[StepOutput]:
        """The groups' reports of one step (or flush); every group's outputs, in group order."""
        self.reports = reports
        self.placed_since_report = 0
        self.spec_gains = []
        for r in reports:
            if r.spec:
                self.spec_gains.append((r.spec, self._spec_seen[r.dp_rank]))
                self._spec_seen[r.dp_rank] = r.spec
        if step:
            for r in reports:
                self.idle_steps[r.dp_rank] += r.scheduled == 0
        outputs = [o for r in reports for o in r.outputs]
        for out in outputs:
            self.dispatcher.advanced(out.request_id)
            if out.finish_reason:
                self.dispatcher.finished(out.request_id)
        return outputs

    @property
    def running(self) -> int:
        return sum(r.running for r in self.reports)

    @property
    def waiting(self) -> int:
        """Queued for admission: as the groups last reported, and placed since."""
        return sum(r.waiting for r in self.reports) + self.placed_since_report

    def busy(self) -> bool:
        """Whether any group has a request in flight (as rank 0 placed them)."""
        return any(self.dispatcher.requests)

    def flushed(self) -> dict[str, int | str]:
        """The groups' flush reports as one: page counts added, anything else as the first
        group said it."""
        out: dict[str, int | str] = {}
        for report in self.reports:
            for key, value in (report.flushed or {}).items():
                old = out.get(key)
                both = isinstance(old, int) and isinstance(value, int)
                out[key] = old + value if both else out.get(key, value)  # type: ignore[operator]
        return out
