"""The interpreter's settings that change what a node computes, as hardy carries them to worker
processes and keys cached results by them (docs/same-answer.md, docs/caching.md): warning filters
on a category a worker loads later, decimal's `DefaultContext`, numpy's error modes, torch's
modes, print options and backend flags. Real scripts run with `python -`, real worker processes
(the default engine) beside the sequential executor, real `DiskCache`s shared by fresh processes."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from conftest import needs_torch

SRC = str(Path(__file__).resolve().parent.parent / "src")


def script(tmp_path: Path, body: str, *args: str, each_engine: bool = False) -> list[str]:
    """Run `body` as a user's script (`python -`, its folder first on sys.path), then `EACH_ENGINE`
    if asked; the lines it printed."""
    source = (f"import sys\nsys.path.insert(0, {str(tmp_path)!r})\n" + textwrap.dedent(body)
              + (EACH_ENGINE if each_engine else ""))
    out = subprocess.run([sys.executable, "-", *args], input=source, text=True, capture_output=True,
                         timeout=120, cwd=tmp_path, env={**os.environ, "PYTHONPATH": SRC})
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.strip().splitlines()


EACH_ENGINE = """
from hardy import Engine, Pipeline
for label, engine in (("sequential", Engine(map_executor="sequential")), ("default", Engine(workers=2))):
    p = Pipeline(NODES, engine=engine)
    for call in (1, 2):
        print(label, "map", [sorted(o.items()) for o in p.map(inputs=ITEMS, map_over=OVER)] == OWN)
    print(label, "run", sorted(p.run(inputs=ONE).items()) == OWN[0])
