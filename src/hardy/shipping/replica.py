"""A worker as a replica of the caller: the user modules a plan reaches, made what the caller has.

A worker imports the user's modules itself, from disk, when it first loads a plan. What it gets
can differ from what the calling process runs: the caller reloaded a module (or `%autoreload`
did), a file was edited since the caller imported it, a notebook cell was run again, or the caller
set module state at run time (`steps.WEIGHTS = load(...)`, a dict filled from `sys.argv`). The
caller's compiled plan reads names in those modules; a worker computing from other objects under
the same names would return another answer, silently.

So every plan carries a `Replica`: for each user module it reaches, the stamp of each name it
reads (`hashing.state.module_stamp`: code by bytecode, values by content), with the caller's
object pickled for the small ones. Before the plan is built there, the worker compares the stamps
with its own copy (`sync`) and installs the caller's object for each name that differs: a function
rebuilt from the caller's code over the worker's own module globals (so it reads the same state
and the module stays one module), a class made the caller's where it stands (its instances
follow), a node by value, a value as the caller has it. Big
values are not pickled up front (a model the worker imported itself is usually the same); a
worker that needs one asks (`Need`), and the caller sends it through the shared-memory transport.
A value that can neither be compared nor sent (a lock, a client made at run time) is refused by
name. docs/same-answer.md is the contract this implements.
"""

from __future__ import annotations

import abc
import functools
import importlib
import importlib.util
import io
import itertools
import os
import pickle
import sys
import types
import weakref
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

import cloudpickle

from ..errors import ReplicaError
from ..hashing import is_user_module
from ..hashing.callables import resolves
from ..hashing.state import ABSENT_STAMP, RESOURCE, module_stamp, stamp_of
from ..hashing.values import ABSENT
from .pickling import ByValuePickler

SMALL = 64 * 1024  # bytes: a value pickled smaller travels with the plan; a bigger one when a worker asks

Names = dict[str, dict[str, Any]]  # module -> name -> object (or stamp, or payload)
Wanted = list[tuple[str, str]]  # (module, name) pairs a worker asks for
Fetch = Callable[[int, Wanted], "dict[tuple[str, str], Any] | str"]  # asks the caller: the objects, or a refusal


class Replica:
    """The caller's side: every module a plan reaches, each name it binds as (stamp, object), and
    which names the plan reads (those travel with it). Every name, not only those read: code can
    reach a module's state in ways no fingerprint sees (`getattr(module, name)`, `globals()`, a
    class's instances given as inputs). Kept alive by its plan (`keep`), so that a worker loading
    it can still ask."""

    _ids = itertools.count(1)

    def __init__(self, reached: dict[str, set[str]]):
        self.id = next(self._ids)
        self.objects: Names = {}
        self.stamps: Names = {}
        self.read = reached
        self.files: dict[str, str | None] = {}
        for module_name in sorted(reached):
            module = sys.modules[module_name]
            if module_name == "__main__":  # the script's: only what the plan reads (a worker's own stays)
                names = sorted(reached[module_name])
                self.stamps[module_name] = module_stamp(module, names)
                self.objects[module_name] = {n: vars(module).get(n, ABSENT) for n in names}
            else:
                names = [n for n in vars(module) if not (n.startswith("__") and n.endswith("__"))]
                self.stamps[module_name] = {**module_stamp(module, names), NAMES: _names_stamp(names)}
                self.objects[module_name] = {**{n: vars(module)[n] for n in names}, NAMES: sorted(names)}
            self.files[module_name] = getattr(module, "__file__", None)
        _LIVE[self.id] = self

    def header(self, everything: bool) -> bytes:
        """What travels with the plan: every stamp, with the caller's object pickled for the names
        the plan reads when it is small (`everything`: every object that pickles, for an engine's
        worker that cannot ask back)."""
        entries: Names = {}
        for module_name, stamps in self.stamps.items():
            read = self.read.get(module_name, set()) | {NAMES}
            entries[module_name] = {}
            for name, stamp in stamps.items():
                payload = _payload(module_name, self.objects[module_name][name]) if everything or name in read else None
                if payload is not None and not everything and len(payload) > SMALL:
                    payload = None
                entries[module_name][name] = (stamp, payload)
        return pickle.dumps((self.id, entries, self.files, os.getpid()), protocol=5)

    def values(self, wanted: Wanted) -> dict[tuple[str, str], Any]:
        """The objects a worker asked for."""
        return {(m, n): self.objects.get(m, {}).get(n) for m, n in wanted}

    def refusal(self, wanted: Wanted) -> str:
        """Why one of the objects asked for cannot be sent (the worker then refuses the plan)."""
        for module_name, name in wanted:
            value = self.objects.get(module_name, {}).get(name)
            if _payload(module_name, value) is None:
                return _refusal(module_name, name, value)
        return "the objects asked for cannot be sent to the worker"


