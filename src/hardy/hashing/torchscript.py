"""How TorchScript values are hashed: a scripted, traced or loaded module (`torch.jit.script`,
`torch.jit.trace`, `torch.jit.load`), a compiled function, and a scripted module's method.

A key covers what decides their results, which their own `.code` does not show: the compiled code
of every function they call (a scripted helper, a module-level function TorchScript compiled along
with them: `.code` names it, `__torch__.userlib.scale(x)`, without its body), their attributes
(`self.threshold`, a list of labels), the tensors a trace baked in as constants (`CONSTANTS.c0` in
`.code`, whatever they hold), parameters and buffers (persistent or not) and compiled hooks. All of
them are in the archive `torch.jit.save` writes, and the key is that archive, entry by entry,
less what decides no result: source locations (`.debug_pkl`, which name files and lines), a
trace's example inputs, the archive's folder name and serialization id, and TorchScript's
numbering of a name compiled twice in one process (`__torch__.___torch_mangle_3.Net`), so that the
same code keys alike wherever and however often it was compiled.

The archive is written to memory through a memfd's path (`save_to_buffer` copies it twice more:
about 108 ms against 40 ms for a model of 10M parameters, whose `nn.Module` form hashes in 11 ms).
A change token (`libraries.TENSOR_VERSIONS` set), made at every call, walks the attributes instead,
tensors by their version counters, and a trace's constants, which are the very tensors it closed
over (`SHIFT.add_(1)` changes what it computes); code, once compiled, does not change.

A module's Python attributes are keyed besides, in both: what a script sets on it after compiling
(`model.scale = 3.0`) lives on its Python wrapper, not in the archive, and a node reads it there.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ..errors import UnhashableError
from .distributions import module_identity
from .libraries import TENSOR_VERSIONS
from .values import encode_into, length, register_library, type_name

if TYPE_CHECKING:
    import zipfile

# patterns, compiled by `re` at their first use (a fork server imports this module, and seldom keys TorchScript)
_MANGLE = rb"[./]___torch_mangle_\d+"
_LEFT_OUT = r"\.debug_pkl$|^\.data/serialization_id$|^traced_inputs"
_CLASS_HEAD = rb"(?m)^class [^\n]*\n((?:  (?!def )[^\n]*\n)+)"  # a compiled class's declarations before its methods


def _encode_script_function(v: Any, out: Callable[[bytes], Any], active: set[int]) -> None:
    """A compiled function (`torch.jit.script`, `torch.jit.trace` of a function): its archive, which
    TorchScript writes as a module whose `forward` is the function, with every function it calls."""
    out(b"JF" + module_identity("torch"))
    if TENSOR_VERSIONS.get() is None:
        _archive(v, out)
    else:
        out(v.code.encode())
        _constants(v.graph, out, active)


def _encode_script_method(v: Any, out: Callable[[bytes], Any], active: set[int]) -> None:
    """A scripted module's method (`model.forward`): its name and the whole module it runs on."""
    out(b"JS" + module_identity("torch") + v.name.encode())
    owner = v.owner  # (the module's compiled form, which `save` and torch's attribute walk take)
    if TENSOR_VERSIONS.get() is None:
        _archive(owner, out)
    else:
        _attributes(owner, out, active)
        _constants(v.graph, out, active)


def _encode_script_module(m: Any, out: Callable[[bytes], Any], active: set[int]) -> None:
    """A scripted, traced or loaded module: its archive; in a change token, its attributes and a
    trace's constants."""
    import torch
    out(b"JM" + module_identity("torch"))
    _python_attributes(m, out, active)
    if TENSOR_VERSIONS.get() is None:
        _archive(m, out)
        return
    _attributes(m._c, out, active)
    for name, sub in m.named_modules():
        if isinstance(sub, torch.jit.TracedModule):  # type: ignore[attr-defined]  # (public, outside its __all__)
            out(name.encode())
            _constants(sub.graph, out, active)


_WRAPPER: tuple[frozenset[str], frozenset[str]] | None = None  # (`_wrapper_names`) a scripted wrapper's, a traced one's


def _python_attributes(m: Any, out: Callable[[bytes], Any], active: set[int]) -> None:
    """The attributes a script set on a compiled module's Python wrappers (its own and its
    submodules'), which neither the archive nor torch's attribute walk sees; torch's bookkeeping
    and the compiled methods bound there are left out. Nothing is said of a module without any:
    it keys as it did before these were keyed."""
    for name, sub in m.named_modules():
        own = _own_attributes(sub)
        if own:
            out(b"py" + name.encode() + length(len(own)))
            encode_into(dict(sorted(own.items())), out, active)


def _own_attributes(sub: Any) -> dict[str, Any]:
    """What a script set on one wrapper. A traced one (`TracedModule`) sends what is set on it
    (`traced.scale = 3.0`) to the script module it wraps, `_actual_script_module`, which with its
    `_name` is its own bookkeeping: that script module is keyed by its Python attributes alone
    (its archive is the traced module's; keyed whole, it made each submodule write one more)."""
    import torch
    scripted, traced = _wrapper_names()
    held = vars(sub)
    inner = held.get("_actual_script_module")
    found = {k: v for k, v in held.items() if k not in (traced if inner is not None else scripted)}
    if inner is not None:
        found.update((k, v) for k, v in vars(inner).items() if k not in scripted)
    return {k: v for k, v in found.items() if not isinstance(v, torch.ScriptMethod) and not _copied_method(k, v)}


