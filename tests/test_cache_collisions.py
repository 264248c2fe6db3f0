"""The collision table: pairs of values a node can tell apart get distinct keys; pairs it cannot
tell apart get equal ones. The pairs an adversarial review found sharing a key, the ones Hamilton
and pipefunc fixed in the field, and Arrow, torch and scipy.sparse values."""

from __future__ import annotations

import collections
import datetime
import json
import os
import subprocess
import sys
import types
import typing
from pathlib import Path

import pytest

from hardy.hashing import code_fingerprint, hash_value

DISTINCT, EQUAL = "distinct", "equal"


class Tagged(dict):
    """A dict subclass code reads an attribute of."""


class Labels(list):
    pass


class Empty:
    pass


class AlsoEmpty:
    pass


class Scale:
    """A stateful callable (pipefunc keyed these by __hash__, which changes between interpreters)."""

    def __init__(self, factor: float):
        self.factor = factor

    def __call__(self, x: float) -> float:
        return self.factor * x


class Day(datetime.date):
    pass


class Money(__import__("decimal").Decimal):
    pass


class Z(complex):
    pass


class Window(collections.deque):
    pass


class Word(str):
    pass


class Failure(Exception):
    pass


class Secret:
    __slots__ = ("__secret",)  # a private slot: Python names it _Secret__secret

    def __init__(self, secret: int):
        self.__secret = secret


class Inner:
    def __cache_key__(self) -> str:
        return "inner-v1"


class Delegating:
    """A wrapper that delegates attributes to what it wraps: `__getattr__` answers for its inner
    object's `__cache_key__`, which is not the wrapper's (Python looks special methods up on the type)."""

    def __init__(self, inner: object, scale: int):
        self.inner, self.scale = inner, scale

    def __getattr__(self, name: str) -> object:
        return getattr(self.inner, name)


class Versioned:
    """A user class that is path-like (`open(ref)` works) and holds more than its path."""

    def __init__(self, path: str, version: int):
        self.path, self.version = path, version

    def __fspath__(self) -> str:
        return self.path


def with_attribute(value: object, **attributes: object) -> object:
    for name, x in attributes.items():
        setattr(value, name, x)
    return value


def image(meta: str):
    class Image(np().ndarray):  # numpy's subclassing recipe: `meta` set as views are made
        def __array_finalize__(self, obj):
            self.meta = getattr(obj, "meta", None)
    return with_attribute(np().zeros(2).view(Image), meta=meta)


class Point(typing.NamedTuple):
    x: int
    y: int = 0


def tagged(extra: object = None) -> Tagged:
    d = Tagged(a=1)
    if extra is not None:
        d.unit = extra
    return d


def labels(name: str | None) -> Labels:
    lst = Labels([1, 2])
    if name:
        lst.name = name
    return lst


def np():
    import numpy
    return numpy


def pd():
    return pytest.importorskip("pandas")


def pa():
    return pytest.importorskip("pyarrow")


def torch():
    return pytest.importorskip("torch")


def sp():
    return pytest.importorskip("scipy.sparse")


def masked(mask, fill=None):
    return np().ma.masked_array([1.0, 2.0, 6.0], mask=mask, fill_value=fill)


def frame(**columns):
    return pd().DataFrame(columns)


def with_attrs(df, **attrs):
    df.attrs.update(attrs)
    return df


def table(metadata=None):
    return pa().table({"a": [1, 2]}, metadata=metadata)


def sparse(fmt, data=(1.0, 2.0)):
    return sp().coo_matrix((list(data), ([0, 1], [1, 0])), shape=(2, 2)).asformat(fmt)


def scaled_tensor(scale: float):
    """A user's tensor subclass, with a Python attribute its code reads (`t.scale`)."""
    class Scaled(torch().Tensor):
        def scaled(self):
            return self * self.scale
    return with_attribute(torch().ones(2).as_subclass(Scaled), scale=scale)


def with_grad(*inputs: float):
    """A parameter whose `.grad` a `backward()` filled (with `inputs` as its gradient)."""
    w = torch().nn.Parameter(torch().ones(len(inputs)))
    if inputs:
        (w * torch().tensor(inputs)).sum().backward()
    return w


def unit_frame(unit: str, total: typing.Callable[[typing.Any], float] = lambda self: float(self["a"].sum())):
    """A user's DataFrame subclass: `_metadata` names `unit`; `total` is its method (its code)."""
    cls = type("UnitFrame", (pd().DataFrame,), {"_metadata": ["unit"], "total": total, "__module__": __name__,
                                                "_constructor": property(lambda self: type(self))})
    return with_attribute(cls({"a": [1.0]}), unit=unit)


