"""The file tier: one file per evicted prefix-cache block in a directory that outlives the server.

    <dir>/<digest hex>.blk      a block (engine/cache/tier_records.py), named by its stable
                                chain digest; the directory's other files: engine/cache/tier_dir.py

A file's format: engine/cache/tier_format.py.

Reads run ahead of admission on a thread of their own (prefetch / take: an admission whose next
block is being read waits while other requests step). Writes run on another (eviction only
queues a snapshot; a full queue drops it): temp file, fsync, then, under the lock, the oldest files (mtime; a hit touches its file) are
deleted until the new one fits the size bound, and the temp file is renamed into place. Every
server on the directory takes the same lock, so the bound holds for all of them, and a rename
is atomic, so a reader sees a whole file or none. A reader trusts nothing it reads: sizes,
checksum, then the header's identity (another model's or layout's file is ignored with a log
line, left to its owner) and its digest, tokens and tensor layout (anything else is corrupt:
deleted). A crash leaves at worst a temp file, deleted at the next start once its writer is gone.
"""

from __future__ import annotations

import atexit
import logging
import os
import queue
import threading
import time
import weakref
from collections import OrderedDict
from pathlib import Path

from baton.engine.cache.tier_dir import TierDirectory
from baton.engine.cache.tier_format import (
    MAX_HEADER_BYTES,
    PREFIX,
    CorruptFile,
    ForeignFile,
    decode,
    encode_parts,
)
from baton.engine.cache.tier_records import BlockRecord, TierIdentity, TierLayout
from baton.engine.cache.tier_stats import TierCounters

logger = logging.getLogger("baton.engine.tiers")

