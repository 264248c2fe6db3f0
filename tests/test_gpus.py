"""GPU-aware workers without a GPU: slots and CUDA_VISIBLE_DEVICES per worker (declared with
HARDY_ASSUME_GPUS, read back inside real worker processes), the CPU/GPU stage cut, CUDA error
classification on the texts torch, cupy, numba and jax really print, sticky errors retiring the
worker, out-of-memory retried on a fresh worker, and the doctor's "no GPU" output. The same
scenarios on a real GPU are in tests/test_cuda.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from hardy import DiskCache, Engine, Failed, MapError, Pipeline, node
from hardy.doctor import runs_on
from hardy.engine.in_process import SequentialExecutor
from hardy.engine.results import Results
from hardy.errors import CudaError, GpuOutOfMemory, InvalidArgument, NodeDefinitionError, NoGpuError
from hardy.observe.watch import Watch
from hardy.parts.stages import StagedExecutor, cut
from hardy.plan.compiled import Plan
from hardy.safety.gpus import cuda_failure, gpu_slots, parse_smi
from hardy.workers.pool import WorkerPool

# Messages as torch, cupy, numba and jax print them (from their issue trackers), and what they are.
REAL_TEXTS = [
    ("RuntimeError", "CUDA error: device-side assert triggered\nCUDA kernel errors might be asynchronously reported "
     "at some other API call, so the stacktrace below might be incorrect.\nFor debugging consider passing "
     "CUDA_LAUNCH_BLOCKING=1.\nCompile with `TORCH_USE_CUDA_DSA` to enable device-side assertions.", "sticky"),
    ("RuntimeError", "CUDA error: an illegal memory access was encountered", "sticky"),
    ("RuntimeError", "CUDA error: unspecified launch failure", "sticky"),
    ("RuntimeError", "CUDA error: uncorrectable ECC error encountered", "sticky"),
    ("CUDARuntimeError", "cudaErrorIllegalAddress: an illegal memory access was encountered", "sticky"),
    ("CUDADriverError", "CUDA_ERROR_ILLEGAL_ADDRESS: an illegal memory access was encountered", "sticky"),
    ("CudaAPIError", "[700] Call to cuMemcpyDtoH results in CUDA_ERROR_ILLEGAL_ADDRESS", "sticky"),
    ("CudaAPIError", "[719] Call to cuCtxSynchronize results in CUDA_ERROR_LAUNCH_FAILED", "sticky"),
    ("OutOfMemoryError", "CUDA out of memory. Tried to allocate 1.70 GiB. GPU 0 has a total capacty of 6.00 GiB of "
     "which 0 bytes is free. Of the allocated memory 2.93 GiB is allocated by PyTorch", "oom"),
    ("RuntimeError", "CUDA out of memory. Tried to allocate 12.50 MiB (GPU 0; 10.92 GiB total capacity; 8.57 MiB "
     "already allocated; 9.28 GiB free; 4.68 MiB cached)", "oom"),
    ("RuntimeError", "CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`", "oom"),
    ("OutOfMemoryError", "Out of memory allocating 25,600,000 bytes (allocated so far: 3,635,267,072 bytes).", "oom"),
    ("CUDARuntimeError", "cudaErrorMemoryAllocation: out of memory", "oom"),
    ("XlaRuntimeError", "RESOURCE_EXHAUSTED: Out of memory while trying to allocate 17179869184 bytes.", "oom"),
    ("RuntimeError", "CUDA error: no kernel image is available for execution on the device", "cuda"),
    ("RuntimeError", "CUDA error: invalid device ordinal", "cuda"),
    ("RuntimeError", "Cannot re-initialize CUDA in forked subprocess. To use CUDA with multiprocessing, you must "
     "use the 'spawn' start method", None),
    ("ValueError", "index 7 is out of bounds for axis 0 with size 3", None),
    ("MemoryError", "Unable to allocate 8.00 GiB for an array with shape (1073741824,)", None),
]


@pytest.mark.parametrize("kind,text,expected", REAL_TEXTS)
def test_cuda_error_texts_are_classified(kind, text, expected):
    exc = type(kind, (Exception,), {})(text)
    assert cuda_failure(exc) == expected


@pytest.mark.slow  # torch imported
def test_torch_out_of_memory_type_is_oom_and_a_wrapped_cause_is_read():
    torch = pytest.importorskip("torch")
    assert cuda_failure(torch.OutOfMemoryError("nothing said")) == "oom"
    try:
        try:
            raise RuntimeError("CUDA error: device-side assert triggered")
        except RuntimeError as inner:
            raise ValueError("the model failed") from inner
    except ValueError as outer:
        assert cuda_failure(outer) == "sticky"


STICKY = "CUDA error: device-side assert triggered\nCUDA kernel errors might be asynchronously reported"
_poisoned: list[bool] = []  # per process, as a CUDA context is


@node(output_name="y")
def gather(x: int) -> int:
    """Behaves like a CUDA gather with an out-of-range index on item 3: after the assert, every
    later call in the same process fails too (CUDA's sticky errors)."""
    if x == 3 or _poisoned:
        _poisoned.append(True)
        raise RuntimeError(STICKY)
    return x * 10


def test_sticky_error_in_process_is_a_cuda_error_with_the_node_stack():
    _poisoned.clear()
    out = Pipeline(nodes=[gather]).map(inputs={"x": [1, 3]}, map_over="x", on_error="continue")
    err = out[1].error
    assert isinstance(err, CudaError) and err.sticky and not isinstance(err, GpuOutOfMemory)
    assert err.node == "gather" and err.item == 1
    assert "device-side assert triggered" in str(err) and "sticky CUDA error" in str(err)
    assert "in gather" in err.stack and "raise RuntimeError(STICKY)" in err.stack
    _poisoned.clear()


def test_sticky_error_retires_the_worker_before_its_next_item():
    with Engine(map_executor="process", workers=2) as engine:
        out = Pipeline(nodes=[gather], engine=engine).map(inputs={"x": list(range(20))}, map_over="x",
                                                          on_error="continue")
        pool = engine.process_pool()
        assert [o["y"] for i, o in enumerate(out) if i != 3] == [x * 10 for x in range(20) if x != 3]
        err = out[3].error
        assert isinstance(err, CudaError) and err.sticky and err.item == 3 and "gather" in str(err)
        assert "in gather" in err.stack
        assert pool.replaced == 1
        again = Pipeline(nodes=[gather], engine=engine).map(inputs={"x": [1, 2]}, map_over="x")
        assert [o["y"] for o in again] == [10, 20]


@node(output_name="where")
def allocate(x: int, marker: str) -> int:
    """Runs out of GPU memory on item 5 in the first process that tries it, as a worker holding a
    fragmented cache would; a fresh process has the memory."""
    if x == 5 and not os.path.exists(marker):
        with open(marker, "w") as f:
            f.write(str(os.getpid()))
        raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.15 GiB "
                           "of which 1.50 GiB is free.")
    return os.getpid()