# (name, what to build the two values, expected)
PAIRS: list[tuple[str, typing.Callable[[], tuple[object, object]], str]] = [
    # what the review found sharing a key
    ("masked: only the mask differs", lambda: (masked([0, 0, 1]), masked([0, 1, 0])), DISTINCT),
    ("masked: only the fill value differs", lambda: (masked([0, 0, 1], 1.0), masked([0, 0, 1], 2.0)), DISTINCT),
    ("masked vs its data", lambda: (masked([0, 0, 0]), np().array([1.0, 2.0, 6.0])), DISTINCT),
    ("np.matrix vs ndarray", lambda: (np().matrix([[1, 2], [3, 4]]), np().array([[1, 2], [3, 4]])), DISTINCT),
    ("recarray vs structured array", lambda: (
        np().rec.fromrecords([(1, 2.0)], names="a,b"),
        np().rec.fromrecords([(1, 2.0)], names="a,b").view(np().ndarray)), DISTINCT),
    ("defaultdict(int) vs defaultdict(list)",
     lambda: (collections.defaultdict(int, a=1), collections.defaultdict(list, a=1)), DISTINCT),
    ("dict subclass: an extra attribute", lambda: (tagged("kg"), tagged()), DISTINCT),
    ("dict subclass: the attribute's value", lambda: (tagged("kg"), tagged("g")), DISTINCT),
    ("list subclass: an attribute", lambda: (labels("ids"), labels(None)), DISTINCT),
    ("object column: 1 vs '1'", lambda: (frame(a=pd().Series([1], dtype=object)),
                                         frame(a=pd().Series(["1"], dtype=object))), DISTINCT),
    ("object column: b'x' vs 'x'", lambda: (frame(a=[b"x"]), frame(a=["x"])), DISTINCT),
    ("object column: a tuple vs its str", lambda: (frame(a=pd().Series([(1, 2)], dtype=object)),
                                                   frame(a=["(1, 2)"])), DISTINCT),
    ("column name 1 vs '1'", lambda: (pd().DataFrame({1: [1]}), pd().DataFrame({"1": [1]})), DISTINCT),
    ("Series name 1 vs '1'", lambda: (pd().Series([1], name=1), pd().Series([1], name="1")), DISTINCT),
    ("DataFrame.attrs", lambda: (with_attrs(frame(a=[1]), unit="m"), frame(a=[1])), DISTINCT),
    ("object Index 1 vs '1'", lambda: (pd().Index([1], dtype=object), pd().Index(["1"])), DISTINCT),
    ("frame index 1 vs '1'", lambda: (pd().DataFrame({"a": [1]}, index=pd().Index([1], dtype=object)),
                                      pd().DataFrame({"a": [1]}, index=["1"])), DISTINCT),
    ("ordered vs unordered categorical", lambda: (pd().Categorical(["a", "b"], ordered=True),
                                                  pd().Categorical(["a", "b"], ordered=False)), DISTINCT),
    ("categorical column: ordered vs not", lambda: (
        frame(a=pd().Categorical(["a", "b"], ordered=True)), frame(a=pd().Categorical(["a", "b"]))), DISTINCT),
    ("categorical: an unused category", lambda: (pd().Series(pd().Categorical(["a"], categories=["a", "b"])),
                                                 pd().Series(pd().Categorical(["a"]))), DISTINCT),
    ("MultiIndex: an unused level value", lambda: (
        pd().MultiIndex.from_tuples([("a", 1), ("b", 2)])[:1], pd().MultiIndex.from_tuples([("a", 1)])), DISTINCT),
    ("MultiIndex built twice", lambda: (pd().MultiIndex.from_tuples([("a", 1), ("b", float("nan"))]),
                                        pd().MultiIndex.from_tuples([("a", 1), ("b", float("nan"))])), EQUAL),
    ("frame flags: duplicate labels refused", lambda: (
        frame(a=[1]).set_flags(allows_duplicate_labels=False), frame(a=[1])), DISTINCT),
    ("masked: a hard mask", lambda: (masked([0, 0, 1]).harden_mask(), masked([0, 0, 1])), DISTINCT),
    # a probe's pairs that code tells apart
    ("nan vs -nan", lambda: (float("nan"), -float("nan")), DISTINCT),
    ("nan made twice", lambda: (float("nan"), float("nan")), EQUAL),
    ("bytearray vs memoryview of the same bytes", lambda: (bytearray(b"ab"), memoryview(b"ab")), DISTINCT),
    ("memoryview vs its cast", lambda: (memoryview(b"abcd"), memoryview(b"abcd").cast("i")), DISTINCT),
    # a probe's pairs sharing a key: a wrapper's `__getattr__` lent it its inner object's
    # `__cache_key__`; `.readonly` was left out; a user class's `__fspath__` made it a path
    ("delegating wrapper: two scales", lambda: (Delegating(Inner(), 1), Delegating(Inner(), 2)), DISTINCT),
    ("delegating wrapper vs what it wraps", lambda: (Delegating(Inner(), 1), Inner()), DISTINCT),
    ("a read-only vs a writable memoryview", lambda: (memoryview(b"ab"), memoryview(bytearray(b"ab"))), DISTINCT),
    ("two writable memoryviews of the same bytes",
     lambda: (memoryview(bytearray(b"ab")), memoryview(bytearray(b"ab"))), EQUAL),
    ("a user class with __fspath__: another field", lambda: (Versioned("a", 1), Versioned("a", 2)), DISTINCT),
    ("a user class with __fspath__ vs a path", lambda: (Versioned("a", 1), Path("a")), DISTINCT),
    ("slices", lambda: (slice(0, 2), slice(0, 3)), DISTINCT),
    ("slice steps", lambda: (slice(0, 4, 1), slice(0, 4, 2)), DISTINCT),
    ("Ellipsis vs None", lambda: (..., None), DISTINCT),
    ("mappingproxies of two dicts", lambda: (types.MappingProxyType({"a": 1}), types.MappingProxyType({"a": 2})),
     DISTINCT),
    ("a mappingproxy vs its dict", lambda: (types.MappingProxyType({"a": 1}), {"a": 1}), DISTINCT),
    ("mappingproxies of equal dicts", lambda: (types.MappingProxyType({"a": 1}), types.MappingProxyType({"a": 1})),
     EQUAL),
    ("dates with a frequency vs the same dates without", lambda: (
        pd().Series([1, 2], index=pd().date_range("2024-01-01", periods=2, freq="D")),
        pd().Series([1, 2], index=pd().DatetimeIndex(["2024-01-01", "2024-01-02"]))), DISTINCT),
    ("torch: the same values, other strides", lambda: (
        torch().arange(6.0).reshape(3, 2).t(), torch().arange(6.0).reshape(3, 2).t().contiguous()), DISTINCT),
    ("torch: a conjugate view vs the tensor", lambda: (torch().tensor([1 + 2j]).conj(), torch().tensor([1 + 2j])),
     DISTINCT),
    ("torch: a conjugate view vs its values", lambda: (
        torch().tensor([1 + 2j]).conj(), torch().tensor([1 + 2j]).conj().resolve_conj()), DISTINCT),
    # a probe's user subclasses of value types: every instance shared one key
    ("date subclass: two dates", lambda: (Day(2024, 12, 31), Day(2020, 1, 1)), DISTINCT),
    ("Decimal subclass: two amounts", lambda: (Money("99.99"), Money("1.50")), DISTINCT),
    ("complex subclass: two numbers", lambda: (Z(7, 8), Z(1, 2)), DISTINCT),
    ("str subclass: an attribute's value", lambda: (with_attribute(Word("w"), lang="fr"),
                                                    with_attribute(Word("w"), lang="en")), DISTINCT),
    ("str subclass: the same word twice", lambda: (Word("w"), Word("w")), EQUAL),
    ("deque subclass: an attribute's value", lambda: (with_attribute(Window([1]), label="a"),
                                                      with_attribute(Window([1]), label="b")), DISTINCT),
    ("exception: two messages", lambda: (Failure("a"), Failure("b")), DISTINCT),
    ("a private slot's value", lambda: (Secret(1), Secret(2)), DISTINCT),
    ("ndarray subclass: an attribute's value", lambda: (image("left"), image("right")), DISTINCT),
    # the review's controls, keyed apart already
    ("-0.0 vs 0.0", lambda: (-0.0, 0.0), DISTINCT),
    ("np.float64(1.5) vs 1.5", lambda: (np().float64(1.5), 1.5), DISTINCT),
    ("np.int32(1) vs np.int64(1)", lambda: (np().int32(1), np().int64(1)), DISTINCT),
    ("the same instant in two time zones", lambda: (
        datetime.datetime(2024, 1, 1, 12, tzinfo=datetime.timezone.utc),
        datetime.datetime(2024, 1, 1, 13, tzinfo=datetime.timezone(datetime.timedelta(hours=1)))), DISTINCT),
    ("tz-aware column: two time zones", lambda: (
        pd().Series(pd().to_datetime(["2024-01-01 12:00"]).tz_localize("UTC")),
        pd().Series(pd().to_datetime(["2024-01-01 12:00"]).tz_localize("UTC").tz_convert("Europe/Paris"))),
     DISTINCT),
    # Hamilton: objects with an empty __dict__, arrays and frames that share bytes
    ("empty __dict__, two classes", lambda: (Empty(), AlsoEmpty()), DISTINCT),
    ("empty __dict__, one class", lambda: (Empty(), Empty()), EQUAL),
    ("same bytes, another shape", lambda: (np().zeros(4), np().zeros((2, 2))), DISTINCT),
    ("same bytes, another dtype", lambda: (np().array([1, 0], dtype=np().int32),
                                           np().array([1], dtype=np().int64)), DISTINCT),
    ("same bytes, another column name", lambda: (frame(a=[1, 2]), frame(b=[1, 2])), DISTINCT),
    ("same bytes, int vs datetime column", lambda: (
        frame(a=np().array([0], dtype="int64")), frame(a=np().array([0], dtype="datetime64[ns]"))), DISTINCT),
    ("C vs Fortran order", lambda: (np().arange(6.0).reshape(2, 3), np().asfortranarray(np().arange(6.0).reshape(2, 3))),
     DISTINCT),
    ("equal frames built twice", lambda: (frame(a=[1, 2], b=["x", None]), frame(a=[1, 2], b=["x", None])), EQUAL),
    ("equal masked arrays", lambda: (masked([0, 1, 0]), masked([0, 1, 0])), EQUAL),
    # pipefunc: stateful callables by their state, not by __hash__
    ("callables with the same state", lambda: (Scale(2.0), Scale(2.0)), EQUAL),
    ("callables with another state", lambda: (Scale(2.0), Scale(3.0)), DISTINCT),
    # containers
    ("NamedTuple vs tuple", lambda: (Point(1, 2), (1, 2)), DISTINCT),
    ("OrderedDict vs dict", lambda: (collections.OrderedDict(a=1), {"a": 1}), DISTINCT),
    ("set vs frozenset", lambda: ({1}, frozenset({1})), DISTINCT),
    # a set of ints iterates in the same order in every process (its hashes are not salted), which
    # `list(s)` reads; a set of strings in the order of the process's salt (no key can hold it)
    ("set of ints iterating in another order", lambda: ({1, 9}, {9, 1}), DISTINCT),
    ("set of ints built in another order, iterating alike", lambda: ({1, 2, 3}, {3, 2, 1}), EQUAL),
    ("set of strings built in another order", lambda: ({"a", "b", "c"}, {"c", "b", "a"}), EQUAL),
    ("frozenset of tuples iterating in another order", lambda: (frozenset([(0, 0.5), (3, 0.5)]),
                                                                frozenset([(3, 0.5), (0, 0.5)])),
     DISTINCT),
    ("RangeIndex vs an Index of the same ints", lambda: (pd().RangeIndex(3), pd().Index([0, 1, 2])), DISTINCT),
    ("datetime64 units", lambda: (np().datetime64(1, "s"), np().datetime64(1, "ms")), DISTINCT),
    # pyarrow
    ("arrow int32 vs int64", lambda: (pa().array([1, 2], pa().int32()), pa().array([1, 2], pa().int64())), DISTINCT),
    ("arrow null vs 0", lambda: (pa().array([None, 1]), pa().array([0, 1])), DISTINCT),
    ("arrow schema metadata", lambda: (table({"unit": "m"}), table()), DISTINCT),
    ("arrow table built twice", lambda: (table(), table()), EQUAL),
    ("arrow string vs large_string", lambda: (pa().array(["a"], pa().string()), pa().array(["a"], pa().large_string())),
     DISTINCT),
    # torch
    ("torch float32 vs float64", lambda: (torch().ones(2, dtype=torch().float32),
                                          torch().ones(2, dtype=torch().float64)), DISTINCT),
    ("torch requires_grad", lambda: (torch().ones(2, requires_grad=True), torch().ones(2)), DISTINCT),
    ("torch Parameter vs tensor", lambda: (torch().nn.Parameter(torch().ones(2)), torch().ones(2, requires_grad=True)),
     DISTINCT),
    ("torch device cpu vs cuda", lambda: (torch().device("cpu"), torch().device("cuda")), DISTINCT),
    ("torch tensor built twice", lambda: (torch().arange(4), torch().arange(4)), EQUAL),
    ("torch tensor: a Python attribute", lambda: (with_attribute(torch().ones(2), unit="kg"), torch().ones(2)),
     DISTINCT),
    ("torch subclass: an attribute", lambda: (scaled_tensor(2.0), scaled_tensor(3.0)), DISTINCT),
    ("torch parameter: its grad", lambda: (with_grad(1.0, 2.0), with_grad(1.0, 3.0)), DISTINCT),
    ("torch parameter: a grad or none", lambda: (with_grad(1.0, 2.0), torch().nn.Parameter(torch().ones(2))),
     DISTINCT),
    # pandas subclasses, as numpy's: their code and what `_metadata` names
    ("pandas subclass: a _metadata attribute", lambda: (unit_frame("cm"), unit_frame("m")), DISTINCT),
    ("pandas subclass: its code", lambda: (unit_frame("cm"), unit_frame("cm", lambda self: 100.0)), DISTINCT),
    ("pandas subclass built twice", lambda: (unit_frame("cm"), unit_frame("cm")), EQUAL),
    # scipy.sparse
    ("sparse csr vs csc", lambda: (sparse("csr"), sparse("csc")), DISTINCT),
    ("sparse csr vs coo", lambda: (sparse("csr"), sparse("coo")), DISTINCT),
    ("sparse matrix vs array", lambda: (sparse("csr"), sp().csr_array(sparse("csr"))), DISTINCT),
    ("sparse values", lambda: (sparse("csr"), sparse("csr", (1.0, 3.0))), DISTINCT),
    ("sparse explicit zero", lambda: (sparse("csr", (1.0, 0.0)), sp().csr_matrix(sparse("csr", (1.0, 0.0)).toarray())),
     DISTINCT),
    ("sparse built twice", lambda: (sparse("csc"), sparse("csc")), EQUAL),
    # a probe's pairs sharing a key: the shape of a 0-d array's contiguous copy (1-d), pandas' row
    # hashes of extension columns (-0.0 is 0.0 to them), a complex NaN's sign, a dtype's metadata
    ("np: a 0-d array vs a one-element one", lambda: (np().array(5), np().array([5])), DISTINCT),
    ("np: a 0-d string array vs a one-element one", lambda: (np().array("a"), np().array(["a"])), DISTINCT),
    ("np: a dtype's metadata", lambda: (np().dtype(float, metadata={"unit": "m"}), np().dtype(float)), DISTINCT),
    ("np: an array whose dtype has metadata", lambda: (
        np().zeros(2, dtype=np().dtype(float, metadata={"unit": "m"})), np().zeros(2)), DISTINCT),
    ("complex: nan vs -nan", lambda: (complex(float("nan"), 0), complex(-float("nan"), 0)), DISTINCT),
    ("complex: nan made twice", lambda: (complex(float("nan"), 0), complex(float("nan"), 0)), EQUAL),
    ("Float64 column: -0.0 vs 0.0", lambda: (pd().Series([-0.0], dtype="Float64"),
                                             pd().Series([0.0], dtype="Float64")), DISTINCT),
    ("Float64 column: NA vs 0.0", lambda: (pd().Series([None], dtype="Float64"),
                                           pd().Series([0.0], dtype="Float64")), DISTINCT),
    ("Int64 column: NA set over a value vs built as NA", lambda: (
        pd().Series([1, 2], dtype="Int64").mask([True, False]), pd().Series([None, 2], dtype="Int64")), EQUAL),
    ("Arrow double column: -0.0 vs 0.0", lambda: (pd().Series([-0.0], dtype=pd().ArrowDtype(pa().float64())),
                                                  pd().Series([0.0], dtype=pd().ArrowDtype(pa().float64()))), DISTINCT),
    ("Arrow list column: two lists", lambda: (pd().Series([[1, 2]], dtype=pd().ArrowDtype(pa().list_(pa().int64()))),
                                              pd().Series([[1, 3]], dtype=pd().ArrowDtype(pa().list_(pa().int64())))),
     DISTINCT),
    ("Arrow list column built twice", lambda: (
        pd().Series([[1, 2], None], dtype=pd().ArrowDtype(pa().list_(pa().int64()))),
        pd().Series([[1, 2], None], dtype=pd().ArrowDtype(pa().list_(pa().int64())))), EQUAL),
    # pandas scalars that were refused: keyed by their content
    ("Timestamp: one instant in two units", lambda: (pd().Timestamp("2020-01-01").as_unit("s"),
                                                     pd().Timestamp("2020-01-01").as_unit("ns")), DISTINCT),
    ("Timestamp: one wall time in two zones", lambda: (pd().Timestamp("2020-01-01", tz="Europe/Paris"),
                                                       pd().Timestamp("2020-01-01", tz="UTC")), DISTINCT),
    ("Timestamp built twice", lambda: (pd().Timestamp("2020-01-01 00:00:00.000000001", tz="Asia/Tokyo"),
                                       pd().Timestamp("2020-01-01 00:00:00.000000001", tz="Asia/Tokyo")), EQUAL),
    ("Timedelta: two units", lambda: (pd().Timedelta(1, "s").as_unit("s"), pd().Timedelta(1, "s").as_unit("ms")),
     DISTINCT),
    ("NaT vs NA", lambda: (pd().NaT, pd().NA), DISTINCT),
    ("Period: M vs 2M", lambda: (pd().Period("2020-01", freq="M"), pd().Period("2020-01", freq="2M")), DISTINCT),
    ("Interval: closed right vs left", lambda: (pd().Interval(0, 1), pd().Interval(0, 1, closed="left")), DISTINCT),
    ("CategoricalDtype: ordered vs not", lambda: (pd().CategoricalDtype(["a"], ordered=True),
                                                  pd().CategoricalDtype(["a"])), DISTINCT),
    ("object column: NA vs None", lambda: (pd().Series([pd().NA], dtype=object), pd().Series([None], dtype=object)),
     DISTINCT),
    ("ZoneInfo: two keys", lambda: (__import__("zoneinfo").ZoneInfo("UTC"), __import__("zoneinfo").ZoneInfo("Asia/Tokyo")),
     DISTINCT),
    # tensors whose hashing raised RuntimeError: one element at another stride, sparse layouts
    ("torch: one element at another stride", lambda: (torch().zeros(1, 3)[:, 0], torch().ones(1, 3)[:, 0]), DISTINCT),
    ("torch: a negated view of one element", lambda: (torch().tensor([1 + 2j]).conj().imag,
                                                      torch().tensor([1 + 3j]).conj().imag), DISTINCT),
    ("torch sparse COO: two values", lambda: (torch().sparse_coo_tensor([[0, 1]], [1.0, 2.0], (3,)),
                                              torch().sparse_coo_tensor([[0, 1]], [1.0, 3.0], (3,))), DISTINCT),
    ("torch sparse COO: coalesced or not", lambda: (torch().sparse_coo_tensor([[0, 1]], [1.0, 2.0], (3,)),
                                                    torch().sparse_coo_tensor([[0, 1]], [1.0, 2.0], (3,)).coalesce()),
     DISTINCT),
    ("torch sparse COO: duplicates in another order", lambda: (
        torch().sparse_coo_tensor([[0, 0]], [1.0, 2.0], (3,)), torch().sparse_coo_tensor([[0, 0]], [2.0, 1.0], (3,))),
     DISTINCT),
    ("torch sparse COO vs its dense tensor", lambda: (torch().sparse_coo_tensor([[0, 1]], [1.0, 2.0], (3,)),
                                                      torch().tensor([1.0, 2.0, 0.0])), DISTINCT),
    ("torch sparse COO built twice", lambda: (torch().sparse_coo_tensor([[0, 1]], [1.0, 2.0], (3,)),
                                              torch().sparse_coo_tensor([[0, 1]], [1.0, 2.0], (3,))), EQUAL),
    ("torch CSR vs CSC", lambda: (torch().eye(2).to_sparse_csr(), torch().eye(2).to_sparse_csc()), DISTINCT),
    ("torch CSR: two values", lambda: (torch().eye(2).to_sparse_csr(), (2 * torch().eye(2)).to_sparse_csr()),
     DISTINCT),
]


