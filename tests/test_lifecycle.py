"""Worker processes and fork servers: started side by side, never outliving their parent, never
re-running the user's script, reachable by nobody else. Real processes, real signals, real users.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
import warnings
from pathlib import Path

import psutil
import pytest

from conftest import Unloadable
from hardy import Engine, NodeCrashed, NodeTimeout, Pipeline, node
from hardy.errors import WorkerStartError
from hardy.workers.launch import SERVER_TAG

SRC = str(Path(__file__).resolve().parents[1] / "src")
GONE_WITHIN = 20  # seconds: a generous bound for "every process has ended", not a timing claim


def _gone(pids: list[int]) -> list[int]:
    """Wait until none of `pids` runs (a zombie no one reaps counts as ended); those still running."""
    deadline = time.monotonic() + GONE_WITHIN
    while True:
        alive = []
        for pid in pids:
            try:
                if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                    alive.append(pid)
            except psutil.NoSuchProcess:
                pass
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.05)


def _carrying(name: str, value: str) -> list[int]:
    """The processes whose environment sets `name` to `value` (what a test's parent and everything
    it started inherit), found however far they moved from the test (new sessions, adopted by init)."""
    found = []
    for proc in psutil.process_iter():
        try:
            if proc.environ().get(name) == value:
                found.append(proc.pid)
        except (psutil.Error, OSError):  # ended meanwhile, or a kernel thread
            continue
    return found


def _none_carrying(name: str, value: str) -> list[int]:
    """`_carrying` until none is left or GONE_WITHIN has passed: those still there (a process
    forked after one look is seen at the next)."""
    deadline = time.monotonic() + GONE_WITHIN
    while (left := _gone(_carrying(name, value))) and time.monotonic() < deadline:
        time.sleep(0.05)
    return left


def _wait_for(path: Path) -> str:
    deadline = time.monotonic() + 60
    while not (path.exists() and path.read_text()):
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.02)
    return path.read_text()


def _script(tmp_path: Path, body: str) -> Path:
    script = tmp_path / "user_script.py"
    script.write_text(textwrap.dedent(body))
    return script


def _env(tmp_path: Path) -> dict[str, str]:
    tmp = tmp_path / "tmp"
    tmp.mkdir(exist_ok=True)
    return {**os.environ, "PYTHONPATH": SRC, "TMPDIR": str(tmp)}


# --- 1. fork servers side by side ----------------------------------------------------------------


@node(output_name="seen")
def what_worker_has(x: int) -> tuple[int, bool, bool, str]:
    return os.getpid(), "colorsys" in sys.modules, "wave" in sys.modules, os.environ["OMP_NUM_THREADS"]


def _seen(engine: Engine, n: int = 4) -> set:
    out = Pipeline(nodes=[what_worker_has], engine=engine).map(inputs={"x": list(range(n))}, map_over="x")
    return {o["seen"][1:] for o in out}


@pytest.mark.timeout(120)
def test_engines_with_different_preloads_and_caps_work_in_any_order_and_at_once(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)  # an earlier import may have set it
    cores = os.cpu_count() or 1
    a = Engine(map_executor="process", workers=1, preload=["colorsys"])
    b = Engine(map_executor="process", workers=2, preload=["wave"])
    want_a = {(True, False, str(max(1, cores)))}
    want_b = {(False, True, str(max(1, cores // 2)))}
    # the old hang: a second preload list while the first engine's workers live, then the first again
    assert _seen(a) == want_a
    assert _seen(b) == want_b
    assert _seen(a) == want_a
    servers = {a.process_pool()._launcher.process.pid, b.process_pool()._launcher.process.pid}
    assert len(servers) == 2
    seen: dict[str, set] = {}

    def use(name: str, engine: Engine) -> None:
        for _ in range(3):
            seen.setdefault(name, set()).update(_seen(engine, 8))

    threads = [threading.Thread(target=use, args=(n, e)) for n, e in (("a", a), ("b", b))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert seen == {"a": want_a, "b": want_b}
    # a third engine with a's settings shares a's server, which outlives a while it has workers
    c = Engine(map_executor="process", workers=1, preload=["colorsys"])
    assert _seen(c) == want_a
    assert c.process_pool()._launcher is a.process_pool()._launcher
    a.close()
    assert _seen(c) == want_a and _seen(b) == want_b
    c.close()
    b.close()
    assert _gone(sorted(servers)) == []  # each server closed with its last pool


@node(output_name="value")
def env_value(name: str) -> str | None:
    return os.environ.get(name)


def test_workers_get_the_environment_of_now_not_of_the_servers_start(monkeypatch):
    with Engine(map_executor="process", workers=1) as first:
        assert _seen(first, 1)
        monkeypatch.setenv("HARDY_SET_LATER", "yes")
        with Engine(map_executor="process", workers=1) as second:
            out = Pipeline(nodes=[env_value], engine=second).map(inputs={"name": ["HARDY_SET_LATER"]},
                                                                   map_over="name")
            assert second.process_pool()._launcher is first.process_pool()._launcher
    assert out == [{"value": "yes"}]


def test_a_preload_that_fails_is_named_and_other_engines_keep_working():
    with Engine(map_executor="process", workers=1, preload=["colorsys"]) as good:
        assert _seen(good, 1)
        with Engine(map_executor="process", workers=1, preload=["no_such_module_here"]) as bad:
            with pytest.raises(WorkerStartError, match="preload module 'no_such_module_here' failed to import"):
                _seen(bad, 1)
        assert _seen(good, 1)


# --- 2. nothing outlives the parent --------------------------------------------------------------

HANGING_PARENT = """
    import os, subprocess, sys, time
    from hardy import Engine, Pipeline, node

    @node(output_name="y", timeout=600)
    def hang(x, marker):
        if x == 1:
            child = subprocess.Popen(["sleep", "1000"])
            with open(marker + ".tmp", "w") as f:
                f.write(str(child.pid))
            os.rename(marker + ".tmp", marker)
            time.sleep(1000)
        return x

    engine = Engine(map_executor="process", workers=2)
    Pipeline(nodes=[hang], engine=engine).map(inputs={"x": [0, 1, 2, 3], "marker": sys.argv[1]}, map_over="x")
