"""The core API: nodes, pipelines, run, map, nesting, bind, outputs and defaults."""

from __future__ import annotations

import numpy as np
import pytest

from hardy import Engine, Failed, Node, Pipeline, node
from hardy.errors import MapInputError, NodeError


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

    p = Pipeline(nodes=[expensive, cheap], engine=Engine(map_executor="sequential"))  # in-process: `calls` is this process's list
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


class CountsOtherThings:
    """A len() that counts something else than what iterating gives (as a DataFrame's does)."""

    def __len__(self) -> int:
        return 3

    def __iter__(self):
        return iter([0])


def test_map_over_a_frame_or_a_miscounting_iterable_is_refused_with_the_fix():
    import pandas as pd
    p = Pipeline(nodes=[add_one])
    frame = pd.DataFrame({"x": [0, 1]})
    for lazy in (p.map, lambda **kw: list(p.imap(**kw))):
        with pytest.raises(MapInputError, match=r"iterates over its column names.*df\.to_dict\('records'\)"):
            lazy(inputs={"x": frame}, map_over="x")
    with pytest.raises(MapInputError, match="len.. says 3 item.s., but iterating them gives 1"):
        p.map(inputs={"x": CountsOtherThings()}, map_over="x")
    assert [o["a"] for o in p.map(inputs={"x": frame["x"]}, map_over="x")] == [1, 2]  # a column: its values

    class Subclassed(pd.DataFrame):  # (geopandas' GeoDataFrame is one)
        pass

    pair = Pipeline(nodes=[node(output_name="s")(lambda x, b: (x, b))])
    with pytest.raises(MapInputError, match="is a pandas DataFrame"):
        pair.map(inputs={"x": Subclassed({"c": [1, 2]}), "b": [7, 8]}, map_over=["x", "b"])
    for mode in ("zip", "product"):  # several inputs: no trailing None either
        with pytest.raises(MapInputError, match="but iterating them gives"):
            pair.map(inputs={"x": CountsOtherThings(), "b": [7, 8, 9]}, map_over=["x", "b"], map_mode=mode)
    with pytest.raises(MapInputError, match="holds a single value"):
        p.map(inputs={"x": np.array(5)}, map_over="x")


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


NESTED_ON_THREADS = """
from hardy import Engine, Pipeline, node

@node(output_name="y")
def inc(x):
    return x + 1

@node(output_name="xs")
def spread(n):
    return list(range(n, n + 12))

inner = Pipeline(nodes=[inc], name="inner")
grow = inner.as_node(name="grow", input_mapping={"xs": "x"}, output_mapping={"y": "ys"}, map_over="xs")
outer = Pipeline(nodes=[spread, grow], engine=Engine(map_executor="threaded", workers=2))
print(sum(sum(o["ys"]) for o in outer.map(inputs={"n": list(range(8))}, map_over="n")))
"""


def test_a_nested_map_on_the_threaded_executor_runs_in_the_outer_items_thread():
    """The nested map shares the engine's thread pool, whose threads all run outer items: its
    items run in the outer item's thread instead of waiting for a free one (which never came: the
    script hung). A script, as users write it, in its own process: a hang fails by the timeout."""
    import subprocess
    import sys
    out = subprocess.run([sys.executable, "-"], input=NESTED_ON_THREADS, capture_output=True, text=True,
                         check=True, timeout=120).stdout
    assert int(out) == sum(x + 1 for n in range(8) for x in range(n, n + 12))


def test_nested_pipeline_uses_inner_bound_values():
    @node(output_name="y")
    def scale(x, factor):
        return x * factor

    inner = Pipeline(nodes=[scale], name="scale").bind(factor=3)
    outer = Pipeline(nodes=[inner.as_node()])
    assert outer.run(inputs={"x": 2}) == {"y": 6}


def test_nested_pipeline_computes_only_the_outputs_a_run_needs():
    ran = []

    @node(output_name="summary")
    def summarize(text):
        ran.append("summarize")
        return text[:3]

    @node(output_name="embedding")
    def embed(text, model):  # the expensive branch; only it reads `model`
        ran.append("embed")
        return [len(text), model]

    @node(output_name="title")
    def titled(summary):
        return summary.title()

    inner = Pipeline(nodes=[summarize, embed], name="doc")
    outer = Pipeline(nodes=[inner.as_node(), titled], engine=Engine(map_executor="sequential"))  # `ran`: here
    # `summary` is read downstream, `embedding` is not: it stays inside, is not computed, and its
    # input is not required
    assert outer.run(inputs={"text": "hello"}) == {"summary": "hel", "title": "Hel"}
    assert ran == ["summarize"]
    assert outer.run(inputs={"text": "ab", "model": "m"}, output_name="embedding") == {"embedding": [2, "m"]}
    assert ran == ["summarize", "embed"]
    assert outer.map(inputs={"text": ["ab", "cd"]}, map_over="text", output_name="title") == [
        {"title": "Ab"}, {"title": "Cd"}]
    alone = Pipeline(nodes=[inner.as_node()])  # nothing reads the outputs: all of them leave
    assert alone.run(inputs={"text": "xy", "model": "m"}) == {"summary": "xy", "embedding": [2, "m"]}
    assert inner.as_node()(text="xyz", model="m") == {"summary": "xyz", "embedding": [3, "m"]}