@pytest.mark.parametrize(("make", "expected"), [(m, e) for _, m, e in PAIRS], ids=[n for n, _, _ in PAIRS])
def test_collision_table(make, expected):
    a, b = make()
    assert (hash_value(a) != hash_value(b)) == (expected == DISTINCT)


def test_a_user_class_built_on_a_type_whose_value_no_attribute_shows_is_refused():
    """A subclass of io.BytesIO holds its bytes where no attribute shows them: keyed by its
    attributes, every instance shared one key. It is refused, naming the class and the fix."""
    import io

    from hardy.errors import UnhashableError

    class Buffer(io.BytesIO):
        pass
    with pytest.raises(UnhashableError, match=r"Buffer is built on _io\.BytesIO.*__cache_key__"):
        hash_value(Buffer(b"x"))


def test_a_library_subclass_or_a_time_zone_is_never_keyed_by_a_repr_that_leaves_its_value_out():
    """A review's cases: pandas' Timestamp is a datetime whose datetime repr drops nanoseconds (two
    instants, one key), a time zone's base repr is an address (a key per process, or one for two
    zones): each gets keys apart, or is refused; a user's tzinfo keeps its key from its fields."""
    import zoneinfo

    from hardy.errors import UnhashableError

    def apart(a: object, b: object) -> bool:
        try:
            return hash_value(a) != hash_value(b)
        except UnhashableError:
            return True
    assert apart(pd().Timestamp("2020-01-01 00:00:00.000000001"), pd().Timestamp("2020-01-01 00:00:00.000000002"))
    assert apart(pd().Timedelta(1, "ns"), pd().Timedelta(2, "ns"))
    assert apart(zoneinfo.ZoneInfo("UTC"), zoneinfo.ZoneInfo("Asia/Tokyo"))

    class Fixed(datetime.tzinfo):
        def __init__(self, hours: int):
            self.hours = hours
    assert hash_value(Fixed(1)) == hash_value(Fixed(1)) != hash_value(Fixed(2))


