"""Batched nodes (`@node(batch_size=N)`, HyperNodes' `DualNode`): a real torch model embeds a
group of items per call, in real worker processes and on every executor; per-item results, cache
entries and errors; a batch call that raises is split until the failing item is alone; a real
segfault inside the batch call (a NULL read through ctypes) costs only the item that caused it."""

from __future__ import annotations

import ctypes
import os
import time

import pytest

from hardy import DiskCache, Engine, Failed, NodeCrashed, NodeError, NodeTimeout, Pipeline, PipelineCallback, node
from hardy.errors import NodeDefinitionError

torch = pytest.importorskip("torch")

IN_PROCESS = Engine(map_executor="sequential")  # for tests that count calls in this process
POISON = "poison"  # the document whose batch call segfaults (executors that contain crashes) or raises
VOCAB = 997
_model: list[object] = []


class Embedder(torch.nn.Module):
    """EmbeddingBag + MLP: the model the benchmark embeds with, small."""

    def __init__(self) -> None:
        super().__init__()
        self.bag = torch.nn.EmbeddingBag(VOCAB, 16, mode="mean")
        self.mlp = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 8))

    def forward(self, ids: list[list[int]]) -> torch.Tensor:
        flat = torch.tensor([i for doc in ids for i in doc], dtype=torch.long)
        offsets = torch.tensor([0, *torch.tensor([len(d) for d in ids]).cumsum(0)[:-1].tolist()], dtype=torch.long)
        return self.mlp(self.bag(flat, offsets))


def model() -> Embedder:
    """Built once per process, the same weights everywhere (seeded)."""
    if not _model:
        torch.manual_seed(0)
        torch.set_num_threads(1)
        _model.append(Embedder().eval())
    return _model[0]  # type: ignore[return-value]


@node(output_name="ids")
def tokenize(text: str) -> list[int]:
    return [sum(map(ord, w)) % (VOCAB - 1) + 1 for w in text.split()] or [0]


@node(output_name=("embedding", "batch_n", "pid"), batch_size=8)
def embed(ids: list[list[int]], text: list[str]) -> tuple[torch.Tensor, list[int], list[int]]:
    if POISON in text:
        if os.environ.get("HARDY_TEST_SEGFAULT") == "1":
            ctypes.string_at(0)  # reads address 0: SIGSEGV inside the batch call
        raise ValueError("poisoned document")
    with torch.no_grad():
        vectors = model()(ids)
    return vectors, [len(ids)] * len(ids), [os.getpid()] * len(ids)


@node(output_name="score")
def score(embedding: torch.Tensor) -> float:
    return round(float(embedding.sum()), 4)


NODES = [tokenize, embed, score]
TEXTS = [f"document {k} about {'cats' if k % 3 else 'dogs'} and item {k * 7}" for k in range(60)]


def expected(texts: list[str]) -> list[float]:
    """Each document embedded alone, in this process: what the batches must reproduce."""
    with torch.no_grad():
        return [round(float(model()([tokenize.func(t)]).sum()), 4) for t in texts]


def test_batched_node_is_called_with_lists_per_group_and_singly_in_run():
    calls: list[list[int]] = []

    @node(output_name="n")
    def length(word: str) -> int:
        return len(word)

    @node(output_name=("double", "triple"), batch_size=4)
    def scale(n: list[int], factor: list[int]) -> tuple[list[int], list[int]]:
        calls.append(list(n))
        return [x * f for x, f in zip(n, factor, strict=True)], [3 * x for x in n]

    @node(output_name="total", batch_size=3)
    def add(double: list[int], triple: list[int]) -> list[int]:
        calls.append([-1, len(double)])
        return [a + b for a, b in zip(double, triple, strict=True)]

    p = Pipeline(nodes=[length, scale, add], engine=IN_PROCESS)  # `calls` is this process's list
    assert p.run(inputs={"word": "abc", "factor": 2}) == {"n": 3, "double": 6, "triple": 9, "total": 15}
    assert calls == [[3], [-1, 1]]
    calls.clear()
    out = p.map(inputs={"word": ["a" * k for k in range(10)], "factor": 2}, map_over="word")
    assert [o["total"] for o in out] == [5 * k for k in range(10)]
    # groups of the largest batch size (4): `scale` once per group, `add` in 3s within it
    assert calls == [[0, 1, 2, 3], [-1, 3], [-1, 1], [4, 5, 6, 7], [-1, 3], [-1, 1], [8, 9], [-1, 2]]
    assert scale(n=[1], factor=[5]) == ([5], [3])  # calling the node calls the function unchanged
    assert p.map(inputs={"word": ["ab", "c"], "factor": 2}, map_over="word", output_name="double") == [
        {"double": 4}, {"double": 2}]  # the outputs asked for, no more
    calls.clear()
    streamed = p.imap(inputs={"word": ("a" * k for k in range(10)), "factor": 2}, map_over="word", window=8)
    assert [o["total"] for o in streamed] == [5 * k for k in range(10)]
    assert [len(c) for c in calls if c[0] != -1] == [4, 4, 2]  # windows of 8: two batches, then the last 2


