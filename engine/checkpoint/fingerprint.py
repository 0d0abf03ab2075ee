"""Fingerprints two engines compare before one hands a request's state to the other.

The config fingerprint tells models of different shapes or settings apart; it cannot tell two
checkpoints of one architecture apart (a base model and its fine-tune, or two random
initialisations, share their config.json), and K/V pages and Mamba states computed with one
set of weights are garbage to the other. The weights fingerprint samples every tensor's bytes
straight from the safetensors files: a few windows spread over its data, keyed by the tensor's
canonical name, so it does not depend on how the checkpoint is split into shards, on the
tensor-parallel slicing of either engine, or on the dtype an engine casts the weights to.
"""

from __future__ import annotations

import hashlib
import json
import mmap
from pathlib import Path

from baton.engine.checkpoint.weights import SKIPPED_PREFIXES, Rename, checkpoint_files, keep_name
from baton.engine.config import ModelConfig

SAMPLES_PER_TENSOR = 8  # windows spread evenly over a tensor's bytes, first and last included
SAMPLE_BYTES = 32


def config_fingerprint(config: ModelConfig) -> str:
    return hashlib.sha256(repr(config).encode()).hexdigest()[:16]


def weights_fingerprint(
    model_dir: str | Path, rename: Rename = keep_name, transform: str = ""
) -> str:
    """A digest of every tensor's name, dtype, shape and sampled bytes (about 256 bytes read
    per tensor, from pages the loader has just read). transform: what the engine did to the
    weights after loading them ("online fp8"), which two engines must share too."""
    entries: list[tuple[str, bytes]] = []
    for path in checkpoint_files(model_dir):
        with open(path, "rb") as file, mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as data:
            header_len = int.from_bytes(data[:8], "little")
            header = json.loads(data[8 : 8 + header_len])
            base = 8 + header_len
            for name, meta in header.items():
                if name == "__metadata__":
                    continue
                name = rename(name)
                if name is None or name.startswith(SKIPPED_PREFIXES):
                    continue
                start, end = (base + offset for offset in meta["data_offsets"])
                digest = hashlib.sha256(f"{meta['dtype']}{meta['shape']}".encode())
                span = max(0, end - start - SAMPLE_BYTES)
                for i in range(SAMPLES_PER_TENSOR):
                    at = start + span * i // max(1, SAMPLES_PER_TENSOR - 1)
                    digest.update(data[at : min(at + SAMPLE_BYTES, end)])
                entries.append((name, digest.digest()))
    total = hashlib.sha256(transform.encode())
    for name, digest in sorted(entries):
        total.update(name.encode() + b"\0" + digest)
    return total.hexdigest()[:16]