"""


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_killing_the_parent_ends_every_descendant(tmp_path, sig):
    script = _script(tmp_path, HANGING_PARENT)
    marker = tmp_path / "node-child"
    parent = subprocess.Popen([sys.executable, str(script), str(marker)], env=_env(tmp_path))
    try:
        node_child = int(_wait_for(marker))
        family = [p.pid for p in psutil.Process(parent.pid).children(recursive=True)]
        assert node_child in family and len(family) >= 4  # fork server, 2 workers, the node's child
        os.kill(parent.pid, sig)
        assert parent.wait(GONE_WITHIN) == -sig  # SIGTERM still ends it as SIGTERM does
        assert _gone(family) == []
        assert list((tmp_path / "tmp").iterdir()) == []  # nor any temporary file
    finally:
        parent.kill()


@node(output_name="y", timeout=1)
def start_child_then(x: int, how: str, marker: str) -> int:
    child = subprocess.Popen(["sleep", "1000"])
    Path(marker).write_text(str(child.pid))
    if how == "hang":
        time.sleep(1000)
    elif how == "crash":
        os.kill(os.getpid(), signal.SIGSEGV)
    return x


@pytest.mark.parametrize("how, error", [("hang", NodeTimeout), ("crash", NodeCrashed), ("return", None)])
def test_processes_a_node_starts_end_with_its_worker(tmp_path, how, error):
    marker = tmp_path / "child"
    with Engine(map_executor="process", workers=1) as engine:
        out = Pipeline(nodes=[start_child_then], engine=engine).map(
            inputs={"x": [5], "how": how, "marker": str(marker)}, map_over="x", on_error="continue")
        if error is None:
            assert out == [{"y": 5}]
        else:
            assert type(out[0].error) is error
    assert _gone([int(marker.read_text())]) == []  # killed with the worker, or at close


@pytest.mark.parametrize("start_method", ["spawn", "fork!"])
def test_every_start_method_kills_a_crashed_workers_children(tmp_path, start_method):
    marker = tmp_path / "child"
    with warnings.catch_warnings(), Engine(map_executor="process", workers=1, start_method=start_method) as engine:
        warnings.simplefilter("ignore")  # "fork!" warns when a hazard is present
        out = Pipeline(nodes=[start_child_then], engine=engine).map(
            inputs={"x": [5, 6], "how": "crash", "marker": str(marker)}, map_over="x", on_error="continue")
        assert [type(o.error) for o in out] == [NodeCrashed, NodeCrashed]
    assert _gone([int(marker.read_text())]) == []



@node(output_name="thread")
def forking_thread(x: int) -> str:
    if x % 2:
        os.kill(os.getpid(), signal.SIGSEGV)
    return threading.current_thread().name  # in a fork child: the thread that forked it


def test_a_pool_that_forks_this_process_forks_each_replacement_on_the_maps_thread():
    """A worker forked from a second thread holds, for good, any lock the map's thread held at
    that moment (a crash's diagnosis walked the loader's list then): so no spare-worker thread."""
    with warnings.catch_warnings(), Engine(map_executor="process", workers=1, start_method="fork!") as engine:
        warnings.simplefilter("ignore")
        out = Pipeline(nodes=[forking_thread], engine=engine).map(inputs={"x": list(range(6))}, map_over="x",
                                                                   on_error="continue")
    assert [o["thread"] for o in out[::2]] == [threading.current_thread().name] * 3
    assert [type(o.error) for o in out[1::2]] == [NodeCrashed] * 3

INTERRUPTED_PARENT = """
    import os, signal, sys, time
    from hardy import Engine, Pipeline, node

    @node(output_name="y")
    def slow(x, marker):
        if x == 1:
            open(marker, "w").write("1")
            time.sleep(1000)
        return x

    engine = Engine(map_executor="process", workers=2)
    p = Pipeline(nodes=[slow], engine=engine)
    try:
        p.map(inputs={"x": [0, 1, 2], "marker": sys.argv[1]}, map_over="x")
    except KeyboardInterrupt:
        print("interrupted", flush=True)
    print([o["y"] for o in p.map(inputs={"x": [5, 6], "marker": ""}, map_over="x")], flush=True)
"""


def test_ctrl_c_interrupts_the_map_and_the_pool_serves_the_next(tmp_path):
    script = _script(tmp_path, INTERRUPTED_PARENT)
    marker = tmp_path / "started"
    parent = subprocess.Popen([sys.executable, str(script), str(marker)], env=_env(tmp_path),
                              stdout=subprocess.PIPE, text=True)
    try:
        _wait_for(marker)
        family = [p.pid for p in psutil.Process(parent.pid).children(recursive=True)]
        os.kill(parent.pid, signal.SIGINT)
        out, _ = parent.communicate(timeout=60)
        assert out.splitlines() == ["interrupted", "[5, 6]"]
        assert parent.returncode == 0
        assert _gone(family) == []
    finally:
        parent.kill()


# --- 3. no __main__ guard ------------------------------------------------------------------------

UNGUARDED = """
    import os
    from hardy import Engine, Failed, Pipeline, node

    print("top level ran in", "parent" if os.environ.get("HARDY_TEST_PARENT") else "a worker!", flush=True)

    class Point:
        def __init__(self, x):
            self.x = x

    @node(output_name="q")
    def shift(p):
        if p.x == 2:
            import ctypes
            ctypes.string_at(0)
        return Point(p.x + 10)

    with Engine(map_executor="process", workers=2) as e:
        out = Pipeline(nodes=[shift], engine=e).map(inputs={"p": [Point(i) for i in range(4)]}, map_over="p",
                                                   on_error="continue")
    print([o.error.signal if isinstance(o, Failed) else (type(o["q"]) is Point, o["q"].x) for o in out])
