"""torch's settings that change what a node computes (`TorchModes`), as `shipping.context` carries
them to a worker at each call that changed them and to the threaded executor's threads: the
calling thread's grad, inference and autocast modes and default device, and the process's
deterministic algorithms, default dtype, matmul precision, cudnn and mkldnn flags, anomaly detection
and print options (`torch_keyed`: those a cache key holds). Read only where the caller imported torch
(`sys.modules`): a process that never loads it pays nothing, and a worker never imports it for it.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from typing import Any, NamedTuple

Autocast = tuple[bool, str, bool, str]  # cpu's enabled and dtype, then cuda's


class TorchModes(NamedTuple):
    """torch's settings that change what a node computes: its thread's grad, inference and autocast
    modes and the process's algorithms, default dtype and matmul precision (a `set_seed` helper's
    `cudnn.deterministic = True`), each as `torch.get_*` and `torch.backends.cudnn` read them."""

    grad: bool = True
    deterministic: bool = False
    warn_only: bool = False
    inference: bool = False
    default_dtype: str = "float32"
    matmul_precision: str = "highest"
    cudnn_deterministic: bool = False
    cudnn_benchmark: bool = False
    cudnn_allow_tf32: bool = True
    autocast: Autocast | None = None  # `torch.autocast("cpu", dtype=torch.bfloat16)` around a map; None: off
    default_device: str | None = None  # `torch.set_default_device("meta")`, `with torch.device(...)`; None: cpu
    cudnn_enabled: bool = True  # `torch.backends.cudnn.enabled`
    mkldnn_enabled: bool = True  # `torch.backends.mkldnn.enabled` (the CPU's convolutions)
    anomaly: bool | None = None  # `torch.autograd.set_detect_anomaly(True, check_nan)`: check_nan; None: off
    print_options: tuple[Any, ...] | None = None  # `torch.set_printoptions`' fields (`PRINT`); None: torch's


TORCH_DEFAULTS = TorchModes()
AUTOCAST_OFF: Autocast = (False, "bfloat16", False, "float16")  # torch's own, as a thread starts
PRINT = ("precision", "threshold", "edgeitems", "linewidth", "sci_mode")
PRINT_DEFAULTS = (4, 1000, 3, 80, None)  # torch's, as `set_printoptions(profile="default")` sets them


def torch_modes() -> TorchModes | None:
    """The calling thread's `TorchModes`; None where torch is not loaded or all are torch's defaults."""
    torch = sys.modules.get("torch")
    modes = torch_now(torch) if torch is not None else TORCH_DEFAULTS
    return None if modes == TORCH_DEFAULTS else modes


def torch_now(torch: Any) -> TorchModes:
    """torch's settings (`TorchModes`) as set now, dtypes by name (torch.float64: "float64")."""
    raw = list(torch_key(torch._C, torch.get_default_dtype))
    raw[4] = _name(raw[4])
    if raw[9] is not None:
        cpu, cpu_dtype, cuda, cuda_dtype = raw[9]
        raw[9] = (cpu, _name(cpu_dtype), cuda, _name(cuda_dtype))
    return TorchModes(*raw)


def _name(dtype: Any) -> str:
    return str(dtype).rpartition(".")[2]


def torch_key(c: Any, default_dtype: Callable[[], Any]) -> tuple[Any, ...]:
    """`TorchModes`' fields as torch's own calls return them (the dtypes objects): about 1 us,
    0.2 of it autocast's two probes (the dtypes, which count only while it is on, read only then),
    0.04 the default device's (`default_device`) and 0.1 the print options' (`print_options`)."""
    try:
        autocast = _autocast(c) if c.is_autocast_enabled("cpu") or c.is_autocast_enabled() else None  # (CUDA's)
    except TypeError:  # torch before 2.4: a call per device
        autocast = _autocast(c)
    return (c.is_grad_enabled(), c._get_deterministic_algorithms(), c._get_deterministic_algorithms_warn_only(),
            c.is_inference_mode_enabled(), default_dtype(), c._get_float32_matmul_precision(),
            c._get_cudnn_deterministic(), c._get_cudnn_benchmark(), c._get_cudnn_allow_tf32(), autocast,
            default_device(c), c._get_cudnn_enabled(), c._get_mkldnn_enabled(),
            c.is_anomaly_check_nan_enabled() if c.is_anomaly_enabled() else None, print_options())