def test_a_raising_item_is_found_by_splitting_and_fails_alone():
    calls: list[int] = []

    @node(output_name="y", batch_size=8, retries=1, retry_on=ConnectionError)
    def square(x: list[int]) -> list[int]:
        calls.append(len(x))
        if len(calls) == 1:
            raise ConnectionError("flaky")  # the node's policy retries the call first
        if 5 in x:
            raise ValueError("five is bad")
        return [v * v for v in x]

    out = Pipeline(nodes=[square], engine=IN_PROCESS).map(inputs={"x": list(range(10))}, map_over="x",
                                                          on_error="continue")
    assert [o for o in out if not isinstance(o, Failed)] == [{"y": v * v} for v in range(10) if v != 5]
    err = out[5].error
    assert isinstance(err, NodeError) and err.node == "square" and err.item == 5 and err.inputs_summary == "x=5"
    assert "five is bad" in str(err) and isinstance(err.__cause__, ValueError)
    # 8 (flaky) and 8 again (retried), then halves down to the culprit: 0-3, 4-7, 4-5, 4, 5, 6-7; then 8-9
    assert calls == [8, 8, 4, 4, 2, 1, 1, 2, 2], calls


@node(output_name="y")
def one_more_but_2(x: int) -> int:
    if x == 2:
        raise ValueError("two")
    return x + 1


@node(output_name="z", batch_size=4)
def twice(y: list[int]) -> list[int]:
    return [v * 2 for v in y]


@pytest.mark.parametrize("executor", ["sequential", "threaded", "process"])
def test_values_asked_for_beside_a_last_batched_node_are_handed_out(executor):
    """A worker hands a last batched node's outputs out from its call, without running a plan per
    item: the earlier node's output and the input asked for come with them, on every executor."""
    with Engine(map_executor=executor, workers=2) as engine:
        out = Pipeline(nodes=[one_more_but_2, twice], engine=engine).map(
            inputs={"x": [0, 1, 2, 3, 4, 5]}, map_over="x", output_name=["x", "y", "z"], on_error="continue")
    assert [o for o in out if not isinstance(o, Failed)] == [
        {"x": x, "y": x + 1, "z": 2 * x + 2} for x in [0, 1, 3, 4, 5]]
    assert isinstance(out[2], Failed) and out[2].error.node == "one_more_but_2"


@node(output_name="y", batch_size=8)
def tens_but_5(x: list[int]) -> list[int]:
    for v in x:
        if v == 5:
            raise KeyError(f"bad {v}")
    return [v * 10 for v in x]


@pytest.mark.parametrize("executor", ["sequential", "process"])
def test_a_split_batchs_item_error_prints_its_own_frames_once(executor):
    """The culprit's error is its own call's alone: the earlier attempts of the batch halving
    found it by are not its `__context__`, so its traceback prints the node's frames once, with
    no "During handling" repeat of each level and none of hardy's frames (batching, node)."""
    import traceback

    with Engine(map_executor=executor, workers=1) as engine:
        out = Pipeline(nodes=[tens_but_5], engine=engine).map(inputs={"x": list(range(8))}, map_over="x",
                                                               on_error="continue")
    cause = out[5].error.__cause__
    assert isinstance(cause, KeyError) and cause.__context__ is None
    text = "".join(traceback.format_exception(cause))
    assert text.count("Traceback") == 1 and "During handling" not in text, text
    assert "parts/batching.py" not in text and "model/node.py" not in text and "in tens_but_5" in text, text