"""
EXPECTED = ["top level ran in parent", "[(True, 10), (True, 11), 'SIGSEGV', (True, 13)]"]


def _run_user_code(tmp_path: Path, args: list[str], stdin: str | None = None) -> subprocess.CompletedProcess:
    env = {**_env(tmp_path), "HARDY_TEST_PARENT": "1"}
    return subprocess.run([sys.executable, *args], input=stdin, capture_output=True, text=True, env=env,
                          timeout=120, cwd=tmp_path)


@pytest.mark.parametrize("how", ["script", "stdin", "-c"])
def test_no_main_guard_is_needed(tmp_path, how):
    code = textwrap.dedent(UNGUARDED)
    if how == "script":
        run = _run_user_code(tmp_path, [str(_script(tmp_path, UNGUARDED))])
    elif how == "stdin":
        run = _run_user_code(tmp_path, ["-"], stdin=code)
    else:
        run = _run_user_code(tmp_path, ["-c", code])
    assert run.stdout.splitlines() == EXPECTED, run.stderr
    assert run.returncode == 0 and "Traceback" not in run.stderr, run.stderr


def test_a_node_from_a_module_loaded_by_path_runs_in_the_workers(tmp_path, monkeypatch):
    """A module loaded by its path, not found on sys.path: a worker loads it from the same file
    (docs/same-answer.md), and the map gives the caller's answer."""
    import importlib.util
    (tmp_path / "elsewhere.py").write_text("from hardy import node\n\n@node(output_name='y')\ndef f(x):\n    return x\n")
    spec = importlib.util.spec_from_file_location("elsewhere", tmp_path / "elsewhere.py")
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "elsewhere", module)  # loaded by path: not on sys.path
    spec.loader.exec_module(module)
    with Engine(map_executor="process", workers=1) as engine:
        out = Pipeline(nodes=[module.f], engine=engine).map(inputs={"x": [1, 2]}, map_over="x")
    assert out == [{"y": 1}, {"y": 2}]


@pytest.mark.slow  # an IPython session
def test_ipython_session_runs_a_process_map(tmp_path):
    pytest.importorskip("IPython")
    code = textwrap.dedent(UNGUARDED)
    run = _run_user_code(tmp_path, ["-m", "IPython", "--quick", "--no-banner", "--colors=NoColor", "-c", code])
    assert run.stdout.splitlines() == EXPECTED, run.stdout + run.stderr


# --- 4. results that cannot come back ------------------------------------------------------------


@node(output_name="out")
def odd_results(x: int):
    if x == 3:
        return threading.Lock()  # cannot be pickled at all
    if x == 5:
        return Unloadable()  # cannot be unpickled in the parent
    return x


def test_a_result_that_cannot_come_back_fails_only_its_item():
    with Engine(map_executor="process", workers=2) as engine:
        out = Pipeline(nodes=[odd_results], engine=engine).map(inputs={"x": list(range(8))}, map_over="x",
                                                                on_error="continue")
    assert [o["out"] for i, o in enumerate(out) if i not in (3, 5)] == [0, 1, 2, 4, 6, 7]
    lock, ghost = out[3].error, out[5].error
    assert (lock.node, lock.item, ghost.node, ghost.item) == ("odd_results", 3, "odd_results", 5)
    assert "_thread.lock" in str(lock) and "pickled back to the parent" in str(lock)
    assert "cannot be unpickled in this process" in str(ghost) and "_refuse_outside" in str(ghost)
    assert "only exists in the process that made it" in str(ghost)


# --- 5. isolated calls from many threads ---------------------------------------------------------


@node(output_name="met", isolate=True)
def rendezvous(folder: str, n: int) -> tuple[int, bool]:
    """Returns once `n` calls are inside workers at the same time (False if they never were)."""
    Path(folder, str(os.getpid())).touch()
    deadline = time.monotonic() + 60
    while len(os.listdir(folder)) < n and time.monotonic() < deadline:
        time.sleep(0.01)
    return os.getpid(), len(os.listdir(folder)) >= n


@pytest.mark.timeout(180)
def test_isolated_calls_from_many_threads_use_every_worker(tmp_path):
    n = 3
    with Engine(workers=n) as engine:
        p = Pipeline(nodes=[rendezvous], engine=engine)
        out: list = []
        threads = [threading.Thread(target=lambda: out.append(p.run(inputs={"folder": str(tmp_path), "n": n})))
                   for _ in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert [met for _, met in (o["met"] for o in out)] == [True] * n
    assert len({pid for pid, _ in (o["met"] for o in out)}) == n


# --- 9. nobody else gets in ----------------------------------------------------------------------


def _as_nobody(action) -> int:
    """Run `action` in a forked child that has dropped to uid/gid nobody; its exit code."""
    pid = os.fork()
    if pid == 0:
        try:
            os.setgroups([])  # none of root's groups either
            os.setgid(65534)
            os.setuid(65534)
            os._exit(action())
        except BaseException:
            os._exit(99)
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])


def _socket_inodes(pid: int) -> dict[int, int]:
    """The inodes of the sockets process `pid` holds, each with one descriptor number that holds it."""
    found = {}
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            found[int(link[8:-1])] = int(fd)
    return found


def _listening_unix_sockets() -> set[int]:
    """Inodes of the Unix sockets that accept connections, on the whole machine (/proc/net/unix)."""
    with open("/proc/net/unix") as f:
        rows = [line.split() for line in f.readlines()[1:]]
    return {int(row[6]) for row in rows if int(row[3], 16) & 0x10000}  # __SO_ACCEPTCON


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another user")
def test_another_user_cannot_reach_or_use_the_fork_server():
    """A server takes requests only on its standard input, one end of a socket pair with no name:
    there is no socket to connect to, in its folder or anywhere; each end is held by one process
    (not by the server's workers, nor by anyone else); and another user cannot read the server's
    descriptors to take its end."""
    with Engine(map_executor="process", workers=1) as engine:
        assert _seen(engine, 1)
        server = engine.process_pool()._launcher
        pid = server.process.pid
        held = _socket_inodes(pid)
        assert not set(held) & _listening_unix_sockets()
        ours, theirs = os.fstat(server._requests.sock.fileno()).st_ino, os.stat(f"/proc/{pid}/fd/0").st_ino
        holders: dict[int, set[int]] = {ours: set(), theirs: set()}
        for proc in psutil.process_iter():
            try:
                for inode in set(_socket_inodes(proc.pid)) & set(holders):
                    holders[inode].add(proc.pid)
            except OSError:  # (a process that ended meanwhile)
                continue
        assert holders == {ours: {os.getpid()}, theirs: {pid}}  # the worker does not hold the server's end

        def take_the_servers_end() -> int:
            try:
                os.listdir(f"/proc/{pid}/fd")
            except PermissionError:
                return 13
            return 0

        assert _as_nobody(take_the_servers_end) == 13
        assert _seen(engine, 4)  # and the server serves its own pool as before


@node(output_name="pid")
def worker_pid(x):
    return os.getpid()


def _new_children(pid: int, before: set[int], n: int) -> set[int]:
    """The children of `pid` not in `before`, once there are `n` (a server forks only after its
    imports; one this process's other engines share has their workers too)."""
    deadline = time.monotonic() + GONE_WITHIN
    while True:
        children = {c.pid for c in psutil.Process(pid).children()} - before
        if len(children) >= n or time.monotonic() > deadline:
            return children
        time.sleep(0.01)


