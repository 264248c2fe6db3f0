"""The code a plan runs can be read: `Pipeline.explain()` shows it, with locals named after the
values they hold and each call commented with its node, and tracebacks and debuggers show its lines.

The expected sources below are snapshots: a change to the generator shows up here as a diff of the
code every run executes."""

from __future__ import annotations

import linecache
import pickle
import traceback

import pytest

from hardy import DiskCache, Engine, NodeError, Pipeline, node
from hardy.plan.compiled import Plan


@node(output_name="cleaned")
def clean(text):
    return text.strip()


@node(output_name="n words")
def count(cleaned):
    return len(cleaned.split())


@node(output_name="n chars")
def size(cleaned):
    return len(cleaned)


@node(output_name=("head", "tail"))
def split(cleaned):
    return cleaned[:1], cleaned[1:]


@node(output_name="a")
async def fetch_a(text):
    return text


@node(output_name="b")
async def fetch_b(text):
    return text


SEQUENTIAL = """\
def _run(_v, _item=None):
    _s = 0
    try:
        text = _v['text']
        cleaned = f_clean(text)  # node 'clean'
        _s = 1
        n_words = f_count(cleaned)  # node 'count'
        _s = 2
        split_result = f_split(cleaned)  # node 'split'
        if split_result.__class__ is not tuple or len(split_result) != 2: split_result = _outs(split_result, 2)
        head, tail = split_result
        _s = 0
        if cleaned.__class__ in _LAZY: _lazy('cleaned', cleaned)
        _s = 1
        if n_words.__class__ in _LAZY: _lazy('n words', n_words)
        _s = 2
        if head.__class__ in _LAZY: _lazy('head', head)
        if tail.__class__ in _LAZY: _lazy('tail', tail)
    except BaseException as _e:
        if _passes(_e): raise
        raise _fail(_s, _e, locals())
    return {'cleaned': cleaned, 'n words': n_words, 'head': head, 'tail': tail}
"""


CACHE = """\
def _run(_v, _item=None):
    _s = 0
    try:
        text = _v['text']
        _pk = _v.get('__hardy_keys__') or _NOKEYS
        text_key = _pk.get('text') or _hv(text, 'text')
        clean_key = _ckey(clean_fingerprint, text_key)
        _s = 1
        count_key = _ckey(count_fingerprint, clean_key)
        _found = _fetch((clean_key, count_key,))
        _s = 0
        clean_result = _found.get(clean_key, _MISS)
        if clean_result is not _MISS: _oncached('clean', clean_key, _item)
        if clean_result is _MISS: clean_result = _fill(clean_key, f_clean, text)  # node 'clean'
        cleaned = clean_result
        _s = 1
        count_result = _found.get(count_key, _MISS)
        if count_result is not _MISS: _oncached('count', count_key, _item)
        if count_result is _MISS: count_result = _fill(count_key, f_count, cleaned)  # node 'count'
        n_words = count_result
        _s = 0
        if cleaned.__class__ in _LAZY: _lazy('cleaned', cleaned)
        _s = 1
        if n_words.__class__ in _LAZY: _lazy('n words', n_words)
    except BaseException as _e:
        if _passes(_e): raise
        raise _fail(_s, _e, locals())
    return {'cleaned': cleaned, 'n words': n_words}
"""


THREADED = """\
def _run(_v, _item=None):
    _s = 0
    try:
        text = _v['text']
        cleaned = f_clean(text)  # node 'clean'
        _s = 1
        count_result = _MISS
        _s = 2
        size_result = _MISS
        if count_result is _MISS: count_future = _submit(_t, 1, f_count, cleaned)  # node 'count'
        if size_result is _MISS: size_future = _submit(_t, 2, f_size, cleaned)  # node 'size'
        _s = 1
        if count_result is _MISS: count_result = count_future.result()
        _s = 2
        if size_result is _MISS: size_result = size_future.result()
        _s = 1
        n_words = count_result
        _s = 2
        n_chars = size_result
        _s = 0
        if cleaned.__class__ in _LAZY: _lazy('cleaned', cleaned)
        _s = 1
        if n_words.__class__ in _LAZY: _lazy('n words', n_words)
        _s = 2
        if n_chars.__class__ in _LAZY: _lazy('n chars', n_chars)
    except BaseException as _e:
        if _passes(_e): raise
        raise _fail(_s, _e, locals())
    return {'cleaned': cleaned, 'n words': n_words, 'n chars': n_chars}
"""


