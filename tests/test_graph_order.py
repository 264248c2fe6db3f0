"""The order a pipeline's nodes run in: dependencies first, and among the nodes ready, the declared
order (hardy's own pipelines) or HyperNodes' choice, the first by name (`hardy.compat.hypernodes`),
under every executor; and HyperNodes' graph introspection."""

from __future__ import annotations

import random

import pytest

from hardy import Engine, node
from hardy import Pipeline as OwnPipeline
from hardy.compat.hypernodes import Pipeline
from hardy.errors import UnknownOutputError


@node(output_name="noise_b")
def zeta(n: int) -> float:
    return random.Random(n).random() if n < 0 else random.random()


@node(output_name="noise_a")
def alpha(n: int) -> float:
    return random.random()


@node(output_name="mid")
def mid(n: int) -> int:
    return n


@node(output_name="after_alpha")
def beta(noise_a: float) -> float:
    return noise_a


def test_hardys_own_pipelines_keep_the_declared_order_level_by_level() -> None:
    """hardy's own API is unchanged: a seeded generator gives each node what it gave before."""
    assert [n.name for n in OwnPipeline(nodes=[zeta, mid, alpha]).graph.execution_order] == ["zeta", "mid", "alpha"]
    assert [n.name for n in OwnPipeline(nodes=[zeta, beta, alpha]).graph.execution_order] == ["zeta", "alpha", "beta"]
    assert list(OwnPipeline(nodes=[zeta, beta, mid, alpha], engine=Engine(map_executor="sequential")).run(
        inputs={"n": 1})) == ["noise_b", "noise_a", "mid", "after_alpha"]


def test_ready_nodes_are_ordered_by_name_as_in_hypernodes() -> None:
    p = Pipeline(nodes=[zeta, mid, alpha])
    assert [n.name for n in p.graph.execution_order] == ["alpha", "mid", "zeta"]
    assert list(p.run(inputs={"n": 1})) == ["noise_a", "mid", "noise_b"]
    # a node made ready by the one just run competes by name with those ready before it
    assert [n.name for n in Pipeline(nodes=[zeta, beta, alpha]).graph.execution_order] == ["alpha", "beta", "zeta"]


def test_two_ready_nodes_of_one_name_keep_the_order_they_became_ready_in() -> None:
    def same(x: int) -> int:
        return x

    late = node(output_name="b", name="same")(lambda a: a)  # declared first, ready only once 'a' is computed
    first = node(output_name="a")(same)
    other = node(output_name="c")(same)
    assert [n.outputs[0] for n in Pipeline(nodes=[late, first, other]).graph.execution_order] == ["a", "c", "b"]


@pytest.mark.parametrize("executor", ["sequential", "threaded", "async"])
def test_every_executor_returns_the_outputs_in_that_order(executor: str) -> None:
    p = Pipeline(nodes=[zeta, beta, mid, alpha], engine=Engine(node_executor=executor))
    got = p.run(inputs={"n": -1})
    assert list(got) == ["noise_a", "after_alpha", "mid", "noise_b"]
    assert got["noise_b"] == random.Random(-1).random() and got["after_alpha"] == got["noise_a"]


def test_hypernodes_graph_introspection() -> None:
    p = Pipeline(nodes=[zeta, mid, alpha, beta])
    assert p.graph.output_to_node == {"noise_b": zeta, "mid": mid, "noise_a": alpha, "after_alpha": beta}
    assert p.graph.get_required_nodes("after_alpha") == [alpha, beta]
    assert p.graph.get_required_nodes(["mid", "noise_b"]) == [mid, zeta]
    assert p.graph.get_required_nodes(None) is None
    with pytest.raises(UnknownOutputError, match="no output 'nope'"):
        p.graph.get_required_nodes("nope")
    assert p.graph.required_outputs == {}
    inner = Pipeline(nodes=[alpha, beta], name="inner").as_node()
    assert Pipeline(nodes=[inner, node(output_name="z")(lambda noise_a: 1)]).graph.required_outputs == {
        inner: ["noise_a"]}