def _asked_ahead(pool, n: int) -> tuple[int, set[int]]:
    """Ask `pool`'s fork server for `n` workers ahead: its pid, and the workers it forked for them."""
    pool.ask_ahead(0)  # (its server, started or shared: asked for nothing)
    server = pool._launcher.process.pid
    before = {c.pid for c in psutil.Process(server).children()}
    pool.ask_ahead(n)
    return server, _new_children(server, before, n)


def test_a_maps_first_workers_are_asked_for_together_and_those_never_set_up_leave_with_the_server():
    """The workers a map asks for ahead fork before the first one is set up, and are the ones that
    run its items; workers asked for but never set up hold nothing open: they end with the server."""
    with Engine(map_executor="process", workers=2) as engine:
        pool = engine.process_pool()
        server, asked = _asked_ahead(pool, 2)
        assert len(asked) == 2 and not any(pool.workers)  # forked before any worker was set up
        out = Pipeline([worker_pid], engine=engine).map(inputs={"x": list(range(8))}, map_over="x")
        assert {o["pid"] for o in out} <= asked
        assert {w.process.pid for w in pool.workers} == asked  # nothing else forked for it
    with Engine(map_executor="process", workers=3, preload=["calendar"]) as engine:  # a server of its own
        pool = engine.process_pool()
        server, asked = _asked_ahead(pool, 3)
        assert len(asked) == 3
        Pipeline([worker_pid], engine=engine).run(inputs={"x": 0})  # sets up one: two stay asked for
    assert _gone([server, *asked]) == []


def test_an_asked_worker_killed_while_it_waits_is_passed_over(tmp_path):
    """A worker asked for ahead and never set up may wait a long time (a map that used fewer);
    killed meanwhile (the OOM killer picks an idle process), the next worker start drops it."""
    with Engine(map_executor="process", workers=2, preload=["calendar"]) as engine:
        pool = engine.process_pool()
        server, asked = _asked_ahead(pool, 2)
        victim = min(asked)
        os.kill(victim, signal.SIGKILL)
        assert _gone([victim]) == []
        out = Pipeline([worker_pid], engine=engine).map(inputs={"x": list(range(6))}, map_over="x")
        assert victim not in {o["pid"] for o in out} and len(out) == 6


@node(output_name="y", batch_size=8)
def batched_sum(x: list) -> list:
    return [v + 1 for v in x]


def test_a_batched_map_asks_only_for_the_workers_its_groups_fill():
    with Engine(map_executor="process", workers=4) as engine:
        out = Pipeline([batched_sum], engine=engine).map(inputs={"x": list(range(10))}, map_over="x")
        pool = engine.process_pool()
        assert [o["y"] for o in out] == list(range(1, 11))
        assert len(pool._launcher._requests.asked) == 0  # 10 items in groups of 8: two workers asked for, two set up
        assert sum(w is not None for w in pool.workers) == 2


def test_a_fork_server_killed_while_it_is_asked_for_a_worker_is_replaced():
    """The server dies between the pool's "alive?" and its answer (killed from outside): the
    worker starts on a fresh server instead of the call failing. Made certain here: the server is
    stopped (SIGSTOP) before the request and killed while the parent waits for its answer."""
    with Engine(map_executor="process", workers=1, max_tasks_per_worker=1, preload=["calendar"]) as engine:
        p = Pipeline([worker_pid], engine=engine)
        p.run(inputs={"x": 0})
        server = engine.process_pool()._launcher.process.pid
        os.kill(server, signal.SIGSTOP)
        threading.Timer(0.5, os.kill, (server, signal.SIGKILL)).start()
        assert isinstance(p.run(inputs={"x": 1})["pid"], int)  # a worker of a fresh server (each run: a fresh worker)
        assert engine.process_pool()._launcher.process.pid != server


def _servers() -> set[int]:
    return {c.pid for c in psutil.Process().children() if c.cmdline()[-1:] == [SERVER_TAG]}


def test_a_first_map_of_no_items_gives_its_fork_server_back():
    """A first map starts its fork server before it knows it has nothing to run (`launch.warm`):
    the engine's close stops it, though no worker ever took it."""
    before = _servers()
    with Engine(map_executor="process", workers=2, preload=["calendar"]) as engine:
        assert Pipeline([worker_pid], engine=engine).map(inputs={"x": []}, map_over="x") == []
        started = _servers() - before
    assert len(started) == 1 and _gone(list(started)) == []


@pytest.mark.parametrize("hard", [False, True])
def test_a_pool_makes_room_for_its_workers_descriptors_or_says_it_cannot(tmp_path, hard):
    """40 workers hold about 240 of the parent's descriptors: past the soft limit the pool raises
    it, within the hard one; past the hard one, one error naming the limit and the fix, before
    any worker starts."""
    script = _script(tmp_path, f"""
        import resource
        from hardy import Engine, Pipeline, node
        limit = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
        resource.setrlimit(resource.RLIMIT_NOFILE, (48, 48 if {hard} else limit))
        @node(output_name="y")
        def f(x):
            return x
        try:
            print(len(Pipeline(nodes=[f], engine=Engine(workers=40)).map(inputs={{"x": list(range(40))}}, map_over="x")),
                  resource.getrlimit(resource.RLIMIT_NOFILE)[0] > 240)
        except Exception as exc:
            print(type(exc).__name__, exc)
    """)
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=_env(tmp_path), timeout=120)
    assert done.returncode == 0, done.stderr
    if hard:
        assert done.stdout.startswith("WorkerStartError 40 workers need about "), done.stdout
        assert "and its limit is 48 (ulimit -Hn): use fewer workers, or raise the limit" in done.stdout
    else:
        assert done.stdout.strip() == "40 True"


def test_a_preload_module_is_found_as_the_script_finds_it(tmp_path):
    """A script that puts its own folder on sys.path and preloads a module from there: the server
    imports it with the script's sys.path, as a worker imports the script's modules."""
    mods = tmp_path / "mods"
    mods.mkdir()
    (mods / "hardy_own_preload.py").write_text("import os\nLOADED_IN = os.getpid()\n")
    script = _script(tmp_path, f"""
        import os, sys
        sys.path.insert(0, {str(mods)!r})
        from hardy import Engine, Pipeline, node
        @node(output_name="y")
        def where(x):
            import hardy_own_preload
            return hardy_own_preload.LOADED_IN != os.getpid()  # imported before this worker forked
        with Engine(workers=1, preload=["hardy_own_preload"]) as engine:
            print(Pipeline(nodes=[where], engine=engine).map(inputs={{"x": [0]}}, map_over="x"))
    """)
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=_env(tmp_path), timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[{'y': True}]"


