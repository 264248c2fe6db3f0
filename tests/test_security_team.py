"""A team's shared cache used by several real uids of one group, each a process of its own with the
default umask (022): every member can write the team's folders, and what refuses one is named.

Two members (uids with a group in common) and an outsider, each run through `setpriv` with this
interpreter reached by a bind mount in a mount namespace of its own (its prefix under /root is
root's only). Each asserts the one warning the cache gives (`hardy.cache` logger): the folder that
refused, whose it is and the fix, never a bare "permission denied" (docs/caching.md, Trust)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import textwrap
from pathlib import Path

import pytest

from hardy.cache.trust import secret_bytes
from hardy.hashing import FORMAT

pytestmark = [pytest.mark.skipif(os.geteuid() != 0 or not (shutil.which("unshare") and shutil.which("setpriv")),
                                 reason="needs root, unshare and setpriv, to act as other users"),
              pytest.mark.timeout(300)]

SRC = str(Path(__file__).resolve().parents[1] / "src")
TEAM = 47000  # the team's group: no name needed, as uids need none
ALICE, BOB, MALLORY = 47001, 47002, 47003  # Alice and Bob are in the team; Mallory is not
SECRET = "team-secret-0123456789abcdef"

# A member's run: a map of double(x) over `xs` through DiskCache(folder, shared=True), with the team
# secret or (empty) the member's own key, under the umask most accounts have. Prints the outputs,
# the hits and the cache's warnings.
MEMBER = """
import json, logging, os, sys
os.umask(0o022)
from hardy import DiskCache, Engine, Pipeline, node

@node(output_name="y")
def double(x: int) -> int:
    return 2 * x

folder, secret, xs = sys.argv[1], sys.argv[2], [int(x) for x in sys.argv[3].split(",")]
said = []
handler = logging.Handler()
handler.emit = lambda record: said.append(record.getMessage())
logging.getLogger("hardy.cache").addHandler(handler)
cache = DiskCache(folder, shared=True, secret=secret or None)
out = Pipeline(nodes=[double], cache=cache, engine=Engine(map_executor="sequential")).map(
    inputs={"x": xs}, map_over="x")
print(json.dumps({"y": [o["y"] for o in out], "hits": cache.hits, "warnings": said}))
"""


@pytest.fixture
def work():
    """A folder every uid can reach, with the member script and each member's home (their own
    cache key is kept in it)."""
    path = Path(tempfile.mkdtemp(prefix="hardy-team-"))
    path.chmod(0o755)
    (path / "py").mkdir()
    (path / "member.py").write_text(textwrap.dedent(MEMBER))
    (path / "member.py").chmod(0o644)
    for uid in (ALICE, BOB, MALLORY):
        (path / f"home-{uid}").mkdir(mode=0o700)
        os.chown(path / f"home-{uid}", uid, uid)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def member(work: Path, uid: int, folder: Path, xs: str, secret: str = SECRET) -> dict:
    """The member script run as `uid` (in the team's group unless it is Mallory's); what it printed."""
    prefix = sys.base_prefix
    python, site = (os.path.join(work, "py", os.path.relpath(p, prefix))
                    for p in (os.path.realpath(sys.executable), sysconfig.get_paths()["purelib"]))
    home = work / f"home-{uid}"
    env = {"HOME": str(home), "TMPDIR": str(home), "XDG_STATE_HOME": str(home / "state"), "PATH": "/usr/bin:/bin",
           "PYTHONPATH": f"{SRC}:{site}"}
    groups = f"--groups={TEAM}" if uid != MALLORY else "--clear-groups"
    command = " ".join(["mount --bind", prefix, str(work / "py"), "&& exec setpriv", f"--reuid={uid}",
                        f"--regid={uid}", groups, python, str(work / "member.py"), str(folder), repr(secret), xs])
    done = subprocess.run(["unshare", "-m", "sh", "-c", command], capture_output=True, text=True, env=env,
                          cwd=home, timeout=240)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])


def as_user(uid: int, script: str, *args: str) -> None:
    """A few lines of the standard library's as `uid` (no hardy: what another user does by hand)."""
    done = subprocess.run(["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", sys.executable, "-I",
                           "-c", textwrap.dedent(script), *args], capture_output=True, text=True,
                          env={"PATH": os.environ["PATH"]}, timeout=120)
    assert done.returncode == 0, done.stderr


def team_folder(work: Path, mode: int = 0o2775) -> Path:
    """The team's cache folder, as an administrator makes one: the team's group, setgid."""
    folder = work / "team-cache"
    folder.mkdir()
    os.chown(folder, 0, TEAM)
    folder.chmod(mode)
    return folder


def key_id(secret: bytes) -> str:
    return hashlib.blake2b(b"hardy-key-id", key=secret, digest_size=8).hexdigest()


