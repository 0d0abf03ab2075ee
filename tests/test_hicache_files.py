"""The file tier on its own (engine/cache/tier_files.py): every byte from disk is hostile until
checked, the size bound holds for every server on a directory, and a write never blocks eviction."""

from __future__ import annotations

import errno
import os
import threading
import time

import pytest
import torch

from baton.engine.cache import tier_files
from baton.engine.cache.tier_files import FileStore
from baton.engine.cache.tier_format import PREFIX, ForeignFile, decode, encode
from baton.engine.cache.tier_records import (
    BlockRecord,
    TierIdentity,
    TierLayout,
    TierTensor,
    chain_digests,
)

LAYOUT = TierLayout(
    pages_per_block=2,
    tensors=(
        TierTensor(key="pages:attention.k", dtype=torch.float32, shape=(2, 2, 4, 3)),
        TierTensor(key="checkpoint:mamba2.ssm", dtype=torch.float32, shape=(2, 5, 7)),
        TierTensor(key="checkpoint:mamba2.conv", dtype=torch.bfloat16, shape=(2, 6, 3)),
    ),
)


def identity(weights: str = "w0") -> TierIdentity:
    return TierIdentity.of(
        config_fingerprint="c0",
        weights_fingerprint=weights,
        dtype=torch.float32,
        page_size=4,
        track_interval=8,
        layout=LAYOUT,
    )


def record(i: int, who: TierIdentity | None = None) -> BlockRecord:
    g = torch.Generator().manual_seed(i)
    tokens = tuple(range(i * 8, i * 8 + 8))
    (digest,) = chain_digests((who or identity()).fingerprint, list(tokens), 8, 1)
    return BlockRecord(
        digest=digest,
        tokens=tokens,
        live_pages=(True, i % 2 == 0),
        tensors={t.key: torch.randn(t.shape, generator=g).to(t.dtype) for t in LAYOUT.tensors},
    )


def same(a: BlockRecord, b: BlockRecord) -> bool:
    return (
        a.digest == b.digest
        and a.tokens == b.tokens
        and a.live_pages == b.live_pages
        and all(torch.equal(a.tensors[k], b.tensors[k]) for k in a.tensors)
    )


def store(path, capacity: int = 1 << 20, who: TierIdentity | None = None) -> FileStore:
    return FileStore(path, capacity, who or identity(), LAYOUT)


def written(path, records: list[BlockRecord], **options) -> FileStore:
    files = store(path, **options)
    for r in records:
        files.put(r)
    files.flush()
    return files


def test_digests_are_stable_and_seeded_by_the_model():
    ids = list(range(40))
    a = chain_digests(identity().fingerprint, ids, 8, 5)
    assert a == chain_digests(identity().fingerprint, ids, 8, 5)  # no per-process salt
    assert a[2] != chain_digests(identity().fingerprint, ids[:16] + [0] + ids[17:], 8, 5)[2]
    assert set(a).isdisjoint(chain_digests(identity("w1").fingerprint, ids, 8, 5))


def test_a_written_block_is_found_by_a_new_store_on_the_directory(tmp_path):
    r = record(1)
    written(tmp_path, [r]).close()
    got = store(tmp_path).get(r.digest, r.tokens)
    assert got is not None and same(got, r)
    assert store(tmp_path).get(record(2).digest, record(2).tokens) is None


