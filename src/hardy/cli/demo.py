"""`hardy demo`: a small text pipeline over generated documents, with one poisoned document.

It shows the three things hardy is for, in one screen: a map with a progress bar, a nested
pipeline, and (with the default process executor) a worker that segfaults inside the nested
pipeline's `tokenize`, costing exactly one item.
"""

from __future__ import annotations

import collections
import random
import re
import sys
import time

from rich.table import Table

from .. import Engine, Failed, MapInterrupted, Pipeline, node
from .consoles import console as new_console

WORDS = ["tensor", "kernel", "cache", "worker", "graph", "signal", "fork", "thread", "token", "model", "batch",
         "shard", "vector", "pipeline", "segment", "buffer", "stream", "queue", "crash", "native", "library",
         "import"]


@node(output_name="cleaned")
def clean(text: str) -> str:
    return re.sub(r"[^a-z ]+", " ", text.lower()).strip()


@node(output_name="tokens")
def tokenize(cleaned: str) -> list[str]:
    if cleaned.startswith("poison"):  # stands for a native library bug hit by one input
        import ctypes
        ctypes.string_at(0)  # dereference NULL: SIGSEGV in the worker
    return cleaned.split()


@node(output_name=("n_tokens", "top_word"))
def stats(tokens: list[str]) -> tuple[int, str]:
    common = collections.Counter(tokens).most_common(1)
    return len(tokens), common[0][0] if common else ""


def make_documents(n: int, poison_at: int | None) -> list[str]:
    rng = random.Random(7)
    docs = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(20, 200))).title() + "!"
            for _ in range(n)]
    if poison_at is not None and n:
        docs[poison_at % n] = "POISON " + docs[poison_at % n]
    return docs


_EXPLANATION = (
    "\n[bold]What happened[/]: the crash was deliberate. Document {item} starts with \"POISON\", and for "
    "it the `tokenize` node dereferences a NULL pointer through ctypes, as a bug in a native library "
    "would. The worker process running it died from SIGSEGV; hardy named the item, the node and the "
    "Python stack, started a replacement worker, and finished the other {good:,} documents: that is "
    "hardy's default (map_executor=\"process\"). Run in-process (a plain loop, or hardy's opt-in "
    "map_executor=\"sequential\"), the same segfault ends the "
    "whole interpreter and all {total:,} results are lost; multiprocessing.Pool waits forever for the "
    "dead worker's task, and ProcessPoolExecutor raises BrokenProcessPool for every pending item.")


def run_demo(items: int, executor: str, workers: int, progress: bool) -> int:
    """The demo's exit code: 0, 1 when not exactly the poisoned document failed, 130 when
    interrupted, saying how many documents were done by then (a silent 130 read as if nothing had
    run, where the map had finished thousands)."""
    try:
        return _demo(items, executor, workers, progress)
    except KeyboardInterrupt as stop:  # a MapInterrupted once the map runs, with what it finished
        done, failed = (stop.done, len(stop.failures)) if isinstance(stop, MapInterrupted) else (0, 0)
        print(f"hardy demo: interrupted: {done:,} of {items:,} documents done, {failed} failed", file=sys.stderr)
        return 130


def _demo(items: int, executor: str, workers: int, progress: bool) -> int:
    console = new_console()
    crashy = executor == "process"
    docs = make_documents(items, items // 2 if crashy else None)
    text = Pipeline(nodes=[clean, tokenize], name="text")
    engine = Engine(map_executor=executor, workers=workers)
    pipeline = Pipeline(nodes=[text.as_node(name="prep", input_mapping={"doc": "text"}), stats],
                        engine=engine, name="demo")
    console.print(f"[bold]hardy demo[/]: {items} documents, map_executor={executor!r}, workers={workers}"
                  + (", one document segfaults its worker" if crashy else ""))
    start = time.perf_counter()
    with engine:
        results = pipeline.map(inputs={"doc": docs}, map_over="doc", on_error="continue", progress=progress)
        elapsed = time.perf_counter() - start
    good = [r for r in results if not isinstance(r, Failed)]
    failed = [(i, r) for i, r in enumerate(results) if isinstance(r, Failed)]
    table = Table(title="results")
    table.add_column("what")
    table.add_column("value", justify="right")
    table.add_row("documents", str(len(results)))
    table.add_row("succeeded", str(len(good)))
    table.add_row("failed", str(len(failed)))
    table.add_row("tokens in total", f"{sum(r['n_tokens'] for r in good):,}")
    top = collections.Counter(r["top_word"] for r in good).most_common(3)
    table.add_row("most frequent top words", ", ".join(f"{w} ({c})" for w, c in top))
    table.add_row("time", f"{elapsed:.2f} s ({len(results) / elapsed:,.0f} docs/s)")
    console.print(table)
    for i, r in failed:
        console.print(f"[red]item {i}[/] cost one item, nothing else:", markup=True)
        console.print(str(r.error), markup=False, highlight=False)
    if crashy and failed:
        console.print(_EXPLANATION.format(item=failed[0][0], good=len(good), total=len(results)), highlight=False)
    if crashy and len(failed) != 1:
        console.print("[red]expected exactly one crashed item[/]")
        return 1
    return 0
