"""What each kind of callable contributes to a code fingerprint (the table in docs/caching.md).

A callable is more than a function: a bound method runs its instance's state, a `partial` its
arguments, a `singledispatch` function every registered implementation, a numba dispatcher its
Python function under its compile options, a decorator both its own code and the function it
wraps, a C function the library (or Python) it ships with. `kind_of` names the kind of an object
and each kind's fingerprinter feeds what that kind runs, recursing through `recurse` (the
dispatcher in `code.py`, which also holds the two kinds made of bytecode: functions and classes).
Nothing here keys a callable by its name alone: a library callable is keyed by its distribution
(`distributions.py`) and only when its module binds it under that name, so a function a library
made at run time (`np.frompyfunc`) is not mistaken for one it ships; what cannot be keyed raises
`UnhashableError` naming the callable and the fixes.
"""

from __future__ import annotations

import ast
import functools
import os
import sys
import types
from collections.abc import Callable
from typing import Any

from ..errors import CALLABLE_FIXES, UnhashableError
from .distributions import file_identity, is_extension, module_identity
from .origin import is_user_file, is_user_module
from .values import encode_attributes, encode_into, registered, type_name

Out = Callable[[bytes], Any]
Seen = dict[int, tuple[int, Any]]
Recurse = Callable[[Any, Out, Seen], None]

_C_CODE = (types.BuiltinFunctionType, types.WrapperDescriptorType, types.MethodWrapperType,
           types.MethodDescriptorType, types.ClassMethodDescriptorType)


def kind_of(obj: Any) -> str:
    """The kind of callable `obj` is, as the fingerprint table names it."""
    t = type(obj)
    if t is types.FunctionType:
        if isinstance(getattr(obj, "registry", None), types.MappingProxyType) and hasattr(obj, "dispatch"):
            return "singledispatch"
        if is_user_function(obj):
            return "function"
        return "library wrapper" if getattr(obj, "__wrapped__", None) is not None else "library function"
    if t is types.MethodType:
        return "classmethod" if isinstance(obj.__self__, type) else "bound method"
    if isinstance(obj, type):
        return "class" if is_user_module(obj.__module__) and not _compiled(obj.__module__) else "library class"
    return _kind_of_object(obj, t)


def _kind_of_object(obj: Any, t: type) -> str:
    if isinstance(obj, functools.partial):
        return "partial"
    if isinstance(obj, functools.partialmethod):
        return "partialmethod"
    if isinstance(obj, functools.singledispatchmethod):
        return "singledispatchmethod"
    if isinstance(obj, (staticmethod, classmethod)):
        return "staticmethod"
    if isinstance(obj, _C_CODE):
        owner = getattr(obj, "__self__", None)
        return "C function" if owner is None or isinstance(owner, (types.ModuleType, type)) else "bound C method"
    if hasattr(obj, "cache_parameters") and getattr(obj, "__wrapped__", None) is not None:
        return "lru_cache"
    if not registered(t):
        module = getattr(obj, "__module__", None) if isinstance(getattr(obj, "__qualname__", None), str) else None
        if isinstance(module, str) and not is_user_module(module):  # a function of another implementation
            return "library wrapper" if getattr(obj, "__wrapped__", None) is not None else "library function"
        if _compiled(module):  # a Cython function of the user's, built in place
            return "C function"
        if not is_user_module(t.__module__) and getattr(obj, "__wrapped__", None) is not None:
            return "library wrapper"
    return "callable object" if callable(obj) else "not callable"


_USER_CODE: dict[str, bool] = {}


def is_user_function(func: Any) -> bool:
    """A function is the user's when its module is and its code was not written in a library: a
    library decorator copies the user's `__module__` onto its own wrapper (`functools.wraps`)."""
    if not is_user_module(func.__module__):
        return False
    path = func.__code__.co_filename
    known = _USER_CODE.get(path)
    if known is None:
        known = _USER_CODE[path] = not os.path.isabs(path) or is_user_file(path)  # exec'd code is the user's
    return known


