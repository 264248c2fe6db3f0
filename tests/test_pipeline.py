"""The core API: nodes, pipelines, run, map, nesting, bind, outputs and defaults."""

from __future__ import annotations

import numpy as np
import pytest

from hardy import Engine, Failed, Node, Pipeline, node


@node(output_name="cleaned")
def clean(text: str) -> str:
    return text.strip().lower()


@node
def count(cleaned: str) -> int:
    return len(cleaned.split())


@node(output_name=("lo", "hi"))
def bounds(x: int, margin: int = 1):
    return x - margin, x + margin


@node(output_name="a")
def add_one(x):
    return x + 1


@node(output_name="b")
def double(a):
    return 2 * a


@node(output_name="c")
def total(a, b):
    return a + b


def test_run_returns_every_output():
    p = Pipeline(nodes=[clean, count], name="text")
    assert p.run(inputs={"text": " Hi There "}) == {"cleaned": "hi there", "count": 2}


def test_output_name_defaults_to_function_name():
    assert count.outputs == ("count",)
    assert count.inputs == ("cleaned",)
    assert count("a b c") == 3  # a node is still the plain function


def test_only_needed_nodes_run():
    calls = []

    @node(output_name="x2")
    def expensive(x):
        calls.append("expensive")
        return x

    @node(output_name="y")
    def cheap(x):
        calls.append("cheap")
        return x

    p = Pipeline(nodes=[expensive, cheap])
    assert p.run(inputs={"x": 1}, output_name="y") == {"y": 1}
    assert calls == ["cheap"]
    assert p.run(inputs={"x": 1}, output_name=["y", "x2"]) == {"y": 1, "x2": 1}


def test_multiple_outputs_and_defaults():
    p = Pipeline(nodes=[bounds])
    assert p.run(inputs={"x": 10}) == {"lo": 9, "hi": 11}
    assert p.run(inputs={"x": 10, "margin": 5}) == {"lo": 5, "hi": 15}


def test_keyword_only_and_defaults_before_given_params():
    @node(output_name="r")
    def f(a, b=2, *, c, d=4):
        return (a, b, c, d)

    p = Pipeline(nodes=[f])
    assert p.run(inputs={"a": 1, "c": 3}) == {"r": (1, 2, 3, 4)}
    assert p.run(inputs={"a": 1, "c": 3, "d": 9}) == {"r": (1, 2, 3, 9)}


def test_provided_value_overrides_its_producer():
    p = Pipeline(nodes=[add_one, double, total])
    assert p.run(inputs={"x": 1}) == {"a": 2, "b": 4, "c": 6}
    assert p.run(inputs={"a": 10}) == {"b": 20, "c": 30}


def test_plain_functions_and_pipelines_are_accepted_as_nodes():
    def shout(cleaned):
        return cleaned.upper()

    inner = Pipeline(nodes=[clean], name="inner")
    p = Pipeline(nodes=[inner, shout])
    assert p.run(inputs={"text": " a "}) == {"cleaned": "a", "shout": "A"}


def test_map_zip_keeps_input_order_and_constants():
    p = Pipeline(nodes=[clean, count])
    docs = ["  A b", "c ", " d e f"]
    out = p.map(inputs={"text": docs}, map_over="text", progress=False)
    assert [o["count"] for o in out] == [2, 1, 3]


def test_map_product():
    @node(output_name="s")
    def add(a, b):
        return a + b

    p = Pipeline(nodes=[add])
    out = p.map(inputs={"a": [1, 2], "b": [10, 20]}, map_over=["a", "b"], map_mode="product")
    assert [o["s"] for o in out] == [11, 21, 12, 22]
    out = p.map(inputs={"a": [1, 2], "b": [10, 20]}, map_over=["a", "b"])
    assert [o["s"] for o in out] == [11, 22]


@pytest.mark.parametrize("make", [list, tuple, lambda xs: range(len(xs)), np.array,
                                  lambda xs: (x for x in xs)])
