"""Deterministic fingerprints of code, for cache keys.

A function's fingerprint covers its bytecode and constants (not its source text), its
defaults, the globals and closure values it reads — following attribute chains read from the
bytecode through user modules (`utils.clean`, `pkg.sub.fn`) and imports inside the function — and,
transitively, the code of the user functions and classes reached that way (a class by its methods,
cached properties and `lru_cache`d methods by what they wrap, nested classes, its metaclass and its
class-level values by content, through `hardy.hashing.values`). Library code is identified by the
installed distribution that provides it (`distributions.py`), and every other kind of callable (a
bound method, a partial, a decorator...) by what it runs (`callables.py`). While a `Reach` is
recording, fingerprints note every name they read, so that a pipeline can tell cheaply whether the
code it compiled is still the code bound to those names (docs/caching.md).
"""


from __future__ import annotations

import builtins
import functools
import sys
import threading
import types
import typing
from collections.abc import Callable
from typing import Any

from blake3 import blake3

from ..errors import UnhashableError
from . import bytecode
from .callables import KINDS, annotations_of, kind_of, library_function, resolves
from .classes import automatic, install_code_fingerprint
from .distributions import module_identity
from .environ import is_environment, keyed_environment
from .models import pydantic_class_parts
from .origin import absolute_module, is_user_file, is_user_module, renamed, small_data, user_made
from .reach import Cell, Size, module_reached, named_imports, note_instance, note_names, note_partial, note_read, noting
from .reach import Reach as Reach
from .reach import recording as recording
from .state import tolerant
from .values import ABSENT, DIGEST, encode_into, length, type_name


def code_fingerprint(obj: Any) -> bytes:
    """What a callable computes, as far as Python can see: a 16-byte digest (see module docstring)."""
    busy: set[int] = _BUSY.__dict__.setdefault("ids", set())
    if id(obj) in busy:  # Config.DEFAULT = Config(): the class's value refers back to the class being hashed
        return b"self:" + (obj.__name__.encode() if isinstance(obj, types.ModuleType)
                           else type_name(obj if isinstance(obj, type) else type(obj)))
    busy.add(id(obj))
    try:
        h = blake3()
        if isinstance(obj, types.ModuleType):  # a module inside a value (`state.module_value`): read whole
            _reference(obj, h.update, {}, (), obj.__name__, obj)
        else:
            _fingerprint(obj, h.update, {})
        return h.digest(DIGEST)
    finally:
        busy.discard(id(obj))


_BUSY = threading.local()

Seen = dict[int, tuple[int, Any]]  # id -> (position, the object: kept alive so that its id is not reused)


def _fingerprint(obj: Any, out: Callable[[bytes], Any], seen: Seen) -> None:
    """Any callable, by its kind (`callables.py`): a function or class by its code here."""
    if id(obj) in seen:  # recursion and mutual recursion: refer back by position
        out(b"@" + length(seen[id(obj)][0]))
        return
    seen[id(obj)] = (len(seen), obj)
    _KINDS[kind_of(obj)](obj, out, seen, _fingerprint)


def _function(func: Any, out: Callable[[bytes], Any], seen: Seen, recurse: Any) -> None:
    """A user function; a decorated one (`functools.wraps`) by its own code and the function it wraps."""
    _fingerprint_function(func, out, seen)
    wrapped = getattr(func, "__wrapped__", None)
    if wrapped is not None:
        out(b"wraps")
        _fingerprint(wrapped, out, seen)


def _class(cls: type, out: Callable[[bytes], Any], seen: Seen, recurse: Any) -> None:
    _fingerprint_class(cls, out, seen)


def _library_class(cls: type, out: Callable[[bytes], Any], seen: Seen, recurse: Any) -> None:
    """A library's class by its distribution and name; one it made at run time (a named tuple
    built by a factory) has no name to find it by, and is walked as a user class is."""
    library_function(cls, out, seen, recurse)
    if not resolves(cls):
        _fingerprint_class(cls, out, seen)


