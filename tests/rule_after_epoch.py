"""A rule written for the tests, in one file, to show the seam: every layer climbs one
rung of the ladder every ``every`` checks, whatever the gradients do. It also keeps the
observations it was given, so that a test can compare what the ranks saw."""

from __future__ import annotations

from typing import Any

from accordion.policy import Ladder, Observation, Rule


class ClimbEveryK(Rule):
    """Rung ``min(top, index // every)`` for every layer."""

    name = "climb-every-k"
    needs = frozenset({"memory_norms"})

    def __init__(self, every: int):
        super().__init__()
        self.every = every
        self.seen: list[dict[str, Any]] = []

    def decide(self, observation: Observation, ladder: Ladder) -> dict[str, int]:
        self.seen.append(
            {"index": observation.index, "grad_norms": dict(observation.grad_norms),
             "memory_norms": dict(observation.memory_norms)}
        )  # fmt: skip
        rung = min(ladder.top, observation.index // self.every)
        self.history.append({"epoch": observation.index, "rung": rung})
        return dict.fromkeys(observation.grad_norms, rung)

    def config(self) -> dict[str, Any]:
        return {"every": self.every}
