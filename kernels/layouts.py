"""The types kernels share with their callers and with each other: the per-forward layouts the
one metadata builder makes (engine/executor/forward_metadata.py) and every attention, conv and scan
kernel reads, and the values the torch and Triton paths of one op exchange. Kept apart from the
ops so that a Triton module never imports its op's torch module (which dispatches to it)."""

from __future__ import annotations

from typing import Literal, NamedTuple

import torch


class AttentionLayout(NamedTuple):
    """Per-forward plan shared by every attention layer (built from host data)."""

    num_seqs: int
    max_q: int
    max_kv: int
    query_start_loc: torch.Tensor  # (num_seqs + 1,) int32 packed query offsets
    kv_lens: torch.Tensor  # (num_seqs,) int32 tokens in cache after this step's writes
    kv_indices: torch.Tensor  # (num_seqs, max_kv) int64 token slots; padding -> slot 0
    q_slot: torch.Tensor  # (num_tokens,) int64 flat (seq * max_q + i) of each query
    slot_q: torch.Tensor  # (num_seqs * max_q,) int64 query per padded slot, num_tokens if empty
    mask: torch.Tensor  # (num_seqs, 1, max_q, max_kv) bool: causal and within kv_len


class ConvLayout(NamedTuple):
    """Gather plan from packed tokens to the padded (num_seqs, K-1 + max_len) input rows."""

    num_seqs: int
    width: int  # K-1 + max_len
    row_source: torch.Tensor  # (num_seqs * width,) int64 into [tokens | states flat | zero row]
    token_column: torch.Tensor  # (num_tokens,) int64: flat (row * width + column) of each token
    final_columns: torch.Tensor  # (num_seqs, K-1) int64: flat columns of the last K-1 inputs


class ChunkLayout(NamedTuple):
    """Where each packed token sits in the aligned (num_seqs, num_chunks, chunk_size) layout.

    Built once per forward (host data) and shared by every Mamba layer.
    """

    num_seqs: int
    num_chunks: int  # chunks of the longest sequence; shorter ones are padded with no-op slots
    chunk_size: int
    token_slot: torch.Tensor  # (num_tokens,) int64: flat slot of each packed token
    slot_token: (
        torch.Tensor
    )  # (num_seqs * num_chunks * chunk_size,) int64: token per slot, or num_tokens (empty)
    cu_seqlens: torch.Tensor  # (num_seqs + 1,) int32: packed token offsets
    start_pos: torch.Tensor  # (num_seqs,) int64: absolute position of each sequence's first token


class SSDOutput(NamedTuple):
    y: torch.Tensor  # (num_tokens, nheads, headdim), x's dtype
    final_states: torch.Tensor  # (num_seqs, nheads, headdim, dstate) float32
    chunk_states: (
        torch.Tensor
    )  # (num_seqs, num_chunks, nheads, headdim, dstate) float32, state after each chunk


class SelectiveScanOutput(NamedTuple):
    """The Mamba1 selective scan's results (kernels/selective_scan.py)."""

    y: torch.Tensor  # (num_tokens, d_inner), x's dtype (gated when z was given)
    final_states: torch.Tensor  # (num_seqs, d_inner, d_state) float32
    chunk_states: (
        torch.Tensor
    )  # (num_seqs, num_chunks, d_inner, d_state) float32, state after each aligned chunk


Activation = Literal["relu2", "swiglu"]

# What the causal conv applies to its outputs: SiLU (Mamba's conv) or nothing (LFM2's short conv).
ConvActivation = Literal["silu", "none"]


class Routing(NamedTuple):
    weights: torch.Tensor  # (T, k) float32
    ids: torch.Tensor  # (T, k) int64
