"""The loaders of what others may write or damage, fuzzed (Hypothesis, bounded: a few hundred examples
each, no deadline): run report files, cache entries and index rows, kept inputs for `hardy replay`,
the framing of worker messages and crash records (and the libraries they name). Each reader either
reads or refuses with its one documented exception; none crashes, hangs or unpickles what it did not
sign. docs/security.md lists these with the rest of the threat model."""

from __future__ import annotations

import json
import math
import os
import pickle
import socket
import sqlite3
import struct
import threading
from pathlib import Path

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from hardy import DiskCache, Engine, Pipeline, node
from hardy.errors import InvalidArgument, ReplayError
from hardy.observe.report import RunReport
from hardy.observe.report_schema import drawing

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]  # fuzzing: hundreds of generated inputs per test
FUZZ = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                       HealthCheck.too_slow])

json_values = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=40),
                           lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner,
                                                                                       max_size=4),
                           max_leaves=20)


@node(output_name="y")
def sometimes(x: int) -> int:
    if x == 1:
        raise ValueError("one")
    return x


@pytest.fixture(scope="module")
def genuine() -> dict:
    p = Pipeline([sometimes], engine=Engine(report=True), name="fuzzed")
    p.map(inputs={"x": [0, 1, 2]}, map_over="x", on_error="continue")
    return json.loads(json.dumps(p.report().to_dict()))


def rendered(path: Path) -> None:
    """Load the report at `path`: refused with InvalidArgument, or loaded and rendered both ways."""
    try:
        report = RunReport.load(path)
    except InvalidArgument:
        return
    page = report._repr_html_()
    assert "<script" not in page.lower()
    str(report)


# --- run reports ---------------------------------------------------------------------------------

@FUZZ
@given(data=st.binary(max_size=300))
def test_any_bytes_as_a_report_are_refused_cleanly(tmp_path, data):
    path = tmp_path / "r.json"
    path.write_bytes(data)
    rendered(path)


def places(value, path=()):
    """Every (container, key) of a JSON value, its root's children first."""
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, child in items:
        yield value, key
        yield from places(child)


@FUZZ
@given(steps=st.lists(st.tuples(st.integers(0, 10**6), json_values), min_size=1, max_size=3))
def test_a_genuine_report_with_any_field_replaced_loads_or_is_refused(tmp_path, genuine, steps):
    """Replace any values anywhere in a genuine report with any JSON (NaN and Infinity included, as
    Python's json writes them)."""
    data = json.loads(json.dumps(genuine))
    for pick, value in steps:
        spots = list(places(data))
        holder, key = spots[pick % len(spots)]
        holder[key] = value
    path = tmp_path / "r.json"
    path.write_text(json.dumps(data))
    rendered(path)


def test_a_report_nested_past_the_parsers_depth_is_refused(tmp_path):
    path = tmp_path / "r.json"
    path.write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(InvalidArgument):
        RunReport.load(path)


tags = st.sampled_from(["svg", "g", "rect", "text", "script", "a", "foreignObject", "iframe", "image", "use",
                        "style", "set", "animate", "title", "path", "marker"])
attributes = st.dictionaries(
    st.sampled_from(["onload", "onclick", "href", "xlink:href", "style", "fill", "marker-end", "id", "x", "src",
                     "transform", "begin", "attributeName", "to"]),
    st.sampled_from(["url(#a)", "url(https://example.invalid/x)", "javascript:alert(1)", "red", "1",
                     "url( 'javascript:x' )", "expression(x)", "&lt;script&gt;", "\" onload=\"x"]),
    max_size=3)
markup = st.recursive(st.tuples(tags, attributes, st.text(max_size=10)).map(lambda t: (*t, [])),
                      lambda inner: st.tuples(tags, attributes, st.text(max_size=10), st.lists(inner, max_size=3)),
                      max_leaves=12)


def _xml(node: tuple, top: bool = True) -> str:
    import html
    tag, attrs, text, children = node
    ns = ' xmlns="http://www.w3.org/2000/svg" xmlns:xlink="http://www.w3.org/1999/xlink"' if top else ""
    shown = "".join(f' {k}="{html.escape(v)}"' for k, v in attrs.items())
    return f"<{tag}{ns}{shown}>{html.escape(text)}{''.join(_xml(c, False) for c in children)}</{tag}>"


@FUZZ
@given(tree=markup, raw=st.text(max_size=60))
def test_the_drawing_keeps_shapes_and_nothing_that_runs_or_fetches(tree, raw):
    """What `drawing` writes, parsed again: only allowed elements and attributes, no reference outside."""
    import re
    import xml.etree.ElementTree as ET

    from hardy.observe.report_schema import ATTRIBUTES, ELEMENTS
    for text in (_xml(tree), raw, _xml(tree)[: len(raw)]):
        out = drawing(text)
        if out is None:
            continue
        for el in ET.fromstring(out).iter():
            assert el.tag.rpartition("}")[2] in ELEMENTS, out
            for name, value in el.attrib.items():
                assert name in ATTRIBUTES and "javascript:" not in value.lower(), out
                assert all(target.strip().strip("'\"").startswith("#")
                           for target in re.findall(r"url\(([^)]*)\)", value, re.IGNORECASE)), out