def test_a_stream_hands_out_a_group_in_the_items_order_when_some_failed_before_its_batch():
    p = Pipeline(nodes=[one_more_but_2, twice], engine=IN_PROCESS)
    streamed = list(p.imap(inputs={"x": range(6)}, map_over="x", on_error="continue", indexed=True))
    assert [i for i, _ in streamed] == list(range(6))  # the failure of item 2 (before the batch call) in its place
    assert isinstance(streamed[2][1], Failed) and streamed[3][1] == {"y": 4, "z": 8}


def test_wrong_output_length_fails_every_item_of_the_batch_with_the_reason():
    @node(output_name="y", batch_size=4)
    def short(x: list[int]) -> list[int]:
        return x[:-1]

    out = Pipeline(nodes=[short]).map(inputs={"x": [1, 2, 3]}, map_over="x", on_error="continue")
    assert all(isinstance(o, Failed) and o.error.node == "short" for o in out)
    assert "called with 3 item(s) and returned a list of length 2" in str(out[0].error)
    with pytest.raises(NodeError, match="returned a int"):
        Pipeline(nodes=[node(lambda x: 1, output_name="y", batch_size=2)]).run(inputs={"x": 1})


def test_batch_size_is_checked_where_the_node_is_made():
    with pytest.raises(NodeDefinitionError, match="batch_size=0 is not valid"):
        node(lambda x: x, output_name="y", batch_size=0)

    async def later(x):
        return x
    with pytest.raises(NodeDefinitionError, match="batch_size= needs a plain function"):
        node(later, output_name="y", batch_size=4)


def test_batch_wait_is_checked_where_the_node_is_made():
    with pytest.raises(NodeDefinitionError, match="batch_wait=-1 is not valid; batch_wait must be a finite number"):
        node(lambda x: x, output_name="y", batch_size=4, batch_wait=-1)
    with pytest.raises(NodeDefinitionError, match=r"batch_wait='1' is not valid"):
        node(lambda x: x, output_name="y", batch_size=4, batch_wait="1")
    with pytest.raises(NodeDefinitionError, match="batch_wait=0.5 has no effect without batch_size="):
        node(lambda x: x, output_name="y", batch_wait=0.5)
    assert node(lambda x: x, output_name="y", batch_size=4, batch_wait=0).batch_wait == 0.0


@node(output_name=("y", "batch_n"), batch_size=64, batch_wait=0.2)
def double_waiting(x: list[int]) -> tuple[list[int], list[int]]:
    return [v * 2 for v in x], [len(x)] * len(x)


@pytest.mark.slow  # waits on a slow stream, item by item
@pytest.mark.parametrize("executor", ["sequential", "process"])
def test_batch_wait_calls_a_partial_batch_of_a_slow_stream(executor):
    """A source that yields an item every 50 ms: with batch_wait=0.2 the first items reach their
    batch call after at most 5 items, and come out before the source ends, not after the 20 a
    full window would wait for."""
    produced: list[int] = []

    def slow_source():
        for k in range(20):
            time.sleep(0.05)
            produced.append(k)
            yield k

    waiting = double_waiting
    eager = node(double_waiting.func, output_name=("y", "batch_n"), name="double_waiting", batch_size=64)
    with Engine(map_executor=executor, workers=2) as engine:
        for n, batched_node in ((0, waiting), (1, eager)):
            produced.clear()
            seen = [(out, len(produced)) for out in Pipeline(nodes=[batched_node], engine=engine).imap(
                inputs={"x": slow_source()}, map_over="x")]
            assert [out["y"] for out, _ in seen] == [2 * k for k in range(20)]
            sizes = [out["batch_n"] for out, _ in seen]
            if n == 0:  # the wait is checked as each item arrives: the 5th came >= 0.2 s after the 1st
                assert sizes[0] <= 5 and max(sizes) < 20, sizes
                # out before the source ended (with worker processes, the caller pulls the next
                # windows before it hands out a finished one, so the executor never idles)
                assert seen[0][1] <= (5 if executor == "sequential" else 15), seen
            else:  # without batch_wait the batch waits for the source's end
                assert seen[0][1] == 20 and set(sizes) == {20}


