"""Big buffers cross between the parent and its workers through memfd segments, both ways.

Checked on real worker processes: results are views of the shared pages (no copy), nothing ever
appears in /dev/shm, and neither a worker segfaulting with segments in flight nor results being
dropped leaves a mapping or a descriptor behind in the parent. torch tensors arrive as views of
the segments on both sides; bytes, bytearray and memoryview cross out of band too, type kept.
"""

from __future__ import annotations

import gc
import os
import signal

import numpy as np
import pytest

from conftest import Unloadable
from hardy import Engine, Failed, NodeCrashed, Pipeline, node
from hardy.buffers import THRESHOLD
from hardy.shipping import transport

pytestmark = pytest.mark.timeout(180)

MB = 1 << 20


@node(output_name="y")
def scaled(x: np.ndarray, k: float) -> np.ndarray:
    return x * k


@node(output_name="y")
def big_or_crash(x: np.ndarray) -> np.ndarray:
    if x[0] == 3:  # its input is mapped here, other workers' results are on their way
        os.kill(os.getpid(), signal.SIGSEGV)
    return x + 1


@node(output_name="y")
def tensor_back(x):
    """The tensor back, and whether it arrived here as a view of a shared segment."""
    return {"t": x, "shared_here": _in_segment(x.data_ptr())}


@node(output_name="y")
def same(x):
    return x


def _in_segment(address: int) -> bool:
    with open("/proc/self/maps") as f:
        for line in f:
            if "memfd:hardy" in line:
                lo, hi = (int(v, 16) for v in line.split()[0].split("-"))
                if lo <= address < hi:
                    return True
    return False


def _segments_mapped() -> int:
    with open("/proc/self/maps") as f:
        return sum("memfd:hardy" in line for line in f)


def _segment_fds() -> int:
    return sum("memfd:hardy" in os.readlink(f"/proc/self/fd/{fd}") for fd in os.listdir("/proc/self/fd")
               if os.path.exists(f"/proc/self/fd/{fd}"))


@pytest.fixture(scope="module")
def engine():
    e = Engine(map_executor="process", workers=2)
    yield e
    e.close()


