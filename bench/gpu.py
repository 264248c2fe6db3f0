"""GPU workers against one in-process loop, and the cost of a sticky CUDA error, in one run.

    python bench/gpu.py          # needs an NVIDIA GPU and a CUDA build of torch

1. 2,000 small CUDA matmuls (256 x 256, float32): an in-process loop (the floor: no process
   boundary), then `Engine(map_executor="process", gpus=[0], workers_per_gpu=1 and 2)`; items/s and
   the ratio to the loop.
2. Recovery after a sticky error: one warm GPU worker runs [device-side assert, good item]; the good
   item waits for the replacement worker (its start and CUDA initialisation). Recovery = that map
   minus the same map of two good items on a warm worker.
"""

from __future__ import annotations

import statistics
import sys
import time

import torch

from hardy import Engine, Pipeline, node

ITEMS = 2000
SIZE = 256


def matmul(seed: int) -> float:
    g = torch.Generator(device="cuda").manual_seed(seed)
    a = torch.randn(SIZE, SIZE, device="cuda", generator=g)
    return float((a @ a).sum().item())


@node(output_name="total", gpus=1)
def gpu_matmul(seed: int) -> float:
    return matmul(seed)


@node(output_name="picked", gpus=1)
def gather(i: int) -> int:
    table = torch.arange(10, device="cuda")
    return int(torch.index_select(table, 0, torch.tensor([100 if i < 0 else i], device="cuda")).item())


def best(call, repeats: int = 3) -> float:
    return min(_timed(call) for _ in range(repeats))


def _timed(call) -> float:
    t = time.perf_counter()
    call()
    return time.perf_counter() - t


def throughput() -> None:
    """hardy first, the loop last: CUDA initialised in this process would not hurt hardy's workers
    (they come from a clean fork server), but the order keeps the maps' parent as a user's is."""
    seeds = list(range(ITEMS))
    rates = {}
    for per_gpu in (1, 2):
        with Engine(map_executor="process", gpus=[0], workers_per_gpu=per_gpu) as engine:
            pipeline = Pipeline(nodes=[gpu_matmul], engine=engine)
            pipeline.map(inputs={"seed": seeds[:8]}, map_over="seed", progress=False)  # workers up, CUDA ready
            rates[per_gpu] = ITEMS / best(lambda p=pipeline: p.map(inputs={"seed": seeds}, map_over="seed",
                                                                   progress=False))
    matmul(0)
    loop = ITEMS / best(lambda: [matmul(s) for s in seeds])
    print(f"in-process loop: {loop:,.0f} items/s (1.00x)")
    for per_gpu, rate in rates.items():
        print(f"gpus=[0], workers_per_gpu={per_gpu}: {rate:,.0f} items/s ({rate / loop:.2f}x the loop)")


def recovery() -> None:
    samples, baseline = [], []
    with Engine(map_executor="process", gpus=[0]) as engine:
        pipeline = Pipeline(nodes=[gather], engine=engine)
        for _ in range(5):
            pipeline.map(inputs={"i": [1]}, map_over="i", progress=False)  # a warm worker
            baseline.append(_timed(lambda: pipeline.map(inputs={"i": [1, 2]}, map_over="i", progress=False)))
            samples.append(_timed(lambda: pipeline.map(inputs={"i": [-1, 2]}, map_over="i", on_error="continue",
                                                       progress=False)))
        replaced = engine.gpu_pool().replaced
    gap = statistics.median(samples) - statistics.median(baseline)
    print(f"recovery after a sticky error (new worker ready, CUDA initialised): {gap * 1000:.0f} ms "
          f"(median of 5; {replaced} workers replaced)")


if not torch.cuda.is_available():
    sys.exit("bench/gpu.py needs an NVIDIA GPU and a CUDA build of torch")
recovery()
throughput()
print(f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}")