def test_a_user_class_with_fspath_is_keyed_by_its_code_and_fields_not_as_a_path():
    """A user class defining `__fspath__` was keyed as a path (its type's name and `os.fspath`):
    a method edited under the same names kept its key. Now as a user class: code and attributes."""
    def made(suffix: str) -> type:
        class Ref:
            def __init__(self, path: str):
                self.path = path

            def __fspath__(self) -> str:
                return self.path

            def tag(self) -> str:
                return self.path + suffix
        return Ref
    assert hash_value(made("")("a")) == hash_value(made("")("a")) != hash_value(made("!")("a"))


class AttrDict(dict):
    __getattr__ = dict.__getitem__  # `cfg.k` reads `cfg["k"]`: a missing name raises KeyError


class Box(dict):
    __getattr__ = dict.get  # a missing name is None


@pytest.mark.parametrize("cls", [AttrDict, Box])
def test_a_dict_subclass_reading_its_keys_as_attributes_is_keyed_as_a_dict(tmp_path, cls):
    """`hasattr(cfg, "__cache_key__")` went through the class's `__getattr__`: KeyError from
    hashing, reported as the node failing, or `None.__call__` (TypeError). Looked up on the type, the
    value is a dict subclass: keyed by its items, run and served from the cache."""
    from hardy import DiskCache, Engine, Pipeline, node

    @node(output_name="y")
    def double(cfg):
        return cfg.k * 2

    def pipeline() -> Pipeline:
        return Pipeline([double], cache=DiskCache(tmp_path / "c"), engine=Engine(map_executor="sequential"))
    assert pipeline().run(inputs={"cfg": cls(k=2)}) == {"y": 4}
    assert [r["y"] for r in pipeline().map(inputs={"cfg": [cls(k=2), cls(k=3)]}, map_over="cfg")] == [4, 6]
    assert hash_value(cls(k=2)) != hash_value(cls(k=3)) != hash_value({"k": 3})


