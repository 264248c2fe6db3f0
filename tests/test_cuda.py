"""CUDA in the parent, CUDA nodes in workers (seed 003) and in a Daft GPU stage; GPU worker slots,
sticky CUDA errors, GPU out-of-memory and a mixed CPU/GPU plan. Needs an NVIDIA GPU and a CUDA build
of torch; skipped elsewhere (CI has neither: tests/test_gpus.py runs the same logic there). Each
scenario runs in a fresh interpreter, so this test process never touches CUDA."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap

import pytest

SCRIPT = """
import sys
import torch
if not torch.cuda.is_available():          # the probe seed 003's users all write first
    sys.exit(77)
from hardy import Engine, Failed, Pipeline, node
from hardy.errors import HazardError
from hardy.safety import fork_hazards

probed = [h.summary for h in fork_hazards() if h.kind == "cuda"]
assert probed and "probed" in probed[0], probed
print("probe: detected")

torch.ones(1, device="cuda").sum().item()   # CUDA is now initialised here
assert any("initialised" in h.summary for h in fork_hazards() if h.kind == "cuda")

@node(output_name="total")
def gpu_sum(n):
    return int(torch.arange(n, device="cuda", dtype=torch.int64).sum().item())

sizes = [10, 1000, 100_000, 1_000_000]
with Engine(map_executor="process", workers=2, preload=["torch"]) as e:
    out = Pipeline(nodes=[gpu_sum], engine=e).map(inputs={"n": sizes}, map_over="n")
