"""How a run report is shown: the terminal tables (rich) and the self-contained HTML page.

Both render the report's plain data (`RunReport.data`, the JSON), never the live recording, so a
report written by another process renders the same (`hardy report run.json`) — and a report file
is data written by whoever wrote it (checked first: `report_schema.py`). So the page is text, never
markup of the file's: every string is escaped, the DAG's drawing is rebuilt from an allow-list
(`report_schema.drawing`), and a Content-Security-Policy, first in the page, forbids scripts,
frames, forms and anything fetched. The terminal is given text too: control characters (escape
sequences that retitle, rewrite or hyperlink a terminal; bidirectional overrides that reorder what
is shown) are written as escapes, and rich markup in a string (`[link=...]`) is shown, not obeyed.
"""

from __future__ import annotations

import re
from typing import Any

from .report_schema import drawing

FAILURES_SHOWN = 100  # failures the tables and the page show, and whose stacks are kept: every one is listed


_BATCH_COLUMNS = ("node", "calls", "items", "items per call (mean / min / max)", "total", "mean per call",
                  "p95 per call")


def _batch_row(b: dict[str, Any]) -> tuple[str, ...]:
    return (f"{b['calls']:,}", f"{b['items']:,}", f"{b['size_mean']:,.1f} / {b['size_min']} / {b['size_max']}",
            _ms(b["total_s"]), _ms(b["mean_s"]), _ms(b["p95_s"]))


def _more(failures: list[dict[str, Any]]) -> str:
    return (f"... and {len(failures) - FAILURES_SHOWN:,} more failures (every one is in the report's JSON, "
            "with item, node, error and message)")


_CONTROL = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u200e\u200f\u202a-\u202e\u2066-\u2069\u2028\u2029]")


def shown(text: str) -> str:
    """`text` as a terminal may be given it: each control character (but newline and tab) written as
    its escape, `\\x1b`, so nothing in a report moves the cursor, retitles or hyperlinks the terminal."""
    return _CONTROL.sub(lambda m: repr(m.group())[1:-1], text)


def _cell(text: str) -> str:
    """A table cell: shown, and rich's markup escaped."""
    from rich.markup import escape
    return escape(shown(text))


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:,.2f} ms"


def _mib(size: int | None) -> str:
    """Bytes as MiB; a dash where unknown (a node run in this process, or by workers gone at the end)."""
    return f"{size / 2**20:,.0f} MiB" if size else "—"


def _headline(d: dict[str, Any]) -> str:
    w = d["workers"]
    unrun = d["items"] - d["succeeded"] - d["failed"]  # a map that raised at its first failure
    text = (f"{d['kind']} of {d['pipeline']!r} on {d['engine']}: {d['succeeded']} of {d['items']} items ok, "
            f"{d['failed']} failed{f', {unrun} not run' if unrun > 0 else ''}, {d['wall_s']:.3f} s wall, "
            f"{d['items_per_s']:,.1f} items/s")
    if w.get("started"):
        text += f"; workers started {w['started']}, died {w['died']}, recycled {w['recycled']}"
    return text


def rich_tables(d: dict[str, Any]) -> Any:
    """The report as rich renderables, in order: the headline, then the tables of nodes, batched
    nodes and failures (`print(report)`, `hardy report`)."""
    from rich.table import Table
    from rich.text import Text

    yield Text(shown(_headline(d)))
    nodes = Table(title="nodes")
    for col in ("node", "calls", "cache hits", "failures", "total", "mean", "p95", "peak worker RSS"):
        nodes.add_column(col, justify="left" if col == "node" else "right")
    for n in d["nodes"]:
        nodes.add_row(_cell(n["name"]), str(n["calls"]), str(n["cached"]), str(n["failures"]),
                      _ms(n["total_s"]), _ms(n["mean_s"]), _ms(n["p95_s"]), _mib(n.get("peak_rss")))
    if d["nodes"]:
        yield nodes
    else:  # a map's light report: nothing instrumented its nodes
        yield "(per-node statistics and the timeline: Engine(report=True))"
    batched = [n for n in d["nodes"] if n.get("batches")]
    if batched:
        table = Table(title="batched nodes: per call")
        for col in _BATCH_COLUMNS:
            table.add_column(col, justify="left" if col == "node" else "right")
        for n in batched:
            table.add_row(_cell(n["name"]), *_batch_row(n["batches"]))
        yield table
    if d["failures"]:
        fails = Table(title="failures")
        for col in ("item", "node", "error", "signal", "message"):
            fails.add_column(col)
        for f in d["failures"][:FAILURES_SHOWN]:
            fails.add_row(str(f["item"]), _cell(f["node"]), _cell(f["error"]), _cell(f["signal"] or ""),
                          _cell(f["message"].splitlines()[0] if f["message"] else ""))
        yield fails
        if len(d["failures"]) > FAILURES_SHOWN:
            yield Text(_more(d["failures"]))


# --- the HTML page ---------------------------------------------------------------------------

_CSS = """
body{font-family:Helvetica,Arial,'DejaVu Sans',sans-serif;margin:24px;color:#0f172a;background:#fff}
h1{font-size:20px;margin:0 0 4px} h2{font-size:16px;margin:24px 0 8px}
table{border-collapse:collapse;font-size:13px} td,th{padding:4px 10px;border-bottom:1px solid #e2e8f0;text-align:left}
th{background:#f1f5f9} td.n{text-align:right;font-variant-numeric:tabular-nums}
.bar{background:#3b82f6;height:10px;display:inline-block}
table.fail th{background:#fecaca} pre{font-size:12px;background:#f8fafc;padding:8px;white-space:pre-wrap;margin:4px 0}
.summary{color:#334155;font-size:14px} .dag{overflow:auto;border:1px solid #e2e8f0;padding:8px;display:inline-block}
"""