def test_the_table_is_large_enough():
    assert len(PAIRS) >= 40 and sum(e == EQUAL for _, _, e in PAIRS) >= 5


def test_keys_are_the_same_in_every_interpreter(tmp_path):
    """pipefunc keyed stateful callables by __hash__: different per interpreter (hash
    randomisation). Keys here come out the same in fresh processes with different hash seeds."""
    script = tmp_path / "keys.py"
    script.write_text(
        "import collections, json, sys\n"
        f"sys.path.insert(0, {str(Path(__file__).parent)!r})\n"
        "from test_cache_collisions import Scale, tagged\n"
        "import typing\n"
        "from hardy.hashing import code_fingerprint, hash_value\n"
        "class Hinted:\n"
        "    z: typing.Annotated[int, frozenset({'alpha', 'beta', 'gamma', 'delta'})]\n"
        "values = [Scale(2.0), {'b', 'a', 'c'}, frozenset({('x', 1), ('y', 2)}), tagged('kg'),\n"
        "          collections.defaultdict(int, a=1), {9, 1, (2, 2.5), 17}]\n"
        "print(json.dumps([hash_value(v).hex() for v in values] + [code_fingerprint(Hinted).hex()]))\n")
    runs = [subprocess.run([sys.executable, "-"], stdin=script.open(), capture_output=True, text=True, timeout=120,
                           env={**os.environ, "PYTHONHASHSEED": seed}) for seed in ("1", "2")]
    assert all(r.returncode == 0 for r in runs), runs[0].stderr + runs[1].stderr
    assert json.loads(runs[0].stdout) == json.loads(runs[1].stdout)


