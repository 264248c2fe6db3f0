"""Drawing a pipeline: inputs (bound ones marked), nodes, outputs, nested pipelines and map_over.

`Pipeline.visualize()` returns a `Drawing`. Notebooks display it (`_repr_svg_`, `_repr_html_`);
`save()` writes .svg, .png, .html or .dot. The picture is described once, as a small graph of
boxes and labelled edges (`Scene`), and then either handed to a system Graphviz `dot` when one is
installed, or laid out here with grandalf's Sugiyama layout (pure Python) and written as SVG, with
PNG from resvg (a self-contained Rust wheel): `pip install "hardy[viz]"` is enough on a machine
without Graphviz or Cairo. Why these libraries: docs/architecture.md ("Drawings without Graphviz").
"""

from __future__ import annotations

import html
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from ..errors import InvalidArgument, install_hint

if TYPE_CHECKING:
    from .nesting import PipelineNode
    from .pipeline import Pipeline

_FONT_SIZE = 13
_CHAR_W = 7.6  # average glyph width at that size (Helvetica / DejaVu Sans), for box sizes
_LINE_H = 17


@dataclass(frozen=True)
class Theme:
    """Colours of a drawing (HyperNodes calls this GraphvizTheme)."""

    function: str = "#dbeafe"
    pipeline: str = "#ede9fe"
    input: str = "#dcfce7"
    bound: str = "#f3f4f6"
    output: str = "#fef3c7"
    border: str = "#334155"
    edge: str = "#475569"
    text: str = "#0f172a"
    cluster: str = "#f5f3ff"
    background: str = "#ffffff"
    font: str = "Helvetica, Arial, DejaVu Sans, sans-serif"


STYLES: dict[str, Theme] = {
    "default": Theme(),
    "dark": Theme(function="#1e3a8a", pipeline="#4c1d95", input="#14532d", bound="#374151",
                  output="#78350f", border="#cbd5e1", edge="#94a3b8", text="#f8fafc", cluster="#1e1b4b",
                  background="#0f172a"),
}


@dataclass
class Box:
    """One drawn element: a node, an input, an output or a collapsed pipeline."""

    id: str
    lines: list[str]
    kind: str  # function | pipeline | input | bound | output
    cluster: str = ""  # the expanded nested pipeline it sits in ("" = top level)
    x: float = 0.0
    y: float = 0.0

    @property
    def width(self) -> float:
        return max(len(s) for s in self.lines) * _CHAR_W + 24

    @property
    def height(self) -> float:
        return len(self.lines) * _LINE_H + 14


@dataclass
class Scene:
    """What to draw: boxes, edges (source id, target id, value name) and expanded pipelines."""

    name: str
    boxes: dict[str, Box] = field(default_factory=dict)
    edges: list[tuple[str, str, str]] = field(default_factory=list)
    clusters: dict[str, str] = field(default_factory=dict)  # cluster id -> its label
    routes: dict[int, list[tuple[float, float]]] = field(default_factory=dict)  # edge index -> points


def scene(pipeline: Pipeline, depth: int | None = 1) -> Scene:
    """The pipeline as boxes and edges; nested pipelines expanded `depth - 1` levels (None: all)."""
    s = Scene(pipeline.name)
    sources = {}
    for name in pipeline.graph.root_inputs:
        bound = name in pipeline.bound_inputs
        box = Box(f"input:{name}", [f"{name} (bound)" if bound else name], "bound" if bound else "input")
        s.boxes[box.id] = box
        sources[name] = box.id
    produced = _add(s, pipeline, "", depth, sources)
    consumed = {i for n in pipeline.graph.nodes for i in n.inputs}
    for name in pipeline.graph.outputs:
        if name not in consumed and name in produced:
            box = Box(f"output:{name}", [name], "output")
            s.boxes[box.id] = box
            s.edges.append((produced[name], box.id, name))
    merged: dict[tuple[str, str], list[str]] = {}  # one arrow per pair of boxes, naming every value
    for a, b, value in s.edges:
        merged.setdefault((a, b), []).append(value)
    s.edges = [(a, b, ", ".join(values)) for (a, b), values in merged.items()]
    return s


