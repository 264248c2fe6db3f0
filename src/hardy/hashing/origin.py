"""Where code comes from: the user's (hashed by content) or a library's (by name and version)."""

from __future__ import annotations

import os
import sys
import sysconfig

_LIBRARY_ROOTS = tuple({p for p in (sysconfig.get_paths().get("purelib"), sysconfig.get_paths().get("platlib"),
                                    sysconfig.get_paths().get("stdlib"), sysconfig.get_paths().get("platstdlib"))
                        if p})


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
        return module_name not in sys.builtin_module_names and module_name not in sys.stdlib_module_names
    user = is_user_file(path)
    _USER[module_name] = user  # a loaded module's file does not move: resolving it once is enough
    return user


def is_user_file(path: str) -> bool:
    path = os.path.realpath(path)
    return not any(path.startswith(root + os.sep) for root in _REAL_ROOTS) \
        and "site-packages" not in path and "dist-packages" not in path


_REAL_ROOTS = tuple(os.path.realpath(root) for root in _LIBRARY_ROOTS)
_USER: dict[str, bool] = {}