_KINDS = {**KINDS, "function": _function, "class": _class, "library class": _library_class,
          "bound method": noting(KINDS["bound method"], lambda m: note_instance(m.__self__)),
          "callable object": noting(KINDS["callable object"], note_instance),
          "partial": noting(KINDS["partial"], note_partial)}


def _fingerprint_class(cls: type, out: Callable[[bytes], Any], seen: Seen) -> None:
    """A user class: its user bases and metaclass, its methods and properties (cached ones and
    `lru_cache`d ones by the function they wrap), nested classes, and its class-level values by
    content (`Model.THRESHOLD`, a class-level array or configured instance), like globals."""
    out(b"class:" + type_name(cls))
    module_reached(cls.__module__)
    members = vars(cls)
    for name in members:
        note_read(members, name)
    for name in {n for base in cls.__mro__[1:] if is_user_module(base.__module__) for n in vars(base)} - set(members):
        note_read(members, name)  # (what it inherits: set on it later, `Model.SCALE = 10` shadows the base's)
    for base in (*cls.__mro__[1:], type(cls)):
        if is_user_module(base.__module__):
            _fingerprint(base, out, seen)
    for name, member in sorted(vars(cls).items()):
        target = member.__func__ if isinstance(member, (staticmethod, classmethod)) else member
        if isinstance(target, property):  # its getter, and a setter and a deleter where it has them
            for suffix, accessor in ((b"", target.fget), (b".fset", target.fset), (b".fdel", target.fdel)):
                if accessor is not None:
                    out(name.encode() + suffix)
                    _fingerprint(accessor, out, seen)
            continue
        target = target.func if isinstance(target, functools.cached_property) else target
        if isinstance(target, (functools.partialmethod, functools.singledispatchmethod)) \
                or (callable(target) and kind_of(target) not in _VALUES):
            out(name.encode())
            _fingerprint(target, out, seen)
        elif not automatic(name, target) and not isinstance(target, _DESCRIPTORS):
            out(name.encode())
            _class_value(cls, name, member, out)
    if "__pydantic_fields__" in members:  # a pydantic model: what pydantic keeps out of the namespace
        out(b"pydantic")
        for label, value in pydantic_class_parts(cls):
            out(b"|" + label.encode())
            _hint(value, out)
    annotations = members.get("__annotations__")
    if annotations:  # what dataclasses, pydantic and `typing.get_type_hints` make of the fields
        out(b"annotations")
        for name, hint in annotations.items():
            out(name.encode())
            _hint(hint, out)


def _class_value(cls: type, name: str, member: Any, out: Callable[[bytes], Any]) -> None:
    """A class-level value by content; one without (a cache, a lock, a registry) is state, not
    configuration: by its type. A module there is code: refused, named, where it cannot be keyed."""
    try:
        tolerant(member, out)
    except UnhashableError as exc:
        raise UnhashableError(f"{cls.__module__}.{cls.__qualname__}.{name}: {exc}") from None


def _hint(hint: Any, out: Callable[[bytes], Any], by_name: bool = False) -> None:
    """A type hint by content: a class or a string as a value, a generic (`list[int]`,
    `Optional[X]`, `Annotated[int, ...]`) by its origin and each argument in turn (not by its
    repr, which lists a set's members in the process's hash order). `by_name` (a function's
    annotations): a class, or a hint whose repr holds an address, by its qualified name."""
    if by_name and isinstance(hint, type):
        out(b"t:" + type_name(hint))
        return
    try:
        encode_into(hint, out, set())
        return
    except UnhashableError:
        pass
    origin = typing.get_origin(hint)
    if origin is None:
        text = repr(hint)
        named = b"q:" + type_name(hint if isinstance(hint, type) else type(hint)) if by_name else b"?"
        out(b"r:" + text.encode() if " at 0x" not in text else named)
        return
    out(b"h:" + repr(origin).encode())
    for arg in typing.get_args(hint):
        _hint(arg, out, by_name)