ASYNC = """\
async def _run(_v, _item=None):
    _s = 0
    try:
        text = _v['text']
        fetch_a_result = _MISS
        _s = 1
        fetch_b_result = _MISS
        _s = 2
        clean_result = _MISS
        _todo = []
        if fetch_a_result is _MISS: _todo.append((0, _mark(0, f_fetch_a(text))))  # node 'fetch_a'
        if fetch_b_result is _MISS: _todo.append((1, _mark(1, f_fetch_b(text))))  # node 'fetch_b'
        _s = _todo[0][0] if _todo else _s
        _res = dict(zip([j for j, _ in _todo], await _gather(*[c for _, c in _todo])))
        if fetch_a_result is _MISS: fetch_a_result = _res[0]
        if fetch_b_result is _MISS: fetch_b_result = _res[1]
        _s = 2
        if clean_result is _MISS: clean_result = f_clean(text)  # node 'clean'
        _s = 0
        a = fetch_a_result
        _s = 1
        b = fetch_b_result
        _s = 2
        cleaned = clean_result
        _s = 0
        if a.__class__ in _LAZY: _lazy('a', a)
        _s = 1
        if b.__class__ in _LAZY: _lazy('b', b)
        _s = 2
        if cleaned.__class__ in _LAZY: _lazy('cleaned', cleaned)
    except BaseException as _e:
        if _passes(_e): raise
        raise _fail(_s, _e, locals())
    return {'a': a, 'b': b, 'cleaned': cleaned}
"""


KEYED = """\
def _run(_v, _item=None):
    _s = 0
    try:
        cleaned = _v['cleaned']
        _pk = _v.get('__hardy_keys__') or _NOKEYS
        cleaned_key = _pk.get('cleaned') or _hv(cleaned, 'cleaned')
        count_key = _ckey(count_fingerprint, cleaned_key)
        count_result = _hit(count_key)
        if count_result is _MISS: count_result = _fill(count_key, f_count, cleaned)  # node 'count'
        n_words = count_result
        n_words_key = count_key
        if n_words.__class__ in _LAZY: _lazy('n words', n_words)
    except BaseException as _e:
        if _passes(_e): raise
        raise _fail(_s, _e, locals())
    return {'n words': n_words, '__hardy_keys__': {'n words': n_words_key}}
"""


def test_sequential_plan_source():
    p = Pipeline(nodes=[clean, count, split], name="words")
    assert p.explain(inputs=["text"]) == SEQUENTIAL
    assert p.run(inputs={"text": " ab c "}) == {"cleaned": "ab c", "n words": 2, "head": "a", "tail": "b c"}


def test_cached_plan_source(tmp_path):
    p = Pipeline(nodes=[clean, count], name="words", engine=Engine(cache=DiskCache(tmp_path)))
    assert p.explain(inputs={"text": " a b "}) == CACHE
    assert p.run(inputs={"text": " a b "}) == p.run(inputs={"text": " a b "}) == {"cleaned": "a b", "n words": 2}


def test_threaded_plan_source():
    p = Pipeline(nodes=[clean, count, size], name="words", engine=Engine(node_executor="threaded"))
    assert p.explain(inputs=["text"]) == THREADED
    assert p.run(inputs={"text": "a b"}) == {"cleaned": "a b", "n words": 2, "n chars": 3}


def test_async_plan_source():
    p = Pipeline(nodes=[fetch_a, fetch_b, clean], name="fetch", engine=Engine(node_executor="async"))
    assert p.explain(inputs=["text"]) == ASYNC
    assert p.run(inputs={"text": " x "}) == {"a": " x ", "b": " x ", "cleaned": "x"}


def test_keyed_plan_source(tmp_path):
    """One stage of a plan cut across places: keys of provided values come in, keys of outputs go out."""
    p = Pipeline(nodes=[clean, count], name="words")
    plan = Plan(p.graph, ["cleaned"], ["n words"], cache=DiskCache(tmp_path), keyed=True)
    assert plan.source == KEYED
    assert plan.run({"cleaned": "a b"})["n words"] == 2


