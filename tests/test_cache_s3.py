"""The object-store cache against a real S3 API server on loopback (moto's server, started here as a
process of its own): publication, hits, races between processes, injected 409/503 answers and
stalls (a loopback proxy in front of the server), damaged objects, the server killed mid-map, a
Dask cluster sharing the bucket, single flight across processes, and `hardy cache --remote`."""

from __future__ import annotations

import http.client
import http.server
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid

import pytest

from hardy import DiskCache, Engine, MapInterrupted, Pipeline, node

pytest.importorskip("s3fs")
pytest.importorskip("moto")
boto3 = pytest.importorskip("boto3")

from hardy.cache.keys import MISS  # noqa: E402
from hardy.cache.objectstore import BucketStore  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]  # a real S3 server (moto) on loopback
SECRET = "team-secret"
CREDS = {"key": "testing", "secret": "testing"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_moto() -> tuple[subprocess.Popen[bytes], str]:
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 60
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return proc, f"http://127.0.0.1:{port}"
        except OSError:
            if time.monotonic() > deadline or proc.poll() is not None:
                proc.kill()
                raise RuntimeError("moto server did not start") from None
            time.sleep(0.1)


def stop(proc: subprocess.Popen[bytes]) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


class S3:
    def __init__(self, endpoint: str):
        self.endpoint = endpoint
        self.client = boto3.client("s3", endpoint_url=endpoint, aws_access_key_id="testing",
                                   aws_secret_access_key="testing", region_name="us-east-1")

    def bucket(self, versioned: bool = False) -> str:
        name = f"hardy-{uuid.uuid4().hex[:12]}"
        self.client.create_bucket(Bucket=name)
        if versioned:
            self.client.put_bucket_versioning(Bucket=name, VersioningConfiguration={"Status": "Enabled"})
        return name

    def options(self, endpoint: str | None = None, **config: float) -> dict[str, object]:
        opts: dict[str, object] = {"endpoint_url": endpoint or self.endpoint, **CREDS}
        if config:
            opts["config_kwargs"] = config
        return opts

    def keys(self, bucket: str) -> list[str]:
        pages = self.client.get_paginator("list_objects_v2").paginate(Bucket=bucket)
        return sorted(o["Key"] for page in pages for o in page.get("Contents", []))


@pytest.fixture(scope="module")
def s3():
    proc, endpoint = start_moto()
    yield S3(endpoint)
    stop(proc)


@pytest.fixture
def bucket(s3):
    return s3.bucket()


def cache_for(s3, bucket, folder, **kw) -> DiskCache:
    opts = kw.pop("storage_options", None) or s3.options()
    return DiskCache(f"s3://{bucket}/team", storage_options=opts, local=folder, secret=SECRET, **kw)


def cache_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "hardy.cache" and r.levelno >= logging.WARNING]


@node(output_name="y")
def triple(x: int) -> int:
    return 3 * x


SEQ = Engine(map_executor="sequential")


# --- publish, hit, miss ----------------------------------------------------------------------------

def test_publish_then_hit_from_another_machine_then_miss(s3, bucket, tmp_path):
    first = cache_for(s3, bucket, tmp_path / "a")
    out = Pipeline(nodes=[triple], cache=first, engine=SEQ).map(inputs={"x": list(range(10))}, map_over="x")
    assert [o["y"] for o in out] == [3 * x for x in range(10)]
    keys = s3.keys(bucket)
    assert len(keys) == 10
    kid = first.key_id.hex()
    assert all(k.startswith(f"team/hardy-key-3/{kid}/") and k.split("/")[-2] == k.split("/")[-1][:2] for k in keys)

    other = cache_for(s3, bucket, tmp_path / "b")  # another machine: its local cache is empty
    p = Pipeline(nodes=[triple], cache=other, engine=SEQ)
    assert [o["y"] for o in p.map(inputs={"x": list(range(10))}, map_over="x")] == [3 * x for x in range(10)]
    assert (other.hits, other.misses) == (10, 0)
    assert len(list(other.store.local.entries())) == 10  # read through: downloaded once, kept locally

    assert p.run(inputs={"x": 99})["y"] == 297  # a miss: computed, published
    assert other.misses == 1
    assert len(s3.keys(bucket)) == 11


