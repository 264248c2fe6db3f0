"""`hardy wheel patch|verify|index` on real wheels, real diffs from `diff -u`, and real pip installs."""

from __future__ import annotations

import base64
import csv
import hashlib
import io
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # real wheels built and installed with pip


def hardy_cli(*args: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hardy.cli", *args], capture_output=True, text=True, **kw)


def _record_hash(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


FILES = {
    "tinypkg/__init__.py": "def greet():\n    return 'hello'\n",
    "tinypkg/letters.txt": "a\nb\nc",  # no newline at the end
    "tinypkg/tool.sh": "#!/bin/sh\necho tool\n",  # executable, like ptxas in a CUDA wheel
}


def build_wheel(folder: Path) -> Path:
    files = {**FILES,
             "tinypkg-1.0.dist-info/METADATA": "Metadata-Version: 2.1\nName: tinypkg\nVersion: 1.0\n",
             "tinypkg-1.0.dist-info/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
                                            "Tag: py3-none-any\n"}
    rows = [[name, _record_hash(body.encode()), str(len(body.encode()))] for name, body in files.items()]
    rows.append(["tinypkg-1.0.dist-info/RECORD", "", ""])
    buf = io.StringIO()
    csv.writer(buf, lineterminator="\n").writerows(rows)
    files["tinypkg-1.0.dist-info/RECORD"] = buf.getvalue()
    path = folder / "tinypkg-1.0-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as zf:
        for name, body in files.items():
            info = zipfile.ZipInfo(name)
            info.external_attr = (0o755 if name.endswith(".sh") else 0o644) << 16
            zf.writestr(info, body)
    return path


def real_diff(tmp: Path, changes: dict[str, str], prefixes: bool = True) -> str:
    """The unified diff `diff -ru` writes for these edits of FILES (no `diff --git` lines)."""
    old, new = tmp / "a", tmp / "b"
    for root, content in ((old, FILES), (new, {**FILES, **changes})):
        for name, body in content.items():
            (root / name).parent.mkdir(parents=True, exist_ok=True)
            (root / name).write_text(body)
    out = subprocess.run(["diff", "-ru", "a", "b"], cwd=tmp, capture_output=True, text=True).stdout
    shutil.rmtree(old), shutil.rmtree(new)
    assert out.count("+++ ") == len(changes)
    return out if prefixes else out.replace("--- a/", "--- ").replace("+++ b/", "+++ ")


def patch(tmp_path: Path, wheel: Path, diff: str, suffix: str = "stripe.5", **kw) -> subprocess.CompletedProcess:
    patches = tmp_path / f"patches-{suffix}"
    patches.mkdir(exist_ok=True)
    (patches / "001-fix.patch").write_text(diff)
    return hardy_cli("wheel", "patch", "--wheel", str(wheel), "--patch-dir", str(patches), "--suffix", suffix,
                     "--dest-dir", str(tmp_path / f"out-{suffix}"), **kw)


def test_patched_wheel_installs_from_a_generated_index_with_its_local_version(tmp_path):
    wheel = build_wheel(tmp_path)
    diff = real_diff(tmp_path, {"tinypkg/__init__.py": "def greet():\n    return 'hello, patched'\n",
                                "tinypkg/letters.txt": "a\nb\nC"})
    out = patch(tmp_path, wheel, diff)
    assert out.returncode == 0, out.stdout + out.stderr
    patched = tmp_path / "out-stripe.5" / "tinypkg-1.0+stripe.5-py3-none-any.whl"
    assert hardy_cli("wheel", "verify", str(patched)).returncode == 0
    index_dir = tmp_path / "index"
    index_dir.mkdir()
    shutil.copy(patched, index_dir)
    shutil.copy(wheel, index_dir)  # upstream beside it: the pin must pick the patched one
    made = hardy_cli("wheel", "index", str(index_dir))
    assert made.returncode == 0, made.stdout + made.stderr
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target),
                    "--index-url", (index_dir / "simple").as_uri(), "tinypkg==1.0+stripe.5"], check=True)
    run = subprocess.run([sys.executable, "-c", "import importlib.metadata as m, tinypkg; "
                          "print(tinypkg.greet(), m.version('tinypkg'))"],
                         capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(target)})
    assert run.stdout.strip() == "hello, patched 1.0+stripe.5", run.stderr
    assert (target / "tinypkg" / "letters.txt").read_text() == "a\nb\nC"  # no newline, none added
    assert os.access(target / "tinypkg" / "tool.sh", os.X_OK)