# --- cache entries and the index -------------------------------------------------------------------

@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("fuzzed-cache")


@FUZZ
@given(value=st.sampled_from([1, "text", b"x" * 300_000, [1.5, None]]),
       cuts=st.lists(st.tuples(st.integers(0, 400), st.binary(max_size=8)), max_size=3),
       length=st.integers(0, 400))
def test_a_damaged_entry_is_a_miss_never_an_exception_nor_an_unpickling(cache_dir, value, cuts, length):
    cache = DiskCache(cache_dir, secret="fuzz")
    key = os.urandom(16)
    assert cache.put(key, value)
    entry = bytearray(cache.store.get(key))
    for at, what in cuts:  # overwrite a few bytes anywhere (the header first: offsets up to 400)
        entry[at:at + len(what)] = what
    entry = entry[:length] if length < 40 else entry
    assume(bytes(entry) != cache.store.get(key))
    cache.store.put(key, bytes(entry))
    got = cache.get(key, "miss")
    assert got == "miss" or got == value  # a change the MAC cannot see does not exist: it is the value or a miss
    assert cache.fetch((key,)) in ({}, {key: value})


row_values = st.one_of(st.none(), st.integers(-2**63, 2**63 - 1), st.floats(allow_nan=True), st.text(max_size=20),
                       st.binary(max_size=40))


@FUZZ
@given(rows=st.lists(st.tuples(row_values.filter(lambda v: v is not None and v == v), row_values,  # (NaN: NULL)
                               st.one_of(st.none(), st.text(max_size=40)), row_values, row_values, row_values),
                     min_size=1, max_size=4))
def test_any_index_rows_are_read_as_misses_or_skipped_never_raised(tmp_path_factory, rows):
    folder = tmp_path_factory.mktemp("index")
    cache = DiskCache(folder, secret="fuzz")
    assert cache.put(bytes(16), "seed")  # makes the index
    db = sqlite3.connect(folder / "index.sqlite")
    for row in rows:
        db.execute("INSERT OR REPLACE INTO entries VALUES (?, ?, ?, ?, ?, ?)", row)
    db.commit()
    db.close()
    fresh = DiskCache(folder, secret="fuzz")
    for key, *_ in rows:
        fresh.get(key if isinstance(key, bytes) else bytes(16), "miss")
    fresh.stats()
    fresh.verify()
    fresh.prune(max_size=1)
    fresh.report()


# --- kept inputs for hardy replay --------------------------------------------------------------------

@pytest.fixture(scope="module")
def kept_report(tmp_path_factory):
    """A report with one kept item, as a failed map leaves it (in this user's private folder)."""
    from hardy.crash import kept
    folder = tmp_path_factory.mktemp("reports")
    with pytest.MonkeyPatch.context() as env:
        env.setenv("XDG_STATE_HOME", str(folder / "state"))  # the user's own key signs what is kept
        report = folder / "run.json"
        said = kept.keep(report, Pipeline([sometimes]), {1: {"x": 1}})
        assert not said[1].startswith("not kept"), said
        yield report, (kept.folder_of(report) / "item-1.pkl").read_bytes()


@FUZZ
@given(cuts=st.lists(st.tuples(st.integers(0, 2000), st.binary(min_size=1, max_size=8)), max_size=3),
       length=st.integers(0, 4000))
def test_a_changed_kept_input_is_refused_before_anything_is_unpickled(kept_report, cuts, length):
    from hardy.crash import kept
    report, good = kept_report
    changed = bytearray(good)
    for at, what in cuts:
        changed[at:at + len(what)] = what
    changed = changed[:length]
    assume(bytes(changed) != good)
    path = kept.folder_of(report) / "item-1.pkl"
    path.write_bytes(bytes(changed))
    try:
        with pytest.raises(ReplayError):
            kept.load(report, 1)
    finally:
        path.write_bytes(good)


# --- worker messages ----------------------------------------------------------------------------------

@FUZZ
@given(data=st.binary(max_size=64))
def test_a_results_header_unpacks_whatever_its_bytes_or_says_it_is_short(data):
    from hardy.workers.messages import HEADER_SIZE, Header
    if len(data) < HEADER_SIZE:
        with pytest.raises(struct.error):
            Header.unpack(data)
    else:
        header = Header.unpack(data)
        assert len(header) == len(Header._fields)
        assert all(isinstance(v, bool) for name, v in zip(Header._fields, header) if name not in ("elapsed", "first"))
        assert type(header.elapsed) is float and type(header.first) is int


@FUZZ
@given(count=st.integers(0, 4), n_fds=st.integers(0, 6), sent=st.integers(0, 3), mismatch=st.integers(-1, 1),
       layout=st.lists(st.tuples(st.integers(0, 7), st.integers(0, 2**64 - 1), st.integers(0, 2**64 - 1)),
                       max_size=5))