def test_big_arrays_are_served_mapped_from_the_local_copy(s3, bucket, tmp_path):
    np = pytest.importorskip("numpy")

    @node(output_name="arr")
    def big(n: int):
        return np.arange(n, dtype=np.float64)

    Pipeline(nodes=[big], cache=cache_for(s3, bucket, tmp_path / "a"), engine=SEQ).run(inputs={"n": 1 << 18})
    reader = cache_for(s3, bucket, tmp_path / "b")
    arr = Pipeline(nodes=[big], cache=reader, engine=SEQ).run(inputs={"n": 1 << 18})["arr"]
    again = Pipeline(nodes=[big], cache=reader, engine=SEQ).run(inputs={"n": 1 << 18})["arr"]
    assert reader.hits == 2 and arr[-1] == again[-1] == (1 << 18) - 1
    from test_cache_mmap import mapped_file
    blob = tmp_path / "b" / "blobs"
    assert mapped_file(arr).startswith(str(blob)) and mapped_file(again).startswith(str(blob))  # pages of the local copy
    again[0] = 7.0  # writable, private


def test_a_cache_on_a_bucket_needs_a_secret(s3, bucket, tmp_path, monkeypatch):
    monkeypatch.delenv("HARDY_CACHE_KEY", raising=False)
    with pytest.raises(ValueError, match="HARDY_CACHE_KEY"):
        DiskCache(f"s3://{bucket}/x", storage_options=s3.options(), local=tmp_path)
    monkeypatch.setenv("HARDY_CACHE_KEY", SECRET)
    assert DiskCache(f"s3://{bucket}/x", storage_options=s3.options(), local=tmp_path).secret


def test_other_secrets_live_apart(s3, bucket, tmp_path):
    mine = cache_for(s3, bucket, tmp_path / "a")
    Pipeline(nodes=[triple], cache=mine, engine=SEQ).run(inputs={"x": 1})
    theirs = DiskCache(f"s3://{bucket}/team", storage_options=s3.options(), local=tmp_path / "b", secret="other")
    Pipeline(nodes=[triple], cache=theirs, engine=SEQ).run(inputs={"x": 1})
    assert (theirs.hits, theirs.misses) == (0, 1)  # never even fetched ours: another key id, another folder
    assert len({k.split("/")[2] for k in s3.keys(bucket)}) == 2


# --- races between processes -----------------------------------------------------------------------

RACER = """
import os, sys, time
from hardy import DiskCache
bucket, endpoint, folder, start = sys.argv[1:5]
opts = {"endpoint_url": endpoint, "key": "testing", "secret": "testing"}
cache = DiskCache(f"s3://{bucket}/race", storage_options=opts, local=folder + "/w", secret="team-secret")
keys = [bytes([k]) * 16 for k in range(12)]
while time.time() < float(start):
    time.sleep(0.001)
for k in keys:
    cache.put(k, ("written by", os.getpid(), k.hex()))
cache.report()
reader = DiskCache(f"s3://{bucket}/race", storage_options=opts, local=folder + "/r", secret="team-secret")
for k in keys:
    print(repr(reader.get(k)))
"""