_VALUES = ("callable object", "not callable")  # callables keyed by content, like any class-level value
_DESCRIPTORS = (types.MemberDescriptorType, types.GetSetDescriptorType)  # __slots__ fields: per instance


def _fingerprint_function(func: Any, out: Callable[[bytes], Any], seen: Seen) -> None:
    """A user function: its code and defaults, then what it reads (globals, closure cells, modules
    it imports), each with the attribute chains the code reads from it."""
    code = func.__code__
    bytecode.code_bytes(code, out)
    out(b"name:" + f"{getattr(func, '__name__', '')}/{getattr(func, '__qualname__', '')}".encode())
    out(b"defaults")
    later = _Later()
    with later:
        _defaults(func, out)
    _annotations_and_attributes(func, out)
    globs = getattr(func, "__globals__", {})
    chains = bytecode.chains(code)
    module_reached(getattr(func, "__module__", None))
    keyed_environment(func, chains, out)  # `os.environ.get("MODE")`, `datetime.fromtimestamp`: what they read counts
    for kind, name in chains:  # the names it loads, present or not: one defined later shadows a builtin
        if kind == "g":
            note_read(globs, name)
    for name in sorted(bytecode.global_names(code)):
        if name in globs:
            out(b"g:" + name.encode())
            with later:
                _reference(globs[name], out, seen, chains.get(("g", name), ()), name, func)
    _set_in_builtins(func, globs, chains, out, seen, later)
    for name, cell in zip(code.co_freevars, getattr(func, "__closure__", None) or ()):
        out(b"c:" + name.encode())
        note_read(Cell(cell), name)
        try:
            value = cell.cell_contents
        except ValueError:  # an empty cell (a name assigned later in the enclosing function)
            out(b"empty")
            continue
        with later:
            _reference(value, out, seen, chains.get(("c", name), ()), name, func)
    with later:
        _imports_inside(func, chains, globs, out, seen)
    later.done()


def _defaults(func: Any, out: Callable[[bytes], Any]) -> None:
    """A function's defaults by content; one that cannot be keyed is named with its function
    (`utils.h`'s default `_lock`), which the node's refusal alone did not say."""
    defaults, kwdefaults = getattr(func, "__defaults__", None), getattr(func, "__kwdefaults__", None)
    try:
        encode_into((defaults, kwdefaults), out, set())
    except UnhashableError as exc:
        if len(exc.path) < 2:  # (a cycle through the tuple itself: said as it was)
            raise
        where, exc.path = exc.path[:2], exc.path[2:]  # ("[0]", "[i]"): positional; ("[1]", "['k']"): keyword
        code = func.__code__
        positional = code.co_varnames[code.co_argcount - len(defaults or ()):code.co_argcount]
        name = positional[int(where[1][1:-1])] if where[0] == "[0]" else where[1][2:-2]
        what = exc.describe(name) if exc.culprit or exc.path else exc.detail
        raise UnhashableError(f"{func.__module__}.{func.__qualname__}'s default {name!r}: {what}",
                              exc.culprit) from None


def _set_in_builtins(func: Any, globs: dict[str, Any], chains: dict[tuple[str, str], set[tuple[str, ...]]],
                     out: Callable[[bytes], Any], seen: Seen, later: _Later) -> None:
    """Globals the code reads that its module does not bind but `builtins` does, put there at run
    time (`builtins.THRESHOLD = 0.5`, a notebook's shared setting; kernprof's `profile`): keyed as
    globals are, and watched in `builtins` (`note_read`). The interpreter's own (`len`, `print`,
    `help`) are not: Python's version keys them. A library's object put there that has no content
    (IPython's `get_ipython`, gettext's `_`) counts by its type; a user's is refused as a global is."""
    space = globs.get("__builtins__", builtins)
    space = vars(space) if isinstance(space, types.ModuleType) else space
    if not isinstance(space, dict):
        return
    wanted = _builtins_read(globs, chains)
    for name in sorted(n for n in wanted if n in space):
        value = space[name]
        if python_own(name, value):
            continue
        note_read(space, name)
        out(b"b:" + name.encode())
        written: list[bytes] = []
        kept = dict(seen)
        with later:
            try:
                _reference(value, written.append, seen, wanted[name], name, func)
            except UnhashableError:
                if is_user_module(value.__module__ if isinstance(value, (types.FunctionType, type))
                                  else type(value).__module__):
                    raise
                seen.clear()
                seen.update(kept)  # (what the failed walk noted was not written)
                written = [b"?" + type_name(type(value))]
            out(b"".join(written))