def print_options() -> tuple[Any, ...] | None:
    """`torch.set_printoptions`' fields (`PRINT`) where not torch's defaults: torch has no getter,
    and keeps them as attributes of one object that it changes in place."""
    now = getattr(sys.modules.get("torch._tensor_str"), "PRINT_OPTS", None)
    if now is None:
        return None
    options = (now.precision, now.threshold, now.edgeitems, now.linewidth, now.sci_mode)
    return None if options == PRINT_DEFAULTS else options


def torch_keyed(modes: TorchModes) -> tuple[Any, ...]:
    """What of torch's settings a cache key holds besides its dtype, matmul precision, autocast
    and device (`shipping.context.result_settings`), each only where it is not torch's default, so
    that keys made without it stay: grad and inference mode (a result with or without a graph and
    `requires_grad`), print options (`str(tensor)`), cudnn or mkldnn turned off, deterministic
    algorithms and cudnn's flags (other kernels, other roundings). Not anomaly detection: it only
    raises, and a call that raised is never stored."""
    parts: tuple[Any, ...] = ()
    if not modes.grad or modes.inference:
        parts += (("grad", modes.grad, modes.inference),)
    if modes.print_options is not None:
        parts += (("print", modes.print_options),)
    if not (modes.cudnn_enabled and modes.mkldnn_enabled):
        parts += (("backends", modes.cudnn_enabled, modes.mkldnn_enabled),)
    algorithms = (modes.deterministic, modes.warn_only, modes.cudnn_deterministic, modes.cudnn_benchmark,
                  modes.cudnn_allow_tf32)
    if algorithms != _ALGORITHMS:
        parts += (("algorithms", *algorithms),)
    return parts


# torch's own: deterministic algorithms off (and their warn_only), cudnn's deterministic and
# benchmark off, its TF32 on. A seed helper's `cudnn.deterministic = True`, `benchmark` or TF32 off
# pick other kernels on a GPU, with other roundings: keyed where not these.
_ALGORITHMS = (False, False, False, False, True)


def default_device(c: Any) -> str | None:
    """The calling thread's default device, as it was set (`torch.set_default_device("cuda")`:
    "cuda", without the index `torch.get_default_device()` finds by making a tensor there, which
    would start CUDA in this process), None for the CPU. torch keeps it as a `DeviceContext` on the
    thread's stack of function modes, read only when that stack holds something (0.04 us to ask)."""
    if not c._len_torch_function_stack():
        return None
    overrides, devices = sys.modules.get("torch.overrides"), sys.modules.get("torch.utils._device")
    if overrides is None or devices is None:  # (no DeviceContext was ever made)
        return None
    for mode in reversed(overrides._get_current_function_mode_stack()):
        if isinstance(mode, devices.DeviceContext):
            device = str(mode.device)
            return None if device == "cpu" else device
    return None


def _autocast(c: Any) -> tuple[Any, ...] | None:
    """This thread's autocast for the CPU and CUDA (enabled, dtype each), None while neither is on."""
    try:
        cpu, cuda = c.is_autocast_enabled("cpu"), c.is_autocast_enabled()  # (no argument: CUDA's)
        if not (cpu or cuda):
            return None
        return cpu, c.get_autocast_dtype("cpu"), cuda, c.get_autocast_dtype("cuda")
    except TypeError:  # torch before 2.4
        cpu, cuda = c.is_autocast_cpu_enabled(), c.is_autocast_enabled()
        return (cpu, c.get_autocast_cpu_dtype(), cuda, c.get_autocast_gpu_dtype()) if cpu or cuda else None


