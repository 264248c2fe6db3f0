"""The caller's objects pickled for a worker's copy of their module (`shipping.replica` decides
which, and installs them there).

A function travels as its code, rebuilt there over the worker's own module globals (`_rebuilt`):
the module stays one module and reads the same state. A class travels as a reduction that, unpickled,
*is* the worker's own class (`_class_here`), which its state then makes the caller's member by member
(`_class_state`): the instances the worker's import made, other modules' names for it and every
reference to it in what travels (a class defined in another's body, a sibling's base, a dict of
handlers, the cell `super()` reads) land on that one object. A member that does not pickle (a lock)
travels as its stamp (`_Unsent`); a `singledispatch` function as its implementations (`_dispatcher`).
Another object a user module binds at top level, met inside what travels (`MISSING` in
`DEFAULTS = {"wd": MISSING}`, a class attribute, a function's default), travels as its name
(`Bound`), and is the worker's object of that name there: `v is MISSING` holds in both processes.
Anything else travels as `dumps` would send it, by value where its module would let it go by reference.
A name bound to a proxy that poses as a function (a `wrapt` decorator's wrapper) or to an `lru_cache`
function travels by its parts (`reductions.whole`), never as what it wraps nor by that name.
"""

from __future__ import annotations

import abc
import contextvars
import enum
import functools
import importlib
import io
import pickle
import sys
import types
import weakref
from collections.abc import Callable
from typing import Any, NamedTuple

import cloudpickle

from ..errors import ReplicaError
from ..hashing import is_user_module
from ..hashing.callables import resolves
from ..hashing.state import registered as registered_in
from ..hashing.state import stamp_of
from ..hashing.values import ABSENT, member_attributes
from .pickling import ByValuePickler
from .reductions import made_with_its_class, whole