def test_eight_processes_racing_publish_one_body_per_key(s3, tmp_path):
    bucket = s3.bucket(versioned=True)  # every overwrite would leave a version behind
    start = str(time.time() + 5)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    procs = [subprocess.Popen([sys.executable, "-", bucket, s3.endpoint, str(tmp_path / f"p{i}"), start],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
             for i in range(8)]
    outs = [p.communicate(RACER.encode(), timeout=180) for p in procs]
    assert all(p.returncode == 0 for p in procs), [e.decode()[-2000:] for _, e in outs]
    seen = [o.decode().split("\n")[:12] for o, _ in outs]
    assert all("None" not in line for lines in seen for line in lines)
    assert all(lines == seen[0] for lines in seen)  # every reader got the same, verified value
    versions = s3.client.list_object_versions(Bucket=bucket)["Versions"]
    assert len(versions) == 12 == len({v["Key"] for v in versions})  # exactly one body per key, never replaced


# --- injected answers: 409, 503, a stall ------------------------------------------------------------

class FaultProxy(http.server.ThreadingHTTPServer):
    """Forwards to the S3 server, answering some requests itself first: `inject[(method, marker)]` is
    a list of (status, code) answered, one per matching request, before the request goes through."""

    daemon_threads = True

    def __init__(self, upstream: str):
        self.upstream = upstream.removeprefix("http://")
        self.inject: dict[tuple[str, str], list[tuple[int, str]]] = {}
        self.injected: list[tuple[str, int]] = []
        self.stall = 0.0
        self.chunked = False  # answers to GET without a Content-Length (chunked), as some proxies send them
        self.seen: list[tuple[str, str]] = []  # (method, path) of every request, in order
        self.in_flight = self.peak = 0  # requests being answered now, and at most at once
        self.lock = threading.Lock()
        super().__init__(("127.0.0.1", 0), _Forward)
        threading.Thread(target=self.serve_forever, daemon=True).start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class _Forward(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):
        pass

    def _any(self) -> None:
        srv: FaultProxy = self.server  # type: ignore[assignment]
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        with srv.lock:
            srv.seen.append((self.command, self.path))
            srv.in_flight += 1
            srv.peak = max(srv.peak, srv.in_flight)
        try:
            self._answer(srv, body)
        finally:
            with srv.lock:
                srv.in_flight -= 1

    def _answer(self, srv: FaultProxy, body: bytes) -> None:
        with srv.lock:
            answer = next(((m, k) for (m, k), queue in srv.inject.items()
                           if m == self.command and k in self.path and queue), None)
            if answer is not None:
                status, code = srv.inject[answer].pop(0)
                srv.injected.append((self.command, status))
        if srv.stall:
            time.sleep(srv.stall)
        if answer is not None:
            xml = f"<?xml version='1.0'?><Error><Code>{code}</Code><Message>injected</Message></Error>".encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/xml")
            self.send_header("Content-Length", str(len(xml)))
            self.end_headers()
            self.wfile.write(xml)
            return
        conn = http.client.HTTPConnection(srv.upstream, timeout=30)
        conn.request(self.command, self.path, body=body, headers=dict(self.headers))
        resp = conn.getresponse()
        data = resp.read()
        self.send_response(resp.status)
        for k, v in resp.getheaders():
            if k.lower() not in ("content-length", "transfer-encoding", "connection", "server", "date"):
                self.send_header(k, v)
        chunked = srv.chunked and self.command == "GET"
        self.send_header(*(("Transfer-Encoding", "chunked") if chunked else ("Content-Length", str(len(data)))))
        self.end_headers()
        if chunked:
            self.wfile.write(b"".join(b"%x\r\n%s\r\n" % (len(data[k:k + 4096]), data[k:k + 4096])
                                      for k in range(0, len(data), 4096)) + b"0\r\n\r\n")
        elif self.command != "HEAD":
            self.wfile.write(data)
        conn.close()

    do_GET = do_PUT = do_HEAD = do_DELETE = do_POST = _any


@pytest.fixture
def proxy(s3):
    srv = FaultProxy(s3.endpoint)
    yield srv
    srv.shutdown()
    srv.server_close()


def test_injected_409_is_retried_and_503_backs_off(s3, bucket, proxy, tmp_path, caplog):
    caplog.set_level(logging.WARNING, "hardy.cache")
    writer = cache_for(s3, bucket, tmp_path / "a", storage_options=s3.options(proxy.endpoint))
    p = Pipeline(nodes=[triple], cache=writer, engine=SEQ)
    proxy.inject[("PUT", "/team/")] = [(409, "ConditionalRequestConflict"), (409, "ConditionalRequestConflict")]
    p.run(inputs={"x": 5})
    assert proxy.injected == [("PUT", 409), ("PUT", 409)] and len(s3.keys(bucket)) == 1  # published on the 3rd try

    reader = cache_for(s3, bucket, tmp_path / "b", storage_options=s3.options(proxy.endpoint))
    proxy.inject[("GET", "/team/")] = [(503, "SlowDown"), (503, "SlowDown")]
    assert Pipeline(nodes=[triple], cache=reader, engine=SEQ).run(inputs={"x": 5})["y"] == 15
    assert reader.hits == 1 and proxy.injected[2:] == [("GET", 503), ("GET", 503)]  # backed off, then read
    assert not cache_warnings(caplog)


def test_throttling_that_does_not_stop_degrades_to_one_warning(s3, bucket, proxy, tmp_path, caplog):
    caplog.set_level(logging.WARNING, "hardy.cache")
    cache = cache_for(s3, bucket, tmp_path / "a", storage_options=s3.options(proxy.endpoint))
    proxy.inject[("GET", "/team/")] = [(503, "SlowDown")] * 1000
    proxy.inject[("PUT", "/team/")] = [(503, "SlowDown")] * 1000
    out = Pipeline(nodes=[triple], cache=cache, engine=SEQ).map(inputs={"x": list(range(20))}, map_over="x")
    assert [o["y"] for o in out] == [3 * x for x in range(20)]
    [warning] = cache_warnings(caplog)
    assert "SlowDown" in warning and "the local cache was used" in warning
    assert len(list(cache.store.local.entries())) == 20
    # 20 lookups and 20 publications, but the store was left alone after its first failure
    assert len(proxy.injected) < 40


def test_a_stalled_server_times_out_and_the_map_completes(s3, bucket, proxy, tmp_path, caplog):
    caplog.set_level(logging.WARNING, "hardy.cache")
    proxy.stall = 3.0
    opts = s3.options(proxy.endpoint, read_timeout=0.5, connect_timeout=0.5)
    cache = cache_for(s3, bucket, tmp_path / "a", storage_options=opts)
    out = Pipeline(nodes=[triple], cache=cache, engine=SEQ).map(inputs={"x": list(range(10))}, map_over="x")
    assert [o["y"] for o in out] == [3 * x for x in range(10)]
    [warning] = cache_warnings(caplog)
    assert "Timeout" in warning or "timeout" in warning


@pytest.mark.parametrize("fault", ["no credentials", "no bucket", "nobody listening"])
def test_a_misconfigured_store_runs_the_map_on_the_local_cache(s3, bucket, tmp_path, caplog, monkeypatch, fault):
    caplog.set_level(logging.WARNING, "hardy.cache")
    for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_PROFILE", "AWS_SESSION_TOKEN"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    opts = {"no credentials": {"endpoint_url": s3.endpoint},
            "no bucket": s3.options(),
            "nobody listening": s3.options(f"http://127.0.0.1:{_free_port()}")}[fault]
    name = "hardy-missing-bucket" if fault == "no bucket" else bucket
    cache = DiskCache(f"s3://{name}/team", storage_options=opts, local=tmp_path / "a", secret=SECRET)
    p = Pipeline(nodes=[triple], cache=cache, engine=SEQ)
    assert [o["y"] for o in p.map(inputs={"x": list(range(10))}, map_over="x")] == [3 * x for x in range(10)]
    [warning] = cache_warnings(caplog)
    assert f"s3://{name}/team" in warning and "the local cache was used" in warning
    assert [o["y"] for o in p.map(inputs={"x": list(range(10))}, map_over="x")] == [3 * x for x in range(10)]
    assert cache.hits == 10  # the local cache went on working