retried_allocate = node(allocate.func, output_name="where", name="allocate", retries=1)


def test_out_of_memory_is_retried_on_a_fresh_worker(tmp_path):
    marker = str(tmp_path / "oom-pid")
    with Engine(map_executor="process", workers=2) as engine:
        out = Pipeline(nodes=[retried_allocate], engine=engine).map(
            inputs={"x": list(range(10)), "marker": marker}, map_over="x")
    assert all(not isinstance(o, Failed) for o in out)
    with open(marker) as f:
        assert out[5]["where"] != int(f.read())  # the retry ran in another process


def test_out_of_memory_without_retries_fails_the_item(tmp_path):
    with Engine(map_executor="process", workers=2) as engine:
        out = Pipeline(nodes=[allocate], engine=engine).map(
            inputs={"x": list(range(10)), "marker": str(tmp_path / "m")}, map_over="x", on_error="continue")
    err = out[5].error
    assert isinstance(err, GpuOutOfMemory) and err.node == "allocate" and err.item == 5
    assert "CUDA out of memory" in str(err)
    assert sum(isinstance(o, Failed) for o in out) == 1


# --- slots -------------------------------------------------------------------------------------------


@node(output_name="features")
def prepare(x: int) -> tuple:
    return x, os.environ.get("CUDA_VISIBLE_DEVICES"), os.getpid()


@node(output_name="embedding", gpus=1)
def embed(features: tuple) -> tuple:
    return features[0] * 2, os.environ.get("CUDA_VISIBLE_DEVICES"), os.getpid()