# --- 5. no orphan, no leftover, no silent hang, in the corners --------------------------------

THREAD_THEN_FORK_CHILD = """
    import multiprocessing, sys, threading, time
    from hardy import Engine, Pipeline, node

    @node(output_name="y")
    def hang_on_one(x):
        if x == 1:
            time.sleep(1000)
        return x

    def use():  # an engine used from a thread: its fork server cannot ask for PR_SET_PDEATHSIG
        engine = Engine(map_executor="process", workers=2)
        Pipeline(nodes=[hang_on_one], engine=engine).map(inputs={"x": [0, 1, 2]}, map_over="x")

    threading.Thread(target=use, daemon=True).start()
    time.sleep(2)
    child = multiprocessing.get_context("fork").Process(target=time.sleep, args=(1000,))
    child.start()
    print(child.pid, flush=True)
    time.sleep(1000)
"""


def test_an_engine_used_from_a_thread_leaves_no_orphan_beside_a_fork_child(tmp_path):
    parent = subprocess.Popen([sys.executable, "-"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                              env=_env(tmp_path))
    parent.stdin.write(textwrap.dedent(THREAD_THEN_FORK_CHILD))
    parent.stdin.close()
    descendants: list[psutil.Process] = []
    try:
        fork_child = int(parent.stdout.readline())
        descendants = psutil.Process(parent.pid).children(recursive=True)
        hardy = [p.pid for p in descendants if p.pid != fork_child]
        assert len(hardy) >= 3  # the fork server and its 2 workers, one of them hung
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait()
        assert _gone(hardy) == []  # while the fork child lives on
        assert psutil.Process(fork_child).is_running()
        assert list((tmp_path / "tmp").iterdir()) == []
    finally:
        parent.kill()
        # the script's processes, init's children once it died (the fork child would sleep on); not
        # this process's other children: its own fork servers, whose folders would be left behind
        for p in descendants:
            with contextlib.suppress(psutil.NoSuchProcess):
                p.kill()


FORKED_WORKERS = """
    import sys, time, warnings
    from hardy import Engine, Pipeline, node

    @node(output_name="y")
    def hang_on_one(x):
        if x == 1:
            print("hung", flush=True)
            time.sleep(1000)
        return x

    warnings.simplefilter("ignore")
    engine = Engine(map_executor="process", workers=2, start_method="fork!")
    Pipeline(nodes=[hang_on_one], engine=engine).map(inputs={"x": [0, 1, 2]}, map_over="x")
"""


def test_fork_start_method_leaves_no_file_when_the_parent_is_killed(tmp_path):
    parent = subprocess.Popen([sys.executable, "-"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                              env=_env(tmp_path))
    parent.stdin.write(textwrap.dedent(FORKED_WORKERS))
    parent.stdin.close()
    try:
        assert parent.stdout.readline().strip() == "hung"
        workers = [p.pid for p in psutil.Process(parent.pid).children(recursive=True)]
        assert len(workers) == 2
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait()
        assert _gone(workers) == []
        assert list((tmp_path / "tmp").iterdir()) == []  # status words and crash records are memfds
    finally:
        parent.kill()


def test_a_fork_server_that_never_gets_its_configuration_ends(tmp_path):
    """The parent killed between starting its server and writing its configuration."""
    from hardy.workers.launch import SERVER_BOOT
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    server = subprocess.Popen([sys.executable, "-c", SERVER_BOOT, SERVER_TAG], stdin=theirs, env=_env(tmp_path))
    theirs.close()
    ours.close()  # as the parent's death closes it
    assert server.wait(GONE_WITHIN) == 0


@pytest.mark.slow  # SIGTERM at twelve moments of a server's start
def test_sigterm_while_the_server_starts_leaves_nothing(tmp_path):
    """A server that finds its parent gone before it could ask for the parent's death signal
    leaves through its clean-up, not a bare exit that skipped it: no process and no file stays."""
    script = _script(tmp_path, """
        from hardy import Engine, Pipeline, node
        @node(output_name="y")
        def f(x):
            return x
        engine = Engine(map_executor="process", workers=1)
        print("mapping", flush=True)
        Pipeline(nodes=[f], engine=engine).map(inputs={"x": [0, 1]}, map_over="x")
    """)
    for step in range(12):  # SIGTERM at 0..0.22 s: before the server exists, while it imports, once it serves
        env = {**_env(tmp_path), "HARDY_TEST_STEP": f"{tmp_path}:{step}"}
        parent = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, env=env)
        parent.stdout.readline()
        assert parent.pid in _carrying("HARDY_TEST_STEP", env["HARDY_TEST_STEP"])  # (environments are readable here)
        time.sleep(step * 0.02)
        parent.terminate()
        parent.wait(GONE_WITHIN)
        assert _none_carrying("HARDY_TEST_STEP", env["HARDY_TEST_STEP"]) == []
        assert list((tmp_path / "tmp").iterdir()) == []


@pytest.mark.parametrize("workers, items, limit", [
    pytest.param(1, 2, 15, marks=pytest.mark.slow),  # waits out its preload timeout
    # 300 probe chunks of 4, more requests than the server's queue holds (about 280): asking ahead
    # stops short of filling it, rather than waiting for ever to ask
    (300, 1200, 3),
])
def test_a_preload_whose_import_blocks_fails_the_map_naming_it(tmp_path, workers, items, limit):
    (tmp_path / "hardy_blocking_mod.py").write_text("import time\ntime.sleep(1000)\n")
    script = _script(tmp_path, f"""
        from hardy import Engine, Pipeline, node
        @node(output_name="y")
        def f(x):
            return x
        try:
            Pipeline(nodes=[f], engine=Engine(map_executor="process", workers={workers},
                                              preload=["hardy_blocking_mod"])).map(
                inputs={{"x": list(range({items}))}}, map_over="x")
        except Exception as exc:
            print(type(exc).__name__, exc)
        print(Pipeline(nodes=[f], engine=Engine(map_executor="process", workers=1)).map(inputs={{"x": [2]}}, map_over="x"))
    """)
    env = {**_env(tmp_path), "PYTHONPATH": os.pathsep.join([SRC, str(tmp_path)]), "HARDY_PRELOAD_TIMEOUT": str(limit)}
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    first, second = done.stdout.strip().splitlines()
    assert first.startswith(
        f"WorkerStartError preload module 'hardy_blocking_mod' did not finish importing within {limit} s")
    assert "HARDY_PRELOAD_TIMEOUT" in first
    assert second == "[{'y': 2}]"  # the next engine is not held up
    assert "importing preload module 'hardy_blocking_mod'" in done.stderr  # the warning came first
    assert list((tmp_path / "tmp").iterdir()) == []


LEAKY_TESTS = """
import os, subprocess, sys, tempfile, time

def test_that_leaves_a_process_in_a_session_of_its_own():
    subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)

def test_that_leaves_a_folder():
    tempfile.mkdtemp(prefix="hardy-leftover-")

def test_that_leaves_nothing():
    subprocess.run([sys.executable, "-c", "pass"], check=True)
"""


@pytest.mark.slow  # a pytest run of its own, which waits out the suite's grace for what a test left
@pytest.mark.parametrize("which, fails", [("process", True), ("folder", True), ("nothing", False)])
def test_the_suite_fails_when_a_test_leaves_a_process_or_a_folder(tmp_path, which, fails):
    """The session fixture of tests/conftest.py, on a suite of its own run by pytest."""
    (tmp_path / "conftest.py").write_text((Path(__file__).parent / "conftest.py").read_text())
    (tmp_path / "test_leaky.py").write_text(textwrap.dedent(LEAKY_TESTS))
    env = {k: v for k, v in os.environ.items() if k != "HARDY_TEST_RUN"}  # a run of its own, with its own mark
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_leaky.py", "-k", which],
                         cwd=tmp_path, capture_output=True, text=True, timeout=120, env=env)
    if fails:
        assert run.returncode != 0 and "the tests left" in run.stdout, run.stdout
        said = run.stdout.split("the tests left", 1)[1]
        assert ("time.sleep(600)" in said) if which == "process" else ("hardy-leftover-" in said)
    else:
        assert run.returncode == 0, run.stdout


