# Nodes that start their own processes and threads, and the ways of calling a pipeline: run, map,
# imap, isolated nodes, nested pipelines, a cache. Each reads state the script set at run time.
# Run as `python - EXECUTOR < pools_and_calls.py`. (A `spawn` or `forkserver` pool started from a
# script read from stdin cannot start in the calling process either: its children look for the
# script's file; those pools are in notebooks.py, where the calling process can start them.)
import concurrent.futures
import multiprocessing
import os
import threading

import corpus
from corpus import pattern, write
from hardy import DiskCache, Failed, Pipeline, node, stateful

engine = corpus.engine()
XS = [1, 2, 3]

write("pool_steps.py", """
    from hardy import node
    OFFSET = 0
    SETTINGS = {"scale": 1}

    def shifted(v):
        return v + OFFSET

    @node(output_name="y")
    def scaled(x):
        return x * SETTINGS["scale"] + OFFSET
""")
import pool_steps  # noqa: E402 -- written by the script above, as a user's module


def ys(nodes, xs=XS, output="y", **options):
    out = corpus.pipeline(nodes, engine, **options).map(inputs={"x": xs}, map_over="x")
    return [o[output] if not isinstance(o, Failed) else corpus.comparable(o) for o in out]


def square(v):  # a helper of the script's, sent to a node's own pool
    return v * v


SCRIPT_FACTOR = {"f": 1}


def times_script_factor(v):
    return v * SCRIPT_FACTOR["f"]


@pattern
def multiprocessing_pool_fork_over_a_script_helper():
    @node(output_name="y")
    def squares(x):
        with multiprocessing.get_context("fork").Pool(2) as pool:
            return pool.map(square, range(x + 1))

    return ys([squares])


@pattern
def fork_pool_imap_unordered_over_a_script_helper_reading_a_script_global():
    @node(output_name="y")
    def scaled_all(x):
        with multiprocessing.get_context("fork").Pool(2) as pool:
            return sorted(pool.imap_unordered(times_script_factor, range(x + 2)))

    SCRIPT_FACTOR["f"] = 10
    return ys([scaled_all], xs=[1, 2])


@pattern
def process_pool_executor_over_a_script_helper():
    @node(output_name="y")
    def squares(x):
        with concurrent.futures.ProcessPoolExecutor(2) as pool:
            return list(pool.map(square, range(x + 1)))

    return ys([squares], xs=[2, 3])


@pattern
def fork_pool_over_a_module_helper_reading_state_set_at_run_time():
    @node(output_name="y")
    def shifted_all(x):
        with multiprocessing.get_context("fork").Pool(2) as pool:
            return pool.map(pool_steps.shifted, range(x))

    pool_steps.OFFSET = 100
    return ys([shifted_all])


@pattern
def threads_started_by_a_node_read_module_state():
    @node(output_name="y")
    def threaded(x):
        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            return list(pool.map(lambda v: v * pool_steps.SETTINGS["scale"], range(x)))

    pool_steps.SETTINGS["scale"] = 7
    return ys([threaded])


@pattern
def thread_started_by_a_node_and_joined():
    @node(output_name="y")
    def background(x):
        out = []
        t = threading.Thread(target=lambda: out.append((x, os.environ.get("WORKER_TAG"), pool_steps.OFFSET)))
        t.start()
        t.join()
        return out[0]

    os.environ["WORKER_TAG"] = "tagged"
    pool_steps.OFFSET = 3
    return ys([background])


@pattern
def run_then_map_then_imap_with_state_changed_between():
    p = Pipeline(nodes=[pool_steps.scaled], engine=engine)
    pool_steps.OFFSET, pool_steps.SETTINGS["scale"] = 0, 2
    one = p.run(inputs={"x": 5})
    pool_steps.SETTINGS["scale"] = 3
    many = p.map(inputs={"x": XS}, map_over="x")
    pool_steps.OFFSET = 1000
    streamed = list(p.imap(inputs={"x": XS}, map_over="x"))
    return [one, many, streamed]


@pattern
def imap_unordered_over_a_generator():
    pool_steps.OFFSET, pool_steps.SETTINGS["scale"] = 5, 10
    p = Pipeline(nodes=[pool_steps.scaled], engine=engine)
    out = p.imap(inputs={"x": (x for x in range(6))}, map_over="x", ordered=False, indexed=True)
    return sorted((i, o["y"]) for i, o in out)


