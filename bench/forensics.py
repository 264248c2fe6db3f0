"""What native crash forensics cost: `python bench/forensics.py [--pyelftools-torch] [--replays]`
(`--replays`: part 4 only).

1. Naming a frame inside libtorch_cpu.so (the issue's figure: 530k symbols): hardy's table read
   (array slices of .symtab, one sort) the first time, then a cached lookup; the floor is the
   same lookup done by hand with pyelftools' symbol iterator, on a smaller library by default
   (libtorch_python.so; `--pyelftools-torch` runs it on libtorch_cpu too, ~30-60 s).
2. Worker start with the native handler vs without (HARDY_NATIVE_HANDLER=off), same run: the
   install call alone (what a worker forked from the fork server pays), and whole pool starts.
3. Hang stacks: from a node's timeout to the NodeTimeout in the caller, py-spy vs faulthandler,
   with torch loaded in the worker.
4. Kept inputs and replays: a map of 2,000 items, 20 of which fail, with and without
   `keep_failed_inputs=True` (the report and 20 signed inputs written) against the plain loop;
   `hardy repeat`'s preloaded handler per run (`python -c pass`, with and without); the wall time
   of `hardy replay --item N` in a fresh worker, `--gdb` and `--py-spy` on a crash in a gcc-built library.
Targets: <= 1 s first, <= 10 ms cached; <= 1 ms more per worker start; <= 5 s from timeout.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import textwrap
import time

from hardy.crash import stacks, symbols

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
        from hardy.crash import handler
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
    without = code.replace("import time\n", "import time\nfrom hardy.crash import stacks\n"
                           "stacks.py_spy = lambda: None  # as if py-spy were not installed\n", 1)
    for label, script in (("py-spy", code), ("faulthandler", without)):
        out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
        line = out.stdout.strip().splitlines()[-1] if out.stdout.strip() else out.stderr[-300:]
        print(f"   {label}: {line.split(' ', 1)[0]} s after the timeout ({line.split(' ', 1)[-1]})")


KEEP = textwrap.dedent("""
    import os, statistics, sys, tempfile, time
    from hardy import Engine, Pipeline, node

    @node(output_name="y")
    def check(x: int) -> int:
        if x % 100 == 7:
            raise ValueError(f"bad item {x}")
        return x

    xs = list(range(2000))
    t = time.perf_counter()
    for x in xs:
        try:
            check.func(x)
        except ValueError:
            pass
    plain = time.perf_counter() - t
    times = {"plain": [plain], False: [], True: []}
    with tempfile.TemporaryDirectory() as state:
        os.environ["XDG_STATE_HOME"] = state
        with Engine(workers=1) as off, Engine(workers=1, keep_failed_inputs=True) as on:
            for _ in range(5):
                for keep, e in ((False, off), (True, on)):
                    t = time.perf_counter()
                    Pipeline(nodes=[check], engine=e, name="check").map(inputs={"x": xs}, map_over="x",
                                                                         on_error="continue")
                    times[keep].append(time.perf_counter() - t)
        kept = sum(len(os.listdir(os.path.join(state, "hardy", "reports", d)))
                   for d in os.listdir(os.path.join(state, "hardy", "reports")) if d.endswith(".inputs"))
    a, b = statistics.median(times[False]), statistics.median(times[True])
    print(f"{plain * 1e3:.2f} {a * 1e3:.1f} {b * 1e3:.1f} {kept}")
""")


def replays() -> None:
    print("4. kept inputs, repeat's preloaded handler, replays")
    out = subprocess.run([sys.executable, "-c", KEEP], capture_output=True, text=True)
    if out.returncode:
        print(out.stderr[-500:])
        return
    plain, off, on, kept = out.stdout.split()
    print(f"   map of 2,000 items, 20 failing (median of 5): plain loop {plain} ms; hardy {off} ms; "
          f"keep_failed_inputs=True {on} ms ({float(on) - float(off):+.1f} ms: {int(kept) // 5} inputs kept per map)")
    from hardy.crash.handler import build
    preload, _ = build(preload=True)
    per = {}
    for label, env in (("without", {}), ("with", {"LD_PRELOAD": preload or ""})):
        times = []
        for _ in range(20):
            t = time.perf_counter()
            subprocess.run([sys.executable, "-c", "pass"], env={**os.environ, **env}, check=True)
            times.append(time.perf_counter() - t)
        per[label] = statistics.median(times)
    print(f"   `python -c pass`, median of 20: {per['without'] * 1e3:.1f} ms without the preloaded handler, "
          f"{per['with'] * 1e3:.1f} ms with ({(per['with'] - per['without']) * 1e3:+.1f} ms per run)")
    import tempfile
    with tempfile.TemporaryDirectory() as folder:
        src = os.path.join(folder, "crash.c")
        with open(src, "w") as f:
            f.write("__attribute__((noinline)) static int inner(volatile int *p) { return *p; }\n"
                    "int crash_here(long a) { return inner((volatile int *)a) + 1; }\n")
        lib = os.path.join(folder, "libcrash.so")
        subprocess.run(["gcc", "-O1", "-shared", "-fPIC", "-o", lib, src], check=True)
        job = textwrap.dedent(f"""
            import ctypes
            from hardy import Engine, Pipeline, node

            @node(output_name="y")
            def embed(x: int) -> int:
                if x == 1:
                    ctypes.CDLL({lib!r}).crash_here(0)
                return x

            with Engine(workers=1, report_dir={folder!r}) as e:
                Pipeline(nodes=[embed], engine=e).map(inputs={{"x": [0, 1]}}, map_over="x", on_error="continue")
        """)
        subprocess.run([sys.executable, "-c", job], check=True, capture_output=True)
        report = next(os.path.join(folder, n) for n in os.listdir(folder) if n.endswith(".json"))
        for flag in ("", "--gdb", "--py-spy"):
            t = time.perf_counter()
            run = subprocess.run([sys.executable, "-m", "hardy.cli", "replay", report, "--item", "1",
                                  *([flag] if flag else [])], capture_output=True, text=True)
            print(f"   hardy replay --item 1 {flag or '(a fresh worker)'}: {time.perf_counter() - t:.2f} s "
                  f"(exit {run.returncode})")


if __name__ == "__main__":
    print(f"py-spy: {stacks.py_spy() or 'not installed'}; load {os.getloadavg()[0]:.2f}")
    if "--replays" not in sys.argv:
        symbolising("--pyelftools-torch" in sys.argv)
        worker_start()
        hang_stacks()
    replays()
