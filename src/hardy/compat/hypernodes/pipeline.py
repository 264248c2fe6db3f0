"""HyperNodes' Pipeline, node and DualNode as thin layers over hardy's.

What this layer changes, and only this: HyperNodes' argument order (`as_node`, `node("out")`),
callbacks taken from the engine, a node's own exception raised as itself (hardy wraps it in a
NodeError naming node and inputs; that text is added to the exception as a note), no progress bar
unless a ProgressCallback asks for one, `visualize()`'s HyperNodes arguments and style names, and
two rules of HyperNodes' calls: an input named as a node's output is not used (the node computes it;
hardy's own takes a given output as computed), and a product map varies the inputs in the order
they were given (bound ones first), not in `map_over`'s.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ...api.pipeline import Pipeline as HardyPipeline
from ...errors import InvalidArgument, MapError, NodeError
from ...model import arguments
from ...model.node import Node, one_name_tuple_fits
from ...observe import PipelineCallback
from .engines import SeqEngine, check_callbacks
from .pipeline_node import PipelineNode


class Pipeline(HardyPipeline):
    """`Pipeline(nodes, engine=None, name=None)`; callbacks and cache may also be given here."""

    _own_callbacks: list[PipelineCallback]  # set by the `callbacks` setter (the base __init__ calls it)
    _inherited: bool
    # HyperNodes checks bound values when a call runs, not in `bind` (hardy's own refuses a name no
    # node takes at once): the call then warns about it and names the inputs missing.
    _checks_bound_names = False
    _by_name = True  # HyperNodes runs the ready node whose name sorts first (`Graph._topological_order`)

    def __init__(self, nodes: Sequence[Any], engine: Any = None, name: str | None = None,
                 cache: Any = None, callbacks: Sequence[PipelineCallback] | None = None, strict: bool = False):
        super().__init__(nodes, engine=engine or SeqEngine(), name=name, callbacks=callbacks, cache=cache,
                         strict=strict)

    @property
    def nodes(self) -> list[Node]:  # type: ignore[override]  # HyperNodes' type
        """The nodes, as HyperNodes' list (a copy: the graph was built from them once)."""
        return list(self.graph.nodes)

    @property
    def id(self) -> str:
        """HyperNodes' id for callbacks' `pipeline_id`-style bookkeeping: `pipeline_<object id>`."""
        return f"pipeline_{id(self)}"

    @property
    def callbacks(self) -> list[PipelineCallback]:
        """The pipeline's own callbacks, then its engine's (where HyperNodes keeps them)."""
        if self._inherited:
            return self._own_callbacks
        return [*self._own_callbacks, *getattr(self.engine, "callbacks", ())]

    @callbacks.setter
    def callbacks(self, callbacks: Sequence[PipelineCallback]) -> None:
        self._own_callbacks = list(callbacks)
        self._inherited = False

    def observed_by(self, callbacks: Sequence[PipelineCallback]) -> Pipeline:
        """Nested in another pipeline, HyperNodes reports to the parent's callbacks only."""
        copy = super().observed_by(callbacks)
        if copy is not self:
            copy._inherited = True  # the parent's callbacks alone, not with its engine's
        return copy

    @property
    def unfulfilled_args(self) -> tuple[str, ...]:
        """Sorted by name, as HyperNodes lists them."""
        return tuple(sorted(super().unfulfilled_args))

    def run(self, inputs: Mapping[str, Any] | None = None, output_name: str | Sequence[str] | None = None,
            engine: Any = None, **kwargs: Any) -> dict[str, Any]:
        check_callbacks(self.callbacks, engine or self.engine)
        try:
            return super().run(self._computed_not_given(inputs), output_name, engine)
        except NodeError as err:
            raise _original(err) from None

    def map(self, inputs: Mapping[str, Any] | None = None,  # type: ignore[override]  # HyperNodes' arguments
            map_over: str | Sequence[str] | None = None,
            map_mode: str = "zip", output_name: str | Sequence[str] | None = None, engine: Any = None,
            on_error: str = "raise", progress: bool = False, **kwargs: Any) -> list[Any]:
        check_callbacks(self.callbacks, engine or self.engine)
        if map_mode == "product" and map_over is not None and not isinstance(map_over, str):
            given = list({**self.bound_inputs, **(inputs or {})})
            map_over = sorted(map_over, key=lambda name: given.index(name) if name in given else len(given))
        over = [map_over] if isinstance(map_over, str) else list(map_over or ())
        computed = [name for name in over if name in self.graph.producer]
        if computed:  # (HyperNodes maps over the list and computes the node anyway: items of nothing)
            raise InvalidArgument(f"map_over names {computed}, which node {self.graph.producer[computed[0]].name!r} "
                                  "computes: its values would not be used; map over that node's own inputs")
        try:
            return super().map(self._computed_not_given(inputs), map_over, map_mode, output_name, on_error,
                               progress, engine)
        except MapError as err:
            raise _original(err.failures[min(err.failures)]) from None

    def _computed_not_given(self, inputs: Mapping[str, Any] | None) -> Mapping[str, Any] | None:
        """`inputs` without those a node of this pipeline computes: HyperNodes runs the node and
        uses its result (a dataset row that happens to hold a column named `score`)."""
        if not inputs:
            return inputs
        return {name: value for name, value in inputs.items() if name not in self.graph.producer}

    def bind(self, **values: Any) -> Pipeline:
        """As `run`'s inputs: a value named as a node's output is not used (the node computes it)."""
        super().bind(**self._computed_not_given(values) or {})
        return self

    def as_node(self, input_mapping: Mapping[str, str] | None = None,  # type: ignore[override]
                output_mapping: Mapping[str, str] | None = None, map_over: str | Sequence[str] | None = None,
                map_mode: str = "zip", name: str | None = None, cache: bool = True,
                on_error: str = "raise") -> PipelineNode:
        """HyperNodes' argument order. `cache=False` turns off HyperNodes' entry for the nested
        node's whole result; hardy caches a nested pipeline per inner node only (inner nodes opt
        out with `@node(cache=False)`), so there is no such entry and nothing to turn off."""
        return PipelineNode(self, input_mapping, output_mapping, map_over, map_mode, cache, name, on_error)

    def visualize(self, filename: str | None = None,  # type: ignore[override]  # HyperNodes' arguments
                  engine: str = "js", depth: int | None = 1,
                  separate_outputs: bool = False, show_types: bool = False, orient: str = "TB",
                  flatten: bool = False, show_legend: bool = False, style: Any = "default", **kwargs: Any) -> Any:
        """HyperNodes' arguments on hardy's drawing; `engine` ("js"/"graphviz") picks nothing here:
        hardy draws one SVG either way, and `filename` chooses the format by its suffix."""
        if isinstance(style, str) and style in HYPERNODES_STYLES:  # its palettes: hardy's nearest
            style = "dark" if style.startswith("dark") else "default"
        drawing = super().visualize(None, depth=None if flatten else depth, orient=orient, style=style)
        if filename is None:
            return drawing
        drawing.save(filename)
        return None


