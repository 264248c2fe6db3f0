"""`hardy replay REPORT --item N [--repeat K]`: one failed item of a run report, run again in fresh workers.

The item's kept inputs (`hardy.forensics.kept`) run through the same pipeline on a process engine with one
worker that serves a single item (`max_tasks_per_worker=1`) and the original engine's worker
options (preload, preload_libs, start method, memory limit), so every run starts as the original
worker did: a fresh process from a clean fork server, the worker environment, the native
handler. One run shows the outcome with its Python and native stacks and the diagnosis; K runs
give the failure rate with its 95 % Wilson interval (`hardy repeat`'s statistics), which tells a
deterministic crash (K of K) from a flaky one.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import typer

from ..doctor.repeat import wilson

if TYPE_CHECKING:
    from ..errors import NodeError


@dataclass
class Replay:
    item: int
    pipeline: str
    outcomes: list[str] = field(default_factory=list)  # "ok", or the failure's signal or error type, per run
    first_failure: NodeError | None = None

    @property
    def failures(self) -> int:
        return sum(o != "ok" for o in self.outcomes)

    @property
    def interval(self) -> tuple[float, float]:
        return wilson(self.failures, len(self.outcomes))

    def verdict(self) -> str:
        n, k = len(self.outcomes), self.failures
        lo, hi = self.interval
        rate = f"failed {k} of {n} run(s): {k / n:.0%} (95% CI {lo:.0%}-{hi:.0%})"
        if k == 0:
            return rate + ": did not fail again here (flaky, or it depends on what ran before it in its worker)"
        if k == n:
            return rate + (": deterministic" if n > 1 else "")
        return rate + ": flaky"


def replay(report: str | os.PathLike[str], item: int, repeat: int = 1) -> Replay:
    """Run the kept item `repeat` times, each in a fresh worker."""
    from ..engine import Engine
    from ..forensics.kept import load
    kept = load(report, item)
    pipeline, inputs = kept["pipeline"], kept["inputs"]
    result = Replay(item, pipeline.name)
    options = {**getattr(pipeline.engine, "process_options", {}), "max_tasks_per_worker": 1}
    with Engine(map_executor="process", workers=1, **options) as engine:  # its preload, start method, libraries
        out = pipeline.map(inputs={k: [v] * repeat for k, v in inputs.items()}, map_over=list(inputs),
                           on_error="continue", progress=False, engine=engine)
    for value in out:
        err: Any = getattr(value, "error", None)
        if err is None:
            result.outcomes.append("ok")
            continue
        result.outcomes.append(getattr(err, "signal", None) or type(err.__cause__ or err).__name__)
        if result.first_failure is None:
            result.first_failure = err
    return result


def replay_command(report: str = typer.Argument(..., metavar="REPORT",
                                                help="A run report's JSON (Engine(report_dir=...) writes them)."),
           item: int = typer.Option(..., "--item", metavar="N", help="The failed item to run again."),
           repeat: int = typer.Option(1, "--repeat", "-n", min=1, metavar="N",
                                      help="Runs, each in a fresh worker: with more "
                                      "than one, the failure rate and its 95% confidence interval.")) -> None:
    """Run a failed item again from its kept inputs; print the outcome, its stacks and the diagnosis.

    Exit code: 0 when every run succeeded, 1 when one failed, 2 when the item cannot be replayed.
    """
    from ..errors import ReplayError
    try:
        result = replay(report, item, repeat)
    except ReplayError as exc:
        typer.echo(f"hardy replay: {exc}", err=True)
        raise typer.Exit(2) from None
    typer.echo(f"item {item} of pipeline {result.pipeline!r}, {repeat} run(s), each in a fresh worker: "
               + ", ".join(result.outcomes))
    if result.first_failure is not None:
        typer.echo(str(result.first_failure))
    typer.echo(result.verdict())
    raise typer.Exit(1 if result.failures else 0)
