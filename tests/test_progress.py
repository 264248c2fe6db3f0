"""The progress bar where users see it: a real pseudo-terminal (nested maps as indented rows, cache
hits and failures counted) and a real Jupyter kernel (no ipywidgets, no warning, a bar updated in
place)."""

from __future__ import annotations

import os
import pty
import re
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent("""
    import sys, time
    from hardy import DiskCache, Engine, Pipeline, node

    @node(output_name="y")
    def slow(x: int) -> int:
        time.sleep(0.05)
        if x == 2:
            raise ValueError("two")
        return x

    here = Engine(map_executor="sequential")  # nested bars are drawn by the process that runs the nested map
    inner = Pipeline([slow], name="inner-items")
    @node(output_name="n")
    def count(ys: list) -> int:
        return len(ys)

    outer = Pipeline([inner.as_node(name="each", input_mapping={"xs": "x"}, output_mapping={"y": "ys"},
                                    map_over="xs", on_error="continue"), count], name="outer-docs", engine=here)
    outer.map(inputs={"xs": [[2, 0, 1, 3, 4, 5]] * 3}, map_over="xs")
    cached = Pipeline([slow], name="warm", cache=DiskCache(sys.argv[1]), engine=here)
    for _ in range(2):
        cached.map(inputs={"x": [0, 1, 2, 3, 4, 5]}, map_over="x", on_error="continue")
    list(Pipeline([slow], name="unknown-length", engine=here).imap(inputs={"x": (x for x in (0, 1, 3))}, map_over="x"))
    with Engine(map_executor="process", workers=2) as engine:  # hits made in worker processes
        workers = Pipeline([slow], name="warm-workers", cache=DiskCache(sys.argv[1]), engine=engine)
        workers.map(inputs={"x": [0, 1, 2, 3, 4, 5]}, map_over="x", on_error="continue")

    @node(output_name="y", batch_size=4)
    def pairs(x: list) -> list:
        time.sleep(0.05)
        return x
    for name, where in (("batched-here", here), ("batched-workers", Engine(map_executor="process", workers=2))):
        Pipeline([pairs], name=name, engine=where).map(inputs={"x": list(range(10))}, map_over="x")
""")


def _read_terminal(main: int) -> bytes:
    """All a child wrote to its terminal, `main` being our end of it (closed once read)."""
    received = b""
    while True:
        try:
            chunk = os.read(main, 65536)
        except OSError:  # the child closed the terminal
            break
        if not chunk:
            break
        received += chunk
    os.close(main)
    return received


def _in_terminal(tmp_path, code: str) -> str:
    """Runs `code` with stderr on a real pseudo-terminal; returns what the terminal received."""
    main, child = pty.openpty()
    env = {**os.environ, "COLUMNS": "150", "TERM": "xterm"}
    proc = subprocess.Popen([sys.executable, "-c", code, str(tmp_path / "cache")], stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=child, env=env)
    os.close(child)
    received = _read_terminal(main)
    assert proc.wait(timeout=120) == 0, received.decode(errors="replace")[-2000:]
    text = re.sub(r"\x1b\[[0-9;]*m", "", received.decode(errors="replace"))  # colours
    return re.sub(r"\x1b\[[0-9;?]*[A-Za-z]|\r", "\n", text)  # cursor moves: each redraw on its own lines


def test_terminal_bar_nests_maps_and_counts_cache_hits_and_failures(tmp_path):
    screen = _in_terminal(tmp_path, SCRIPT)
    lines = [ln for ln in screen.splitlines() if ln.strip()]
    assert any(ln.startswith("outer-docs") for ln in lines)
    nested = [ln for ln in lines if ln.startswith("  inner-items")]
    assert nested and any("1 failed" in ln for ln in nested), screen[-3000:]
    warm = [ln for ln in lines if ln.startswith("warm")]
    assert any("6/6" in ln and "1 failed" in ln and "5 cache hits" in ln for ln in warm), warm[-5:]
    streamed = [ln for ln in lines if ln.startswith("unknown-length")]
    assert streamed and not any("ETA" in ln for ln in streamed), streamed[-3:]  # no estimate to give
    in_workers = [ln for ln in lines if ln.startswith("warm-workers")]
    assert any("6/6" in ln and "1 failed" in ln and "5 cache hits" in ln for ln in in_workers), in_workers[-5:]
    for name in ("batched-here", "batched-workers"):  # each batched node's calls: how many, mean size and time
        batched = [ln for ln in lines if ln.startswith(name)]
        assert any("10/10" in ln and re.search(r"pairs: 3 batches of 3\.3, \d+\.\d ms each", ln) for ln in batched), \
            batched[-3:]


