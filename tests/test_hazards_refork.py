"""start_method="fork": every later fork of a worker checks the fork hazards again.

The check at the pool's start cannot see a thread started after it: a replacement worker forked
then would inherit the lock that thread holds and hang on it until its node's timeout."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

SCRIPT = """
import ctypes, os, sys, threading, time
sys.path.insert(0, {folder!r})
import held
from hardy import Engine, Pipeline, node
from hardy.errors import HazardError

@node(output_name="s", timeout=5, retries=1)
def use(i: int) -> int:
    import held
    if i == 1 and os.environ.get("CRASH") == "1" and not os.path.exists({mark!r}):
        open({mark!r}, "w").close()
        ctypes.string_at(0)                      # a real SIGSEGV: the pool forks a replacement
    with held.LOCK:
        return i * 2

pipe = Pipeline(nodes=[use], engine=Engine(map_executor="process", start_method="fork", workers=1))
print("first", pipe.map(inputs={{"i": [0, 1]}}, map_over="i"))
def holder():
    with held.LOCK:
        time.sleep(60)
threading.Thread(target=holder, daemon=True).start()
time.sleep(0.1)
os.environ["CRASH"] = "1"
try:
    out = pipe.map(inputs={{"i": [0, 1, 2]}}, map_over="i", on_error="continue")
    print("no refusal", out)
except HazardError as exc:
    print("refused", type(exc).__name__, exc.results, sorted(exc.failures))
    print(exc)
"""


def test_a_replacement_fork_after_a_thread_took_a_lock_is_refused_keeping_the_results(tmp_path: Path) -> None:
    (tmp_path / "held.py").write_text("import threading\nLOCK = threading.Lock()\n")
    code = SCRIPT.format(folder=str(tmp_path), mark=str(tmp_path / "crashed"))
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=120, cwd=tmp_path)
    lines = proc.stdout.splitlines()
    assert lines[0] == "first [{'s': 0}, {'s': 2}]", proc.stdout + proc.stderr
    # item 0 ran on the first worker; item 1 crashed it, and its replacement was refused, not hung
    assert lines[1].startswith("refused ForkRefused [{'s': 0}, "), proc.stdout + proc.stderr
    assert "start_method='fork' refused for a new worker" in proc.stdout
    assert "1 Python thread(s) besides this one are running" in proc.stdout
    assert ".results" in proc.stdout


OWN_THREADS = """
import ctypes, os, sys, threading, time
from hardy import Engine, Pipeline, node
from hardy.errors import HazardError

@node(output_name="s", timeout=20)
def use(i: int) -> int:
    if i == 1 and not os.path.exists({mark!r}):
        open({mark!r}, "w").close()
        ctypes.string_at(0)                      # a real SIGSEGV: the pool forks a replacement
    return i * 2

def engine(**options):
    return Engine(map_executor="process", start_method="fork", workers=1, **options)

def fresh():
    if os.path.exists({mark!r}):
        os.remove({mark!r})

fresh()  # imap forks from its runner thread ("hardy-imap"), this one waiting: its first worker and the replacement
print("imap", list(Pipeline(nodes=[use], engine=engine()).imap(inputs={{"i": [0, 1, 2]}}, map_over="i",
                                                                 on_error="continue")))
fresh()  # the bar's threads run while every item's worker is forked (recycled after each item)
pipe = Pipeline(nodes=[use], engine=engine(max_tasks_per_worker=1))
print("progress", pipe.map(inputs={{"i": [0, 1, 2]}}, map_over="i", on_error="continue", progress=True))
fresh()  # a thread of the script's, started after the pool: an imap's fork is still refused
pipe = Pipeline(nodes=[use], engine=engine())
print("before", list(pipe.imap(inputs={{"i": [0]}}, map_over="i")))
stop = threading.Event()
threading.Thread(target=stop.wait, name="script-thread", daemon=True).start()
try:
    print("no refusal", list(pipe.imap(inputs={{"i": [0, 1, 2]}}, map_over="i", on_error="continue")))
except HazardError as exc:
    print("refused", type(exc).__name__, str(exc).splitlines()[1])
"""


def test_hardys_own_threads_do_not_refuse_a_fork_but_a_scripts_thread_still_does(tmp_path: Path) -> None:
    code = OWN_THREADS.format(mark=str(tmp_path / "crashed"))
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=300, cwd=tmp_path)
    lines = [line for line in proc.stdout.splitlines() if line.split(" ")[0] in
             ("imap", "progress", "before", "refused", "no")]
    said = proc.stdout + proc.stderr
    assert len(lines) == 4, said
    assert lines[0].startswith("imap [{'s': 0}, Failed(NodeCrashed(") and lines[0].endswith("{'s': 4}]"), said
    assert "SIGSEGV" in lines[0], said
    assert lines[1].startswith("progress [{'s': 0}, Failed(NodeCrashed(") and lines[1].endswith("{'s': 4}]"), said
    assert lines[2] == "before [{'s': 0}]", said
    assert lines[3].startswith("refused ForkRefused   - threads: 1 Python thread(s) besides this one are running "
                               "('script-thread'; hardy's own are not counted)"), said
