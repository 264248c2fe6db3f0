"""A node is a plain function plus the names that wire it into a pipeline.

Inputs are the function's parameter names; outputs are declared with `output_name`. Everything the
engine needs later (is it async? which parameters have defaults?) is read once, here, so that the
per-call path never inspects a signature again.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, cast, overload

from ..errors import InvalidArgumentType, NodeDefinitionError
from ..wording import a_kind
from . import arguments


class Node:
    """A function wired by name. Calling the node calls the function unchanged (handy in tests)."""

    gpus: float = 0  # GPUs (or a share of one) the node needs; pipelines used as nodes need none
    batch_size: int = 0  # items per call of `batch` in a map; 0: called once per item
    batch: Callable[..., Any] | None = None  # the function on lists (docs/batching.md)
    batch_wait: float | None = None  # seconds a stream's partial batch waits for more items; None: until full
    unpacks: bool = False  # output_name was a tuple or list: the result is unpacked, even into one name

    def __init__(
        self,
        func: Callable[..., Any],
        output_name: str | Sequence[str] | None = None,
        *,
        name: str | None = None,
        cache: bool = True,
        isolate: bool = False,
        retries: int = 0,
        retry_on: type[Exception] | tuple[type[Exception], ...] = (),
        backoff: float = 0.0,
        timeout: float | None = None,
        gpus: float = 0,
        batch_size: int | None = None,
        batch_wait: float | None = None,
    ):
        if not callable(func):
            raise NodeDefinitionError(
                f"a node must wrap a callable, got {type(func).__name__} {func!r}; "
                "decorate a function with @node or pass Pipeline(nodes=[...]) functions and pipelines only."
            )
        self.func = func
        self.name: str = _node_name(func, name, output_name)
        self.outputs: tuple[str, ...] = _output_names(output_name, self.name)
        self.unpacks = isinstance(output_name, (tuple, list))
        one_name_tuple_fits(self.name, self.outputs if self.unpacks else (), batch_size)
        self.inputs, self.defaults, self.kwonly = _parameters(func, self.name)
        self.is_async = inspect.iscoroutinefunction(func) or inspect.iscoroutinefunction(
            getattr(func, "__call__", None))  # noqa: B004 - an instance's __call__ may be async
        owner = f"node {self.name!r}"
        self.cache = arguments.flag(owner, "cache", cache)
        self.isolate = arguments.flag(owner, "isolate", isolate)
        # the failure policy (hardy/model/policy.py): the same under every executor
        self.retries: int = arguments.whole_number(owner, "retries", retries, 0)
        self.retry_on: tuple[type[Exception], ...] = (
            arguments.exception_types(owner, retry_on) if retry_on != () else ())
        if self.retry_on and not self.retries:
            raise NodeDefinitionError(f"{owner}: retry_on={retry_on!r} has no effect with retries=0; "
                                      "say how many times to retry, e.g. retries=3.")
        self.backoff: float = arguments.seconds(owner, "backoff", backoff, zero=True)
        self.timeout: float | None = arguments.seconds(owner, "timeout", timeout, optional=True)
        self.gpus: float = arguments.share(owner, "gpus", gpus, "a number >= 0: 1 for a GPU, 0.5 for half of one")
        if batch_size is not None:
            self.batch_size = arguments.whole_number(owner, "batch_size", batch_size, 1)
            if self.is_async:
                raise NodeDefinitionError(f"{owner}: batch_size= needs a plain function; an async node's items "
                                          "already run concurrently. Drop batch_size= or make it a def.")
            self.batch = func  # it takes one list per parameter and returns one list per output
        if batch_wait is not None:
            if not self.batch_size:
                raise NodeDefinitionError(f"{owner}: batch_wait={batch_wait!r} has no effect without batch_size=; "
                                          "say how many items a call takes, e.g. batch_size=64, batch_wait=0.5.")
            self.batch_wait = arguments.seconds(owner, "batch_wait", batch_wait, zero=True)
        self.__doc__ = getattr(func, "__doc__", None)
        self.__name__ = getattr(func, "__name__", self.name)  # as functools.wraps gives HyperNodes' nodes
        self.__wrapped__ = func

    @property
    def output_name(self) -> str | tuple[str, ...]:
        """HyperNodes' spelling: a string for one output, a tuple for several or for a one-name
        tuple as declared (`output_name=("label",)`: the node returns a 1-tuple, unpacked)."""
        return self.outputs[0] if len(self.outputs) == 1 and not self.unpacks else self.outputs

    @property
    def root_args(self) -> tuple[str, ...]:
        """HyperNodes' name for the input parameter names."""
        return self.inputs

    @property
    def code_hash(self) -> str:
        """HyperNodes' name for the node's identity in cache keys (its code, transitively, and its
        outputs): a 64-digit hex digest of `fingerprint()`."""
        from blake3 import blake3
        return blake3(self.fingerprint()).hexdigest()

    def cached_in(self, cache: Any) -> Node:
        """This node as a plan with `cache` calls it: itself (the plan caches its result); a nested
        pipeline's node (`PipelineNode`) caches its own nodes instead."""
        return self

    def narrowed(self, outputs: tuple[str, ...]) -> Node:
        """The node computing only `outputs` (a run needs no more of it). A function returns all
        its outputs at once, so it is itself; a nested pipeline skips the inner nodes not needed."""
        return self

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.func(*args, **kwargs)

    def __eq__(self, other: object) -> bool:
        """HyperNodes' equality where it is safe: `node(output_name="y")(f) == node(output_name="y")(f)`
        (the same function wrapped twice, same name and outputs). Two different functions of the
        same name (a redefinition, a factory's closures) stay different nodes: they compute different
        things, which HyperNodes' name-only test would hide."""
        if other is self:
            return True
        if type(other) is not type(self) or not isinstance(other, Node):
            return False
        return (other.func is self.func and other.batch is self.batch and other.name == self.name
                and other.outputs == self.outputs and other.unpacks == self.unpacks)

    def __hash__(self) -> int:
        return hash((self.name, self.outputs))

    def __reduce_ex__(self, protocol: Any) -> Any:
        # A node defined at module level travels by reference, as a plain function would: the
        # worker imports its module, so crash stacks show the user's real file and line, not
        # cloudpickle's "<dynamic-code>". Nodes from __main__, closures and modules registered to
        # travel by value (ship_modules=) are pickled whole.
        if type(self) is Node and _importable_as(self):
            return (_node_by_reference, (self.func.__module__, self.func.__qualname__))
        return super().__reduce_ex__(protocol)

    def binding(self) -> tuple[str, str] | None:
        """(module, name) under which this node travels by reference to another process, which
        finds there whatever its copy of the module binds to that name (`shipping.replica` makes
        it this process's); None when it travels by value."""
        if type(self) is Node and _importable_as(self):
            return self.func.__module__, self.func.__qualname__.split(".")[0]
        return None

    def call_batch(self, **columns: list[Any]) -> Any:
        """A batched node's call on a batch: each parameter's list of values, by name
        (`hardy.parts.batching`); HyperNodes' DualNode passes them its own way."""
        assert self.batch is not None
        return self.batch(**columns)

    def fingerprint(self) -> bytes:
        """The node's identity for caching: its code (transitively), its outputs and the key format;
        for one name declared as a tuple, that its result is unpacked (`("x",)` gives `x` what
        `"x"` gives as `(x,)`). A pipeline used as a node overrides it with its inner nodes'."""
        from ..hashing import FORMAT, code_fingerprint, digest
        unpacked = [b"unpacks"] if self.unpacks and len(self.outputs) == 1 else []
        return digest(FORMAT, b"node", code_fingerprint(self.func), repr(self.outputs).encode(), *unpacked)

    def __repr__(self) -> str:
        return f"Node({self.name}: {', '.join(self.inputs)} -> {', '.join(self.outputs)})"


