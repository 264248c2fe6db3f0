"""`python -m hardy.replay_item REPORT N [DEADLINE [--wait]]`: one kept item, run in this process.

What `hardy replay --gdb` and `--py-spy` start under those tools (`cli/replay.py`; not under
`hardy.cli`, whose command-line libraries would be most of what py-spy samples): a fresh
process with the worker environment (the thread caps, the engine's `preload` modules and
`preload_libs`, faulthandler and hardy's native handler on stderr) that runs the item's nodes in
its main thread, so that gdb stops where the node crashes and py-spy samples the node itself.
Past a node's timeout (or DEADLINE seconds, `--timeout`), the main thread gets SIGINT: gdb stops there and prints
the hung stack; without gdb, Python raises KeyboardInterrupt in the node if it runs bytecode, and
one second later the process writes every thread's Python stack and exits with code 124.
`--wait`: read a line from stdin before running the item (the caller attaches py-spy first).
"""

from __future__ import annotations

import faulthandler
import importlib
import os
import signal
import sys
import threading
import time
import traceback

TIMED_OUT = 124


_posted = [0.0]  # the monotonic time by which the running node must end (0: none), as workers post it


def _post(t: float) -> float:
    before, _posted[0] = _posted[0], t
    return before


_stopped: list[str] = []  # why the watchdog stopped the item, once it has


def _watchdog(overall: float) -> None:
    """Stops the item past its node's timeout (posted as in a worker: `crash.containment.mark_contained`) or
    past `overall` seconds from now (0: no such limit)."""
    main = threading.main_thread().ident
    assert main is not None
    end = time.monotonic() + overall if overall > 0 else 0.0

    def watch() -> None:
        while True:
            time.sleep(0.05)
            now = time.monotonic()
            if 0 < _posted[0] < now or 0 < end < now:
                break
        why = "its node's timeout" if 0 < _posted[0] < now else f"--timeout {overall:g} s"
        _stopped.append(why)  # (the outcome, said here: the KeyboardInterrupt below is only how)
        print(f"outcome: ran past {why}: SIGINT to the main thread", flush=True)
        signal.pthread_kill(main, signal.SIGINT)
        time.sleep(1.0)
        faulthandler.dump_traceback(all_threads=True)
        os._exit(TIMED_OUT)
    threading.Thread(target=watch, name="hardy-replay-deadline", daemon=True).start()


def main(argv: list[str]) -> int:
    from .crash import handler
    from .crash.containment import mark_contained
    from .crash.kept import load
    from .engine import Engine
    from .errors import ReplayError
    from .workers.launch import worker_environment
    report, item = argv[0], int(argv[1])
    deadline = float(argv[2]) if len(argv) > 2 else 0.0
    wait = argv[3:] == ["--wait"]
    os.environ.update(worker_environment(1))
    faulthandler.enable(all_threads=True)
    handler.install(2)  # in front of faulthandler: the native frames first, on stderr
    try:
        kept = load(report, item)
    except ReplayError as exc:
        print(f"hardy replay: {exc}", file=sys.stderr)
        return 2
    pipeline, inputs = kept["pipeline"], kept["inputs"]
    options = getattr(pipeline.engine, "process_options", {})
    for module in options.get("preload", ()):
        importlib.import_module(module)
    if options.get("preload_libs"):
        from .native.libs import preload
        libs = options["preload_libs"]
        preload(packages=[p for p in libs if not os.path.isdir(p)], paths=[p for p in libs if os.path.isdir(p)])
    print(f"item {item} of pipeline {pipeline.name!r}, run in one fresh process (pid {os.getpid()}), its nodes in "
          "the main thread", flush=True)
    if wait:  # until the caller's profiler is attached
        sys.stdin.readline()
    mark_contained(_post)  # as in a worker: node timeouts are posted, here to the watchdog
    _watchdog(deadline)
    try:
        pipeline.run(inputs=inputs, engine=Engine(map_executor="sequential"))
    except BaseException as exc:  # KeyboardInterrupt from the deadline too: the outcome, then its stack
        from .tracebacks import own_frames
        cause = exc.__cause__ or exc
        if not _stopped:  # (past a deadline, the watchdog said the outcome; this is where the node was)
            print(f"outcome: {type(cause).__name__}: {cause}", flush=True)
        traceback.print_exception(type(cause), cause, own_frames(cause.__traceback__))  # (the user's frames)
        return 1
    print("outcome: ok", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
