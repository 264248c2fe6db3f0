"""What a plan's fingerprints read, to tell cheaply whether the plan still holds between calls.

While a `Reach` records (`recording`), the fingerprints of `hashing.code` note every name they
read (`note_read`); a pipeline keeps the `Reach` of its compiled plan and asks it, at each call,
whether anything read was bound again or changed in place since (docs/caching.md,
docs/same-answer.md).
"""

from __future__ import annotations

import abc
import functools
import re
import sys
import threading
import types
from collections.abc import Callable, Iterable
from typing import Any

from .classes import slot_names
from .origin import is_user_module
from .values import ABSENT


class Reach:
    """What a set of fingerprints read, to tell cheaply whether it still holds: each global,
    module attribute, class attribute and module imported inside a function that the code
    reaches, as (namespace, name, the object found there), and the user modules reached. A
    notebook cell run again, a helper redefined, a global reassigned or `importlib.reload` all
    put another object under a name; `changed()` is one dict lookup and an identity test per
    name. A value changed in place (a global dict filled, an array written) keeps its object, and so
    does a function whose code IPython's autoreload replaced: `watch` adds a content token for each
    such value and the code of each function, compared too."""

    __slots__ = ("reads", "modules", "watched", "codes", "registered", "_token")

    def __init__(self) -> None:
        self.reads: list[tuple[Any, str, Any]] = []
        self.modules: set[str] = set()
        self.watched: list[tuple[Any, bytes]] = []  # (object read, its token): values that can change in place
        self.codes: list[tuple[Any, Any, Any, Any, int]] = []  # (function, its code, defaults, attributes' count)
        self.registered: object = None  # abc's count of registrations, when a user ABC is read (`ABC.register`)
        self._token: Callable[[Any], bytes | None] | None = None

    def changed(self) -> bool:
        for namespace, name, found in self.reads:  # noqa: SIM110 - a loop is faster than any() here
            if namespace.get(name, ABSENT) is not found:
                return True
        for func, code, defaults, kwdefaults, size in self.codes:
            if (func.__code__ is not code or func.__defaults__ is not defaults or func.__kwdefaults__ is not kwdefaults
                    or len(func.__dict__) != size):
                return True
        if self.registered is not None and abc.get_cache_token() != self.registered:
            return True
        if not self.watched:
            return False
        token = self._token
        return token is not None and any(token(found) != before for found, before in self.watched)

    def watch(self, token: Callable[[Any], bytes | None], functions: Iterable[Any] = ()) -> Reach:
        """Also notice values changed in place (`token(obj)`: None for an object whose identity says
        whether it changed, else a digest of its content, `hashing.state.token`), and code or
        defaults replaced in place in the functions read, the methods a call of a user class read
        reaches with no attribute read (`_IMPLICIT`: a named tuple's `__new__`) and `functions` (a
        plan's nodes'), whose mutable defaults are watched as values (`def f(x, vocab=VOCAB)`)."""
        self._token = token
        objects = {id(found): found for where, _, found in self.reads
                   if found is not ABSENT and not _a_librarys_callable(where, found)}
        objects.update((id(f), f) for f in functions)
        code = [f for f in objects.values() if isinstance(f, types.FunctionType)]
        code += [f for c in objects.values() if isinstance(c, type) and is_user_module(c.__module__)
                 for m in map(vars(c).get, _IMPLICIT) if isinstance(f := getattr(m, "__func__", m), types.FunctionType)]
        objects.update((id(d), d) for f in code for d in (*(f.__defaults__ or ()), *(f.__kwdefaults__ or {}).values()))
        self.watched = [(found, t) for found in objects.values() if (t := token(found)) is not None]
        self.codes = [(f, f.__code__, f.__defaults__, f.__kwdefaults__, len(f.__dict__)) for f in code]
        # (a watched function's attributes counted there, not as a `Size` read: a method call less per call)
        dicts = {id(f.__dict__) for f in code}
        self.reads = [r for r in self.reads if not (type(r[0]) is Size and id(r[0].namespace) in dicts)]
        abcs = any(isinstance(c, abc.ABCMeta) and is_user_module(c.__module__) for c in objects.values())
        self.registered = abc.get_cache_token() if abcs else None
        return self

    def settle(self) -> None:
        """Take the values watched as they are now: what nodes running in this process changed in
        them during a call is theirs (a memo, a counter), as in a plain loop; only what changes
        between calls makes the reads stale."""
        token = self._token
        if token is not None and self.watched:
            self.watched = [(found, token(found) or b"") for found, _ in self.watched]
        if self.registered is not None:
            self.registered = abc.get_cache_token()


def _a_librarys_callable(namespace: Any, found: Any) -> bool:
    """A library's function or class read from its module (`np.sqrt`): watched by identity alone
    (`changed`: a script's patch rebinds it), as its content is the library's own (and a token of
    a ufunc costs 50 µs at every call)."""
    name = namespace.get("__name__") if type(namespace) is dict else None
    return isinstance(name, str) and callable(found) and not is_user_module(name) and not (
        isinstance(found, (types.FunctionType, type)) and is_user_module(found.__module__))  # (a patch: its code)


_IMPLICIT = ("__new__", "__init__", "__call__")  # (every other method is read by name, and watched as read)

_RECORDING = threading.local()


def recording(reach: Reach | None) -> Any:
    """Make this thread's fingerprints note what they read into `reach` (None: stop); returns the
    previous recorder, to restore."""
    previous = getattr(_RECORDING, "reach", None)
    _RECORDING.reach = reach
    return previous