class Batches(PipelineCallback):
    """Every event a batched map reports, item and batch events with the item they name."""

    def __init__(self) -> None:
        self.events: list[tuple[object, ...]] = []

    def on_node_end(self, node_id, outputs, duration, ctx):
        self.events.append(("end", node_id, ctx.get("hardy.item"), duration >= 0))

    def on_node_cached(self, node_id, signature, ctx):
        self.events.append(("cached", node_id, ctx.get("hardy.item")))

    def on_error(self, node_id, error, ctx):
        self.events.append(("error", node_id, ctx.get("hardy.item"), type(error).__name__))

    def on_batch_end(self, node_id, size, duration, ctx):
        self.events.append(("batch", node_id, size, duration > 0))


@node(output_name="y")
def plus_one(x: int) -> int:
    return x + 1


@node(output_name="z", batch_size=4)
def doubled_but_13(y: list[int]) -> list[int]:
    if 13 in y:
        raise ValueError("thirteen")
    time.sleep(0.001)
    return [v * 2 for v in y]


@node(output_name="w")
def minus_one(z: int) -> int:
    if z == 200:  # (x=99) fails after the others' results were due to be sent: its group's log is cut there
        time.sleep(0.02)
        raise ValueError("two hundred")
    return z - 1


@pytest.mark.parametrize("executor", ["sequential", "threaded", "process", "gpu"])
def test_events_and_report_show_items_and_each_batch_call_on_every_local_executor(executor, tmp_path, monkeypatch):
    """The same events wherever the items ran (worker processes log them and the parent replays
    them; "gpu": the batched node on a GPU worker, the others on CPU workers): each item's node
    events, the culprit's error, and each batch call with its size (the call that raised and the
    halves that found item 12); the report's per-call table."""
    callback = Batches()
    batched_node, gpus = doubled_but_13, {}
    if executor == "gpu":
        monkeypatch.setenv("HARDY_ASSUME_GPUS", "1")
        batched_node = node(doubled_but_13.func, output_name="z", name="doubled_but_13", batch_size=4, gpus=1)
        executor, gpus = "process", {"gpus": 1}
    with Engine(map_executor=executor, workers=2, report=True, cache=DiskCache(tmp_path / "c"), **gpus) as engine:
        p = Pipeline(nodes=[plus_one, batched_node, minus_one], engine=engine, callbacks=[callback])
        out = p.map(inputs={"x": list(range(16))}, map_over="x", on_error="continue")
        report = p.report().to_dict()
        warm = Batches()
        again = Pipeline(nodes=[plus_one, batched_node, minus_one], engine=engine, callbacks=[warm]).map(
            inputs={"x": [99, *range(8)]}, map_over="x", on_error="continue")
    assert [k for k, o in enumerate(out) if isinstance(o, Failed)] == [12]
    events = callback.events
    batches = sorted(e[2] for e in events if e[0] == "batch")
    assert batches == [1, 1, 2, 2, 4, 4, 4, 4] and all(e[3] for e in events if e[0] == "batch")
    assert [e[1:] for e in events if e[0] == "error"] == [("doubled_but_13", 12, "ValueError")]
    ends = {(e[1], e[2]) for e in events if e[0] == "end"}
    assert len([e for e in events if e[0] == "end"]) == 16 + 15 + 15 and all(e[3] for e in events if e[0] == "end")
    assert ends == {(n, i) for n in ("plus_one", "doubled_but_13", "minus_one") for i in range(16)} - {
        ("doubled_but_13", 12), ("minus_one", 12)}
    (row,) = [n for n in report["nodes"] if n["name"] == "doubled_but_13"]
    assert row["calls"] == 16 and row["failures"] == 1
    assert row["batches"]["calls"] == 8 and row["batches"]["items"] == 22 and row["batches"]["size_max"] == 4
    assert row["batches"]["total_s"] > 0 and "batched nodes: per call" in str(p.report())
    assert "plus_one" not in {n["name"] for n in report["nodes"] if "batches" in n}
    assert len(report["timeline"]) == 16 and all(t[3] >= t[2] for t in report["timeline"])
    # a warm run: each item's batched node answered from its own cache entry, one call for the miss
    assert [e[2] for e in warm.events if e[0] == "batch"] == [1]
    assert sorted(e[2] for e in warm.events if e[0] == "cached" and e[1] == "doubled_but_13") == list(range(1, 9))
    assert [e[1:] for e in warm.events if e[0] == "error"] == [("minus_one", 0, "ValueError")]
    assert [o["w"] for o in again[1:]] == [2 * (x + 1) - 1 for x in range(8)]


