"""Where code comes from: the user's (hashed by content) or a library's (by its distribution,
`distributions.py`). A package the user installed from a local folder or file (`pip install ./mypkg`,
`pip install -e .`) is the user's: its version says nothing about edits made since. What a
library's module holds that is the user's (`user_made`: a patch; `renamed`: another function) or small plain data
(`small_data`: `sys.argv`) is keyed by what it is, not by the library's distribution."""

from __future__ import annotations

import functools
import os
import sys
import types
from typing import Any

from .distributions import folders, is_local_install


def is_user_module(module_name: str | None) -> bool:
    """User code is whatever is not the standard library, an installed package, or hardy itself.

    Code of unknown origin (exec'd, no module) counts as user code: it is hashed by its content.
    """
    if not module_name:
        return True
    known = _USER.get(module_name)
    if known is not None:
        return known
    if module_name == "builtins" or module_name.split(".")[0] == "hardy":
        return False
    if module_name == "__main__":
        return True
    module = sys.modules.get(module_name)
    path = getattr(module, "__file__", None)
    if module is None or path is None:
        parts = list(getattr(module, "__path__", None) or ())  # a namespace package: where its parts are
        if parts:
            user = any(is_user_file(os.path.join(part, "__init__.py")) for part in parts)
            _USER[module_name] = user
            return user
        return module_name not in sys.builtin_module_names and module_name not in sys.stdlib_module_names
    user = is_user_file(path)
    _USER[module_name] = user  # a loaded module's file does not move: resolving it once is enough
    return user


def is_user_file(path: str) -> bool:
    """Whether code read from `path` is the user's: outside the standard library and the site
    directories, or installed there from a local folder or file."""
    real = os.path.realpath(path)
    if real.startswith(folders("purelib", "platlib", "stdlib", "platstdlib")) or "site-packages" in real \
            or "dist-packages" in real:
        return is_local_install(real)
    return True


_USER: dict[str, bool] = {}


def absolute_module(name: str, globs: dict[str, Any]) -> str:
    """The module an import inside a function names, a relative one (`from .helpers import f`,
    kept with its dots by `bytecode._scan_chains`) resolved as Python does, from the package of the
    function whose globals are `globs`; "" where it cannot be (the import fails the same way when
    it runs)."""
    if not name.startswith("."):
        return name
    import importlib.util
    package = globs.get("__package__") or globs.get("__name__", "").rpartition(".")[0]
    try:
        return importlib.util.resolve_name(name, package)
    except (ImportError, ValueError):
        return ""


def small_data(value: Any, depth: int) -> bool:
    """Plain data of at most `SMALL_DATA` items, nested at most `depth` deep: a library's value a
    script may set (`sys.argv`), keyed by content and watched at each call at little cost."""
    if value is None or isinstance(value, (bool, int, float, complex, str, bytes)):
        return True
    if type(value) in (list, tuple, set, frozenset) and len(value) <= SMALL_DATA and depth > 0:
        return all(small_data(v, depth - 1) for v in value)
    if type(value) is dict and len(value) <= SMALL_DATA and depth > 0:
        return all(small_data(k, 0) and small_data(v, depth - 1) for k, v in value.items())
    return False


SMALL_DATA = 64


def user_made(value: Any) -> bool:
    """Whether `value`, found in a library's module, is user code or made at run time: put there by
    a script (`math.sqrt = my_sqrt`), which a worker's import of the library does not do. A function
    or class of a user module, a `functools.partial` (`json.dumps = partial(json.dumps, indent=2)`),
    a user's object or its bound method, a mock (`mock.patch("math.sqrt", return_value=0.5)`)."""
    if isinstance(value, functools.partial) or any(
            c.__name__ == "NonCallableMock" and c.__module__ == "unittest.mock" for c in type(value).__mro__):
        return True
    if isinstance(value, (types.FunctionType, type)):
        return _user_home(getattr(value, "__module__", None))
    if isinstance(value, types.MethodType):  # a bound method: of a user's object, or a user's function
        func = value.__func__
        return (isinstance(func, types.FunctionType) and user_made(func)) or _users_object(value.__self__)
    return callable(value) and _users_object(value)


def _users_object(value: Any) -> bool:
    """An instance of a class of a user module (not a module, a class or a C function)."""
    return not isinstance(value, (types.BuiltinFunctionType, types.ModuleType, type)) \
        and _user_home(type(value).__module__)


def _user_home(module_name: Any) -> bool:
    """A user module that code is defined in: the script, or one loaded from a file. Not a module
    of unknown origin (`is_user_module` counts those as the user's): an extension's types
    (`pybind11_builtins`, Cython's `_cython_3_2_4`) and a library's generated functions name such."""
    if not isinstance(module_name, str):
        return False
    home = sys.modules.get(module_name)
    return home is not None and (module_name == "__main__" or getattr(home, "__file__", None) is not None) \
        and is_user_module(module_name)


def renamed(value: Any, name: str) -> bool:
    """Whether a library's module holds under `name` a function or class of another name: an alias
    of its own (`np.abs`, `np.absolute`), or a script's swap (`math.sqrt = math.exp`)."""
    own = getattr(value, "__name__", None) if callable(value) else None
    return isinstance(own, str) and own != name
