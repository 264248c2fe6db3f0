"""`hardy doctor`, `hardy repeat`, `hardy libs` and `hardy wheel`: the native-environment tools."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import sys
from typing import TYPE_CHECKING, Any

import typer
from rich.table import Table

from . import consoles
from .consoles import plain
from .usage import PlainUsage, at_least, refuse

if TYPE_CHECKING:
    from ..doctor.repeat import RepeatReport, RunOutcome

console = consoles.console()  # a table folds a long cell over lines: a path is never cut off (rich would end it in …)
wheel_app = typer.Typer(add_completion=False, no_args_is_help=True, rich_markup_mode=None,
                        help="Patch a wheel reproducibly, verify one against its RECORD, serve a folder as an index.")

_SEVERITY_STYLE = {"ok": "green", "note": "cyan", "warning": "yellow", "error": "red"}


def _ci(lo: float, hi: float) -> str:
    return f"{lo:.0%}–{hi:.0%}"


def doctor(import_: str | None = typer.Option(None, "--import", metavar="MODULES",
                                              help="Comma-separated modules to import in this process before "
                                                   "examining it."),
           matrix: str | None = typer.Option(None, "--matrix", metavar="MODULES",
                                             help="Comma-separated modules: each alone and each ordered pair, "
                                                  "imported in --repeat fresh interpreters (the import-order crash "
                                                  "matrix)."),
           imports: str | None = typer.Option(None, "--imports", hidden=True,
                                              help="The name --matrix had (with --repeat), kept for scripts."),
           then: str | None = typer.Option(None, "--then", metavar="CODE",
                                           help="Python code to run after the imports (--matrix only)."),
           repeat: int = typer.Option(0, "--repeat", "-n", metavar="N", callback=at_least(0),
                                      help="Fresh interpreters per cell of the crash matrix."),
           jobs: int = typer.Option(2, "--jobs", "-j", metavar="N", callback=at_least(1),
                                     help="Interpreters run at once (--matrix; 1 or more)."),
           as_json: bool = typer.Option(False, "--json", help="Machine-readable output.")) -> None:
    """Diagnose this Python environment; with --matrix a,b --repeat N, find the import order that crashes.

    Exit code: 0 all fine, 1 warnings, 2 errors (or, for the matrix, 1 if any cell crashed).
    """
    from . import quiet_when_the_reader_goes
    quiet_when_the_reader_goes()
    if imports and repeat:  # the old spelling of --matrix
        matrix = imports
    elif imports:  # ... and, without --repeat, of --import
        import_ = import_ or imports
    if matrix is not None and not _names(matrix):
        raise typer.BadParameter("name the modules, comma-separated: --matrix torch,cuml", param_hint="--matrix")
    if matrix:
        if not repeat:
            raise typer.BadParameter("--matrix needs --repeat N (fresh interpreters per cell)", param_hint="--repeat")
        _crash_matrix(_names(matrix), then, repeat, jobs, as_json)
    if then:
        raise typer.BadParameter("--then runs after each cell's imports: give --matrix MODULES --repeat N too",
                                 param_hint="--then")
    _examination(_names(import_ or ""), as_json)


def _names(text: str) -> list[str]:
    return [m.strip() for m in text.split(",") if m.strip()]


def _crash_matrix(modules: list[str], then: str | None, repeat: int, jobs: int, as_json: bool) -> None:
    from ..doctor import import_matrix
    cells = import_matrix(modules, then=then, repeat=repeat, jobs=jobs,
                          on_cell=None if as_json else lambda c: console.print(
                              f"  {plain(f'{c.label:<40}')} {c.failures}/{c.runs} crashed", highlight=False))
    if as_json:
        typer.echo(json.dumps([{"modules": c.modules, "runs": c.runs, "crashes": c.crashes, "stages": c.stages,
                                "rate": c.rate, "ci95": c.interval} for c in cells]))
    else:
        t = Table(title=f"import-order crash matrix ({repeat} fresh interpreters per row)"
                  + (f", then: {plain(then)}" if then else ""))
        for col in ("imports", "crashed", "rate", "95% CI", "signals", "when"):
            t.add_column(col, overflow="fold")
        for c in cells:
            style = "red" if c.failures else ""
            t.add_row(plain(c.label), f"{c.failures}/{c.runs}", f"{c.rate:.0%}", _ci(*c.interval),
                      plain(", ".join(f"{k} x{v}" for k, v in c.crashes.items()) or "-"),
                      plain(", ".join(f"{k} x{v}" for k, v in c.stages.items()) or "-"), style=style)
        console.print(t)
    raise typer.Exit(1 if any(c.failures for c in cells) else 0)


def _examination(modules: list[str], as_json: bool) -> None:
    from ..doctor import examine
    report = examine(modules)
    if as_json:
        typer.echo(json.dumps(report.as_dict(), default=str))
        raise typer.Exit(report.exit_code)
    console.print(f"[bold]Python[/] {plain(report.python)}\n[bold]Platform[/] {plain(report.platform)}")
    if report.imported:
        console.print(f"[bold]Imported first[/] {plain(', '.join(report.imported))}")
    t = Table(title="native-heavy packages")
    t.add_column("package", overflow="fold")
    t.add_column("version", overflow="fold")
    for name, version in report.packages.items():
        t.add_row(plain(name), plain(version) if version else "[dim]not installed[/]")
    console.print(t)
    t = Table(title="runtimes and threads")
    t.add_column("what", overflow="fold")
    t.add_column("value", overflow="fold")
    t.add_row("OpenMP runtimes loaded", plain("\n".join(report.openmp) or "none"))
    t.add_row("BLAS libraries loaded", plain("\n".join(report.blas) or "none"))
    for k, v in {**report.threads, **report.cuda}.items():
        t.add_row(plain(k), plain(v))
    console.print(t)
    _print_gpus(report.gpu)
    _print_findings(report.findings)
    raise typer.Exit(report.exit_code)


def _print_findings(findings: list[Any]) -> None:
    if not findings:
        console.print("[green]nothing to report[/]: no fork hazard, no unresolvable library, no version "
                      "outside a checked range")
        return
    t = Table(title="findings")
    t.add_column("", overflow="fold")
    t.add_column("topic", overflow="fold")
    t.add_column("finding", overflow="fold")
    for f in findings:
        t.add_row(f"[{_SEVERITY_STYLE[f.severity]}]{f.severity}[/]", plain(f.topic), plain(f.message))
    console.print(t)


def _print_gpus(gpu: dict[str, Any]) -> None:
    t = Table(title="GPUs")
    t.add_column("what", overflow="fold")
    t.add_column("value", overflow="fold")
    if not gpu.get("gpus"):
        t.add_row("GPUs", "[bold]no NVIDIA GPU[/] (see findings)")
    for g in gpu.get("gpus", []):
        memory = (f", {g['memory_free'] / 2**30:.1f} of {g['memory_total'] / 2**30:.1f} GiB free"
                  if g["memory_total"] else "")
        cc = f", compute capability {g['compute_capability']}" if g["compute_capability"] else ""
        t.add_row(f"GPU {g['index']}", plain(f"{g['name']}{cc}{memory}"))
    t.add_row("found through", plain(gpu.get("source", "none")))
    if gpu.get("driver"):
        t.add_row("driver", plain(f"{gpu['driver']} (CUDA up to {gpu.get('cuda_driver') or '?'})"))
    for lib, version in gpu.get("built_for_cuda", {}).items():
        t.add_row(f"{plain(lib)} built for CUDA", plain(version))
    if gpu.get("torch_architectures"):
        t.add_row("torch architectures", plain(" ".join(gpu["torch_architectures"])))
    t.add_row("CUDA_VISIBLE_DEVICES", plain(gpu.get("CUDA_VISIBLE_DEVICES")))
    t.add_row("CUDA in this process", plain(gpu.get("cuda_in_this_process", "?")))
    console.print(t)


def repeat(ctx: typer.Context,
           n: int = typer.Option(30, "-n", metavar="N", callback=at_least(1), help="How many runs (1 or more)."),
           jobs: int = typer.Option(1, "--jobs", "-j", metavar="N", callback=at_least(1),
                                    help="Runs at once (1 or more)."),
           stop_on_failure: bool = typer.Option(False, "--stop-on-failure", help="Stop at the first failing run."),
           timeout: float | None = typer.Option(None, "--timeout", metavar="SECONDS",
                                                help="Seconds before a run counts as hung "
                                                   "and is killed (with its process group)."),
           logs: str | None = typer.Option(None, "--logs", metavar="FOLDER",
                                           help="Keep each failing run's stdout/stderr here."),
           native: bool = typer.Option(True, "--native-frames/--no-native-frames", help="Give each run hardy's "
                                       "native crash handler (LD_PRELOAD): a crash names its library and function.")
           ) -> None:
    """Run a command N times in fresh processes and measure its crash rate: hardy repeat -n 30 -- CMD ARGS...

    Each run sees HARDY_RUN_INDEX=1..N. A crashing run's line names the library and function it died
    in; the first failing run's native and Python stacks are printed at the end. Exit code 1 if any
    run failed.
    """
    from ..doctor.repeat import repeat as run_repeat
    command = list(ctx.args)
    if not command:
        raise typer.BadParameter("give the command after --, e.g. hardy repeat -n 30 -- python pipeline.py")
    if shutil.which(command[0]) is None:
        raise typer.BadParameter(f"{command[0]!r}: no such command (not a file, nor found on PATH)")
    width = len(str(n))

    def line(r: RunOutcome, total: int) -> None:
        mark = "[green]ok[/]  " if r.ok else "[red]FAIL[/]"
        extra = (f"  in {r.crashed_in}" if r.crashed_in else "") + (f"  log: {r.log}" if r.log else "")
        console.print(f"run {r.index:0{width}d}/{total} {mark} {plain(f'{r.outcome:<28}')} {r.seconds:6.2f} s"
                      + plain(extra), highlight=False, soft_wrap=True)

    from ..errors import InvalidArgument
    from . import exit_141_once_the_runs_stop
    with exit_141_once_the_runs_stop(console):
        try:
            report = run_repeat(command, n=n, jobs=jobs, stop_on_failure=stop_on_failure, timeout=timeout, logs=logs,
                                on_run=line, native=native)
        except InvalidArgument as exc:  # a --logs folder another user could swap: before any run
            refuse(str(exc))
        _summary(report, command)
    raise typer.Exit(1 if report.failures else 0)


def _summary(report: RepeatReport, command: list[str]) -> None:
    """`hardy repeat`'s last words: the first failing run's stacks, the outcomes and the failure rate."""
    first = next((r for r in report.runs if not r.ok and (r.native_stack or r.python_stack)), None)
    if first is not None:
        console.print(f"run {first.index} ({first.outcome})" + (f" died in {first.crashed_in}" if first.crashed_in
                                                                else "") + ":", highlight=False, soft_wrap=True,
                      markup=False)
        if first.native_stack:
            console.print(f"native stack:\n{first.native_stack}", highlight=False, soft_wrap=True, markup=False)
        if first.python_stack:
            console.print(first.python_stack, highlight=False, soft_wrap=True, markup=False)
    elif report.failures and report.native:
        console.print(f"({report.native})", highlight=False, markup=False)
    console.print(f"{len(report.runs)} runs of: {shlex.join(command)}", highlight=False, soft_wrap=True, markup=False)
    t = Table()
    t.add_column("outcome", overflow="fold")
    t.add_column("runs", justify="right", overflow="fold")
    for outcome, count in sorted(report.counts.items(), key=lambda kv: -kv[1]):
        t.add_row(plain(outcome), str(count))
    console.print(t)
    lo, hi = report.interval
    console.print(f"failure rate {report.failures}/{len(report.runs)} = {report.rate:.1%} (95% CI {_ci(lo, hi)})")


def libs(paths: list[str] = typer.Argument(None, metavar="FOLDER",
                                           help="Directories to index (default: exactly this interpreter's "
                                           "sys.path)."),
         package: list[str] = typer.Option([], "--package", "-p", metavar="PACKAGE",
                                           help="Index these (namespace) packages, "
                                           "e.g. nvidia."),
         order: bool = typer.Option(False, "--order", help="Print the preload order (dependencies first)."),
         preload: bool = typer.Option(False, "--preload", help="dlopen them in that order, here, as a test."),
         as_json: bool = typer.Option(False, "--json", help="Machine-readable output.")) -> None:
    """Index ELF shared libraries: report unresolvable DT_NEEDED and the order to preload them.

    Exit code 2 if a needed library is found nowhere, 1 if cycles were found.
    """
    from ..native.libs import analyse, package_dirs, scan
    from ..native.libs import preload as do_preload
    search = [p for p in sys.path if p and os.path.isdir(p)]
    absent = [p for p in paths or [] if not os.path.isdir(p)]
    if absent:
        raise typer.BadParameter(f"not a folder: {', '.join(absent)}", param_hint="FOLDER")
    dirs = [*(paths or []), *package_dirs(package)] or search
    skipped: list[str] = []  # (another user's, or replaceable: never loaded, said here)
    plan = analyse(scan(dirs, environment=dirs is search, skipped=skipped), search=search)
    if as_json:
        typer.echo(json.dumps({"python": sys.executable, "directories": dirs, "order": [lib.path for lib in plan.order],
                               "missing": [{"library": m.library.path, "needed": m.needed, "elsewhere": m.elsewhere}
                                           for m in plan.missing],
                               "needs_preload": [{"library": m.library.path, "needed": m.needed,
                                                  "provided_by": m.elsewhere} for m in plan.needs_preload],
                               "cycles": plan.cycles, "skipped": skipped}))
    else:
        where = (f"the {len(dirs)} directories of sys.path" if not (paths or package) else f"{len(dirs)} directories")
        console.print(f"{len(plan.order)} libraries indexed under {where} of {sys.executable} (Python "
                      f"{sys.version.split()[0]})", highlight=False, soft_wrap=True, markup=False)
        for m in plan.missing:
            console.print(f"[red]missing[/] {plain(m)}", highlight=False)
        for m in plan.needs_preload:
            console.print("[yellow]needs preload[/] " + plain(f"{m.library.path} needs {m.needed}, which only "
                          f"{m.elsewhere} has: load it first (hardy libs --order)"), highlight=False)
        for c in plan.cycles:
            console.print(f"[yellow]cycle[/] {plain(' -> '.join(c))}", highlight=False)
        for s in skipped:
            console.print(f"[yellow]skipped[/] {plain(s)}", highlight=False)
        if order:
            for i, lib in enumerate(plan.order, 1):
                console.print(f"{i:4d}  {lib.soname:<40} {lib.path}", highlight=False, markup=False)
    if preload:
        loaded = do_preload(paths=dirs)
        console.print(f"preloaded {len(loaded)} libraries")
    raise typer.Exit(2 if plan.missing else (1 if plan.cycles else 0))


@wheel_app.command("patch")
def wheel_patch(wheel: str = typer.Option(..., "--wheel", metavar="FILE", help="The wheel to patch."),
                patch_dir: str = typer.Option(..., "--patch-dir", metavar="FOLDER",
                                              help="Unified diffs, applied in name order."),
                suffix: str = typer.Option(..., "--suffix", metavar="LABEL",
                                           help="Local version label: VERSION+SUFFIX."),
                dest_dir: str = typer.Option(..., "--dest-dir", metavar="FOLDER",
                                             help="Where the patched wheel is written.")) -> None:
    """Unpack, apply the patches, set VERSION+SUFFIX, regenerate RECORD, repack."""
    from ..doctor.wheel import patch_wheel
    from ..errors import WheelError
    try:
        out = patch_wheel(wheel, patch_dir, suffix, dest_dir)
    except WheelError as exc:
        console.print(f"[red]error[/] {plain(exc)}", highlight=False)
        raise typer.Exit(2) from None
    console.print(f"wrote {out}", highlight=False, markup=False)


@wheel_app.command("verify", cls=PlainUsage)
def wheel_verify(wheel: str = typer.Argument(..., metavar="WHEEL", help="The wheel to check.")) -> None:
    """Check every file's sha256 and size against RECORD. Exit code 1 on any mismatch."""
    from ..doctor.wheel import verify_wheel
    if not os.path.isfile(wheel):
        raise typer.BadParameter(f"{wheel}: no such file", param_hint="WHEEL")
    result = verify_wheel(wheel)
    for p in result.problems:
        console.print(f"[red]bad[/] {plain(p)}", highlight=False)
    console.print(f"checked {result.checked} files, {len(result.problems)} problems")
    raise typer.Exit(1 if result.problems else 0)


@wheel_app.command("index", cls=PlainUsage)
def wheel_index(folder: str = typer.Argument(..., metavar="FOLDER", help="A folder of wheels (and sdists).")) -> None:
    """Write a PEP 503 simple index (FOLDER/simple) for pip --index-url file://FOLDER/simple."""
    from ..doctor.wheel import build_index
    from ..errors import WheelError
    try:
        simple = build_index(folder)
    except WheelError as exc:
        console.print(f"[red]error[/] {plain(exc)}", highlight=False)
        raise typer.Exit(2) from None
    install = shlex.join(["pip", "install", "--index-url", simple.as_uri()])
    console.print(f"wrote {simple}; install with: {install} NAME", highlight=False, markup=False)