KILLED_SERVER = """
    import os, signal, tempfile, time
    import psutil
    from hardy import Engine, Pipeline, node

    @node(output_name="y")
    def twice(x):
        return 2 * x

    p = Pipeline([twice])
    first = Engine(workers=1)  # open until the process ends, as a pipeline's default engine is
    p.map(inputs={"x": [1]}, map_over="x", engine=first)
    [server] = [c for c in psutil.Process().children() if c.cmdline()[-1:] == ["hardy-fork-server"]]
    server.kill()  # killed from outside (the OOM killer, a kill -9): no clean-up of its own
    server.wait()
    with Engine(workers=1) as engine:  # the same settings: a new server in its place
        print(p.map(inputs={"x": [2]}, map_over="x", engine=engine))
    from hardy.workers import launch
    launch._stop_everything()  # what the process stops as it exits
    print(os.listdir(tempfile.gettempdir()))
"""


def test_a_fork_server_killed_from_outside_is_replaced_and_leaves_nothing(tmp_path):
    run = subprocess.run([sys.executable, "-"], input=textwrap.dedent(KILLED_SERVER), capture_output=True, text=True,
                         timeout=120, env=_env(tmp_path))
    assert run.returncode == 0, run.stderr
    assert run.stdout.splitlines() == ["[{'y': 4}]", "[]"], run.stdout


HOLDS_A_SERVER = """
    import sys
    import psutil
    from hardy import Engine, Pipeline, node

    @node(output_name="y")
    def twice(x):
        return 2 * x

    engine = Engine(workers=1)
    p = Pipeline([twice], engine=engine)
    p.map(inputs={"x": [1]}, map_over="x")
    [server] = [c for c in psutil.Process().children() if c.cmdline()[-1:] == ["hardy-fork-server"]]
    print(server.pid, flush=True)
    sys.stdin.readline()  # until the test says: map again
    print(p.map(inputs={"x": [2]}, map_over="x"), flush=True)
"""


def test_a_server_killed_with_its_parent_leaves_nothing(tmp_path):
    """SIGKILL ends a fork server and its parent with no clean-up (a cluster's worker killed at
    shutdown, with the server it started): its workers follow it (their parent-death signal, or
    their pipe to the parent), and the server wrote nothing, while it served or after, for anyone
    to sweep."""
    held = subprocess.Popen([sys.executable, "-c", textwrap.dedent(HOLDS_A_SERVER)], env=_env(tmp_path), text=True,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        server = psutil.Process(int(held.stdout.readline()))
        workers = [c.pid for c in server.children()]
        assert workers
        assert list((tmp_path / "tmp").iterdir()) == []  # while it serves
        server.kill()
        held.kill()
        held.wait()
        assert _gone([server.pid, *workers]) == []
        assert list((tmp_path / "tmp").iterdir()) == []
    finally:
        held.kill()
        held.wait()


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None,
                    reason="needs root and unshare, to mount read-only temporary directories in a namespace")
