"""The autopsy of a dead worker: how it ended, its fault record (read once), and what both say.

`ended` is the one place the parent reads a dead worker's fault record; every later step takes
the `Ending` it returns. `examine` turns it into a `Death`: the sentence (`sentence.crash_line`),
the named native frames (`frames`), the native stack as the error shows it and the diagnosis
(`diagnosis.diagnose`); for a worker killed past its timeout, the stacks taken before the kill.
"""

from __future__ import annotations

from dataclasses import dataclass

from .frames import format_frames
from .record import FaultRecord, read
from .sentence import crash_line, describe_exit
from .symbols import Frame


@dataclass(frozen=True)
class Ending:
    """What the parent knows of a dead worker: its fault record, the signal it died of (None for
    an exit), the exit's plain sentence (or why the parent killed it), its exit code, and
    `killed_for` ("timeout", "memory"; None when it died on its own) with `hang`, the stacks
    taken before a timeout's kill as `stacks.hang_stacks` gave them."""

    record: FaultRecord
    signal: str | None
    reason: str
    exitcode: int | None
    killed_for: str | None = None
    hang: tuple[str, str] | None = None


def ended(fault_path: str, exitcode: int | None, killed_for: str | None = None, kill_detail: str = "",
          hang: tuple[str, str] | None = None) -> Ending:
    """The `Ending` of a worker whose fault record is the file `fault_path`: the record read
    once, here, after the worker is gone."""
    signame, reason = describe_exit(exitcode)
    if killed_for:
        signame, reason = "SIGKILL", kill_detail
    return Ending(read(fault_path), signame, reason, exitcode, killed_for, hang)


@dataclass(frozen=True)
class Death:
    """What the parent makes of a dead worker's record: the first line, frames, diagnosis, stacks."""

    reason: str
    frames: list[Frame]
    native_stack: str
    diagnosis: list[str]
    stacks: str = ""


def examine(record: FaultRecord, signame: str | None, reason: str, node: str, stack: str,
            hang: tuple[str, str] | None = None, after_return: bool = False) -> Death:
    """The death of a worker whose fault record is `record`. `hang`: for a worker killed for
    running too long, (py-spy's stacks, why none) as `stacks.hang_stacks` gave them, the Python
    stacks of `stack` standing in when py-spy gave none."""
    from .diagnosis import diagnose  # deaths only: a pool's import stays light
    if hang is not None:
        text, why = hang
        stacks = text or (f"faulthandler, Python frames only ({why}):\n{stack}" if stack else "")
        return Death(reason, [], "", diagnose(stacks=text), stacks)
    frames = record.frames
    return Death(crash_line(signame, reason, frames, node, stack), frames, format_frames(frames),
                 diagnose(frames, after_return=after_return))