def test_cache_entries_are_per_item_and_a_warm_run_makes_no_batch_call(tmp_path):
    calls: list[int] = []

    @node(output_name="y", batch_size=4)
    def cube(x: list[int]) -> list[int]:
        calls.append(len(x))
        return [v ** 3 for v in x]

    p = Pipeline(nodes=[cube], engine=Engine(map_executor="sequential", cache=DiskCache(tmp_path / "c")))
    assert [o["y"] for o in p.map(inputs={"x": list(range(6))}, map_over="x")] == [v ** 3 for v in range(6)]
    assert calls == [4, 2]
    calls.clear()
    again = p.map(inputs={"x": list(range(6))}, map_over="x")
    assert [o["y"] for o in again] == [v ** 3 for v in range(6)] and calls == []  # warm: 0 batch calls
    more = p.map(inputs={"x": list(range(10))}, map_over="x")
    assert [o["y"] for o in more] == [v ** 3 for v in range(10)]
    assert calls == [2, 2]  # only the misses: items 6, 7 (group 4-7) and 8, 9
    calls.clear()
    assert p.run(inputs={"x": 9}) == {"y": 729} and calls == []  # run() reads the map's per-item entry
    # in worker processes too, sharing the entries
    q = Pipeline(nodes=[cube], engine=Engine(map_executor="process", workers=2, cache=DiskCache(tmp_path / "c")))
    assert [o["y"] for o in q.map(inputs={"x": list(range(14))}, map_over="x")] == [v ** 3 for v in range(14)]
    assert DiskCache(tmp_path / "c").stats().entries == 14  # one per item, whoever computed it


@pytest.mark.slow  # torch in a subprocess
@pytest.mark.parametrize("executor", ["sequential", "threaded", "process"])
def test_torch_embed_pipeline_local_executors(executor, monkeypatch):
    crash = executor == "process"
    monkeypatch.setenv("HARDY_TEST_SEGFAULT", "1" if crash else "0")  # workers inherit it
    texts = [*TEXTS[:37], POISON, *TEXTS[37:]]
    with Engine(map_executor=executor, workers=2, preload=["torch"]) as engine:
        out = Pipeline(nodes=NODES, engine=engine).map(inputs={"text": texts}, map_over="text",
                                                       on_error="continue")
    _check_embed_run(out, texts, crashed=crash, parent=os.getpid(), in_workers=executor == "process")


def _check_embed_run(out: list, texts: list[str], crashed: bool, parent: int, in_workers: bool) -> None:
    bad = texts.index(POISON)
    failed = [k for k, o in enumerate(out) if isinstance(o, Failed)]
    assert failed == [bad], failed
    err = out[bad].error
    assert err.node == "embed" and err.item == bad
    if crashed:
        assert isinstance(err, NodeCrashed) and err.signal == "SIGSEGV", err
        assert "in embed" in err.stack and "test_batching.py" in err.stack
    else:
        assert "poisoned document" in str(err) and POISON in err.inputs_summary
    good = [o for o in out if not isinstance(o, Failed)]
    assert [o["score"] for o in good] == pytest.approx(expected([t for t in texts if t != POISON]), abs=1e-3)
    assert max(o["batch_n"] for o in good) == 8  # real batches reached the model
    assert sum(o["batch_n"] == 8 for o in good) >= len(good) // 2
    pids = {o["pid"] for o in good}
    assert (parent not in pids) if in_workers else pids == {parent}
    assert all(o["embedding"].shape == (8,) and o["embedding"].untyped_storage().nbytes() == 32 for o in good)