def test_a_default_map_runs_where_no_temporary_directory_is_writable(tmp_path):
    """A full or read-only /tmp: every folder Python's `tempfile` would try (its variables unset,
    /tmp and /var/tmp mounted read-only, the working directory /proc) refuses a file, and a default
    map still runs: its fork server keeps no file, a worker's status words and crash record are
    memfds. (A server's folder in the temporary directory failed the map here.)"""
    import site

    import cloudpickle
    hidden = ("/tmp/", "/var/tmp/")  # (this process's sys.path: other tests put their folders there)
    needed = (SRC, sys.executable, sys.prefix, *site.getsitepackages(), os.path.dirname(cloudpickle.__file__))
    if any(p.startswith(hidden) for p in needed):
        pytest.skip("this checkout or this Python lies in a temporary directory, which the read-only mount would hide")
    mounts = " && ".join(f"mount -t tmpfs -o ro tmpfs {d}" for d in ("/tmp", "/var/tmp") if os.path.isdir(d))
    if subprocess.run(["unshare", "-m", "sh", "-c", mounts], capture_output=True).returncode:
        pytest.skip("no mount namespace or tmpfs mount here (root without CAP_SYS_ADMIN?)")
    env = {k: v for k, v in os.environ.items() if k not in ("TMPDIR", "TEMP", "TMP")}
    script = textwrap.dedent("""
        import tempfile
        from hardy import Pipeline, node
        try:
            tempfile.gettempdir()
        except FileNotFoundError:
            print("no temporary directory")
        @node(output_name="y")
        def twice(x):
            return 2 * x
        print(Pipeline([twice]).map(inputs={"x": [1, 2]}, map_over="x"))
    """)
    done = subprocess.run(["unshare", "-m", "sh", "-c", f"{mounts} && cd /proc && exec {sys.executable} -"],
                          input=script, env={**env, "PYTHONPATH": SRC}, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["no temporary directory", "[{'y': 2}, {'y': 4}]"], done.stdout


def test_a_preload_list_of_hundreds_of_modules_names_the_one_that_blocks(tmp_path):
    """The server keeps the name of the module it imports as one current note, not a message per
    module: after 300 that imported at once, the warning and the error name the 301st, which
    blocks (a queue of notes filled up after about 280, and named an innocent one)."""
    for k in range(300):
        (tmp_path / f"hardy_quick_{k}.py").write_text("")
    (tmp_path / "hardy_blocking_mod.py").write_text("import time\ntime.sleep(1000)\n")
    preload = [f"hardy_quick_{k}" for k in range(300)] + ["hardy_blocking_mod"]
    script = _script(tmp_path, f"""
        from hardy import Engine, Pipeline, node
        @node(output_name="y")
        def f(x):
            return x
        try:
            Pipeline(nodes=[f], engine=Engine(workers=1, preload={preload!r})).map(inputs={{"x": [1]}}, map_over="x")
        except Exception as exc:
            print(type(exc).__name__, exc)
    """)
    env = {**_env(tmp_path), "PYTHONPATH": os.pathsep.join([SRC, str(tmp_path)]), "HARDY_PRELOAD_TIMEOUT": "3"}
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("WorkerStartError preload module 'hardy_blocking_mod' did not finish importing"), \
        done.stdout
    assert "importing preload module 'hardy_blocking_mod'" in done.stderr


def test_asking_a_fork_server_whose_queue_is_full_never_waits():
    """`Requests.ahead` stops at a full queue (a server still importing its preload) rather than
    waiting for ever to ask: each request is sent without waiting, which `socket.send_fds` did
    not do before Python 3.13 (it dropped the flag); nothing reads this queue."""
    from hardy.workers.asking import Requests
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    ours.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)  # full after a few requests, not hundreds of descriptors
    requests, asked = Requests(ours), []

    def fill() -> None:
        with contextlib.suppress(BlockingIOError):
            while len(asked) < 10_000:
                asked.append(requests.one(socket.MSG_DONTWAIT))
        asked.append(None)  # full, said at once
    filling = threading.Thread(target=fill, daemon=True)
    filling.start()
    filling.join(GONE_WITHIN)
    waited = filling.is_alive()
    theirs.close()  # (a send that waits fails now)
    filling.join(GONE_WITHIN)
    for one in asked[:-1]:
        for end in one:
            end.close()
    ours.close()
    assert not waited and asked[-1] is None and len(asked) > 1