MAX_PENDING = 64  # snapshots queued for writing; more are dropped (eviction never waits)
MAX_PENDING_BYTES = 1 << 30  # ... and their memory (a Nano-9B-v2 block is ~145 MiB)
# Blocks read (or being read) and not taken yet: at most this many bytes' worth, and MAX_LOADED
# (a request aborted meanwhile leaves its blocks here: the oldest go)
MAX_READ_AHEAD_BYTES = 1 << 30
MAX_LOADED = 256
READING = "reading"  # take(): the block's file is being read; ask again later


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
        self._pending_bytes = 0
        self._pending_lock = threading.Lock()
        self._known: set[bytes] = set()  # digests written or loaded by this process
        self._foreign_logged: set[str] = set()
        self._queue: queue.Queue[BlockRecord | None] = queue.Queue()
        self.files = TierDirectory(self.dir)
        self.files.remove_stale_temps()
        with self.files.locked():
            self.files.write_total(self._evict_to(capacity))
        self._thread = threading.Thread(target=self._write_loop, name="tier-files", daemon=True)
        self._thread.start()
        # Reads ahead of admission: the scheduler asks (prefetch / take), a thread reads and
        # checks (blake2b releases the GIL: the check runs beside the step).
        self._reads: queue.Queue[tuple[bytes, tuple[int, ...]] | None] = queue.Queue()
        self._read_lock = threading.Lock()
        self._reading: set[bytes] = set()
        self._loaded: OrderedDict[bytes, BlockRecord | None] = OrderedDict()
        self._reader = threading.Thread(target=self._read_loop, name="tier-reads", daemon=True)
        self._reader.start()
        # the queued writes of an engine nobody closed still reach the disk at exit
        atexit.register(_flush_at_exit, weakref.ref(self))

    # -- the scheduler's side ---------------------------------------------------------------------

    def put(self, record: BlockRecord, wait: bool = False) -> None:
        """Queue a snapshot for writing; if MAX_PENDING are queued, it is dropped (and counted),
        or with `wait` (a server that stops) the queue is drained first."""
        if wait and self._full(record):
            self.flush()
        with self._pending_lock:
            if record.digest in self._known or record.digest in self._pending:
                return
            if self._full(record):
                self.counters.add(dropped=1)
                return
            self._pending[record.digest] = record
            self._pending_bytes += record.nbytes
        self._queue.put(record)

    def _full(self, record: BlockRecord) -> bool:
        return bool(self._pending) and (
            len(self._pending) >= MAX_PENDING
            or self._pending_bytes + record.nbytes > MAX_PENDING_BYTES
        )

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

    @property
    def reading(self) -> bool:
        return bool(self._reading)

    @property
    def _max_ahead(self) -> int:
        return max(2, min(MAX_LOADED, MAX_READ_AHEAD_BYTES // max(1, self.layout.nbytes)))

    def prefetch(self, digest: bytes, tokens: tuple[int, ...], ahead: bool = True) -> bool:
        """Start reading the block's file on the reader thread, if there is one; whether the
        block is read, being read, or queued for writing (take() has it or will). `ahead`
        (not needed yet): not when the read-ahead is full."""
        with self._pending_lock:
            if digest in self._pending:
                return True
        with self._read_lock:
            if digest in self._reading or digest in self._loaded:
                return True
            if ahead and len(self._reading) + len(self._loaded) >= self._max_ahead:
                return False
            if not self._path(digest).exists():
                return False
            self._reading.add(digest)
        self._reads.put((digest, tokens))
        return True

    def take(self, digest: bytes, tokens: tuple[int, ...]) -> BlockRecord | str | None:
        """The block if it was read (or is queued for writing), READING while its file is read
        (the read is started if need be), None if this tier cannot give it."""
        with self._pending_lock:
            record = self._pending.get(digest)
        if record is not None:
            return record if record.tokens == tokens else None
        with self._read_lock:
            if digest in self._loaded:
                record = self._loaded.pop(digest)
                return record if record is not None and record.tokens == tokens else None
        return READING if self.prefetch(digest, tokens, ahead=False) else None

    def get(self, digest: bytes, tokens: tuple[int, ...]) -> BlockRecord | None:
        with self._pending_lock:
            record = self._pending.get(digest)
        if record is not None:
            return record if record.tokens == tokens else None
        path = self._path(digest)
        try:
            with open(path, "rb") as file:
                size = os.fstat(file.fileno()).st_size
                limit = PREFIX.size + MAX_HEADER_BYTES + self.layout.nbytes
                data = bytearray(min(size, limit + 1))  # (a larger one fails its size check)
                del data[file.readinto(data) :]  # (in place: shorter only if it shrank)
        except FileNotFoundError:
            return None
        except OSError as error:
            logger.warning("tier file %s unreadable: %s", path.name, error)
            return None
        try:
            record = decode(data, self.identity, self.layout, digest, tokens)
        except ForeignFile as error:
            self.counters.add(foreign=1)
            if path.name not in self._foreign_logged:
                self._foreign_logged.add(path.name)
                logger.info("tier file %s ignored: another model or layout (%s)", path.name, error)
            return None
        except CorruptFile as error:
            self.counters.add(corrupt=1)
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
        self._reads.put(None)
        self._queue.put(None)
        self._thread.join(timeout=60.0)
        self._reader.join(timeout=60.0)

    # -- the reader thread ------------------------------------------------------------------------

    def _read_loop(self) -> None:
        while (item := self._reads.get()) is not None:
            digest, tokens = item
            began = time.perf_counter()
            try:
                record = self.get(digest, tokens)
            except Exception:  # a failed read is a miss, never the engine's end
                logger.exception("tier file read failed")
                record = None
            self.counters.add(load_seconds=time.perf_counter() - began)
            with self._read_lock:
                self._reading.discard(digest)
                self._loaded[digest] = record
                while len(self._loaded) > self._max_ahead:
                    self._loaded.popitem(last=False)

    # -- the writer thread ------------------------------------------------------------------------

    def _write_loop(self) -> None:
        while (record := self._queue.get()) is not None:
            try:
                self._write(record)
            except Exception:  # a failed write loses a cache entry, never the engine
                self.counters.add(write_errors=1)
                logger.exception("tier file write failed")
            finally:
                with self._pending_lock:
                    if self._pending.pop(record.digest, None) is not None:
                        self._pending_bytes -= record.nbytes

    def _write(self, record: BlockRecord) -> None:
        began = time.perf_counter()
        parts = encode_parts(record, self.identity, self.layout)
        size = sum(len(part) for part in parts)
        if size > self.capacity:
            self.counters.add(dropped=1)
            return
        path = self._path(record.digest)
        temp = self.dir / f".{record.digest.hex()}.{os.getpid()}.{threading.get_ident()}.tmp"
        try:
            fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                for part in parts:
                    view = memoryview(part)
                    while view:
                        view = view[os.write(fd, view) :]
                os.fsync(fd)
            finally:
                os.close(fd)
            with self.files.locked():
                total = self.files.read_total(self.capacity)
                old = path.stat().st_size if path.exists() else 0
                if total - old + size > self.capacity:
                    total = self._evict_to(self.capacity - size, keep=path.name)
                    old = path.stat().st_size if path.exists() else 0
                os.replace(temp, path)
                self.files.write_total(total - old + size)
        except OSError:
            temp.unlink(missing_ok=True)
            raise
        self._known.add(record.digest)
        self.counters.add(writes=1, written_bytes=size, write_seconds=time.perf_counter() - began)

    # -- the directory ----------------------------------------------------------------------------

    def _path(self, digest: bytes) -> Path:
        return self.dir / f"{digest.hex()}.blk"

    def _evict_to(self, limit: int, keep: str = "") -> int:
        """The least recently used files deleted until they take at most `limit` bytes (under
        the lock); their total after."""
        total, evicted = self.files.evict_to(limit, keep)
        for name in evicted:
            self._known.discard(bytes.fromhex(name.removesuffix(".blk")))
        self.counters.add(evictions=len(evicted))
        return total


def _flush_at_exit(store: weakref.ref[FileStore]) -> None:
    alive = store()
    if alive is not None:
        alive.flush(timeout=30.0)
