"""A plan: the rows of the engine loop's next forward, each with the rule that put it there.

`Scheduler.schedule()` returns one; `execute(plan)` forwards its blocks in one backend call
and `update(plan, outputs)` hands each job its result. Being data, a plan can be logged
(`describe`), observed by tests (`Scheduler.on_plan`) and checked without running a model.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from inference_engine.runtime.job import Job
from inference_engine.execution.executor import Block


class Why(Enum):
    """The rule that gave a job its rows."""

    DECODE = "decode"  # a stream's next step (streams go first, in rotating order)
    JOINED = "joined"  # a stream started while the streams' plans waited for their last forward
    FINISHING = "finishing"  # an append that completes here, whole, beyond its budget (a prompt's TTFT)
    SLICE = "slice"  # an append's slice within the budget the streams leave (policy.GAP_SLACK)
    FILL = "fill"  # an append with no stream running: the rows left


@dataclass(frozen=True)
class Row:
    """One job's block in the forward."""

    job: Job  # whose block it is (its `update` takes the result)
    block: Block  # its session's executor and token rows
    why: Why  # the rule that chose it


@dataclass(frozen=True)
class Plan:
    """The next forward."""

    rows: tuple[Row, ...]  # every block of the forward, in the order they were planned
    streams: int  # stream rows this iteration, counting streams mid-hand-over (the appends' budget base)
    budget: int | None  # append rows allowed beside the streams (None: no stream, or no append waiting)
    planned_at: float  # the scheduler's clock when the streams' blocks were planned (a stream's period mark)

    @property
    def n_rows(self) -> int:
        """Token rows in the forward."""
        return sum(len(r.block.tokens) for r in self.rows)

    @property
    def is_streaming(self) -> bool:
        """A stream's step is in it (its period is timed for the cost model)."""
        return any(r.why in (Why.DECODE, Why.JOINED) for r in self.rows)

    def describe(self) -> list[tuple[str, int, str]]:
        """(session tag, rows, why) per block: what a log line or a test reads."""
        return [(getattr(r.job.session, "tag", "?"), len(r.block.tokens), r.why.value) for r in self.rows]