def _builtins_read(globs: dict[str, Any], chains: dict[tuple[str, str], set[tuple[str, ...]]]
                   ) -> dict[str, set[tuple[str, ...]]]:
    """The names code reads from `builtins`, each with the attribute chains it reads below it: a
    global its module does not bind (`THRESHOLD`), and an attribute of the module `builtins`
    itself (`builtins.THRESHOLD`, `import builtins` at the top or inside the function)."""
    wanted = {n: set(paths) for (kind, n), paths in chains.items() if kind == "g" and n not in globs}
    for (kind, n), paths in chains.items():
        if (kind == "g" and globs.get(n) is builtins) or (kind == "import" and n == "builtins"):
            for path in paths:
                if path:
                    wanted.setdefault(path[0], set()).add(path[1:])
    return wanted


def python_own(name: str, value: Any) -> bool:
    """Whether `builtins.name` is the interpreter's own: a dunder, a constant, `site`'s helpers
    (`help`, `exit`), or a builtin class or function under its own name (`OSError` under its
    aliases `IOError` and `EnvironmentError` too; `open` is `io`'s, `_io`'s from Python 3.12)."""
    if (name.startswith("__") and name.endswith("__")) or any(value is c for c in (None, Ellipsis, NotImplemented,
                                                                                  True, False)):
        return True
    if type(value).__module__ == "_sitebuiltins":
        return True
    return (isinstance(value, (type, types.BuiltinFunctionType)) and getattr(value, "__module__", None)
            in ("builtins", "io", "_io") and (value.__name__ == name or value is OSError))


def _imports_inside(func: Any, chains: dict[tuple[str, str], set[tuple[str, ...]]], globs: dict[str, Any],
                    out: Callable[[bytes], Any], seen: Seen) -> None:
    """The modules a function imports inside its body, with what it reads from them."""
    for _, name in sorted(r for r in chains if r[0] == "submodule"):
        _imported(name)  # `import pkg.sub` inside: what `pkg.sub.f` then reads
    roots = [(r, chains[r]) for r in sorted(r for r in chains if r[0] in ("import", "from"))]
    roots += [(("import", n), {()}) for n in sorted(named_imports(func.__code__))]  # read whole
    for root, read in roots:  # imports inside the function, `import_module("cfg")` as `import cfg`
        name = absolute_module(root[1], globs)
        out(b"i:" + name.encode())
        module = _imported(name)
        note_read(sys.modules, name)
        if module is not ABSENT:
            if root[0] == "from":
                _import_submodules(module, read)
            _reference(module, out, seen, read, name, func)
        else:  # a library imported only inside the node: by its distribution, found without importing it
            out(module_identity(name))


class _Later:
    """The first `UnhashableError` of a function's parts (a default, a global, a cell), raised by
    `done()` once every part was walked: a walk that stopped at `_LOCK = threading.Lock()` left the
    modules read after it unnoted (the globals go in name order), and a worker computed with its
    own import-time `settings.CFG` where the caller had changed it, silently."""

    def __init__(self) -> None:
        self.error: UnhashableError | None = None

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: Any, exc: Any, tb: Any) -> bool:
        if isinstance(exc, UnhashableError):
            self.error = self.error or exc
            return True
        return False

    def done(self) -> None:
        if self.error is not None:
            raise self.error