NAMES = ""  # the entry of a module's stamps for the set of names it binds (no name can be empty)


def _names_stamp(names: list[str]) -> bytes:
    return stamp_of(sorted(names))


_LIVE: weakref.WeakValueDictionary[int, Replica] = weakref.WeakValueDictionary()
_KEPT: weakref.WeakKeyDictionary[Any, Replica] = weakref.WeakKeyDictionary()


def kept(owner: Any, make: Callable[[], Replica]) -> Replica:
    """The replica of `owner` (a plan), made once and kept alive as long as it lives: a plan does
    not change what it reads (it is made again when that changes), and a worker loading it may
    ask for its objects by its replica's id."""
    found = _KEPT.get(owner)
    if found is None:
        found = _KEPT.setdefault(owner, make())
    return found


def replica(replica_id: int) -> Replica | None:
    """The replica a worker's `Need` names (None once its plan is gone)."""
    return _LIVE.get(replica_id)


def reached_names(reads: Iterable[tuple[Any, str, Any]], modules: Iterable[str]) -> dict[str, set[str]]:
    """The names read (namespace, name, object), by user module: those of `modules`, and any other
    module whose namespace was read (a submodule reached through an attribute chain)."""
    by_namespace = {id(vars(m)): name for name, m in list(sys.modules.items())  # not under an alias:
                    if m is not None and getattr(m, "__name__", None) == name  # (`__mp_main__` is `__main__`)
                    and (name in modules or is_user_module(name))}
    names: dict[str, set[str]] = {}
    for namespace, name, _ in reads:
        module_name = by_namespace.get(id(namespace))
        if module_name is not None:
            names.setdefault(module_name, set()).add(name)
    for module_name in modules:
        names.setdefault(module_name, set())
    return names


# --- pickling the caller's objects ------------------------------------------------------------------


