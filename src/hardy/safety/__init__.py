"""Making worker processes safe to start: fork hazards, start-method choice, worker environment."""

from .environment import install_numba_guard, numba_guard_supported
from .hazards import Hazard, choose_start_method, fork_hazards

__all__ = ["Hazard", "fork_hazards", "choose_start_method",
           "install_numba_guard", "numba_guard_supported"]
