"""`hardy replay`: run one failed item of a saved run report again, in fresh workers."""

from __future__ import annotations

import typer


def replay(report: str = typer.Argument(..., help="A run report's JSON (Engine(report_dir=...) writes them)."),
           item: int = typer.Option(..., "--item", help="The failed item to run again."),
           repeat: int = typer.Option(1, "--repeat", "-n", min=1, help="Runs, each in a fresh worker: with more "
                                      "than one, the failure rate and its 95% confidence interval.")) -> None:
    """Run a failed item again from its kept inputs; print the outcome, its stacks and the diagnosis.

    Exit code: 0 when every run succeeded, 1 when one failed, 2 when the item cannot be replayed.
    """
    from ..forensics.kept import ReplayError
    from ..forensics.replay import replay as run_replay
    try:
        result = run_replay(report, item, repeat)
    except ReplayError as exc:
        typer.echo(f"hardy replay: {exc}", err=True)
        raise typer.Exit(2) from None
    typer.echo(f"item {item} of pipeline {result.pipeline!r}, {repeat} run(s), each in a fresh worker: "
               + ", ".join(result.outcomes))
    if result.first_failure is not None:
        typer.echo(str(result.first_failure))
    typer.echo(result.verdict())
    raise typer.Exit(1 if result.failures else 0)