def test_a_segfault_in_a_batch_costs_one_item_and_the_batch_runs_again_one_item_per_call(monkeypatch):
    """The batch of 8 holding the poisoned document dies; its items run again one per call, on a
    fresh worker, until the culprit dies alone; it is reported once, the node's retries spent on
    it alone, and every other item of the batch keeps its result."""
    monkeypatch.setenv("HARDY_TEST_SEGFAULT", "1")
    texts = [*TEXTS[:8], POISON, *TEXTS[8:15]]  # the poison in the second batch (items 8-15)
    retried = node(embed.func, output_name=embed.outputs, name="embed", batch_size=8, retries=2)
    with Engine(map_executor="process", workers=2, report=True, preload=["torch"]) as engine:  # fresh workers fork ready
        p = Pipeline(nodes=[tokenize, retried, score], engine=engine)
        out = p.map(inputs={"text": texts}, map_over="text", on_error="continue")
        report = p.report().to_dict()
    assert [k for k, o in enumerate(out) if isinstance(o, Failed)] == [8]
    assert isinstance(out[8].error, NodeCrashed) and out[8].error.node == "embed"
    assert report["workers"]["died"] == 2 + 2  # the batch, the culprit alone, then its 2 retries
    assert report["failed"] == 1 and report["succeeded"] == 15


@node(output_name="bumped", batch_size=4)
def bump_but_7(x: list[int]) -> list[int]:
    if 7 in x:
        ctypes.string_at(0)  # reads address 0: SIGSEGV inside the batch call, in a nested map
    return [v + 1 for v in x]


@node(output_name="xs")
def twelve_from(n: int) -> list[int]:
    return list(range(n, n + 12))


def test_a_segfault_in_a_nested_maps_batch_costs_one_inner_item():
    """The batch call that crashes holds four inner items and names none: the outer item runs
    again with that map's calls one item each, then again without the item that crashed."""
    inner = Pipeline(nodes=[bump_but_7], name="inner")
    grow = inner.as_node(name="grow", input_mapping={"xs": "x"}, output_mapping={"bumped": "ys"}, map_over="xs",
                         on_error="continue")
    with Engine(map_executor="process", workers=2) as engine:
        out = Pipeline(nodes=[twelve_from, grow], engine=engine).map(
            inputs={"n": [0, 20]}, map_over="n", output_name="ys", on_error="continue")
    assert out[1] == {"ys": list(range(21, 33))}
    ys = out[0]["ys"]
    assert ys[:7] == list(range(1, 8)) and ys[8:] == list(range(9, 13))
    err = ys[7].error
    # named by its path, as an exception in the nested map would be
    assert isinstance(err, NodeCrashed) and err.signal == "SIGSEGV" and (err.node, err.item) == ("grow/bump_but_7", 7)


def test_a_hanging_item_times_out_alone(monkeypatch):
    @node(output_name="y", batch_size=4, timeout=1.0)
    def wait(x: list[int]) -> list[int]:
        if 2 in x:
            time.sleep(60)
        return [v + 1 for v in x]

    with Engine(map_executor="process", workers=2) as engine:
        out = Pipeline(nodes=[wait], engine=engine).map(inputs={"x": list(range(8))}, map_over="x",
                                                        on_error="continue")
    assert [o for o in out if not isinstance(o, Failed)] == [{"y": v + 1} for v in range(8) if v != 2]
    assert isinstance(out[2].error, NodeTimeout) and out[2].error.node == "wait"