# --- a map reads ahead ------------------------------------------------------------------------------

def test_a_map_asks_the_bucket_once_per_entry_and_concurrently(s3, bucket, proxy, tmp_path):
    """A map reads ahead: the entries of the next items are fetched together, many requests in
    flight at once, and each lookup is answered from them. A cold map asks once per entry (the
    answer "absent" is not asked again before computing) and publishes each; another machine's
    first run then fetches each entry exactly once and verifies every one."""
    xs = list(range(300))
    writer = cache_for(s3, bucket, tmp_path / "a", storage_options=s3.options(proxy.endpoint))
    Pipeline(nodes=[triple], cache=writer, engine=SEQ).map(inputs={"x": xs}, map_over="x")
    gets = [path for method, path in proxy.seen if method == "GET"]
    puts = [path for method, path in proxy.seen if method == "PUT"]
    assert len(gets) == len(set(gets)) == 300 and sorted(puts) == sorted(gets)
    assert len(s3.keys(bucket)) == 300

    proxy.seen.clear()
    proxy.peak = 0
    reader = cache_for(s3, bucket, tmp_path / "b", storage_options=s3.options(proxy.endpoint))
    out = Pipeline(nodes=[triple], cache=reader, engine=SEQ).map(inputs={"x": xs}, map_over="x")
    assert [o["y"] for o in out] == [3 * x for x in xs]
    assert (reader.hits, reader.misses, reader.rejected) == (300, 0, 0)
    assert sorted(path for _, path in proxy.seen) == sorted(gets) and proxy.peak > 1
    assert not reader.store._ahead and not reader.store._absent  # every entry fetched was looked up

    proxy.seen.clear()  # the local cache now has them all: the bucket is not asked again
    again = cache_for(s3, bucket, tmp_path / "b", storage_options=s3.options(proxy.endpoint))
    Pipeline(nodes=[triple], cache=again, engine=SEQ).map(inputs={"x": xs}, map_over="x")
    assert again.hits == 300 and proxy.seen == []