assert [o["total"] for o in out] == [n * (n - 1) // 2 for n in sizes], out
print("forkserver: ok")

try:
    Engine(map_executor="process", start_method="fork").process_pool()
    raise AssertionError("fork was not refused")
except HazardError as exc:
    assert "cuda" in str(exc) and "forked subprocess" in str(exc), exc
    print("fork: refused")

# Forcing a bare fork shows what hardy saves users from: every item fails in the child, each
# reported as that item's error naming the node, and the parent lives on.
import warnings
warnings.simplefilter("ignore")
with Engine(map_executor="process", workers=1, start_method="fork!") as e:
    out = Pipeline(nodes=[gpu_sum], engine=e).map(inputs={"n": [10, 20]}, map_over="n", on_error="continue")
assert all(isinstance(o, Failed) for o in out), out
message = str(out[0].error)
assert "gpu_sum" in message and "CUDA" in message, message
print("fork!: items failed:", message.splitlines()[0])
"""


DAFT_GPU_STAGE = """
import os, sys
import torch
if not torch.cuda.is_available():
    sys.exit(77)
from hardy import Pipeline, node
from hardy.integrations.daft import daft_engine

torch.ones(1, device="cuda")  # CUDA initialised in the driver, as in seed 003

@node(output_name="ids")
def tokenize(text):
    return [float(ord(c)) for c in text]

@node(output_name="norm")
def embed(ids):
    t = torch.tensor(ids, device="cuda")
    return round(float(t.norm().item()), 3), torch.cuda.get_device_name(0), os.getpid()

texts = ["hardy", "survives", "native", "code"] * 8
engine = daft_engine(node_resources={"embed": {"gpus": 1}})  # tokenize in CPU workers, embed in a GPU one
out = Pipeline(nodes=[tokenize, embed], engine=engine).map(inputs={"text": texts}, map_over="text")
norms = [o["norm"][0] for o in out]
assert norms == [round(sum(ord(c) ** 2 for c in t) ** 0.5, 3) for t in texts], norms
assert {o["norm"][2] for o in out}.isdisjoint({os.getpid()})
print("daft gpu stage: ok on", out[0]["norm"][1])
"""


GPU_WORKERS = """
import os, sys, time
import torch
if not torch.cuda.is_available():
    sys.exit(77)
from hardy import Engine, Failed, Pipeline, node
from hardy.errors import CudaError, GpuOutOfMemory

@node(output_name="picked", gpus=1)
def gather(i):
    table = torch.arange(10, device="cuda")
    index = torch.tensor([100 if i == 7 else i % 10], device="cuda")  # item 7: out of range on the GPU
    return int(torch.index_select(table, 0, index).item()), os.environ["CUDA_VISIBLE_DEVICES"], os.getpid()

with Engine(map_executor="process", gpus=[0], workers_per_gpu=2) as e:
    p = Pipeline(nodes=[gather], engine=e)
    p.map(inputs={"i": [0, 1]}, map_over="i")  # workers started and CUDA initialised
    before = set(e.gpu_pool().pids())
    out = p.map(inputs={"i": list(range(20))}, map_over="i", on_error="continue")
    err = out[7].error
    assert isinstance(err, CudaError) and err.sticky and "device-side assert" in str(err), err
    assert "index_select" in err.stack, err.stack
    assert [o["picked"][0] for k, o in enumerate(out) if k != 7] == [k % 10 for k in range(20) if k != 7], out
    assert {o["picked"][1] for k, o in enumerate(out) if k != 7} == {"0"}
    assert e.gpu_pool().replaced == 1 and set(e.gpu_pool().pids()) != before
    print("sticky: item 7 CudaError, 19 correct, worker replaced:", str(err).splitlines()[0][:100])

@node(output_name="big", gpus=1)
def hoard(n):
    free, total = torch.cuda.mem_get_info()
    return torch.empty(int(free * 2), dtype=torch.uint8, device="cuda").numel()

with Engine(map_executor="process", gpus=[0]) as e:
    out = Pipeline(nodes=[hoard], engine=e).map(inputs={"n": [1]}, map_over="n", on_error="continue")
    assert isinstance(out[0].error, GpuOutOfMemory), out
    print("oom: GpuOutOfMemory:", str(out[0].error).splitlines()[0][:100])

@node(output_name="ids")
def tokenize(text):
    return [float(ord(c)) for c in text], os.environ.get("CUDA_VISIBLE_DEVICES"), torch.cuda.is_available()

@node(output_name="norm", gpus=1)
def embed(ids):
    return round(float(torch.tensor(ids[0], device="cuda").norm().item()), 3), os.environ["CUDA_VISIBLE_DEVICES"]

@node(output_name="label")
def label(norm):
    return "long" if norm[0] > 500 else "short"

texts = ["hardy", "survives", "native", "code"] * 8
with Engine(map_executor="process", workers=2, gpus="all") as e:
    out = Pipeline(nodes=[tokenize, embed, label], engine=e).map(inputs={"text": texts}, map_over="text")
norms = [round(sum(ord(c) ** 2 for c in t) ** 0.5, 3) for t in texts]
assert [o["norm"][0] for o in out] == norms
assert [o["label"] for o in out] == ["long" if n > 500 else "short" for n in norms]
assert {o["ids"][1:] for o in out} == {("", False)}   # CPU workers see no GPU
print("mixed: ok, GPU workers saw", sorted({o["norm"][1] for o in out}))
"""


def run_cuda_script(script: str) -> str:
    if not (os.path.exists("/dev/nvidia0") or os.path.exists("/dev/nvidiactl")):
        pytest.skip("no NVIDIA GPU on this machine")
    if importlib.util.find_spec("torch") is None:
        pytest.skip("torch is not installed")
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(script)], capture_output=True, text=True,
                          timeout=240)
    if proc.returncode == 77:
        pytest.skip("torch here has no CUDA (a CPU build, or no driver)")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    print(proc.stdout)
    return proc.stdout


def test_cuda_parent_and_cuda_nodes_in_workers():
    out = run_cuda_script(SCRIPT).splitlines()
    assert out[:3] == ["probe: detected", "forkserver: ok", "fork: refused"]
    assert out[3].startswith("fork!: items failed:")


def test_daft_gpu_stage_beside_cpu_stage():
    if importlib.util.find_spec("daft") is None:
        pytest.skip("daft is not installed")
    assert run_cuda_script(DAFT_GPU_STAGE).splitlines()[-1].startswith("daft gpu stage: ok on NVIDIA")


def test_gpu_workers_sticky_error_out_of_memory_and_mixed_plan():
    out = run_cuda_script(GPU_WORKERS).splitlines()
    assert out[0].startswith("sticky: item 7 CudaError") and out[1].startswith("oom: GpuOutOfMemory")
    assert out[2].startswith("mixed: ok")