class _Payload(ByValuePickler):
    """Pickles a module's object for another process's copy of that module: its functions rebuilt
    there from this process's code over *that* module's globals (`_rebuilt`), the object itself
    by value even when its module would let it travel by reference (the point is to replace what
    the reference finds there); anything else as `dumps` would."""

    def __init__(self, file: Any, roots: Iterable[Any], **kwargs: Any):
        super().__init__(file, protocol=5, **kwargs)
        roots = list(roots)
        self.roots = {id(root) for root in roots}  # (alive: the caller holds them while it pickles)
        # the classes defined in a root class's body (`Outer.Inner`) are part of it (`_class_here`)
        self.nests = tuple((root.__module__, f"{root.__qualname__}.") for root in roots if isinstance(root, type))
        self.travels: dict[int, bool] = {}  # class members tried alone (`_members`): id -> whether they pickle

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, types.FunctionType):
            home = _home(obj)
            if home is not None:
                return _rebuilt, (home, obj.__code__, obj.__name__, obj.__qualname__, obj.__defaults__,
                                  obj.__kwdefaults__, _cells(obj), dict(vars(obj)))
        elif isinstance(obj, type) and type(obj).__module__ == "_ctypes" and not resolves(obj):
            # (`c_int * 2` makes a type no other process can find, and cloudpickle cannot rebuild)
            raise pickle.PicklingError(f"the ctypes type {obj.__qualname__} was made at run time")
        elif isinstance(obj, type) and (id(obj) in self.roots or self._nested(obj)):
            made = cloudpickle.cloudpickle._dynamic_class_reduce(obj)  # (how to make it, should the worker lack it)
            state, slots = made[2]
            own = {k: v for k, v in vars(obj).items() if k not in _OWN_MEMBERS and not _slot(v)}  # (cloudpickle's
            # state leaves out what a base holds too, which a class made anew inherits but the worker's may not)
            # a plain class is updated in place whatever it holds; another (an Enum) is kept where it is the same
            plain = (type(obj), obj.__bases__, vars(obj).get("__slots__")) if type(obj) in _PLAIN_METACLASSES else None
            stamp = b"" if plain else stamp_of(obj)
            return (_class_here, (obj.__module__, obj.__qualname__, stamp, plain, made[0], made[1]),
                    (self._members(own), {**self._members(state), "__qualname__": obj.__qualname__}, slots, made[5]),
                    None, None, _class_state)
        elif type(obj) is functools.cached_property:  # (its lock does not pickle)
            return _cached_property, (obj.func, obj.attrname)
        elif id(obj) in self.roots and callable(obj) and hasattr(obj, "__wrapped__") and hasattr(obj, "__dict__"):
            return object.__reduce_ex__(obj, 2)  # a node: by value, not by its module's name for it
        return super().reducer_override(obj)

    def _nested(self, cls: type) -> bool:
        """Whether `cls` was defined in a root class's body: by reference it would be the worker's
        own nested class as its import made it, not what the caller has since made of it
        (`Outer.Inner.factor = 10`)."""
        if not self.nests:
            return False
        module, qualname = cls.__module__, cls.__qualname__
        return "<locals>" not in qualname and any(module == m and qualname.startswith(start) for m, start in self.nests)

    def _members(self, members: dict[str, Any]) -> dict[str, Any]:
        """A class's members, each that does not pickle (a lock) replaced by its stamp (`_Unsent`):
        the worker keeps its own where that is the same, and refuses the plan where it is not. Each
        member is tried alone, once (a class in it travels by reference then: it is tried as a
        member of its own)."""
        sent = {}
        for name, member in members.items():
            travels = isinstance(member, type) or self.travels.get(id(member))
            if travels is None:
                try:
                    _Payload(io.BytesIO(), ()).dump(member)
                    travels = True
                except Exception:
                    travels = False
                self.travels[id(member)] = travels
            sent[name] = member if travels else _Unsent(stamp_of(member), f"{type(member).__module__}."
                                                                          f"{type(member).__qualname__}")
        return sent


class _Unsent(NamedTuple):
    """A class's member that could not be pickled, by its stamp and its type (`_Payload._members`)."""
    stamp: bytes
    kind: str


# what `_class_here` made of each class it found, for `_class_state`: "keep" it as it is, or
# "update" it (weak keys: an unpickling that failed between the two leaves nothing behind)
_FOUND: weakref.WeakKeyDictionary[type, str] = weakref.WeakKeyDictionary()


def _cached_property(func: Callable[[Any], Any], attrname: str | None) -> functools.cached_property[Any]:
    made = functools.cached_property(func)  # (`__set_name__` would check the class it is set on)
    made.attrname = attrname
    return made


