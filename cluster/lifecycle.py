"""Restart bookkeeping for one group: backoff between attempts, and when to give up.

LeaderWorkerSet recreates a group on any pod restart and keeps doing so; we do the same with
exponential backoff, and after ``max_restarts`` failures within ``window_s`` the group is
marked failed (a crash loop that eats a whole node group helps no one).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from pydantic import BaseModel, ConfigDict, Field


class RecoveryConfig(BaseModel):
    """How the coordinator checks groups and restarts them (``coordinator:`` in the serve config)."""

    model_config = ConfigDict(extra="forbid")

    health_period_s: float = Field(
        0.5, gt=0, description="How often every ready group is checked (leader, engine, progress)."
    )
    health_timeout_s: float = Field(
        3.0,
        gt=0,
        description="A leader that does not answer a health check within this is hung (its event loop is stuck).",
    )
    death_verdict_s: float = Field(
        10.0,
        gt=0,
        description=(
            "A leader that misses its health check is called hung only once Ray's actor table has not listed it "
            "dead for this long after: Ray learns of a killed leader seconds after its process is gone (2.4-3.6 s "
            "measured on a 2-core machine serving light load, over 6 s in the e2e suite), and that is a death, "
            "not a hang."
        ),
    )
    hang_timeout_s: float = Field(
        30.0,
        gt=0,
        description=(
            "An engine with unfinished requests and no step output for this long is hung (a frozen rank or a stuck "
            "collective). Above the longest single engine step you expect: one step prefills up to "
            "max_num_batched_tokens (2,048 on CPU); on a slow day of the 2-core dev machine smollm2-135m took "
            "5.9 s to answer a 600-token prompt and 15.4 s a 2,000-token one (one group, idle), so the 4 s "
            "default before 2026-12-05 gang-restarted healthy groups. vLLM's own timeouts are minutes."
        ),
    )
    worker_check_period_s: float = Field(
        2.0,
        gt=0,
        description="How often every worker actor's state is read from Ray (Ray executor: a dead rank vLLM missed).",
    )
    drain_timeout_s: float = Field(
        30.0, ge=0, description="Operator restarts wait this long for in-flight requests before killing the group."
    )
    max_restarts: int = Field(5, ge=1, description="Restarts allowed within window_s before the group is failed.")
    window_s: float = Field(600.0, gt=0, description="The window max_restarts counts over.")
    backoff_initial_s: float = Field(
        0.0, ge=0, description="Delay before the first restart: none, a single fault should cost no extra time."
    )
    backoff_base_s: float = Field(2.0, gt=0, description="Delay before the second restart, doubling after that.")
    backoff_max_s: float = Field(60.0, gt=0, description="Longest delay between restarts.")


@dataclass
class RestartBudget:
    config: RecoveryConfig
    failures: deque[float] = field(default_factory=deque)

    def next_delay(self, now: float) -> float | None:
        """Record a failure at ``now``; the delay before restarting, or None when the budget is spent."""
        window_start = now - self.config.window_s
        while self.failures and self.failures[0] < window_start:
            self.failures.popleft()
        self.failures.append(now)
        recent = len(self.failures)
        if recent > self.config.max_restarts:
            return None
        if recent == 1:
            return self.config.backoff_initial_s
        return min(self.config.backoff_max_s, self.config.backoff_base_s * 2 ** (recent - 2))