def _compiled(module_name: str | None) -> bool:
    """Whether a user module is compiled code (a C extension or Cython module built by the user):
    no bytecode to read, keyed by its file's content."""
    if not module_name or not is_user_module(module_name):
        return False
    return is_extension(getattr(sys.modules.get(module_name), "__file__", None))


def resolves(obj: Any) -> bool:
    """Whether `obj` is what its module binds under its qualified name: then that name, with the
    module's distribution, identifies it (what pickle checks before pickling by reference)."""
    module = sys.modules.get(getattr(obj, "__module__", None) or "")
    qualname = getattr(obj, "__qualname__", None)
    if module is None or not isinstance(qualname, str) or "<locals>" in qualname:
        return False
    target: Any = module
    for part in qualname.split("."):
        target = getattr(target, part, None)
    return target is obj or (target is not None and type(target) is type(obj) and _same(target, obj))


def _same(a: Any, b: Any) -> bool:
    try:
        return bool(a == b)  # a C method bound to a class is made anew on each access: equal, not identical
    except Exception:
        return False


def annotations_of(func: Any) -> dict[str, Any]:
    """A function's annotations as `typing.get_type_hints` reads them: one written as text (under
    `from __future__ import annotations`, a compiler flag that must not move a key) evaluated in
    the function's globals where it is a plain name, attribute or subscript (`"np.ndarray"`,
    `"list[int]"`), so that `x: int` gives one key with or without the flag; the text where it
    cannot be (a name defined later). None where they cannot be read at all."""
    try:
        found = getattr(func, "__annotations__", None)
    except Exception:  # (lazily evaluated annotations naming what is not defined)
        return {}
    if not isinstance(found, dict):
        return {}
    globs = getattr(func, "__globals__", None)
    return {name: _evaluated(hint, globs) if isinstance(hint, str) and isinstance(globs, dict) else hint
            for name, hint in found.items()}


_PLAIN = (ast.Expression, ast.Name, ast.Attribute, ast.Subscript, ast.Tuple, ast.List, ast.Constant, ast.Load,
          ast.BinOp, ast.BitOr)  # what an annotation's text may hold to be evaluated: no call, no operator else


def _evaluated(text: str, globs: dict[str, Any]) -> Any:
    try:
        tree = ast.parse(text, mode="eval")
        if all(isinstance(n, _PLAIN) for n in ast.walk(tree)) and "__builtins__" in globs:
            return eval(compile(tree, "<annotation>", "eval"), globs)
    except Exception:
        pass
    return text


# --- the kinds -----------------------------------------------------------------------------------


def bound_method(obj: Any, out: Out, seen: Seen, recurse: Recurse) -> None:
    """The function, and the content of the instance it runs on (a fitted model's coefficients)."""
    out(b"method")
    recurse(obj.__func__, out, seen)
    bound_object(obj.__self__, obj, out, seen, recurse)


def classmethod_(obj: Any, out: Out, seen: Seen, recurse: Recurse) -> None:
    """A method bound to a class: the function and the class (its code, or its library)."""
    out(b"classmethod")
    recurse(obj.__func__, out, seen)
    recurse(obj.__self__, out, seen)


def bound_c_method(obj: Any, out: Out, seen: Seen, recurse: Recurse) -> None:
    """A C method bound to an object (`lookup.get`, `(3).__mul__`): its type's code, by the
    distribution (or Python) that ships it, and the object's content."""
    owner = type(obj.__self__)
    out(b"cmethod:" + module_identity(owner.__module__) + b":" + type_name(owner) + obj.__name__.encode())
    bound_object(obj.__self__, obj, out, seen, recurse)


def bound_object(instance: Any, method: Any, out: Out, seen: Seen, recurse: Recurse) -> None:
    """What a method is bound to: a callable by its own kind, anything else by content; an object
    without deterministic content refuses the callable (`CALLABLE_FIXES`)."""
    if callable(instance) and kind_of(instance) not in ("callable object", "not callable"):
        recurse(instance, out, seen)
    else:
        strictly(instance, method, "the instance it is bound to", out)


def strictly(value: Any, callable_: Any, role: str, out: Out) -> None:
    """`value`'s content, or the refusal naming the callable that carries it and the fixes."""
    try:
        encode_into(value, out, set())
    except UnhashableError as exc:
        raise refusal(callable_, role, value, exc) from None