def _class_here(module_name: str, qualname: str, stamp: bytes, plain: tuple[type, tuple[type, ...], Any] | None,
                make: Callable[..., type], newargs: tuple[Any, ...]) -> type:
    """The worker's own class `qualname` of `module_name`, which `_class_state` then makes the
    caller's where it stands: the instances the worker's import made (`MODEL = Model()`), other
    modules' names for it (`from model import Model`) and every reference to it in the caller's
    objects (a class defined in its body, a sibling's base, an attribute, `super()` in its methods)
    all land on that one class. A class bound anew (as a class by value would be) left
    `MODEL = Model()` on the old one, and a class defined in another's body, by reference, stayed
    the worker's as its import made it (`Outer.Inner.factor = 10` never reached it). One the worker
    lacks, or cannot update in place (another metaclass, such as an Enum's; other bases or slots),
    is made by value (cloudpickle's `make`)."""
    found = _importable(module_name)
    for part in qualname.split("."):
        found = vars(found).get(part) if isinstance(found, (type, types.ModuleType)) else None
    if isinstance(found, type) and found.__qualname__ == qualname:
        if plain is not None and plain == (type(found), found.__bases__, vars(found).get("__slots__")):
            _FOUND[found] = "update"
            return found
        if plain is None and stamp_of(found) == stamp:  # the same as the caller's: left as it is (an Enum's members)
            _FOUND[found] = "keep"
            return found
    return make(*newargs)


def _importable(module_name: str) -> types.ModuleType | None:
    """The worker's module `module_name`, when it can import it; never its `__main__`, which is not
    the caller's script (the script's classes travel by value)."""
    if module_name == "__main__":
        return None
    try:
        return sys.modules.get(module_name) or importlib.import_module(module_name)
    except Exception:
        return None


def _class_state(cls: type, state: tuple[dict[str, Any], dict[str, Any], dict[str, Any], Callable[..., Any]]) -> None:
    """`cls` given the caller's members (all of them, and as cloudpickle's state has them): the
    worker's own class updated member by member (its methods' `super()` names it already: they
    were pickled with a reference to it), or a class made by value given them as cloudpickle gives
    them. A member that could not travel (`_Unsent`) must be the worker's own as it stands, else
    the plan is refused, naming it."""
    members, made, slots, setstate = state
    found = _FOUND.pop(cls, None)
    if found == "keep":
        return
    unsent = {name: member for name, member in members.items() if type(member) is _Unsent}
    for name, member in unsent.items():
        if found is None or stamp_of(vars(cls).get(name, ABSENT)) != member.stamp:
            raise ReplicaError(_refusal(cls.__module__, f"{made['__qualname__']}.{name}", member))
    if found is None:
        setstate(cls, (made, slots))
        return
    for name in [k for k, v in vars(cls).items() if k not in _OWN_MEMBERS and k not in members and not _slot(v)]:
        delattr(cls, name)
    for name, member in members.items():
        if name not in unsent and vars(cls).get(name, ABSENT) is not member:
            setattr(cls, name, member)
    for registered in made.get("_abc_impl") or ():  # an ABC's virtual subclasses (`Scalar.register(int)`)
        cls.register(registered)  # type: ignore[attr-defined]


def _home(func: types.FunctionType) -> str | None:
    """The user module whose globals `func` runs in, if it is one (not `__main__`: its code travels by value)."""
    name = func.__globals__.get("__name__")
    module = sys.modules.get(name) if isinstance(name, str) else None
    if module is None or name == "__main__" or vars(module) is not func.__globals__ or not is_user_module(name):
        return None
    return name


def _cells(func: types.FunctionType) -> tuple[Any, ...] | None:
    if func.__closure__ is None:
        return None
    values = []
    for cell in func.__closure__:
        try:
            values.append(cell.cell_contents)
        except ValueError:
            values.append(_EMPTY)
    return tuple(values)


class _Empty:
    def __reduce__(self) -> str:
        return "_EMPTY"


_EMPTY = _Empty()