def test_big_arrays_come_back_as_shared_pages_and_are_released(engine):
    arrays = [np.full(3 * MB // 8, float(i)) for i in range(6)]
    shm_before = set(os.listdir("/dev/shm"))
    out = Pipeline(nodes=[scaled], engine=engine).map(inputs={"x": arrays, "k": 2.0}, map_over="x")
    assert [float(o["y"][17]) for o in out] == [2.0 * i for i in range(6)]
    assert _segments_mapped() >= 1 and isinstance(out[0]["y"].base.base, memoryview)
    out[0]["y"][0] = -1.0  # writable, like an unpickled array
    assert set(os.listdir("/dev/shm")) == shm_before and _segment_fds() == 0
    del out
    gc.collect()
    assert _segments_mapped() == 0


def test_an_input_shared_by_all_items_is_written_once(engine):
    weights = np.full(4 * MB // 8, 0.5)

    @node(output_name="y")
    def weigh(x: float, w: np.ndarray) -> float:
        return x * float(w.sum())

    p = Pipeline(nodes=[weigh], engine=engine)
    written = []
    real = transport._segment
    transport._segment = lambda raws: written.append(sum(r.nbytes for r in raws)) or real(raws)
    try:
        out = p.map(inputs={"x": [float(i) for i in range(64)], "w": weights}, map_over="x")
    finally:
        transport._segment = real
    assert [o["y"] for o in out] == [i * 0.5 * weights.size for i in range(64)]
    assert written == [weights.nbytes]  # once for the map, not once per chunk
    assert _segment_fds() == 0


def test_small_values_stay_in_the_pipe(engine):
    out = Pipeline(nodes=[scaled], engine=engine).map(inputs={"x": [np.ones(1000)] * 3, "k": 3.0}, map_over="x")
    assert float(out[2]["y"].sum()) == 3000.0 and _segments_mapped() == 0


def test_worker_crash_with_segments_in_flight_leaves_nothing(engine):
    shm_before = set(os.listdir("/dev/shm"))
    arrays = [np.full(2 * MB // 8, float(i)) for i in range(6)]
    out = Pipeline(nodes=[big_or_crash], engine=engine).map(inputs={"x": arrays}, map_over="x",
                                                              on_error="continue")
    assert isinstance(out[3], Failed) and isinstance(out[3].error, NodeCrashed)
    assert out[3].error.signal == "SIGSEGV"
    assert [float(o["y"][0]) for i, o in enumerate(out) if i != 3] == [i + 1.0 for i in range(6) if i != 3]
    del out
    gc.collect()
    assert set(os.listdir("/dev/shm")) == shm_before
    assert _segments_mapped() == 0 and _segment_fds() == 0


def test_pack_and_unpack_across_a_socket():
    import socket
    from multiprocessing.connection import Connection

    from hardy.shipping import dumps

    a, b = socket.socketpair()
    sender, receiver = Connection(a.detach()), Connection(b.detach())
    value = {"big": np.arange(THRESHOLD // 8 + 1, dtype=np.int64), "small": np.arange(4), "n": 7}
    packed = transport.pack(value, dumps)
    assert packed.data[:4] == transport.MAGIC and len(packed.fds) == 1 and packed.owned
    transport.send(sender, b"", packed)
    assert not packed.owned  # the sender's descriptor is closed once sent
    got = transport.unpack(receiver, memoryview(receiver.recv_bytes()))
    assert got["n"] == 7 and np.array_equal(got["big"], value["big"]) and np.array_equal(got["small"], value["small"])
    plain = transport.pack({"small": np.arange(4)}, dumps)
    assert not plain.fds and plain.data[:1] == b"\x80"
    weights = np.ones(THRESHOLD // 8 * 2)
    shared = transport.Shared([{"w": weights}], dumps)
    first = transport.pack({"w": weights, "x": value["big"]}, dumps, shared)
    second = transport.pack({"w": weights}, dumps, shared)
    assert len(first.fds) == 2 and second.fds == first.fds[1:] and not second.owned  # written once
    transport.send(sender, b"", first)
    transport.send(sender, b"", second)
    one, two = (transport.unpack(receiver, memoryview(receiver.recv_bytes())) for _ in range(2))
    assert np.array_equal(one["x"], value["big"]) and float(one["w"].sum()) == float(two["w"].sum()) == weights.size
    shared.close()
    sender.close()
    receiver.close()


def test_a_big_segment_is_written_in_pieces_and_mapped_as_one(monkeypatch):
    import socket
    from multiprocessing.connection import Connection

    from hardy.shipping import dumps

    monkeypatch.setattr(transport, "WRITERS", 3)  # as on a machine with 3 cores or more
    a, b = socket.socketpair()
    sender, receiver = Connection(a.detach()), Connection(b.detach())
    # Two buffers over three pieces: the second one straddles a boundary between pieces.
    value = [np.arange(transport.PIECE // 8 * 2, dtype=np.int64), np.arange(transport.PIECE // 8 + 5, dtype=np.int64)]
    packed = transport.pack(value, dumps)
    assert len(packed.fds) == packed.owned == 3
    transport.send(sender, b"", packed)
    got = transport.unpack(receiver, memoryview(receiver.recv_bytes()))
    assert all(np.array_equal(g, v) for g, v in zip(got, value))
    assert _segments_mapped() == 3 and _segment_fds() == 0  # three pieces in one mapping
    got[1][-1] = -1  # writable
    del got
    gc.collect()
    assert _segments_mapped() == 0
    sender.close()
    receiver.close()


def test_more_segments_than_one_message_may_pass():
    import socket
    from multiprocessing.connection import Connection

    from hardy.shipping import dumps

    a, b = socket.socketpair()
    sender, receiver = Connection(a.detach()), Connection(b.detach())
    weights = [np.full(THRESHOLD // 8, float(k)) for k in range(transport.SCM_MAX_FD + 7)]
    shared = transport.Shared([weights], dumps)
    packed = transport.pack(weights, dumps, shared)  # a descriptor per array: more than one sendmsg takes
    assert len(packed.fds) > transport.SCM_MAX_FD
    transport.send(sender, b"", packed)
    got = transport.unpack(receiver, memoryview(receiver.recv_bytes()))
    assert [float(g[-1]) for g in got] == [float(k) for k in range(len(weights))]
    shared.close()
    del got
    gc.collect()
    assert _segments_mapped() == 0 and _segment_fds() == 0
    sender.close()
    receiver.close()


@pytest.mark.slow  # torch in a subprocess
def test_torch_tensors_cross_as_shared_pages_both_ways(engine):
    torch = pytest.importorskip("torch")
    tensors = [torch.arange(MB, dtype=torch.float32),  # 4 MiB
               torch.linspace(-1, 1, 2 * MB, dtype=torch.bfloat16).reshape(1024, 2048).requires_grad_()]
    out = Pipeline(nodes=[tensor_back], engine=engine).map(inputs={"x": tensors}, map_over="x")
    for sent, o in zip(tensors, out):
        got = o["y"]["t"]
        assert o["y"]["shared_here"] and _in_segment(got.data_ptr())  # no copy in the worker nor here
        assert (got.dtype, got.shape, got.requires_grad) == (sent.dtype, sent.shape, sent.requires_grad)
        assert torch.equal(got.detach(), sent.detach())
    out[0]["y"]["t"][0] = -1.0  # writable
    del out, o, got
    gc.collect()
    assert _segments_mapped() == 0 and _segment_fds() == 0


@node(output_name="y")
def arrow_back(x):
    """The table back, and whether its column arrived here as a view of a shared segment."""
    return {"t": x, "shared_here": _in_segment(x.column("v").chunk(0).buffers()[1].address)}


def test_arrow_tables_cross_as_shared_pages_both_ways(engine):
    pa = pytest.importorskip("pyarrow")
    tables = [pa.table({"v": np.arange(MB, dtype=np.int64) + i, "w": np.full(MB, 0.5)}) for i in range(3)]
    out = Pipeline(nodes=[arrow_back], engine=engine).map(inputs={"x": tables}, map_over="x")
    for sent, o in zip(tables, out):
        got = o["y"]["t"]
        assert o["y"]["shared_here"] and _in_segment(got.column("v").chunk(0).buffers()[1].address)
        assert got.equals(sent)
    del out, o, got
    gc.collect()
    assert _segments_mapped() == 0 and _segment_fds() == 0


def test_bytes_likes_cross_out_of_band_and_keep_their_type(engine):
    values = [bytes(range(256)) * (16 * 1024), bytearray(b"\x07" * (4 * MB)),
              memoryview(np.arange(MB, dtype=np.int32).reshape(1024, 1024)).cast("B").cast("i", (1024, 1024))]
    out = Pipeline(nodes=[same], engine=engine).map(inputs={"x": values}, map_over="x")
    got = [o["y"] for o in out]
    assert [type(g) for g in got] == [bytes, bytearray, memoryview]
    assert got[0] == values[0] and got[1] == values[1]
    assert (got[2].format, got[2].shape) == ("i", (1024, 1024)) and got[2].tobytes() == values[2].tobytes()
    got[2][0, 0] = -1  # a view of the shared pages, writable
    del out, got
    gc.collect()
    assert _segments_mapped() == 0 and _segment_fds() == 0


@node(output_name="y")
def view_or_ghost(x: int):
    """Item 105 cannot be unpickled in the parent: its whole batch is sent again."""
    return Unloadable() if x == 105 else memoryview(np.arange(4, dtype=np.int32) + x)


def test_a_memoryview_keeps_its_type_when_its_batch_is_sent_again(engine):
    out = Pipeline(nodes=[view_or_ghost], engine=engine).map(inputs={"x": list(range(200))}, map_over="x",
                                                               on_error="continue")
    assert isinstance(out[105], Failed) and "cannot be unpickled" in str(out[105].error)
    got = [o["y"] for i, o in enumerate(out) if i != 105]
    assert {(type(g), g.format) for g in got} == {(memoryview, "i")}
    assert [g.tolist() for g in got] == [[i, i + 1, i + 2, i + 3] for i in range(200) if i != 105]


def test_only_big_plain_values_leave_the_pickle():
    torch = pytest.importorskip("torch")
    from hardy.shipping import dumps

    for big in (torch.ones(MB), torch.ones(MB, dtype=torch.bfloat16), b"x" * (2 * MB), bytearray(2 * MB),
                memoryview(bytearray(2 * MB))):
        packed = transport.pack({"v": [big]}, dumps)
        assert len(packed.data) < 1000 and len(packed.fds) == 1, type(big)
        packed.close()
    for stays in (torch.ones(1000), b"x" * 1000, bytearray(1000), torch.ones(1024, 1024)[:, ::2]):
        packed = transport.pack({"v": stays}, dumps)  # small, or not contiguous: in the pickle as before
        assert not packed.fds and len(packed.data) > 1000
    weights = torch.ones(MB)
    shared = transport.Shared([{"w": weights}], dumps)
    first, second = (transport.pack({"w": weights}, dumps, shared) for _ in range(2))
    assert first.fds == second.fds and not first.owned  # a tensor every item holds is written once
    shared.close()


def test_pickling_for_workers_never_imports_torch():
    import subprocess
    import sys

    code = ("import sys; from hardy.shipping import dumps, transport; import numpy as np; "
            "transport.pack({'a': np.ones(2**18), 'b': b'x' * 2**21, 'm': memoryview(b'ab')}, dumps).close(); "
            "assert 'torch' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_spin_for_returns_at_data_at_the_end_of_its_time_or_of_the_peer():
    """`spin_for` waits on the CPU until the descriptor is readable, for at most its time: it
    returns with the message there, with nothing there, and when the other end is gone."""
    import select
    import socket
    ours, theirs = socket.socketpair()
    poller = select.poll()
    poller.register(ours.fileno(), select.POLLIN)
    transport.spin_for(poller, 0.001)  # nothing comes
    assert not poller.poll(0)
    transport.write_frame(theirs.fileno(), b"", b"hello")
    transport.spin_for(poller, 3600)  # there already: returns at once (else the test times out)
    assert transport.read_frame(ours.fileno()) == b"hello"
    theirs.close()
    transport.spin_for(poller, 3600)  # the peer is gone
    with pytest.raises(EOFError):
        transport.read_frame(ours.fileno())
    ours.close()