def _annotations_and_attributes(func: Any, out: Callable[[bytes], Any]) -> None:
    """What a function carries besides its code and defaults, which code can read."""
    annotations = annotations_of(func)
    if annotations:  # `pydantic.validate_call`, `typing.get_type_hints` read them when called
        out(b"annotations")
        for name, hint in annotations.items():
            out(name.encode())
            _hint(hint, out, by_name=True)
    attributes = {k: v for k, v in getattr(func, "__dict__", {}).items() if k != "__wrapped__"}
    if attributes:  # what was set on it (`helper.factor = 2`), which code reads as `helper.factor`
        out(b"attributes")
        for name, value in sorted(attributes.items()):
            out(name.encode())
            tolerant(value, out)
    note_read(Size(func.__dict__), "")  # an attribute set on it later (`h.k = 3`, read as `getattr(h, "k", 2)`)


def _reference(value: Any, out: Callable[[bytes], Any], seen: Seen, chains: Any, name: str, reader: Any) -> None:
    """A global, closure value or imported module the code reads, with the attribute chains the
    code reads from it: through a user module, what counts is what the chains reach; through a
    library, the distributions of the modules they reach."""
    if is_environment(value):  # `from os import environ`: its variables count by name (`keyed_variables`)
        out(b"environ")
    elif isinstance(value, types.ModuleType):
        if is_user_module(value.__name__):
            out(b"mod:" + value.__name__.encode())
            module_reached(value.__name__, as_module=True)
            _module_attributes(value, out, seen, chains, name, reader)
        else:
            _library_chains(value, out, seen, chains)
    elif isinstance(value, (types.FunctionType, types.MethodType, type)) or (callable(value) and (
            kind_of(value) not in _VALUES or not is_user_module(type(value).__module__))):
        _fingerprint(value, out, seen)  # a callable of any kind; a user's callable object is a value
    else:  # a value; an instance of a user class is keyed by its class's code too (see encode_object)
        try:
            encode_into(value, out, set())
        except UnhashableError as exc:
            kind = "module attribute" if "." in name else "global"
            reader_name = f"{getattr(reader, '__module__', '?')}.{getattr(reader, '__qualname__', '?')}"
            raise UnhashableError(f"{reader_name} reads the {kind} {name!r}: {exc.describe(name)}", exc.culprit,
                                  exc.path) from None


def _library_chains(module: types.ModuleType, out: Callable[[bytes], Any], seen: Seen, chains: Any) -> None:
    """A library module by the distributions of what the code reads from it: each attribute
    chain followed through submodules (`s4ns.tok.count` reaches the namespace package's part
    `s4ns.tok`), the module itself when it is read whole or is not a namespace package. Only what
    is already imported is followed (a library's lazy attributes are never loaded to key a node).
    The attribute a chain reads from a module is noted (`note_read`): a script that patches it
    (`math.sqrt = my_sqrt`, `json.dumps = ...`) makes the plan stale, and what it put there, user
    code or a partial, is keyed as such (`user_made`), another function by its name (`renamed`),
    which the library's distribution says nothing of."""
    whole = not chains or () in chains
    if whole or getattr(module, "__file__", None) is not None:
        out(b"lib:" + module.__name__.encode() + b"@" + module_identity(module.__name__))
    for chain in sorted(c for c in chains if c):
        target: Any = module
        last = module
        path = name = module.__name__
        for attr in chain:
            if not isinstance(target, types.ModuleType):
                break
            namespace = vars(target)
            target = namespace.get(attr, ABSENT)
            if target is ABSENT:
                break
            path, name = path + "." + attr, attr
            if isinstance(target, types.ModuleType):
                last = target
            elif callable(target) or small_data(target, 2):
                note_read(namespace, attr)
        out(b"." + path.encode() + b"@" + module_identity(last.__name__))
        if user_made(target):
            out(b"patched:")
            try:
                _fingerprint(target, out, seen)
            except UnhashableError as exc:  # (a bare `mock.patch("math.sqrt")`'s MagicMock)
                raise UnhashableError(f"it reads {path}, which this process replaced with a {type(target).__name__} "
                                      f"({exc})", exc.culprit, exc.path) from None
            continue
        if renamed(target, name):  # an alias (`np.abs`), or another function put there (`math.sqrt = math.exp`)
            out(b"is:" + f"{getattr(target, '__module__', '?')}.{getattr(target, '__qualname__', '?')}".encode())
        if not isinstance(target, types.ModuleType) and not callable(target) and small_data(target, 2):
            out(b"value:")  # `sys.argv`, `sys.path`, a library's setting in a list or a dict
            tolerant(target, out)
        origin = getattr(target, "__module__", None) if not isinstance(target, types.ModuleType) else None
        if isinstance(origin, str) and origin != last.__name__ and (
                origin.split(".")[0] != last.__name__.split(".")[0]
                or module_identity(origin) != module_identity(last.__name__)):
            # re-exported from another distribution, or from another file of a package no
            # distribution installed (keyed by each file's content: `fakepkg.scale` from its `core.py`)
            out(b"from:" + module_identity(origin))


