"""What a run report file may hold: the schema `RunReport.load` checks, and the drawing's SVG, rebuilt.

A report file is data written by whoever wrote it (a CI artifact, a teammate's `report_dir`), so
`hardy report` treats it as such: `check` accepts only the shape hardy writes (each field's type;
numbers finite, integers within 64 bits, so that no rendering overflows) and names the first field
that is not (`failures[3].item: expected an integer, got '<meta ...>'`), before anything renders.
Keys hardy does not know are allowed (a newer hardy's) and never rendered; those the renderings do
not use may be missing (an older hardy's report).

The DAG's drawing is SVG markup, the one field that cannot simply be escaped: `drawing` parses it
and writes it again from an allow-list (shapes, text, titles, markers; their geometry and paint;
`url(#id)` references only), so no script, handler, link, style sheet, foreign object or external
reference of the file's survives into the page, whatever the file holds.

Checked by hand rather than with jsonschema: the schema is small and fixed, the errors name the
field in the report's own terms, and jsonschema would bring attrs, referencing and rpds-py (a
compiled extension) into `hardy report` for a hundred lines.
"""

from __future__ import annotations

import math
import re
from typing import Any

from ..errors import InvalidArgument

INT, NUM, STR, BOOL = "an integer", "a number", "a string", "true or false"
OPTIONAL = "?"  # a key that may be missing: "?name"

BATCHES = {"calls": INT, "items": INT, "size_mean": NUM, "size_min": INT, "size_max": INT, "total_s": NUM,
           "mean_s": NUM, "p95_s": NUM}
NODE = {"name": STR, "calls": INT, "cached": INT, "failures": INT, "total_s": NUM, "mean_s": NUM, "p95_s": NUM,
        "?peak_rss": (INT, None), "?batches": BATCHES}
FAILURE = {"item": INT, "node": STR, "error": STR, "message": STR, "signal": (STR, None), "?exitcode": (INT, None),
           "stack": STR, "?diagnosis": [STR], "?kept_inputs": STR}
WORKERS = {"started": INT, "died": INT, "recycled": INT, "?peak_rss": {STR: INT}}
REPORT = {"format": INT, "pipeline": STR, "kind": STR, "engine": STR, "started_at": STR, "wall_s": NUM,
          "items": INT, "failed": INT, "succeeded": INT, "items_per_s": NUM, "nodes": [NODE], "failures": [FAILURE],
          "workers": WORKERS, "timeline": [(INT, STR, NUM, NUM, BOOL)], "dag": {"svg": (STR, None), "nodes": [STR]}}


def check(data: Any, source: str) -> None:
    """Raise `InvalidArgument` naming the first field of `data` that is not as hardy writes it."""
    problem = _problem(data, REPORT, "")
    if problem is not None:
        where, expected, value = problem
        shown = repr(value)
        raise InvalidArgument(f"{source} is not a hardy run report: {where or 'the file'}: expected {expected}, "
                              f"got {shown[:80] + '...' if len(shown) > 80 else shown}")


def _problem(value: Any, spec: Any, where: str) -> tuple[str, str, Any] | None:
    """(where, what was expected, what was found) for the first mismatch, or None."""
    if isinstance(spec, str):
        return None if _is(value, spec) else (where, spec, value)
    if spec is None:
        return None if value is None else (where, "null", value)
    if isinstance(spec, list):
        if not isinstance(value, list):
            return where, "a list", value
        return next((p for k, v in enumerate(value) if (p := _problem(v, spec[0], f"{where}[{k}]"))), None)
    if isinstance(spec, tuple) and None in spec:  # one of several
        if any(_problem(value, s, where) is None for s in spec):
            return None
        return where, " or ".join("null" if s is None else str(s) for s in spec), value
    if isinstance(spec, tuple):  # a row of fixed length
        if not isinstance(value, list) or len(value) != len(spec):
            return where, f"a list of {len(spec)}", value
        return next((p for k, (v, s) in enumerate(zip(value, spec)) if (p := _problem(v, s, f"{where}[{k}]"))), None)
    return _problem_in_object(value, spec, where)


