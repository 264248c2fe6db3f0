"""Patching a wheel reproducibly (seed 001's wheel_patcher.py, done properly), and verifying one.

`patch_wheel` unpacks a wheel, applies the unified diffs of a directory in name order (a hunk that
does not apply is an error naming the file and the line), gives the result the version
`VERSION+SUFFIX` (a PEP 440 local label: the dist-info directory is renamed and METADATA updated),
regenerates RECORD with sha256 hashes and sizes, and repacks it with the original tags.
"""

from __future__ import annotations

import base64
import csv
import hashlib
import io
import os
import re
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

_HUNK = re.compile(r"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@")


class WheelError(Exception):
    """A wheel or a patch that cannot be used; the message says which file and why."""


@dataclass(frozen=True)
class VerifyResult:
    checked: int
    problems: list[str]


def _record_hash(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def _dist_info(root: Path) -> Path:
    found = [p for p in root.iterdir() if p.name.endswith(".dist-info") and p.is_dir()]
    if len(found) != 1:
        raise WheelError(f"expected one .dist-info directory in the wheel, found {[p.name for p in found]}")
    return found[0]


def apply_patch(root: Path, patch_file: Path) -> list[str]:
    """Apply one unified diff under `root`. Returns the files it changed."""
    text = patch_file.read_text()
    changed = []
    lines = text.splitlines(keepends=True)
    i = 0
    while i < len(lines):
        if not lines[i].startswith("--- "):
            i += 1
            continue
        if i + 1 >= len(lines) or not lines[i + 1].startswith("+++ "):
            raise WheelError(f"{patch_file.name}: '---' line {i + 1} is not followed by '+++'")
        target = lines[i + 1][4:].split("\t")[0].strip()
        rel = target.split("/", 1)[1] if target.startswith(("a/", "b/")) else target
        path = root / rel
        if not path.is_file():
            raise WheelError(f"{patch_file.name}: patches {rel}, which is not in the wheel")
        original = path.read_text().splitlines(keepends=True)
        result: list[str] = []
        cursor = 0
        i += 2
        while i < len(lines) and lines[i].startswith("@@"):
            m = _HUNK.match(lines[i])
            if not m:
                raise WheelError(f"{patch_file.name}: malformed hunk header at line {i + 1}: {lines[i].strip()}")
            start = int(m.group(1)) - 1 if int(m.group(2) or 1) else int(m.group(1))
            result += original[cursor:start]
            cursor = start
            i += 1
            while i < len(lines) and lines[i][:1] in (" ", "-", "+", "\\"):
                tag, body = lines[i][:1], lines[i][1:]
                if tag == "\\":  # "\ No newline at end of file"
                    if result:
                        result[-1] = result[-1].rstrip("\n")
                elif tag in (" ", "-"):
                    have = original[cursor] if cursor < len(original) else None
                    if have is None or have.rstrip("\n") != body.rstrip("\n"):
                        raise WheelError(
                            f"{patch_file.name}: hunk at line {m.group(1)} of {rel} does not apply: line "
                            f"{cursor + 1} is {have!r}, the patch expects {body!r}")
                    if tag == " ":
                        result.append(have)
                    cursor += 1
                else:
                    result.append(body)
                i += 1
        result += original[cursor:]
        path.write_text("".join(result))
        changed.append(rel)
    if not changed:
        raise WheelError(f"{patch_file.name} contains no unified diff")
    return changed


def patch_wheel(wheel: str | os.PathLike[str], patch_dir: str | os.PathLike[str], suffix: str,
                dest_dir: str | os.PathLike[str]) -> Path:
    """The patched wheel's path (see the module docstring)."""
    wheel, patch_dir, dest = Path(wheel), Path(patch_dir), Path(dest_dir)
    if not re.fullmatch(r"[A-Za-z0-9]+(\.[A-Za-z0-9]+)*", suffix):
        raise WheelError(f"suffix {suffix!r} is not a PEP 440 local label (letters, digits, dots)")
    parts = wheel.name[:-4].split("-")
    if len(parts) < 5:
        raise WheelError(f"{wheel.name} is not named NAME-VERSION-PYTHON-ABI-PLATFORM.whl")
    name, version, tags = parts[0], parts[1], parts[-3:]
    new_version = f"{version}.{suffix}" if "+" in version else f"{version}+{suffix}"
    patches = sorted(p for p in patch_dir.iterdir() if p.suffix in (".patch", ".diff"))
    if not patches:
        raise WheelError(f"no .patch or .diff files in {patch_dir}")
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        with zipfile.ZipFile(wheel) as zf:
            zf.extractall(root)
        for p in patches:
            apply_patch(root, p)
        info = _dist_info(root)
        new_info = root / f"{name}-{new_version}.dist-info"
        info.rename(new_info)
        meta = new_info / "METADATA"
        text = meta.read_text()
        if not re.search(r"^Version: .*$", text, flags=re.M):
            raise WheelError("METADATA has no Version field")
        meta.write_text(re.sub(r"^Version: .*$", f"Version: {new_version}", text, count=1, flags=re.M))
        record = new_info / "RECORD"
        rows = []
        for path in sorted(p for p in root.rglob("*") if p.is_file()):
            rel = path.relative_to(root).as_posix()
            if path == record:
                continue
            data = path.read_bytes()
            rows.append([rel, _record_hash(data), str(len(data))])
        rows.append([record.relative_to(root).as_posix(), "", ""])
        buf = io.StringIO()
        csv.writer(buf, lineterminator="\n").writerows(rows)
        record.write_text(buf.getvalue())
        dest.mkdir(parents=True, exist_ok=True)
        out = dest / f"{name}-{new_version}-{'-'.join(tags)}.whl"
        with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as zf:
            # dist-info last, as wheel builders do; fixed timestamps keep the output reproducible
            files = sorted(rows, key=lambda r: (r[0].startswith(new_info.name), r[0]))
            for rel, *_ in files:
                zi = zipfile.ZipInfo(rel, date_time=(1980, 1, 1, 0, 0, 0))
                zi.external_attr = 0o644 << 16
                zi.compress_type = zipfile.ZIP_DEFLATED
                zf.writestr(zi, (root / rel).read_bytes())
    return out


def verify_wheel(wheel: str | os.PathLike[str]) -> VerifyResult:
    """Check every file against RECORD (hash and size); list files RECORD does not mention."""
    problems = []
    with zipfile.ZipFile(wheel) as zf:
        names = [n for n in zf.namelist() if not n.endswith("/")]
        records = [n for n in names if n.endswith(".dist-info/RECORD")]
        if len(records) != 1:
            return VerifyResult(0, [f"expected one RECORD, found {records}"])
        listed = {}
        for row in csv.reader(io.StringIO(zf.read(records[0]).decode())):
            if row:
                listed[row[0]] = row
        for n in names:
            row = listed.get(n)
            if row is None:
                problems.append(f"{n}: not in RECORD")
                continue
            if n == records[0]:
                continue
            data = zf.read(n)
            if row[1] != _record_hash(data):
                problems.append(f"{n}: hash does not match RECORD")
            elif row[2] and int(row[2]) != len(data):
                problems.append(f"{n}: size {len(data)} but RECORD says {row[2]}")
        for n in listed:
            if n not in names:
                problems.append(f"{n}: in RECORD but missing from the wheel")
    return VerifyResult(len(names), problems)


__all__ = ["patch_wheel", "verify_wheel", "apply_patch", "WheelError", "VerifyResult"]
