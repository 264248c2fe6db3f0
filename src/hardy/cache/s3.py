"""The S3 API's answers, as the object-store cache reads them: the error code behind an exception,
which codes make a bucket unusable for a while, and how much of an object is read at most.

Sizes are capped as the bytes arrive, not by trusting the Content-Length an answer carries (a
proxy may send none): whoever can write to a bucket could otherwise plant an object, an entry or
a lease, that a reader loads until the kernel kills it. The cap is half the memory this process
may use: the machine's, or less under a cgroup's limit (a container), measured in each process.
"""

from __future__ import annotations

import os
from typing import Any

CONFLICT_TRIES = 6  # 409 ConditionalRequestConflict: retried this often, with jittered backoff
UNUSABLE = {"NoSuchBucket", "AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken",
            "InvalidToken", "AllAccessDisabled", "SlowDown", "ServiceUnavailable", "InternalError", "503", "500"}
PIECE = 1 << 20  # bytes read at a time while a body is capped


def code_of(exc: BaseException) -> str:
    """The S3 error code behind an exception (s3fs translates botocore's into OSErrors, keeping the
    original as the cause); the exception's type name for what never reached the server."""
    for e in (exc, exc.__cause__):
        response = getattr(e, "response", None)
        if isinstance(response, dict) and "Error" in response:
            return str(response["Error"].get("Code") or response.get("ResponseMetadata", {}).get("HTTPStatusCode"))
    return type(exc.__cause__ or exc).__name__


def reason(exc: BaseException) -> str:
    text = str(exc).splitlines()[0] if str(exc) else ""
    return f"{code_of(exc)}: {text}"[:160]


def half_the_memory() -> int:
    """Half the memory this process may use: the machine's, or its cgroup's limit where lower."""
    limit = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            with open(path) as f:
                text = f.read().strip()
        except OSError:
            continue
        if text.isdigit():
            limit = min(limit, int(text))
    return limit // 2


async def read_capped(resp: dict[str, Any], cap: int) -> bytes | None:
    """An answer's body, or None if it is longer than `cap` bytes (said by its Content-Length, before
    any is read, or found as it arrives); the connection is closed either way."""
    async with resp["Body"] as body:
        size = resp.get("ContentLength")
        if isinstance(size, int):  # (the client reads no more than it says: one read, as ever)
            return await body.read() if size <= cap else None
        pieces, total = [], 0  # none said: counted as it arrives
        while piece := await body.read(PIECE):
            total += len(piece)
            if total > cap:
                return None
            pieces.append(piece)
        return b"".join(pieces)