@pattern
def imap_with_state_changed_while_it_streams():
    # The map was called with SETTINGS as it was then: a change made while its results come back
    # is the script's own business, so only the first result is compared.
    pool_steps.OFFSET, pool_steps.SETTINGS["scale"] = 0, 4
    stream = Pipeline(nodes=[pool_steps.scaled], engine=engine).imap(inputs={"x": [1]}, map_over="x")
    first = next(stream)
    pool_steps.SETTINGS["scale"] = 99
    stream.close()
    return first


@pattern
def map_product_mode_reads_state():
    write("prod_steps.py", """
        from hardy import node
        SEP = "-"

        @node(output_name="y")
        def joined(a, b):
            return f"{a}{SEP}{b}"
    """)
    import prod_steps
    prod_steps.SEP = "::"
    out = Pipeline(nodes=[prod_steps.joined], engine=engine).map(
        inputs={"a": [1, 2], "b": ["u", "v"]}, map_over=["a", "b"], map_mode="product")
    return out


@pattern
def bound_inputs_and_state_changed():
    p = Pipeline(nodes=[pool_steps.scaled], engine=engine).bind(x=4)
    pool_steps.OFFSET, pool_steps.SETTINGS["scale"] = 0, 6
    first = p.run()
    pool_steps.SETTINGS["scale"] = 8
    return [first, p.run()]


@pattern
def isolated_node_on_every_executor_reads_state_and_environment():
    write("iso_steps.py", """
        import os
        from hardy import node
        TABLE = {"k": 1}

        @node(output_name="y", isolate=True)
        def isolated(x):
            return [x * TABLE["k"], os.environ.get("ISO", "-"), os.getpid() != int(os.environ["CALLER_PID"])]
    """)
    import iso_steps
    os.environ["CALLER_PID"] = str(os.getpid())
    iso_steps.TABLE["k"] = 12
    os.environ["ISO"] = "on"
    first = ys([iso_steps.isolated], xs=[1])
    iso_steps.TABLE["k"] = 13
    return [first, Pipeline(nodes=[iso_steps.isolated], engine=engine).run(inputs={"x": 2})]


@pattern
def isolated_node_after_an_edit_and_reload():
    import importlib
    write("isor_steps.py", """
        from hardy import node

        @node(output_name="y", isolate=True)
        def isolated(x):
            return x + 1
    """)
    import isor_steps
    first = ys([isor_steps.isolated], xs=[1])
    with open("isor_steps.py") as f:
        source = f.read()
    write("isor_steps.py", source.replace("x + 1", "x + 2"))
    importlib.reload(isor_steps)
    second = ys([isor_steps.isolated], xs=[1])
    write("isor_steps.py", source.replace("x + 1", "x + 3"))  # not reloaded
    return [first, second, ys([isor_steps.isolated], xs=[1])]


@pattern
def nested_pipeline_with_map_over_reads_state():
    inner = Pipeline(nodes=[pool_steps.scaled], name="inner")
    outer_node = inner.as_node(input_mapping={"xs": "x"}, output_mapping={"y": "ys"}, map_over="xs")

    @node(output_name="total")
    def total(ys):
        return sum(ys)

    p = Pipeline(nodes=[outer_node, total], engine=engine)
    pool_steps.OFFSET, pool_steps.SETTINGS["scale"] = 1, 2
    first = p.run(inputs={"xs": XS})
    pool_steps.SETTINGS["scale"] = 5
    second = p.map(inputs={"xs": [[1], [1, 2]]}, map_over="xs")
    return [first, second]


@pattern
def nested_pipeline_node_redefined_in_the_script():
    def make(add):
        @node(output_name="y")
        def step(x):
            return x + add
        return step

    inner = Pipeline(nodes=[make(1)], name="inner")
    p = Pipeline(nodes=[inner.as_node(map_over="x")], engine=engine)
    first = p.run(inputs={"x": XS})
    inner = Pipeline(nodes=[make(100)], name="inner")
    p = Pipeline(nodes=[inner.as_node(map_over="x")], engine=engine)
    return [first, p.run(inputs={"x": XS})]


@pattern
def cache_hits_and_misses_follow_state():
    write("cache_steps.py", """
        import numpy as np
        from hardy import node
        WEIGHTS = np.ones(3)
        SETTINGS = {"bias": 0}

        @node(output_name="y")
        def scored(x, log):
            with open(log, "a") as f:
                f.write(f"{x}\\n")
            return float(WEIGHTS.sum() * x + SETTINGS["bias"])
    """)
    import cache_steps
    cache = DiskCache(".cache-state")

    def call():
        out = Pipeline(nodes=[cache_steps.scored], engine=engine, cache=cache).map(
            inputs={"x": XS, "log": os.path.abspath("calls.log")}, map_over="x")
        with open("calls.log") as f:
            return [[o["y"] for o in out], len(f.read().split())]

    steps = [call(), call()]  # computed, then read back
    cache_steps.SETTINGS["bias"] = 0.5
    steps.append(call())  # the state changed: computed again
    cache_steps.WEIGHTS[0] = 10.0
    steps.append(call())  # changed in place: computed again
    cache_steps.WEIGHTS = cache_steps.WEIGHTS.copy()
    steps.append(call())  # rebound to an equal array: read back
    return steps


