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


def a_kind(value: Any) -> str:
    """`value`'s type name with its article, as a sentence says it: "an int", "a list" (not "a int")."""
    name = type(value).__name__
    lower = name.lower()
    vowel = lower[:1] in ("a", "e", "i", "o") or lower.startswith("un") and not lower.startswith("uni")
    return f"{'an' if vowel else 'a'} {name}"


class _NotComputed:
    """An input whose value did not exist yet when the node failed (its key could not be made,
    or a node before it failed): shown as such, not as `None`, which would point at another bug."""

    def __repr__(self) -> str:
        return "(not computed yet)"


NOT_COMPUTED = _NotComputed()


def summarize(values: dict[str, Any], limit: int = 60) -> str:
    """A short, safe rendering of a node's inputs for error messages, each on one line: a table by
    its shape and columns (`_table`), anything else by its repr, a multi-line one's lines joined
    by one space (a 2-D array's rows), cut at `limit` characters."""
    parts = []
    for key, value in values.items():
        text = _table(value, limit)
        if text is None:
            try:
                text = repr(value)
                if "\n" in text:  # a multi-line repr (a str's has none: it escapes them)
                    text = " ".join(line.strip() for line in text.splitlines() if line.strip())
            except Exception:  # a broken __repr__ must not hide the real error
                text = f"<{type(value).__name__}>"
        if len(text) > limit:
            text = text[: limit - 3] + "..."
        parts.append(f"{key}={text}")
    return ", ".join(parts)


_TABLES = ("pandas", "polars", "modin", "cudf")  # whose DataFrame and Series `_table` shows


def _table(value: Any, limit: int) -> str | None:
    """A pandas (polars, modin, cuDF) DataFrame as `DataFrame(3 rows × 2 columns: a, b)`, a
    Series as `Series(3 values, dtype int64, name 'a')`; None for anything else. Their repr's first
    line is the column header padded with spaces (`df=       a           ...`), which says neither
    how big the table is nor which columns it has."""
    kind = type(value)
    if kind.__module__.partition(".")[0] not in _TABLES or kind.__name__ not in ("DataFrame", "Series"):
        return None
    try:
        if kind.__name__ == "Series":
            name = f", name {value.name!r}" if value.name not in (None, "") else ""
            return f"Series({len(value):,} values, dtype {value.dtype}{name})"
        rows, count = value.shape
        head = f"DataFrame({rows:,} rows × {count:,} columns"
        names = [str(c) for c in list(value.columns)[:count]]
        shown: list[str] = []
        for name in names:  # as many names as fit the limit, then how many more
            if len(head) + len(", ".join([*shown, name])) + 16 > limit and shown:
                break
            shown.append(name)
        more = f", +{count - len(shown)} more" if len(shown) < count else ""
        return f"{head}: {', '.join(shown)}{more})" if shown else f"{head})"
    except Exception:  # a table that cannot say its shape (a lazy one): its repr, as for anything else
        return None
