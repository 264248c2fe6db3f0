"""GPUs: which NVIDIA devices this machine has, how they become worker slots, and what CUDA's
error messages mean.

Finding GPUs never initialises CUDA here (a process that has, cannot fork safely): NVML, the
driver's management library that `nvidia-smi` itself reads, through NVIDIA's own binding
`nvidia-ml-py` (`pip install "hardy[gpu]"`, imported only when asked), else the `nvidia-smi`
command. `HARDY_ASSUME_GPUS=N` declares N GPUs without looking: it exists so that slot routing can
be tested on machines without one (the workers get `CUDA_VISIBLE_DEVICES` as on a real machine;
nothing CUDA runs). The doctor shows when it is set.

CUDA errors come as text from several libraries (torch, cupy, numba, jax), so they are told apart
by the messages and enum names CUDA itself defines, which all of them repeat.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ..errors import InvalidArgument, NoGpuError, install_hint, text_of
from ..model import arguments

ASSUME = "HARDY_ASSUME_GPUS"

# After these, every later CUDA call of the process fails (the CUDA context is corrupted).
_STICKY = ("an illegal memory access was encountered", "device-side assert triggered", "unspecified launch failure",
           "uncorrectable ecc error encountered", "misaligned address", "an illegal instruction was encountered",
           "the launch timed out and was terminated", "hardware stack error",
           "cuda_error_illegal_address", "cuda_error_assert", "cuda_error_launch_failed",
           "cuda_error_ecc_uncorrectable", "cuda_error_misaligned_address", "cuda_error_illegal_instruction",
           "cuda_error_launch_timeout", "cuda_error_hardware_stack_error")
_OOM = ("cuda out of memory", "cuda error: out of memory", "cudaerrormemoryallocation", "cuda_error_out_of_memory",
        "cublas_status_alloc_failed", "cudnn_status_alloc_failed", "out of memory allocating",
        "out of memory to allocate", "resource_exhausted: out of memory")
_CUDA = ("cuda error", "cudaerror", "cuda_error_", "cublas_status_", "cudnn_status_", "cusolver_status_",
         "cufft_internal_error", "nccl error")
_CUDA_PACKAGES = {"torch", "cupy", "cupy_backends", "numba", "jax", "jaxlib", "pycuda", "cuda"}


def cuda_failure(exc: BaseException) -> str | None:
    """"sticky", "oom", "cuda" (another CUDA error) or None for an exception that is not CUDA's.
    The exception's causes are read too: libraries wrap CUDA's error in their own."""
    chain: list[BaseException] = []
    seen: BaseException | None = exc
    while seen is not None and len(chain) < 5:
        chain.append(seen)
        seen = seen.__cause__ or seen.__context__
    text = "\n".join(f"{type(e).__name__}: {text_of(e)}" for e in chain).lower()
    if any(m in text for m in _STICKY):
        return "sticky"
    if any(m in text for m in _OOM) or any(type(e).__name__ == "OutOfMemoryError"
                                           and type(e).__module__.split(".")[0] in _CUDA_PACKAGES for e in chain):
        return "oom"
    if any(m in text for m in _CUDA):
        return "cuda"
    return None


# --- finding GPUs ------------------------------------------------------------------------------------


@dataclass
class Gpu:
    index: int
    name: str
    uuid: str = ""
    memory_total: int | None = None   # bytes
    memory_free: int | None = None
    compute_capability: str | None = None  # "9.0"


@dataclass
class Inventory:
    """What the driver says: the GPUs (physical indices, whatever CUDA_VISIBLE_DEVICES says), the
    driver version and the newest CUDA version it supports; `problem` says why none were found."""

    source: str  # "nvml", "nvidia-smi", ASSUME or "none"
    gpus: list[Gpu] = field(default_factory=list)
    driver: str | None = None
    cuda_driver: str | None = None  # "12.4"
    problem: str = ""


def inventory() -> Inventory:
    import shutil
    import subprocess

    assumed = os.environ.get(ASSUME)
    if assumed:
        try:
            n = int(assumed)
        except ValueError:
            raise NoGpuError(f"{ASSUME}={assumed!r} must be a number of GPUs (it declares GPUs for tests on "
                             "machines without one).") from None
        return Inventory(ASSUME, [Gpu(i, f"assumed by {ASSUME} (not a real device)") for i in range(n)])
    problems = []
    try:
        return _nvml()
    except ImportError:
        problems.append(f"NVML: nvidia-ml-py is not installed ({install_hint('gpu')})")
    except Exception as exc:  # pynvml.NVMLError_*: no driver, no library, no device
        problems.append(f"NVML: {exc}")
    if shutil.which("nvidia-smi"):
        try:
            return _smi()
        except (OSError, subprocess.SubprocessError, ValueError) as exc:
            problems.append(f"nvidia-smi: {exc}")
    else:
        problems.append("nvidia-smi: not on PATH")
    return Inventory("none", problem="; ".join(problems))


def _nvml() -> Inventory:
    import pynvml

    pynvml.nvmlInit()
    try:
        version = pynvml.nvmlSystemGetCudaDriverVersion_v2()
        found = Inventory("nvml", driver=_text(pynvml.nvmlSystemGetDriverVersion()),
                          cuda_driver=f"{version // 1000}.{version % 1000 // 10}")
        for i in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(i)
            memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
            major, minor = pynvml.nvmlDeviceGetCudaComputeCapability(handle)
            found.gpus.append(Gpu(i, _text(pynvml.nvmlDeviceGetName(handle)), _text(pynvml.nvmlDeviceGetUUID(handle)),
                                  memory.total, memory.free, f"{major}.{minor}"))
        return found
    finally:
        pynvml.nvmlShutdown()


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value


_SMI_QUERY = "index,name,uuid,memory.total,memory.free,compute_cap,driver_version"


def _smi() -> Inventory:
    import subprocess

    csv = subprocess.run(["nvidia-smi", f"--query-gpu={_SMI_QUERY}", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True, timeout=30, check=True).stdout
    banner = subprocess.run(["nvidia-smi"], capture_output=True, text=True, timeout=30).stdout
    return parse_smi(csv, banner)


def parse_smi(csv: str, banner: str) -> Inventory:
    """nvidia-smi's CSV query (memory in MiB) and its banner, which alone states the CUDA version."""
    found = Inventory("nvidia-smi")
    for line in csv.strip().splitlines():
        index, name, uuid, total, free, cc, driver = (part.strip() for part in line.split(","))
        found.driver = driver
        found.gpus.append(Gpu(int(index), name, uuid, int(total) * 2**20, int(free) * 2**20, cc))
    cuda = re.search(r"CUDA Version:\s*([\d.]+)", banner)
    found.cuda_driver = cuda.group(1) if cuda else None
    return found