"""

CATEGORIES = {
    "quality.py": """
        import warnings
        class DataQualityWarning(UserWarning):
            pass
        def check(rows):
            if rows < 10:
                warnings.warn(f"only {rows} rows", DataQualityWarning)
            return rows
    """,
    # a library that puts a filter of its own first as it is imported (numpy's RankWarning "always")
    "chatty.py": """
        import warnings
        class ChattyWarning(UserWarning):
            pass
        warnings.simplefilter("always", ChattyWarning)
        def talk(n):
            warnings.warn("chatty", ChattyWarning)
            return n
    """,
    "late.py": """
        import warnings
        class LateWarning(UserWarning):
            pass
        def check(n):
            warnings.warn("late", LateWarning)
            return n
    """,
}


def test_warning_filters_on_categories_a_worker_loads_later_apply_in_the_callers_order(tmp_path):
    """A filter that makes a user module's category an error (`quality.DataQualityWarning`), one on a
    module that puts its own "always" filter first as it is imported (`chatty`, as numpy does for
    `RankWarning`), one on a module a node imports inside its body (`late`), numpy's own
    `RankWarning`, and a category the script defines: workers took none of them (their modules
    were not loaded yet as the worker took its caller's filters, and the script's never is), so
    each node computed its "fast path" there, on every map and run, where the caller rejects."""
    for name, text in CATEGORIES.items():
        (tmp_path / name).write_text(textwrap.dedent(text))
    lines = script(tmp_path, """
        import warnings
        import numpy as np
        import chatty, late, quality
        from hardy import node

        class ScriptWarning(UserWarning):
            pass

        for category in (quality.DataQualityWarning, chatty.ChattyWarning, late.LateWarning,
                         np.exceptions.RankWarning, ScriptWarning):
            warnings.filterwarnings("error", category=category)

        def outcome(call, *args):
            try:
                call(*args)
                return "fast path"
            except Warning as w:
                return f"rejected ({type(w).__name__})"

        @node(output_name="quality")
        def rows(n):
            return outcome(quality.check, n)

        @node(output_name="chatty")
        def talk(n):
            return outcome(chatty.talk, n)

        @node(output_name="late")
        def lately(n):
            import late as module  # (not among what the plan loads)
            return outcome(module.check, n)

        @node(output_name="rank")
        def fit(n):
            return outcome(np.polyfit, [1.0, 1.0, 1.0], [1.0, 2.0, 3.0], 2)

        @node(output_name="script")
        def own(n):
            return outcome(warnings.warn, "mine", ScriptWarning)

        NODES, ITEMS, OVER, ONE = [rows, talk, lately, fit, own], {"n": [5, 6]}, "n", {"n": 5}
        OWN = [sorted({"quality": rows.func(n), "chatty": talk.func(n), "late": lately.func(n), "rank": fit.func(n),
                       "script": own.func(n)}.items()) for n in (5, 6)]
        print(OWN[0])
    """, each_engine=True)
    assert lines[0] == ("[('chatty', 'rejected (ChattyWarning)'), ('late', 'rejected (LateWarning)'), "
                        "('quality', 'rejected (DataQualityWarning)'), ('rank', 'rejected (RankWarning)'), "
                        "('script', 'rejected (ScriptWarning)')]")
    assert lines[1:] == [f"{engine} {call} True" for engine in ("sequential", "default")
                         for call in ("map", "map", "run")]


def test_decimal_default_context_reaches_workers_their_threads_and_the_cache_key(tmp_path):
    """`decimal.DefaultContext.prec = 6` (the Python docs' way to set system-wide defaults) was
    compared with `decimal.Context()`, itself a copy of it: nothing travelled and workers computed
    with 28 digits, in the node's own thread, a thread it starts and `decimal.Context()` alike; and
    a cache filled under it served its 6-digit results to a later plain process."""
    body = """
        import decimal, sys, threading
        if sys.argv[1] == "6":
            decimal.DefaultContext.prec = 6
        from decimal import Decimal
        from hardy import DiskCache, node

        @node(output_name="share")
        def split(total):
            found = []
            thread = threading.Thread(target=lambda: found.append(str(Decimal(total) / 7)))
            thread.start()
            thread.join()
            return str(Decimal(total) / 3), found[0], decimal.Context().prec

        NODES, ITEMS, OVER, ONE = [split], {"total": ["100", "10"]}, "total", {"total": "100"}
        OWN = [sorted({"share": split.func(t)}.items()) for t in ("100", "10")]
        print(OWN[0])
        if sys.argv[2] == "cache":
            from hardy import Engine, Pipeline
            cached = Pipeline([split], engine=Engine(map_executor="sequential"), cache=DiskCache(sys.argv[3]))
            print(cached.run(inputs=ONE)["share"] == OWN[0][0][1])
            sys.exit()
    """
    lines = script(tmp_path, body, "6", "engines", each_engine=True)
    assert lines[0] == "[('share', ('33.3333', '14.2857', 6))]"
    assert lines[1:] == [f"{engine} {call} True" for engine in ("sequential", "default")
                         for call in ("map", "map", "run")]
    cache = str(tmp_path / "cache")
    assert script(tmp_path, body, "6", "cache", cache) == ["[('share', ('33.3333', '14.2857', 6))]", "True"]
    assert script(tmp_path, body, "28", "cache", cache) == [
        "[('share', ('33.33333333333333333333333333', '14.28571428571428571428571429', 28))]", "True"]


KEYED = """
import os, sys, warnings
import numpy as np
import quality
from hardy import DiskCache, Engine, Pipeline, node

@node(output_name="status")
def load(rows):
    with open(sys.argv[2], "a") as f:
        f.write("load\\n")
    try:
        quality.check(rows)
        return "ok"
    except quality.DataQualityWarning:
        return "rejected"

@node(output_name="logs")
def safe_log(v):
    with open(sys.argv[2], "a") as f:
        f.write("log\\n")
    try:
        return np.log(np.asarray(v, dtype=float)).tolist()
    except (FloatingPointError, ValueError) as e:
        return f"bad input ({type(e).__name__})"

def complain(kind, flag):
    raise ValueError(kind)

settings = sys.argv[3].split(",")
if "strict" in settings:
    warnings.filterwarnings("error", category=quality.DataQualityWarning)
if "raise" in settings:
    np.seterr(divide="raise")
if "call" in settings:
    np.seterr(divide="call")
    np.seterrcall(complain)
p = Pipeline([load, safe_log], engine=Engine(map_executor=sys.argv[4]), cache=DiskCache(sys.argv[1]))
got = p.run(inputs={"rows": 5, "v": [1.0, 0.0]})
sys.argv[2] = os.devnull  # (the script's own calls below are not the pipeline's)
print(got["status"], got["logs"], got == {"status": load.func(5), "logs": safe_log.func([1.0, 0.0])})
"""


@pytest.mark.parametrize("executor", ["sequential", "process"])
def test_warning_filters_that_raise_and_numpy_error_modes_are_in_the_cache_key(tmp_path, executor):
    """hardy carries warning filters and `np.seterr` to workers because they change what a node
    computes, but keyed neither: a process that made a category an error, or division by zero an
    error (or a call of its function), was served the results computed without (and the reverse).
    Each is keyed where it is not its default; a plain process still finds the plain entries."""
    (tmp_path / "quality.py").write_text(textwrap.dedent(CATEGORIES["quality.py"]))
    (tmp_path / "job.py").write_text(KEYED)
    cache, calls = str(tmp_path / "cache"), tmp_path / "calls.txt"

    def run(*settings: str) -> tuple[str, list[str]]:
        before = calls.read_text().split() if calls.exists() else []
        out = subprocess.run([sys.executable, str(tmp_path / "job.py"), cache, str(calls), ",".join(settings),
                              executor], text=True, capture_output=True, timeout=120, cwd=tmp_path,
                             env={**os.environ, "PYTHONPATH": SRC})
        assert out.returncode == 0, out.stderr[-3000:]
        return out.stdout.strip(), (calls.read_text().split() if calls.exists() else [])[len(before):]

    assert run("plain") == ("ok [0.0, -inf] True", ["load", "log"])
    assert run("strict") == ("rejected [0.0, -inf] True", ["load", "log"])
    assert run("raise") == ("ok bad input (FloatingPointError) True", ["load", "log"])
    assert run("call") == ("ok bad input (ValueError) True", ["load", "log"])
    assert run("strict", "raise") == ("rejected bad input (FloatingPointError) True", ["load", "log"])
    assert run("plain") == ("ok [0.0, -inf] True", [])  # (its keys as before: found again)
    assert run("strict") == ("rejected [0.0, -inf] True", [])


TORCH = """
import sys
import torch
from hardy import DiskCache, Engine, Pipeline, node

@node(output_name="text")
def show(x):
    return str(torch.tensor([x]) / 3)

@node(output_name="graph")
def scaled(x):
    return (torch.ones(2, requires_grad=True) * x).requires_grad

@node(output_name="flags")
def flags(x):
    return (torch.backends.cudnn.enabled, torch.backends.mkldnn.enabled, torch.is_anomaly_enabled(),
            torch.is_anomaly_check_nan_enabled())

@node(output_name="algorithms")
def algorithms(x):
    return (torch.are_deterministic_algorithms_enabled(), torch.backends.cudnn.deterministic,
            torch.backends.cudnn.benchmark, torch.backends.cudnn.allow_tf32)

settings = sys.argv[2].split(",")
if "algorithms" in settings:  # (a seed helper's; on a GPU, other kernels and other roundings)
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, True
    torch.backends.cudnn.allow_tf32 = False
if "print" in settings:
    torch.set_printoptions(precision=2)
if "flags" in settings:
    torch.backends.cudnn.enabled = torch.backends.mkldnn.enabled = False
    torch.autograd.set_detect_anomaly(True, check_nan=False)
if "no_grad" in settings:
    torch.set_grad_enabled(False)
NODES, ITEMS, OVER, ONE = [show, scaled, flags, algorithms], {"x": [1.0, 2.0]}, "x", {"x": 1.0}
OWN = [sorted({"text": show.func(x), "graph": scaled.func(x), "flags": flags.func(x),
               "algorithms": algorithms.func(x)}.items()) for x in (1.0, 2.0)]
print(OWN[0])
cached = Pipeline(NODES, engine=Engine(map_executor="sequential"), cache=DiskCache(sys.argv[1]))
print("cache", sorted(cached.run(inputs=ONE).items()) == OWN[0])
"""


@pytest.mark.slow  # torch imported
def test_torch_print_options_backend_flags_anomaly_and_grad_mode_travel_and_key(tmp_path):
    """`torch.set_printoptions` (`str(tensor)`), `torch.backends.cudnn.enabled`,
    `torch.backends.mkldnn.enabled` and anomaly detection were not carried to workers; print
    options, the backends, deterministic algorithms, cudnn's flags and grad mode were not in the cache key: a process under
    `torch.no_grad()` was served a tensor that requires grad, one with `precision=2` four digits."""
    needs_torch()
    cache = str(tmp_path / "cache")
    assert script(tmp_path, TORCH, cache, "plain") == [
        "[('algorithms', (False, False, False, True)), ('flags', (True, True, False, True)), ('graph', True), "
        "('text', 'tensor([0.3333])')]", "cache True"]
    lines = script(tmp_path, TORCH, cache, "print,flags,no_grad,algorithms", each_engine=True)
    assert lines[:2] == [
        "[('algorithms', (True, True, True, False)), ('flags', (False, False, True, False)), ('graph', False), "
        "('text', 'tensor([0.33])')]", "cache True"]
    assert lines[2:] == [f"{engine} {call} True" for engine in ("sequential", "default")
                         for call in ("map", "map", "run")]
    for each in ("print", "flags", "no_grad", "algorithms"):  # (each one keyed on its own)
        assert script(tmp_path, TORCH, cache, each)[1] == "cache True", each


CHANGED_BETWEEN_CALLS = """
import decimal, sys, warnings
from decimal import Decimal
from hardy import DiskCache, Engine, Pipeline, node

@node(output_name="y")
def seventh(n):
    try:
        warnings.warn("old API", DeprecationWarning)
        said = "ok"
    except DeprecationWarning:
        said = "raised"
    return str(decimal.Context().divide(Decimal(n), Decimal(7))), said

warnings.simplefilter("error")
if sys.argv[1] == "ignore":  # (put first: it decides before the error filter does)
    warnings.filterwarnings("ignore", category=DeprecationWarning)
cached = Pipeline([seventh], engine=Engine(map_executor="sequential"), cache=DiskCache(sys.argv[2]))
for engine in (Engine(map_executor="sequential"), Engine(workers=1)):
    p = Pipeline([seventh], engine=engine)
    for prec in (28, 5, 28):
        decimal.DefaultContext.prec = prec  # (in place, between two calls of one pipeline)
        print(p.run(inputs={"n": 1})["y"] == seventh.func(1), p.map(inputs={"n": [1]}, map_over="n")[0]["y"]
              == seventh.func(1), cached.run(inputs={"n": 1})["y"] == seventh.func(1))
"""


def test_settings_changed_between_two_calls_and_filters_before_an_error_filter_count(tmp_path):
    """`decimal.DefaultContext` set in place between two calls of one pipeline was not seen (the
    call kept its settings, and its key, from before: workers and a cache gave 28 digits where
    your process computes 5); and an `ignore` filter ahead of an `error` one, which decides whether
    a warning raises, was left out of the key: a process whose node warned and raised was served
    what a process that ignored the warning computed."""
    cache = str(tmp_path / "cache")
    for order in ("ignore", "error", "ignore"):
        out = subprocess.run([sys.executable, "-c", CHANGED_BETWEEN_CALLS, order, cache], text=True,
                             capture_output=True, timeout=120, env={**os.environ, "PYTHONPATH": SRC})
        assert out.returncode == 0, out.stderr[-3000:]
        assert out.stdout.split() == ["True"] * 18, (order, out.stdout)


IMPORTS_BETWEEN_MAPS = """
import warnings
import IPython  # (as a notebook's kernel has it: it makes its own completer warning an error)
from hardy import DiskCache, Engine, Pipeline, node

calls = []

@node(output_name="y")
def double(x):
    calls.append(x)
    return 2 * x

p = Pipeline([double], engine=Engine(map_executor="sequential"), cache=DiskCache(CACHE))
p.map(inputs={"x": [1, 2]}, map_over="x")
warnings.filterwarnings("ignore", category=ResourceWarning)  # (as a library adds its own, imported next)
import numpy, pandas, sklearn  # noqa: E401,F401
p.map(inputs={"x": [1, 2]}, map_over="x")  # (found: nothing that decides a warning raises has changed)
warnings.filterwarnings("error", category=UserWarning)  # (the user's own: keyed, with what decides it)
p.map(inputs={"x": [1, 2]}, map_over="x")
warnings.filterwarnings("ignore", category=UserWarning, message="x")  # (decides ahead of it: keyed)
p.map(inputs={"x": [1, 2]}, map_over="x")
print(calls)
"""


def test_filters_that_cannot_change_which_warnings_raise_leave_keys_alone(tmp_path):
    """IPython (a notebook's kernel, or a library importing it) makes its own completer warning an
    error; every filter ahead of it was keyed, so each library imported next (numpy, pandas,
    sklearn put their filters first) moved every key: a notebook recomputed its cached items after
    each new import. Only filters on a category overlapping an error filter's are keyed now."""
    body = IMPORTS_BETWEEN_MAPS.replace("CACHE", repr(str(tmp_path / "cache")))
    assert script(tmp_path, body) == ["[1, 2, 1, 2, 1, 2]"]


class LibWarning(Warning):  # (at module level: a category a process finds by its module and name)
    pass


class LibPending(PendingDeprecationWarning, LibWarning):  # loaded: what makes the two overlap
    pass


def test_a_filter_on_a_category_sharing_a_subclass_with_an_error_filters_is_keyed():
    """`ignore::PendingDeprecationWarning` ahead of `error::AstropyWarning` decides whether an
    `AstropyPendingDeprecationWarning` (a subclass of both) raises: it was left out of the key."""
    import warnings

    from hardy.shipping import context

    def keyed() -> list[tuple[object, ...]]:
        return context._error_filters(tuple((a, m, context._named(c), mod, n) for a, m, c, mod, n in warnings.filters))

    with warnings.catch_warnings():
        warnings.resetwarnings()
        warnings.filterwarnings("error", category=LibWarning)
        alone = keyed()
        warnings.filterwarnings("ignore", category=PendingDeprecationWarning)
        assert keyed() != alone