def _rebuilt(module_name: str, code: types.CodeType, name: str, qualname: str, defaults: Any, kwdefaults: Any,
             cells: tuple[Any, ...] | None, attributes: dict[str, Any]) -> types.FunctionType:
    """A function of the caller's, over this process's copy of its module's globals."""
    module = importlib.import_module(module_name)
    closure = None if cells is None else tuple(types.CellType() if v is _EMPTY else types.CellType(v) for v in cells)
    func = types.FunctionType(code, vars(module), name, defaults, closure)
    func.__qualname__, func.__kwdefaults__ = qualname, kwdefaults
    func.__dict__.update(attributes)
    return func


def _payload(module_name: str, value: Any) -> bytes | None:
    """`value` pickled for another process's `module_name`, or None when it cannot be."""
    try:
        file = io.BytesIO()
        _Payload(file, (value,)).dump(value)
        return file.getvalue()
    except Exception:
        return None


def dump_values(values: Any, buffer_callback: Callable[[Any], bool] | None = None) -> bytes:
    """A `Values` message (`workers.messages`), big buffers out of band (`transport.pack`'s
    `dump`), each object pickled as `_payload` pickles it: a class or a node by value, where its
    reference would find the worker's own."""
    file = io.BytesIO()
    objects = values.values if isinstance(values.values, dict) else {}
    _Payload(file, objects.values(), buffer_callback=buffer_callback).dump(values)
    return file.getvalue()


def _refusal(module_name: str, name: str, value: Any) -> str:
    kind = value.kind if type(value) is _Unsent else f"{type(value).__module__}.{type(value).__qualname__}"
    return (f"{module_name}.{name} in the calling process ({kind}) is not what this worker's import of "
            f"{module_name} made, and it cannot be sent (it does not pickle): hardy will not run the pipeline "
            f"with another value under that name. Build it where it is used (inside the node, or in a "
            f"@stateful class), or pass it to the pipeline as an input.")


# --- the worker's side -----------------------------------------------------------------------------


class Refusal(str):
    """Why a worker will not load a plan (a `ReplicaError`'s sentence): its items come back as
    `PipelineRefused`, which the caller raises as one `ReplicaError`."""

HELD: dict[tuple[str, str], bytes] = {}  # (module, name) -> the stamp this worker's copy has now, as installed
_INSTALLS = [0]  # changes of HELD so far (`Synced.current`)


class Synced:
    """A plan's replica on the worker: the caller's stamps, and what it has of the caller's objects
    (payloads as bytes, or objects a `Need` brought), to make the modules match again before a
    chunk of this plan whenever another plan's sync changed them."""

    def __init__(self, header: bytes):
        self.id, entries, self.files, caller = pickle.loads(header)
        self.home = caller == os.getpid()  # an engine running tasks in the caller's own process (Dask's threads)
        self.stamps = {(m, n): stamp for m, names in entries.items() for n, (stamp, _) in names.items()}
        self.payloads: dict[tuple[str, str], Any] = {
            (m, n): payload for m, names in entries.items() for n, (_, payload) in names.items() if payload is not None}
        self.fetched: dict[tuple[str, str], Any] = {}
        self.checked = -1  # `_INSTALLS` when `current` last found it current

    def current(self) -> bool:
        """Whether this worker's modules hold what the caller's stamps say, as far as it installed them
        (asked before every chunk: answered from the last answer while nothing was installed since)."""
        if self.home or self.checked == _INSTALLS[0]:
            return True
        if all(HELD.get(key) == stamp for key, stamp in self.stamps.items()):
            self.checked = _INSTALLS[0]
            return True
        return False

    def sync(self, fetch: Fetch | None) -> None:
        """Make each name the caller's: compare, install what travelled, fetch the rest (or refuse).
        Names this worker already made the caller's for this stamp are not compared again: a node
        that changes its module's state here changes it for the next calls, as it would in-process."""
        if self.home:  # these modules are the caller's own
            return
        differing = []
        for (module_name, name), stamp in self.stamps.items():
            if HELD.get((module_name, name)) == stamp:
                continue
            module = _module(module_name, self.files.get(module_name))
            mine = _names_stamp(_own_names(module)) if name == NAMES else stamp_of(vars(module).get(name, ABSENT))
            if mine == stamp:
                HELD[(module_name, name)] = stamp
                _INSTALLS[0] += 1
            else:
                differing.append((module_name, name))
        wanted = [key for key in differing if key not in self.payloads and key not in self.fetched]
        if wanted:
            if fetch is None:
                raise ReplicaError(_cannot_ask(wanted, self.stamps))
            got = fetch(self.id, wanted)
            if isinstance(got, str):
                raise ReplicaError(got)
            self.fetched.update(got)
        for key in differing:  # (a class before the values holding its instances: the order names were read)
            self.install(key)

    def install(self, key: tuple[str, str]) -> None:
        module_name, name = key
        stamp = self.stamps[key]
        module = _module(module_name, self.files.get(module_name))
        value = self.fetched[key] if key in self.fetched else pickle.loads(self.payloads[key])
        if name == NAMES:  # names the caller's module does not bind: gone here too
            for extra in set(_own_names(module)) - set(value):
                delattr(module, extra)
        elif stamp == ABSENT_STAMP:
            vars(module).pop(name, None)
        elif vars(module).get(name, ABSENT) is not value:  # (a class is the worker's own, made the caller's)
            setattr(module, name, value)
        HELD[key] = stamp
        _INSTALLS[0] += 1


