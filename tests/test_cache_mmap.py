"""Entries with big buffers (format 4): a hit hands out the blob file's pages, not a copy, and is
as safe as one: verified first, private to the caller, damage rejected, deletion harmless."""

from __future__ import annotations

import pickle
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from hardy import DiskCache, Pipeline, node
from hardy.cache.entry import BUFFERS, HEADER, MAGIC, VERSION
from hardy.cache.store import Buffer, Data, EntryInfo, pieces

pytestmark = pytest.mark.usefixtures("in_process_default")  # the cache's mapped hits, seen here

N = 1 << 18  # float64: 2 MB, above transport.THRESHOLD
KEY = bytes(range(16))


def big(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).random(N)


def mapped_file(a: np.ndarray) -> str | None:
    """The file whose mapping holds `a`'s first byte, from the kernel's own list of this process's
    mappings (None for the heap and anonymous memory)."""
    address = a.ctypes.data
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split(maxsplit=5)
        start, end = (int(x, 16) for x in fields[0].split("-"))
        if start <= address < end and len(fields) == 6 and fields[5].startswith("/"):
            return fields[5]
    return None


def blob(cache: DiskCache, key: bytes) -> Path:
    return Path(cache.path) / "blobs" / key.hex()[:2] / key.hex()


@pytest.fixture
def cache(tmp_path) -> DiskCache:
    return DiskCache(tmp_path / "c")


def test_a_big_array_comes_back_as_pages_of_its_blob_file(cache):
    a = big(0)
    assert cache.put(KEY, a)
    assert blob(cache, KEY).read_bytes()[3] == BUFFERS
    got = cache.get(KEY)
    assert np.array_equal(got, a) and got.flags.writeable
    assert mapped_file(got) == str(blob(cache, KEY))
    assert mapped_file(a) is None  # the check tells a heap array from a mapped one


def test_containers_of_big_arrays_and_small_values_round_trip(cache):
    value = {"pair": (big(1), big(2)), "n": 3, "name": "x", "small": np.arange(5)}
    cache.put(KEY, value)
    got = cache.get(KEY)
    assert got.keys() == value.keys() and got["n"] == 3 and got["name"] == "x"
    assert np.array_equal(got["small"], np.arange(5))
    for mine, theirs in zip(got["pair"], value["pair"]):
        assert np.array_equal(mine, theirs) and mapped_file(mine) == str(blob(cache, KEY))
    assert not np.shares_memory(got["pair"][0], got["pair"][1])


@node(output_name="y")
def scaled(x: np.ndarray) -> np.ndarray:
    return x * 2


def test_a_pipeline_hit_returns_the_mapped_array(cache):
    p = Pipeline(nodes=[scaled], cache=cache)
    x = big(3)
    first = p.run(inputs={"x": x})["y"]
    second = p.run(inputs={"x": x})["y"]
    assert cache.hits == 1 and np.array_equal(first, second)
    assert mapped_file(first) is None and mapped_file(second) is not None


def test_writing_into_a_hit_never_changes_the_cache(cache):
    cache.put(KEY, big(4))
    got = cache.get(KEY)
    got[:] = -1.0
    again = cache.get(KEY)
    assert np.array_equal(again, big(4)) and not np.shares_memory(got, again)
    assert DiskCache(cache.path).get(KEY) is not None  # the file still verifies


def _flip(path: Path, at: int) -> None:
    with open(path, "r+b") as f:  # in place: the inode a later reader maps
        f.seek(at)
        byte = f.read(1)[0]
        f.seek(at)
        f.write(bytes([byte ^ 0x10]))


@pytest.mark.parametrize("where", ["buffer", "pickle", "layout"])
def test_a_flipped_byte_anywhere_is_rejected_and_recomputed(cache, where):
    p = Pipeline(nodes=[scaled], cache=cache)
    x = big(5)
    p.run(inputs={"x": x})
    [entry] = cache.entries()
    path = blob(cache, entry.key)
    at = {"buffer": path.stat().st_size - 1000, "pickle": HEADER + 30, "layout": HEADER + 4}[where]
    _flip(path, at)
    fresh = DiskCache(cache.path)
    out = Pipeline(nodes=[scaled], cache=fresh).run(inputs={"x": x})["y"]
    assert np.array_equal(out, x * 2) and fresh.rejected == 1 and fresh.hits == 0