def _problem_in_object(value: Any, spec: dict[Any, Any], where: str) -> tuple[str, str, Any] | None:
    if not isinstance(value, dict):
        return where, "an object", value
    if STR in spec:  # a mapping of any keys
        return next((p for k, v in value.items() if (p := _problem(v, spec[STR], f"{where}.{k}"))), None)
    for name, sub in spec.items():
        optional = name.startswith(OPTIONAL)
        name = name.lstrip(OPTIONAL)
        at = f"{where}.{name}" if where else name
        if name not in value:
            if optional:
                continue
            return at, "a value (the field is missing)", None
        problem = _problem(value[name], sub, at)
        if problem is not None:
            return problem
    return None


def _is(value: Any, kind: str) -> bool:
    if kind == STR:
        return isinstance(value, str)
    if kind == BOOL:
        return isinstance(value, bool)
    if isinstance(value, bool):
        return False
    if kind == INT:
        return isinstance(value, int) and -2**63 <= value < 2**63
    return isinstance(value, (int, float)) and math.isfinite(value) and abs(value) < 1e15


# --- the drawing ---------------------------------------------------------------------------------

SVG = "http://www.w3.org/2000/svg"
ELEMENTS = {"svg", "g", "title", "desc", "rect", "ellipse", "circle", "polygon", "polyline", "path", "line", "text",
            "tspan", "defs", "marker"}
UNWRAPPED = {"a", "switch"}  # Graphviz wraps nodes with a URL in <a>: their content is kept, the link dropped
ATTRIBUTES = {"id", "class", "x", "y", "x1", "y1", "x2", "y2", "cx", "cy", "r", "rx", "ry", "dx", "dy", "width",
              "height", "d", "points", "transform", "viewBox", "fill", "stroke", "stroke-width", "stroke-dasharray",
              "stroke-linecap", "stroke-linejoin", "stroke-opacity", "fill-opacity", "opacity", "font-family",
              "font-size", "font-weight", "font-style", "text-anchor", "dominant-baseline", "marker-end",
              "marker-start", "markerWidth", "markerHeight", "refX", "refY", "orient", "shape-rendering",
              "preserveAspectRatio"}
_URL = re.compile(r"url\(\s*([^)]*)\)", re.IGNORECASE)
_LOCAL = re.compile(r"#[A-Za-z0-9_.:-]+")


def drawing(text: str) -> str | None:
    """The SVG `text`, rebuilt from the allow-list; None if it is not an SVG drawing at all (the
    page then lists the nodes)."""
    import xml.etree.ElementTree as ET
    if re.search(r"<!(DOCTYPE|ENTITY)", text, re.IGNORECASE):
        return None  # hardy's own drawings have neither (their prolog is cut off when recorded)
    try:
        root = ET.fromstring(text)
    except (ET.ParseError, ValueError):
        return None
    if root.tag != f"{{{SVG}}}svg":
        return None
    return "".join(_element(root, top=True))


def _element(el: Any, top: bool = False) -> list[str]:
    import html
    namespace, _, name = el.tag.rpartition("}") if isinstance(el.tag, str) else ("", "", "")
    out: list[str] = []
    if namespace.lstrip("{") == SVG and name in ELEMENTS:
        attributes = "".join(f' {key}="{html.escape(value)}"' for key, value in sorted(el.attrib.items())
                             if key in ATTRIBUTES and _harmless(value))
        out.append(f"<{name}{f' xmlns={SVG!r}' if top else ''}{attributes}>")
        out.append(html.escape(el.text or ""))
        for child in el:
            out += _element(child)
        out.append(f"</{name}>")
    elif namespace.lstrip("{") == SVG and name in UNWRAPPED:
        out.append(html.escape(el.text or ""))
        for child in el:
            out += _element(child)
    out.append(html.escape(el.tail or "") if not top else "")
    return out


def _harmless(value: str) -> bool:
    """An attribute value that references nothing outside the drawing (`url(#arrow)` only)."""
    return all(_LOCAL.fullmatch(target.strip().strip("'\"")) for target in _URL.findall(value)) and \
        "javascript:" not in value.lower()