def test_an_entry_read_ahead_is_verified_like_any_other(s3, bucket, tmp_path):
    xs = list(range(40))
    Pipeline(nodes=[triple], cache=cache_for(s3, bucket, tmp_path / "a"), engine=SEQ).map(inputs={"x": xs},
                                                                                        map_over="x")
    name = s3.keys(bucket)[7]
    good = s3.client.get_object(Bucket=bucket, Key=name)["Body"].read()
    s3.client.delete_object(Bucket=bucket, Key=name)
    s3.client.put_object(Bucket=bucket, Key=name, Body=good[:-1] + bytes([good[-1] ^ 1]))

    reader = cache_for(s3, bucket, tmp_path / "b")
    out = Pipeline(nodes=[triple], cache=reader, engine=SEQ).map(inputs={"x": xs}, map_over="x")
    assert [o["y"] for o in out] == [3 * x for x in xs]
    assert (reader.hits, reader.rejected) == (39, 1)
    assert s3.client.get_object(Bucket=bucket, Key=name)["Body"].read() == good  # deleted, recomputed, republished


def test_an_interrupted_map_publishes_every_result_it_computed(s3, bucket, tmp_path):
    """Ctrl-C in the middle of a cold map: the publications still in flight finish before the map
    raises, so another machine finds every result computed before the interruption."""
    @node(output_name="y")
    def interrupted_at_150(x: int) -> int:
        if x == 150:
            raise KeyboardInterrupt
        return 3 * x

    writer = cache_for(s3, bucket, tmp_path / "a")
    with pytest.raises(MapInterrupted):
        Pipeline(nodes=[interrupted_at_150], cache=writer, engine=SEQ).map(inputs={"x": list(range(300))},
                                                                          map_over="x")
    assert len(s3.keys(bucket)) == 150
    reader = cache_for(s3, bucket, tmp_path / "b")
    out = Pipeline(nodes=[interrupted_at_150], cache=reader, engine=SEQ).map(inputs={"x": list(range(150))},
                                                                            map_over="x")
    assert [o["y"] for o in out] == [3 * x for x in range(150)] and reader.hits == 150


# --- damaged entries -------------------------------------------------------------------------------

def test_a_tampered_object_is_never_unpickled_deleted_and_republished(s3, bucket, tmp_path, caplog):
    caplog.set_level(logging.WARNING, "hardy.cache")
    Pipeline(nodes=[triple], cache=cache_for(s3, bucket, tmp_path / "a"), engine=SEQ).run(inputs={"x": 4})
    [name] = s3.keys(bucket)
    good = s3.client.get_object(Bucket=bucket, Key=name)["Body"].read()
    import pickle
    evil = good[:28] + pickle.dumps(12345)  # a valid header, another body: the MAC no longer fits
    s3.client.delete_object(Bucket=bucket, Key=name)
    s3.client.put_object(Bucket=bucket, Key=name, Body=evil)

    reader = cache_for(s3, bucket, tmp_path / "b")
    assert Pipeline(nodes=[triple], cache=reader, engine=SEQ).run(inputs={"x": 4})["y"] == 12
    assert reader.rejected == 1 and reader.hits == 0
    assert s3.client.get_object(Bucket=bucket, Key=name)["Body"].read() == good  # recomputed and republished
    assert any("1 damaged entry deleted" in w for w in cache_warnings(caplog))