PLANTED = """
import os
with open({marker!r}, "a") as f:
    f.write(f"{{__name__}} planted by another user ran as uid {{os.getuid()}}\\n")
raise ImportError("planted")
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another user")
def test_the_fork_server_imports_nothing_from_a_shared_working_directory():
    """A user runs their own script (in a private folder) from a shared, sticky working directory
    (/tmp, a team's scratch folder), where another user left `cloudpickle.py` and `socket.py`. Their
    `python script.py` does not look there (its sys.path starts with the script's folder), and
    neither may the fork server that `python -c` starts: its first path entry is the working directory."""
    base = Path(tempfile.mkdtemp(prefix="hardy-shared-cwd-", dir="/tmp"))  # (one the other user can reach)
    try:
        _run_from_a_shared_folder(base)
    finally:
        shutil.rmtree(base)


def _run_from_a_shared_folder(base: Path) -> None:
    base.chmod(0o755)
    shared, home = base / "shared", base / "home"
    shared.mkdir()
    shared.chmod(0o1777)
    home.mkdir(mode=0o700)
    marker = base / "planted-ran"

    def plant() -> int:
        for name in ("cloudpickle", "socket", "selectors", "blake3"):
            (shared / f"{name}.py").write_text(PLANTED.format(marker=str(marker)))
        return 0

    assert _as_nobody(plant) == 0 and (shared / "socket.py").stat().st_uid == 65534
    (home / "pipe.py").write_text(textwrap.dedent("""
        from hardy import Pipeline, node

        @node(output_name="y")
        def double(x):
            return 2 * x

        print([r["y"] for r in Pipeline([double]).map(inputs={"x": [1, 2]}, map_over="x")])
    """))
    out = subprocess.run([sys.executable, str(home / "pipe.py")], cwd=shared, capture_output=True, text=True,
                         timeout=120, env={**os.environ, "PYTHONPATH": SRC})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[2, 4]"
    assert not marker.exists(), marker.read_text()


CLOSED_STDIO = """
import os, signal, sys
from hardy import Engine, Failed, Pipeline, node

@node(output_name="y")
def chatty(x):
    os.write(2, b"native lib: warming up\\n" * 20)  # what a C library's fprintf(stderr, ...) does
    if x == 2:
        os.kill(os.getpid(), signal.SIGSEGV)
    return [os.readlink(f"/proc/self/fd/{fd}") if os.path.lexists(f"/proc/self/fd/{fd}") else "closed"
            for fd in range(3)]

with open(sys.argv[1], "w") as said, Engine(workers=1, start_method=sys.argv[2] or None) as engine:
    for out in Pipeline([chatty], engine=engine).map(inputs={"x": [0, 1, 2, 3]}, map_over="x", on_error="continue"):
        print(str(out.error).partition("Python stack at the crash:")[2] if isinstance(out, Failed) else out["y"],
              file=said)
"""


@pytest.mark.parametrize("start_method", ["", "spawn", "fork!"])
@pytest.mark.parametrize("closed", [">&- 2>&-", "<&- >&- 2>&-"])
def test_a_script_started_with_its_standard_streams_closed_keeps_stderr_out_of_crash_records(
        tmp_path, start_method, closed):
    """A daemon's or a supervisor's script, its standard streams closed: each descriptor a worker
    receives would take the lowest free number, so its crash record was its stderr, and a node's
    (or a C library's) writes there showed as the stack of a later crash. Workers get /dev/null
    where the script's streams are closed, on every start method: the crash shows its stack."""
    script = _script(tmp_path, CLOSED_STDIO)
    said = tmp_path / "said.txt"
    done = subprocess.run(["bash", "-c", f"exec {sys.executable} {script} {said} '{start_method}' {closed}"],
                          env=_env(tmp_path), timeout=120)
    assert done.returncode == 0
    lines = said.read_text().split("\n", 3)
    assert lines[:2] == [str(["/dev/null"] * 3)] * 2, lines
    assert "native lib" not in lines[2] + lines[3], lines
    assert "line 9 in chatty" in lines[3], lines


LIMITED = """
import resource, subprocess, sys
from hardy import Engine, Pipeline, node

@node(output_name="y")
def square(x):
    return x * x

limit, room, method, workers = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3] or None, int(sys.argv[4])
resource.setrlimit(resource.RLIMIT_NPROC, (limit, limit))
engine = Engine(map_executor="process", workers=workers, start_method=method)
others = []
try:
    if room >= 0:  # the pool made, the user's other processes leave room for `room` more
        engine.process_pool()
        while True:
            try:
                others.append(subprocess.Popen(["sleep", "60"]))
            except BlockingIOError:
                break
        for p in others[:room]:
            p.kill()
            p.wait()
        del others[:room]
    print(sum(o["y"] for o in Pipeline([square], engine=engine).map(inputs={"x": list(range(20))}, map_over="x")))
except Exception as exc:
    print(f"{type(exc).__name__}: {exc}")
finally:
    for p in others:
        p.kill()
        p.wait()
"""


def _as_a_user_of_its_own(tmp_path: Path, script: str, *args: str) -> subprocess.CompletedProcess[str]:
    """`script` run as a uid no process uses (RLIMIT_NPROC counts a real uid's processes and threads,
    and never root's), with this interpreter reached through a bind mount of its prefix in a mount
    namespace of its own (a prefix under /root is root's only); asserts none of its processes is left."""
    import sysconfig
    if os.geteuid() != 0 or not (shutil.which("unshare") and shutil.which("setpriv")):
        pytest.skip("needs root, unshare and setpriv, to act as another user")
    uid = next(u for u in range(40000 + os.getpid() % 20000, 70000) if not _processes_of(u))
    work = Path(tempfile.mkdtemp(prefix="hardy-nproc-"))
    try:
        work.chmod(0o755)
        (work / "py").mkdir()
        (work / "home").mkdir()
        os.chown(work / "home", uid, uid)
        (work / "user.py").write_text(textwrap.dedent(script))
        (work / "user.py").chmod(0o644)
        prefix = sys.base_prefix
        python, site = (os.path.join(work, "py", os.path.relpath(p, prefix))
                        for p in (os.path.realpath(sys.executable), sysconfig.get_paths()["purelib"]))
        env = {"HOME": str(work / "home"), "TMPDIR": str(work / "home"), "PATH": "/usr/bin:/bin",
               "PYTHONPATH": f"{SRC}:{site}", "HARDY_NATIVE_HANDLER": "ctypes"}  # (a compiler's forks: not counted on)
        command = " ".join(["mount --bind", prefix, str(work / "py"), "&& exec setpriv", f"--reuid={uid}",
                            f"--regid={uid} --clear-groups", python, str(work / "user.py"), *(repr(a) for a in args)])
        done = subprocess.run(["unshare", "-m", "sh", "-c", command], capture_output=True, text=True, env=env,
                              cwd=work / "home", timeout=240)
        deadline = time.monotonic() + GONE_WITHIN
        while _processes_of(uid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _processes_of(uid) == [], "processes left"
        return done
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _processes_of(uid: int) -> list[int]:
    """The running processes (zombies aside) whose real uid is `uid`."""
    found = []
    for proc in psutil.process_iter(["uids", "status"]):
        if proc.info["uids"] and proc.info["uids"].real == uid and proc.info["status"] != psutil.STATUS_ZOMBIE:
            found.append(proc.pid)
    return found


@pytest.mark.slow  # a second user id
@pytest.mark.parametrize("limit, room, method, workers, said", [
    (5, -1, "", 2, r"2 workers need about 5 more processes and threads \(a fork server, and 2 for each worker\), and "
                   r"this user may run 5 processes and threads at once \(ulimit -u\), and runs \d+: use fewer "
                   r"workers, or raise the limit \(ulimit -u\)"),
    (6, 0, "", 1, r"a worker could not start: the fork server \(no preload\) could not fork a worker \(\[Errno 11\] "
                  r"Resource temporarily unavailable\): this user may run 6 processes and threads at once "
                  r"\(ulimit -u\), and runs \d+: use fewer workers \(Engine\(workers=\.\.\.\)\), or raise the limit "
                  r"\(ulimit -u\)"),
    (6, 1, "", 1, r"worker processes die while setting up, before reading any work \(3 in a row\): they run out of "
                  r"processes: this user may run 6 processes and threads at once \(ulimit -u\), and runs \d+: use "
                  r"fewer workers \(Engine\(workers=\.\.\.\)\), or raise the limit \(ulimit -u\)"),
    (6, 0, "spawn", 1, r"the fork server could not start: Resource temporarily unavailable: this user may run 6 "
                       r"processes and threads at once \(ulimit -u\), and runs \d+: use fewer workers"),
    (6, 0, "fork!", 1, r"a worker could not start: Resource temporarily unavailable: this user may run 6 processes "
                       r"and threads at once \(ulimit -u\), and runs \d+: use fewer workers"),
], ids=["before any worker", "the server's fork", "a worker's thread", "the server's start", "a fork of this process"])
def test_out_of_processes_says_so_and_leaves_nothing(tmp_path, limit, room, method, workers, said):
    """Past `ulimit -u` (RLIMIT_NPROC: every process and thread of a user), a fork or a thread's
    start fails with EAGAIN: one error names the limit and the fix, whichever start failed (the
    pool's estimate before any worker, a fork server's fork or its own start, a fork of this process,
    a worker's thread), with no second traceback at exit and no process left."""
    import re
    done = _as_a_user_of_its_own(tmp_path, LIMITED, str(limit), str(room), method, str(workers))
    assert done.returncode == 0 and "Traceback" not in done.stderr and "Exception ignored" not in done.stderr, \
        done.stderr
    assert re.fullmatch(f"WorkerStartError: {said}.*", done.stdout.strip()), done.stdout
    enough = _as_a_user_of_its_own(tmp_path, LIMITED, "64", "-1", method, str(workers))
    assert enough.stdout.strip() == "2470", enough.stdout + enough.stderr
