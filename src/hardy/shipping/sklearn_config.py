"""scikit-learn's configuration (`sklearn.set_config`, `sklearn.config_context`) as
`shipping.context` carries it: `set_config(transform_output="pandas")` makes every transformer
return a DataFrame, `assume_finite=True` turns an error into a value. sklearn keeps it per thread
(a new thread starts from the configuration the import made), so the threaded executor's threads
take the caller's at each map, and a worker takes it at each call that changed it. Read only where
the caller imported sklearn (`sys.modules`): a process that never loads it pays nothing, and a
worker imports it only when the caller's configuration is not the one a thread starts with.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from typing import Any


def sklearn_now() -> dict[str, Any] | None:
    """The calling thread's configuration (`sklearn.get_config()`, a copy: about 0.3 us); None
    where sklearn is not loaded (`shipping.context.settings_key` compares it at every call)."""
    sklearn = sys.modules.get("sklearn")
    get_config = getattr(sklearn, "get_config", None)  # (None while sklearn's own import is under way)
    return get_config() if get_config is not None else None


def sklearn_config() -> dict[str, Any] | None:
    """The calling thread's configuration where it is not the one a new thread starts with (the
    import's), else None: what a worker must take (`Settings.sklearn`) and a cache key must hold."""
    config = sklearn_now()
    return None if config is None or config == _started() else config


def _started() -> dict[str, Any]:
    """The configuration a new thread of this process starts with (what sklearn's import made, its
    `SKLEARN_*` environment variables read): read once, in a thread of its own, as sklearn offers
    no other public way to it."""
    if not _STARTED:
        import sklearn
        found: list[dict[str, Any]] = []
        reader = threading.Thread(target=lambda: found.append(sklearn.get_config()), name="hardy-sklearn-config")
        reader.start()
        reader.join()
        _STARTED.append(found[0])
    return _STARTED[0]


_STARTED: list[dict[str, Any]] = []


def take_sklearn_config(theirs: dict[str, Any] | None) -> None:
    """Make this thread's configuration the caller's (a worker, at each call that changed it): sklearn
    is imported for a configuration the caller changed; one loaded here is set back to what a thread
    starts with where the caller's is that."""
    if theirs is None and "sklearn" not in sys.modules:
        return
    import sklearn
    wanted = theirs if theirs is not None else _started()
    if sklearn.get_config() != wanted:
        sklearn.set_config(**wanted)


def sklearn_thread_config() -> Callable[[], None] | None:
    """What the threaded executor's threads take to compute as the calling thread (its
    configuration, compared and set in each chunk's thread); None where sklearn is not loaded."""
    config = sklearn_now()
    if config is None:
        return None
    sklearn = sys.modules["sklearn"]

    def take() -> None:
        if sklearn.get_config() != config:
            sklearn.set_config(**config)
    return take
