"""The file tier's directory, shared by every server on it (engine/cache/tier_files.py):

    <digest hex>.blk            a block file                     (NAME)
    .<digest>.<pid>.<tid>.tmp   a write in progress              (TEMP)
    .lock                       flock'ed around renames and evictions
    .size                       the bytes of *.blk files, as the last writer counted them

Every writer takes the lock to rename a file in and to delete the least recently used ones (by
mtime) until the directory fits its bound, so the bound holds for all of them. `.size` spares
a rescan per write: a recount happens only when it says a write would not fit (or it is
unreadable). A temp file whose writer is gone (its pid, or older than STALE_TEMP_S) is removed
at a store's start.
"""

from __future__ import annotations

import fcntl
import logging
import os
import re
import time
from contextlib import contextmanager
from pathlib import Path

logger = logging.getLogger("baton.engine.tiers")

NAME = re.compile(r"^[0-9a-f]{32}\.blk$")
TEMP = re.compile(r"^\.[0-9a-f]{32}\.(\d+)\.\d+\.tmp$")
STALE_TEMP_S = 600.0  # a temp file this old has no live writer, whoever's it is


class TierDirectory:
    def __init__(self, path: Path):
        self.dir = path

    @contextmanager
    def locked(self):
        fd = os.open(self.dir / ".lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # releases the lock

    def read_total(self, capacity: int) -> int:
        """The bytes of block files as the last writer counted them; over `capacity` when
        unknown (a recount follows)."""
        try:
            total = int((self.dir / ".size").read_text())
        except (OSError, ValueError):
            total = -1
        return total if total >= 0 else capacity + 1  # unknown: count again

    def write_total(self, total: int) -> None:
        (self.dir / ".size").write_text(str(total))

    def evict_to(self, limit: int, keep: str = "") -> tuple[int, list[str]]:
        """Delete the least recently used block files (but `keep`) until they take at most
        `limit` bytes (under the lock): their total after, and the names deleted."""
        files = []
        for entry in os.scandir(self.dir):
            if (
                NAME.match(entry.name)
                and entry.name != keep
                and entry.is_file(follow_symlinks=False)
            ):
                try:
                    st = entry.stat()
                except FileNotFoundError:
                    continue
                files.append((st.st_mtime, st.st_size, entry.name))
        total, evicted = sum(size for _, size, _ in files), []
        for _, size, name in sorted(files):
            if total <= limit:
                break
            (self.dir / name).unlink(missing_ok=True)
            evicted.append(name)
            total -= size
        return total, evicted

    def remove_stale_temps(self) -> None:
        """Temp files of writers that died mid-write (a crash, a kill)."""
        now = time.time()
        for entry in os.scandir(self.dir):
            match = TEMP.match(entry.name)
            if match is None:
                continue
            pid = int(match.group(1))
            try:
                stale = now - entry.stat().st_mtime > STALE_TEMP_S or not _alive(pid)
                if stale:
                    os.unlink(entry.path)
                    logger.info("tier: removed %s, left by an interrupted write", entry.name)
            except FileNotFoundError:
                continue


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True  # another store of this process may be writing it
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