@pytest.mark.slow  # torch in a subprocess
def test_gpu_batched_node_gets_batches_on_gpu_workers_and_the_rest_runs_on_cpu_workers(monkeypatch):
    """`@node(gpus=1, batch_size=8)` without a GPU: slots declared by HARDY_ASSUME_GPUS, each GPU
    worker started with its CUDA_VISIBLE_DEVICES (read back inside the batch call)."""
    monkeypatch.setenv("HARDY_ASSUME_GPUS", "1")

    @node(output_name="ids")
    def tokenize_where(text: str) -> tuple[list[int], str, int]:
        return tokenize.func(text), os.environ.get("CUDA_VISIBLE_DEVICES", "unset"), os.getpid()

    @node(output_name=("vector", "seen"), gpus=1, batch_size=8)
    def embed_on_gpu(ids: list[tuple[list[int], str, int]]) -> tuple[torch.Tensor, list[tuple[str, int, int]]]:
        with torch.no_grad():
            vectors = model()([i for i, _, _ in ids])
        where = (os.environ.get("CUDA_VISIBLE_DEVICES", "unset"), os.getpid(), len(ids))
        return vectors, [where] * len(ids)

    @node(output_name="score")
    def score_where(vector: torch.Tensor) -> tuple[float, int]:
        return round(float(vector.sum()), 4), os.getpid()

    with Engine(map_executor="process", workers=2, gpus=1) as engine:
        out = Pipeline(nodes=[tokenize_where, embed_on_gpu, score_where], engine=engine).map(
            inputs={"text": TEXTS}, map_over="text")
        gpu_pids = set(engine.gpu_pool().pids())
        cpu_pids = set(engine.process_pool().pids())
    assert [o["score"][0] for o in out] == pytest.approx(expected(TEXTS), abs=1e-3)
    assert {o["seen"][0] for o in out} == {"0"} and {o["seen"][1] for o in out} == gpu_pids
    assert max(o["seen"][2] for o in out) == 8  # the GPU worker received batches
    assert {o["ids"][1] for o in out} == {""} and {o["ids"][2] for o in out} <= cpu_pids  # CPU workers, no GPU
    assert {o["score"][1] for o in out} <= cpu_pids


def test_dual_node_batches_in_maps_and_runs_singular_in_run():
    """HyperNodes' contract: `batch` takes PyArrow arrays (a `@stateful` resource as itself) and
    may return an array or a list; `singular` runs in run()."""
    pa = pytest.importorskip("pyarrow")
    import pyarrow.compute as pc

    from hardy.compat.hypernodes import DualNode, stateful
    from hardy.compat.hypernodes import Pipeline as HnPipeline

    calls: list[tuple[str, object]] = []

    @stateful
    class Scale:
        def __init__(self, k: int):
            self.k = k

    def encode_one(text: str, scale: Scale) -> int:
        calls.append(("singular", text))
        return len(text) * scale.k

    def encode_batch(texts, scale):
        calls.append(("batch", type(texts).__name__, texts.to_pylist(), type(scale).__name__))
        return pc.multiply(pc.utf8_length(texts), scale.k)

    dual = DualNode(output_name="size", singular=encode_one, batch=encode_batch)
    assert dual.name == "encode" and dual.batch_size == 64
    p = HnPipeline(nodes=[dual])
    assert p.run(inputs={"text": "abc", "scale": Scale(2)}) == {"size": 6}
    assert calls == [("singular", "abc")]
    calls.clear()
    assert p.map(inputs={"text": ["a", "bb", "ccc"], "scale": Scale(3)}, map_over="text") == [
        {"size": 3}, {"size": 6}, {"size": 9}]
    assert calls == [("batch", "StringArray", ["a", "bb", "ccc"], "Scale")]
    calls.clear()
    assert p.map(inputs={"text": ["z"], "scale": Scale(1)}, map_over="text") == [{"size": 1}]
    assert calls == [("batch", "StringArray", ["z"], "Scale")]
    assert isinstance(pa.array([1]), pa.Array)


@pytest.fixture(scope="module")
def remote_executors():
    pytest.importorskip("distributed")
    pytest.importorskip("ray")
    from hardy.integrations.dask import DaskExecutor
    from hardy.integrations.ray import RayExecutor
    made = {"dask": DaskExecutor(workers=2), "ray": RayExecutor(workers=2)}
    yield made
    for ex in made.values():
        ex.close()


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", ["dask", "ray", "daft"])
def test_torch_embed_pipeline_on_dask_ray_and_daft(name, monkeypatch, request):
    monkeypatch.setenv("HARDY_TEST_SEGFAULT", "1")
    if name == "daft":
        pytest.importorskip("daft")
        from hardy.integrations.daft import daft_engine
        engine = daft_engine()
    else:
        engine = Engine(map_executor=request.getfixturevalue("remote_executors")[name])
    texts = [*TEXTS[:21], POISON, *TEXTS[21:]]
    out = Pipeline(nodes=NODES, engine=engine).map(inputs={"text": texts}, map_over="text", on_error="continue")
    _check_embed_run(out, texts, crashed=True, parent=os.getpid(), in_workers=True)