def _served(tmp_path: Path, func: typing.Callable[..., object], inputs: list[dict[str, object]]) -> list[object]:
    """What a cached node returns for each input in turn, one cache on disk: a wrong hit returns
    an earlier input's result."""
    from hardy import DiskCache, Engine, Pipeline, node
    p = Pipeline([node(func, output_name="y")], cache=DiskCache(tmp_path / "cache"),
                 engine=Engine(map_executor="sequential"))
    return [p.run(inputs=i)["y"] for i in inputs]


def test_pydantic_models_are_keyed_by_their_state_not_by_model_dump(tmp_path):
    """A probe's case: `model_dump()` writes a `Dog` held by an `Animal` field as an `Animal`,
    leaves out an `exclude=True` field and applies a `field_serializer`, so two requests a node
    reads differently shared a key (`'collie|0.51|s1'` served for the second). Keyed by their
    class and state (`__dict__`, extra fields, private attributes, fields set), each is its own."""
    pydantic = pytest.importorskip("pydantic")

    class Animal(pydantic.BaseModel):
        name: str

    class Dog(Animal):
        breed: str

    class Cat(pydantic.BaseModel):
        name: str

    class Holder(pydantic.BaseModel):
        pet: typing.Any

    class Request(pydantic.BaseModel):
        pet: Animal
        threshold: float = 0.5
        salt: str = pydantic.Field(default="", exclude=True)

        @pydantic.field_serializer("threshold")
        def _shown(self, v: float) -> float:
            return round(v, 1)

    class Open(pydantic.BaseModel):
        model_config = pydantic.ConfigDict(extra="allow")
        k: int = 1

    def describe(req: Request) -> str:
        return f"{req.pet.breed}|{req.threshold}|{req.salt}"  # type: ignore[attr-defined]
    a = Request(pet=Dog(name="rex", breed="collie"), threshold=0.51, salt="s1")
    b = Request(pet=Dog(name="rex", breed="poodle"), threshold=0.54, salt="s2")
    assert _served(tmp_path, describe, [{"req": a}, {"req": b}]) == ["collie|0.51|s1", "poodle|0.54|s2"]
    assert hash_value(Request(pet=Dog(name="rex", breed="x"))) != hash_value(Request(pet=Dog(name="rex", breed="y")))
    assert hash_value(Request(pet=Animal(name="rex"), salt="1")) != hash_value(Request(pet=Animal(name="rex"), salt="2"))
    assert hash_value(Holder(pet=Animal(name="rex"))) != hash_value(Holder(pet=Cat(name="rex")))  # equal dumps
    assert hash_value(Open()) != hash_value(Open(k=1))  # `model_fields_set`, `model_dump(exclude_unset=True)`
    assert hash_value(Open(j=1)) != hash_value(Open(j=2))  # extra fields
    assert hash_value(Request(pet=Dog(name="rex", breed="x"), salt="1")) == \
        hash_value(Request(pet=Dog(name="rex", breed="x"), salt="1"))


