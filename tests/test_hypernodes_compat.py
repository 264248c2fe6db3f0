"""Differential tests: the same HyperNodes 0.4.8 scripts run under HyperNodes itself (in a side
virtual environment, bench/.venv-hn, made once and reused) and under hardy with only the import
changed (`from hypernodes ...` -> `from hardy.compat.hypernodes ...`). Results, output dicts,
exposed names and the exception types a caller can catch must be the same. Most scenarios are
HyperNodes' own README and documentation examples; deliberate differences (docs/hypernodes.md)
are asserted separately at the end.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
VENV = ROOT / "bench" / ".venv-hn"
OFFLINE = ("NewConnectionError", "Network is unreachable", "Temporary failure in name resolution",
           "No matching distribution found", "Could not find a version", "ConnectTimeout", "ProxyError")

# Every scenario is a user's script. It may use TMP (a fresh directory) and outcome(fn), which
# runs fn and returns {"ok": value} or {"raises": [the HyperNodes and builtin exception types
# that catch the error]}; it leaves what it observed in `result`.
PRELUDE = '''
import hypernodes as _hn
def outcome(fn):
    try:
        return {"ok": fn()}
    except Exception as e:
        names = [n for n in ("HyperNodesError", "CycleError", "DependencyError", "ExecutionError")
                 if isinstance(e, getattr(_hn, n))]
        return {"raises": names + [b.__name__ for b in (ValueError, TypeError, KeyError, RuntimeError,
                                                        ZeroDivisionError) if isinstance(e, b)]}
'''

SCENARIOS = {
    "an_input_named_as_a_nodes_output_is_computed_not_used": '''
from hypernodes import Pipeline, node

@node(output_name="add")
def add(x: int, y: int) -> int:
    return x + y

@node(output_name="sq")
def sq(add: int) -> int:
    return add * add

p = Pipeline(nodes=[add, sq])  # a dataset row that happens to hold a column named as an output
result = {"run": p.run(inputs={"x": 1, "y": 2, "add": 100}),
          "map": p.map(inputs={"x": [1, 2], "y": 2, "add": 100}, map_over="x"),
          "only the output": outcome(lambda: p.run(inputs={"add": 100})),
          "bound": Pipeline(nodes=[add, sq]).bind(add=100).run(inputs={"x": 1, "y": 2})}
''',
    "a_product_map_varies_its_inputs_in_hypernodes_order": '''
from hypernodes import Pipeline, node

@node(output_name="pair")
def pair(lr: float, depth: int) -> tuple:
    return (lr, depth)

@node(output_name="xy")
def xy(x: int, y: int) -> tuple:
    return (x, y)

grid = {"lr": [0.1, 0.01], "depth": [2, 4]}
p, q = Pipeline(nodes=[pair]), Pipeline(nodes=[xy])
result = {"map": [r["pair"] for r in p.map(inputs=grid, map_over=["depth", "lr"], map_mode="product")],
          "bound": [r["pair"] for r in Pipeline(nodes=[pair]).bind(depth=[2, 4]).map(
              inputs={"lr": [0.1, 0.01]}, map_over=["lr", "depth"], map_mode="product")],
          "nested": Pipeline(nodes=[p.as_node(map_over=["depth", "lr"], map_mode="product")]).run(inputs=grid),
          "nested xy": Pipeline(nodes=[q.as_node(map_over=["y", "x"], map_mode="product")]).run(
              inputs={"x": [1, 2], "y": [10, 20]})}
''',
    "map_and_run_with_an_engine": '''
from hypernodes import Pipeline, SeqEngine, node

@node(output_name="double")
def double(x: int) -> int:
    return 2 * x

p = Pipeline(nodes=[double])
result = {"map": p.map(inputs={"x": [1, 2]}, map_over="x", engine=SeqEngine()),
          "run": p.run(inputs={"x": 3}, engine=SeqEngine())}
''',
    "visualize_takes_hypernodes_style_names": '''
from hypernodes import Pipeline, node

@node(output_name="y")
def inc(x: int) -> int:
    return x + 1

p = Pipeline(nodes=[inc])
result = {style: outcome(lambda: p.visualize(style=style) is not None)
          for style in ("modern", "sunny", "dark_neon", "legacy", "default")}
''',
    "a_scalar_for_two_outputs_is_a_type_error": '''
from hypernodes import Pipeline, node

@node(output_name=("q", "r"))
def div(a: int, b: int) -> tuple:
    return a

result = outcome(lambda: Pipeline(nodes=[div]).run(inputs={"a": 7, "b": 2}))
''',
    "bind_is_checked_when_the_call_runs": '''
from hypernodes import Pipeline, node

@node(output_name="s")
def add(x: int, y: int) -> int:
    return x + y

p = Pipeline(nodes=[add])
bound = outcome(lambda: p.bind(invalid_key=999) and None)  # HyperNodes keeps it; the call complains
result = {"bind": bound, "run": outcome(lambda: p.run())}
''',
    "readme_think_singular": '''
from hypernodes import Pipeline, node

@node(output_name="cleaned")
def clean(text: str) -> str:
    return text.strip().lower()

@node(output_name="word_count")
def count(cleaned: str) -> int:
    return len(cleaned.split())

text_processor = Pipeline(nodes=[clean, count], name="text_processor")
result = text_processor.run(inputs={"text": "  Hello World  "})
''',
    "readme_compose_and_map": '''
from hypernodes import Pipeline, node

@node(output_name="cleaned")
def clean(text: str) -> str:
    return text.strip().lower()

@node(output_name="word_count")
def count(cleaned: str) -> int:
    return len(cleaned.split())

@node(output_name="report")
def summarize(word_count: int, cleaned: str) -> str:
    return f"Processed: {word_count} words"

text_processor = Pipeline(nodes=[clean, count], name="text_processor")
analysis = Pipeline(nodes=[text_processor.as_node(), summarize], name="analysis")
result = {
    "run": analysis.run(inputs={"text": " A b C "}),
    "map": text_processor.map(inputs={"text": ["Hello", "World", "Foo Bar"]}, map_over="text"),
}
''',
    "readme_batch_processor": '''
from hypernodes import Pipeline, node

@node(output_name="cleaned")
def clean(text: str) -> str:
    return text.strip().lower()

@node(output_name="word_count")
def count(cleaned: str) -> int:
    return len(cleaned.split())

text_processor = Pipeline(nodes=[clean, count], name="text_processor")
batch_processor = text_processor.as_node(
    name="batch_text_processor", map_over="texts",
    input_mapping={"texts": "text"}, output_mapping={"word_count": "word_counts"})

@node(output_name="total")
def total(word_counts: list) -> int:
    return sum(word_counts)

outer = Pipeline(nodes=[batch_processor, total])
result = {"node_outputs": batch_processor.output_name, "node_inputs": list(batch_processor.root_args),
          "run": outer.run(inputs={"texts": ["a b", "c d e", "f"]})}
''',
    "readme_incremental_cache": '''
from hypernodes import Pipeline, SeqEngine, DiskCache, node

calls = []

@node(output_name="features")
def featurize(text: str) -> dict:
    calls.append(text)
    return {"len": len(text)}

engine = SeqEngine(cache=DiskCache(path=TMP + "/cache"))
featurizer = Pipeline(nodes=[featurize], engine=engine)
first = featurizer.map(inputs={"text": ["alpha", "beta"]}, map_over="text")
second = featurizer.map(inputs={"text": ["alpha", "beta", "delta"]}, map_over="text")
result = {"first": first, "second": second, "computed": calls}
''',
    "docs_fluent_configuration": '''
from hypernodes import Pipeline, DiskCache, SeqEngine, node

@node
def step1(x): return x + 1

@node
def step2(step1): return step1 * 2

base = Pipeline(nodes=[step2, step1])
pipeline = base.with_name("my_pipeline").with_engine(SeqEngine(cache=DiskCache(TMP + "/c")))
result = {"same_object": pipeline is base, "name": pipeline.name, "run": pipeline.run(inputs={"x": 10}),
          "map": pipeline.map(inputs={"x": [1, 2, 3]}, map_over="x"),
          "run_engine": pipeline.run(inputs={"x": 1}, engine=SeqEngine())}
''',
    "bind_unbind_unfulfilled": '''
from hypernodes import Pipeline, node

@node(output_name="y")
def scale(x: int, factor: int) -> int:
    return x * factor

p = Pipeline(nodes=[scale])
r = {"before": list(p.unfulfilled_args)}
p.bind(factor=3)
r.update(after=list(p.unfulfilled_args), bound=p.bound_inputs, run=p.run(inputs={"x": 2}),
         override=p.run(inputs={"x": 2, "factor": 10}))
p.bind(x=[1, 2, 3])
r["map_only_bound"] = p.map(map_over="x")
r["run_no_inputs"] = outcome(lambda: p.unbind("x").run())
p.unbind()
r["unbound_all"] = [p.bound_inputs, list(p.unfulfilled_args)]
result = r
''',
    "output_name_selection": '''
from hypernodes import Pipeline, node

@node(output_name="a")
def fa(x): return x + 1

@node(output_name="b")
def fb(a): return a * 2

@node(output_name=("lo", "hi"))
def bounds(b): return b - 1, b + 1

p = Pipeline(nodes=[fa, fb, bounds])
result = {"all": p.run(inputs={"x": 1}), "one": p.run(inputs={"x": 1}, output_name="b"),
          "two": p.run(inputs={"x": 1}, output_name=["a", "hi"]),
          "map_one": p.map(inputs={"x": [1, 2]}, map_over="x", output_name="lo"),
          "unknown": outcome(lambda: p.run(inputs={"x": 1}, output_name="nope"))}
''',
    "map_modes": '''
from hypernodes import Pipeline, node

@node(output_name="s")
def add(a, b): return a + b

p = Pipeline(nodes=[add])
result = {"zip": p.map(inputs={"a": [1, 2], "b": [10, 20]}, map_over=["a", "b"]),
          "product": p.map(inputs={"a": [1, 2], "b": [10, 20]}, map_over=["a", "b"], map_mode="product"),
          "broadcast": p.map(inputs={"a": [1, 2, 3], "b": 100}, map_over="a"),
          "empty": p.map(inputs={"a": [], "b": 1}, map_over="a"),
          "unequal": outcome(lambda: p.map(inputs={"a": [1, 2], "b": [1]}, map_over=["a", "b"])),
          "not_a_list": outcome(lambda: p.map(inputs={"a": 1, "b": 1}, map_over="a"))}
''',
    "errors": '''
from hypernodes import Pipeline, node

@node(output_name="y")
def f(x): return x + 1

@node(output_name="a")
def g(b): return b

@node(output_name="b")
def h(a): return a

@node(output_name="y")
def f2(x): return x

@node(output_name="z")
def bad(y): raise ValueError("boom")

@node(output_name="q")
def div(x): return 1 / x

result = {"missing": outcome(lambda: Pipeline(nodes=[f]).run(inputs={})),
          "cycle": outcome(lambda: Pipeline(nodes=[g, h])),
          "duplicate_output": outcome(lambda: Pipeline(nodes=[f, f2])),
          "node_raises_run": outcome(lambda: Pipeline(nodes=[f, bad]).run(inputs={"x": 1})),
          "node_raises_map": outcome(lambda: Pipeline(nodes=[div]).map(inputs={"x": [1, 0]}, map_over="x"))}
try:
    Pipeline(nodes=[f]).run(inputs={})
except ValueError as e:
    result["missing_message"] = str(e)[:len("Missing required input(s): ['x']")]
''',
    "nested_mappings": '''
from hypernodes import Pipeline, node

@node(output_name="cleaned")
def clean(text): return text.strip()

@node(output_name="n")
def length(cleaned): return len(cleaned)

inner = Pipeline(nodes=[clean, length], name="inner")
renamed = inner.as_node(name="renamed", input_mapping={"document": "text"}, output_mapping={"cleaned": "processed_doc"})
plain = inner.as_node(name="plain")
result = {"renamed_outputs": renamed.output_name, "renamed_inputs": list(renamed.root_args),
          "renamed_run": Pipeline(nodes=[renamed]).run(inputs={"document": " x "}),
          "plain_run": Pipeline(nodes=[plain]).run(inputs={"text": " yy "}),
          "fractal": Pipeline(nodes=[inner.as_node(name="b", map_over="text")]).run(inputs={"text": [" a", "bb "]})}
''',
    "nested_bound_inner": '''
from hypernodes import Pipeline, node

@node(output_name="y")
def scale(x, k): return x * k

inner = Pipeline(nodes=[scale]).bind(k=5)
n = inner.as_node(name="scaled")

@node(output_name="z")
def plus(y): return y + 1

outer = Pipeline(nodes=[n, plus])
result = {"inputs": list(n.root_args), "unfulfilled": list(outer.unfulfilled_args),
          "run": outer.run(inputs={"x": 2}), "map": outer.map(inputs={"x": [1, 2]}, map_over="x")}
''',
    "callbacks_events": '''
from hypernodes import Pipeline, SeqEngine, DiskCache, node
from hypernodes.callbacks import PipelineCallback, CallbackContext

class Recorder(PipelineCallback):
    def __init__(self): self.events = []
    def on_node_start(self, node_id, inputs, ctx): self.events.append(["node_start", node_id, inputs])
    def on_node_end(self, node_id, outputs, duration, ctx): self.events.append(["node_end", node_id, outputs])
    def on_node_cached(self, node_id, signature, ctx): self.events.append(["node_cached", node_id])
    def on_map_start(self, total_items, ctx): self.events.append(["map_start", total_items])
    def on_map_item_start(self, i, ctx): self.events.append(["item_start", i])
    def on_map_item_end(self, i, duration, ctx): self.events.append(["item_end", i])
    def on_map_item_cached(self, i, signature, ctx): self.events.append(["item_cached", i])
    def on_map_end(self, d, ctx): self.events.append(["map_end"])
    def on_pipeline_start(self, pid, inputs, ctx): self.events.append(["pipeline_start", inputs])
    def on_pipeline_end(self, pid, outputs, d, ctx): self.events.append(["pipeline_end", outputs])
    def on_error(self, node_id, error, ctx): self.events.append(["error", node_id, type(error).__name__])

@node(output_name="a")
def fa(x): return x + 1

@node(output_name="b")
def fb(a): return a * 2

rec = Recorder()
p = Pipeline(nodes=[fa, fb], engine=SeqEngine(cache=DiskCache(TMP + "/c"), callbacks=[rec]))
p.run(inputs={"x": 1})
run_events, rec.events = rec.events, []
p.run(inputs={"x": 1})
cached_events, rec.events = rec.events, []
p.map(inputs={"x": [5, 6]}, map_over="x")
map_events, rec.events = rec.events, []

@node(output_name="c")
def boom(b): raise KeyError("k")

q = Pipeline(nodes=[fa, fb, boom], engine=SeqEngine(callbacks=[rec]))
raised = outcome(lambda: q.run(inputs={"x": 1}))
result = {"run": run_events, "cached": cached_events, "map": map_events, "error": rec.events, "raised": raised}
''',
    "callbacks_of_nodes_with_two_outputs_or_a_dict": '''
from hypernodes import Pipeline, SeqEngine, node
from hypernodes.callbacks import PipelineCallback

class Recorder(PipelineCallback):
    def __init__(self): self.events = []
    def on_node_end(self, node_id, outputs, duration, ctx): self.events.append([node_id, repr(outputs)])

@node(output_name=("c", "d"))
def split(b): return b, -b

@node(output_name="info")
def describe(c): return {"c": c, "double": 2 * c}

rec = Recorder()
p = Pipeline(nodes=[split, describe], engine=SeqEngine(callbacks=[rec]))
p.run(inputs={"b": 2})
run_events, rec.events = rec.events, []
p.map(inputs={"b": [1, 3]}, map_over="b")
result = {"run": run_events, "map": rec.events}
''',
    "callbacks_nested": '''
from hypernodes import Pipeline, SeqEngine, node
from hypernodes.callbacks import PipelineCallback

class Recorder(PipelineCallback):
    def __init__(self): self.events = []
    def on_node_start(self, node_id, inputs, ctx): self.events.append(["node_start", node_id])
    def on_node_end(self, node_id, outputs, duration, ctx): self.events.append(["node_end", node_id, outputs])
    def on_nested_pipeline_start(self, parent, child, ctx): self.events.append(["nested_start"])
    def on_nested_pipeline_end(self, parent, child, d, ctx): self.events.append(["nested_end"])

@node(output_name="a")
def fa(x): return x + 1

inner = Pipeline(nodes=[fa], name="inner")

@node(output_name="b")
def fb(a): return a * 2

rec = Recorder()
outer = Pipeline(nodes=[inner.as_node(name="inner_node"), fb], engine=SeqEngine(callbacks=[rec]))
out = outer.run(inputs={"x": 1})
result = {"out": out, "events": rec.events}
''',
    "nested_cache_flag": '''
from hypernodes import Pipeline, SeqEngine, DiskCache, node

calls = []

@node(output_name="a")
def fa(x):
    calls.append(x)
    return x + 1

inner = Pipeline(nodes=[fa])
seen = {}
for flag in (True, False):
    calls.clear()
    outer = Pipeline(nodes=[inner.as_node(name="n", cache=flag)],
                     engine=SeqEngine(cache=DiskCache(TMP + f"/c{flag}")))
    outs = [outer.run(inputs={"x": 1}), outer.run(inputs={"x": 1}), outer.map(inputs={"x": [1, 2]}, map_over="x")]
    seen[str(flag)] = [outs, list(calls)]
result = seen
''',
    "map_cached_events": '''
from hypernodes import Pipeline, SeqEngine, DiskCache, node
from hypernodes.callbacks import PipelineCallback

class Recorder(PipelineCallback):
    def __init__(self): self.events = []
    def on_node_cached(self, node_id, signature, ctx): self.events.append(["node_cached", node_id])
    def on_map_item_cached(self, i, signature, ctx): self.events.append(["item_cached", i])
    def on_node_start(self, node_id, inputs, ctx): self.events.append(["node_start", node_id])

@node(output_name="y")
def inc(x): return x + 1

rec = Recorder()
p = Pipeline(nodes=[inc], engine=SeqEngine(cache=DiskCache(TMP + "/c"), callbacks=[rec]))
p.map(inputs={"x": [1, 2]}, map_over="x")
first, rec.events = rec.events, []
out = p.map(inputs={"x": [1, 2, 3]}, map_over="x")
result = {"first": first, "second": rec.events, "out": out}
''',
    "cache_key_objects": '''
from hypernodes import Pipeline, SeqEngine, DiskCache, node

class Config:
    def __init__(self, name, noise):
        self.name, self.noise = name, noise
    def __cache_key__(self):
        return self.name

calls = []

@node(output_name="y")
def use(cfg: Config) -> str:
    calls.append(cfg.noise)
    return cfg.name

p = Pipeline(nodes=[use], engine=SeqEngine(cache=DiskCache(TMP + "/c")))
outs = [p.run(inputs={"cfg": Config("a", 1)}), p.run(inputs={"cfg": Config("a", 2)}),
        p.run(inputs={"cfg": Config("b", 3)})]
result = {"outs": outs, "computed": calls}
''',
    "stateful_docs": '''
from hypernodes import Pipeline, node, stateful

built = []

@stateful
class ExpensiveModel:
    def __init__(self, model_path: str):
        built.append(model_path)
        self.path = model_path
    def predict(self, text: str) -> str:
        return f"{self.path}:{text}"

model = ExpensiveModel("./model.pkl")
lazy = list(built)

@node(output_name="prediction")
def predict(text: str, model: ExpensiveModel) -> str:
    return model.predict(text)

p = Pipeline(nodes=[predict])
out = p.map(inputs={"text": ["a", "b", "c"], "model": model}, map_over="text")
result = {"isinstance": isinstance(model, ExpensiveModel), "built_before_use": lazy, "out": out,
          "built": built, "name": type(model).__name__}
''',
    "stateful_cache_key": '''
from hypernodes import Pipeline, SeqEngine, DiskCache, node, stateful

@stateful
class Model:
    def __init__(self, path, device):
        self.path, self.device = path, device
    def __cache_key__(self):
        return f"Model(path={self.path})"

calls = []

@node(output_name="y")
def use(x, model):
    calls.append(x)
    return f"{model.path}-{x}"

p = Pipeline(nodes=[use], engine=SeqEngine(cache=DiskCache(TMP + "/c")))
a = p.run(inputs={"x": 1, "model": Model("m1", "cpu")})
b = p.run(inputs={"x": 1, "model": Model("m1", "cuda")})  # same __cache_key__: a cache hit
c = p.run(inputs={"x": 1, "model": Model("m2", "cpu")})
result = {"outs": [a, b, c], "computed": calls}
''',
    "dual_node": '''
from hypernodes import Pipeline, DualNode

def double_one(x: int) -> int:
    return x * 2

def double_batch(x):
    return [v * 2 for v in x.to_pylist()]

n = DualNode(output_name="doubled", singular=double_one, batch=double_batch)
p = Pipeline(nodes=[n])
result = {"name": n.name, "run": p.run(inputs={"x": 4})}
''',
    "node_forms": '''
from hypernodes import Pipeline, Node, node

@node
def plain(x): return x + 1

@node()
def empty_parens(plain): return plain * 10

@node(output_name=("q", "r"))
def divmod_(empty_parens): return divmod(empty_parens, 7)

def raw(q, r): return q - r

p = Pipeline(nodes=[plain, empty_parens, divmod_, Node(raw, output_name="diff")])
result = {"run": p.run(inputs={"x": 4}), "output_names": [plain.output_name, list(divmod_.output_name)],
          "root_args": list(divmod_.root_args), "call": plain(1)}
''',
    "async_nodes": '''
import asyncio
from hypernodes import Pipeline, node

@node(output_name="a")
async def fetch(x):
    await asyncio.sleep(0)
    return x * 3

@node(output_name="b")
def after(a): return a + 1

p = Pipeline(nodes=[fetch, after])
result = {"run": p.run(inputs={"x": 2}), "map": p.map(inputs={"x": [1, 2]}, map_over="x")}
''',
    "progress_callback": '''
from hypernodes import Pipeline, SeqEngine, node
from hypernodes.telemetry import ProgressCallback

@node(output_name="y")
def f(x): return x + 1

p = Pipeline(nodes=[f], engine=SeqEngine(callbacks=[ProgressCallback(enable=False)]))
result = {"run": p.run(inputs={"x": 1}), "map": p.map(inputs={"x": [1, 2, 3]}, map_over="x")}
''',
    "exposed_names": '''
import hypernodes, hypernodes.engines, hypernodes.cache, hypernodes.callbacks, hypernodes.telemetry
public = ["node", "stateful", "DualNode", "HyperNode", "Node", "Pipeline", "SeqEngine", "DiskCache",
          "PipelineCallback", "CallbackContext", "GraphvizTheme", "DESIGN_STYLES", "HyperNodesError",
          "CycleError", "DependencyError", "ExecutionError", "__version__", "DaftEngine"]
hooks = ["on_pipeline_start", "on_pipeline_end", "on_node_start", "on_node_end", "on_node_cached", "on_error",
         "on_nested_pipeline_start", "on_nested_pipeline_end", "on_map_start", "on_map_end",
         "on_map_item_start", "on_map_item_end", "on_map_item_cached"]
ctx = hypernodes.CallbackContext()
ctx.push_pipeline("outer"); ctx.push_pipeline("inner"); ctx.set("k", 1)
result = {"top": [n for n in public if hasattr(hypernodes, n)],
          "engines": [n for n in ("SeqEngine", "DaftEngine") if hasattr(hypernodes.engines, n)],
          "cache": hasattr(hypernodes.cache, "DiskCache"),
          "callbacks": [n for n in ("PipelineCallback", "CallbackContext") if hasattr(hypernodes.callbacks, n)],
          "telemetry": [n for n in ("ProgressCallback", "TelemetryCallback") if hasattr(hypernodes.telemetry, n)],
          "hooks": [h for h in hooks if callable(getattr(hypernodes.PipelineCallback, h, None))],
          "ctx": [ctx.depth, ctx.current_pipeline_id, ctx.parent_pipeline_id, ctx.hierarchy_path, ctx.get("k")],
          "pipeline_methods": [m for m in ("run", "map", "bind", "unbind", "as_node", "with_engine", "with_name",
                                           "visualize") if callable(getattr(hypernodes.Pipeline, m, None))],
          "styles": "default" in hypernodes.DESIGN_STYLES}
''',
    "nested_exposure_rule": '''
from hypernodes import Pipeline, node

log = []

@node(output_name="doubled")
def double(x: int) -> int:
    log.append("double")
    return x * 2

@node(output_name="incremented")
def add_one(doubled: int) -> int:
    return doubled + 1

@node(output_name="result")
def square(incremented: int) -> int:
    return incremented ** 2

inner = Pipeline(nodes=[double, add_one])
two_level = Pipeline(nodes=[Pipeline(nodes=[Pipeline(nodes=[double]).as_node(), add_one]).as_node(), square])

@node(output_name="a")
def make_a(x):
    log.append("a")
    return x * 2

@node(output_name="b")
def make_b(a):
    log.append("b")
    return a * 3

@node(output_name="c")
def make_c(b):
    log.append("c")
    return b * 4

@node(output_name="result")
def use_first(first):
    log.append("result")
    return first + 100

abc = Pipeline(nodes=[make_a, make_b, make_c])
selective = Pipeline(nodes=[abc.as_node(output_mapping={"a": "first", "b": "second", "c": "third"}), use_first])
result = {"used_some": Pipeline(nodes=[inner.as_node(), square]).run(inputs={"x": 5}),
          "two_level": two_level.run(inputs={"x": 5}),
          "unused": Pipeline(nodes=[inner.as_node()]).run(inputs={"x": 5})}
log.clear()
result["selective"] = [selective.run(inputs={"x": 5}), list(log)]
log.clear()
result["map"] = [selective.map(inputs={"x": [1, 2]}, map_over="x"), list(log)]
''',
    "pipeline_node_call": '''
from hypernodes import Pipeline, node

@node(output_name="a")
def make_a(x): return x * 2

@node(output_name="b")
def make_b(x): return x * 3

@node(output_name="c")
def make_c(x): return x * 4

inner = Pipeline(nodes=[make_a, make_b, make_c])
result = {"mapped": inner.as_node(output_mapping={"a": "first", "b": "second"})(x=5),
          "all": Pipeline(nodes=[make_a, make_b]).as_node()(x=5),
          "map_over": inner.as_node(map_over="xs", input_mapping={"xs": "x"},
                                    output_mapping={"c": "cs"})(xs=[1, 2])}
''',
    "default_named_nested": '''
from hypernodes import Pipeline, node

@node(output_name="result")
def process_a(input: int) -> int:
    return input * 2

@node(output_name="result")
def process_b(input: int) -> int:
    return input * 3

@node(output_name="combined")
def combine(result_a: int, result_b: int) -> int:
    return result_a + result_b

a = Pipeline(nodes=[process_a]).as_node(output_mapping={"result": "result_a"})
b = Pipeline(nodes=[process_b]).as_node(output_mapping={"result": "result_b"})
outer = Pipeline(nodes=[a, b, combine])
result = {"run": outer.run(inputs={"input": 5}), "map": outer.map(inputs={"input": [1, 2]}, map_over="input")}
''',
    "introspection": '''
from hypernodes import Pipeline, node
from hypernodes.pipeline_node import PipelineNode

@node(output_name="doubled")
def double(x: int) -> int:
    return x * 2

@node(output_name="total")
def add(doubled: int, y: int) -> int:
    return doubled + y

@node(output_name="scaled")
def scale(value: int, factor: int) -> int:
    return value * factor

inner = Pipeline(nodes=[double, add])
plain = PipelineNode(pipeline=inner)
named = PipelineNode(pipeline=inner, name="custom")
positional = PipelineNode(inner, {"outer_y": "y"}, None, None, "zip", False, "positional")
bound = Pipeline(nodes=[double, add]).bind(x=5)
mapped = Pipeline(nodes=[scale]).bind(factor=10).as_node(map_over="values", input_mapping={"values": "value"})
result = {"root_args": inner.graph.root_args, "outputs": inner.graph.available_output_names,
          "order": [n.name for n in inner.graph.execution_order],
          "code_hash": [len(double.code_hash), double.code_hash == add.code_hash, len(plain.code_hash)],
          "node": [named.name, list(plain.root_args), plain.output_name, positional.name,
                   list(positional.root_args), isinstance(inner.as_node(), PipelineNode)],
          "bound": [bound.as_node().bound_inputs, bound.as_node(input_mapping={"outer_y": "y"}).unfulfilled_args,
                    mapped.unfulfilled_args],
          "repr": ["bound=" in repr(bound), "needs=" in repr(bound) and "y" in repr(bound)],
          "run": Pipeline(nodes=[named]).run(inputs={"x": 1, "y": 2})}
''',
    "map_cached_context": '''
from hypernodes import Pipeline, SeqEngine, DiskCache, PipelineCallback, node

events = []

class Tracker(PipelineCallback):
    def on_node_cached(self, node_id, signature, ctx):
        events.append(["cached", node_id, bool(ctx.get("_in_map")), ctx.get("_map_item_index")])

    def on_node_start(self, node_id, inputs, ctx):
        events.append(["start", node_id, bool(ctx.get("_in_map")), ctx.get("_map_item_index")])

    def on_map_item_cached(self, item_index, signature, ctx):
        events.append(["item_cached", item_index])

@node(output_name="doubled")
def double(item: int) -> int:
    return item * 2

p = Pipeline(nodes=[double], engine=SeqEngine(cache=DiskCache(path=TMP + "/c"), callbacks=[Tracker()]))
runs = []
for items in ([1, 2, 3], [1, 2, 3], [1, 2, 4]):
    events.clear()
    runs.append([p.map(inputs={"item": items}, map_over="item"), list(events)])
events.clear()
p.run(inputs={"item": 1})
result = {"maps": runs, "run_after_map": events}
''',
    "cache_private_attributes": '''
from hypernodes import Pipeline, SeqEngine, DiskCache, node

log = []

class Processor:
    def __init__(self, config):
        self.config = config
        self._internal_counter = 0
        self._cache = {}

class Client:
    def __init__(self, model):
        self.model = model
        self._session = open(__file__)  # unhashable private state, as HyperNodes' docs show

@node(output_name="result")
def process(processor, value: int) -> int:
    log.append(["process", processor.config, value])
    return value * 2

@node(output_name="answer")
def ask(client, prompt: str) -> str:
    log.append(["ask", client.model])
    return client.model + ":" + prompt

p = Pipeline(nodes=[process], engine=SeqEngine(cache=DiskCache(path=TMP + "/c")))
busy = Processor("v1")
busy._internal_counter, busy._cache = 100, {"some": "data"}
runs = [p.run(inputs={"processor": Processor("v1"), "value": 5}),
        p.run(inputs={"processor": busy, "value": 5}),
        p.run(inputs={"processor": Processor("v2"), "value": 5})]
q = Pipeline(nodes=[ask], engine=SeqEngine(cache=DiskCache(path=TMP + "/q")))
runs += [q.run(inputs={"client": Client("m"), "prompt": "hi"}), q.run(inputs={"client": Client("m"), "prompt": "hi"})]
result = {"runs": runs, "computed": log}
''',
    "stateful_lazy_instance": '''
from hypernodes import stateful

@stateful
class Model:
    def __init__(self, value: int):
        self.value = value

m = Model(value=42)
before = m._instance is None
result = [Model.__hypernode_stateful__, before, m.value, m._instance is not None]
''',
    "callback_supported_engines": '''
from hypernodes import Pipeline, PipelineCallback, SeqEngine, node

class DaftOnly(PipelineCallback):
    @property
    def supported_engines(self):
        return ["DaftEngine"]

class SeqOnly(PipelineCallback):
    @property
    def supported_engines(self):
        return ["SeqEngine"]

@node(output_name="y")
def f(x): return x + 1

refused = Pipeline(nodes=[f], engine=SeqEngine(callbacks=[DaftOnly()]))
result = {"run": outcome(lambda: refused.run(inputs={"x": 1})),
          "map": outcome(lambda: refused.map(inputs={"x": [1]}, map_over="x")),
          "accepted": Pipeline(nodes=[f], engine=SeqEngine(callbacks=[SeqOnly()])).run(inputs={"x": 1})}
''',
    "a_one_name_tuple_output_is_unpacked": '''
from hypernodes import Pipeline, node

@node(output_name=("label",))
def classify(score): return ("pos" if score > 0 else "neg",)

@node(output_name="report")
def report(label): return f"label={label} len={len(label)}"

@node(output_name=("u", "v"))
def pair(x): return (i for i in (x, x * 2))

@node(output_name=("w", "z"))
def listed(x): return [x, -x]

p = Pipeline(nodes=[classify, report])
result = {"run": p.run(inputs={"score": 3}), "map": p.map(inputs={"score": [3, -1]}, map_over="score"),
          "output_name": list(classify.output_name), "is_tuple": isinstance(classify.output_name, tuple),
          "generator": Pipeline(nodes=[pair, listed]).run(inputs={"x": 3})}
''',
    "independent_nodes_run_in_hypernodes_order": '''
import random
from hypernodes import Pipeline, node

log = []

@node(output_name="noise_b")
def zeta(n):
    log.append("zeta")
    return round(random.random(), 4)

@node(output_name="noise_a")
def alpha(n):
    log.append("alpha")
    return round(random.random(), 4)

@node(output_name="mid")
def mid(n):
    log.append("mid")
    return n

@node(output_name="after")
def beta(noise_a): return noise_a

random.seed(0)
p = Pipeline(nodes=[zeta, mid, alpha])
r = p.run(inputs={"n": 1})
result = {"run": r, "keys": list(r), "log": log, "order": [n.output_name for n in p.graph.execution_order],
          "ready_by_name": [n.name for n in Pipeline(nodes=[zeta, beta, alpha]).graph.execution_order]}
''',
    "graph_and_node_introspection": '''
from hypernodes import Pipeline, node

@node(output_name="y")
def f(x): return x + 1

@node(output_name="z")
def g(y): return y * 2

@node(output_name="w")
def h(x): return x

p = Pipeline(nodes=[f, g, h])
inner = Pipeline(nodes=[f, g]).as_node()
result = {"id": p.id.startswith("pipeline_") and p.id != Pipeline(nodes=[f]).id,
          "output_to_node": {k: v.name for k, v in p.graph.output_to_node.items()},
          "required": [n.name for n in p.graph.get_required_nodes("z")],
          "required all": p.graph.get_required_nodes(None),
          "unknown": outcome(lambda: p.graph.get_required_nodes("nope")),
          "required_outputs": p.graph.required_outputs,
          "nested required_outputs": list(Pipeline(nodes=[inner, node(output_name="q")(lambda y: y)])
                                          .graph.required_outputs.values()),
          "__name__": f.__name__, "nodes": type(p.nodes).__name__, "len": len(p.nodes),
          "eq": [f == node(output_name="y")(f.func), f == g, f == node(output_name="yy")(f.func)]}
''',
}

# Deliberate differences (docs/hypernodes.md): checked here so the table stays true.
DIFFERENCES = {
    "default_values": '''
from hypernodes import Pipeline, node

@node(output_name="y")
def f(x, k=2): return x * k

result = outcome(lambda: Pipeline(nodes=[f]).run(inputs={"x": 1}))
''',
    "cache_keys_tell_types_apart": '''
from hypernodes import Pipeline, SeqEngine, DiskCache, node

@node(output_name="kind")
def kind(x): return type(x).__name__

p = Pipeline(nodes=[kind], engine=SeqEngine(cache=DiskCache(TMP + "/c")))
result = [p.run(inputs={"x": 1})["kind"], p.run(inputs={"x": "1"})["kind"]]
''',
}


def _offline(text: str) -> bool:
    return any(marker in text for marker in OFFLINE)


@pytest.fixture(scope="session")
def hypernodes_python() -> Path:
    """The side environment with HyperNodes 0.4.8 (a test tool, never a hardy dependency)."""
    python = VENV / "bin" / "python"
    probe = [str(python), "-c", "import hypernodes, tqdm, cloudpickle, pyarrow, importlib.metadata as m; "
                                "assert m.version('hypernodes') == '0.4.8'"]
    if python.exists() and subprocess.run(probe, capture_output=True).returncode == 0:
        return python
    subprocess.run([sys.executable, "-m", "venv", "--clear", str(VENV)], check=True)
    pip = subprocess.run([str(python), "-m", "pip", "install", "-q", "hypernodes==0.4.8", "tqdm", "cloudpickle",
                                                      "pyarrow"],
                         capture_output=True, text=True)
    if pip.returncode != 0:
        if _offline(pip.stdout + pip.stderr):
            pytest.skip(f"the package index is unreachable, so HyperNodes 0.4.8 cannot be installed: "
                        f"{(pip.stdout + pip.stderr).strip().splitlines()[-1]}")
        raise AssertionError(f"installing hypernodes==0.4.8 into {VENV} failed:\n{pip.stderr}")
    return python


DRIVER = '''
import json, runpy, sys
out = {}
for name, path, tmp in json.loads(sys.argv[1]):
    try:
        g = runpy.run_path(path, init_globals={"TMP": tmp})
        out[name] = g["result"]
    except Exception as e:
        out[name] = {"script failed": f"{type(e).__name__}: {e}"}
print("RESULTS" + json.dumps(out, default=repr))
'''


def _run_all(python: Path, scenarios: dict[str, str], tmp: Path, module: str, env: dict[str, str]) -> dict:
    jobs = []
    for name, code in scenarios.items():
        source = PRELUDE + textwrap.dedent(code)
        if module != "hypernodes":  # the one change a user makes
            source = source.replace("import hypernodes as _hn", f"import {module} as _hn")
            source = source.replace("from hypernodes", f"from {module}")
            source = source.replace("import hypernodes, hypernodes.engines, hypernodes.cache, hypernodes.callbacks, "
                                    "hypernodes.telemetry",
                                    f"import {module} as hypernodes, {module}.engines, {module}.cache, "
                                    f"{module}.callbacks, {module}.telemetry")
        path = tmp / f"{name}.py"
        path.write_text(source)
        (tmp / name).mkdir()
        jobs.append((name, str(path), str(tmp / name)))
    proc = subprocess.run([str(python), "-c", DRIVER, json.dumps(jobs)], capture_output=True, text=True,
                          env=env, cwd=tmp, timeout=240)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULTS")), None)
    assert line is not None, f"scenario driver failed under {module}:\n{proc.stderr[-3000:]}"
    return json.loads(line[len("RESULTS"):])


@pytest.fixture(scope="session")
def both(hypernodes_python: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, dict]:
    scenarios = {**SCENARIOS, **DIFFERENCES}
    base_env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    theirs = _run_all(hypernodes_python, scenarios, tmp_path_factory.mktemp("hypernodes"), "hypernodes", base_env)
    ours = _run_all(Path(sys.executable), scenarios, tmp_path_factory.mktemp("hardy"), "hardy.compat.hypernodes",
                    {**base_env, "PYTHONPATH": str(ROOT / "src"), "HARDY_PROGRESS": "0"})
    return theirs, ours


def _same(ours: object, theirs: object) -> bool:
    """Equal, except that an error may be catchable by more types under hardy than under HyperNodes
    (hardy's errors also derive from the matching built-in, e.g. a CycleError is a ValueError),
    never by fewer: every `except` a HyperNodes user wrote still catches it."""
    if isinstance(theirs, dict) and isinstance(ours, dict):
        if set(theirs) == {"raises"} == set(ours):
            return set(theirs["raises"]) <= set(ours["raises"])
        return theirs.keys() == ours.keys() and all(_same(ours[k], theirs[k]) for k in theirs)
    if isinstance(theirs, list) and isinstance(ours, list):
        return len(ours) == len(theirs) and all(_same(a, b) for a, b in zip(ours, theirs))
    return ours == theirs


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_same_results_as_hypernodes(both: tuple[dict, dict], name: str) -> None:
    theirs, ours = both
    assert "script failed" not in theirs[name], theirs[name]
    assert _same(ours[name], theirs[name]), f"hardy: {ours[name]}\nHyperNodes: {theirs[name]}"


def test_comparison_allows_extra_catching_types_only() -> None:
    assert _same({"raises": ["ValueError", "CycleError"]}, {"raises": ["CycleError"]})
    assert not _same({"raises": ["ValueError"]}, {"raises": ["CycleError"]})
    assert not _same({"ok": [1, 2]}, {"ok": [1, 3]}) and not _same({"ok": 1}, {"raises": ["ValueError"]})


@pytest.mark.slow
def test_defaults_make_inputs_optional_where_hypernodes_requires_them(both: tuple[dict, dict]) -> None:
    theirs, ours = both
    assert theirs["default_values"] == {"raises": ["ValueError"]}
    assert ours["default_values"] == {"ok": {"y": 2}}


@pytest.mark.slow
def test_cache_never_answers_a_str_with_an_int_result_where_hypernodes_does(both: tuple[dict, dict]) -> None:
    theirs, ours = both
    assert theirs["cache_keys_tell_types_apart"] == ["int", "int"]  # "1" got the cached result of 1
    assert ours["cache_keys_tell_types_apart"] == ["int", "str"]


# --- hardy only: HyperNodes' engine arguments land on hardy's engines -------------------------------


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_daft_and_dask_engines_take_hypernodes_arguments(tmp_path):
    pytest.importorskip("daft")
    pytest.importorskip("distributed")
    from hardy.compat.hypernodes import DiskCache, Pipeline, PipelineCallback, node
    from hardy.compat.hypernodes.engines import DaftEngine, DaskEngine

    class Items(PipelineCallback):
        def __init__(self):
            self.done = []

        def on_map_item_end(self, item_index, duration, ctx):
            self.done.append(item_index)

    @node(output_name="y")
    def square(x: int) -> int:
        return x * x

    items = Items()
    daft_engine = DaftEngine(use_batch_udf=True, default_daft_config={"max_concurrency": 1, "use_process": True},
                             cache=DiskCache(str(tmp_path / "c")), callbacks=[items])
    assert daft_engine.map_executor.resources["max_concurrency"] == 1
    p = Pipeline(nodes=[square], engine=daft_engine)
    assert p.map(inputs={"x": [1, 2, 3]}, map_over="x") == [{"y": 1}, {"y": 4}, {"y": 9}]
    assert sorted(items.done) == [0, 1, 2]
    with DaskEngine(scheduler="processes", num_workers=1) as dask_engine:
        assert p.with_engine(dask_engine).map(inputs={"x": [4, 5]}, map_over="x") == [{"y": 16}, {"y": 25}]


def test_readme_visualize_call_writes_a_drawing(tmp_path):
    """HyperNodes' README: `featurizer.visualize(filename=..., engine="graphviz", separate_outputs=True,
    depth=None)` writes the file (here with or without a system Graphviz) and returns None."""
    import xml.etree.ElementTree as ET

    from hardy.compat.hypernodes import Pipeline, node

    @node(output_name="features")
    def featurize(text: str) -> dict:
        return {"len": len(text)}

    featurizer = Pipeline(nodes=[featurize], name="featurizer")
    target = tmp_path / "outputs" / "cache_walkthrough.svg"
    target.parent.mkdir()
    assert featurizer.visualize(filename=str(target), engine="graphviz", separate_outputs=True, depth=None) is None
    titles = {t.text for t in ET.parse(target).iter("{http://www.w3.org/2000/svg}title")}
    assert {"featurize", "input:text", "output:features"} <= titles
    assert "<svg" in featurizer.visualize(engine="js")._repr_html_()


def test_only_compat_keys_leave_private_attributes_out(tmp_path):
    """HyperNodes' keying (public attributes) holds through hardy.compat.hypernodes; hardy's own
    DiskCache keeps private state in the key, and refuses state it cannot hash."""
    import threading

    from hardy import DiskCache as HardyDiskCache
    from hardy.compat.hypernodes import DiskCache
    from hardy.errors import UnhashableError

    class Client:
        def __init__(self, model, session):
            self.model, self._session = model, session

    ours = DiskCache(str(tmp_path / "compat"))
    assert ours.input_key(Client("m", 1), "client") == ours.input_key(Client("m", 2), "client")
    assert ours.input_key(Client("m", threading.Lock()), "client") == ours.input_key(Client("m", 1), "client")
    assert ours.input_key(Client("m", 1), "client") != ours.input_key(Client("n", 1), "client")
    strict = HardyDiskCache(str(tmp_path / "hardy"))
    assert strict.input_key(Client("m", 1), "client") != strict.input_key(Client("m", 2), "client")
    with pytest.raises(UnhashableError, match="_session"):
        strict.input_key(Client("m", threading.Lock()), "client")