class _Payload(ByValuePickler):
    """Pickles a module's object for another process's copy of that module (see the module's
    docstring): `roots`, the objects pickled, by (module, name); `classes`, the classes those modules
    bind, by the same, so that a class met anywhere in them lands on the worker's own."""

    def __init__(self, file: Any, roots: dict[tuple[str, str], Any], classes: dict[tuple[str, str], type] | None = None,
                 bound: Bound | None = None, probed: set[int] | None = None, **kwargs: Any):
        super().__init__(file, protocol=5, **kwargs)
        self.roots = {id(root) for root in roots.values()}  # (alive: the caller holds them while it pickles)
        self.bound = bound  # the objects the modules bind at top level, which travel by name
        self.probed = probed  # (`Bound.reaches`' probe: every such object met is noted, and travels by name)
        # where the worker finds its own of each root, and of each class its module binds (`classes`: the
        # module and name it is bound to, as `Legacy = Model` then `class Model` binds two classes of one
        # qualified name; `MODEL = Model()` must land on the worker's `Model`), and of each class defined
        # in a root class's body (`Outer.Inner`: under that root's name)
        self.where = {id(c): (module, (name,)) for (module, name), c in (classes or {}).items()}
        self.where.update((id(root), (module, (name,))) for (module, name), root in roots.items())
        self.nests = [(root.__module__, f"{root.__qualname__}.", module, name)
                      for (module, name), root in roots.items() if isinstance(root, type)]
        self.travels: dict[int, bool] = {}  # class members tried alone (`_members`): id -> whether they pickle

    def reducer_override(self, obj: Any) -> Any:
        if id(obj) in self.roots and (parts := whole(obj)) is not None:  # (a wrapt proxy, an lru_cache function:
            return parts  # by its parts, not by the name the worker's own is bound to)
        kind = type(obj)  # (not `isinstance`: a proxy posing as a function or class is not one, `reductions.poses`)
        if kind is types.FunctionType and _dispatches(obj):  # (one found nowhere is made anew)
            return _dispatcher, (*(self._where(obj) or (obj.__module__, ())), dict(obj.registry))
        if self.bound is not None and id(obj) not in self.roots and (found := self.bound.where.get(id(obj))):
            if self.probed is not None:
                self.probed.add(id(obj))
            # (one that refers back to what is pickled travels by value, as its part: see `Bound.reaches`)
            if self.probed is not None or not self.bound.reaches(id(obj), self.roots):
                return _bound, found
        if kind is types.FunctionType:
            home = _home(obj)
            if home is not None:
                return _rebuilt, (home, obj.__code__, obj.__name__, obj.__qualname__, obj.__defaults__,
                                  obj.__kwdefaults__, _cells(obj), dict(vars(obj)))
        elif issubclass(kind, type) and kind.__module__ == "_ctypes" and not resolves(obj):
            # (`c_int * 2` makes a type no other process can find, and cloudpickle cannot rebuild)
            raise pickle.PicklingError(f"the ctypes type {obj.__qualname__} was made at run time")
        elif issubclass(kind, type) and (where := self._where(obj, by_name=False)):
            # how to make it, should the worker lack it
            made = made_with_its_class(obj, cloudpickle.cloudpickle._dynamic_class_reduce(obj))
            state, slots = made[2]
            own = {k: v for k, v in vars(obj).items() if k not in _OWN_MEMBERS and not _slot(v)}  # (cloudpickle's
            # state leaves out what a base holds too, which a class made anew inherits but the worker's may not)
            # a plain class is updated in place whatever it holds; another (an Enum) is kept where it is the same
            plain = (type(obj), obj.__bases__, vars(obj).get("__slots__")) if type(obj) in _PLAIN_METACLASSES else None
            stamp = b"" if plain else stamp_of(obj)
            return (_class_here, (*where, obj.__qualname__, stamp, plain, made[0], made[1]),
                    (self._members(own), {**self._members(state), "__qualname__": obj.__qualname__}, slots, made[5],
                     {m.name: member_attributes(m) for m in obj} if issubclass(obj, enum.Enum) else {}),
                    None, None, _class_state)
        elif kind is functools.cached_property:  # (its lock does not pickle)
            return _cached_property, (obj.func, obj.attrname)
        elif issubclass(kind, type) and id(obj) in self.roots:  # (one the worker cannot find: by value)
            return made_with_its_class(obj, cloudpickle.cloudpickle._dynamic_class_reduce(obj))
        elif id(obj) in self.roots and callable(obj) and hasattr(obj, "__wrapped__") and hasattr(obj, "__dict__"):
            return object.__reduce_ex__(obj, 2)  # a node: by value, not by its module's name for it
        return super().reducer_override(obj)

    def _where(self, obj: Any, by_name: bool = True) -> tuple[str, tuple[str, ...]] | None:
        """Where the worker finds its own `obj` (a class, a `singledispatch` function): a root's
        module and name; a class defined in a root class's body, under that root (by reference it
        would be the worker's as its import made it, not what the caller has since made of it:
        `Outer.Inner.factor = 10`); else, `by_name`, its module and qualified name, where they find
        it here too (another class travels by reference: its module's own stamps follow it). None
        where nothing does (it travels as `dumps` sends it)."""
        found = self.where.get(id(obj))
        if found is not None:
            return found
        qualname = obj.__qualname__
        if "<locals>" in qualname:
            return None
        for module, start, bound, name in self.nests:
            if obj.__module__ == module and qualname.startswith(start):
                return bound, (name, *qualname[len(start):].split("."))
        path = tuple(qualname.split("."))
        return (obj.__module__, path) if by_name and _walk(obj.__module__, path) is obj else None

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
                    _Payload(io.BytesIO(), {}).dump(member)
                    travels = True
                except Exception:
                    travels = False
                self.travels[id(member)] = travels
            sent[name] = member if travels else _Unsent(stamp_of(member), f"{type(member).__module__}."
                                                                          f"{type(member).__qualname__}")
        return sent


