"""`RayExecutor`: the items of a map as Ray tasks, one per chunk (`pip install "hardy[ray]"`).

    Engine(map_executor=RayExecutor())                  # a local Ray instance, started on first use
    Engine(map_executor=RayExecutor("head-node:6379"))  # an existing cluster

Tasks run with `max_retries=0`: a crash is hardy's to classify and retry (the nodes' `retries`).
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import weakref
from collections.abc import Sequence
from typing import Any

from .remote import TaskExecutor, require

# The longest temporary folder Ray's socket paths fit under (107 bytes, with its private folder's
# name, `/r` and `/session_<date>_<time>_<pid>/sockets/plasma_store` after it).
_TEMP_PATH_MAX = 24
_PREFIX = "hardy-r-"  # (two bytes shorter than "hardy-ray-", for the `/r` below it)


class RayExecutor(TaskExecutor):
    engine = "Ray"

    def __init__(self, address: str | None = None, workers: int | None = None, ship_modules: Sequence[str] = (),
                 init_kwargs: dict[str, Any] | None = None):
        super().__init__(ship_modules)
        self.address = address
        self.inherits_environment = address is None  # (a local instance's workers: started by `ray.init` here)
        self.n_workers = workers
        self.init_kwargs = dict(init_kwargs or {})
        self._started = False
        self._tasks: dict[Any, Any] = {}
        self._removal: weakref.finalize[Any, Any] | None = None  # of the private folder of a local instance

    def _start(self) -> None:
        ray = require("ray", "ray")
        if not ray.is_initialized():
            os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
            kwargs: dict[str, Any] = {"include_dashboard": False, "log_to_driver": False, **self.init_kwargs}
            if self.address:
                ray.init(address=self.address, **kwargs)
            else:  # "local": never attach to a stale cluster found through /tmp/ray.
                # Workers on this machine import what the driver imports (multiprocessing and Dask's
                # LocalCluster do the same); a cluster's workers need the code installed.
                kwargs.setdefault("_node_ip_address", "127.0.0.1")
                # Its session folder, sockets and logs in a private folder: Ray's default,
                # `$TMPDIR/ray`, is taken as found (another user who made it first stops every
                # start), and Ray makes the folder it is given writable by anyone (`chmod 0777`):
                # it is given `r` inside a folder of mode 0700, which no other user can enter.
                if "_temp_dir" not in kwargs:  # (its sockets' paths must fit in 107 bytes: under /tmp if need be)
                    short = len(tempfile.gettempdir()) <= _TEMP_PATH_MAX or not os.path.isdir("/tmp")
                    private = tempfile.mkdtemp(prefix=_PREFIX, dir=None if short else "/tmp")
                    kwargs["_temp_dir"] = os.path.join(private, "r")
                    self._removal = weakref.finalize(self, shutil.rmtree, private, True)
                # A Ray worker that exits SIGKILLs its children (Ray 2.x), hardy's fork server among
                # them, which then cannot collect its workers and what their nodes started; told not
                # to, the server cleans up itself as the worker's pipe closes, as under any other parent.
                os.environ.setdefault("RAY_kill_child_processes_on_worker_exit", "0")
                paths = os.pathsep.join(p for p in sys.path if p)
                kwargs.setdefault("runtime_env", {"env_vars": {"PYTHONPATH": paths}})
                ray.init(address="local", num_cpus=self.n_workers or os.cpu_count(), **kwargs)
            self._started = True

    def _remote(self, fn: Any) -> Any:
        task = self._tasks.get(fn)
        if task is None:
            import ray
            task = self._tasks[fn] = ray.remote(max_retries=0, num_cpus=1)(fn)
        return task

    def _workers(self) -> int:
        import ray
        return max(1, int(ray.cluster_resources().get("CPU", 1)))

    def _put(self, data: bytes) -> Any:
        import ray
        return ray.put(data)

    def _submit(self, fn: Any, *args: Any) -> Any:
        return self._remote(fn).remote(*args)

    def _wait_any(self, futures: list[Any]) -> list[Any]:
        import ray
        done: list[Any]
        done, _ = ray.wait(futures, num_returns=1)
        return done

    def _result(self, future: Any) -> Any:
        import ray
        return ray.get(future)

    def _cancel(self, futures: list[Any]) -> None:
        import ray
        for f in futures:
            ray.cancel(f, force=True)

    def _is_crash(self, exc: BaseException) -> bool:
        from ray import exceptions as rex
        crash = tuple(getattr(rex, n) for n in ("WorkerCrashedError", "NodeDiedError", "OutOfMemoryError",
                                                "LocalRayletDiedError") if hasattr(rex, n))
        return isinstance(exc, crash)

    def _cause(self, exc: BaseException) -> BaseException:
        return getattr(exc, "cause", None) or exc

    def close(self) -> None:
        if self._started:
            import ray
            ray.shutdown()
            self._started = False
        self._tasks.clear()
        if self._removal is not None:
            self._removal()  # (its folder)
            self._removal = None

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_tasks": {}, "_started": False, "_removal": None}
