"""Making worker processes safe to start: fork hazards, start-method choice, worker environment.

Each name loads with its module on first use (`hardy.lazy`): a worker and its fork server need
`environment` alone, and the hazards' checks are the parent's, before it starts them."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..lazy import exports

if TYPE_CHECKING:
    from .environment import install_numba_guard, numba_guard_supported
    from .hazards import Hazard, choose_start_method, fork_hazards

__all__ = ["Hazard", "fork_hazards", "choose_start_method", "install_numba_guard", "numba_guard_supported"]
__getattr__, __dir__ = exports(__name__, {
    "Hazard": "hazards", "fork_hazards": "hazards", "choose_start_method": "hazards",
    "install_numba_guard": "environment", "numba_guard_supported": "environment"})