def test_no_newline_multi_file_diffs_without_prefixes_and_modes(tmp_path):
    wheel = build_wheel(tmp_path)
    diff = real_diff(tmp_path, {"tinypkg/letters.txt": "a\nbb\nc", "tinypkg/tool.sh": "#!/bin/sh\necho new\n"},
                     prefixes=False)
    assert "\\ No newline at end of file" in diff and "diff --git" not in diff
    out = patch(tmp_path, wheel, diff, suffix="x1")
    assert out.returncode == 0, out.stdout + out.stderr
    with zipfile.ZipFile(tmp_path / "out-x1" / "tinypkg-1.0+x1-py3-none-any.whl") as zf:
        assert zf.read("tinypkg/letters.txt") == b"a\nbb\nc"
        assert zf.read("tinypkg/tool.sh") == b"#!/bin/sh\necho new\n"
        assert zf.getinfo("tinypkg/tool.sh").external_attr >> 16 & 0o777 == 0o755
        assert zf.getinfo("tinypkg/__init__.py").external_attr >> 16 & 0o777 == 0o644
        assert zf.namelist()[-1] == "tinypkg-1.0+x1.dist-info/RECORD"


def test_the_same_inputs_give_the_same_bytes(tmp_path):
    wheel = build_wheel(tmp_path)
    diff = real_diff(tmp_path, {"tinypkg/letters.txt": "z\nb\nc"})
    outs = []
    for attempt in ("one", "two"):
        folder = tmp_path / attempt
        folder.mkdir()
        assert patch(folder, wheel, diff, suffix="r1").returncode == 0
        outs.append((folder / "out-r1" / "tinypkg-1.0+r1-py3-none-any.whl").read_bytes())
    assert outs[0] == outs[1]


def test_verify_catches_tampering_and_patch_refuses_bad_hunks(tmp_path):
    wheel = build_wheel(tmp_path)
    tampered = tmp_path / "tampered" / wheel.name
    tampered.parent.mkdir()
    with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(tampered, "w") as dst:
        for item in src.infolist():
            data = src.read(item.filename)
            if item.filename.endswith("__init__.py"):
                data = data.replace(b"hello", b"HELLO")
            dst.writestr(item, data)
    bad = hardy_cli("wheel", "verify", str(tampered))
    assert bad.returncode == 1 and "tinypkg/__init__.py: hash does not match RECORD" in bad.stdout
    diff = real_diff(tmp_path, {"tinypkg/__init__.py": "def greet():\n    return 'x'\n"})
    refused = patch(tmp_path, wheel, diff.replace(" def greet():", " def greeting():"), suffix="y")
    assert refused.returncode == 2, refused.stdout
    assert "does not apply" in refused.stdout and "tinypkg/__init__.py" in refused.stdout
    assert not (tmp_path / "out-y").exists() or not list((tmp_path / "out-y").iterdir())


def test_without_git_the_error_says_what_to_install(tmp_path):
    wheel = build_wheel(tmp_path)
    diff = real_diff(tmp_path, {"tinypkg/letters.txt": "q\nb\nc"})
    no_git = tmp_path / "bin"
    no_git.mkdir()
    out = patch(tmp_path, wheel, diff, suffix="g", env={**os.environ, "PATH": str(no_git)})
    assert out.returncode == 2 and "install git" in out.stdout, out.stdout + out.stderr


def test_index_refuses_a_folder_without_distributions(tmp_path):
    (tmp_path / "notes.txt").write_text("no wheels here")
    out = hardy_cli("wheel", "index", str(tmp_path))
    assert out.returncode == 2 and "no wheels or sdists" in out.stdout