def _copied_method(name: str, v: Any) -> bool:
    """A method of torch's that scripting puts on the wrapper under its own name, bound to the
    module it compiled (a `Sequential`'s or `ModuleList`'s `__len__`, `__getitem__`, `__iter__`,
    `__dir__`): torch's code, what the archive holds besides; keyed whole, it keyed that eager
    module and its weights again."""
    func = getattr(v, "__func__", None)
    return getattr(func, "__name__", None) == name and getattr(func, "__module__", "").startswith("torch.")


def _wrapper_names() -> tuple[frozenset[str], frozenset[str]]:
    """What torch's Python wrappers of a compiled module hold of their own (`_c`, `_concrete_type`,
    a traced one's `_actual_script_module` and `_name`, `nn.Module`'s hooks and tables), read off
    real ones at the first use, as this torch makes them: a traced wrapper of an empty module and
    the scripted one it wraps (about 1.5 ms once; nothing is compiled or traced)."""
    global _WRAPPER
    if _WRAPPER is None:
        import torch
        module = frozenset(vars(torch.nn.Module()))
        wrap: Any = torch.jit.TracedModule  # type: ignore[attr-defined]  # (public, outside its __all__)
        traced = vars(wrap(torch.nn.Module()))  # (its script module held there, as `_own_attributes` reads it)
        _WRAPPER = module | frozenset(vars(traced["_actual_script_module"])), module | frozenset(traced)
    return _WRAPPER


def _archive(compiled: Any, out: Callable[[bytes], Any]) -> None:
    """The entries of the archive `compiled.save` writes (see the module's docstring), each by its
    name and bytes, names and code without TorchScript's numbering; a stored entry (a tensor's
    storage) read straight from the memfd it was written to."""
    import zipfile  # (here: it loads `shutil` and `pathlib`, which a fork server otherwise never imports)
    fd = os.memfd_create("hardy-torchscript-key", os.MFD_CLOEXEC)
    try:
        try:
            compiled.save(f"/proc/self/fd/{fd}")
        except RuntimeError as exc:  # (a custom class without __getstate__; a call of a @torch.jit.ignore method,
            # whose Python code the archive cannot hold: a key of what it runs is not to be had)
            said = next((line.strip() for line in str(exc).splitlines() if line.strip()), type(exc).__name__)
            raise UnhashableError(f"TorchScript cannot save this {type(compiled).__name__}, which its key is made "
                                  f"from ({said})") from None
        with open(fd, "rb", closefd=False) as f, zipfile.ZipFile(f) as z:
            for info in z.infolist():
                name = info.filename.partition("/")[2]  # (the folder is named after the file)
                if re.search(_LEFT_OUT, name):
                    continue
                if info.compress_type != zipfile.ZIP_STORED or name.endswith((".pkl", ".py")):
                    data = re.sub(_MANGLE, b"", z.read(info))
                    data = re.sub(_CLASS_HEAD, _sorted_head, data) if name.endswith(".py") else data
                else:
                    data = os.pread(fd, info.file_size, _data_offset(fd, info))
                out(b"e" + re.sub(_MANGLE, b"", name.encode()) + length(len(data)))
                out(data)
    finally:
        os.close(fd)


def _sorted_head(found: re.Match[bytes]) -> bytes:
    """A compiled class's declarations (attributes, constants) in sorted order: TorchScript writes a
    class's constants in the order of the set they come from (`Linear`'s `__constants__`), which
    each process's string hashing changes; their order decides nothing."""
    head = found.group(0).split(b"\n", 1)
    return head[0] + b"\n" + b"".join(sorted(found.group(1).splitlines(keepends=True)))


def _data_offset(fd: int, info: zipfile.ZipInfo) -> int:
    """Where a stored entry's bytes start: after its local header (30 bytes, then its name and
    its extra field, whose lengths the header gives: the central directory's may differ)."""
    header = os.pread(fd, 30, info.header_offset)
    return info.header_offset + 30 + int.from_bytes(header[26:28], "little") + int.from_bytes(header[28:30], "little")


def _attributes(compiled: Any, out: Callable[[bytes], Any], active: set[int]) -> None:
    """A change token's walk of a compiled module: every attribute of it and of its submodules by
    name (`training`, `threshold`, `lin.weight`), tensors by their version counters (a module's
    are, as `libraries._encode_torch_module` says why), submodules through their own attributes;
    a value hardy cannot hash (a TorchScript class's object) by its type."""
    import torch
    budget = TENSOR_VERSIONS.get()
    left = budget[0] if budget is not None else 0
    if budget is not None:
        budget[0] = 0
    try:
        walk = torch._C._jit_debug_module_iterators(compiled)  # type: ignore[attr-defined]  # (no public listing)
        for name, value in walk["named_attributes_r"]:
            out(name.encode())
            if isinstance(value, torch.ScriptObject):  # a submodule: walked through its own names
                continue
            try:
                encode_into(value, out, active)
            except UnhashableError:
                out(b"?" + type_name(type(value)))
    finally:
        if budget is not None:
            budget[0] = left


def _constants(graph: Any, out: Callable[[bytes], Any], active: set[int]) -> None:
    """The tensors a graph holds as constants (a trace's `CONSTANTS.c0`), in a change token."""
    for node in graph.nodes():
        if node.kind() == "prim::Constant" and node.hasAttribute("value") and node.kindOf("value") == "t":
            encode_into(node.t("value"), out, active)


register_library("torch.jit", lambda jit: ((jit.ScriptFunction, _encode_script_function),
                                           (jit.ScriptModule, _encode_script_module),
                                           (sys.modules["torch"].ScriptMethod, _encode_script_method)))