def test_a_pydantic_secret_is_keyed_by_the_value_it_hides(tmp_path):
    """A model with a `SecretStr` field was refused, with advice (`__cache_key__()`) the user
    cannot follow for pydantic's class: the secret is the value the node computes with."""
    pydantic = pytest.importorskip("pydantic")

    class Login(pydantic.BaseModel):
        token: pydantic.SecretStr

    def head(login: Login) -> str:
        return login.token.get_secret_value()[:2]
    assert _served(tmp_path, head, [{"login": Login(token="ab1")}, {"login": Login(token="cd1")}]) == ["ab", "cd"]
    assert hash_value(pydantic.SecretStr("a")) == hash_value(pydantic.SecretStr("a")) != \
        hash_value(pydantic.SecretStr("b")) != hash_value(pydantic.SecretBytes(b"b"))


def test_numpy_records_with_an_object_field_are_keyed_by_their_dtype(tmp_path):
    """An array with an object field was keyed by its shape and `tolist()`, its dtype left out:
    records whose `score` is int16 or int64, or whose field is `label` or `name`, shared a key
    (`[-5536]`, int16's overflow, served for int64's `[60000]`), as did a record scalar."""
    np = pytest.importorskip("numpy")

    def records(score: str = "i8", label: str = "label") -> object:
        return np.array([("a", 30000)], dtype=[(label, object), ("score", score)])

    def doubled(rec: object) -> list[int]:
        return (rec["score"] * 2).tolist()  # type: ignore[index]
    assert _served(tmp_path, doubled, [{"rec": records("i2")}, {"rec": records("i8")}]) == [[-5536], [60000]]
    assert hash_value(records(label="label")) != hash_value(records(label="name"))
    assert hash_value(records(">i8")) != hash_value(records("<i8"))
    assert hash_value(records("i2")[0]) != hash_value(records("i8")[0])
    as_tuples = np.empty(1, dtype=object)
    as_tuples[0] = ("a", 30000)
    assert hash_value(records()) != hash_value(as_tuples)
    assert hash_value(records()) == hash_value(records())


def test_quantized_tensors_are_keyed_by_their_scale_and_zero_point(tmp_path):
    """Two quantized tensors with the same integers and another scale shared a key: a node that
    dequantizes was served `[1.0, 2.0]` for `[2.0, 4.0]`. Per channel, the scales, zero points and axis."""
    torch = pytest.importorskip("torch")

    def per_tensor(values: list[float], scale: float, zero: int = 0) -> object:
        return torch.quantize_per_tensor(torch.tensor(values), scale=scale, zero_point=zero, dtype=torch.quint8)

    def per_channel(scales: list[float], axis: int = 0, zeros: tuple[int, int] = (0, 0)) -> object:
        return torch.quantize_per_channel(torch.ones(2, 2), torch.tensor(scales), torch.tensor(zeros), axis,
                                          torch.quint8)

    def dequantized(q: object) -> list[float]:
        return q.dequantize().tolist()  # type: ignore[attr-defined]
    a, b = per_tensor([1.0, 2.0], 0.1), per_tensor([2.0, 4.0], 0.2)
    assert _served(tmp_path, dequantized, [{"q": a}, {"q": b}]) == [dequantized(a), dequantized(b)]
    assert hash_value(per_tensor([1.0], 0.1, zero=0)) != hash_value(per_tensor([1.1], 0.1, zero=1))
    assert hash_value(per_channel([0.5, 1.0])) != hash_value(per_channel([0.25, 0.5]))
    assert hash_value(per_channel([0.5, 1.0], axis=0)) != hash_value(per_channel([0.5, 1.0], axis=1))
    assert hash_value(per_channel([0.5, 1.0])) == hash_value(per_channel([0.5, 1.0]))


