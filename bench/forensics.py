"""What native crash forensics cost: `python bench/forensics.py [--pyelftools-torch]`.

1. Naming a frame inside libtorch_cpu.so (the issue's figure: 530k symbols): hardy's table read
   (array slices of .symtab, one sort) the first time, then a cached lookup; the floor is the
   same lookup done by hand with pyelftools' symbol iterator, on a smaller library by default
   (libtorch_python.so; `--pyelftools-torch` runs it on libtorch_cpu too, ~30-60 s).
2. Worker start with the native handler vs without (HARDY_NATIVE_HANDLER=off), same run: the
   install call alone (what a worker forked from the fork server pays), and whole pool starts.
3. Hang stacks: from a node's timeout to the NodeTimeout in the caller, py-spy vs faulthandler,
   with torch loaded in the worker.
Targets: <= 1 s first, <= 10 ms cached; <= 1 ms more per worker start; <= 5 s from timeout.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import textwrap
import time

from hardy.forensics import stacks, symbols

TORCH_LIB = os.path.join(os.path.dirname(__import__("importlib.util").util.find_spec("torch").origin), "lib")


def _pyelftools_lookup(path: str, offset: int) -> tuple[str, float]:
    from elftools.elf.elffile import ELFFile
    start = time.perf_counter()
    best = ("", -1)
    with open(path, "rb") as f:
        for sym in ELFFile(f).get_section_by_name(".symtab").iter_symbols():
            v = sym["st_value"]
            if sym["st_info"]["type"] == "STT_FUNC" and best[1] < v <= offset:
                best = (sym.name, v)
    return best[0], time.perf_counter() - start


def symbolising(pyelftools_torch: bool) -> None:
    cpu = os.path.join(TORCH_LIB, "libtorch_cpu.so")
    small = os.path.join(TORCH_LIB, "libtorch_python.so")
    print("1. naming a frame (first: the table read and sorted; cached: one more lookup)")
    for path, offset in ((cpu, 0x6CE4B70), (small, 0x400000)):
        symbols._tables.clear()
        t = time.perf_counter()
        frame = symbols.symbolise(0x10000 + offset, 0x10000, path, "?", caller=False)
        first = time.perf_counter() - t
        cached = []
        for k in range(20):
            t = time.perf_counter()
            symbols.symbolise(0x10000 + offset + k, 0x10000, path, "?", caller=False)
            cached.append(time.perf_counter() - t)
        table = symbols.table(path)
        print(f"   {os.path.basename(path)}: {len(table.keys) if table else 0:,} functions; first {first:.3f} s, "
              f"cached {statistics.median(cached) * 1e3:.2f} ms -> {frame.function[:70]}")
        if path == small or pyelftools_torch:
            name, took = _pyelftools_lookup(path, offset)
            print(f"   pyelftools symbol loop, same library: {took:.2f} s ({took / first:.0f}x hardy's first lookup)"
                  f", found {symbols.demangle(name)[:50]!r}")


def worker_start() -> None:
    print("2. worker start with the native handler vs without")
    code = textwrap.dedent("""
        import os, sys, time
        from hardy.forensics import handler
        handler.prepare()  # as the fork server does once
        fd = os.open(os.devnull, os.O_WRONLY)
        times = []
        for _ in range(200):
            pid = os.fork()
            if pid == 0:
                t = time.perf_counter_ns()
                handler.install(fd)
                os.write(1, b"%d\\n" % (time.perf_counter_ns() - t))
                os._exit(0)
            os.waitpid(pid, 0)
    """)
    for mode in ("off", "auto", "ctypes"):
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             env={**os.environ, "HARDY_NATIVE_HANDLER": mode}).stdout.split()
        us = sorted(int(x) / 1e3 for x in out)
        label = {"off": "nothing installed (the floor)", "auto": "compiled handler", "ctypes": "ctypes fallback"}[mode]
        print(f"   install in a forked worker, {label}: "
              f"median {statistics.median(us):.1f} us, p95 {us[int(len(us) * 0.95)]:.1f} us")
    pool = textwrap.dedent("""
        import time
        from hardy import Engine, Pipeline, node

        @node(output_name="y")
        def one(x: int) -> int:
            return x

        with Engine(map_executor="process", workers=1, max_tasks_per_worker=1) as e:
            p = Pipeline(nodes=[one], engine=e)
            p.map(inputs={"x": [0, 1]}, map_over="x")  # the fork server started, the handler built
            t = time.perf_counter()
            p.map(inputs={"x": list(range(60))}, map_over="x")  # each item on a fresh worker
            print((time.perf_counter() - t) / 60)
    """)
    per: dict[str, list[float]] = {"off": [], "auto": []}
    for mode in ("off", "auto") * 3:  # alternated: the machine's load drifts
        out = subprocess.run([sys.executable, "-c", pool], capture_output=True, text=True,
                             env={**os.environ, "HARDY_NATIVE_HANDLER": mode})
        per[mode].append(float(out.stdout.strip().splitlines()[-1]) if out.returncode == 0 else float("nan"))
    off, on = statistics.median(per["off"]), statistics.median(per["auto"])
    print(f"   one item per fresh worker (start + item + exit), median of 3: without {off * 1e3:.2f} ms, "
          f"with {on * 1e3:.2f} ms ({(on - off) * 1e3:+.2f} ms; the spread of the runs: "
          f"{(max(per['off'] + per['auto']) - min(per['off'] + per['auto'])) * 1e3:.1f} ms)")


def hang_stacks() -> None:
    print("3. from a node's timeout to NodeTimeout, torch loaded in the worker")
    code = textwrap.dedent("""
        import time
        from hardy import Engine, Pipeline, node

        @node(output_name="y")
        def warm(x: int) -> int:
            import torch
            return int(torch.ones(4).sum()) + x

        @node(output_name="y", timeout=5)
        def stuck(x: int) -> int:
            time.sleep(60)
            return x

        with Engine(map_executor="process", workers=1) as e:
            Pipeline(nodes=[warm], engine=e).map(inputs={"x": [0]}, map_over="x")  # torch imported in the worker
            p = Pipeline(nodes=[stuck], engine=e)
            t = time.perf_counter()
            out = p.map(inputs={"x": [1]}, map_over="x", on_error="continue")
            print(f"{time.perf_counter() - t - 5:.2f}", out[0].error.stacks.splitlines()[0][:60])
    """)
    without = code.replace("import time\n", "import time\nfrom hardy.forensics import stacks\n"
                           "stacks.py_spy = lambda: None  # as if py-spy were not installed\n", 1)
    for label, script in (("py-spy", code), ("faulthandler", without)):
        out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
        line = out.stdout.strip().splitlines()[-1] if out.stdout.strip() else out.stderr[-300:]
        print(f"   {label}: {line.split(' ', 1)[0]} s after the timeout ({line.split(' ', 1)[-1]})")


if __name__ == "__main__":
    print(f"py-spy: {stacks.py_spy() or 'not installed'}")
    symbolising("--pyelftools-torch" in sys.argv)
    worker_start()
    hang_stacks()