def test_a_team_folder_made_under_umask_022_is_writable_by_every_member(work):
    """The first member's run made `entries/`, the key format's, the key id's and the shard folders
    0755 (umask 022): the second member could never store an entry there, with the team secret or
    with their own key. They are made with the team folder's group permissions now."""
    folder = team_folder(work)
    assert member(work, ALICE, folder, "1,2,3") == {"y": [2, 4, 6], "hits": 0, "warnings": []}
    team_entries = folder / "entries" / FORMAT.decode() / key_id(secret_bytes(SECRET))
    made = [folder / "entries", folder / "entries" / FORMAT.decode(), team_entries, *team_entries.iterdir()]
    assert {oct(p.stat().st_mode & 0o7777) for p in made} == {"0o2775"}, made
    assert member(work, BOB, folder, "1,2,3,4,5") == {"y": [2, 4, 6, 8, 10], "hits": 3, "warnings": []}
    assert member(work, ALICE, folder, "4,5")["hits"] == 2  # Bob's entries, in folders Alice made
    assert member(work, BOB, folder, "7", secret="") == {"y": [14], "hits": 0, "warnings": []}  # his own key
    assert member(work, BOB, folder, "7", secret="")["hits"] == 1


def test_a_team_folder_a_member_cannot_write_is_named_with_its_owner_and_the_fix(work):
    """A tree of Alice's that the team cannot write (an older hardy's, made under umask 022): Bob's
    warning names its top folder, its owner and the `chmod` that fixes it."""
    folder = team_folder(work)
    member(work, ALICE, folder, "1")
    as_user(ALICE, "import os, sys\nfor d, _, _ in os.walk(sys.argv[1]): os.chmod(d, 0o2755)",
            str(folder / "entries"))
    bob = member(work, BOB, folder, "2,3")
    assert bob["y"] == [4, 6], bob
    [warning] = bob["warnings"]
    assert f"2 entries could not be written (permission denied: {folder}/entries is uid {ALICE}'s" in warning, warning
    assert f"`chmod -R g+rwX {folder}/entries`" in warning and "those nodes ran uncached" in warning, warning


def test_a_key_id_folder_another_user_made_first_is_named_with_its_owner(work):
    """Folder names are public: Mallory makes the folder of Alice's own key id in the next shared
    directory Alice uses, before her. Alice's warning names that folder and its owner, and what to do."""
    first, second = work / "first", work / "second"
    for shared in (first, second):
        shared.mkdir(mode=0o777)
        shared.chmod(0o1777)
    member(work, ALICE, first, "1", secret="")
    [alices] = os.listdir(first / "entries" / FORMAT.decode())
    squat = second / "entries" / FORMAT.decode() / alices
    as_user(MALLORY, "import os, sys\nos.umask(0)\nos.makedirs(sys.argv[1])", str(squat))
    alice = member(work, ALICE, second, "1,2", secret="")
    assert alice["y"] == [2, 4], alice
    [warning] = alice["warnings"]
    assert f"2 entries could not be read and 2 could not be written (permission denied: {squat} must be yours " \
           f"alone" in warning and f"uid {MALLORY}'s" in warning and "remove it" in warning, warning


SQUAT = """
import os, sys
shard, name = sys.argv[1:]
os.umask(0)
os.makedirs(shard)
os.chmod(shard, 0o1777)
with open(os.path.join(shard, name), "wb") as f:
    f.write(b"HRD\\x03" + b"forged, never a valid entry" * 4)
"""


def test_an_entry_that_could_not_be_deleted_is_never_said_deleted(work):
    """Mallory (not in the team) makes the shard folder of the team's entry for x=1 hers, sticky, with
    a forged entry in it, which the team can neither delete nor replace: each run said it was both
    "could not be deleted" and "deleted and recomputed". It is only the former, with the folder named."""
    folder = team_folder(work, 0o2777)
    (work / "scratch").mkdir(mode=0o777)
    (work / "scratch").chmod(0o777)
    member(work, ALICE, work / "scratch", "1")  # where the entry of x=1 goes: a name anyone can compute
    scratch_entries = work / "scratch" / "entries" / FORMAT.decode() / key_id(secret_bytes(SECRET))
    [name] = [p.name for shard in scratch_entries.iterdir() for p in shard.iterdir()]
    shard = folder / "entries" / FORMAT.decode() / key_id(secret_bytes(SECRET)) / name[:2]
    as_user(MALLORY, SQUAT, str(shard), name)
    for _ in range(2):
        alice = member(work, ALICE, folder, "1")
        assert alice["y"] == [2], alice
        [warning] = alice["warnings"]
        assert "deleted and recomputed" not in warning, warning
        assert f"1 entry could not be deleted after failing verification and 1 could not be written (permission " \
               f"denied: {shard} is a sticky folder, uid {MALLORY}'s" in warning and "remove the folder" in warning, \
            warning
