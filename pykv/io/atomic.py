"""Replace a file's content atomically: readers see the old content or all of the new."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def write_atomically(path: str | os.PathLike, content: bytes | str, *, durable: bool = True) -> Path:
    """``path`` holds either its old content or all of ``content``, even if interrupted.

    The temporary file sits beside ``path`` (same directory, so the rename is atomic) and
    is removed on failure. ``durable`` fsyncs it before the rename; counters and progress
    files, rewritten often and worthless after a crash, pass ``False``."""
    path = Path(path)
    data = content.encode() if isinstance(content, str) else content
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, temp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            if durable:
                f.flush()
                os.fsync(f.fileno())
        os.replace(temp, path)
    except BaseException:
        Path(temp).unlink(missing_ok=True)
        raise
    return path