def refusal(callable_: Any, role: str, value: Any, exc: UnhashableError) -> UnhashableError:
    where = role + "".join(exc.path)
    what = (f"{where} is a {exc.culprit.__module__}.{exc.culprit.__qualname__}, which has no deterministic content"
            if exc.culprit is not None else f"{where}: {exc.detail}")
    owner = f"{type(value).__module__}.{type(value).__qualname__}" if is_user_module(type(value).__module__) \
        else "a class of yours wrapping it"
    return UnhashableError(f"{describe(callable_)} cannot be keyed by what it runs: {what}; "
                           f"{CALLABLE_FIXES.format(owner=owner)}", exc.culprit, exc.path)


def describe(obj: Any) -> str:
    name = getattr(obj, "__qualname__", None) or type(obj).__qualname__
    module = getattr(obj, "__module__", None) or type(obj).__module__
    kind = kind_of(obj)
    return f"the {kind} {module}.{name}" if kind != "callable object" else f"the callable {module}.{name} object"


def partial(obj: Any, out: Out, seen: Seen, recurse: Recurse) -> None:
    """`partial` and `partialmethod`: the function, then the arguments it binds."""
    out(b"partial" + type_name(type(obj)))
    recurse(obj.func, out, seen)
    strictly((tuple(obj.args), dict(obj.keywords)), obj, "its bound arguments", out)


def singledispatch(obj: Any, out: Out, seen: Seen, recurse: Recurse) -> None:
    """Every registered implementation, by the type it is registered for."""
    out(b"singledispatch")
    for cls, impl in sorted(obj.registry.items(), key=lambda item: type_name(item[0])):
        out(b"for:" + type_name(cls))
        recurse(impl, out, seen)


def singledispatchmethod(obj: Any, out: Out, seen: Seen, recurse: Recurse) -> None:
    out(b"singledispatchmethod")
    recurse(obj.dispatcher, out, seen)


def staticmethod_(obj: Any, out: Out, seen: Seen, recurse: Recurse) -> None:
    out(b"descriptor" + type_name(type(obj)))
    recurse(obj.__func__, out, seen)


def lru_cache(obj: Any, out: Out, seen: Seen, recurse: Recurse) -> None:
    """The function it wraps; `typed=True` too (`f(1)` and `f(1.0)` are then separate calls)."""
    out(b"lru_cache" + (b"typed" if obj.cache_parameters().get("typed") else b""))
    recurse(obj.__wrapped__, out, seen)


def library_function(obj: Any, out: Out, seen: Seen, recurse: Recurse) -> None:
    """A library's function, class or C function, by its distribution and name when its module
    binds it under that name; a function a library made at run time (a closure of a factory) by
    its code and the values it closes over; a C function made at run time cannot be keyed."""
    module = getattr(obj, "__module__", None)
    if isinstance(obj, type) and not resolves(obj):
        out(b"libclass:" + module_identity(module or "") + type_name(obj))
        return  # the class's code is walked by `code.py`, as a user class's
    if isinstance(obj, types.FunctionType) and (is_user_module(module) or not resolves(obj)):
        library_closure(obj, out, seen, recurse)  # made at run time, or named after the user's function it wraps
        return
    if not isinstance(obj, (type, types.FunctionType)) and not resolves(obj):
        raise UnhashableError(f"{describe(obj)} ({obj!r}) was made at run time, so neither its name nor its "
                              "library identify what it computes; call the function it was made from in the "
                              "node instead, or opt the node out with @node(cache=False)")
    where = _code_identity(obj) if isinstance(obj, types.FunctionType) else module_identity(module or "")
    out(b"lib:" + where + b":" + f"{module}.{obj.__qualname__}".encode())


def _code_identity(func: Any) -> bytes:
    path = func.__code__.co_filename
    return file_identity(path) if os.path.isabs(path) else module_identity(func.__module__ or "")