def recorder() -> Reach | None:
    """The `Reach` this thread's fingerprints note what they read into, if any."""
    found: Reach | None = getattr(_RECORDING, "reach", None)
    return found


def module_reached(name: str | None, as_module: bool = False) -> None:
    """Note a user module the code reaches; `__main__` only when read as a module (`import __main__`
    in a module's code), not as the home of a script's function (whose globals travel with it)."""
    reach = recorder()
    if reach is not None and name and (name != "__main__" or as_module) and name in sys.modules:
        reach.modules.add(name)


@functools.lru_cache(maxsize=4096)  # code objects are immutable; reading bytecode is the slow part
def named_imports(code: types.CodeType) -> frozenset[str]:
    """The modules code (and its nested code) imports by a constant name: the string loaded right
    after `importlib.import_module`, `import_module` (`from importlib import import_module`) or
    `__import__`, which no attribute chain shows (`import_module("cfg").g(x)` served `cfg.g`'s old
    results). A name built at run time (`import_module("plugins." + kind)`) is not seen."""
    import dis
    found: set[str] = set()
    stack = [code]
    while stack:
        c = stack.pop()
        stack.extend(k for k in c.co_consts if isinstance(k, types.CodeType))
        after_importer = False
        for ins in dis.get_instructions(c):
            if ins.opname in ("PUSH_NULL", "NOP"):  # (3.11 and 3.12 push a NULL before a plain call)
                continue
            if after_importer and ins.opname == "LOAD_CONST" and isinstance(ins.argval, str) \
                    and _MODULE_NAME.fullmatch(ins.argval):
                found.add(ins.argval)
            after_importer = ins.opname.startswith("LOAD_") and ins.argval in ("import_module", "__import__")
    return frozenset(found)


_MODULE_NAME = re.compile(r"\.*[A-Za-z_]\w*(\.[A-Za-z_]\w*)*")  # (a relative name keeps its dots)


def note_read(namespace: Any, name: str) -> None:
    reach = recorder()
    if reach is not None:
        reach.reads.append((namespace, name, namespace.get(name, ABSENT)))


class Cell:
    """A closure cell read as a namespace of one name (`Reach.changed` calls `get`): a cell rebound
    since (`nonlocal`, or an enclosing function's variable assigned again) is a name rebound."""

    __slots__ = ("cell",)

    def __init__(self, cell: Any):
        self.cell = cell

    def get(self, name: str, default: Any = None) -> Any:
        try:
            return self.cell.cell_contents
        except ValueError:  # empty
            return default


class Size:
    """The names of a namespace (an instance's `__dict__`, a function's), read as one name: one
    added since, which no name read was (`obj.F = 3` shadowing the class's `F`, `h.k = 3` read
    through `getattr(h, "k", 2)`), changes its size (one deleted is a name read, gone). `get`
    answers True, whose identity holds while the size does (and which no token watches)."""

    __slots__ = ("namespace", "size")

    def __init__(self, namespace: dict[str, Any]):
        self.namespace, self.size = namespace, len(namespace)

    def get(self, name: str, default: Any = None) -> Any:
        return True if len(self.namespace) == self.size else default


class Slots:
    """An instance's `__slots__` read as a namespace (its `__dict__` is one already): a slot set
    again (`o.k = 3` on a `@dataclass(slots=True)`) is a name rebound, and its value is watched
    by content as an attribute's is."""

    __slots__ = ("instance",)

    def __init__(self, instance: Any):
        self.instance = instance

    def get(self, name: str, default: Any = None) -> Any:
        return getattr(self.instance, name, default)


def note_names(namespace: Any, names: Iterable[str]) -> None:
    """Note each of `names` read in `namespace` (while a `Reach` records)."""
    for name in names:
        note_read(namespace, name)


def noting(handler: Any, note: Callable[[Any], None]) -> Any:
    """`handler`, noting (while a `Reach` records) what the object a callable carries holds
    (`note_instance`): a pipeline then sees `scaler.factor = 3` on the instance its node is
    bound to, as it sees a global rebound, and (by content, `Reach.watch`) a model a `partial` binds
    trained in place: a partial's keywords (a dict set in place) and its positional arguments (a
    tuple, not rebound)."""
    def handle(obj: Any, out: Callable[[bytes], Any], seen: Any, recurse: Any) -> None:
        if recorder() is not None:
            note(obj)
        handler(obj, out, seen, recurse)
    return handle


def note_partial(p: functools.partial[Any]) -> None:
    note_names(p.keywords, list(p.keywords))
    positional = {f"*{i}": a for i, a in enumerate(p.args)}
    note_names(positional, list(positional))


def note_instance(instance: Any) -> None:
    """Note what the object a callable carries holds (a bound method's instance, a callable
    object), as names read: its class, each attribute of its `__dict__`, each of its slots, and the
    size of its `__dict__` (an attribute added). A class or module is no instance: a class method's class is
    read by its fingerprint. A size costs `Reach.changed` about 0.1 us, as a name does (a bound
    method over two helpers: 22 reads, 1.9 us a call, where 14 took 1.2 us)."""
    if isinstance(instance, (type, types.ModuleType)) or recorder() is None:
        return
    attributes = getattr(instance, "__dict__", None)
    if isinstance(attributes, dict):
        note_names(attributes, list(attributes))
        note_read(Size(attributes), "")
    names = slot_names(type(instance))
    note_names(Slots(instance), ("__class__", *names))  # (`obj.__class__ = Other`: another class's methods)
