"""What a function's bytecode says it reads, for its fingerprint (`code`) and its stamp (`state`):
the attribute chains from each global, cell and module imported inside it (`chains`), the globals
it loads (`global_names`), and the code itself as key bytes (`code_bytes`).
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable
from typing import Any

from .values import encode_into, length


@functools.lru_cache(maxsize=4096)  # code objects are immutable; reading bytecode is the slow part
def chains(code: types.CodeType) -> dict[tuple[str, str], set[tuple[str, ...]]]:
    """The attribute chains the code (and its nested code) reads, from the bytecode:
    `utils.clean(x)` is LOAD_GLOBAL utils, LOAD_METHOD clean -> {("g", "utils"): {("clean",)}}.
    Roots are globals ("g"), closure cells ("c") and modules imported inside the function: `import
    a.b` binds ("import", "a") and imports ("submodule", "a.b"); `from m import f` reads from
    ("from", "m"), so that `f.g` is the chain m.f.g, and `from .m import f` from ("from", ".m")."""
    found: dict[tuple[str, str], set[tuple[str, ...]]] = {}
    stack = [code]
    while stack:
        c = stack.pop()
        stack.extend(k for k in c.co_consts if isinstance(k, types.CodeType))
        _scan_chains(c, found)
    return found


def _scan_chains(c: types.CodeType, found: dict[tuple[str, str], set[tuple[str, ...]]]) -> None:
    """Add the chains one code object (not its nested code) reads to `found`."""
    import dis
    bound: dict[str, tuple[tuple[str, str], tuple[str, ...]]] = {}  # local -> (root, chain prefix)
    root: tuple[str, str] | None = None
    attrs: list[str] = []
    importing: tuple[str, str] | None = None
    prefix: tuple[str, ...] = ()
    consts: list[Any] = [None, None]  # IMPORT_NAME's two constants: its level, its fromlist (None: `import a.b`)
    for ins in dis.get_instructions(c):
        op = ins.opname
        if op in ("LOAD_ATTR", "LOAD_METHOD") and root is not None:
            attrs.append(ins.argval)
            continue
        if root is not None:
            found.setdefault(root, set()).add(tuple(attrs))
            root = None
        if op in ("LOAD_GLOBAL", "LOAD_NAME"):
            root, attrs = ("g", ins.argval), []
        elif op in ("LOAD_DEREF", "LOAD_CLASSDEREF") and ins.argval in c.co_freevars:
            root, attrs = ("c", ins.argval), []
        elif op in ("LOAD_FAST", "LOAD_DEREF") and ins.argval in bound:
            root, chain = bound[ins.argval]
            attrs = list(chain)
        elif op == "IMPORT_NAME":  # `import a.b` binds a; `from a.b import c` reads from a.b
            level, fromlist = consts
            if fromlist is not None:
                importing = ("from", "." * (level if isinstance(level, int) else 0) + ins.argval)
            else:
                importing = ("import", ins.argval.split(".")[0])
                if "." in ins.argval:
                    found.setdefault(("submodule", ins.argval), set())
            prefix = ()
            found.setdefault(importing, set())
            continue
        elif op == "IMPORT_FROM" and importing is not None:
            prefix = (*prefix, ins.argval)
            found[importing].add(prefix)
            continue
        elif op.startswith("STORE_") and importing is not None:
            bound[ins.argval] = (importing, prefix)
            prefix = ()
            continue
        elif op in ("SWAP", "ROT_TWO", "POP_TOP") and importing is not None:
            continue
        importing = None
        consts = [consts[1], ins.argval] if op in ("LOAD_CONST", "LOAD_SMALL_INT") else [None, None]
    if root is not None:
        found.setdefault(root, set()).add(tuple(attrs))


def global_names(code: types.CodeType) -> set[str]:
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= global_names(const)
    return names


# Flags that change what code does (varargs, generator, coroutine...). Compiler flags such as
# `from __future__ import annotations`, inherited by exec() from its caller, do not count.
_SEMANTIC_FLAGS = 0x3FF


def code_bytes(code: types.CodeType, out: Callable[[bytes], Any]) -> None:
    """A code object's canonical bytes (its bytecode, names, constants and nested code; not its
    file or lines), for a fingerprint (`code`) and for comparing code across processes (`state`)."""
    out(b"code" + length(len(code.co_code)) + code.co_code)
    # (the exception table: which lines a `try` covers, moved into its `else:`, leaves co_code as it was)
    table = getattr(code, "co_exceptiontable", b"")
    out(b"except" + length(len(table)) + table)
    out(repr((code.co_name, getattr(code, "co_qualname", ""),  # what a function made from it is named
              code.co_names, code.co_varnames, code.co_freevars, code.co_cellvars, code.co_argcount,
              code.co_posonlyargcount, code.co_kwonlyargcount, code.co_flags & _SEMANTIC_FLAGS)).encode())
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            code_bytes(const, out)
        else:
            encode_into(const, out, set())

