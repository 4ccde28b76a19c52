"""Writing the report's files whole or not at all.

Every file the report writes (records, runs.csv, tables, figures, claims.md, data_missing.json) goes to a hidden
temporary file in the same folder first, flushed to disk, and is renamed over its path only once complete: a full
disk, a read-only folder or a kill leaves the old file (or none), never a truncated one. A replaced file keeps its
permissions, as one written in place would. A failed write removes the temporary file and ends in one line
(`StorageError`) naming the file, why, and the command to rerun.
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO

from xmc_repro.errors import StorageError


@contextmanager
def replacing(path: Path, rerun: str, *, binary: bool = False, newline: str | None = None) -> Iterator[IO]:
    """A file to write `path`'s new contents to; it replaces `path` when the block ends without an error.

    `rerun` names the command that writes the file again, for the error line (e.g. "`records add`")."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    existed = path.exists()
    try:
        mode = stat.S_IMODE(path.stat().st_mode) if existed else None
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(tmp, "wb" if binary else "w", **({} if binary else {"encoding": "utf-8", "newline": newline})) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        if mode is not None:
            os.chmod(tmp, mode)
        os.replace(tmp, path)
    except OSError as error:
        kept = "the old file is kept" if existed else "no file was left there"
        raise StorageError(f"{path}: could not be written ({error.strerror or error}); {_fix(error)} and rerun "
                           f"{rerun} ({kept})") from None
    finally:
        try:
            tmp.unlink(missing_ok=True)
        except OSError:
            pass


def write_text(path: Path, text: str, rerun: str) -> None:
    """Replace `path` with `text` (UTF-8, newlines as given), whole or not at all."""
    with replacing(path, rerun) as f:
        f.write(text)


def _fix(error: OSError) -> str:
    if error.errno in (errno.ENOSPC, errno.EDQUOT):
        return "free space"
    if error.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return "make the folder writable"
    return "fix that"