@pattern
def cache_filled_then_run_reads_it_back():
    write("cr_steps.py", """
        from hardy import node
        FACTOR = {"f": 2}

        @node(output_name="y")
        def scaled(x):
            return x * FACTOR["f"]
    """)
    import cr_steps
    cache = DiskCache(".cache-run")
    p = Pipeline(nodes=[cr_steps.scaled], engine=engine, cache=cache)
    cr_steps.FACTOR["f"] = 3
    mapped = p.map(inputs={"x": XS}, map_over="x")
    run = p.run(inputs={"x": 2})
    cr_steps.FACTOR["f"] = 4
    return [mapped, run, p.run(inputs={"x": 2})]


@pattern
def stateful_resource_built_from_module_state():
    write("res_steps.py", """
        from hardy import node, stateful
        CONFIG = {"vocab": ["a"]}

        @stateful
        class Vocab:
            def __init__(self):
                self.words = list(CONFIG["vocab"])

        @node(output_name="y")
        def known(x, vocab):
            return len(vocab.words) * x
    """)
    import res_steps
    res_steps.CONFIG["vocab"] = ["a", "b", "c", "d"]
    out = Pipeline(nodes=[res_steps.known], engine=engine).map(
        inputs={"x": XS, "vocab": res_steps.Vocab()}, map_over="x")
    return [o["y"] for o in out]



@pattern
def stateful_handle_attribute_set_between_calls():
    # `clf.threshold = 0.9` on a @stateful handle: set on this process's object, and on each worker's
    write("clf_steps.py", """
        from hardy import node, stateful

        @stateful
        class Classifier:
            def __init__(self, name):
                self.name, self.threshold = name, 0.5

            def __call__(self, score):
                return score > self.threshold

        @node(output_name="label")
        def classify(score, clf):
            return [clf(score), clf.threshold]
    """)
    import clf_steps
    clf = clf_steps.Classifier("m")
    pipe = Pipeline(nodes=[clf_steps.classify], engine=engine)
    first = pipe.map(inputs={"score": [0.7, 0.95], "clf": clf}, map_over="score")
    clf.threshold = 0.9
    second = pipe.map(inputs={"score": [0.7, 0.95], "clf": clf}, map_over="score")
    clf.threshold = 0.6
    return [first, second, pipe.run(inputs={"score": 0.7, "clf": clf})]


SCRIPT_TABLE = {1: 11}


@pattern
def stateful_class_in_the_script_reads_a_script_global():
    @stateful
    class Lookup:
        def __init__(self):
            self.table = dict(SCRIPT_TABLE)

    @node(output_name="y")
    def looked(x, lookup):
        return lookup.table.get(x, 0)

    SCRIPT_TABLE[2] = 22
    out = Pipeline(nodes=[looked], engine=engine).map(inputs={"x": XS, "lookup": Lookup()}, map_over="x")
    return [o["y"] for o in out]



@pattern
def batched_node_reads_state():
    write("batch_steps.py", """
        from hardy import node
        SCALE = {"s": 1}

        @node(output_name="y", batch_size=2)
        def scaled(x):
            return [v * SCALE["s"] for v in x]
    """)
    import batch_steps
    batch_steps.SCALE["s"] = 9
    return ys([batch_steps.scaled], xs=[1, 2, 3, 4, 5])


@pattern
def async_node_reads_state():
    write("async_steps.py", """
        import asyncio
        from hardy import node
        DELAY = {"tag": "none"}

        @node(output_name="y")
        async def fetched(x):
            await asyncio.sleep(0)
            return f"{DELAY['tag']}{x}"
    """)
    import async_steps
    async_steps.DELAY["tag"] = "async-"
    return ys([async_steps.fetched])


@pattern
def failing_items_and_state():
    write("fail_steps.py", """
        from hardy import node
        BAD = set()

        @node(output_name="y")
        def checked(x):
            if x in BAD:
                raise ValueError(f"bad item {x}")
            return x
    """)
    import fail_steps
    fail_steps.BAD.add(2)
    out = Pipeline(nodes=[fail_steps.checked], engine=engine).map(inputs={"x": XS}, map_over="x", on_error="continue")
    return out


corpus.close()
