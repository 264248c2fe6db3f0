"""Patching a wheel reproducibly, verifying one, and serving a folder of them as a package index.

A team that must patch a library (a CUDA wheel whose loader preloads its libraries in the wrong
order, say) needs three things: the patched wheel, proof that nothing else changed, and an index
that pip and Bazel's rules_python can install it from. Each step stands on a maintained tool
rather than code of our own:

- diffs are applied by `git apply`: it handles multi-file diffs with or without `diff` lines,
  "\\ No newline at end of file", new and deleted files and mode changes, and names the file and
  line of a hunk that does not apply;
- the wheel is packed by the `wheel` project's `WheelFile`, which writes RECORD (sha256, size),
  keeps each file's mode (a CUDA wheel's `ptxas` stays executable) and orders dist-info last;
- names and versions are parsed by `packaging` (PEP 427 file names, PEP 440 local labels, PEP 503
  project names).
"""

from __future__ import annotations

import csv
import hashlib
import html
import io
import os
import re
import shutil
import subprocess
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from ..errors import WheelError

# 1980-01-01, the earliest time a zip file can hold: every file gets it, so the same inputs give
# byte-identical wheels.
_EPOCH = 315532800


@dataclass(frozen=True)
class VerifyResult:
    checked: int
    problems: list[str]


def _git() -> str:
    git = shutil.which("git")
    if git is None:
        raise WheelError("applying patches needs git ('git apply'), which is not on PATH: install git "
                         "(e.g. apt-get install git) and run again")
    return git


def apply_patch(root: Path, patch_file: Path) -> list[str]:
    """Apply one unified diff under `root` with `git apply`; returns the files it changed.

    Paths may carry the `a/` and `b/` prefixes of git and `diff -ru a b` (stripped) or none."""
    git, patch_file = _git(), Path(patch_file).resolve()
    env = {**os.environ, "GIT_CEILING_DIRECTORIES": str(Path(root).resolve().parent)}
    errors = []
    for strip in (1, 0):
        apply = [git, "apply", f"-p{strip}", "--whitespace=nowarn"]
        check = subprocess.run([*apply, "--check", "--numstat", str(patch_file)],
                               cwd=root, env=env, capture_output=True, text=True)
        if check.returncode == 0 and check.stdout.strip():
            subprocess.run([*apply, str(patch_file)], cwd=root, env=env, check=True, capture_output=True)
            return [line.split("\t", 2)[2] for line in check.stdout.splitlines()]
        errors.append(check.stderr.strip() or "no unified diff found")
    raise WheelError(f"{patch_file.name} does not apply: {errors[0]}")


def _fix_version(root: Path, name: str, new_version: str) -> None:
    """Rename the dist-info directory to the new version and set METADATA's Version."""
    found = [p for p in root.iterdir() if p.name.endswith(".dist-info") and p.is_dir()]
    if len(found) != 1:
        raise WheelError(f"expected one .dist-info directory in the wheel, found {[p.name for p in found]}")
    info = root / f"{name}-{new_version}.dist-info"
    found[0].rename(info)
    (info / "RECORD").unlink(missing_ok=True)  # WheelFile writes a new one
    meta = info / "METADATA"
    text = meta.read_text()
    if not re.search(r"^Version: .*$", text, flags=re.M):
        raise WheelError("METADATA has no Version field")
    meta.write_text(re.sub(r"^Version: .*$", f"Version: {new_version}", text, count=1, flags=re.M))


def _extract(wheel: Path, root: Path) -> None:
    """Unzip keeping each file's mode (zipfile alone drops it: CPython issue 59999)."""
    with zipfile.ZipFile(wheel) as zf:
        for info in zf.infolist():
            target = Path(zf.extract(info, root))
            mode = info.external_attr >> 16 & 0o777
            if mode and not info.is_dir():
                target.chmod(mode)


def _pack(root: Path, out: Path) -> None:
    from wheel.wheelfile import WheelFile

    for path in root.rglob("*"):
        os.utime(path, (_EPOCH, _EPOCH))
    previous = os.environ.get("SOURCE_DATE_EPOCH")
    os.environ["SOURCE_DATE_EPOCH"] = str(_EPOCH)  # RECORD's own timestamp
    try:
        with WheelFile(out, "w") as wf:
            wf.write_files(str(root))
    finally:
        if previous is None:
            del os.environ["SOURCE_DATE_EPOCH"]
        else:
            os.environ["SOURCE_DATE_EPOCH"] = previous


