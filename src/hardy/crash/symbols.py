"""Naming a native frame: library + offset -> function + offset, C++ names demangled.

A crash record (`handler.py`) holds each frame's address, its library's load base and the exported
symbol `dladdr` found. Most frames of interest are internal functions (`static`, anonymous
namespaces, template instances) that only the library's `.symtab` names. pyelftools reads a
symbol at a time (33.8 s for libtorch_cpu's 530,469 symbols); here the table is read in one go
with `array` slices (the value and size columns of the fixed 24-byte Elf64_Sym records), the
function symbols sorted once, and each address found by bisection: 0.2-0.4 s the first time,
cached per build-id (or path + size + mtime when a library has none). 64-bit little-endian ELF
only (x86_64, aarch64): the machines hardy's workers run on.
"""

from __future__ import annotations

import bisect
import ctypes
import ctypes.util
import functools
import mmap
import os
import stat
import struct
import sys
import threading
from array import array
from dataclasses import dataclass

_EHDR = struct.Struct("<16sHHIQQQIHHHHHH")
_SHDR = struct.Struct("<IIQQQQIIQQ")
_PHDR = struct.Struct("<IIQQQQQQ")
_SHT_SYMTAB, _SHT_DYNSYM, _SHT_NOTE, _PT_LOAD = 2, 11, 7, 1


@dataclass(frozen=True)
class Frame:
    """One native frame: where it is (`library`, `offset` from its load base) and, when known,
    the function (`function`, demangled) and the offset into it. `library` is "" for code in no
    library (a JIT's, such as numba's). `replaced`: the library's file was replaced after the
    process loaded it, so the function is named from the copy it ran, or not at all (`mapped.py`)."""

    address: int
    library: str
    offset: int
    function: str = ""
    function_offset: int = 0
    replaced: bool = False

    @property
    def name(self) -> str:
        """The library's file name."""
        return os.path.basename(self.library)

    def __str__(self) -> str:
        if not self.library:
            return f"{self.address:#x} in no library: JIT-compiled code (numba, llvmlite...) or anonymous memory"
        where = f"{self.name} +{self.offset:#x}"
        return f"{where} ({self._named()})" if self.function or self.replaced else where

    def short(self) -> str:
        """`libfoo.so (crash_here+0x12)`: how a crash's first line names it."""
        if not self.library:
            return "JIT-compiled code (no library: numba, llvmlite or another JIT)"
        return f"{self.name} ({self._named()})" if self.function else \
            f"{self.name} +{self.offset:#x}" + (f" ({self._named()})" if self.replaced else "")

    def _named(self) -> str:
        if not self.function:
            return REPLACED
        return f"{self.function}+{self.function_offset:#x}"


REPLACED = "library replaced since it was loaded"  # instead of a name read from another file


class SymbolTable:
    """The function symbols of one library, sorted by address; names are read from the file
    when a frame needs one (libtorch_cpu's string table alone is 76 MB)."""

    def __init__(self, path: str, keys: list[int], first: array[int], sizes: array[int], strings: int, base: int):
        self.path, self.keys, self.first, self.sizes, self.strings = path, keys, first, sizes, strings
        self.base = base  # the lowest PT_LOAD address: what a load base of the file corresponds to

    def lookup(self, offset: int) -> tuple[str, int] | None:
        """(mangled name, offset into it) of the function holding `offset` from the load base."""
        address = offset + self.base
        k = bisect.bisect_right(self.keys, address << _INDEX_BITS | _INDEX_MASK) - 1
        if k < 0:
            return None
        start = self.keys[k] >> _INDEX_BITS
        aliases = [self.keys[j] & _INDEX_MASK for j in range(k, max(k - 8, -1), -1)
                   if self.keys[j] >> _INDEX_BITS == start]
        i = next((i for i in aliases if address < start + self.sizes[i]), aliases[0])
        if self.sizes[i] and address >= start + self.sizes[i]:
            return None  # past the end of the nearest function: no symbol covers it
        return self._name(self.first[i] & 0xFFFFFFFF), address - start

    def _name(self, at: int) -> str:
        with open(self.path, "rb") as f:
            f.seek(self.strings + at)
            chunk = b""
            while b"\0" not in chunk and len(chunk) < 1 << 16:
                more = f.read(4096)
                if not more:
                    break
                chunk += more
        return chunk.split(b"\0", 1)[0].decode(errors="replace")


_INDEX_BITS = 26  # a sort key is address << 26 | symbol index: one int sorts faster than a tuple
_INDEX_MASK = (1 << _INDEX_BITS) - 1
_tables: dict[object, SymbolTable | None] = {}
_lock = threading.Lock()