def _add(s: Scene, pipeline: Pipeline, prefix: str, depth: int | None, sources: dict[str, str],
         bound: frozenset[str] = frozenset()) -> dict[str, str]:
    """Boxes and edges of `pipeline`'s nodes; returns {value name: id of the box producing it}.
    `bound` inputs (of a nested pipeline) are written in their consumers' boxes rather than drawn
    as boxes of their own, which would sit inside the nested pipeline's frame beside the outer
    pipeline's inputs."""
    sources = dict(sources)
    for n in pipeline.graph.order:
        nested = getattr(n, "pipeline", None) is not None  # a PipelineNode (drawn without importing it)
        if nested and (depth is None or depth > 1):
            sources.update(_expand(s, n, prefix, depth, sources))
            continue
        lines = [n.name, "→ " + ", ".join(n.outputs)]
        if bound.intersection(n.inputs):
            lines.append("bound: " + ", ".join(i for i in n.inputs if i in bound))
        if nested and (pn := cast("PipelineNode", n)).map_over:
            outer = {inner: outer for outer, inner in pn.inner_inputs.items()}
            lines.append("map over: " + ", ".join(outer[m] for m in pn.map_over))
        box = Box(prefix + n.name, lines, "pipeline" if nested else "function",
                  prefix.rstrip("/"))
        s.boxes[box.id] = box
        for i in n.inputs:
            if i in sources:
                s.edges.append((sources[i], box.id, i))
        for o in n.outputs:
            sources[o] = box.id
    return sources


def _expand(s: Scene, n: Any, prefix: str, depth: int | None, sources: dict[str, str]) -> dict[str, str]:
    """A nested pipeline drawn inside a labelled frame; returns the outer names it produces."""
    inner = n.pipeline
    cluster = prefix + n.name
    outer_names = {i: o for o, i in n.inner_inputs.items()}
    label = f"{n.name} (map over: {', '.join(outer_names[m] for m in n.map_over)})" if n.map_over else n.name
    s.clusters[cluster] = label
    inner_sources = {i: sources[o] for o, i in n.inner_inputs.items() if o in sources}
    produced = _add(s, inner, cluster + "/", None if depth is None else depth - 1, inner_sources,
                    frozenset(inner.bound_inputs))
    return {outer: produced[i] for i, outer in zip(n.inner_outputs, n.outputs) if i in produced}


# --- output formats ------------------------------------------------------------------------------


def to_dot(sc: Scene, theme: Theme, orient: str = "TB") -> str:
    """Graphviz source, with expanded pipelines as clusters."""
    def q(text: str) -> str:
        return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'

    def node_line(b: Box) -> str:
        shape = {"input": "ellipse", "bound": "ellipse", "output": "note"}.get(b.kind, "box")
        style = "filled,rounded,dashed" if b.kind == "bound" else "filled,rounded"
        peripheries = 2 if b.kind == "pipeline" else 1
        return (f"{q(b.id)} [label={q(chr(10).join(b.lines))}, shape={shape}, style={q(style)}, "
                f"fillcolor={q(getattr(theme, b.kind))}, peripheries={peripheries}];")

    lines = [f"digraph {q(sc.name)} {{", f"  rankdir={orient}; bgcolor={q(theme.background)};",
             f"  graph [fontname={q(theme.font.split(',')[0])}, fontsize=12, fontcolor={q(theme.text)}];",
             f"  node [fontname={q(theme.font.split(',')[0])}, fontsize=12, color={q(theme.border)}, "
             f"fontcolor={q(theme.text)}];",
             f"  edge [color={q(theme.edge)}, fontcolor={q(theme.edge)}, fontsize=10];"]
    numbers = {cid: k for k, cid in enumerate(sc.clusters)}

    def frame(cid: str, indent: str) -> None:
        """The boxes of frame `cid` ("" = top level), then the frames nested in it, recursively."""
        lines.extend(indent + node_line(b) for b in sc.boxes.values() if b.cluster == cid)
        for child in sc.clusters:
            if child.rpartition("/")[0] == cid:
                lines.append(f"{indent}subgraph cluster_{numbers[child]} {{ label={q(sc.clusters[child])}; "
                             f"style=\"filled,rounded\"; fillcolor={q(theme.cluster)};")
                frame(child, indent + "  ")
                lines.append(indent + "}")

    frame("", "  ")
    lines += [f"  {q(a)} -> {q(b)} [label={q(v)}];" for a, b, v in sc.edges]
    lines.append("}")
    return "\n".join(lines) + "\n"