def _module_attributes(module: types.ModuleType, out: Callable[[bytes], Any], seen: Seen,
                       chains: Any, name: str, reader: Any) -> None:
    """What a function reaches through a user module: each attribute chain, followed through
    submodules to the first object that is not one. Read without a chain (`getattr(m, name)`,
    passed along as a value), the module counts by all the functions and classes it defines and
    by its values (`settings.THRESHOLD`, read by the function it was passed to)."""
    if not chains or () in chains:
        if id(module) in seen:
            out(b"@" + length(seen[id(module)][0]))
        else:
            seen[id(module)] = (len(seen), module)
            # a module read whole: any name it binds again counts (not `__builtins__`: a token of each at each call)
            note_names(vars(module), [a for a, v in vars(module).items() if not a.startswith("__") or callable(v)])
            for attr, value in sorted(vars(module).items()):
                if isinstance(value, (types.FunctionType, type)):
                    if value.__module__ == module.__name__:
                        out(b"a:" + attr.encode())
                        _fingerprint(value, out, seen)
                elif not (attr.startswith("__") or isinstance(value, types.ModuleType) or callable(value)):
                    out(b"v:" + attr.encode())
                    tolerant(value, out)
    for chain in sorted(c for c in chains if c):
        target, path = module, name
        for attr in chain:
            if not (isinstance(target, types.ModuleType) and is_user_module(target.__name__)):
                break
            path += "." + attr
            note_read(vars(target), attr)
            target = getattr(target, attr, ABSENT)  # type: ignore[arg-type]  # absent: fails the same way when run
        out(b"." + path.encode())
        if target is ABSENT:
            out(b"absent")
        else:  # a user module the chain ends at is read as a value: all of it counts
            _reference(target, out, seen, ((),) if isinstance(target, types.ModuleType) else (), path, reader)


def _import_submodules(module: types.ModuleType, chains: Any) -> None:
    """`from pkg import sub` inside a function imports the submodule `pkg.sub` when the package does
    not bind `sub`: so does this (user code only, as `_imported`), for its code to count."""
    for chain in chains:
        if chain and chain[0] not in vars(module) and hasattr(module, "__path__"):
            _imported(f"{module.__name__}.{chain[0]}")


def _imported(module_name: str) -> Any:
    """The module an import inside a function binds. One not imported yet is imported now only if
    it is user code: a library imported inside a node (`import torch` there, to keep the parent
    process free of its threads) must stay unimported here; it counts by name."""
    module = sys.modules.get(module_name)
    if module is not None:
        return module
    if not module_name:
        return ABSENT
    import importlib.util
    try:
        top = importlib.util.find_spec(module_name.split(".")[0])  # a top-level name: no code runs
        if top is None or top.origin is None or not is_user_file(top.origin):
            return ABSENT
        return importlib.import_module(module_name)
    except Exception:  # the node itself will fail the same way when it runs
        return ABSENT


install_code_fingerprint(code_fingerprint)
