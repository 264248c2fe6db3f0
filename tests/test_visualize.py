"""Pipeline.visualize(): real SVG, PNG, HTML and DOT files, read back by independent parsers
(xml.etree, zlib, Graphviz's own `dot`, headless Chromium)."""

from __future__ import annotations

import os
import shutil
import struct
import subprocess
import sys
import xml.etree.ElementTree as ET
import zlib
from pathlib import Path

import pytest

from hardy import Pipeline, node

SVG = "{http://www.w3.org/2000/svg}"


@node(output_name="cleaned")
def clean(text: str) -> str:
    return text.strip().lower()


@node(output_name="word_count")
def count(cleaned: str) -> int:
    return len(cleaned.split())


@node(output_name="report")
def summarize(word_count: int, cleaned: str, lang: str) -> str:
    return f"{lang}: {word_count}"


@node(output_name="n")
def total(reports: list) -> int:
    return len(reports)


def nested() -> Pipeline:
    """outer ⊃ batch (a map over texts) ⊃ tp: two levels of nesting, one bound input inside."""
    tp = Pipeline(nodes=[clean, count], name="tp")
    analysis = Pipeline(nodes=[tp.as_node(name="tp"), summarize], name="analysis").bind(lang="en")
    batch = analysis.as_node(name="batch", input_mapping={"texts": "text"}, output_mapping={"report": "reports"},
                             map_over="texts")
    return Pipeline(nodes=[batch, total], name="outer")


def drawn(svg: str) -> tuple[set[str], set[str], set[str], str]:
    """(node ids, edges "a->b", cluster ids, all text) of an SVG, read with xml.etree."""
    root = ET.fromstring(svg)
    groups = root.iter(f"{SVG}g")
    nodes, edges, clusters = set(), set(), set()
    for g in groups:
        title = g.find(f"{SVG}title")
        kind = g.get("class", "").split()
        if title is None or not kind:
            continue
        {"node": nodes, "edge": edges, "cluster": clusters}.get(kind[0], set()).add(title.text)
    text = " ".join(t.text or "" for t in root.iter(f"{SVG}text"))
    return nodes, edges, clusters, text


def test_svg_names_every_node_input_output_and_edge():
    p = Pipeline(nodes=[clean, count, summarize], name="flat").bind(lang="en")
    nodes, edges, clusters, text = drawn(p.visualize(use_dot=False).svg)
    assert nodes == {"input:text", "input:lang", "clean", "count", "summarize", "output:report"}
    assert edges == {"input:text->clean", "clean->count", "clean->summarize", "count->summarize",
                     "input:lang->summarize", "summarize->output:report"}
    assert not clusters
    assert "lang (bound)" in text and "text" in text.split()  # bound inputs are marked, free ones are not
    assert "→ cleaned" in text and "→ word_count" in text  # every node names its outputs


def test_nested_pipeline_collapsed_then_expanded_one_and_two_levels():
    p = nested()
    nodes, edges, clusters, text = drawn(p.visualize(depth=1, use_dot=False).svg)
    assert nodes == {"input:texts", "batch", "total", "output:n"} and not clusters
    assert edges == {"input:texts->batch", "batch->total", "total->output:n"}
    assert "map over: texts" in text

    nodes, edges, clusters, text = drawn(p.visualize(depth=2, use_dot=False).svg)
    assert nodes == {"input:texts", "batch/tp", "batch/summarize", "total", "output:n"}
    assert clusters == {"batch"} and "batch (map over: texts)" in text
    assert edges == {"input:texts->batch/tp", "batch/tp->batch/summarize", "batch/summarize->total",
                     "total->output:n"}
    assert "bound: lang" in text  # the nested pipeline's bound input, in its consumer's box

    nodes, edges, clusters, _ = drawn(p.visualize(depth=None, use_dot=False).svg)
    assert nodes == {"input:texts", "batch/tp/clean", "batch/tp/count", "batch/summarize", "total", "output:n"}
    assert clusters == {"batch", "batch/tp"}
    assert {"input:texts->batch/tp/clean", "batch/tp/clean->batch/tp/count", "batch/tp/clean->batch/summarize",
            "batch/tp/count->batch/summarize"} <= edges
    assert drawn(p.visualize(depth=3, use_dot=False).svg)[0] == nodes


def test_the_drawing_matches_what_the_pipeline_runs():
    assert nested().run(inputs={"texts": [" A b", "c "]}) == {"reports": ["en: 2", "en: 1"], "n": 2}


