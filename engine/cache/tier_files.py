"""The file tier: one file per evicted prefix-cache block in a directory that outlives the server.

    <dir>/<digest hex>.blk      a block (engine/cache/tier_records.py), named by its stable
                                chain digest
    <dir>/.<digest>.<pid>.tmp   a write in progress (renamed into place when complete)
    <dir>/.lock                 flock'ed around renames and evictions (size accounting)
    <dir>/.size                 the bytes of *.blk files, as the last writer counted them

A file's format: engine/cache/tier_format.py.

Writes run on a background thread (eviction only queues a snapshot; a full queue drops it):
temp file, fsync, then, under the lock, the oldest files (mtime; a hit touches its file) are
deleted until the new one fits the size bound, and the temp file is renamed into place. Every
server on the directory takes the same lock, so the bound holds for all of them, and a rename
is atomic, so a reader sees a whole file or none. A reader trusts nothing it reads: sizes,
checksum, then the header's identity (another model's or layout's file is ignored with a log
line, left to its owner) and its digest, tokens and tensor layout (anything else is corrupt:
deleted). A crash leaves at worst a temp file, deleted at the next start once its writer is gone.
"""

from __future__ import annotations

import fcntl
import logging
import os
import queue
import re
import threading
import time
from contextlib import contextmanager
from pathlib import Path

from baton.engine.cache.tier_format import (
    MAX_HEADER_BYTES,
    PREFIX,
    CorruptFile,
    ForeignFile,
    decode,
    encode,
)
from baton.engine.cache.tier_records import BlockRecord, TierIdentity, TierLayout
from baton.engine.cache.tier_stats import TierCounters

logger = logging.getLogger("baton.engine.tiers")

NAME = re.compile(r"^[0-9a-f]{32}\.blk$")
TEMP = re.compile(r"^\.[0-9a-f]{32}\.(\d+)\.\d+\.tmp$")
STALE_TEMP_S = 600.0  # a temp file this old has no live writer, whoever's it is
MAX_PENDING = 64  # snapshots queued for writing; more are dropped (eviction never waits)