def library_closure(func: Any, out: Out, seen: Seen, recurse: Recurse) -> None:
    """A function a library made at run time (a factory's closure, a decorator's wrapper that
    copied the user function's name): its code, by its library, and the values it closes over,
    which configure it, by `configuration`'s rules."""
    out(b"libclosure:" + _code_identity(func) + b":" + func.__code__.co_name.encode())
    for name, cell in zip(func.__code__.co_freevars, func.__closure__ or ()):
        out(b"c:" + name.encode())
        if _filled(cell):
            configuration(cell.cell_contents, func, name, out, seen, recurse)


def c_function(obj: Any, out: Out, seen: Seen, recurse: Recurse) -> None:
    """A function or method written in C (or Cython): by the distribution (or Python version) that
    ships its module, or by the content of the user's own compiled module."""
    owner = getattr(obj, "__self__", None)
    module: str | None
    if isinstance(owner, types.ModuleType):
        module = owner.__name__
    elif isinstance(owner, type):
        module = owner.__module__
    else:
        module = getattr(getattr(obj, "__objclass__", None), "__module__", None) or getattr(obj, "__module__", None)
    out(b"C:" + module_identity(module or "builtins") + b":" + f"{module}.{obj.__qualname__}".encode())


def library_wrapper(obj: Any, out: Out, seen: Seen, recurse: Recurse) -> None:
    """A library's decorator around a function (`torch.compile`, `torch.no_grad()`, a retry
    decorator): the library's code by its distribution, the function it wraps, and, when that is
    the user's code, the decorator's configuration: the values it closes over or holds, the user's
    strictly, the library's own state (locks, compile caches) where it has a content."""
    function = type(obj) is types.FunctionType  # (not `isinstance`: a wrapt wrapper poses as the function it wraps)
    module = getattr(obj, "__module__", None) if not function else None
    where = _code_identity(obj) if function else module_identity(type(obj).__module__)
    out(b"wrapper:" + where + b":" + type_name(type(obj)) + str(module).encode())
    wrapped = obj.__wrapped__
    recurse(wrapped, out, seen)
    if not _wraps_user_code(wrapped):
        return
    state: dict[str, Any] | None
    if function:
        state = {n: c.cell_contents for n, c in zip(obj.__code__.co_freevars, obj.__closure__ or ())
                 if _filled(c)}
    elif (state := wrapper_parts(obj)) is None:
        state = {n: v for n, v in getattr(obj, "__dict__", {}).items() if not n.startswith("__")}
    for name, value in sorted(state.items()):
        if value is not wrapped:
            out(b"s:" + name.encode())
            configuration(value, obj, name, out, seen, recurse)


# What a wrapt function wrapper (`@wrapt.decorator`) holds besides the function it wraps, as wrapt
# names its slots (`_self_wrapper`, ...) and `_FunctionWrapperBase.__init__` its arguments; `owner`
# came with wrapt 2. Its `__dict__` is the wrapped function's (a proxy forwards it).
WRAPPER_PARTS = ("instance", "wrapper", "enabled", "binding", "parent", "owner")


def wrapper_parts(obj: Any) -> dict[str, Any] | None:
    """A wrapt function wrapper's parts (`WRAPPER_PARTS`: the decorator's own code, the instance a
    bound one has), None for another object. Its decorator is the user's code, which a key holds
    with what it reads, as a node's own."""
    kind = type(obj)
    wrapt = sys.modules.get("wrapt")
    if wrapt is None or not any(c.__name__ == "_FunctionWrapperBase" for c in kind.__mro__):
        return None
    return {part: getattr(obj, f"_self_{part}") for part in WRAPPER_PARTS if hasattr(obj, f"_self_{part}")}


def _filled(cell: Any) -> bool:
    try:
        return cell.cell_contents is not _EMPTY  # an empty cell raises
    except ValueError:
        return False


_EMPTY = object()


def _wraps_user_code(func: Any) -> bool:
    for _ in range(100):  # the innermost function of a stack of decorators
        inner = getattr(func, "__wrapped__", None)
        if inner is None or isinstance(func, types.MethodType):
            break
        func = inner
    func = getattr(func, "__func__", func)
    if isinstance(func, types.FunctionType):
        return is_user_function(func)
    return is_user_module(getattr(func, "__module__", None) or type(func).__module__)