def layout(sc: Scene, orient: str = "TB") -> tuple[float, float]:
    """Places every box and edge route; returns the drawing's width and height."""
    pad = 30.0 + (_LINE_H + 12) * _nesting(sc)  # room for the frames of expanded pipelines
    if not sc.boxes:
        return 2 * pad, 2 * pad
    centres, routes = _sugiyama(sc, orient in ("LR", "RL"))

    def turn(point: tuple[float, float]) -> tuple[float, float]:
        x, y = (point[1], point[0]) if orient in ("LR", "RL") else point
        return (-x if orient == "RL" else x, -y if orient == "BT" else y)

    for bid, xy in centres.items():
        sc.boxes[bid].x, sc.boxes[bid].y = turn(xy)
    left = min(b.x - b.width / 2 for b in sc.boxes.values()) - pad
    top = min(b.y - b.height / 2 for b in sc.boxes.values()) - pad
    for b in sc.boxes.values():
        b.x, b.y = b.x - left, b.y - top
    sc.routes = {k: [(x - left, y - top) for x, y in map(turn, points)] for k, points in enumerate(routes)}
    return (max(b.x + b.width / 2 for b in sc.boxes.values()) + pad,
            max(b.y + b.height / 2 for b in sc.boxes.values()) + pad)


def _sugiyama(sc: Scene, across: bool) -> tuple[dict[str, tuple[float, float]], list[list[tuple[float, float]]]]:
    """grandalf's layered layout, top to bottom (`across`: boxes measured turned by 90 degrees):
    each box's centre, and each edge's bend points; separate components side by side."""
    try:
        from grandalf.graphs import Edge, Graph, Vertex
        from grandalf.layouts import SugiyamaLayout
    except ImportError as exc:
        raise ImportError(f"drawing a pipeline without a system Graphviz needs grandalf: {install_hint('viz')} "
                          "(or install Graphviz's `dot`)") from exc

    class View:  # what grandalf reads (w, h) and writes (xy, setpath)
        def __init__(self, w: float = 0.0, h: float = 0.0):
            self.w, self.h, self.xy = w, h, (0.0, 0.0)
            self.points: list[tuple[float, float]] = []

        def setpath(self, points: list[tuple[float, float]]) -> None:
            self.points = list(points)

    vertices = {}
    for bid, box in sc.boxes.items():
        vertices[bid] = Vertex(bid)
        vertices[bid].view = View(*((box.height, box.width) if across else (box.width, box.height)))
    edges = [Edge(vertices[a], vertices[b]) for a, b, _ in sc.edges]
    for e in edges:
        e.view = View()
    offset = 0.0
    for component in Graph(list(vertices.values()), edges).C:
        sug = SugiyamaLayout(component)
        sug.xspace, sug.yspace = 40, 60 + 20 * _nesting(sc)
        sug.init_all()
        sug.draw()
        shift = offset - min(v.view.xy[0] - v.view.w / 2 for v in component.sV)
        for v in component.sV:
            v.view.xy = (v.view.xy[0] + shift, v.view.xy[1])
        for e in component.sE:
            e.view.points = [(x + shift, y) for x, y in e.view.points]
        offset = max(v.view.xy[0] + v.view.w / 2 for v in component.sV) + 60
    return {bid: v.view.xy for bid, v in vertices.items()}, [e.view.points[1:-1] for e in edges]


def _nesting(sc: Scene) -> int:
    return max((c.count("/") + 1 for c in sc.clusters), default=0)