# --- slots -------------------------------------------------------------------------------------------


def gpu_slots(gpus: str | int | Sequence[int] | None, workers_per_gpu: int = 1) -> list[str]:
    """`CUDA_VISIBLE_DEVICES` for each GPU worker: `gpus="all"`, a count, or indices among the GPUs
    this process may use (its own CUDA_VISIBLE_DEVICES, else all), `workers_per_gpu` workers each.
    None or 0: no GPU worker. Raises NoGpuError, saying what to do, when the GPUs are not there,
    InvalidArgument for arguments that mean nothing."""
    if gpus is None or (isinstance(gpus, int) and not isinstance(gpus, bool) and gpus == 0):
        return []
    arguments.whole_number("Engine", "workers_per_gpu", workers_per_gpu, 1)
    if isinstance(gpus, str) and gpus != "all" or isinstance(gpus, (bool, float)) or (
            isinstance(gpus, int) and gpus < 0):
        raise InvalidArgument(f"Engine(gpus={gpus!r}): give 'all', a number of GPUs, or a list of GPU "
                              "indices such as [0, 1]; gpus=0 runs every node on CPU workers.")
    visible = visible_devices()
    if isinstance(gpus, int):
        chosen = visible[:gpus] if gpus <= len(visible) else None
    elif gpus == "all":
        chosen = visible or None
    else:
        wanted: list[Any] = list(gpus)  # checked here: whatever the caller passed
        chosen = [visible[i] for i in wanted] if all(
            isinstance(i, int) and 0 <= i < len(visible) for i in wanted) and wanted else None
    if not chosen:
        raise NoGpuError(f"Engine(gpus={gpus!r}): {_what_is_visible(visible)}. Pass gpus=0 (or leave it out) "
                         "to run every node on CPU workers, or run where the GPUs and their driver are.")
    return [device for device in chosen for _ in range(workers_per_gpu)]


def visible_devices() -> list[str]:
    """The devices this process may use, as CUDA_VISIBLE_DEVICES entries."""
    own = os.environ.get("CUDA_VISIBLE_DEVICES")
    if own is not None and not os.environ.get(ASSUME):
        return [d.strip() for d in own.split(",") if d.strip() and d.strip() != "-1"]
    return [str(g.index) for g in inventory().gpus]


def _what_is_visible(visible: list[str]) -> str:
    if visible:
        return f"this process sees {len(visible)} GPU(s) ({', '.join(visible)})"
    own = os.environ.get("CUDA_VISIBLE_DEVICES")
    if own is not None and not os.environ.get(ASSUME):
        return f"CUDA_VISIBLE_DEVICES={own!r} hides every GPU from this process"
    return f"no NVIDIA GPU was found ({inventory().problem})"