class Bound:
    """The objects that a replica's user modules bind at top level (`vars(module)[name] is obj`),
    each with the (module, name, stamp) under which a worker finds its own. Met inside a value that
    travels, such an object travels as that name (`_bound`), not as a copy: a copy of
    `MISSING = object()` in `DEFAULTS = {"wd": MISSING}` would not be the worker's `MISSING`, and
    `v is MISSING` would be False there. Objects that pickle as themselves are left out (numbers,
    strings, None; classes, modules and Enum members, which travel by reference already), and so
    are plain dicts, lists, tuples and sets, which pickle saves without asking. Made once
    per replica, kept by it, and found by its id for the objects a worker asks for (`dump_values`)."""

    def __init__(self, replica_id: int, objects: dict[str, dict[str, Any]], stamps: dict[str, dict[str, bytes]]):
        self.where: dict[int, tuple[str, str, bytes]] = {}
        self.objects: dict[int, Any] = {}  # (held: an id stands for its object only while it lives)
        for module_name, names in objects.items():
            for name, obj in names.items():  # (a name bound to an object bound before: the first name)
                if name in stamps[module_name] and _has_identity(obj) and id(obj) not in self.where:
                    self.where[id(obj)] = (module_name, name, stamps[module_name][name])
                    self.objects[id(obj)] = obj
        self.refs: dict[int, set[int]] = {}  # what each one's own pickle refers to by name
        _BOUND[replica_id] = self

    def reaches(self, start: int, targets: set[int]) -> bool:
        """Whether the object `start` refers, through the objects travelling by name, to one of
        `targets` (what is being pickled). Such a one travels by value inside it: a worker
        installing one name's value, then the other's it refers to, would come back to the first
        half made. Each object's references are found once, by pickling it (`_Sink`)."""
        seen: set[int] = set()
        todo = [start]
        while todo:
            at = todo.pop()
            if at in targets:
                return True
            if at not in seen:
                seen.add(at)
                todo.extend(self._refs(at))
        return False

    def _refs(self, at: int) -> set[int]:
        if at not in self.refs:
            obj = self.objects[at]
            probed: set[int] = set()
            try:
                _Payload(_Sink(), {self.where[at][:2]: obj}, bound=self, probed=probed).dump(obj)
            except Exception:  # (it cannot travel by value at all: the worker keeps its own, or refuses)
                pass
            self.refs[at] = probed
        return self.refs[at]


_BOUND: weakref.WeakValueDictionary[int, Bound] = weakref.WeakValueDictionary()  # by replica id


class _Sink:
    """A file that keeps nothing (`Bound._refs` pickles only to see what an object refers to)."""

    def write(self, data: Any) -> int:
        return len(data)


_IDENTICAL = (int, float, complex, str, bytes, type(None), type, types.ModuleType, enum.Enum)
# (the C pickler saves these itself, never asking `reducer_override`: they travel by value, as before)
_SAVED_BY_PICKLE = frozenset({dict, list, tuple, set, frozenset, bytearray})


def _has_identity(obj: Any) -> bool:
    """Whether a copy of `obj` would not be `obj` to code that asks `is`, and `_Payload` can send
    it by name instead (see `Bound`)."""
    return not isinstance(obj, _IDENTICAL) and type(obj) not in _SAVED_BY_PICKLE and obj is not ABSENT


# The worker's side: how a name met in a payload finds the worker's object (`shipping.replica`'s
# sync sets it while it installs, and installs the caller's object first where the name differs)
RESOLVE: contextvars.ContextVar[Callable[[str, str, bytes], Any] | None] = contextvars.ContextVar(
    "hardy_resolve", default=None)


def _bound(module_name: str, name: str, stamp: bytes) -> Any:
    """This process's object bound to `name` in `module_name`, which stands for the caller's
    (`stamp`): the sync under way finds it (`RESOLVE`); else it is this process's own object, where
    its stamp is the caller's."""
    resolve = RESOLVE.get()
    if resolve is not None:
        return resolve(module_name, name, stamp)
    found = vars(_importable(module_name) or types.ModuleType(module_name)).get(name, ABSENT)
    if stamp_of(found, module_name) != stamp:
        raise ReplicaError(unmatched(module_name, name))
    return found


def unmatched(module_name: str, name: str) -> str:
    return (f"{module_name}.{name} is held by a value that travels to this worker, and this worker's "
            f"{module_name}.{name} is not what the calling process has there: hardy will not run the pipeline "
            f"with another object in its place. Keep the two values from referring to each other, or pass "
            f"them to the pipeline as inputs.")


class _Unsent(NamedTuple):
    """A class's member that could not be pickled, by its stamp and its type (`_Payload._members`)."""
    stamp: bytes
    kind: str


# what `_class_here` made of each class it found, for `_class_state`: "keep" it as it is, or
# "update" it (weak keys: an unpickling that failed between the two leaves nothing behind)
_FOUND: weakref.WeakKeyDictionary[type, str] = weakref.WeakKeyDictionary()


