"""The bytes of a cache entry: a value pickled, then signed, so that it is verified before it is unpickled.

Entry layout (bytes, whatever the store):
    b"HRD" | format version (1 byte) | key id (8 bytes) | MAC (16 bytes) | body
    format 3, a value without big buffers: body = pickle
    format 4, a value with buffers of at least `buffers.THRESHOLD` bytes (numpy arrays...):
        body = count (u32) | pickle size (u64) | each buffer's size (u64) | pickle (protocol 5,
               the buffers out of band) | each buffer, at an offset that is a multiple of 64
MAC = keyed BLAKE3(secret, FORMAT | entry key | body), and for format 4 FORMAT | entry key | 4 |
body (so that neither format's entry verifies as the other's). It is the checksum and the signature
at once: a truncated, zeroed or flipped entry, or an entry copied under another key, fails
verification and is deleted and recomputed.

Why format 4: a hit on an 80 MB array used to read the entry into memory, then unpickle a second
copy of it. A format 4 entry is written piece by piece (the buffers from where they are, not joined
into one bytes object); on a hit, the store maps the blob file privately (`Store.view`), the MAC is
checked over a copy of the pickle (a file written into in place after the check cannot slip in
another one) and over the mapped buffers, which are unpickled as views of it: the arrays are the
file's pages, copied only where the user writes into them (copy-on-write; the cache never changes). Both
formats are read: entries written before format 4 still hit; a hardy that knows only format 3
skips (keeps) format 4 entries. Every format from 4 on is signed as FORMAT | key | its version byte |
the rest, so a reader tells a newer hardy's entry (it verifies: skipped, kept) from one whose
version byte someone rewrote (it does not: damage). The key id (a keyed hash of nothing but the
secret) tells an entry written under another secret from a damaged one only where its header can
be trusted that far: in a private directory (only its user writes it) one naming another secret —
the user's own under another HARDY_CACHE_KEY — is skipped, not deleted; a shared directory and a
bucket keep each key id's entries in a folder of its own, where a header naming another is damage
(anyone who can write there can write those 8 bytes). Nothing that fails is unpickled, so a crafted
pickle in the cache directory never runs.

This module lays the bytes out and reads them back; DiskCache signs them (`DiskCache._entry`) and
checks the MAC before anything here unpickles them (`DiskCache._load`).
"""

from __future__ import annotations

import pickle
import struct
from typing import Any

from ..hashing import DIGEST
from .store import Buffer

MAGIC = b"HRD"
VERSION = 3  # 3: keyed BLAKE3 MACs (a value without big buffers)
BUFFERS = 4  # a value whose big buffers follow its pickle, mapped on a hit
TAG = bytes([BUFFERS])  # first in a format 4 entry's MAC: neither format's entry verifies as the other's
FORMATS = (VERSION, BUFFERS)
ALIGN = 64
KEY_ID = 8
HEADER = len(MAGIC) + 1 + KEY_ID + DIGEST


def dumps(value: Any, big: list[memoryview]) -> bytes:
    """`value` pickled (protocol 5, cloudpickle for what pickle cannot do); its buffers of at least
    `buffers.THRESHOLD` bytes are left out of the pickle and appended to `big`, uncopied."""
    from ..buffers import big_buffer  # here: `import hardy` does not load ctypes

    def out_of_band(buf: pickle.PickleBuffer) -> bool:
        raw = big_buffer(buf)
        if raw is None:
            return True
        big.append(raw)
        return False
    try:
        return pickle.dumps(value, protocol=5, buffer_callback=out_of_band)
    except Exception:
        big.clear()
        import cloudpickle
        return cloudpickle.dumps(value, protocol=5, buffer_callback=out_of_band)  # type: ignore[no-any-return]


def private(view: memoryview) -> Buffer:
    """`view`, copied unless it is memory of its own (bytes, a store's bytearray): the bytes that
    are unpickled must be the bytes that were verified, and a mapped file can change in between
    (anyone allowed to write into it in place could slip in a pickle that runs code)."""
    return view if isinstance(view.obj, (bytes, bytearray)) else bytes(view)


def split(whole: memoryview) -> tuple[Buffer, memoryview]:
    """A format 4 entry's body: its layout and pickle (`private`), then its buffers where they
    are (data: a change after the check changes values, runs nothing)."""
    count, size = struct.unpack_from("<IQ", whole, HEADER) if len(whole) >= HEADER + 12 else (0, 0)
    end = min(len(whole), HEADER + 12 + 8 * count + size)
    return private(whole[HEADER:end]), whole[end:]


def unpack(whole: memoryview, body: Buffer) -> Any:
    """A verified format 4 entry unpickled over views of its buffers: no copy. `body` is its layout
    and pickle (`split`). An entry in read-only memory (a store's bytes) is copied once, so that
    arrays come back writable as from any pickle."""
    if whole.readonly:
        whole = memoryview(bytearray(whole))
    count, size = struct.unpack_from("<IQ", body)
    start = 12 + 8 * count
    buffers, end = [], HEADER + start + size
    for n in struct.unpack_from(f"<{count}Q", body, 12):
        end += -end % ALIGN
        buffers.append(whole[end:end + n])
        end += n
    if end != len(whole) or len(body) != start + size:
        raise ValueError(f"the layout ends at byte {end} of {len(whole)}")
    return pickle.loads(memoryview(body)[start:], buffers=buffers)


def laid_out(payload: bytes, big: list[memoryview]) -> list[Buffer]:
    """A format 4 entry's body, in pieces: the layout (count, pickle size, each buffer's size), the
    pickle, then each buffer as it is, at an offset that is a multiple of `ALIGN`."""
    body: list[Buffer] = [struct.pack(f"<IQ{len(big)}Q", len(big), len(payload), *(b.nbytes for b in big)), payload]
    end = HEADER + len(body[0]) + len(payload)
    for buf in big:
        body += [bytes(-end % ALIGN), buf]
        end += -end % ALIGN + buf.nbytes
    return body