def _png_pixels(data: bytes) -> tuple[int, int, list[bytes]]:
    """Decodes an 8-bit RGB/RGBA, non-interlaced PNG with zlib: (width, height, rows of pixels)."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, idat, header = 8, b"", None
    while pos < len(data):
        length, kind = struct.unpack(">I4s", data[pos:pos + 8])
        body = data[pos + 8:pos + 8 + length]
        if kind == b"IHDR":
            header = struct.unpack(">IIBBBBB", body)
        elif kind == b"IDAT":
            idat += body
        pos += 12 + length
    width, height, depth, color, _, _, interlace = header
    assert depth == 8 and color in (2, 6) and interlace == 0, header
    bpp = 3 if color == 2 else 4
    raw, stride, rows, prev = zlib.decompress(idat), width * bpp, [], bytearray(width * bpp)
    for y in range(height):
        kind, line = raw[y * (stride + 1)], bytearray(raw[y * (stride + 1) + 1:(y + 1) * (stride + 1)])
        for x in range(stride):
            a = line[x - bpp] if x >= bpp else 0
            b, c = prev[x], prev[x - bpp] if x >= bpp else 0
            if kind == 1:
                line[x] = (line[x] + a) & 255
            elif kind == 2:
                line[x] = (line[x] + b) & 255
            elif kind == 3:
                line[x] = (line[x] + (a + b) // 2) & 255
            elif kind == 4:
                pa, pb, pc = abs(b - c), abs(a - c), abs(a + b - 2 * c)
                line[x] = (line[x] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 255
        rows.append(bytes(line))
        prev = line
    return width, height, [bytes(r[i:i + 3]) for r in rows for i in range(0, stride, bpp)]


def _not_blank(png: bytes) -> tuple[int, float]:
    """(distinct colours, share of pixels that are not the background colour)."""
    width, height, pixels = _png_pixels(png)
    colours: dict[bytes, int] = {}
    for px in pixels:
        colours[px] = colours.get(px, 0) + 1
    background = max(colours.values())
    return len(colours), 1 - background / (width * height)


def test_saves_svg_png_html_and_dot(tmp_path):
    drawing = nested().visualize(depth=2, use_dot=False)
    for suffix in ("svg", "png", "html", "dot"):
        assert drawing.save(tmp_path / f"p.{suffix}").stat().st_size > 200
    ET.parse(tmp_path / "p.svg")
    colours, ink = _not_blank((tmp_path / "p.png").read_bytes())
    assert colours > 10 and ink > 0.02  # boxes, text and arrows were rasterised, not an empty canvas
    page = (tmp_path / "p.html").read_text()
    assert page.startswith("<!DOCTYPE html>") and "<svg" in page
    dot = (tmp_path / "p.dot").read_text()
    assert dot.startswith('digraph "outer"') and "subgraph cluster_0" in dot
    assert '"batch/tp" -> "batch/summarize"' in dot
    assert "\n    subgraph cluster_1 { label=\"tp\"" in nested().visualize(depth=None).dot  # tp inside batch
    assert drawing._repr_svg_() == drawing.svg and "<svg" in drawing._repr_html_()
    with pytest.raises(ValueError, match=r"\.svg, \.png, \.html or \.dot"):
        drawing.save(tmp_path / "p.jpg")


def test_filename_saves_and_bad_arguments_name_the_fix(tmp_path):
    p = nested()
    p.visualize(filename=tmp_path / "x.svg", use_dot=False)
    assert (tmp_path / "x.svg").exists()
    with pytest.raises(ValueError, match="known styles are"):
        p.visualize(style="neon")
    with pytest.raises(ValueError, match="depth counts levels from 1"):
        p.visualize(depth=0)
    dark = p.visualize(style="dark", orient="LR", use_dot=False).svg
    assert "#0f172a" in dark and drawn(dark)[0] == drawn(p.visualize(use_dot=False).svg)[0]


def test_works_without_a_system_graphviz(tmp_path):
    """What `pip install "hardy[viz]"` gives on a machine with no `dot`: PATH holds no Graphviz."""
    code = ("from hardy import Pipeline, node\n"
            "@node(output_name='b')\ndef f(a): return a\n"
            "d = Pipeline(nodes=[f], name='p').visualize()\n"
            "assert d.dot_binary is None\n"
            "d.save('p.png'); d.save('p.svg'); print('ok')\n")
    env = {**os.environ, "PATH": str(tmp_path), "PYTHONPATH": str(Path(__file__).parents[1] / "src")}
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert out.stdout.strip() == "ok", out.stderr
    assert _not_blank((tmp_path / "p.png").read_bytes())[0] > 5


@pytest.mark.skipif(shutil.which("dot") is None, reason="no system Graphviz `dot` here (apt-get install graphviz)")
def test_uses_system_dot_when_present(tmp_path):
    drawing = nested().visualize(depth=None)
    assert drawing.dot_binary
    nodes, edges, _, _ = drawn(drawing.svg)  # Graphviz titles nodes by id and edges "a->b", as hardy does
    assert {"batch/tp/clean", "batch/summarize", "total", "input:texts", "output:n"} <= nodes
    assert "batch/tp/clean->batch/tp/count" in edges
    assert _not_blank(drawing.png)[0] > 10


@pytest.mark.skipif(shutil.which("chromium") is None,
                    reason="Chromium is not installed (Debian: apt-get install chromium)")
@pytest.mark.slow  # headless Chromium
def test_html_page_renders_in_headless_chromium(tmp_path):
    page = nested().visualize(depth=None, use_dot=False).save(tmp_path / "pipeline.html")
    shot = tmp_path / "shot.png"
    subprocess.run(["chromium", "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                    "--disable-background-networking", "--disable-component-update", "--disable-sync",
                    f"--user-data-dir={tmp_path / 'profile'}", f"--screenshot={shot}", "--window-size=700,900",
                    page.as_uri()], capture_output=True, timeout=120, check=True)
    colours, ink = _not_blank(shot.read_bytes())
    assert colours > 10 and ink > 0.02, (colours, ink)