def _dispatches(func: types.FunctionType) -> bool:
    """Whether `func` is a user module's `functools.singledispatch` function: its own globals are
    functools', so it would travel by reference, and the worker's has none of the implementations
    the caller registered since (`@fmt.register(int)`)."""
    registry = getattr(func, "registry", None)
    return (isinstance(registry, types.MappingProxyType) and object in registry
            and callable(getattr(func, "dispatch", None)) and callable(getattr(func, "_clear_cache", None))
            and is_user_module(func.__module__))


def _dispatcher(module_name: str, path: tuple[str, ...], registry: dict[type, Callable[..., Any]]
                ) -> Callable[..., Any]:
    """The worker's own `singledispatch` function found at `path`, given the caller's implementations
    (other modules' names for it see them too); made anew where the worker lacks it or holds an
    implementation the caller does not (none can be taken back)."""
    found = _walk(module_name, path)
    usable = isinstance(found, types.FunctionType) and _dispatches(found)
    if not usable or set(vars(found)["registry"]) - set(registry):
        found = functools.singledispatch(registry[object])
    for cls, impl in registry.items():
        if found.registry.get(cls) is not impl:
            found.register(cls, impl)
    return found  # type: ignore[no-any-return]


def _walk(module_name: str, path: tuple[str, ...]) -> Any:
    """What this process's `module_name` holds at `path`, a name then attributes of classes (None: nothing)."""
    found: Any = _importable(module_name)
    for part in path:
        found = vars(found).get(part) if isinstance(found, (type, types.ModuleType)) else None
    return found


def _cached_property(func: Callable[[Any], Any], attrname: str | None) -> functools.cached_property[Any]:
    made = functools.cached_property(func)  # (`__set_name__` would check the class it is set on)
    made.attrname = attrname
    return made


def _class_here(module_name: str, path: tuple[str, ...], qualname: str, stamp: bytes,
                plain: tuple[type, tuple[type, ...], Any] | None, make: Callable[..., type],
                newargs: tuple[Any, ...]) -> type:
    """The worker's own class at `path` in `module_name` (where the caller's is bound; a class of
    another qualified name there is not it), which `_class_state` then makes the
    caller's where it stands: the instances the worker's import made (`MODEL = Model()`), other
    modules' names for it (`from model import Model`) and every reference to it in the caller's
    objects (a class defined in its body, a sibling's base, an attribute, `super()` in its methods)
    all land on that one class. A class bound anew (as a class by value would be) left
    `MODEL = Model()` on the old one, and a class defined in another's body, by reference, stayed
    the worker's as its import made it (`Outer.Inner.factor = 10` never reached it). One the worker
    lacks, or cannot update in place (another metaclass, such as an Enum's; other bases or slots),
    is made by value (cloudpickle's `make`)."""
    found = _walk(module_name, path)
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


def _class_state(cls: type, state: tuple[dict[str, Any], dict[str, Any], dict[str, Any], Callable[..., Any],
                                        dict[str, dict[str, Any]]]) -> None:
    """`cls` given the caller's members (all of them, and as cloudpickle's state has them): the
    worker's own class updated member by member (its methods' `super()` names it already: they
    were pickled with a reference to it), or a class made by value given them as cloudpickle gives
    them. A member that could not travel (`_Unsent`) must be the worker's own as it stands, else
    the plan is refused, naming it."""
    members, made, slots, setstate, attributes = state
    found = _FOUND.pop(cls, None)
    if found == "keep":
        return
    for name, held in attributes.items():  # an Enum's members' own (its class made anew gave them none)
        vars(vars(cls)["_member_map_"][name]).update(held)
    unsent = {name: member for name, member in members.items() if type(member) is _Unsent}
    for name, member in unsent.items():
        if found is None or stamp_of(vars(cls).get(name, ABSENT)) != member.stamp:
            raise ReplicaError(refusal(cls.__module__, f"{made['__qualname__']}.{name}", member))
    if found is None:
        setstate(cls, (made, slots))
        return
    for name in [k for k, v in vars(cls).items() if k not in _OWN_MEMBERS and k not in members and not _slot(v)]:
        delattr(cls, name)
    for name, member in members.items():
        if name not in unsent and vars(cls).get(name, ABSENT) is not member:
            setattr(cls, name, member)
    if isinstance(cls, abc.ABCMeta):
        _registered(cls, made.get("_abc_impl") or [])