CSP = ("default-src 'none'; style-src 'unsafe-inline'; img-src data:; base-uri 'none'; form-action 'none'; "
       "frame-src 'none'")


def to_html(d: dict[str, Any]) -> str:
    """The report as one HTML page, viewable offline (`report.save("run.html")`, notebooks)."""
    import html
    e = html.escape
    parts = [f"<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\"><meta http-equiv=\"Content-Security-Policy\" "
             f"content=\"{CSP}\"><title>hardy report: {e(d['pipeline'])}</title><style>{_CSS}</style></head><body>",
             f"<h1>{e(d['pipeline'])}</h1><p class=\"summary\">{e(_headline(d))}<br>started {e(d['started_at'])}</p>",
             "<h2>pipeline</h2>", _dag_html(d["dag"]), "<h2>time per node</h2>", _nodes_html(d["nodes"]),
             "<h2>timeline of items per worker</h2>", _timeline_svg(d["timeline"], d["wall_s"]),
             f"<h2>failures ({len(d['failures'])})</h2>", _failures_html(d["failures"]), "</body></html>\n"]
    return "\n".join(parts)


def _dag_html(dag: dict[str, Any]) -> str:
    import html
    svg = drawing(dag["svg"]) if dag.get("svg") else None  # rebuilt: nothing of the file's markup but shapes
    if svg:
        return f"<div class=\"dag\">{svg}</div>"
    return "<ol>" + "".join(f"<li>{html.escape(n)}</li>" for n in dag["nodes"]) + "</ol>"


def _px(value: float) -> int:
    """A coordinate, bounded: a report's numbers are the file's, and no page needs more than this."""
    return round(min(max(value, -1e6), 1e6))


def _nodes_html(nodes: list[dict[str, Any]]) -> str:
    import html
    e = html.escape
    longest = max((n["total_s"] for n in nodes), default=0.0) or 1.0
    rows = ["<table><tr><th>node</th><th>calls</th><th>cache hits</th><th>failures</th><th>total</th>"
            "<th>mean</th><th>p95</th><th>peak worker RSS</th><th></th></tr>"]
    for n in nodes:
        width = max(1, _px(300 * (n["total_s"] / longest)))
        rows.append(f"<tr><td>{e(n['name'])}</td><td class=n>{int(n['calls'])}</td><td class=n>{int(n['cached'])}</td>"
                    f"<td class=n>{int(n['failures'])}</td><td class=n>{_ms(n['total_s'])}</td>"
                    f"<td class=n>{_ms(n['mean_s'])}</td><td class=n>{_ms(n['p95_s'])}</td>"
                    f"<td class=n>{_mib(n.get('peak_rss'))}</td>"
                    f"<td><span class=bar style=\"width:{width}px\"></span></td></tr>")
    if not nodes:
        rows.append("<tr><td colspan=9>no node events were recorded</td></tr>")
    rows.append("</table>")
    batched = [n for n in nodes if n.get("batches")]
    if batched:
        rows.append("<h2>batched nodes: per call</h2><table><tr>" + "".join(f"<th>{c}</th>" for c in _BATCH_COLUMNS)
                    + "</tr>")
        rows += [f"<tr><td>{e(n['name'])}</td>" + "".join(f"<td class=n>{e(c)}</td>" for c in _batch_row(n["batches"]))
                 + "</tr>" for n in batched]
        rows.append("</table>")
    return "".join(rows)


def _timeline_svg(timeline: list[list[Any]], wall: float) -> str:
    import html
    e = html.escape
    lanes = sorted({t[1] for t in timeline})
    if not lanes:
        return "<p>no items</p>"
    row, left, width = 18, 110, 800
    scale = width / max(wall, max(t[3] for t in timeline), 1e-9)
    out = [f"<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{left + width + 10}\" "
           f"height=\"{row * len(lanes) + 24}\" font-size=\"11\" shape-rendering=\"crispEdges\">"]
    lane_of = {name: k for k, name in enumerate(lanes)}
    for name, k in lane_of.items():
        out.append(f"<text x=\"0\" y=\"{k * row + 13}\">{e(name)}</text>")
    for i, worker, start, end, ok in timeline:
        x, w = _px(left + start * scale), max(2, _px((end - start) * scale))
        colour = "#22c55e" if ok else "#ef4444"
        out.append(f"<rect x=\"{x}\" y=\"{lane_of[worker] * row + 2}\" width=\"{w}\" height=\"{row - 4}\" "
                   f"fill=\"{colour}\"><title>item {int(i)}: {_ms(end - start)}</title></rect>")
    out.append(f"<text x=\"{left}\" y=\"{row * len(lanes) + 18}\">0 s</text>"
               f"<text x=\"{left + width - 40}\" y=\"{row * len(lanes) + 18}\">{wall:.3f} s</text></svg>")
    return "".join(out)


def _failures_html(failures: list[dict[str, Any]]) -> str:
    import html
    if not failures:
        return "<p>none</p>"
    e = html.escape
    rows = ["<table class=fail><tr><th>item</th><th>node</th><th>error</th><th>signal</th><th>message</th></tr>"]
    for f in failures[:FAILURES_SHOWN]:
        stack = f"<details><summary>stack</summary><pre>{e(f['stack'])}</pre></details>" if f["stack"] else ""
        rows.append(f"<tr><td class=n>{int(f['item'])}</td><td>{e(f['node'])}</td><td>{e(f['error'])}</td>"
                    f"<td>{e(f['signal'] or '')}</td><td><pre>{e(f['message'])}</pre>{stack}</td></tr>")
    more = f"<p>{_more(failures)}</p>" if len(failures) > FAILURES_SHOWN else ""
    return "".join(rows) + "</table>" + more