def test_an_object_bigger_than_half_the_memory_is_never_read(s3, bucket, tmp_path, caplog):
    """Whoever can write to the bucket could plant an object bigger than a reader's memory under an
    entry's name: read whole, it would grow the reader until the kernel killed it. A reader does
    not read an object over its limit (half the machine's memory; 10 kB here): the item is
    computed here, the object left alone (it may be a bigger machine's), a warning says so."""
    caplog.set_level(logging.WARNING, "hardy.cache")
    Pipeline(nodes=[triple], cache=cache_for(s3, bucket, tmp_path / "a"), engine=SEQ).run(inputs={"x": 5})
    [name] = s3.keys(bucket)
    planted = os.urandom(64 << 10)
    s3.client.delete_object(Bucket=bucket, Key=name)
    s3.client.put_object(Bucket=bucket, Key=name, Body=planted)

    reader = cache_for(s3, bucket, tmp_path / "b")
    assert reader.store.bucket.read_limit > 1 << 30  # (half this machine's memory)
    reader.store.bucket.read_limit = 10_000
    assert Pipeline(nodes=[triple], cache=reader, engine=SEQ).run(inputs={"x": 5})["y"] == 15
    assert reader.hits == 0 and reader.rejected == 0  # never read, so never judged
    assert s3.client.get_object(Bucket=bucket, Key=name)["Body"].read() == planted
    assert any("1 entry not read (bigger than 9.31e-06 GiB, half this machine's memory)" in w
               for w in cache_warnings(caplog)), cache_warnings(caplog)


def test_what_a_reader_holds_of_a_bucket_is_capped_as_it_arrives(s3, bucket, proxy):
    """Through a proxy that sends no Content-Length (chunked answers), an object over the limit is
    still not read whole: the cap counts the bytes as they come, and an entry under it reads as
    ever. A batch fetched ahead holds at most an eighth of the limit, between its objects: planted
    objects each just under the limit cannot add up (those left out are neither found nor
    absent: looked up alone when their item needs them). The limit is each process's own."""
    store = BucketStore(f"s3://{bucket}/team", "hardy-key-3/00", storage_options=s3.options(proxy.endpoint))
    store.read_limit = 80_000
    big, small = os.urandom(16), os.urandom(16)
    s3.client.put_object(Bucket=bucket, Key=store.path(big), Body=os.urandom(100_000))
    s3.client.put_object(Bucket=bucket, Key=store.path(small), Body=b"x" * 5000)
    proxy.chunked = True
    assert store.fetch(big) is None and store.fetch(small)[0] == b"x" * 5000
    assert store.settle() == ["1 entry not read (bigger than 7.45e-05 GiB, half this machine's memory) at "
                              f"s3://{bucket}/team; the local cache was used"]
    proxy.chunked = False
    keys = [os.urandom(16) for _ in range(20)]
    for key in keys:
        s3.client.put_object(Bucket=bucket, Key=store.path(key), Body=os.urandom(3000))
    found, absent = store.fetch_ahead(tuple(keys)).result()
    assert len(found) == 3 and sum(len(data) for data, _ in found.values()) == 9000 and not absent
    assert all(store.fetch(key) is not None for key in keys)
    import pickle

    from hardy.cache.s3 import half_the_memory
    assert pickle.loads(pickle.dumps(store)).read_limit == half_the_memory() > 1 << 28


def test_a_lease_longer_than_ours_is_taken_over_unread(s3, bucket, tmp_path):
    """A lease of ours is a short line: one padded past 4 kB is taken over as forged, without
    being read, even when what it holds is signed and alive (a writer could otherwise make every
    waiting reader load a huge one, again and again)."""
    store = cache_for(s3, bucket, tmp_path / "a", single_flight=True).store.bucket
    key = os.urandom(16)
    path, alive = store.lease_path(key), store._lease_body(key, "alive", 600)
    s3.client.put_object(Bucket=bucket, Key=path, Body=alive)
    assert store._run(store._expired(key, path, {})) == (None, False)  # signed and alive: waited on
    s3.client.put_object(Bucket=bucket, Key=path, Body=alive[:-1] + b', "pad": "' + b"x" * 8000 + b'"}')
    condition, forged = store._run(store._expired(key, path, {}))
    assert forged and "IfMatch" in condition


