"""A state machine of the cache: random interleavings of put / get / prune in 2-4 real processes
with corrupted, truncated, moved and other-secret entries and a disk that fills up never hand
back a wrong value and never raise."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from hardy import DiskCache
from hardy.cache.store import LocalStore

pytestmark = pytest.mark.slow  # a property-based state machine: many runs of real processes

WORKER = """
import hashlib, json, sys
from hardy import DiskCache
cache = DiskCache(sys.argv[1], secret=sys.argv[2])

def key(k):
    return hashlib.blake2b(str(k).encode(), digest_size=16).digest()

def value(k):
    return hashlib.sha256(str(k).encode()).digest() * (8 if k % 3 else 10_000)  # inline, or a blob

for line in sys.stdin:
    op, k = json.loads(line)
    try:
        if op == "put":
            result = cache.put(key(k), value(k))
        elif op == "get":
            got = cache.get(key(k))
            result = None if got is None else hashlib.sha256(got).hexdigest()
        else:
            result = cache.prune(max_size=k)
        cache.report()
        print(json.dumps({"ok": result}), flush=True)
    except BaseException as exc:
        print(json.dumps({"error": repr(exc)}), flush=True)
"""

KEYS = st.integers(0, 4)


def key(k: int) -> bytes:
    return hashlib.blake2b(str(k).encode(), digest_size=16).digest()


def value(k: int) -> bytes:
    return hashlib.sha256(str(k).encode()).digest() * (8 if k % 3 else 10_000)


@pytest.fixture(scope="module")
def disk(tmp_path_factory):
    """A 2 MB tmpfs when we may mount one (root), so that 'disk full' is real; else a plain folder."""
    folder = tmp_path_factory.mktemp("machine")
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(folder)],
                             capture_output=True).returncode == 0
    yield folder, mounted
    if mounted:
        subprocess.run(["umount", "-l", str(folder)], check=True)


def test_cache_state_machine(disk):
    root, can_fill = disk
    runs = iter(range(10**6))

    class CacheMachine(RuleBasedStateMachine):
        @initialize(n=st.integers(2, 4))
        def start(self, n):
            self.dir = root / f"run{next(runs)}"
            # the processes share one directory; with 4, the last one has another secret
            secrets = ["team"] * min(n, 3) + ["someone-else"] * (n == 4)
            self.procs = [subprocess.Popen([sys.executable, "-c", WORKER, str(self.dir), s], stdin=subprocess.PIPE,
                                           stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
                          for s in secrets]
            self.raw = LocalStore(self.dir)
            self.ballast = root / "ballast"

        def ask(self, i, op, arg):
            proc = self.procs[i % len(self.procs)]
            proc.stdin.write(json.dumps([op, arg]) + "\n")
            proc.stdin.flush()
            answer = json.loads(proc.stdout.readline())
            assert "error" not in answer, answer  # nothing ever raises out of the cache
            return answer["ok"]

        @rule(i=st.integers(0, 3), k=KEYS)
        def put(self, i, k):
            self.ask(i, "put", k)

        @rule(i=st.integers(0, 3), k=KEYS)
        def get(self, i, k):
            got = self.ask(i, "get", k)
            assert got in (None, hashlib.sha256(value(k)).hexdigest()), f"wrong value for key {k}"

        @rule(i=st.integers(0, 3), j=st.integers(0, 3), k=KEYS)
        def put_here_get_there(self, i, j, k):
            self.put(i, k)
            self.get(j, k)

        @rule(i=st.integers(0, 3), size=st.sampled_from([0, 1000, 400_000, 10**9]))
        def prune(self, i, size):
            self.ask(i, "prune", size)

        def _raw_put(self, k, data):
            try:
                self.raw.put(key(k), data)
            except Exception:  # the disk is full for us too: nothing damaged then
                pass

        def _raw_get(self, k):
            try:
                return self.raw.get(key(k))
            except Exception:
                return None

        # Each kind of damage is followed by a read of what was damaged, by some process.

        @rule(k=KEYS, at=st.integers(0, 10**6), bit=st.integers(0, 7), i=st.integers(0, 3))
        def corrupt(self, k, at, bit, i):
            data = self._raw_get(k)
            if data:
                at %= len(data)
                self._raw_put(k, data[:at] + bytes([data[at] ^ (1 << bit)]) + data[at + 1:])
            self.get(i, k)

        @rule(k=KEYS, keep=st.floats(0, 0.99), i=st.integers(0, 3))
        def truncate(self, k, keep, i):
            data = self._raw_get(k)
            if data:
                self._raw_put(k, data[: int(len(data) * keep)])
            self.get(i, k)

        @rule(src=KEYS, dst=KEYS, i=st.integers(0, 3))
        def move(self, src, dst, i):  # a valid entry copied under another key
            data = self._raw_get(src)
            if data and src != dst:
                self._raw_put(dst, data)
            self.get(i, dst)

        @rule(k=KEYS, wrong=KEYS, i=st.integers(0, 3))
        def other_secret_writes_a_wrong_value(self, k, wrong, i):
            try:
                DiskCache(self.dir, secret="intruder").put(key(k), value(wrong))
            except Exception as exc:  # put itself never raises: that is what is being tested
                raise AssertionError(f"put raised {exc!r}") from exc
            self.get(i, k)

        @precondition(lambda self: can_fill)
        @rule()
        def fill_or_free_the_disk(self):
            if self.ballast.exists():
                self.ballast.unlink()
                return
            try:
                with open(self.ballast, "ab") as f:
                    while True:
                        f.write(b"\0" * 65536)
                        f.flush()
            except OSError:
                pass

        @invariant()
        def workers_alive(self):
            assert all(p.poll() is None for p in getattr(self, "procs", []))

        def teardown(self):
            for p in getattr(self, "procs", []):
                p.stdin.close()
                p.wait(timeout=30)
            if hasattr(self, "ballast"):
                self.ballast.unlink(missing_ok=True)
            leftovers = [p for p in self.dir.rglob("*.tmp")] if hasattr(self, "dir") else []
            assert leftovers == [], leftovers  # temporary files never outlive a failed write
            subprocess.run(["rm", "-rf", str(getattr(self, "dir", root / "none"))])

    run_state_machine_as_test(CacheMachine, settings=settings(
        max_examples=12, stateful_step_count=40, deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much]))