HYPERNODES_STYLES = frozenset({  # HyperNodes 0.4.8's DESIGN_STYLES, and "modern" of its docs
    "default", "legacy", "dark_neon_solid", "dark_neon_wire", "dark_neon", "dark_soft", "dark_deep", "bright_mint",
    "sunny", "coral_sunset", "tailwind_pastel", "cool_breeze", "warm_glow", "lavender_fields", "vivid_pastel",
    "nord_soft", "soft_candy", "warm_flow", "tropical_ocean", "sunrise", "modern"})


def _original(err: NodeError) -> BaseException:
    """The node's own exception (HyperNodes raises it unwrapped), with hardy's report as a note.
    A crash or timeout has no exception of its own: it stays a NodeCrashed (ExecutionError)."""
    cause = err.__cause__
    if not isinstance(cause, Exception):
        return err
    if hasattr(cause, "add_note"):
        cause.add_note(f"hardy: {err}")
    return cause


def node(output_name: str | Sequence[str] | Callable[..., Any] | None = None, cache: bool = True,
         **options: Any) -> Any:
    """`@node`, `@node("out")`, `@node(output_name=("a", "b"), cache=False)`. hardy's own options
    (`isolate`, `retries`, `timeout`) are accepted too."""
    if callable(output_name):
        return _reporting_as_hypernodes(Node(output_name, cache=cache, **options))
    return lambda func: _reporting_as_hypernodes(Node(func, output_name, cache=cache, **options))


def _reporting_as_hypernodes(made: Node) -> Node:
    """A node whose `on_node_end` outputs take HyperNodes' shape: `{("c", "d"): (2, -2)}` for a
    node of two outputs, a returned dict as itself (`observe.events`), where hardy's own give
    one entry per output name."""
    made.hypernodes_events = True  # type: ignore[attr-defined]
    return made


class DualNode(Node):
    """A node with a one-item function (`singular`) and a batch function (`batch`), as in
    HyperNodes: `run()` calls `singular`; a map calls `batch` on up to `batch_size` items at once
    (a hardy batched node, docs/batching.md), with HyperNodes' arguments (`call_batch`). Its results,
    cache entries and errors stay per item, and a batch call that raises or crashes is split
    until the failing item is found."""

    def __init__(self, output_name: str | Sequence[str], singular: Callable[..., Any],
                 batch: Callable[..., Any], cache: bool = True, batch_size: int = 64):
        name = getattr(singular, "__name__", "dual_node")
        for suffix in ("_singular", "_one", "_single"):
            if name.endswith(suffix):
                name = name[: -len(suffix)]
                break
        super().__init__(singular, output_name, name=name, cache=cache)
        _reporting_as_hypernodes(self)
        self.singular = singular
        self.batch = batch
        self.batch_size = arguments.whole_number(f"DualNode {name!r}", "batch_size", batch_size, 1)
        one_name_tuple_fits(self.name, self.outputs if self.unpacks else (), self.batch_size)
        self.is_dual_node = True

    def call_batch(self, **columns: list[Any]) -> Any:
        """HyperNodes' convention: arguments by position, in the order of `singular`'s
        parameters; a `@stateful` resource as itself, other values as a PyArrow array (a list
        where PyArrow cannot hold them, or is not installed); an Arrow or numpy array returned
        is read as a list."""
        assert self.batch is not None
        out = self.batch(*[_argument(columns[p]) for p in self.inputs if p in columns])
        if hasattr(out, "to_pylist"):
            return out.to_pylist()
        return out.tolist() if hasattr(out, "tolist") else out

    def fingerprint(self) -> bytes:
        """Both functions' code: a change to either is a different node."""
        from ...hashing import FORMAT, code_fingerprint, digest
        return digest(FORMAT, b"dual", code_fingerprint(self.singular), code_fingerprint(self.batch),
                      repr(self.outputs).encode())


def _argument(column: list[Any]) -> Any:
    first = column[0]
    if getattr(type(first), "__hypernode_stateful__", False):
        return first
    try:
        import pyarrow
        return pyarrow.array(column)
    except Exception:  # not installed, or values Arrow cannot hold (objects): the list itself
        return column