@pytest.mark.parametrize(
    "damage",
    ["truncate", "flip_payload", "flip_header", "empty", "bad_magic", "header_len"],
)
def test_a_damaged_file_is_never_loaded_and_is_deleted(tmp_path, damage):
    r = record(3)
    written(tmp_path, [r]).close()
    (path,) = tmp_path.glob("*.blk")
    data = bytearray(path.read_bytes())
    if damage == "truncate":
        data = data[: len(data) // 2]
    elif damage == "flip_payload":
        data[-5] ^= 0x40
    elif damage == "flip_header":
        data[PREFIX.size + 10] ^= 0x01
    elif damage == "empty":
        data = bytearray()
    elif damage == "bad_magic":
        data[:8] = b"NOTBATON"
    else:
        data[12:16] = (1 << 31).to_bytes(4, "little")
    path.write_bytes(bytes(data))
    files = store(tmp_path)
    assert files.get(r.digest, r.tokens) is None
    assert not path.exists() and files.counters.corrupt == 1


def test_a_sound_file_under_another_blocks_name_is_deleted(tmp_path):
    a, b = record(4), record(5)
    written(tmp_path, [a]).close()
    (tmp_path / f"{a.digest.hex()}.blk").rename(tmp_path / f"{b.digest.hex()}.blk")
    files = store(tmp_path)
    assert files.get(b.digest, b.tokens) is None and files.counters.corrupt == 1
    assert not list(tmp_path.glob("*.blk"))


def test_a_file_of_another_model_is_ignored_and_left_alone(tmp_path):
    theirs = identity("other weights")
    r = record(6, theirs)
    written(tmp_path, [r], who=theirs).close()
    files = store(tmp_path)  # ours: same name asked for, another identity inside
    assert files.get(r.digest, r.tokens) is None
    assert files.counters.foreign == 1 and files.counters.corrupt == 0
    assert (tmp_path / f"{r.digest.hex()}.blk").exists()
    with pytest.raises(ForeignFile):
        decode(encode(r, theirs, LAYOUT), identity(), LAYOUT, r.digest, r.tokens)


def test_the_size_bound_holds_and_the_least_recently_used_go_first(tmp_path):
    size = max(len(encode(record(i), identity(), LAYOUT)) for i in range(6))
    files = written(tmp_path, [record(i) for i in range(3)], capacity=3 * size)
    time.sleep(0.01)
    assert files.get(record(0).digest, record(0).tokens) is not None  # used: kept
    for i in (3, 4):
        files.put(record(i))
        files.flush()
        assert sum(p.stat().st_size for p in tmp_path.glob("*.blk")) <= 3 * size
    kept = {p.name for p in tmp_path.glob("*.blk")}
    assert kept == {f"{record(i).digest.hex()}.blk" for i in (0, 3, 4)}
    assert files.counters.evictions == 2


def test_a_full_disk_fails_the_write_cleanly_and_the_next_write_succeeds(tmp_path, monkeypatch):
    real_write, failures = os.write, [1]

    def write(fd, data):
        if failures:
            failures.pop()
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(fd, data)

    monkeypatch.setattr(tier_files.os, "write", write)
    files = written(tmp_path, [record(7), record(8)])
    assert files.counters.write_errors == 1 and files.counters.writes == 1
    assert not list(tmp_path.glob(".*.tmp"))  # the failed write's temp file is gone
    assert files.get(record(8).digest, record(8).tokens) is not None


def test_a_write_interrupted_by_a_kill_leaves_nothing_loadable(tmp_path):
    r = record(9)
    data = encode(r, identity(), LAYOUT)
    dead = 2**22 + 1  # above Linux's pid_max: no such process
    leftover = tmp_path / f".{r.digest.hex()}.{dead}.1.tmp"
    leftover.write_bytes(data[:100])
    (tmp_path / f"{r.digest.hex()}.blk").write_bytes(data[: len(data) - 7])  # a torn rename
    files = store(tmp_path)
    assert not leftover.exists()  # removed at start: its writer is gone
    assert files.get(r.digest, r.tokens) is None and files.counters.corrupt == 1
    files.put(r)
    files.flush()
    assert same(files.get(r.digest, r.tokens), r)  # the tier recovers


def test_eviction_never_waits_for_the_writer(tmp_path, monkeypatch):
    gate = threading.Event()
    files = store(tmp_path)
    real = files._write
    monkeypatch.setattr(files, "_write", lambda r: (gate.wait(), real(r)))
    began = time.perf_counter()
    for i in range(tier_files.MAX_PENDING + 5):
        files.put(record(100 + i))
    assert time.perf_counter() - began < 1.0
    assert files.counters.dropped == 5
    queued = record(100)
    assert same(files.get(queued.digest, queued.tokens), queued)  # served while queued
    gate.set()
    files.flush()
    assert files.counters.writes == tier_files.MAX_PENDING


def test_two_servers_on_one_directory_keep_the_bound_and_every_file_sound(tmp_path):
    size = max(len(encode(record(i), identity(), LAYOUT)) for i in range(40))
    bound = 10 * size
    a, b = store(tmp_path, capacity=bound), store(tmp_path, capacity=bound)
    threads = [
        threading.Thread(target=lambda s=s, k=k: [s.put(record(k + i)) for i in range(0, 40, 2)])
        for s, k in ((a, 0), (b, 1))
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    a.flush()
    b.flush()
    names = list(tmp_path.glob("*.blk"))
    assert sum(p.stat().st_size for p in names) <= bound and len(names) >= 9
    reader = store(tmp_path, capacity=bound)
    by_name = {f"{record(i).digest.hex()}.blk": record(i) for i in range(40)}
    for p in names:
        r = by_name[p.name]
        assert same(reader.get(r.digest, r.tokens), r)
    assert reader.counters.corrupt == 0


def resealed(data: bytes, edit) -> bytes:
    """`data` with its header edited by `edit` and a checksum that matches again (a file made to
    pass the checksum: only the checks after it stand in the way)."""
    import hashlib
    import json

    magic, version, header_len, payload_len, _ = PREFIX.unpack_from(data)
    header = json.loads(data[PREFIX.size : PREFIX.size + header_len])
    payload = data[PREFIX.size + header_len :]
    raw = json.dumps(edit(header)).encode()
    checksum = hashlib.blake2b(raw + payload, digest_size=32).digest()
    return PREFIX.pack(magic, version, len(raw), payload_len, checksum) + raw + payload


@pytest.mark.parametrize(
    "edit",
    [
        lambda h: [h],
        lambda h: {**h, "tensors": [1, 2, 3]},
        lambda h: {**h, "tensors": [{**h["tensors"][0], "bytes": 10**12}, *h["tensors"][1:]]},
        lambda h: {**h, "live_pages": "yes"},
        lambda h: {**h, "live_pages": [True]},
        lambda h: {**h, "tokens": h["tokens"][:-1] + [0]},
        lambda h: {k: v for k, v in h.items() if k != "digest"},
        lambda h: {**h, "identity": 7},
    ],
)
def test_a_header_that_passes_the_checksum_is_still_checked_field_by_field(tmp_path, edit):
    r = record(10)
    written(tmp_path, [r]).close()
    (path,) = tmp_path.glob("*.blk")
    path.write_bytes(resealed(path.read_bytes(), edit))
    files = store(tmp_path)
    assert files.get(r.digest, r.tokens) is None
    assert files.counters.corrupt == 1 and not path.exists()


def test_a_directory_that_cannot_be_used_is_refused_naming_the_flag(tmp_path):
    (tmp_path / "a-file").write_text("not a directory")
    with pytest.raises(ValueError, match="--hicache-storage-dir .*a-file/tier: cannot use it"):
        store(tmp_path / "a-file" / "tier")


def taken(files: FileStore, r: BlockRecord, timeout: float = 10.0):
    """take() until the reader thread has answered."""
    deadline = time.monotonic() + timeout
    while (got := files.take(r.digest, r.tokens)) is tier_files.READING:
        assert time.monotonic() < deadline, "the read never finished"
        time.sleep(0.001)
    return got


def test_a_block_is_read_ahead_on_the_reader_thread_and_taken_once(tmp_path):
    good, bad, missing = record(11), record(12), record(13)
    written(tmp_path, [good, bad]).close()
    path = tmp_path / f"{bad.digest.hex()}.blk"
    path.write_bytes(path.read_bytes()[:-1])
    files = store(tmp_path)
    assert files.take(missing.digest, missing.tokens) is None  # no file: no read
    assert files.take(good.digest, good.tokens) is tier_files.READING  # the read starts
    assert files.prefetch(bad.digest, bad.tokens)
    assert same(taken(files, good), good)
    assert taken(files, bad) is None and not path.exists()  # checked there, deleted there
    assert files.counters.corrupt == 1 and not files.reading


def test_the_write_queue_is_bounded_by_bytes_too(tmp_path, monkeypatch):
    gate = threading.Event()
    files = store(tmp_path)
    real = files._write
    monkeypatch.setattr(files, "_write", lambda r: (gate.wait(), real(r)))
    monkeypatch.setattr(tier_files, "MAX_PENDING_BYTES", 3 * record(0).nbytes)
    for i in range(5):
        files.put(record(200 + i))
    assert files.counters.dropped == 2
    gate.set()
    files.flush()
    assert files.counters.writes == 3
