"""A node's outputs as declared: a tuple of names (one name included) unpacks the result, strictly;
the errors for what cannot be unpacked, and for a node hardy cannot read, name the node and the fix."""

from __future__ import annotations

import functools

import pytest

from hardy import Engine, Pipeline, node
from hardy.errors import LazyOutputError, NodeDefinitionError, NodeError, OutputCountError


@node(output_name=("label",))
def classify(score: int) -> tuple[str]:
    return ("pos" if score > 0 else "neg",)


@node(output_name="report")
def report(label: str) -> str:
    return f"{label}:{len(label)}"


def test_a_one_name_tuple_unpacks_the_one_tuple_returned() -> None:
    p = Pipeline(nodes=[classify, report])
    assert p.run(inputs={"score": 3}) == {"label": "pos", "report": "pos:3"}
    assert p.map(inputs={"score": [3, -1]}, map_over="score") == [
        {"label": "pos", "report": "pos:3"}, {"label": "neg", "report": "neg:3"}]
    assert classify.output_name == ("label",) and classify.outputs == ("label",)
    assert classify(1) == ("pos",)  # calling the node calls the function unchanged


@pytest.mark.parametrize("returned", ["pos", 7, {"label": 1}, ("a", "b")])
def test_a_one_name_tuple_refuses_anything_but_one_value(returned: object) -> None:
    @node(output_name=("label",))
    def f(x: int) -> object:
        return returned

    with pytest.raises(OutputCountError, match=r"output_name=\('label',\), a tuple of one name.*return a 1-tuple"):
        Pipeline(nodes=[f]).run(inputs={"x": 1})


def test_a_generator_or_other_iterable_of_the_right_count_is_unpacked() -> None:
    @node(output_name=("u", "v"))
    def pair(x: int):  # type: ignore[no-untyped-def]
        return (i for i in (x, x * 2))

    @node(output_name=("w",))
    def one(x: int):  # type: ignore[no-untyped-def]
        yield x + 1

    assert Pipeline(nodes=[pair, one]).run(inputs={"x": 3}) == {"u": 3, "v": 6, "w": 4}


def test_an_iterable_of_the_wrong_count_a_dict_or_a_set_is_refused_with_what_it_was() -> None:
    def returning(make: object) -> Pipeline:  # (`make` builds the value in the node: a generator does not pickle)
        return Pipeline(nodes=[node(output_name=("u", "v"))(lambda x: make())])  # type: ignore[operator]

    with pytest.raises(OutputCountError, match="a generator of more than 2 values"):
        returning(lambda: (i for i in range(5))).run(inputs={"x": 1})
    with pytest.raises(OutputCountError, match="a generator of 1 values"):
        returning(lambda: (i for i in range(1))).run(inputs={"x": 1})
    with pytest.raises(OutputCountError, match=r"a dict of length 2, which is not unpacked \(that would give its keys\)"):
        returning(lambda: {"u": 1, "v": 2}).run(inputs={"x": 1})
    with pytest.raises(OutputCountError, match=r"a set of length 2, which is not unpacked \(it has no order\)"):
        returning(lambda: {1, 2}).run(inputs={"x": 1})


def test_a_generator_output_error_names_the_node() -> None:
    @node(output_name="g")
    def gen(n: int):  # type: ignore[no-untyped-def]
        yield from range(n)

    with pytest.raises(NodeError) as caught:
        Pipeline(nodes=[gen]).run(inputs={"n": 2})
    cause = caught.value.__cause__
    assert isinstance(cause, LazyOutputError)
    assert str(cause).startswith("node 'gen': its output 'g' is a generator")


def test_a_one_name_tuple_is_unpacked_in_an_isolated_worker_and_refused_with_batches() -> None:
    """An isolated node's worker stores the unpacked value, and its caller unpacks the 1-tuple the
    call gives back: the same as in-process. A batched node's lists cannot carry it yet: refused."""
    @node(output_name=("y",), isolate=True)
    def one(x: int) -> tuple[int]:
        return (x + 1,)

    for engine in (Engine(map_executor="sequential"), Engine(workers=1)):
        with engine:
            p = Pipeline(nodes=[one], engine=engine)
            assert p.run(inputs={"x": 1}) == {"y": 2}
            assert p.map(inputs={"x": [1, 2]}, map_over="x") == [{"y": 2}, {"y": 3}]
    with pytest.raises(NodeDefinitionError, match=r"cannot be combined with batch_size= yet"):
        node(output_name=("y",), batch_size=4)(lambda x: (x,))


