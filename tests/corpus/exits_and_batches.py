# Nodes that end their process, and batched nodes that return their batch's outputs as a table,
# an array, a tensor or a dict of columns. An exit costs its own item and never runs a finished
# item again; a batch's outputs are its rows, one per item. (An exit that ends the calling process
# cannot be compared there: on the in-process executors those patterns run the innocent items
# only, and check the ended item on the others.) Run as `python - EXECUTOR < exits_and_batches.py`.
import collections
import ctypes
import os
import sys

import numpy as np
import pandas as pd
import pyarrow as pa

import corpus
from corpus import pattern
from hardy import Failed, NodeCrashed, Pipeline, node

engine = corpus.engine()
XS = list(range(1, 9))
ENDS_ON = 5  # the item whose node ends its process


def runs_per_item(log):
    """How many times each item's node ran (innocent items: once)."""
    with open(log) as f:
        return sorted(collections.Counter(int(line) for line in f).items())


def innocents(make, log):
    """The map of `make`'s node over XS, the item ENDS_ON left out where it would end this process."""
    xs = [x for x in XS if x != ENDS_ON or not corpus.IN_PROCESS]
    out = Pipeline(nodes=[make(log)], engine=engine).map(inputs={"x": xs}, map_over="x", on_error="continue")
    if not corpus.IN_PROCESS:
        ended = out.pop(ENDS_ON - 1)
        assert isinstance(ended, Failed) and isinstance(ended.error, NodeCrashed), ended
        assert ended.error.item == ENDS_ON - 1, ended
        counts = [c for c in runs_per_item(log) if c[0] != ENDS_ON]
    else:
        counts = runs_per_item(log)
    return [out, counts]


@pattern
def sys_exit_in_a_node():
    @node(output_name="y")
    def leaves(x):
        if x == 3:
            sys.exit(4)
        return x * 2

    return Pipeline(nodes=[leaves], engine=engine).map(inputs={"x": XS}, map_over="x", on_error="continue")


def ending(end, factor):
    """A node that logs each call and ends its process on item ENDS_ON by `end()`."""
    def make(log):
        @node(output_name="y")
        def leaves(x):
            with open(log, "a") as f:
                f.write(f"{x}\n")
            if x == ENDS_ON:
                end()
            return x * factor
        return leaves
    return make


@pattern
def os_exit_in_a_node_keeps_finished_items():
    return innocents(ending(lambda: os._exit(3), 2), os.path.abspath("os_exit.log"))


@pattern
def exit_from_c_in_a_node_keeps_finished_items():
    # a C library calling exit(): atexit handlers run, then the process ends
    return innocents(ending(lambda: ctypes.CDLL(None).exit(5), 3), os.path.abspath("c_exit.log"))


@pattern
def segfault_in_a_node_keeps_finished_items():
    return innocents(ending(lambda: ctypes.string_at(0), 4), os.path.abspath("segv.log"))


def batch_map(fn, xs=XS):
    return Pipeline(nodes=[fn], engine=engine).map(inputs={"x": xs}, map_over="x", on_error="continue")


@pattern
def batch_returns_a_dataframe_of_rows():
    @node(output_name="feat", batch_size=3)
    def featurise(x):
        return pd.DataFrame({"double": [2 * v for v in x], "square": [v * v for v in x]})

    return batch_map(featurise)


@pattern
def batch_returns_a_series():
    @node(output_name="y", batch_size=3)
    def halves(x):
        return pd.Series([v / 2 for v in x])

    return batch_map(halves)


@pattern
def batch_returns_a_dict_of_columns():
    @node(output_name="feat", batch_size=4)
    def columns(x):
        return {"plus": [v + 1 for v in x], "minus": [v - 1 for v in x]}

    return batch_map(columns)


@pattern
def batch_returns_a_2d_array():
    @node(output_name="y", batch_size=3)
    def embedded(x):
        return np.stack([np.full(2, float(v)) for v in x])

    return batch_map(embedded)


@pattern
def batch_returns_an_arrow_table():
    @node(output_name="row", batch_size=3)
    def tabled(x):
        return pa.table({"x": x, "sq": [v * v for v in x]})

    return batch_map(tabled)


@pattern
def batch_returns_one_row_too_many():
    @node(output_name="y", batch_size=4)
    def extra(x):
        return [*x, 0]

    return batch_map(extra, xs=[1, 2, 3])


@pattern
def sys_exit_in_a_batch_costs_its_item():
    @node(output_name="y", batch_size=4)
    def batched(x):
        if 6 in x:
            sys.exit(7)
        return [v * 10 for v in x]

    return batch_map(batched)


corpus.close()
