"""How hardy words what it reports: a value shown in a message, a misspelt name's likely meaning,
how to install an optional part. A leaf below `errors`, which builds its messages with these."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any


def install_hint(extra: str) -> str:
    """How to install one of hardy's optional parts (`extra`, as pyproject.toml names it), in a form
    that works where hardy came from: its packages by name (read from hardy's installed metadata), or
    the extra from a clone. Never `pip install "hardy[extra]"`: hardy is not on the package index."""
    from importlib.metadata import PackageNotFoundError, requires
    try:
        wanted = [r.split(";")[0].strip() for r in requires("hardy") or ()
                  if r.partition(";")[2].replace("'", '"').replace(" ", "").endswith(f'extra=="{extra}"')]
    except PackageNotFoundError:  # hardy on sys.path without metadata: a clone
        wanted = []
    clone = f'pip install -e ".[{extra}]" in a clone of hardy'
    return f"pip install {' '.join(repr(w) for w in wanted)} (or {clone})" if wanted else clone


def did_you_mean(name: str, candidates: Iterable[str]) -> str:
    """The hint appended to an error about a misspelt name: " (did you mean 'x'?)", or ""."""
    import difflib  # (here: `import hardy` and every worker import this module, and only errors use it)
    match = difflib.get_close_matches(name, list(candidates), n=1, cutoff=0.6)
    return f" (did you mean {match[0]!r}?)" if match else ""


class _NotComputed:
    """An input whose value did not exist yet when the node failed (its key could not be made,
    or a node before it failed): shown as such, not as `None`, which would point at another bug."""

    def __repr__(self) -> str:
        return "(not computed yet)"


NOT_COMPUTED = _NotComputed()


def summarize(values: dict[str, Any], limit: int = 60) -> str:
    """A short, safe rendering of a node's inputs for error messages."""
    parts = []
    for key, value in values.items():
        try:
            text = repr(value)
        except Exception:  # a broken __repr__ must not hide the real error
            text = f"<{type(value).__name__}>"
        if len(text) > limit:
            text = text[: limit - 3] + "..."
        parts.append(f"{key}={text}")
    return ", ".join(parts)