def _importable_as(n: Node) -> bool:
    module_name = getattr(n.func, "__module__", None)
    qualname = getattr(n.func, "__qualname__", "")
    if not module_name or module_name == "__main__" or "<locals>" in qualname:
        return False
    module = sys.modules.get(module_name)
    if module is None or getattr(module, "__spec__", None) is None:
        return False
    try:
        import cloudpickle.cloudpickle as cp
        if cp._is_registered_pickle_by_value(module):
            return False
    except (ImportError, AttributeError):
        pass
    target: Any = module
    for part in qualname.split("."):
        target = getattr(target, part, None)
    return target is n


def _node_by_reference(module_name: str, qualname: str) -> Node:
    import importlib
    target: Any = importlib.import_module(module_name)
    for part in qualname.split("."):
        target = getattr(target, part)
    return cast(Node, target)


def _node_name(func: Callable[..., Any], name: str | None, output_name: Any) -> str:
    if name is not None and (not isinstance(name, str) or not name):
        raise NodeDefinitionError(f"a node's name must be a non-empty string, got name={name!r}.")
    found = cast(str, name or getattr(func, "__name__", type(func).__name__))
    if found == "<lambda>" and output_name is None:
        raise NodeDefinitionError(
            "a lambda node needs output_name=...: its output would be called '<lambda>', which no other "
            "node can consume. Write node(lambda x: ..., output_name=\"y\") or use a named function.")
    return found


