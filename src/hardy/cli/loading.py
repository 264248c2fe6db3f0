"""What `hardy run MODULE:PIPELINE` runs: the module imported as Python imports it, and the
pipeline in it. Whatever goes wrong there is a usage error (exit code 2) naming the fix: a file
path given for a module (`sub/flows.py`), a module that cannot be imported, raises or exits while
imported, a name that is no pipeline. Its message points at the user's own line, not at the
standard library's or importlib's."""

from __future__ import annotations

import contextlib
import importlib
import os
import re
import shlex
import sys
from pathlib import Path
from typing import Any

from ..wording import a_kind
from .usage import refuse as _fail_usage


def load_pipeline(target: str) -> Any:
    """`pkg.module:name` (a dotted attribute path after the colon) as a Pipeline. Whatever goes
    wrong while importing the module (it raises, has a syntax error, calls sys.exit) is a usage
    error: nothing has run yet."""
    from ..api.pipeline import Pipeline
    module_name, _, attr = target.partition(":")
    if not module_name or not attr:
        _fail_usage(f"{target!r} is not MODULE:PIPELINE, e.g. mypkg.flows:pipeline")
    if module_name.endswith(".py") or "/" in module_name or os.sep in module_name or module_name.startswith("."):
        _fail_usage(f"{module_name!r} is a file path or a relative module; {_as_imported(module_name, attr)}")
    if "" not in sys.path:
        sys.path.insert(0, "")  # the current directory, as `python -m` has it
    obj: Any = _import(module_name)
    for part in attr.split("."):
        if not hasattr(obj, part):
            names = sorted(n for n in dir(obj) if isinstance(getattr(obj, n, None), Pipeline))
            _fail_usage(f"{module_name!r} has no attribute {attr!r}; pipelines there: {names or 'none'}")
        obj = getattr(obj, part)
    if not isinstance(obj, Pipeline):
        _fail_usage(f"{target} is {a_kind(obj)}, not a hardy Pipeline")
    return obj


def _as_imported(module_name: str, attr: str) -> str:
    """How to name the module a file path names, as Python imports it: its dotted name where each
    folder is one (`sub/flows.py`: sub.flows); else its folder on PYTHONPATH (a folder named
    `my dir` or `..` is no package); a file named as no module can be (`my-flows.py`) renamed first."""
    path = module_name.removesuffix(".py")
    if "/" not in path and os.sep not in path:  # a relative module: `.flows`
        path = path.lstrip(".")
    parts = [part for part in Path(path).parts if part != "."] or ["mymodule"]
    name = parts[-1] if parts[-1].isidentifier() else re.sub(r"\W", "_", parts[-1]).lstrip("0123456789") or "flows"
    rename = "" if name == parts[-1] else (
        f"{parts[-1]!r} is no name Python can import (letters, digits and _, not first a digit): rename the file, "
        f"e.g. {name}.py, then ")
    if not Path(path).is_absolute() and all(part.isidentifier() for part in parts[:-1]):
        return (f"{rename}name the module as Python imports it: {'.'.join([*parts[:-1], name])}:{attr} (run from the "
                "directory that holds it, or set PYTHONPATH)")
    folder = os.path.dirname(path)
    return (f"{rename}put its folder on PYTHONPATH and name the module alone, as Python imports it: "
            f"PYTHONPATH={shlex.quote(folder)} {shlex.join(['hardy', 'run', f'{name}:{attr}'])} (the other "
            "arguments as before)")


def _import(module_name: str) -> Any:
    try:
        return importlib.import_module(module_name)
    except ImportError as exc:
        if getattr(exc, "name", None) in (module_name, module_name.split(".")[0]):
            _fail_usage(f"cannot import {module_name!r}: {exc}")
        _fail_usage(f"cannot import {module_name!r}: {_where(exc)}")
    except SyntaxError as exc:
        _fail_usage(f"cannot import {module_name!r}: {type(exc).__name__} in {exc.filename}, line {exc.lineno}: "
                    f"{exc.msg}")
    except SystemExit as exc:
        _fail_usage(f"importing {module_name!r} called sys.exit({exc.code!r}), so nothing ran; a module for "
                    "`hardy run` must not exit when imported: put its script part under "
                    "`if __name__ == \"__main__\":`")
    except Exception as exc:
        _fail_usage(f"importing {module_name!r} raised {_where(exc)}")


def _where(exc: BaseException) -> str:
    """The exception and the deepest line of the user's own files it went through: not the
    standard library's nor an installed package's (a `json.loads` of a bad config fails in
    json/decoder.py, which is not where the fix goes), nor hardy's or importlib's; failing that,
    the deepest frame outside importlib and this command."""
    import traceback
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if "importlib" not in f.filename
              and not f.filename.endswith("cli/loading.py")]
    own = [f for f in frames if not _not_users(f.filename)]
    if not own and not frames:
        return f"{type(exc).__name__}: {exc}"
    frame = (own or frames)[-1]
    name = frame.filename
    with contextlib.suppress(ValueError):
        relative = os.path.relpath(name)
        name = name if relative.startswith(os.pardir) else relative
    return f"{type(exc).__name__}: {exc} (at {name}, line {frame.lineno}, in {frame.name})"


def _not_users(filename: str) -> bool:
    """A file that is not the user's own: generated (`<frozen ...>`, `<string>`), hardy's, or in
    the standard library's or an installed package's folder."""
    import sysconfig

    from ..tracebacks import is_hardy
    if filename.startswith("<") or is_hardy(filename):
        return True
    paths = sysconfig.get_paths()
    folders = {paths[k] for k in ("stdlib", "platstdlib", "purelib", "platlib") if paths.get(k)}
    parts = Path(filename).parts
    return "site-packages" in parts or "dist-packages" in parts or any(
        filename.startswith(folder + os.sep) for folder in folders)