def test_nested_pipelines_that_keep_the_default_name_are_numbered():
    @node(output_name="y")
    def inc(x):
        raise ValueError("boom")

    @node(output_name="z")
    def neg(x):
        return -x

    outer = Pipeline(nodes=[Pipeline(nodes=[neg]), Pipeline(nodes=[inc])])
    assert [n.name for n in outer.nodes] == ["pipeline", "pipeline_2"]
    with pytest.raises(NodeError) as exc:
        outer.run(inputs={"x": -1})
    assert exc.value.node == "pipeline_2/inc"  # the error tells which of the two failed


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


# --- HyperNodes' fluent API, engines per call, nested maps that keep going ------------------------


def test_with_engine_with_name_and_unfulfilled_args_chain():
    p = Pipeline(nodes=[add_one, double])
    engine = Engine(node_executor="threaded")
    assert p.with_name("calc").with_engine(engine) is p
    assert p.name == "calc" and p.engine is engine
    assert p.unfulfilled_args == ("x",) and p.bind(x=1).unfulfilled_args == ()
    assert p.run() == {"a": 2, "b": 4}


def test_run_and_map_on_another_engine_leave_the_pipeline_as_it_was():
    p = Pipeline(nodes=[add_one, double])
    threads = Engine(map_executor="threaded", workers=2)
    assert p.run(inputs={"x": 1}, engine=threads) == {"a": 2, "b": 4}
    assert p.map(inputs={"x": [1, 2]}, map_over="x", engine=threads) == [{"a": 2, "b": 4}, {"a": 3, "b": 6}]
    assert p.engine is not threads
    p.bind(x=[5, 6])
    assert p.map(map_over="x", engine=threads) == [{"a": 6, "b": 12}, {"a": 7, "b": 14}]  # lists may be bound


def test_nested_map_on_error_continue_keeps_a_crashed_item_as_failed():
    """A segfault inside a nested map costs that one inner item, not the outer item or the run."""
    import os
    import signal

    from hardy import NodeCrashed

    @node(output_name="sq")
    def square(v):
        if v == 3:
            os.kill(os.getpid(), signal.SIGSEGV)
        return v * v

    with Engine(map_executor="process", workers=2) as engine:
        inner = Pipeline(nodes=[square], name="inner", engine=engine)
        keep_going = inner.as_node(name="squares", input_mapping={"vs": "v"}, output_mapping={"sq": "sqs"},
                                   map_over="vs", on_error="continue")
        out = Pipeline(nodes=[keep_going]).run(inputs={"vs": [1, 2, 3, 4]})["sqs"]
        assert out[:2] == [1, 4] and out[3] == 16
        assert isinstance(out[2], Failed) and isinstance(out[2].error, NodeCrashed)
        assert out[2].error.signal == "SIGSEGV" and out[2].error.item == 2

        strict = inner.as_node(name="squares", input_mapping={"vs": "v"}, map_over="vs")
        outer = Pipeline(nodes=[strict])
        rows = outer.map(inputs={"vs": [[1, 2], [3], [4]]}, map_over="vs", on_error="continue")
        assert rows[0] == {"sq": [1, 4]} and rows[2] == {"sq": [16]}
        assert isinstance(rows[1], Failed) and rows[1].error.node == "squares/square"  # the outer item, reported
        assert rows[1].error.item == 1 and "in nested map at 'square' item 0" in str(rows[1].error)


def test_callbacks_see_cached_nodes_and_nested_pipelines(tmp_path):
    from hardy import DiskCache, PipelineCallback

    class Recorder(PipelineCallback):
        def __init__(self):
            self.events = []

        def on_node_start(self, node_id, inputs, ctx):
            self.events.append(("start", node_id, ctx.depth))

        def on_node_cached(self, node_id, signature, ctx):
            self.events.append(("cached", node_id, len(signature)))

        def on_map_item_cached(self, item_index, signature, ctx):
            self.events.append(("item_cached", item_index))

        def on_nested_pipeline_start(self, parent_id, child_pipeline_id, ctx):
            self.events.append(("nested", parent_id, child_pipeline_id))

    rec = Recorder()
    inner = Pipeline(nodes=[add_one], name="inner")
    # in-process: a nested pipeline inside a worker reports as the one node that runs it (observability.md)
    p = Pipeline(nodes=[inner.as_node(name="inc"), double], name="outer", callbacks=[rec],
                 cache=DiskCache(tmp_path / "c"), engine=Engine(map_executor="sequential"))
    p.run(inputs={"x": 1})
    assert rec.events == [("start", "inc", 1), ("nested", "outer", "inner"), ("start", "add_one", 2),
                          ("start", "double", 1)]
    rec.events.clear()
    p.map(inputs={"x": [1]}, map_over="x")
    assert ("cached", "double", 32) in rec.events and ("item_cached", 0) in rec.events
    assert ("cached", "add_one", 32) in rec.events  # the nested pipeline's node, from its own cache lookup