def test_a_format_4_entry_relabelled_format_3_does_not_verify(cache):
    cache.put(KEY, big(6))
    path = blob(cache, KEY)
    data = bytearray(path.read_bytes())
    data[3] = VERSION
    path.write_bytes(bytes(data))
    assert cache.get(KEY, "miss") == "miss" and cache.rejected == 1


@pytest.mark.parametrize("value", [list(range(100_000)), {"a": big(8), "n": list(range(100_000))}],
                         ids=["format 3", "format 4"])
def test_what_is_unpickled_is_what_was_verified(cache, value):
    """Someone writing into the blob file in place between the check and the unpickling (a shared
    directory's group-writable files) must not get their pickle run."""
    cache.put(KEY, value)
    path = blob(cache, KEY)
    where = path.read_bytes().index(b"M" + (50_000).to_bytes(2, "little")) + 1  # the pickled int 50000
    checks = {name: getattr(cache, name) for name in ("_mac", "_mac_pieces")}

    def checked_then_changed(name: str) -> Any:
        def check(*args: Any) -> bytes:
            mac: bytes = checks[name](*args)
            with open(path, "r+b") as f:
                f.seek(where)
                f.write((50_001).to_bytes(2, "little"))
            return mac
        return check

    for name in checks:
        setattr(cache, name, checked_then_changed(name))
    got = cache.get(KEY)
    assert (got if isinstance(got, list) else got["n"])[50_000] == 50_000


def test_a_truncated_blob_is_rejected(cache):
    cache.put(KEY, big(7))
    path = blob(cache, KEY)
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size - 4096)
    assert cache.get(KEY, "miss") == "miss" and cache.rejected == 1 and not path.exists()


@pytest.mark.parametrize("how", ["clear", "prune"])
def test_a_hit_stays_readable_after_its_entry_is_deleted(cache, how):
    cache.put(KEY, big(8))
    got = cache.get(KEY)
    if how == "clear":
        cache.clear()
    else:
        cache.prune(max_size=0)
    assert not blob(cache, KEY).exists() and cache.stats().entries == 0
    assert np.array_equal(got, big(8)) and mapped_file(got) == f"{blob(cache, KEY)} (deleted)"


def test_format_3_entries_of_big_values_still_hit(cache):
    """An entry written before format 4 (the array inside its pickle) is served as it was."""
    payload = pickle.dumps(big(9), protocol=5)
    cache.store.put(KEY, MAGIC + bytes([VERSION]) + cache.key_id + cache._mac(KEY, payload) + payload)
    got = cache.get(KEY)
    assert np.array_equal(got, big(9)) and cache.hits == 1 and mapped_file(got) is None


def test_the_file_store_reads_format_4_entries_into_writable_memory(tmp_path):
    cache = DiskCache(tmp_path / "c", store="files")
    value = (big(10), big(11), "tag")
    cache.put(KEY, value)
    got = cache.get(KEY)
    assert np.array_equal(got[0], value[0]) and np.array_equal(got[1], value[1]) and got[2] == "tag"
    assert got[0].flags.writeable and mapped_file(got[0]) is None


class BytesStore:
    """A minimal third-party store: entries as bytes in a dict, so `view` hands out read-only memory."""

    def __init__(self) -> None:
        self.data: dict[bytes, bytes] = {}

    def get(self, key: bytes) -> bytes | None:
        return self.data.get(key)

    view = get

    def get_many(self, keys: tuple[bytes, ...]) -> dict[bytes, Buffer]:
        return {k: self.data[k] for k in keys if k in self.data}

    def put(self, key: bytes, data: Data) -> None:
        self.data[key] = b"".join(pieces(data))

    def delete(self, key: bytes) -> None:
        self.data.pop(key, None)

    def entries(self) -> Iterator[EntryInfo]:
        return iter([EntryInfo(k, len(v), 0.0, 0.0, True) for k, v in self.data.items()])

    def clear(self) -> None:
        self.data.clear()

    def exists(self) -> bool:
        return True


def test_a_store_of_read_only_bytes_still_gives_writable_arrays(tmp_path):
    cache = DiskCache(tmp_path / "c", store=BytesStore())
    cache.put(KEY, big(12))
    got: Any = cache.get(KEY)
    assert np.array_equal(got, big(12)) and got.flags.writeable
    got[0] = 5.0
    assert np.array_equal(cache.get(KEY), big(12))
