"""What `hardy run` is given to run: `--set NAME=VALUE` values and the items of an `--inputs` JSONL
file, checked before anything runs (each mistake a usage error naming the flag, the file and its
line, and the fix).

An item keeps the number of its line in the file: blank lines are skipped, so item N is not line
N+1 where the file has any, and whatever names a line (these errors, a failure in the run report,
`hardy replay`) names the item's own. Lines end at "\\n" alone, as JSON Lines has them: a string may
hold U+2028 unescaped, which `str.splitlines` took for the end of a line.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .usage import refuse as _fail_usage


def parse_sets(pairs: list[str]) -> dict[str, Any]:
    """NAME=VALUE pairs; a value is read as JSON (numbers, lists, objects) and otherwise as text.
    A name given twice is a usage error: which value was meant, the command cannot know."""
    values: dict[str, Any] = {}
    for pair in pairs:
        name, sep, raw = pair.partition("=")
        if not sep or not name:
            _fail_usage(f"--set {pair!r} is not NAME=VALUE")
        if name in values:
            first = next(p for p in pairs if p.partition("=")[0] == name)
            _fail_usage(f"--set {first} and --set {pair} both give input {name!r}: give it once")
        try:
            values[name] = json.loads(raw)
        except ValueError:
            values[name] = raw
    return values


def read_items(path: str, over: list[str], given: dict[str, Any]) -> tuple[dict[str, list[Any]], list[str], list[int]]:
    """The JSONL file's lines as per-item values: every key a line holds is that item's input (a
    key left out of `--map-over` used to be dropped, and the node took its default instead), so
    each line holds the same keys; maps over those keys, and over the --map-over names `given` with
    --set (`alongside` checks their lists). No line: no item (`{}`, None). With each item, its line's
    number in the file: blank lines are skipped, so item N is not line N+1 where the file has any."""
    columns: dict[str, list[Any]] = {}
    try:
        text = _utf8(path, Path(path).read_bytes())
    except OSError as exc:
        _fail_usage(f"--inputs {path}: {exc.strerror}")
    keys: list[str] | None = None
    numbers: list[int] = []  # each item's line (JSON Lines ends lines at \n alone: a string may hold U+2028)
    for number, line in ((n, ln) for n, ln in enumerate(text.split("\n"), 1) if ln.strip()):
        row = _row(path, number, line)
        keys = keys if keys is not None else list(row)
        missing = [name for name in over if name not in row and name not in given]
        if missing:
            _fail_usage(f"--inputs {path} line {number} has no {missing} (each line needs every --map-over name "
                        "not given with --set)")
        if set(row) != set(keys):
            _fail_usage(f"--inputs {path} line {number} holds {sorted(row)}, line {numbers[0]} {sorted(keys)}: each "
                        "line holds the same inputs, one value each per item (give the others with --set)")
        for name in keys:
            columns.setdefault(name, []).append(row[name])
        numbers.append(number)
    if keys is None:
        return columns, over, numbers
    return columns, keys + [name for name in over if name not in keys], numbers


def _row(path: str, number: int, line: str) -> dict[str, Any]:
    """Line `number` of the --inputs file as one item's inputs: a usage error where it is not a JSON object."""
    try:
        row = json.loads(line)
    except ValueError as exc:
        _fail_usage(f"--inputs {path} line {number} is not JSON: {exc}")
    if not isinstance(row, dict) or not row:
        _fail_usage(f"--inputs {path} line {number} is not a JSON object of input values (one item's inputs)")
    return row


def _utf8(path: str, raw: bytes) -> str:
    """The --inputs file as UTF-8, JSON's encoding (a byte order mark skipped, as RFC 8259 allows: PowerShell's
    `Out-File -Encoding utf8` writes one); other text (`>` in PowerShell writes UTF-16) is a usage error."""
    try:
        return raw.removeprefix(b"\xef\xbb\xbf").decode("utf-8")
    except UnicodeDecodeError as exc:
        utf16, line = raw[:2] in (b"\xff\xfe", b"\xfe\xff"), exc.object.count(b"\n", 0, exc.start) + 1
        what = "UTF-16 text (as PowerShell's > writes it)" if utf16 else \
            f"not UTF-8 text (byte 0x{exc.object[exc.start]:02x} on line {line})"
        _fail_usage(f"--inputs {path} is {what}: JSON lines are read as UTF-8; save it as UTF-8 (PowerShell: "
                    f"Out-File -Encoding utf8; elsewhere: iconv -f {'UTF-16' if utf16 else 'ITS-ENCODING'} -t UTF-8)")


def alongside(values: dict[str, Any], mapped: list[str], inputs: str, items: int) -> None:
    """A --set list mapped over alongside --inputs gives one value per line of the file, in order:
    a usage error, before anything runs, where it is not a list of as many values."""
    for name in mapped:
        value = values[name]
        if not isinstance(value, list):
            _fail_usage(f"--map-over {name} names --set {name}, which is one value, not a list: drop {name} from "
                        f"--map-over (every item then takes it), or give a list of one value per item of --inputs "
                        f"{inputs} ({items})")
        if len(value) != items:
            _fail_usage(f"--map-over {name} names --set {name}, a list of {len(value)} value(s), and --inputs {inputs} "
                        f"holds {items} item(s): a list mapped over alongside --inputs gives one value per item, in "
                        f"the file's order; give {items} values, or put {name} in each line of {inputs} instead")