def patch_wheel(wheel: str | os.PathLike[str], patch_dir: str | os.PathLike[str], suffix: str,
                dest_dir: str | os.PathLike[str]) -> Path:
    """Apply the `.patch`/`.diff` files of `patch_dir` in name order and repack as VERSION+SUFFIX.

    The local label keeps the patched wheel distinguishable from upstream's everywhere (pip's
    resolver, `importlib.metadata`, an index), while `==VERSION+SUFFIX` pins it exactly."""
    from packaging.utils import InvalidWheelFilename, parse_wheel_filename
    from packaging.version import InvalidVersion, Version

    wheel, patch_dir, dest = Path(wheel), Path(patch_dir), Path(dest_dir)
    try:
        _, version, _, _ = parse_wheel_filename(wheel.name)
        new_version = str(Version(f"{version}.{suffix}" if version.local else f"{version}+{suffix}"))
    except InvalidWheelFilename as exc:
        raise WheelError(f"{wheel.name} is not a wheel file name (NAME-VERSION-PYTHON-ABI-PLATFORM.whl): {exc}") \
            from None
    except InvalidVersion:
        raise WheelError(f"suffix {suffix!r} is not a PEP 440 local label (letters, digits, dots)") from None
    patches = sorted(p for p in patch_dir.iterdir() if p.suffix in (".patch", ".diff"))
    if not patches:
        raise WheelError(f"no .patch or .diff files in {patch_dir}")
    name, rest = wheel.name.split("-", 1)
    tags = rest.split("-", 1)[1]
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        _extract(wheel, root)
        for p in patches:
            apply_patch(root, p)
        _fix_version(root, name, new_version)
        dest.mkdir(parents=True, exist_ok=True)
        out = dest / f"{name}-{new_version}-{tags}"
        _pack(root, out)
    return out


def verify_wheel(wheel: str | os.PathLike[str]) -> VerifyResult:
    """Check every file against RECORD (hash and size); list files RECORD does not mention.

    All problems are collected (not just the first, as an installer stops at), so one run shows
    everything a patch or a hand edit changed."""
    from wheel.wheelfile import urlsafe_b64encode

    problems = []
    with zipfile.ZipFile(wheel) as zf:
        names = [n for n in zf.namelist() if not n.endswith("/")]
        records = [n for n in names if n.endswith(".dist-info/RECORD")]
        if len(records) != 1:
            return VerifyResult(0, [f"expected one RECORD, found {records}"])
        listed = {row[0]: row for row in csv.reader(io.StringIO(zf.read(records[0]).decode())) if row}
        for n in names:
            row = listed.get(n)
            if row is None:
                problems.append(f"{n}: not in RECORD")
            elif n != records[0]:
                data = zf.read(n)
                digest = "sha256=" + urlsafe_b64encode(hashlib.sha256(data).digest()).decode()
                if row[1] != digest:
                    problems.append(f"{n}: hash does not match RECORD")
                elif row[2] and int(row[2]) != len(data):
                    problems.append(f"{n}: size {len(data)} but RECORD says {row[2]}")
        problems += [f"{n}: in RECORD but missing from the wheel" for n in listed if n not in names]
    return VerifyResult(len(names), problems)


def build_index(folder: str | os.PathLike[str]) -> Path:
    """Write a PEP 503 simple index of the wheels and sdists in `folder`; returns its `simple/` path.

    pip installs from it with `--index-url file://FOLDER/simple` (or over any static web server),
    and so does Bazel's rules_python; links carry `#sha256=` so installers check each download."""
    from packaging.utils import canonicalize_name, parse_sdist_filename, parse_wheel_filename

    folder = Path(folder).resolve()
    projects: dict[str, list[tuple[str, str]]] = {}
    for f in sorted(folder.iterdir()):
        try:
            if f.name.endswith(".whl"):
                name = parse_wheel_filename(f.name)[0]
            elif f.name.endswith((".tar.gz", ".zip")):
                name = parse_sdist_filename(f.name)[0]
            else:
                continue
        except ValueError as exc:
            raise WheelError(f"{f.name} is not a distribution file name: {exc}") from None
        digest = hashlib.sha256(f.read_bytes()).hexdigest()
        projects.setdefault(canonicalize_name(name), []).append((f.name, digest))
    if not projects:
        raise WheelError(f"no wheels or sdists in {folder}")
    simple = folder / "simple"
    simple.mkdir(exist_ok=True)
    page = "<!DOCTYPE html>\n<html><head><meta name=\"pypi:repository-version\" content=\"1.0\">" \
           "<title>{title}</title></head><body>\n{links}\n</body></html>\n"
    links = [f'<a href="{html.escape(p)}/">{html.escape(p)}</a>' for p in projects]
    (simple / "index.html").write_text(page.format(title="Simple index", links="<br>\n".join(links)))
    for project, files in projects.items():
        (simple / project).mkdir(exist_ok=True)
        links = [f'<a href="../../{html.escape(n)}#sha256={d}">{html.escape(n)}</a>' for n, d in files]
        (simple / project / "index.html").write_text(page.format(title=f"Links for {project}",
                                                                 links="<br>\n".join(links)))
    return simple


__all__ = ["patch_wheel", "verify_wheel", "apply_patch", "build_index", "VerifyResult"]