def test_explain_shows_the_plan_run_uses():
    p = Pipeline(nodes=[clean, count], name="words")
    p.run(inputs={"text": "a"}, output_name="n words")
    (plan,) = p._plans.values()
    assert p.explain(inputs=["text"], output_name="n words") is plan.source


def test_locals_are_valid_unique_identifiers_named_after_values():
    @node(output_name="class")
    def keyword_named(x):
        return x

    @node(output_name="x-y")
    def dashed(x):
        return x + 1

    @node(output_name="x y")
    def spaced(x):
        return x + 2

    @node(output_name="sum")
    def shadowing(x_y):
        return x_y

    source = Pipeline(nodes=[keyword_named, dashed, spaced, shadowing]).explain(inputs=["x", "x_y"])
    assert "class_ = f_keyword_named(x)  # node 'keyword_named'" in source
    assert "x_y_2 = f_dashed(x)  # node 'dashed'" in source
    assert "x_y_3 = f_spaced(x)  # node 'spaced'" in source
    assert "sum_ = f_shadowing(x_y)  # node 'shadowing'" in source
    compile(source, "<test>", "exec")


def test_a_nodes_traceback_starts_at_the_node_and_a_plan_keeps_its_lines_for_pdb():
    @node(output_name="cleaned")
    def clean(text):
        raise ValueError("bad text")

    p = Pipeline(nodes=[clean, count], name="words", engine=Engine(map_executor="sequential"))  # raised here
    with pytest.raises(NodeError) as info:
        p.run(inputs={"text": "a"})
    shown = "".join(traceback.format_exception(info.value))
    assert 'in clean\n    raise ValueError("bad text")\n' in shown
    assert "<hardy plan" not in shown  # hardy's generated code is out of the way (hardy.tracebacks)
    (plan,) = p._plans.values()
    assert plan.filename.startswith("<hardy plan 'words' #")
    assert linecache.getline(plan.filename, 5) == "        cleaned = f_clean(text)  # node 'clean'\n"  # for pdb


def test_each_plan_has_its_own_file_name_released_with_the_plan():
    import gc

    p = Pipeline(nodes=[clean, count], name="words")
    first = Plan(p.graph, ["text"], ["cleaned"], name="words")
    second = Plan(p.graph, ["text"], ["n words"], name="words")
    assert first.filename != second.filename
    copy = pickle.loads(pickle.dumps(second))  # rebuilt on the other side, under its own name
    assert copy.filename.startswith("<hardy plan 'words' #") and copy.filename != second.filename
    assert linecache.getline(second.filename, 5) == "        cleaned = f_clean(text)  # node 'clean'\n"
    filename = first.filename
    del first
    gc.collect()
    assert linecache.getline(filename, 5) == ""


def test_the_documented_plan_is_what_the_generator_writes():
    """The example in plan/compiled.py's docstring and docs/architecture.md cannot drift from the generator."""
    import textwrap
    from pathlib import Path

    import hardy.plan.compiled

    written = Pipeline(nodes=[clean, count]).explain(inputs=["text"])
    in_docstring = hardy.plan.compiled.__doc__.split("shows:\n\n")[1].split("\n\n")[0]
    assert textwrap.dedent(in_docstring) + "\n" == written
    architecture = (Path(__file__).resolve().parent.parent / "docs" / "architecture.md").read_text()
    assert "```text\n" + written + "```" in architecture


def test_the_plans_loop_reads_the_clock_after_items_1_2_4_8_then_every_16th():
    """`_each`'s clock schedule (`source._CLOCK_READ`): a batch due is seen after the 1st item, so
    slow items beginning a call of the loop go one by one, and at worst 15 items late after fast ones."""
    from hardy.plan import source
    ns: dict = {}
    exec("def loop(_xs, _due, _clock):\n    _item = 0\n    _next, _every = _item + 1, 1\n    for _x in _xs:\n"
         "        _item += 1\n" + "\n".join(source._CLOCK_READ) + "\n", ns)
    count, read_after = [0], []

    def items():
        for x in range(100):
            count[0] = x + 1
            yield x

    def clock() -> float:
        read_after.append(count[0])
        return 0.0
    ns["loop"](items(), 1.0, clock)
    assert read_after == [1, 2, 4, 8, 16, 32, 48, 64, 80, 96]