def take_torch_modes(torch: Any, theirs: TorchModes) -> None:
    """Set each of torch's settings that differs from the caller's (inference mode before grad
    mode: entering or leaving it sets grad mode too)."""
    now = torch_now(torch)
    if now.inference != theirs.inference:
        _take_inference(torch, theirs.inference)
    if bool(torch.is_grad_enabled()) != theirs.grad:
        torch.set_grad_enabled(theirs.grad)
    if now[1:3] != theirs[1:3]:  # (its first call loads torch's compiler stack: a second)
        torch.use_deterministic_algorithms(theirs.deterministic, warn_only=theirs.warn_only)
    if now.default_dtype != theirs.default_dtype:
        torch.set_default_dtype(getattr(torch, theirs.default_dtype))
    if now.matmul_precision != theirs.matmul_precision:
        torch.set_float32_matmul_precision(theirs.matmul_precision)
    if now[6:9] != theirs[6:9]:
        cudnn = torch.backends.cudnn
        cudnn.deterministic, cudnn.benchmark, cudnn.allow_tf32 = theirs[6:9]
    if now.autocast != theirs.autocast:
        _take_autocast(torch, theirs.autocast)
    if now.default_device != theirs.default_device:  # (a device this process lacks fails where a tensor is made)
        torch.set_default_device(theirs.default_device)
    if (now.cudnn_enabled, now.mkldnn_enabled) != (theirs.cudnn_enabled, theirs.mkldnn_enabled):
        torch.backends.cudnn.enabled, torch.backends.mkldnn.enabled = theirs.cudnn_enabled, theirs.mkldnn_enabled
    if now.anomaly != theirs.anomaly:  # (off: check_nan back to torch's default, True)
        torch.autograd.set_detect_anomaly(theirs.anomaly is not None, check_nan=theirs.anomaly is not False)
    if now.print_options != theirs.print_options:
        torch.set_printoptions(**dict(zip(PRINT, theirs.print_options or PRINT_DEFAULTS)))


def _take_autocast(torch: Any, wanted: Autocast | None) -> None:
    """This thread's autocast as the caller's (`torch.autocast` has no other setter than these).
    While it is on, autocast's cache of cast weights is off here: torch empties it only when the
    outermost `autocast` block is left, which never happens in a thread that holds the mode for its
    caller, so a weight the caller changed in place since would be read as cast before. (The cache
    saves work; a cast is the same either way.)"""
    cpu, cpu_dtype, cuda, cuda_dtype = wanted or AUTOCAST_OFF
    try:
        for device, on, dtype in (("cpu", cpu, cpu_dtype), ("cuda", cuda, cuda_dtype)):
            torch.set_autocast_enabled(device, on)
            torch.set_autocast_dtype(device, getattr(torch, dtype))
    except TypeError:  # torch before 2.4: a call per device
        torch.set_autocast_cpu_enabled(cpu)
        torch.set_autocast_cpu_dtype(getattr(torch, cpu_dtype))
        torch.set_autocast_enabled(cuda)
        torch.set_autocast_gpu_dtype(getattr(torch, cuda_dtype))
    torch.clear_autocast_cache()
    torch.set_autocast_cache_enabled(wanted is None)


_INFERENCE = threading.local()  # `held`: the inference-mode guard this thread entered for its caller


def _take_inference(torch: Any, wanted: bool) -> None:
    """Enter or leave inference mode on this thread as the caller has it. torch offers no setter,
    only a guard (`torch.inference_mode()` enters one): the guard this thread entered for an
    earlier call is left first, which restores the mode from before it, and a new one is entered
    only if that is not the caller's."""
    held = getattr(_INFERENCE, "held", None)
    _INFERENCE.held = None
    if held is not None:
        held.__exit__(None, None, None)
    if bool(torch.is_inference_mode_enabled()) != wanted:
        guard = torch._C._InferenceMode(wanted)
        guard.__enter__()
        _INFERENCE.held = guard


def torch_thread_modes() -> Callable[[], Any] | None:
    """What of the calling thread's torch settings another thread must take to compute the same
    (the threaded executor's chunks, `shipping.context.thread_modes`): its grad, inference and
    autocast modes and its default device are the thread's own; None where torch is not loaded.
    (torch's other settings are the process's.)"""
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    grad, inference = bool(torch.is_grad_enabled()), bool(torch.is_inference_mode_enabled())
    now = torch_now(torch)
    autocast, device = now.autocast, now.default_device

    def take() -> None:
        _take_inference(torch, inference)  # (nothing to do where this thread holds no guard and agrees)
        torch.set_grad_enabled(grad)
        if autocast is not None or _autocast(torch._C) is not None:  # (a pool thread keeps what it took)
            _take_autocast(torch, autocast)
        if default_device(torch._C) != device:
            torch.set_default_device(device)
    return take