def test_a_decorator_without_wraps_is_told_to_use_functools_wraps() -> None:
    def logged(func):  # type: ignore[no-untyped-def]
        def w(*a, **k):  # type: ignore[no-untyped-def]
            return func(*a, **k)
        return w

    def wrapped(func):  # type: ignore[no-untyped-def]
        @functools.wraps(func)
        def w(*a, **k):  # type: ignore[no-untyped-def]
            return func(*a, **k)
        return w

    with pytest.raises(NodeDefinitionError, match=r"node 'w': parameter 'a' is \*args.*@functools.wraps\(func\)"):
        node(output_name="y")(logged(lambda x: x))

    def add(a: int, b: int) -> int:
        return a + b

    assert Pipeline(nodes=[node(output_name="y")(wrapped(add))]).run(inputs={"a": 1, "b": 2}) == {"y": 3}


def test_nodes_of_the_same_function_and_outputs_are_equal_as_in_hypernodes() -> None:
    def f(x: int) -> int:
        return x

    def g(x: int) -> int:
        return x

    g.__name__ = "f"
    a, b = node(output_name="y")(f), node(output_name="y")(f)
    assert a == b and hash(a) == hash(b) and a.__name__ == "f"
    assert a != node(output_name="z")(f)
    assert a != node(output_name="y")(g)  # another function of the same name computes something else


def test_a_one_name_tuple_nodes_event_holds_the_unpacked_value() -> None:
    """`on_node_end` said `{'label': ('pos',)}` where the pipeline holds `'pos'`."""
    from hardy import PipelineCallback

    seen: list[dict[str, object]] = []

    class Ends(PipelineCallback):
        def on_node_end(self, node_id, outputs, duration, ctx):  # type: ignore[no-untyped-def]
            seen.append(dict(outputs))

    @node(output_name=("label",))
    def classify(score: int) -> tuple[str]:
        return ("pos" if score > 0 else "neg",)

    Pipeline(nodes=[classify], callbacks=[Ends()], engine=Engine(map_executor="sequential")).run(inputs={"score": 3})
    assert seen == [{"label": "pos"}]


def test_a_node_declared_with_x_or_a_tuple_of_x_keys_its_results_apart(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """`output_name="x"` makes `x` the 1-tuple a node returns, `("x",)` its item: a node reading
    `x` downstream was served the other declaration's cached result (same key)."""
    from hardy import DiskCache

    def f(a: int) -> tuple[int]:
        return (a,)

    @node(output_name="y")
    def g(x: object) -> str:
        return repr(x)

    got = [Pipeline(nodes=[node(output_name=declared)(f), g], cache=DiskCache(str(tmp_path)),
                    engine=Engine(map_executor="sequential")).run(inputs={"a": 5})["y"]
           for declared in ("x", ("x",))]
    assert got == ["(5,)", "5"]


def test_a_dataframe_for_two_outputs_is_refused_not_unpacked_into_its_column_labels() -> None:
    import pandas as pd

    @node(output_name=("a", "b"))
    def frame(x: int) -> pd.DataFrame:
        return pd.DataFrame({"u": [x, x], "v": [x, x]})  # two rows: iterating gives 'u', 'v'

    with pytest.raises(OutputCountError, match="a DataFrame of 2 rows, which is not unpacked"):
        Pipeline(nodes=[frame], engine=Engine(map_executor="sequential")).run(inputs={"x": 1})


def test_a_hypernodes_dual_node_with_a_one_name_tuple_is_refused() -> None:
    """A DualNode batches (batch_size 64 by default), which a one-name tuple cannot be carried
    through yet: on the process executor its 1-tuples were kept whole where sequential unpacked."""
    from hardy.compat.hypernodes import DualNode

    with pytest.raises(NodeDefinitionError, match=r"cannot be combined with batch_size= yet"):
        DualNode(output_name=("y",), singular=lambda x: (x,), batch=lambda xs: [(x,) for x in xs])