def test_attrs_and_dataclass_instances_are_keyed_by_all_they_hold(tmp_path):
    """An attrs instance was keyed by its declared fields: two scalers `fit()` on other data
    (`self.mean_`) shared a key (`[2.0, 3.0]` served for `[-16.0, -15.0]`); a dataclass left out a
    slot its mixin declares. Both now add what the instance holds besides its fields, as a plain
    object's key does. A slot is read through its descriptor: hashing an attrs instance does not
    compute a `cached_property` its class's `__getattr__` would compute."""
    import dataclasses
    import functools

    attr = pytest.importorskip("attr")

    @attr.s
    class Scaler:
        with_mean = attr.ib(default=True)

        def fit(self, xs: list[float]) -> Scaler:
            self.mean_ = sum(xs) / len(xs)
            return self

        def transform(self, xs: list[float]) -> list[float]:
            return [x - self.mean_ for x in xs]

    class Unit:
        __slots__ = ("_unit",)

    @dataclasses.dataclass
    class Measure(Unit):
        value: float

    def measure(value: float, unit: str) -> Measure:
        m = Measure(value)
        m._unit = unit
        return m

    @attr.define
    class Lazy:
        k: int = 1

        @functools.cached_property
        def expensive(self) -> int:
            raise AssertionError("computed by hashing")

    def apply(scaler: Scaler, xs: list[float]) -> list[float]:
        return scaler.transform(xs)
    s1, s2 = Scaler().fit([1, 2, 3]), Scaler().fit([10, 20, 30])
    assert _served(tmp_path, apply, [{"scaler": s1, "xs": [4, 5]}, {"scaler": s2, "xs": [4, 5]}]) == \
        [[2.0, 3.0], [-16.0, -15.0]]
    assert hash_value(measure(1.0, "kg")) != hash_value(measure(1.0, "lb"))
    assert hash_value(measure(1.0, "kg")) == hash_value(measure(1.0, "kg"))
    assert hash_value(Lazy()) == hash_value(Lazy())


def test_an_int_past_pythons_str_limit_is_keyed_by_its_bytes(tmp_path):
    """`str(n)` raises past 4,300 digits: a cached node given `math.factorial(2000)`, or reading
    such a global, failed with ValueError where the same pipeline without a cache ran. Such an int is
    keyed by its bytes; every other int keeps the key its digits give it."""
    import math

    if not hasattr(sys, "get_int_max_str_digits"):
        pytest.skip("no limit on int-to-str conversion in this Python")
    big = math.factorial(2000)

    def bits(n: int) -> int:
        return n.bit_length()
    assert _served(tmp_path, bits, [{"n": big}, {"n": big * 2}, {"n": big}]) == [bits(big), bits(big) + 1, bits(big)]
    assert len({hash_value(big), hash_value(big + 1), hash_value(-big), hash_value([big])}) == 4
    assert hash_value(big) == hash_value(math.factorial(2000))
    assert hash_value(10**4299) != hash_value(10**4300)  # either side of the limit

    def reading(n: int) -> typing.Callable[[], int]:
        return lambda: n.bit_length()  # a value the code reads (a global, a closure cell)
    assert code_fingerprint(reading(big)) != code_fingerprint(reading(big + 1))
    assert hash_value(12345).hex() == hash_value(12345).hex() and hash_value(-7) != hash_value(7)
    unlimited = subprocess.run([sys.executable, "-c", "import math; from hardy.hashing import hash_value; "
                                "print(hash_value(math.factorial(2000)).hex())"], capture_output=True, text=True,
                               env={**os.environ, "PYTHONINTMAXSTRDIGITS": "0"}, timeout=60)
    assert unlimited.stdout.strip() == hash_value(big).hex(), "a process without the limit keys it otherwise"


def test_a_models_key_does_not_change_when_a_cached_property_is_read():
    """A model is keyed by all it holds; a `cached_property`'s value, stored in the instance once
    read, follows from the rest: had it counted, one script reading `cfg.total` before the map and
    another not would miss each other's entries."""
    import functools

    attrs = pytest.importorskip("attrs")
    pydantic = pytest.importorskip("pydantic")

    @attrs.define(slots=False)
    class Scaler:
        x: int

        @functools.cached_property
        def total(self) -> int:
            return self.x * 2

    class Settings(pydantic.BaseModel):
        x: int

        @functools.cached_property
        def total(self) -> int:
            return self.x * 2

    for model in (Scaler(1), Settings(x=1)):
        before = hash_value(model)
        assert model.total == 2
        assert hash_value(model) == before, type(model).__name__