def to_svg(sc: Scene, theme: Theme, orient: str = "TB") -> str:
    """The drawing as SVG, laid out here (no Graphviz needed). Every box is a <g class="node">
    with an id and a <title>, every edge a <g class="edge"> titled "source->target", as Graphviz
    writes them, so tools that read one read the other."""
    width, height = layout(sc, orient)
    e = html.escape
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width:.0f}" height="{height:.0f}" '
           f'viewBox="0 0 {width:.0f} {height:.0f}" font-family="{e(theme.font)}" font-size="{_FONT_SIZE}">',
           f"<title>{e(sc.name)}</title>",
           f'<rect width="100%" height="100%" fill="{theme.background}"/>',
           '<defs><marker id="arrow" viewBox="0 0 10 10" refX="10" refY="5" markerWidth="8" markerHeight="8" '
           f'orient="auto-start-reverse"><path d="M0,0 L10,5 L0,10 z" fill="{theme.edge}"/></marker></defs>']
    for cid in sorted(sc.clusters, key=lambda c: c.count("/")):
        members = [b for b in sc.boxes.values() if b.cluster == cid or b.cluster.startswith(cid + "/")]
        if not members:
            continue
        levels = 1 + max((c.count("/") - cid.count("/") for c in sc.clusters if c.startswith(cid + "/")),
                         default=0)  # frames inside this one: each needs room for its own label
        x0 = min(b.x - b.width / 2 for b in members) - 12 * levels
        y0 = min(b.y - b.height / 2 for b in members) - (_LINE_H + 14) * levels
        x1 = max(b.x + b.width / 2 for b in members) + 12 * levels
        y1 = max(b.y + b.height / 2 for b in members) + 12 * levels
        out.append(f'<g class="cluster" id="{e(cid)}"><title>{e(cid)}</title>'
                   f'<rect x="{x0:.1f}" y="{y0:.1f}" width="{x1 - x0:.1f}" height="{y1 - y0:.1f}" rx="10" '
                   f'fill="{theme.cluster}" stroke="{theme.border}" stroke-dasharray="4 3"/>'
                   f'<text x="{x0 + 8:.1f}" y="{y0 + _LINE_H - 2:.1f}" fill="{theme.text}" font-weight="bold">'
                   f"{e(sc.clusters[cid])}</text></g>")
    for k, (a, b, value) in enumerate(sc.edges):
        out.append(_svg_edge(sc.boxes[a], sc.boxes[b], sc.routes.get(k, []), value, theme, orient))
    for box in sc.boxes.values():
        out.append(_svg_box(box, theme))
    out.append("</svg>")
    return "\n".join(out) + "\n"


def _svg_edge(a: Box, b: Box, via: list[tuple[float, float]], value: str, theme: Theme, orient: str) -> str:
    """An arrow from box a's border to box b's, through the layout's bend points, as smooth curves."""
    e = html.escape
    across = orient in ("LR", "RL")
    if across:
        sign = 1 if b.x >= a.x else -1
        points = [(a.x + sign * a.width / 2, a.y), *via, (b.x - sign * b.width / 2, b.y)]
    else:
        sign = 1 if b.y >= a.y else -1
        points = [(a.x, a.y + sign * a.height / 2), *via, (b.x, b.y - sign * b.height / 2)]
    path = [f"M{points[0][0]:.1f},{points[0][1]:.1f}"]
    for (x1, y1), (x2, y2) in zip(points, points[1:]):
        if across:
            path.append(f"C{(x1 + x2) / 2:.1f},{y1:.1f} {(x1 + x2) / 2:.1f},{y2:.1f} {x2:.1f},{y2:.1f}")
        else:
            path.append(f"C{x1:.1f},{(y1 + y2) / 2:.1f} {x2:.1f},{(y1 + y2) / 2:.1f} {x2:.1f},{y2:.1f}")
    (x1, y1), (x2, y2) = points[-2], points[-1]
    lx, ly = ((x1 + x2) / 2, (y1 + y2) / 2 - 5) if across else ((x1 + x2) / 2 + 5, (y1 + y2) / 2)
    return (f'<g class="edge"><title>{e(a.id)}-&gt;{e(b.id)}</title>'
            f'<path d="{" ".join(path)}" fill="none" stroke="{theme.edge}" stroke-width="1.4" '
            f'marker-end="url(#arrow)"/>'
            f'<text x="{lx:.1f}" y="{ly:.1f}" fill="{theme.edge}" font-size="11">{e(value)}</text></g>')


def _svg_box(b: Box, theme: Theme) -> str:
    e = html.escape
    x, y, w, h = b.x - b.width / 2, b.y - b.height / 2, b.width, b.height
    fill = getattr(theme, b.kind)
    if b.kind in ("input", "bound"):
        dash = ' stroke-dasharray="5 3"' if b.kind == "bound" else ""
        shape = (f'<ellipse cx="{b.x:.1f}" cy="{b.y:.1f}" rx="{w / 2:.1f}" ry="{h / 2:.1f}" fill="{fill}" '
                 f'stroke="{theme.border}"{dash}/>')
    else:
        double = (f'<rect x="{x + 3:.1f}" y="{y + 3:.1f}" width="{w - 6:.1f}" height="{h - 6:.1f}" rx="5" '
                  f'fill="none" stroke="{theme.border}"/>') if b.kind == "pipeline" else ""
        shape = (f'<rect x="{x:.1f}" y="{y:.1f}" width="{w:.1f}" height="{h:.1f}" rx="7" fill="{fill}" '
                 f'stroke="{theme.border}"/>{double}')
    bold = ' font-weight="bold"' if b.kind in ("function", "pipeline") else ""  # the node's name, line 1
    text = "".join(
        f'<text x="{b.x:.1f}" y="{y + 3 + (k + 1) * _LINE_H:.1f}" text-anchor="middle" fill="{theme.text}"'
        f'{bold if k == 0 else ""}>{e(line)}</text>' for k, line in enumerate(b.lines))
    return f'<g class="node {b.kind}" id="{e(b.id)}"><title>{e(b.id)}</title>{shape}{text}</g>'


