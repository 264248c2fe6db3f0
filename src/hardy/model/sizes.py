"""Sizes given by people: "2GB", "512M", 1_000_000."""

from __future__ import annotations

_UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def parse_size(size: int | str | None) -> int | None:
    """Bytes from an int or a string with an optional K/M/G/T suffix (binary units)."""
    if size is None or isinstance(size, int):
        return size
    text = size.strip().upper().removesuffix("B").removesuffix("I")
    if text and text[-1] in _UNITS:
        return int(float(text[:-1]) * _UNITS[text[-1]])
    return int(text)