def test_a_conditional_delete_loses_to_a_republish(s3, bucket, tmp_path):
    """A reader found an object damaged; before it deletes it, another machine deleted the same
    damaged object and published a good one: the first reader's delete (If-Match on the ETag it
    read) must leave the good entry alone."""
    seed = cache_for(s3, bucket, tmp_path / "seed")
    seed.put(b"k" * 16, "good value")
    seed.report()
    [name] = s3.keys(bucket)
    good = s3.client.get_object(Bucket=bucket, Key=name)["Body"].read()
    s3.client.delete_object(Bucket=bucket, Key=name)
    s3.client.put_object(Bucket=bucket, Key=name, Body=good[:-1] + bytes([good[-1] ^ 1]))

    slow, fast = cache_for(s3, bucket, tmp_path / "slow"), cache_for(s3, bucket, tmp_path / "fast")
    entry = slow.store.view(b"k" * 16)  # slow reads the damaged object ...
    assert fast.get(b"k" * 16) is None and fast.rejected == 1  # ... fast finds it damaged too and deletes it,
    assert fast.put(b"k" * 16, "good value")  # publishes a good one,
    fast.report()
    assert slow._load(b"k" * 16, entry) is MISS and slow.rejected == 1  # ... then slow rejects its copy
    assert s3.client.get_object(Bucket=bucket, Key=name)["Body"].read() == good  # and the good one stayed
    assert cache_for(s3, bucket, tmp_path / "c").get(b"k" * 16) == "good value"


def test_delete_is_conditional_on_the_etag_read(s3, bucket):
    store = BucketStore(f"s3://{bucket}/p", "ns", s3.options())
    store.put(b"a" * 16, b"one")
    data, etag = store.fetch(b"a" * 16)
    assert data == b"one"
    store.put(b"a" * 16, b"two")  # create-only: someone else's publication of the same entry
    assert store.fetch(b"a" * 16)[0] == b"one"
    s3.client.delete_object(Bucket=bucket, Key=store.path(b"a" * 16))
    store.put(b"a" * 16, b"three")
    assert store.delete_if(b"a" * 16, etag) is False  # not the object that was read
    assert store.fetch(b"a" * 16)[0] == b"three"


# --- the server killed mid-map -----------------------------------------------------------------------

def test_server_killed_mid_map_completes_uncached(s3, tmp_path, caplog):
    caplog.set_level(logging.WARNING, "hardy.cache")
    proc, endpoint = start_moto()
    try:
        boto3.client("s3", endpoint_url=endpoint, aws_access_key_id="t", aws_secret_access_key="t",
                     region_name="us-east-1").create_bucket(Bucket="hardy-doomed")

        @node(output_name="y")
        def kill_at_ten(x: int, server: int) -> int:
            if x == 10:
                os.kill(server, signal.SIGKILL)
            return x + 1

        cache = DiskCache("s3://hardy-doomed/t", storage_options={"endpoint_url": endpoint, **CREDS},
                          local=tmp_path / "a", secret=SECRET)
        p = Pipeline(nodes=[kill_at_ten], cache=cache, engine=SEQ)
        out = p.map(inputs={"x": list(range(30)), "server": proc.pid}, map_over="x")
        assert [o["y"] for o in out] == [x + 1 for x in range(30)]
        [warning] = cache_warnings(caplog)
        assert "s3://hardy-doomed/t" in warning
        assert len(list(cache.store.local.entries())) == 30  # every result kept locally
    finally:
        stop(proc)


# --- a Dask cluster sharing the bucket ---------------------------------------------------------------

def test_dask_workers_share_the_bucket_second_run_all_hits(s3, bucket, tmp_path):
    pytest.importorskip("distributed")
    from hardy.integrations.dask import DaskExecutor
    calls = tmp_path / "calls"

    @node(output_name="sq")
    def square(x: int, log: str) -> int:
        with open(log, "a") as f:
            f.write(f"{os.getpid()}\n")
        return x * x

    inputs = {"x": list(range(40)), "log": str(calls)}
    with Engine(map_executor=DaskExecutor(workers=2)) as engine:
        cold = Pipeline(nodes=[square], cache=cache_for(s3, bucket, tmp_path / "first"), engine=engine)
        assert [o["sq"] for o in cold.map(inputs=inputs, map_over="x")] == [x * x for x in range(40)]
        assert len(calls.read_text().split()) == 40
        assert len(s3.keys(bucket)) == 40
        warm = Pipeline(nodes=[square], cache=cache_for(s3, bucket, tmp_path / "second"), engine=engine)
        assert [o["sq"] for o in warm.map(inputs=inputs, map_over="x")] == [x * x for x in range(40)]
    assert len(calls.read_text().split()) == 40  # the second run computed nothing: all hits from the bucket
    assert len(list((tmp_path / "second").glob("index.sqlite"))) == 1  # read through into the new local cache