def configuration(value: Any, carrier: Any, name: str, out: Out, seen: Seen, recurse: Recurse) -> None:
    """A library decorator's value: a callable by its kind, a value by content. One that cannot be
    keyed refuses the node when it is the user's; the library's own (a lock, a compiler's cache, its
    internal callbacks) is state, keyed by what it holds that has a content, one level down."""
    if _users(value):
        if callable(value) and kind_of(value) != "callable object":
            recurse(value, out, seen)
        else:
            strictly(value, carrier, f"the value it holds as {name!r}", out)
        return
    kept, written = dict(seen), list[bytes]()
    try:
        if callable(value) and kind_of(value) != "callable object":
            recurse(value, written.append, seen)
        else:
            encode_into(value, written.append, set())
        out(b"".join(written))
        return
    except UnhashableError:
        seen.clear()
        seen.update(kept)  # what the failed attempt noted was not written
    if isinstance(value, types.MethodType):  # a method of the library's own object: the object's state
        out(b"~method:" + getattr(value.__func__, "__qualname__", "?").encode())
        value = value.__self__
    out(b"~state:" + type_name(type(value)))
    for attr, inner in sorted((getattr(value, "__dict__", None) or {}).items()):
        written = list[bytes]()
        try:
            encode_into(inner, written.append, set())
        except UnhashableError:
            continue
        out(b"=" + attr.encode() + b"".join(written))


def _users(value: Any) -> bool:
    """Whether a value a decorator holds is the user's: code, an object of a user class, or a
    callable wrapping user code."""
    if isinstance(value, types.FunctionType):
        return is_user_function(value)
    if isinstance(value, type):
        return is_user_module(value.__module__)
    if isinstance(value, types.MethodType):
        return _users(value.__self__) or _users(value.__func__)
    if is_user_module(type(value).__module__):
        return True
    return getattr(value, "__wrapped__", None) is not None and _wraps_user_code(value)


def callable_object(obj: Any, out: Out, seen: Seen, recurse: Recurse) -> None:
    """An object called as a function: its class (the user's code, or its library) and its
    content (`np.vectorize` by the function it vectorizes and its options, a user's object or a
    library's by its attributes), strictly."""
    out(b"object")
    recurse(type(obj), out, seen)
    t = type(obj)
    if is_user_module(t.__module__) or registered(t):
        strictly(obj, obj, "the object", out)
    elif hasattr(obj, "__dict__") and isinstance(_inherited_call(t), types.FunctionType):
        try:  # a library's callable object without an encoder (a scorer, a polynomial): its attributes
            encode_attributes(vars(obj), out, set())
        except UnhashableError as exc:
            raise refusal(obj, "the object", obj, exc) from None
    else:  # called in C, made at run time (np.frompyfunc(f, 1, 1)): what it runs is out of sight
        raise UnhashableError(f"{describe(obj)} ({obj!r}) has no code or content hardy can read, and its library "
                              "did not make it under a name; call the function it was made from in the node "
                              "instead, or opt the node out with @node(cache=False)")


def _inherited_call(t: type) -> Any:
    """The `__call__` a class runs, written in Python or in C."""
    return next((vars(c)["__call__"] for c in t.__mro__ if "__call__" in vars(c)), None)


def not_callable(obj: Any, out: Out, seen: Seen, recurse: Recurse) -> None:
    raise UnhashableError(f"cannot fingerprint {obj!r}: it is not a function")


KINDS: dict[str, Callable[[Any, Out, Seen, Recurse], None]] = {
    "bound method": bound_method, "classmethod": classmethod_, "bound C method": bound_c_method,
    "partial": partial, "partialmethod": partial, "singledispatch": singledispatch,
    "singledispatchmethod": singledispatchmethod, "staticmethod": staticmethod_, "lru_cache": lru_cache,
    "library function": library_function, "library class": library_function, "C function": c_function,
    "library wrapper": library_wrapper,
    "callable object": callable_object, "not callable": not_callable,
}
"""The kinds fingerprinted here, by name; `code.py` adds "function" and "class"."""
