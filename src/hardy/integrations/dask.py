"""`DaskExecutor`: the items of a map as Dask tasks, one per chunk (`pip install "hardy[dask]"`).

    Engine(map_executor=DaskExecutor())                       # a LocalCluster on this machine
    Engine(map_executor=DaskExecutor("tcp://scheduler:8786"))  # an existing cluster
    Engine(map_executor=DaskExecutor(client))                  # an existing Client

hardy sets `allowed-failures` to 0 on clusters it starts: a segfaulting item would otherwise kill
up to four workers before Dask gives up. On clusters you start, set it yourself (docs/distributed.md).
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


def _local_settings(folder: str) -> dict[str, Any]:
    """A LocalCluster's settings, made anew for each (distributed appends to the route lists it is
    given). Its scratch folder (`temporary-directory`) is `folder`, a private one: Dask's default,
    `$TMPDIR/dask-scratch-space`, is taken as it is found where another user made it (writable by
    anyone), and Dask puts its workers' folders in it first on `sys.path`, where a module of theirs
    is imported by your process and hardy's fork server; and they can hold its lock file, on which
    your next cluster waits for ever. Its HTTP servers listen on loopback with no routes, and no
    dashboard (`DaskExecutor._start`): another user of the machine would read its logs and stacks
    there, and retire its workers."""
    return {"distributed.scheduler.allowed-failures": 0, "distributed.scheduler.http.routes": [],
            "distributed.worker.http.routes": [], "temporary-directory": folder}


class DaskExecutor(TaskExecutor):
    engine = "Dask"

    def __init__(self, address: Any = None, workers: int | None = None, ship_modules: Sequence[str] = ()):
        super().__init__(ship_modules)
        self.address = address
        self.n_workers = workers
        self.client: Any = None
        self._cluster: Any = None
        self._own_client = False
        self._folder: str | None = None  # the private scratch folder of the LocalCluster started here
        self._removal: weakref.finalize[Any, Any] | None = None

    def _start(self) -> None:
        if self.client is not None:
            return
        require("distributed", "dask")
        import dask
        from distributed import Client, LocalCluster
        if isinstance(self.address, Client):
            self.client = self.address
            return
        if self.address:
            self.client = Client(self.address, timeout="30s")
        else:
            self._folder = tempfile.mkdtemp(prefix="hardy-dask-")
            self._removal = weakref.finalize(self, shutil.rmtree, self._folder, True)  # (at exit, if not closed)
            with dask.config.set(_local_settings(self._folder)):
                self._cluster = LocalCluster(n_workers=self.n_workers or os.cpu_count() or 1, threads_per_worker=1,
                                             processes=False, dashboard_address="127.0.0.1:0",
                                             worker_dashboard_address="127.0.0.1:0",
                                             scheduler_kwargs={"dashboard": False})
                self.client = Client(self._cluster)
        self._own_client = True

    def _workers(self) -> int:
        return len(self.client.scheduler_info()["workers"])

    def _put(self, data: bytes) -> Any:
        # Sent with each task rather than scattered: scattered data dies with the worker holding it,
        # and a crash would then cancel every task that needs the plan.
        return data

    def _submit(self, fn: Any, *args: Any) -> Any:
        return self.client.submit(fn, *args, pure=False, retries=0)

    def _wait_any(self, futures: list[Any]) -> list[Any]:
        from distributed import wait
        try:
            with self.client.as_current():  # wait() uses the default client; ours may not be it
                return list(wait(futures, return_when="FIRST_COMPLETED").done)
        except Exception:  # a cancelled future (its worker died) makes wait() raise: report it as done
            return [f for f in futures if f.status in ("finished", "error", "cancelled", "lost")]

    def _result(self, future: Any) -> Any:
        return future.result()

    def _cancel(self, futures: list[Any]) -> None:
        if futures:
            self.client.cancel(futures)

    def _is_crash(self, exc: BaseException) -> bool:
        from concurrent.futures import CancelledError

        from distributed import KilledWorker
        from distributed.comm.core import CommClosedError
        return isinstance(exc, (KilledWorker, CommClosedError, CancelledError)) or \
            "worker died" in str(exc).lower() or "cancelled" in type(exc).__name__.lower()

    def close(self) -> None:
        if self.client is not None and self._own_client:
            self.client.close()
        if self._cluster is not None:
            self._cluster.close()
        self.client = self._cluster = None
        if self._folder is not None and self._removal is not None:  # Dask leaves its folders on sys.path:
            sys.path[:] = [p for p in sys.path if not p.startswith(self._folder + os.sep)]  # paths another
            self._removal()  # user could make again, once removed
            self._folder = self._removal = None

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "client": None, "_cluster": None, "_folder": None, "_removal": None}