def test_stateful_returns_the_class_and_honours_its_cache_key():
    import cloudpickle

    from hardy import stateful

    @stateful
    class Model:
        built = 0

        def __init__(self, path):
            Model.built += 1
            self.path = path

        def __cache_key__(self):
            return ("model", self.path)

    m = Model("a")
    assert isinstance(m, Model) and Model.__name__ == "Model" and Model.built == 0  # class attributes too
    assert m.__cache_key__() == ("model", "a") and m.path == "a"
    again = cloudpickle.loads(cloudpickle.dumps(m))  # travels as (class, arguments, key), never the object
    assert isinstance(again, Model) and again.path == "a"


def test_daft_engine_is_importable_from_hardy_without_importing_daft_first():
    import subprocess
    import sys
    code = ("import sys, hardy; assert 'daft' not in sys.modules; from hardy import daft_engine; "
            "print(daft_engine.__module__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "hardy.integrations.daft"



STATEFUL_ATTRIBUTES = """
import copy, sys, threading, tempfile
from hardy import DiskCache, Engine, Pipeline, node, stateful

@stateful
class Model:
    def __init__(self, k):
        self.k, self.threshold = k, 0.5

    def calibrate(self):
        self.threshold = 0.7

@node(output_name="y")
def scored(x, model):
    return [x * model.k, model.threshold]

m = Model(2)
m.lock = threading.Lock()  # (does not pickle: the other processes' objects keep their own, none)
m.threshold = 0.9
for name in ("sequential", "process"):
    for cache in (None, DiskCache(tempfile.mkdtemp())):
        p = Pipeline([scored], engine=Engine(map_executor=name), cache=cache)
        print(name, cache is not None, p.map(inputs={"x": [1, 2], "model": m}, map_over="x"))
m.calibrate()
copy.deepcopy({"model": m})  # (a copy in its own process: its object keeps what calibrate() set)
print("after copy", m.threshold)
"""


def test_stateful_attributes_that_cannot_travel_stay_and_a_copy_resets_nothing(tmp_path):
    """Attributes set on a @stateful handle travel to workers where they pickle; a lock set on it
    made every map fail to ship it (and every cached map fail to key it). A copy of the handle in
    its own process left what the object's methods changed since as it was."""
    import subprocess
    import sys
    out = subprocess.run([sys.executable, "-"], input=STATEFUL_ATTRIBUTES, capture_output=True, text=True,
                         timeout=180, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    rows = "[{'y': [2, 0.9]}, {'y': [4, 0.9]}]"
    assert out.stdout.splitlines() == [f"sequential False {rows}", f"sequential True {rows}",
                                       f"process False {rows}", f"process True {rows}", "after copy 0.7"]


GPU_ATTRIBUTES = """
import torch
from hardy import Engine, Pipeline, node, stateful

@stateful
class Model:
    def __init__(self):
        self.head = None

@node(output_name="y")
def seen(x, model):
    return [x, None if model.head is None else str(next(model.head.parameters()).device)]

m = Model()
m.head = torch.nn.Linear(2, 2, device="meta")  # (a device no worker should be handed: as a GPU)
print(Pipeline([seen], engine=Engine(map_executor="process")).map(inputs={"x": [1], "model": m}, map_over="x"))
m.head = torch.nn.Linear(2, 2)
print(Pipeline([seen], engine=Engine(map_executor="process")).map(inputs={"x": [1], "model": m}, map_over="x"))
"""


def test_a_stateful_attribute_holding_a_model_off_the_cpu_stays_in_its_process(tmp_path):
    """A torch module whose parameters are on another device than the CPU, set on a handle, does
    not travel (a worker would start CUDA to unpickle it); one on the CPU does."""
    import subprocess
    import sys

    from conftest import needs_torch
    needs_torch()
    out = subprocess.run([sys.executable, "-"], input=GPU_ATTRIBUTES, capture_output=True, text=True, timeout=180,
                         cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == ["[{'y': [1, None]}]", "[{'y': [1, 'cpu']}]"]