# Members a class keeps when it is updated (`_class_state`): tied to the class object its `class`
# statement made (`_abc_impl`: an ABC's registered subclasses), never moved to another.
_OWN_MEMBERS = frozenset({"__dict__", "__weakref__", "__module__", "__qualname__", "__slots__", "_abc_impl"})
_PLAIN_METACLASSES = (type, abc.ABCMeta)


def _slot(member: Any) -> bool:
    """Whether a class member is a slot's descriptor, which belongs to the class that made it
    (cloudpickle leaves them out of the class it rebuilds: the worker's own are kept)."""
    return isinstance(member, (types.MemberDescriptorType, types.GetSetDescriptorType))


def _own_names(module: types.ModuleType) -> list[str]:
    return [n for n in vars(module) if not (n.startswith("__") and n.endswith("__"))]


def _module(name: str, file: str | None) -> types.ModuleType:
    """This process's copy of the caller's module `name`: imported as usual, else from the file the
    caller loaded it from (a relative entry of sys.path meant another folder then), else an empty
    module the caller's objects fill (the file was deleted, or broken, since the caller imported it)."""
    module = sys.modules.get(name)
    if module is not None:
        return module
    try:
        return importlib.import_module(name)
    except Exception:
        pass
    spec = importlib.util.spec_from_file_location(name, file) if file and os.path.isfile(file) else None
    module = importlib.util.module_from_spec(spec) if spec is not None else types.ModuleType(name)
    module.__file__ = file
    sys.modules[name] = module
    try:
        if spec is not None and spec.loader is not None:
            spec.loader.exec_module(module)
    except Exception:  # broken since: the caller's objects fill it instead (`Synced.install`)
        vars(module).update(__name__=name, __file__=file)
    parent, _, child = name.rpartition(".")
    if parent and parent in sys.modules:
        setattr(sys.modules[parent], child, module)
    return module


def _cannot_ask(wanted: Wanted, stamps: dict[tuple[str, str], bytes]) -> str:
    names = ", ".join(f"{m}.{n}" for m, n in wanted)
    resources = [f"{m}.{n}" for m, n in wanted if stamps[(m, n)].startswith(RESOURCE)]
    why = "it does not pickle" if resources else "it did not travel with the plan"
    return (f"{names}: the calling process has other values there than this worker's import of the module, and "
            f"{why}. Build such values inside the node (or a @stateful class), or pass them as inputs.")