def _registered(cls: abc.ABCMeta, registered: list[type]) -> None:
    """An ABC's virtual subclasses made the caller's (`Scalar.register(int)`), the ones it no longer
    has (a reload) taken back; held here too (the ABC holds them weakly, and a class of the script,
    made by value, has no other holder)."""
    if registered_in(cls) == set(registered):
        return
    cls._abc_registry_clear()  # type: ignore[attr-defined]
    cls._abc_caches_clear()  # type: ignore[attr-defined]
    for sub in registered:
        cls.register(sub)
    _HELD.extend(registered)


_HELD: list[type] = []


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


def payload(module_name: str, name: str, value: Any, classes: dict[tuple[str, str], type] | None = None,
            bound: Bound | None = None) -> bytes | None:
    """`value`, bound to `name` in `module_name`, pickled for another process's copy of that module
    (`classes`: the classes it binds, by (module, name); `bound`: the objects its modules bind,
    which travel by name), or None when it cannot be (`unsendable` says why)."""
    found = _pickled(module_name, name, value, classes, bound)
    return found if isinstance(found, bytes) else None


def unsendable(module_name: str, name: str, value: Any, bound: Bound | None = None) -> str:
    """Why `value` cannot be pickled for a worker (`payload`), in words: the error itself (a wrapper
    kept the function it replaced, a ctypes type made at run time, a `__reduce__` that raised), not
    merely that it failed; "" when it can be."""
    found = _pickled(module_name, name, value, None, bound)
    return "" if isinstance(found, bytes) else f"{type(found).__name__}: {found}"


def _pickled(module_name: str, name: str, value: Any, classes: dict[tuple[str, str], type] | None,
             bound: Bound | None) -> bytes | Exception:
    try:
        file = io.BytesIO()
        _Payload(file, {(module_name, name): value}, classes, bound).dump(value)
        return file.getvalue()
    except Exception as exc:
        return exc


def dump_values(values: Any, buffer_callback: Callable[[Any], bool] | None = None) -> bytes:
    """A `Values` message (`workers.messages`), big buffers out of band (`transport.pack`'s
    `dump`), each object pickled as `_payload` pickles it: a class or a node by value, where its
    reference would find the worker's own; the other objects its replica's modules bind, by name
    (all in one pickle: an object two of them hold arrives as one)."""
    file = io.BytesIO()
    objects = values.values if isinstance(values.values, dict) else {}
    _Payload(file, objects, bound=_BOUND.get(values.replica), buffer_callback=buffer_callback).dump(values)
    return file.getvalue()


def refusal(module_name: str, name: str, value: Any, why: str = "it does not pickle", node: str = "") -> str:
    """Why a worker cannot be given the caller's `value`: `why`, the pickling error itself where
    there is one (`unsendable`), and `node`, the node that reads it, where it is known."""
    kind = value.kind if type(value) is _Unsent else f"{type(value).__module__}.{type(value).__qualname__}"
    reader = f"; node {node!r} reads it" if node else ""
    return (f"{module_name}.{name} in the calling process ({kind}) is not what this worker's import of "
            f"{module_name} made, and it cannot be sent ({why}){reader}: hardy will not run the pipeline "
            f"with another value under that name. Build it where it is used (inside the node, or in a "
            f"@stateful class), or pass it to the pipeline as an input.")


# Members a class keeps when it is updated (`_class_state`): tied to the class object its `class`
# statement made (`_abc_impl`: an ABC's registered subclasses), never moved to another.
_OWN_MEMBERS = frozenset({"__dict__", "__weakref__", "__module__", "__qualname__", "__slots__", "_abc_impl",
                          "__class__"})  # (a proxy's `__class__` property: only a `class` statement can give it)
_PLAIN_METACLASSES = (type, abc.ABCMeta)


def _slot(member: Any) -> bool:
    """Whether a class member is a slot's descriptor, which belongs to the class that made it
    (cloudpickle leaves them out of the class it rebuilds: the worker's own are kept)."""
    return isinstance(member, (types.MemberDescriptorType, types.GetSetDescriptorType))