class FileStore:
    name = "file"
    durable = True  # a restarted server finds it

    def __init__(
        self, directory: str | Path, capacity: int, identity: TierIdentity, layout: TierLayout
    ):
        self.dir = Path(directory)
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            os.close(os.open(self.dir / ".lock", os.O_RDWR | os.O_CREAT, 0o644))
        except OSError as error:
            raise ValueError(
                f"--hicache-storage-dir {directory}: cannot use it ({error})"
            ) from None
        self.capacity = capacity
        self.identity = identity
        self.layout = layout
        self.counters = TierCounters()
        self._pending: dict[bytes, BlockRecord] = {}  # queued or being written
        self._pending_lock = threading.Lock()
        self._known: set[bytes] = set()  # digests written or loaded by this process
        self._foreign_logged: set[str] = set()
        self._queue: queue.Queue[BlockRecord | None] = queue.Queue()
        self._remove_stale_temps()
        with self._locked():
            self._write_total(self._evict_to(capacity))
        self._thread = threading.Thread(target=self._write_loop, name="tier-files", daemon=True)
        self._thread.start()

    # -- the scheduler's side ---------------------------------------------------------------------

    def put(self, record: BlockRecord, wait: bool = False) -> None:
        """Queue a snapshot for writing; if MAX_PENDING are queued, it is dropped (and counted),
        or with `wait` (a server that stops) the queue is drained first."""
        if wait and len(self._pending) >= MAX_PENDING:
            self.flush()
        with self._pending_lock:
            if record.digest in self._known or record.digest in self._pending:
                return
            if len(self._pending) >= MAX_PENDING:
                self.counters.dropped += 1
                return
            self._pending[record.digest] = record
        self._queue.put(record)

    def contains(self, digest: bytes) -> bool:
        """Whether this process wrote or loaded the block and its file is still there (then it
        counts as just used); a file only another server wrote is not known: written again."""
        with self._pending_lock:
            if digest in self._pending:
                return True
        if digest not in self._known:
            return False
        try:
            os.utime(self._path(digest))
        except OSError:
            self._known.discard(digest)  # evicted by another server meanwhile
            return False
        return True

    def get(self, digest: bytes, tokens: tuple[int, ...]) -> BlockRecord | None:
        with self._pending_lock:
            record = self._pending.get(digest)
        if record is not None:
            return record if record.tokens == tokens else None
        path = self._path(digest)
        try:
            with open(path, "rb") as file:
                data = file.read(PREFIX.size + MAX_HEADER_BYTES + self.layout.nbytes + 1)
        except FileNotFoundError:
            return None
        except OSError as error:
            logger.warning("tier file %s unreadable: %s", path.name, error)
            return None
        try:
            record = decode(data, self.identity, self.layout, digest, tokens)
        except ForeignFile as error:
            self.counters.foreign += 1
            if path.name not in self._foreign_logged:
                self._foreign_logged.add(path.name)
                logger.info("tier file %s ignored: another model or layout (%s)", path.name, error)
            return None
        except CorruptFile as error:
            self.counters.corrupt += 1
            logger.warning("tier file %s is corrupt (%s): deleted", path.name, error)
            path.unlink(missing_ok=True)
            self._known.discard(digest)
            return None
        self._known.add(digest)
        try:
            os.utime(path)  # recently used: evicted last
        except OSError:
            pass
        return record

    def flush(self, timeout: float = 60.0) -> None:
        """Wait until every queued snapshot is written (tests, restarts, benchmarks)."""
        deadline = time.monotonic() + timeout
        while self._pending and time.monotonic() < deadline:
            time.sleep(0.002)

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=60.0)

    # -- the writer thread ------------------------------------------------------------------------

    def _write_loop(self) -> None:
        while (record := self._queue.get()) is not None:
            try:
                self._write(record)
            except Exception:  # a failed write loses a cache entry, never the engine
                self.counters.write_errors += 1
                logger.exception("tier file write failed")
            finally:
                with self._pending_lock:
                    self._pending.pop(record.digest, None)

    def _write(self, record: BlockRecord) -> None:
        began = time.perf_counter()
        data = encode(record, self.identity, self.layout)
        if len(data) > self.capacity:
            self.counters.dropped += 1
            return
        path = self._path(record.digest)
        temp = self.dir / f".{record.digest.hex()}.{os.getpid()}.{threading.get_ident()}.tmp"
        try:
            fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view) :]
                os.fsync(fd)
            finally:
                os.close(fd)
            with self._locked():
                total = self._read_total()
                old = path.stat().st_size if path.exists() else 0
                if total - old + len(data) > self.capacity:
                    total = self._evict_to(self.capacity - len(data), keep=path.name)
                    old = path.stat().st_size if path.exists() else 0
                os.replace(temp, path)
                self._write_total(total - old + len(data))
        except OSError:
            temp.unlink(missing_ok=True)
            raise
        self._known.add(record.digest)
        self.counters.writes += 1
        self.counters.written_bytes += len(data)
        self.counters.write_seconds += time.perf_counter() - began

    # -- the directory ----------------------------------------------------------------------------

    def _path(self, digest: bytes) -> Path:
        return self.dir / f"{digest.hex()}.blk"

    @contextmanager
    def _locked(self):
        fd = os.open(self.dir / ".lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # releases the lock

    def _read_total(self) -> int:
        try:
            total = int((self.dir / ".size").read_text())
        except (OSError, ValueError):
            total = -1
        return total if total >= 0 else self.capacity + 1  # unknown: count again

    def _write_total(self, total: int) -> None:
        (self.dir / ".size").write_text(str(total))

    def _evict_to(self, limit: int, keep: str = "") -> int:
        """Delete the least recently used block files until they take at most `limit` bytes
        (under the lock); their total after."""
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
        total = sum(size for _, size, _ in files)
        for _, size, name in sorted(files):
            if total <= limit:
                break
            (self.dir / name).unlink(missing_ok=True)
            self._known.discard(bytes.fromhex(name[:-4]))
            total -= size
            self.counters.evictions += 1
        return total

    def _remove_stale_temps(self) -> None:
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