@node(output_name="score")
def score(embedding: tuple, features: tuple) -> tuple:
    return embedding[0] + features[0], os.environ.get("CUDA_VISIBLE_DEVICES"), os.getpid()


MIXED = [prepare, embed, score]


def test_no_gpu_gives_a_clear_error_and_gpus_0_runs_on_cpu(monkeypatch):
    monkeypatch.delenv("HARDY_ASSUME_GPUS", raising=False)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    for gpus in ("all", 1, [0]):
        with pytest.raises(NoGpuError, match=r"no NVIDIA GPU was found \(NVML: .*\).*gpus=0"):
            Engine(map_executor="process", gpus=gpus)
    with Engine(map_executor="process", workers=2, gpus=0) as engine:
        out = Pipeline(nodes=MIXED, engine=engine).map(inputs={"x": [1, 2, 3]}, map_over="x")
    assert [o["score"][0] for o in out] == [3, 6, 9]
    assert engine.gpu_slots == []


def test_slots_from_counts_indices_and_visible_devices(monkeypatch):
    monkeypatch.setenv("HARDY_ASSUME_GPUS", "2")
    assert gpu_slots("all") == ["0", "1"]
    assert gpu_slots("all", workers_per_gpu=2) == ["0", "0", "1", "1"]
    assert gpu_slots(1) == ["0"]
    assert gpu_slots([1]) == ["1"]
    assert gpu_slots(0) == [] and gpu_slots(None) == []
    with pytest.raises(NoGpuError, match=r"sees 2 GPU\(s\)"):
        gpu_slots(3)
    with pytest.raises(NoGpuError, match=r"sees 2 GPU\(s\)"):
        gpu_slots([2])
    with pytest.raises(InvalidArgument, match="workers_per_gpu"):
        gpu_slots("all", workers_per_gpu=0)
    with pytest.raises(InvalidArgument, match="'all', a number of GPUs"):
        gpu_slots("some")
    monkeypatch.delenv("HARDY_ASSUME_GPUS")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")  # indices count among the devices this process may use
    assert gpu_slots([1]) == ["5"] and gpu_slots("all") == ["3", "5"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    with pytest.raises(NoGpuError, match="hides every GPU"):
        gpu_slots("all")


def test_mixed_plan_runs_gpu_nodes_on_gpu_workers_and_cpu_nodes_elsewhere(monkeypatch):
    monkeypatch.setenv("HARDY_ASSUME_GPUS", "2")
    items = list(range(40))
    with Engine(map_executor="process", workers=2, gpus="all", workers_per_gpu=1) as engine:
        out = Pipeline(nodes=MIXED, engine=engine).map(inputs={"x": items}, map_over="x")
        gpu_pids = set(engine.gpu_pool().pids())
    assert [o["score"][0] for o in out] == [3 * x for x in items]
    assert {o["embedding"][1] for o in out} == {"0", "1"}  # both GPUs used, each worker its own
    by_pid = {}
    for o in out:
        by_pid.setdefault(o["embedding"][2], set()).add(o["embedding"][1])
    assert all(len(devices) == 1 for devices in by_pid.values()) and set(by_pid) == gpu_pids
    cpu = [o[name] for o in out for name in ("features", "score")]
    assert {c[1] for c in cpu} == {""}  # CPU workers see no GPU
    assert not {c[2] for c in cpu} & gpu_pids


def test_stage_failures_raise_and_continue_and_isolated_gpu_nodes(monkeypatch):
    monkeypatch.setenv("HARDY_ASSUME_GPUS", "1")

    @node(output_name="embedding", gpus=0.5)
    def picky(features: tuple) -> tuple:
        if features[0] == 2:
            raise ValueError("no embedding for 2")
        return features[0] * 2, os.environ.get("CUDA_VISIBLE_DEVICES"), os.getpid()

    with Engine(map_executor="process", workers=1, gpus=1, workers_per_gpu=2) as engine:
        pipeline = Pipeline(nodes=[prepare, picky, score], engine=engine)
        out = pipeline.map(inputs={"x": [1, 2, 3]}, map_over="x", on_error="continue")
        assert out[0]["score"][0] == 3 and out[2]["score"][0] == 9
        assert isinstance(out[1], Failed) and out[1].error.node == "picky" and out[1].error.item == 1
        with pytest.raises(MapError) as info:
            pipeline.map(inputs={"x": [1, 2, 3]}, map_over="x")
        assert info.value.failures[1].node == "picky"
        isolated = node(embed.func, output_name="embedding", name="embed", gpus=1, isolate=True)
        single = Pipeline(nodes=[prepare, isolated], engine=engine).run(inputs={"x": 4})
        assert single["embedding"][:2] == (8, "0")


def test_an_interrupted_staged_map_ends_as_a_map_interrupted_on_one_pool_does(tmp_path):
    """Ctrl-C while the GPU stage runs: the stage's view of the map's results is told to stop (it
    passes that on to the map's), and the script exits 130 with what it held, as for one pool."""
    script = """
        import os, signal, time
        from hardy import Engine, Pipeline, node

        @node(output_name="features")
        def prepare(x):
            return x

        @node(output_name="embedding", gpus=1)
        def embed(features):
            if features == 3:
                os.kill(int(os.environ["SCRIPT"]), signal.SIGINT)  # Ctrl-C, as the terminal sends it
                time.sleep(60)
            return features * 2

        os.environ["SCRIPT"] = str(os.getpid())  # workers see the script's environment
        engine = Engine(map_executor="process", workers=1, gpus=1)
        Pipeline([prepare, embed], engine=engine).map(inputs={"x": range(6)}, map_over="x")
    """
    out = subprocess.run([sys.executable, "-"], input=textwrap.dedent(script), cwd=tmp_path, capture_output=True,
                         text=True, timeout=180, env={**os.environ, "HARDY_ASSUME_GPUS": "1"})
    assert out.returncode == 130, out.stderr
    assert "MapInterrupted: map interrupted" in out.stderr and "AttributeError" not in out.stderr, out.stderr


def test_an_in_process_executor_refuses_one_stage_of_a_map():
    """Items run here go through the map's own results (numbered and observed as the map's); one
    stage's view of them only ever meets worker pools, and an in-process executor says so."""
    staged = StagedExecutor(lambda n: n.gpus > 0, lambda gpu: SequentialExecutor(), enforces_timeouts=False)
    plan = Plan(Pipeline(nodes=MIXED).graph, ["x"], ["score"])
    results = Results(1, "continue", Watch.quiet(1, "map"))
    with pytest.raises(TypeError, match="_StageResults is not a map's Results: an in-process executor runs whole"):
        staged.run_items(plan, [{"x": 1}], results)
    pool = WorkerPool(workers=1)  # where stages do run
    staged.executor_for = lambda gpu: pool
    try:
        staged.run_items(plan, [{"x": 1}], results)
    finally:
        pool.close()
    assert results.values[0]["score"][0] == 3


def test_a_node_asking_for_two_gpus_is_refused_in_the_local_pool(monkeypatch):
    monkeypatch.setenv("HARDY_ASSUME_GPUS", "2")
    with pytest.raises(NodeDefinitionError, match="gpus=-1 is not valid"):
        node(embed.func, output_name="embedding", gpus=-1)
    big = node(embed.func, output_name="embedding", name="big", gpus=2)
    with Engine(map_executor="process", workers=1, gpus="all") as engine, \
            pytest.raises(NodeDefinitionError, match="gpus=2.*one GPU"):
        Pipeline(nodes=[prepare, big], engine=engine).map(inputs={"x": [1]}, map_over="x")


@node(output_name="features")
def prepare_here(x: int) -> tuple:
    return x, os.getpid()


@node(output_name="embedding", gpus=1)
def embed_here(features: tuple) -> tuple:
    return features[0] * 2, os.getpid()


@node(output_name="score")
def score_here(embedding: tuple, features: tuple) -> tuple:
    return embedding[0] + features[0], os.getpid()


def test_the_cut_keeps_cache_keys_of_the_whole_plan(tmp_path, monkeypatch):
    """(Nodes that do not read CUDA_VISIBLE_DEVICES, which MIXED's return: a value read from the
    environment is in a node's key, and a GPU worker's differs from this process's.)"""
    monkeypatch.setenv("HARDY_ASSUME_GPUS", "1")
    nodes = [prepare_here, embed_here, score_here]
    stages = cut(Plan(Pipeline(nodes=nodes).graph, ["x"], ["score"]), lambda n: n.gpus > 0)
    assert [(wanted, stage.outputs) for wanted, stage in stages] == [
        (False, ("features",)), (True, ("embedding",)), (False, ("score",))]
    cache = DiskCache(str(tmp_path / "cache"))
    with Engine(map_executor="process", workers=1, gpus=1) as engine:
        staged = Pipeline(nodes=nodes, engine=engine, cache=cache).map(inputs={"x": [1, 2]}, map_over="x")
    cached = Pipeline(nodes=nodes, cache=cache).map(inputs={"x": [1, 2]}, map_over="x")
    assert cached == staged  # every value (pids included) came from the cache the staged map wrote


# --- the doctor --------------------------------------------------------------------------------------


def _doctor(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hardy.cli", "doctor", *args], capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, timeout=120)


def test_doctor_says_no_gpu_here(monkeypatch):
    if os.path.exists("/dev/nvidiactl"):
        pytest.skip("this machine has an NVIDIA GPU")
    env = {k: v for k, v in os.environ.items() if k != "HARDY_ASSUME_GPUS"}
    report = json.loads(subprocess.run([sys.executable, "-m", "hardy.cli", "doctor", "--json"], capture_output=True,
                                       text=True, env=env, timeout=120).stdout)
    gpu = report["gpu"]
    assert gpu["source"] == "none" and gpu["gpus"] == []
    assert gpu["cuda_in_this_process"].startswith("untouched")
    finding = [f for f in report["findings"] if f["topic"] == "gpu"]
    assert finding[0]["severity"] == "ok" and finding[0]["message"].startswith("no NVIDIA GPU: NVML: ")
    text = subprocess.run([sys.executable, "-m", "hardy.cli", "doctor"], capture_output=True, text=True, env=env,
                          timeout=120).stdout
    assert "no NVIDIA GPU" in text and "CUDA_VISIBLE_DEVICES" in text


def test_doctor_flags_assumed_gpus():
    report = json.loads(_doctor("--json", env={"HARDY_ASSUME_GPUS": "2"}).stdout)
    assert len(report["gpu"]["gpus"]) == 2 and report["gpu"]["source"] == "HARDY_ASSUME_GPUS"
    assert any(f["severity"] == "warning" and "HARDY_ASSUME_GPUS=2" in f["message"] for f in report["findings"])


def test_nvidia_smi_output_and_architectures():
    csv = ("0, NVIDIA H200, GPU-6f1a3c1e-0d2b-4c55-9a61-8d3b2f0e7a11, 143771, 142850, 9.0, 570.133.20\n"
           "1, NVIDIA H200, GPU-0b7e2d44-51aa-4f0c-8e3d-2c9d1e6f5a20, 143771, 143000, 9.0, 570.133.20\n")
    banner = "| NVIDIA-SMI 570.133.20     Driver Version: 570.133.20     CUDA Version: 12.8     |"
    inv = parse_smi(csv, banner)
    assert [g.name for g in inv.gpus] == ["NVIDIA H200"] * 2 and inv.gpus[1].index == 1
    assert inv.driver == "570.133.20" and inv.cuda_driver == "12.8"
    assert inv.gpus[0].memory_total == 143771 * 2**20 and inv.gpus[0].compute_capability == "9.0"
    arches = ["sm_50", "sm_60", "sm_70", "sm_75", "sm_80", "sm_86", "sm_90"]
    assert runs_on("9.0", arches) and runs_on("8.9", arches)  # an sm_86 cubin runs on 8.9
    assert not runs_on("12.0", arches) and runs_on("12.0", [*arches, "compute_90"])  # PTX JIT
    assert not runs_on("3.7", arches)


def test_node_events_of_every_stage_reach_the_callbacks_in_order(monkeypatch):
    """Node events logged in each stage's workers are replayed once the item leaves its last stage."""
    from hardy import PipelineCallback

    class Nodes(PipelineCallback):
        def __init__(self) -> None:
            self.ends: dict[int, list[str]] = {}

        def on_node_end(self, node_id, outputs, duration, ctx):
            self.ends.setdefault(ctx.get("hardy.item"), []).append(node_id)

    monkeypatch.setenv("HARDY_ASSUME_GPUS", "1")
    seen = Nodes()
    with Engine(map_executor="process", workers=1, gpus="all") as engine:
        Pipeline(nodes=MIXED, engine=engine, callbacks=[seen]).map(inputs={"x": [1, 2, 3]}, map_over="x")
    assert seen.ends == {i: ["prepare", "embed", "score"] for i in range(3)}
