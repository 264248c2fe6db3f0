"""A library is keyed by the content of the wheel it was installed from, as its RECORD hashes it,
not only by its name and version: a wheel built locally, installed from a folder of wheels
(`--find-links`: pip writes no `direct_url.json`), then rebuilt with changed code under the same
version, served the old build's results.

Real wheels built with `pip wheel` (no index is reached), real virtual environments, and a user's
script run as two fresh processes against one cache folder.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

SRC = str(Path(__file__).resolve().parent.parent / "src")

PYPROJECT = """
[build-system]
requires = ["setuptools"]
build-backend = "setuptools.build_meta"
[project]
name = "s62wkey"
version = "1.0"
[project.scripts]
s62wkey-cli = "s62wkey.core:main"
"""

SCRIPT = """
import json, sys
import s62wkey
from hardy import DiskCache, Engine, Pipeline, node
from hardy.hashing.distributions import module_identity

@node(output_name="y")
def step(x):
    with open(sys.argv[2], "a") as f:
        f.write("call\\n")
    return s62wkey.h(x)

out = Pipeline(nodes=[step], cache=DiskCache(sys.argv[1]), engine=Engine(map_executor="sequential")).run(
    inputs={"x": 3})
print(json.dumps({"out": out["y"], "direct": s62wkey.h(3), "key": module_identity("s62wkey.core").decode(),
                  "file": s62wkey.__file__}))
"""


@dataclass
class Env:
    python: Path
    env: dict[str, str]

    def pip(self, *args: str) -> None:
        subprocess.run([str(self.python), "-m", "pip", "install", "-q", "--no-index", "--no-deps",
                        "--disable-pip-version-check", *args], check=True, capture_output=True, env=self.env)

    def run(self, root: Path) -> dict:
        """The script in a fresh process against the shared cache; how many calls the node made so far."""
        done = subprocess.run([str(self.python), "-", str(root / "cache"), str(root / "log")], input=SCRIPT,
                              capture_output=True, text=True, env=self.env, cwd=root)
        assert done.returncode == 0, done.stderr[-3000:]
        result = json.loads(done.stdout.strip().splitlines()[-1])
        result["calls"] = len((root / "log").read_text().split())
        return result


def build(root: Path, offset: int) -> Path:
    """A wheel of s62wkey 1.0 whose `h` adds `offset`: one folder of wheels per build, as a user's
    `dist/` after each `pip wheel`."""
    src = root / f"src{offset}"
    (src / "s62wkey").mkdir(parents=True)
    (src / "pyproject.toml").write_text(PYPROJECT)
    (src / "s62wkey" / "__init__.py").write_text("from .core import h\n")
    (src / "s62wkey" / "core.py").write_text(f"def h(x):\n    return x + {offset}\n\ndef main():\n    print(h(0))\n")
    wheels = root / f"dist{offset}"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-index", "--no-build-isolation",
                    "--disable-pip-version-check", "-w", str(wheels), str(src)], check=True, capture_output=True,
                   env={**os.environ, "PIP_NO_INPUT": "1"}, cwd=root)
    return wheels


def venv(folder: Path, pythonpath: str) -> Env:
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(folder)], check=True)
    env = {**os.environ, "PYTHONPATH": pythonpath, "PYTHONDONTWRITEBYTECODE": "1", "PIP_NO_INPUT": "1"}
    return Env(folder / "bin" / "python", env)


@pytest.fixture(scope="module")
def wheels(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("wheelkeys")
    return build(root, 1), build(root, 2)


def test_a_local_wheel_rebuilt_with_changed_code_and_the_same_version_is_computed_again(wheels, tmp_path):
    """`pip install --find-links dist s62wkey` writes no direct_url.json: the library is keyed as
    one from an index, and before its RECORD was keyed the rebuild served `4` where `h(3)` is 5."""
    first, second = wheels
    env = venv(tmp_path / "env", SRC)
    env.pip("--find-links", str(first), "s62wkey")
    before = env.run(tmp_path)
    assert (before["out"], before["direct"], before["calls"]) == (4, 4, 1)
    env.pip("--force-reinstall", "--find-links", str(second), "s62wkey")
    after = env.run(tmp_path)
    assert after["direct"] == 5, "the rebuild did not change what the library computes"
    assert after["out"] == 5 and after["calls"] == 2, "the old build's result was served"
    assert after["key"] != before["key"] and "s62wkey==1.0#record:" in before["key"]


def test_one_wheel_installed_in_two_layouts_has_one_key(wheels, tmp_path):
    """The same wheel in a venv's site-packages and in another venv's `--target` folder (its
    script at another relative place, with another shebang) keys alike: the second process, in
    the other venv, is served the first's entry."""
    first, _ = wheels
    one = venv(tmp_path / "one" / "env", SRC)
    one.pip("--find-links", str(first), "s62wkey")
    target = tmp_path / "two" / "layer" / "site-packages"  # a site directory of its own, as a Lambda layer's
    two = venv(tmp_path / "two" / "env", os.pathsep.join([str(target), SRC]))
    two.pip("--target", str(target), "--find-links", str(first), "s62wkey")
    a, b = one.run(tmp_path), two.run(tmp_path)
    assert Path(a["file"]).parent.parent != Path(b["file"]).parent.parent, "both imported from one place"
    assert a["key"] == b["key"] and "#record:" in a["key"]
    assert (a["out"], b["out"], b["calls"]) == (4, 4, 1), "one wheel installed elsewhere missed the cache"


def test_the_record_digest_leaves_out_what_differs_between_installs_of_one_wheel():
    """Compiled `.pyc` files (no hash), scripts out of the site directory and the installer's own
    files differ between two installs of one wheel; the order of RECORD's lines does not count."""
    from hardy.hashing.distributions import _record_digest
    wheel = [b"pkg/__init__.py,sha256=AAA,10", b"pkg/core.py,sha256=BBB,20", b"pkg-1.0.dist-info/METADATA,sha256=CCC,5"]
    one = wheel + [b"pkg/__pycache__/core.cpython-311.pyc,,", b"../../../bin/pkg-cli,sha256=DDD,200",
                   b"pkg-1.0.dist-info/INSTALLER,sha256=EEE,4", b"pkg-1.0.dist-info/REQUESTED,sha256=FFF,0",
                   b"pkg-1.0.dist-info/RECORD,,"]
    two = [*reversed(wheel), b"../../bin/pkg-cli,sha256=GGG,190", b'"pkg-1.0.dist-info/direct_url.json",sha256=H,9',
           b"pkg-1.0.dist-info/INSTALLER,sha256=III,3"]
    assert _record_digest(b"\n".join(one)) == _record_digest(b"\r\n".join(two)) != ""
    changed = [b"pkg/core.py,sha256=XXX,20" if b"core.py" in line else line for line in one]
    assert _record_digest(b"\n".join(changed)) != _record_digest(b"\n".join(one))
    assert _record_digest(b"pkg/__init__.py,,\n") == "", "no hashes: the version alone keys it"