def _output_names(output_name: str | Sequence[str] | None, default: str) -> tuple[str, ...]:
    if output_name is None:
        return (default,)
    if isinstance(output_name, str) and output_name:
        return (output_name,)
    names = tuple(output_name) if isinstance(output_name, (tuple, list)) else ()
    if not names or not all(isinstance(n, str) and n for n in names):
        raise NodeDefinitionError(
            f"node {default!r}: output_name must be a string or a tuple of strings, got {output_name!r}")
    if len(set(names)) != len(names):
        raise NodeDefinitionError(f"node {default!r}: output_name repeats a name: {names}")
    return names


def one_name_tuple_fits(name: str, declared: tuple[str, ...], batch_size: int | None) -> None:
    """A one-name tuple (`output_name=("label",)`: the node returns a 1-tuple) is not yet carried
    through a batched node's lists: refused here, with the spelling that works, rather than
    failing on some engines only."""
    if len(declared) != 1 or batch_size is None:
        return
    raise NodeDefinitionError(
        f"node {name!r}: output_name={declared} (a tuple of one name, whose 1-tuple result is unpacked) "
        f"cannot be combined with batch_size= yet; declare output_name={declared[0]!r} and return the value itself.")


def _parameters(func: Callable[..., Any], name: str
                ) -> tuple[tuple[str, ...], dict[str, Any], frozenset[str]]:
    try:
        sig = inspect.signature(func)
    except (TypeError, ValueError) as exc:
        raise NodeDefinitionError(f"node {name!r}: cannot read the signature of {func!r}: {exc}") from exc
    inputs, defaults, kwonly = [], {}, set()
    for p in sig.parameters.values():
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            raise NodeDefinitionError(
                f"node {name!r}: parameter {p.name!r} is *args/**kwargs; a node's inputs are wired by "
                "name, so list each input as a named parameter. If a decorator of yours wraps the "
                "function, give its wrapper @functools.wraps(func): hardy then reads the wrapped "
                "function's parameters.")
        if p.kind is p.POSITIONAL_ONLY:
            raise NodeDefinitionError(
                f"node {name!r}: parameter {p.name!r} is positional-only; inputs are passed by name.")
        inputs.append(p.name)
        if p.kind is p.KEYWORD_ONLY:
            kwonly.add(p.name)
        if p.default is not p.empty:
            defaults[p.name] = p.default
    return tuple(inputs), defaults, frozenset(kwonly)