def table(path: str) -> SymbolTable | None:
    """The symbol table of the library at `path` (None if it is no readable 64-bit ELF), cached
    per build-id, or per path + size + mtime."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)  # a FIFO named in a record: no wait
        with open(fd, "rb") as f:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or not st.st_size:
                return None
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
                return _cached(path, st, data)
    except (OSError, ValueError, struct.error, IndexError, OverflowError):  # no ELF this reads, or one that lies
        return None


def _cached(path: str, st: os.stat_result, data: mmap.mmap) -> SymbolTable | None:
    sections = _sections(data)
    if sections is None:
        return None
    key: object = _build_id(data, sections) or (_canonical(path), st.st_size, st.st_mtime_ns)
    with _lock:
        if key in _tables:
            return _tables[key]
    read = _read_table(path, data, sections)
    with _lock:
        _tables[key] = read
    return read


def _sections(data: mmap.mmap) -> list[tuple[int, ...]] | None:
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:  # 64-bit, little-endian
        return None
    header = _EHDR.unpack_from(data)
    shoff, shentsize, shnum = header[6], header[11], header[12]
    return [_SHDR.unpack_from(data, shoff + k * shentsize) for k in range(shnum)]


def _build_id(data: mmap.mmap, sections: list[tuple[int, ...]]) -> bytes | None:
    for s in sections:
        if s[1] == _SHT_NOTE:
            at, end = s[4], s[4] + s[5]
            while at + 12 <= end:
                namesz, descsz, kind = struct.unpack_from("<III", data, at)
                name_at = at + 12
                desc_at = name_at + (namesz + 3 & ~3)
                if kind == 3 and data[name_at:name_at + namesz] == b"GNU\0":  # NT_GNU_BUILD_ID
                    return bytes(data[desc_at:desc_at + descsz])
                at = desc_at + (descsz + 3 & ~3)
    return None


def _read_table(path: str, data: mmap.mmap, sections: list[tuple[int, ...]]) -> SymbolTable | None:
    chosen = next((s for s in sections if s[1] == _SHT_SYMTAB), None) or \
        next((s for s in sections if s[1] == _SHT_DYNSYM), None)
    if chosen is None or chosen[5] // 24 > _INDEX_MASK:
        return None
    words = array("Q")
    words.frombytes(data[chosen[4]:chosen[4] + chosen[5] // 24 * 24])
    if sys.byteorder != "little":
        words.byteswap()
    first, values, sizes = words[0::3], words[1::3], words[2::3]  # name | info | other | shndx; value; size
    # defined functions: a value, and st_info's type STT_FUNC (2) or STT_GNU_IFUNC (10), both 2 in its low 3 bits
    keys = [v << _INDEX_BITS | k for k, (v, w) in enumerate(zip(values, first)) if v and w >> 32 & 7 == 2]
    keys.sort()
    return SymbolTable(_canonical(path), keys, first, sizes, sections[chosen[6]][4], _load_base(data))


def _canonical(path: str) -> str:
    """The path a table reads names from: resolved, except a /proc link (a worker's
    /proc/self/map_files entry of a replaced library, `mapped.py`), which opens the mapped file
    itself where its target's name would open another or none."""
    return path if path.startswith("/proc/") else os.path.realpath(path)


def _load_base(data: mmap.mmap) -> int:
    header = _EHDR.unpack_from(data)
    phoff, phentsize, phnum = header[5], header[9], header[10]
    loads = [p[3] for k in range(phnum) for p in [_PHDR.unpack_from(data, phoff + k * phentsize)] if p[0] == _PT_LOAD]
    return min(loads) & ~0xFFF if loads else 0


@functools.lru_cache(maxsize=1)
def _cxa_demangle() -> tuple[object, object] | None:
    try:
        lib = ctypes.CDLL(ctypes.util.find_library("stdc++") or "libstdc++.so.6")
        libc = ctypes.CDLL(None)
    except OSError:
        return None
    f = lib.__cxa_demangle
    f.restype = ctypes.c_void_p
    f.argtypes = (ctypes.c_char_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.POINTER(ctypes.c_int))
    libc.free.argtypes = (ctypes.c_void_p,)
    return f, libc.free


def demangle(name: str) -> str:
    """A C++ name as written (`at::native::sum<float>(...)`), through libstdc++'s own
    `__cxa_demangle`; other names, or with no libstdc++, unchanged."""
    if not name.startswith("_Z"):
        return name
    found = _cxa_demangle()
    if found is None:
        return name
    cxa, free = found
    status = ctypes.c_int()
    out = cxa(name.encode(), None, None, ctypes.byref(status))  # type: ignore[operator]
    if not out or status.value:
        return name
    try:
        return ctypes.string_at(out).decode(errors="replace")
    finally:
        free(out)  # type: ignore[operator]


def symbolise(address: int, base: int, library: str, exported: str, caller: bool) -> Frame:
    """A frame from one line of a crash record. `caller`: the address is a return address, so the
    call is the instruction before it (what is looked up)."""
    if library in ("", "?") or not base:
        return Frame(address, "", 0)
    offset = address - base
    found = table(library)
    hit = found.lookup(offset - caller) if found is not None else None
    if hit is None:
        if exported and exported != "?":
            return Frame(address, library, offset, demangle(exported), 0)
        return Frame(address, library, offset)
    name, into = hit
    return Frame(address, library, offset, demangle(name), into + caller)
