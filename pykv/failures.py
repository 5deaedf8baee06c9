"""Why one block of a job failed, as a value: the step that failed and its errno.

The store and its callers decide by the step, never by message text: a block that
failed its checks or its authentication (``auth_key_file``) is corrupt (its file is
quarantined); a failed directory, open for write, write, fsync or publish is the
medium refusing stores (stores pause for ``store_retry_interval``); a missing file
or a failed read is neither. ``str()`` of a
failure is the log line's reason ("open: No such file or directory").
"""

from __future__ import annotations

import enum
import errno as errnos
import os
from dataclasses import dataclass


class Step(enum.Enum):
    """Where a block's transfer stopped."""

    OPEN = "open"
    READ = "read"
    CHECK = "check"  # header, size or checksum: the file is there and is not what it should be
    AUTH = "auth"  # the key ring refuses the block: unsigned, an unknown key id or a wrong MAC
    FILL = "fill"  # the engine could not put the KV into the staging slot
    COPY = "copy"  # the engine could not copy the KV out of the staging slot
    MKDIR = "mkdir"
    OPEN_FOR_WRITE = "open for write"
    WRITE = "write"
    FSYNC = "fsync"
    PUBLISH = "publish"
    SHED = "shed"  # vLLM needed the store's GPU blocks back before a staging slot was free: dropped
    STALL = "stall"  # no progress within io_deadline (a stalled mount): given up, recomputed or unstored


_STORE_MEDIUM = frozenset({Step.MKDIR, Step.OPEN_FOR_WRITE, Step.WRITE, Step.FSYNC, Step.PUBLISH})
#: errnos a healthy cache meets in normal operation (a block gc removed, a full or read-only
#: medium); failures with them are logged at DEBUG, the rest at WARNING.
EXPECTED_ERRNOS = frozenset({errnos.ENOENT, errnos.ENOSPC, errnos.EROFS, errnos.EACCES, errnos.EDQUOT,
                             errnos.EPERM})


@dataclass(frozen=True)
class BlockFailure:
    """One block's failure: ``step``, the ``errno`` when the OS gave one, and a detail for logs."""

    step: Step
    errno: int | None = None
    detail: str = ""

    @property
    def corrupt(self) -> bool:
        """The block's file exists and fails its checks (authentication included): quarantine it."""
        return self.step in (Step.CHECK, Step.AUTH)

    @property
    def medium_refuses_stores(self) -> bool:
        """The medium failed a store step: pause stores, keep serving."""
        return self.step in _STORE_MEDIUM

    @property
    def expected(self) -> bool:
        """A failure a healthy cache meets (log quietly)."""
        return self.errno in EXPECTED_ERRNOS or self.step is Step.SHED

    def __str__(self) -> str:
        reason = self.detail or (os.strerror(self.errno) if self.errno else "failed")
        return f"{self.step.value}: {reason}"


def os_failure(step: Step, err: int | OSError) -> BlockFailure:
    """A failure from an errno (a positive int, or a negative completion result) or an ``OSError``."""
    if isinstance(err, OSError):
        return BlockFailure(step, err.errno, err.strerror or str(err))
    return BlockFailure(step, abs(err), os.strerror(abs(err)))