def test_map_over_any_iterable(make):
    p = Pipeline(nodes=[add_one])
    out = p.map(inputs={"x": make([0, 1, 2])}, map_over="x")
    assert [int(o["a"]) for o in out] == [1, 2, 3]


def test_map_equals_list_of_runs_for_every_executor():
    xs = list(range(50))
    expected = [Pipeline(nodes=[add_one, double, total]).run(inputs={"x": x}) for x in xs]
    for ex in ("sequential", "threaded", "async"):
        p = Pipeline(nodes=[add_one, double, total], engine=Engine(map_executor=ex, node_executor=ex))
        assert p.map(inputs={"x": xs}, map_over="x") == expected
        assert p.run(inputs={"x": 3}) == expected[3]


def test_empty_map():
    p = Pipeline(nodes=[add_one])
    assert p.map(inputs={"x": []}, map_over="x") == []


def test_bind_and_unbind():
    @node(output_name="greeting")
    def greet(name, lang):
        return f"{lang}:{name}"

    p = Pipeline(nodes=[greet]).bind(lang="en")
    assert p.run(inputs={"name": "a"}) == {"greeting": "en:a"}
    assert p.run(inputs={"name": "a", "lang": "fr"}) == {"greeting": "fr:a"}  # run() overrides
    assert [r["greeting"] for r in p.map(inputs={"name": ["a", "b"]}, map_over="name")] == ["en:a", "en:b"]
    p.unbind("lang")
    with pytest.raises(ValueError, match="lang"):
        p.run(inputs={"name": "a"})


def test_nested_pipeline_with_mappings():
    inner = Pipeline(nodes=[clean, count], name="inner")
    prep = inner.as_node(name="prep", input_mapping={"doc": "text"}, output_mapping={"cleaned": "doc_clean"})
    assert prep.inputs == ("doc",)
    assert prep.outputs == ("doc_clean",)  # HyperNodes' rule: with a mapping, only mapped outputs

    @node(output_name="loud")
    def shout(doc_clean):
        return doc_clean.upper()

    outer = Pipeline(nodes=[prep, shout])
    assert outer.run(inputs={"doc": " Hello World "}) == {"doc_clean": "hello world", "loud": "HELLO WORLD"}


def test_nested_pipeline_mapped_over_a_list():
    inner = Pipeline(nodes=[clean], name="inner")
    prep = inner.as_node(name="prep", input_mapping={"docs": "text"},
                         output_mapping={"cleaned": "all_clean"}, map_over="docs")

    @node(output_name="n")
    def how_many(all_clean):
        return len(all_clean)

    outer = Pipeline(nodes=[prep, how_many])
    assert outer.run(inputs={"docs": [" A", "B "]}) == {"all_clean": ["a", "b"], "n": 2}


def test_nested_pipeline_uses_inner_bound_values():
    @node(output_name="y")
    def scale(x, factor):
        return x * factor

    inner = Pipeline(nodes=[scale], name="scale").bind(factor=3)
    outer = Pipeline(nodes=[inner.as_node()])
    assert outer.run(inputs={"x": 2}) == {"y": 6}


def test_node_class_directly():
    n = Node(lambda v: v * 3, "tripled", name="triple")
    assert Pipeline(nodes=[n]).run(inputs={"v": 2}) == {"tripled": 6}


def test_map_continue_returns_failed_in_place():
    @node(output_name="inv")
    def invert(x):
        return 1 / x

    p = Pipeline(nodes=[invert])
    out = p.map(inputs={"x": [1, 0, 2]}, map_over="x", on_error="continue")
    assert out[0] == {"inv": 1.0} and out[2] == {"inv": 0.5}
    assert isinstance(out[1], Failed)
    assert out[1].error.item == 1 and out[1].error.node == "invert"
    assert isinstance(out[1].error.__cause__, ZeroDivisionError)