@overload
def node(func: Callable[..., Any]) -> Node: ...
@overload
def node(func: None = None, *, output_name: str | Sequence[str] | None = None, name: str | None = None,
         cache: bool = True, isolate: bool = False, retries: int = 0,
         retry_on: type[Exception] | tuple[type[Exception], ...] = (), backoff: float = 0.0,
         timeout: float | None = None, gpus: float = 0,
         batch_size: int | None = None, batch_wait: float | None = None) -> Callable[[Callable[..., Any]], Node]: ...


def node(func: Callable[..., Any] | None = None, *, output_name: str | Sequence[str] | None = None,
         name: str | None = None, cache: bool = True, isolate: bool = False, retries: int = 0,
         retry_on: type[Exception] | tuple[type[Exception], ...] = (), backoff: float = 0.0,
         timeout: float | None = None, gpus: float = 0,
         batch_size: int | None = None, batch_wait: float | None = None) -> Node | Callable[[Callable[..., Any]], Node]:
    """Make a function a pipeline node: `@node` or `@node(output_name="x", retries=2, timeout=30)`.

    `isolate=True` runs the node in a crash-containing worker process whatever the engine.
    `retries` reruns it after a crash, a timeout or an exception listed in `retry_on`, waiting
    `backoff` seconds (doubling, with jitter) before each retry; `timeout` is seconds per attempt.
    The same rules hold under every executor: see `hardy.model.policy`.
    `gpus=1` (or a share, 0.5) marks a GPU node: with `Engine(map_executor="process", gpus=...)` it
    runs on GPU workers and the other nodes on CPU workers; daft_engine() gives it a GPU UDF.
    `batch_size=64` makes a batched node: the function takes one list per parameter and returns
    one list (a tuple of lists for several outputs) with an entry per item; a map calls it with up
    to 64 items at once, `run()` with lists of one, and caching, errors and crashes stay per item
    (`docs/batching.md`). `batch_wait=0.5`: in a stream (`imap`), a batch not yet full is called
    once its first item has waited 0.5 s for more (by default it waits until it is full or the
    input ends).
    """
    def wrap(f: Callable[..., Any]) -> Node:
        return Node(f, output_name, name=name, cache=cache, isolate=isolate, retries=retries, retry_on=retry_on,
                    backoff=backoff, timeout=timeout, gpus=gpus, batch_size=batch_size, batch_wait=batch_wait)

    return wrap(func) if func is not None else wrap


def as_nodes(given: Any) -> list[Node]:
    """What `Pipeline(nodes=...)` was given, as nodes: nodes as they are, plain functions wrapped,
    pipelines as nodes (`as_node()`). A lone node, function or pipeline, or anything else, is
    refused with the fix (iterating over it would fail deep inside with no hint)."""
    if isinstance(given, Node) or callable(given) or hasattr(given, "as_node"):
        shown = getattr(given, "name", None) or getattr(given, "__name__", type(given).__name__)
        raise InvalidArgumentType(
            f"Pipeline(nodes={given!r:.60}) is one node, not a list of them; pass Pipeline(nodes=[{shown}]).")
    if isinstance(given, (str, bytes, Mapping)) or not isinstance(given, Iterable):
        raise InvalidArgumentType(
            f"Pipeline(nodes={given!r:.60}) is {a_kind(given)}, not a list of nodes; pass a list of "
            "functions decorated with @node, plain functions, or pipelines.")
    return [_as_node(obj, position) for position, obj in enumerate(given)]


def _as_node(obj: Any, position: int) -> Node:
    if isinstance(obj, Node):
        return obj
    if hasattr(obj, "as_node"):  # a Pipeline (hardy.api.pipeline stands above this module)
        return cast(Node, obj.as_node())
    if callable(obj):
        return Node(obj)
    raise NodeDefinitionError(
        f"Pipeline(nodes=[...]) item {position} is {a_kind(obj)} ({obj!r:.60}), not a node: pass "
        "functions decorated with @node, plain functions, or pipelines.")
