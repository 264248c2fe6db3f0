"""Deterministic fingerprints for cache keys: of values (`values.py`, `libraries.py`) and of code (`code.py`).

The two recurse into each other (a value's class is hashed by its code, a function's globals by
their values); `code` imports `values` and installs its fingerprint in `classes` (what a value's
class adds to its key: its code, an instance's attributes), and `libraries` (numpy,
pandas, torch... encoders) registers its types there the same way, as `models` does its encoders
of dataclasses, attrs classes and pydantic models, so importing this package loads them all.
`callables.py` keys each kind of callable by what it runs (a bound method with its instance, a
partial with its arguments...), `distributions.py` library code by the installed distribution
that provides it, and `origin.py` tells user code (hashed by content) from libraries.
"""

from . import libraries, models, torchscript  # noqa: F401  # install their encoders into `values`
from .code import Reach, code_fingerprint, recording
from .origin import is_user_module
from .values import DIGEST, FORMAT, digest, encode, hash_public, hash_value, register

__all__ = ["FORMAT", "DIGEST", "digest", "encode", "hash_value", "hash_public", "register", "code_fingerprint",
           "Reach", "recording", "is_user_module"]
