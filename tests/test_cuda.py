"""CUDA in the parent, CUDA nodes in workers (seed 003) and in a Daft GPU stage. Needs an NVIDIA GPU
and a CUDA build of torch; skipped elsewhere (CI has neither). Each scenario runs in a fresh
interpreter, so this test process never touches CUDA."""

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
from hardy.integrations.daft import DaftEngine

torch.ones(1, device="cuda")  # CUDA initialised in the driver, as in seed 003

@node(output_name="ids")
def tokenize(text):
    return [float(ord(c)) for c in text]

@node(output_name="norm")
def embed(ids):
    t = torch.tensor(ids, device="cuda")
    return round(float(t.norm().item()), 3), torch.cuda.get_device_name(0), os.getpid()

texts = ["hardy", "survives", "native", "code"] * 8
engine = DaftEngine(node_resources={"embed": {"gpus": 1}})  # tokenize in CPU workers, embed in a GPU one
out = Pipeline(nodes=[tokenize, embed], engine=engine).map(inputs={"text": texts}, map_over="text")
norms = [o["norm"][0] for o in out]
assert norms == [round(sum(ord(c) ** 2 for c in t) ** 0.5, 3) for t in texts], norms
assert {o["norm"][2] for o in out}.isdisjoint({os.getpid()})
print("daft gpu stage: ok on", out[0]["norm"][1])
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