# --- single flight across machines ------------------------------------------------------------------

FLIGHT = """
import os, sys, time
from hardy import DiskCache, Pipeline, Engine, node
bucket, endpoint, folder, log, start = sys.argv[1:6]

@node(output_name="y")
def slow(x: int, log: str) -> int:
    with open(log, "a") as f:
        f.write(f"{os.getpid()}\\n")
    time.sleep(2)
    return x * 10

cache = DiskCache(f"s3://{bucket}/lease", storage_options={"endpoint_url": endpoint, "key": "testing",
                  "secret": "testing"}, local=folder, secret="team-secret", single_flight=True)
while time.time() < float(start):
    time.sleep(0.001)
print(Pipeline(nodes=[slow], cache=cache, engine=Engine(map_executor="sequential")).run(inputs={"x": 7, "log": log})["y"])
"""


def test_single_flight_lease_one_machine_computes(s3, bucket, tmp_path):
    log, start = tmp_path / "calls", str(time.time() + 4)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    procs = [subprocess.Popen([sys.executable, "-", bucket, s3.endpoint, str(tmp_path / f"m{i}"), str(log), start],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
             for i in range(3)]
    outs = [p.communicate(FLIGHT.encode(), timeout=180) for p in procs]
    assert [o.decode().strip() for o, _ in outs] == ["70"] * 3, [e.decode()[-2000:] for _, e in outs]
    assert len(log.read_text().split()) == 1  # one computed, two waited for its entry
    assert not [k for k in s3.keys(bucket) if "/leases/" in k]  # released


def test_an_expired_lease_is_taken_over(s3, bucket):
    store = BucketStore(f"s3://{bucket}/p", "ns", s3.options())
    store.lease_key = os.urandom(32)  # what DiskCache derives from the secret: leases are signed
    key = b"z" * 16
    s3.client.put_object(Bucket=bucket, Key=store.lease_path(key), Body=store._lease_body(key, "dead", 1))
    with store.lease(key, ttl=5):  # never renewed: the waiter sees its nonce for its ttl (1 s), then takes it
        held = json.loads(s3.client.get_object(Bucket=bucket, Key=store.lease_path(key))["Body"].read())
        assert held["holder"] != "dead"
    assert store.lease_path(key) not in s3.keys(bucket)


# --- hardy cache ... --remote --------------------------------------------------------------------------

def test_cli_remote_stats_ls_verify_prune(s3, bucket, tmp_path):
    cache = cache_for(s3, bucket, tmp_path / "a")
    Pipeline(nodes=[triple], cache=cache, engine=SEQ).map(inputs={"x": list(range(6))}, map_over="x")
    names = s3.keys(bucket)
    good = s3.client.get_object(Bucket=bucket, Key=names[0])["Body"].read()
    s3.client.delete_object(Bucket=bucket, Key=names[0])
    s3.client.put_object(Bucket=bucket, Key=names[0], Body=good[:-1] + bytes([good[-1] ^ 1]))
    env = {**os.environ, "HARDY_CACHE_KEY": SECRET, "AWS_ACCESS_KEY_ID": "testing", "COLUMNS": "200",
           "AWS_SECRET_ACCESS_KEY": "testing", "PYTHONPATH": os.pathsep.join(sys.path)}
    remote = ["--remote", f"s3://{bucket}/team", "--endpoint-url", s3.endpoint]

    def hardy(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "hardy.cli", "cache", *args, *remote], env=env,
                              capture_output=True, text=True, timeout=120, cwd=tmp_path)

    stats = json.loads(hardy("stats", "--json").stdout)
    assert stats["entries"] == 6
    listed = hardy("ls")
    assert names[1].rsplit("/", 1)[1] in listed.stdout
    verified = hardy("verify")
    assert verified.returncode == 1 and "checked 6 entries, 1 bad" in verified.stdout
    assert len(s3.keys(bucket)) == 5
    assert "deleted 0 entries" in hardy("prune", "--older-than", "1").stdout
    assert "deleted 5 entries" in hardy("prune", "--older-than", "0").stdout
    assert s3.keys(bucket) == []
    assert not (tmp_path / ".hardy-cache").exists()  # maintaining the bucket creates no local cache