@pytest.mark.slow  # a Jupyter kernel
def test_notebook_bar_without_ipywidgets_or_warnings(tmp_path):
    jupyter_client = pytest.importorskip("jupyter_client", reason="needs jupyter_client and ipykernel")
    pytest.importorskip("ipykernel")
    assert __import__("importlib").util.find_spec("ipywidgets") is None, "the point is to work without it"
    km = jupyter_client.KernelManager(kernel_name="python3")
    km.kernel_spec  # noqa: B018 - fails early where no python3 kernel is installed
    km.start_kernel(env={**os.environ}, cwd=str(tmp_path))
    client = km.client()
    client.start_channels()
    try:
        client.wait_for_ready(timeout=60)
        code = SCRIPT.replace("sys.argv[1]", repr(str(tmp_path / "cache"))).replace(
            'outer.map(inputs={"xs": [[2, 0, 1, 3, 4, 5]] * 3}, map_over="xs")', "")
        messages = []
        client.execute(code)
        while True:
            msg = client.get_iopub_msg(timeout=60)
            messages.append(msg)
            if msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
                break
    finally:
        client.stop_channels()
        km.shutdown_kernel(now=True)
    shown = [m["content"]["data"]["text/html"] for m in messages
             if m["msg_type"] in ("display_data", "update_display_data")]
    streams = "".join(m["content"]["text"] for m in messages if m["msg_type"] == "stream")
    errors = [m["content"] for m in messages if m["msg_type"] == "error"]
    assert not errors and "ipywidgets" not in streams and "Warning" not in streams, (errors, streams)
    assert any("<progress" in h and "6/6" in h and "1 failed" in h and "5 cache hits" in h for h in shown), shown[-3:]


LOGS = textwrap.dedent("""
    import logging, sys, time
    from hardy import Engine, Pipeline, node
    logging.basicConfig(level=logging.INFO, format="LOG %(message)s")  # its handler keeps today's sys.stderr

    @node(output_name="y")
    def f(x: int) -> int:
        time.sleep(0.15)  # the bar redraws between items
        logging.getLogger("nodes").info("node logged %s", x)
        return x

    Pipeline([f], engine=Engine(map_executor=sys.argv[1], workers=1)).map(inputs={"x": list(range(6))}, map_over="x")
    logging.getLogger("nodes").info("after the map")
""")


def _screen(raw: bytes) -> list[str]:
    """The rows a terminal shows after `raw`, as far as rich's bar and plain lines need: text,
    carriage return, line feed, erase line, cursor up (colours and the cursor's visibility dropped)."""
    rows: list[list[str]] = [[]]
    row = col = 0
    for token in re.findall(r"\x1b\[[0-9;?]*[A-Za-z]|\r|\n|[^\x1b\r\n]", raw.decode(errors="replace")):
        if token == "\r":
            col = 0
        elif token == "\n":
            row += 1
            rows += [[] for _ in range(row + 1 - len(rows))]
        elif token == "\x1b[2K":
            rows[row] = []
        elif token.startswith("\x1b[") and token.endswith("A"):
            row = max(0, row - int(token[2:-1] or 1))
        elif not token.startswith("\x1b"):
            line = rows[row]
            line += [" "] * (col + 1 - len(line))
            line[col] = token
            col += 1
    return ["".join(r).rstrip() for r in rows]


@pytest.mark.parametrize("executor", ["sequential", "process"])
def test_log_lines_appear_whole_above_the_bar(tmp_path, executor):
    """`logging.basicConfig` writes to the stream it found, past rich's redirection: each log line
    (a node's in this process, or a worker's, handled by this process's loggers) was glued to a
    stale frame of the bar ("pipeline ━━╸━ 1/6 ... 3 items/sLOG node logged 1")."""
    main, child = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-c", LOGS, executor], stdin=subprocess.DEVNULL, stdout=child,
                            stderr=child, env={**os.environ, "COLUMNS": "120", "TERM": "xterm"}, cwd=tmp_path)
    os.close(child)
    raw = _read_terminal(main)
    assert proc.wait(timeout=120) == 0, raw.decode(errors="replace")[-2000:]
    rows = [row for row in _screen(raw) if row]
    logged = [row for row in rows if "LOG" in row]
    assert logged == [f"LOG node logged {x}" for x in range(6)] + ["LOG after the map"], rows
    bars = [row for row in rows if row.startswith("pipeline")]
    assert len(bars) == 1 and "6/6" in bars[0] and rows.index(bars[0]) == len(rows) - 2, rows  # one bar, below