class Drawing:
    """A pipeline's picture. Displays itself in notebooks; `save(path)` picks the format by suffix."""

    def __init__(self, sc: Scene, theme: Theme, orient: str = "TB", use_dot: bool | None = None):
        self.scene, self.theme, self.orient = sc, theme, orient
        self.dot_binary = shutil.which("dot") if use_dot is not False else None
        self._svg: str | None = None

    @property
    def dot(self) -> str:
        return to_dot(self.scene, self.theme, self.orient)

    @property
    def svg(self) -> str:
        if self._svg is None:
            self._svg = self._dot_render("svg").decode() if self.dot_binary else to_svg(
                self.scene, self.theme, self.orient)
        return self._svg

    def _dot_render(self, fmt: str) -> bytes:
        assert self.dot_binary
        return subprocess.run([self.dot_binary, f"-T{fmt}"], input=self.dot.encode(), capture_output=True,
                              check=True).stdout

    @property
    def png(self) -> bytes:
        if self.dot_binary:
            return self._dot_render("png")
        try:
            import resvg_py
        except ImportError as exc:
            raise ImportError(f"saving a pipeline drawing as PNG needs resvg: {install_hint('viz')}") from exc
        return bytes(resvg_py.svg_to_bytes(svg_string=self.svg, background=self.theme.background, zoom=2))

    @property
    def html(self) -> str:
        e = html.escape
        return ("<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\">"
                f"<title>{e(self.scene.name)}</title></head>\n"
                f'<body style="margin:0;padding:16px;background:{self.theme.background}">\n{self.svg}</body></html>\n')

    def save(self, path: str | Path) -> Path:
        """Writes .svg, .png, .html or .dot (by the file's suffix); returns the path."""
        path = Path(path)
        suffix = path.suffix.lower()
        if suffix == ".png":
            path.write_bytes(self.png)
        elif suffix in (".svg", ".html", ".dot"):
            path.write_text(getattr(self, suffix[1:]), encoding="utf-8")
        else:
            raise InvalidArgument(f"cannot save a pipeline drawing as {path.name!r}: use a .svg, .png, .html or .dot "
                             "file name.")
        return path

    def _repr_svg_(self) -> str:
        return self.svg

    def _repr_html_(self) -> str:
        return self.svg

    def __repr__(self) -> str:
        return (f"<Drawing of pipeline {self.scene.name!r}: {len(self.scene.boxes)} boxes, "
                f"{len(self.scene.edges)} edges>")


def visualize(pipeline: Pipeline, filename: str | Path | None = None, depth: int | None = 1,
              orient: str = "TB", style: str | Theme = "default", use_dot: bool | None = None) -> Drawing:
    """Draw `pipeline`. `depth=1` shows nested pipelines as one box, `depth=2` opens them one level,
    `None` opens all. `orient` is TB, LR, BT or RL; `style` a name in STYLES or a Theme.
    `use_dot=False` skips a system Graphviz even when one is installed."""
    if orient not in ("TB", "LR", "BT", "RL"):
        raise InvalidArgument(f"visualize(orient={orient!r}): use 'TB', 'LR', 'BT' or 'RL'.")
    if depth is not None and depth < 1:
        raise InvalidArgument(f"visualize(depth={depth}): depth counts levels from 1 (collapsed); None opens all.")
    if isinstance(style, str):
        if style not in STYLES:
            raise InvalidArgument(f"visualize(style={style!r}): known styles are {sorted(STYLES)}, or pass a Theme.")
        theme = STYLES[style]
    else:
        theme = style
    drawing = Drawing(scene(pipeline, depth), theme, orient, use_dot)
    if filename is not None:
        drawing.save(filename)
    return drawing


__all__ = ["visualize", "Drawing", "Theme", "STYLES", "scene", "to_dot", "to_svg"]