def test_a_message_whose_segments_are_not_what_its_framing_says_is_refused(count, n_fds, sent, mismatch, layout):
    """A message's framing (`shipping.transport`): segments announced but not all sent (the sender then
    gone), layouts pointing anywhere, counts that disagree. The reader raises (EOFError: the sender
    died; anything else: the batch is unreadable, asked for again item by item by the scheduler),
    never hangs, crashes or keeps a descriptor."""
    from multiprocessing.connection import Connection

    from hardy.shipping import transport
    before = len(os.listdir("/proc/self/fd"))
    ours, theirs = socket.socketpair()
    segments = []
    for _ in range(sent):
        fd = os.memfd_create("fuzz")
        os.write(fd, b"x" * 64)
        segments.append(fd)
    if segments:
        socket.send_fds(theirs, [b"F"], segments)
    for fd in segments:
        os.close(fd)
    theirs.close()  # the sender is gone: what is missing never comes
    rows = [v for row in layout[:max(0, count + mismatch)] for v in row]
    message = transport.MAGIC + struct.pack("<II", count, n_fds) + struct.pack(f"<{len(rows)}Q", *rows) \
        + pickle.dumps("payload", protocol=5)
    conn = Connection(ours.detach())
    try:
        transport.unpack(conn, memoryview(message))
    except Exception:  # noqa: S110 - refused, as the scheduler expects (BaseException would fail here)
        pass
    finally:
        conn.close()
    assert len(os.listdir("/proc/self/fd")) == before


# --- crash records -----------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def libraries(tmp_path_factory) -> list[str]:
    """What a record may name: a real library, a truncated and a scrambled copy, a folder, a FIFO, nothing."""
    import sysconfig
    folder = tmp_path_factory.mktemp("libs")
    real = next(p for p in (Path("/lib/x86_64-linux-gnu/libz.so.1"), Path("/usr/lib/x86_64-linux-gnu/libz.so.1"),
                            Path("/lib/aarch64-linux-gnu/libz.so.1"),
                            Path(sysconfig.get_config_var("LIBDIR") or "/usr/lib") / "libpython3.11.so.1.0",
                            Path("/bin/true")) if p.exists())  # a small one first: the fuzzer copies it
    body = real.read_bytes()
    (folder / "truncated.so").write_bytes(body[:4096])
    scrambled = bytearray(body[:65536])
    for k in range(64, len(scrambled), 97):
        scrambled[k] ^= 0x5A
    (folder / "scrambled.so").write_bytes(bytes(scrambled))
    os.mkfifo(folder / "fifo.so")
    (folder / "dir.so").mkdir()
    return [str(real), str(folder / "truncated.so"), str(folder / "scrambled.so"), str(folder / "fifo.so"),
            str(folder / "dir.so"), str(folder / "missing.so"), "?", ""]


@FUZZ
@given(lines=st.lists(st.one_of(
    st.text(max_size=60),
    st.tuples(st.integers(0, 2**64 - 1), st.integers(0, 2**64 - 1), st.text(max_size=8).map(lambda t: t.replace(" ", "")),
              st.sampled_from(["?", "malloc", "_ZN2at6native3sumEv", "_Z", "x y"]), st.integers(0, 7))),
    max_size=8))
def test_a_crash_record_of_any_content_is_read_without_an_exception_or_a_hang(libraries, lines):
    """A record's native lines name a library (read for its symbol table: a real one, a truncated or
    scrambled copy, a folder, a FIFO, a missing file) and an address in it; any other line is noise."""
    from hardy.crash.frames import MARK, format_frames
    from hardy.crash.record import parse
    from hardy.crash.sentence import crash_report
    text = [f"{MARK}{line[0]:x} {line[1]:x} {line[2] or '-'} {line[3]} {libraries[line[4]]}"
            if isinstance(line, tuple) else line for line in lines]
    record = "\n".join(text)
    done: list = []
    reader = threading.Thread(target=lambda: done.append((parse(record).frames, crash_report(record))), daemon=True)
    reader.start()
    reader.join(60)
    assert done, "reading the crash record hung"
    frames, (named, native, python) = done[0]
    format_frames(frames)
    assert all(isinstance(f.offset, int) and not math.isnan(f.offset) for f in frames)


@FUZZ
@given(cuts=st.lists(st.tuples(st.integers(0, 2**16), st.binary(min_size=1, max_size=8)), min_size=1, max_size=6),
       in_tables=st.booleans(), offsets=st.lists(st.integers(0, 2**40), max_size=4))
def test_a_library_whose_elf_headers_lie_is_read_as_no_symbols_or_some(tmp_path_factory, libraries, cuts, in_tables,
                                                                        offsets):
    """The symbol tables of the libraries a record names are read from their files: header fields
    (section and program tables, counts, offsets, string table links) of any value."""
    from hardy.crash.symbols import _EHDR, table
    real = Path(libraries[0]).read_bytes()
    body = bytearray(real)
    shoff = _EHDR.unpack_from(real)[6]
    for at, what in cuts:
        at = (shoff + at % max(1, len(body) - shoff)) if in_tables else at % 64
        body[at:at + len(what)] = what
    path = tmp_path_factory.mktemp("elf") / "lib.so"
    path.write_bytes(bytes(body))
    found = table(str(path))
    if found is not None:
        for offset in offsets:
            found.lookup(offset)
