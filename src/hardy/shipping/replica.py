"""A worker as a replica of the caller: the user modules a plan reaches, made what the caller has.

A worker imports the user's modules itself, from disk, when it first loads a plan. What it gets
can differ from what the calling process runs: the caller reloaded a module (or `%autoreload`
did), a file was edited since the caller imported it, a notebook cell was run again, or the caller
set module state at run time (`steps.WEIGHTS = load(...)`, a dict filled from `sys.argv`). The
caller's compiled plan reads names in those modules; a worker computing from other objects under
the same names would return another answer, silently. How each object travels is
`shipping.payload`'s.

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

import builtins
import importlib
import importlib.util
import itertools
import os
import pickle
import sys
import types
import weakref
from collections.abc import Callable, Iterable
from typing import Any

from ..errors import ReplicaError, UnhashableError
from ..hashing import is_user_module
from ..hashing.code import code_fingerprint, python_own
from ..hashing.origin import renamed, user_made
from ..hashing.state import ABSENT_STAMP, RESOURCE, module_stamp, stamp_of
from ..hashing.values import ABSENT
from .payload import RESOLVE, Bound, payload, refusal, unmatched, unsendable
from .pickling import PATCHED

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

    def __init__(self, reached: dict[str, set[str]], aliases: dict[str, str] | None = None,
                 reader: Callable[[str, str], str] | None = None):
        self.id = next(self._ids)
        self.reader = reader  # (the node that reads a module's name, for a refusal: `plans._reader`)
        self.aliases = aliases or {}  # (`module_aliases`)
        self.objects: Names = {}
        self.stamps: Names = {}
        self.read = reached
        self.files: dict[str, str | None] = {}
        for module_name in sorted(reached):
            module = sys.modules[module_name]
            if is_script(module_name) or not is_user_module(module_name):  # only what the plan reads (builtins,
                # a library's patched names: a worker's own others stay)
                names = sorted(reached[module_name])
                self.stamps[module_name] = module_stamp(module, names)
                self.objects[module_name] = {n: vars(module).get(n, ABSENT) for n in names}
                if module_name != "builtins" and not is_script(module_name):
                    _with_what_patches_read(self.stamps[module_name], self.objects[module_name])
            else:
                names = _own_names(module)
                self.stamps[module_name] = {**module_stamp(module, names), NAMES: _names_stamp(names)}
                self.objects[module_name] = {**{n: vars(module)[n] for n in names}, NAMES: sorted(names)}
            self.files[module_name] = SCRIPT if is_script(module_name) else getattr(module, "__file__", None)
        self.found: Bound | None = None
        _LIVE[self.id] = self

    def bound(self) -> Bound:
        """The objects these modules bind at top level, by identity (`payload.Bound`: met inside a
        value that travels, each travels by name), found once: when the plan is first shipped."""
        if self.found is None:
            self.found = Bound(self.id, self.objects, self.stamps)
        return self.found

    def header(self, everything: bool) -> bytes:
        """What travels with the plan: every stamp, with the caller's object pickled for the names
        the plan reads when it is small (`everything`: every object that pickles, for an engine's
        worker that cannot ask back)."""
        entries: Names = {}
        for module_name, stamps in self.stamps.items():
            read = self.read.get(module_name, set()) | {NAMES}
            entries[module_name] = {}
            objects = self.objects[module_name]
            classes = {(module_name, n): v for n, v in objects.items() if isinstance(v, type)}  # (once a module)
            for name, stamp in stamps.items():
                sent = (payload(module_name, name, objects[name], classes, self.bound())
                        if everything or name in read else None)
                if sent is not None and not everything and len(sent) > SMALL:
                    sent = None
                entries[module_name][name] = (stamp, sent)
        return pickle.dumps((self.id, entries, self.files, os.getpid(), self.aliases), protocol=5)

    def values(self, wanted: Wanted) -> dict[tuple[str, str], Any]:
        """The objects a worker asked for (`payload.dump_values` finds their `bound` by this replica's id)."""
        self.bound()
        return {(m, n): self.objects.get(m, {}).get(n) for m, n in wanted}

    def refusal(self, wanted: Wanted) -> str:
        """Why one of the objects asked for cannot be sent (the worker then refuses the plan)."""
        for module_name, name in wanted:
            value = self.objects.get(module_name, {}).get(name)
            why = unsendable(module_name, name, value, bound=self.bound())
            if why:
                return refusal(module_name, name, value, why, self.reader(module_name, name) if self.reader else "")
        return "the objects asked for cannot be sent to the worker"


NAMES = ""  # the entry of a module's stamps for the set of names it binds (no name can be empty)


def builtins_read(reads: Iterable[tuple[Any, str, Any]]) -> set[str]:
    """The names code reads as globals that its module lacks, so that Python finds them in
    `builtins`, and that Python did not put there (`builtins.THRESHOLD = 0.5` at run time, gettext's
    `_`, kernprof's `profile`): a worker's builtins lack them (a node raised NameError there). Each
    travels as a name of the module `builtins` (`Replica`: stamped, sent, installed there), one
    the calling process lacks too as absent (a worker drops what an earlier plan installed)."""
    namespace = vars(builtins)
    found = set()
    for where, name, value in reads:
        if ((where is namespace or (value is ABSENT and type(where) is dict and "__name__" in where))
                and not python_own(name, namespace.get(name, ABSENT))):
            found.add(name)
    return found


def _with_what_patches_read(stamps: dict[str, bytes], objects: dict[str, Any]) -> None:
    """A library's patched names stamped with what the patch reads too (`math.sqrt = lambda x: x * K`
    reads K, a closure's list, a partial's arguments): the worker's copy, pickled with what it read
    then, is made again when that changes (a name's stamp is its code alone)."""
    for name, value in objects.items():
        if user_made(value):
            try:
                stamps[name] += b"|" + code_fingerprint(value)
            except UnhashableError:  # (the key refuses it too, naming it)
                pass


def library_patches(reads: Iterable[tuple[Any, str, Any]]) -> dict[str, set[str]]:
    """The names of library modules that code reads and that hold user code (`math.sqrt = my_sqrt`,
    `json.dumps = ...` at run time, a callback handed to a library's module), by module: a worker's
    import of the library has its own there. Each travels as a name of that module (`Replica`), and
    a worker puts its own back once a plan that does not carry it runs (`Synced.sync`)."""
    found: dict[str, set[str]] = {}
    for where, name, value in reads:
        module_name = where.get("__name__") if type(where) is dict else None
        if (isinstance(module_name, str) and (user_made(value) or renamed(value, name)) and module_name != "builtins"
                and getattr(sys.modules.get(module_name), "__dict__", None) is where
                and not is_user_module(module_name)):
            found.setdefault(module_name, set()).add(name)
    return found


def is_script(module_name: str) -> bool:
    """`__main__`, or a script a launcher ran (`runpy.run_path("train.py")`, which names it `<run_path>`
    or its `run_name`): a module with a file but no import spec, whose file is the script itself.
    Or a module whose top level ran a map (`import job` of a file with no `__main__` guard, and
    `hardy run job:pipeline`), from then on: a worker importing it would run that map again.
    A worker never imports or runs it (that would repeat what the script did: `_module`)."""
    module = sys.modules.get(module_name)
    spec = getattr(module, "__spec__", None)
    if getattr(spec, "_initializing", False) is True and _running_here(module):  # (importlib's mark)
        _MAPPED_AT_IMPORT.add(module_name)
    return module_name == "__main__" or not all(part.isidentifier() for part in module_name.split(".")) or (
        module is not None and spec is None and isinstance(getattr(module, "__file__", None), str)) or (
        module_name in _MAPPED_AT_IMPORT)


_MAPPED_AT_IMPORT: set[str] = set()  # the modules whose top level built a plan that reads them


def _running_here(module: Any) -> bool:
    """Whether `module`'s top level is running in this thread (it called the map), not merely being
    imported by another thread as this one compiles a plan that reads it."""
    namespace = vars(module)
    frame: types.FrameType | None = sys._getframe(1)
    while frame is not None and not (frame.f_globals is namespace and frame.f_code.co_name == "<module>"):
        frame = frame.f_back
    return frame is not None


SCRIPT = "\0script"  # a module's file, for a worker: a script, never imported or run there (no path holds a NUL)


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
    by_namespace = {id(m.__dict__): name for name, m in list(sys.modules.items())  # not under an alias:
                    if getattr(m, "__name__", None) == name  # (`__mp_main__` is `__main__`)
                    and hasattr(m, "__dict__")}  # (anything may sit in sys.modules: an object with slots)
    names: dict[str, set[str]] = {}
    for namespace, name, _ in reads:
        module_name = by_namespace.get(id(namespace))
        # only a module that was read is asked whether it is the user's (the first map's hundreds of
        # loaded modules would each cost a look at their distribution)
        if module_name is not None and (module_name in modules or is_user_module(module_name)):
            names.setdefault(module_name, set()).add(name)
    for module_name in modules:
        names.setdefault(module_name, set())
    return names


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
        self.id, entries, self.files, caller, self.aliases = pickle.loads(header)
        self.home = caller == os.getpid()  # an engine running tasks in the caller's own process (Dask's threads)
        self.stamps = {(m, n): stamp for m, names in entries.items() for n, (stamp, _) in names.items()}
        self.payloads: dict[tuple[str, str], Any] = {
            (m, n): payload for m, names in entries.items() for n, (_, payload) in names.items() if payload is not None}
        self.fetched: dict[tuple[str, str], Any] = {}
        self.checked = -1  # `_INSTALLS` when `current` last found it current
        self.installing: set[tuple[str, str]] = set()

    def current(self) -> bool:
        """Whether this worker's modules hold what the caller's stamps say, as far as it installed them
        (asked before every chunk: answered from the last answer while nothing was installed since)."""
        if self.home or self.checked == _INSTALLS[0]:
            return True
        if (all(HELD.get(key) == stamp for key, stamp in self.stamps.items()) and PATCHED.keys() <= self.stamps.keys()
                and ALIASED.keys() <= self.aliases.keys()
                and all(sys.modules.get(a) is sys.modules.get(m) for a, m in self.aliases.items())):
            self.checked = _INSTALLS[0]
            return True
        return False

    def sync(self, fetch: Fetch | None) -> None:
        """Make each name the caller's: compare, install what travelled, fetch the rest (or refuse).
        Names this worker already made the caller's for this stamp are not compared again: a node
        that changes its module's state here changes it for the next calls, as it would in-process."""
        if self.home:  # these modules are the caller's own
            return
        for key in [k for k in PATCHED if k not in self.stamps]:  # a library's own again where this plan reads it
            _unpatch(key)
        for alias in [a for a in ALIASED if a not in self.aliases]:  # this worker's own module under that name again
            _unalias(alias)
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
        if wanted and fetch is None:
            raise ReplicaError(_cannot_ask(wanted, self.stamps))
        resolving = RESOLVE.set(self.resolve)
        try:
            if wanted and fetch is not None:  # every differing name: in one pickle, what two hold arrives as one
                got = fetch(self.id, [key for key in differing if key not in self.fetched])
                if isinstance(got, str):
                    raise ReplicaError(got)
                self.fetched.update(got)
            for key in differing:  # (a class before the values holding its instances: the order names were read)
                if HELD.get(key) != self.stamps[key]:  # (unless a value holding it installed it first)
                    self.install(key)
        finally:
            RESOLVE.reset(resolving)
        for alias, module_name in self.aliases.items():
            _alias(alias, _module(module_name, self.files.get(module_name)))

    def resolve(self, module_name: str, name: str, stamp: bytes) -> Any:
        """The object a name stands for in the caller's value being installed (`payload.Bound`):
        this worker's own where its stamp is the caller's, else the caller's, installed first."""
        key = (module_name, name)
        if (HELD.get(key) != stamp and self.stamps.get(key) == stamp and key not in self.installing
                and (key in self.fetched or key in self.payloads)):
            self.install(key)
        found = vars(_module(module_name, self.files.get(module_name))).get(name, ABSENT)
        if HELD.get(key) != stamp or found is ABSENT:
            raise ReplicaError(unmatched(module_name, name))
        return found

    def install(self, key: tuple[str, str]) -> None:
        module_name, name = key
        stamp = self.stamps[key]
        module = _module(module_name, self.files.get(module_name))
        self.installing.add(key)
        try:
            value = self.fetched[key] if key in self.fetched else pickle.loads(self.payloads[key])
        finally:
            self.installing.discard(key)
        if name == NAMES:  # names the caller's module does not bind: gone here too
            for extra in set(_own_names(module)) - set(value):
                delattr(module, extra)
        elif stamp == ABSENT_STAMP:
            vars(module).pop(name, None)
        elif vars(module).get(name, ABSENT) is not value:  # (a class is the worker's own, made the caller's)
            own = vars(module).get(name, ABSENT)  # (a builtin's own kept too: a patch may call it, `own_object`)
            if not is_user_module(module_name) and (module_name != "builtins" or own is not ABSENT):
                PATCHED.setdefault(key, own)
            setattr(module, name, value)
        HELD[key] = stamp
        _INSTALLS[0] += 1


def _unpatch(key: tuple[str, str]) -> None:
    """Put a library's own object back where a plan had installed the caller's patch."""
    module_name, name = key
    own = PATCHED.pop(key)
    if own is ABSENT:
        vars(sys.modules[module_name]).pop(name, None)
    else:
        setattr(sys.modules[module_name], name, own)
    HELD.pop(key, None)
    _INSTALLS[0] += 1


ALIASED: dict[str, Any] = {}  # a name of sys.modules pointed at another module -> this worker's own entry there


def _alias(alias: str, module: types.ModuleType) -> None:
    """`sys.modules[alias]` made the caller's module (`module_aliases`), this worker's own entry kept
    to put back (`_unalias`) once a plan that does not carry the alias runs."""
    if sys.modules.get(alias) is module:
        return
    ALIASED.setdefault(alias, sys.modules.get(alias, ABSENT))
    sys.modules[alias] = module
    _INSTALLS[0] += 1


def _unalias(alias: str) -> None:
    own = ALIASED.pop(alias)
    if own is ABSENT:
        sys.modules.pop(alias, None)
    else:
        sys.modules[alias] = own
    _INSTALLS[0] += 1


def module_aliases(reads: Iterable[tuple[Any, str, Any]]) -> dict[str, str]:
    """The names of `sys.modules` that code imports (`import settings` inside a node) and that the
    caller pointed at a module of another name (`sys.modules["settings"] = settings_prod`), each
    with that module's name: a worker's import of the name would load another file (or none). The
    module travels under its own name (`Replica`), and the worker points the alias at it (`_alias`)."""
    found = {}
    for where, name, value in reads:
        own = getattr(value, "__name__", None) if where is sys.modules else None
        if isinstance(value, types.ModuleType) and isinstance(own, str) and own != name \
                and sys.modules.get(own) is value and not is_script(own):
            found[name] = own
    return found


def _own_names(module: types.ModuleType) -> list[str]:
    """The names a module binds for its code, besides the interpreter's; a module's own
    `__getattr__` and `__dir__` (PEP 562) are its code, answering for the names it does not bind."""
    return [n for n in vars(module) if not (n.startswith("__") and n.endswith("__")) or n in _MODULE_HOOKS]


_MODULE_HOOKS = ("__getattr__", "__dir__")


def _module(name: str, file: str | None) -> types.ModuleType:
    """This process's copy of the caller's module `name`: imported as usual, else from the file the
    caller loaded it from (a relative entry of sys.path meant another folder then), else an empty
    module the caller's objects fill (the file was deleted, or broken, since the caller imported it;
    or a script, `SCRIPT`)."""
    module = sys.modules.get(name)
    if module is not None:
        return module
    if file == SCRIPT:  # (a script a launcher ran: never imported or run again here)
        file = None
    else:
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
