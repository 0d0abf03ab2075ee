"""A toy mixer with state of its own, declared only in its state spec: nothing in the pools, the
prefix cache, the handover, the wire or the TP planning knows it (tests/test_state_spec_toy.py).

Per request it keeps three tensors:

    mem   paged  (heads, head_dim)  one row per token, read back by attention over the
                                    sequence (K = V = mem)                      split by heads
    acc   slot   (heads, head_dim)  acc_t = decay * acc_{t-1} + u_t             split by heads
    peak  slot   (channels,)        peak_t = max(peak_{t-1}, x_t[:channels])    replicated

    y_t = o_proj(attention(q_t, mem_<=t) + acc_t) + p_proj(peak_t)

q, mem and u are column-parallel by heads, o_proj row-parallel (its output all-reduced), p_proj
and peak replicated: every rank computes the same peak from the same (replicated) input. The
recurrences run token by token in Python: a toy. `reference` computes the same layer over whole
sequences with no state at all: the oracle the engine runs are compared with.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from baton.engine import parallel
from baton.engine.cache.pools import StateCache
from baton.engine.cache.spec import LayerState, Segment, StateTensor, TPSplit
from baton.engine.executor.forward_metadata import Mamba2Metadata
from baton.kernels.attention import paged_attention


@dataclass(frozen=True, kw_only=True, slots=True)
class ToyMixerConfig:
    num_heads: int
    head_dim: int
    peak_channels: int
    decay: float
    chunk_size: int  # the grid its checkpoints sit on (any multiple would do: token recurrence)


class ToyMixer(nn.Module):
    @staticmethod
    def state_spec(config: ToyMixerConfig, dtype: torch.dtype) -> LayerState:
        heads = TPSplit(
            dim=0,
            segments=(
                Segment(atoms=config.num_heads, atom_units=1, replicate_below=False, what="heads"),
            ),
        )
        return LayerState(
            kind="toy",
            tensors=(
                StateTensor(
                    name="mem",
                    kind="paged",
                    shape=(config.num_heads, config.head_dim),
                    dtype=dtype,
                    split=heads,
                    checkpointed=True,
                ),
                StateTensor(
                    name="acc",
                    kind="slot",
                    shape=(config.num_heads, config.head_dim),
                    dtype=torch.float32,
                    split=heads,
                    checkpointed=True,
                ),
                StateTensor(
                    name="peak",
                    kind="slot",
                    shape=(config.peak_channels,),
                    dtype=torch.float32,
                    split=None,
                    checkpointed=True,
                ),
            ),
            chunk_size=config.chunk_size,
            window_width=None,
            page_window=None,
        )

    def __init__(self, hidden_size: int, config: ToyMixerConfig, index: int):
        super().__init__()
        self.tp = tp = parallel.current()
        first, heads = parallel.split_evenly(config.num_heads, tp, "heads")
        self.index, self.heads, self.head_dim = index, heads, config.head_dim
        self.decay, self.channels = config.decay, config.peak_channels
        width = heads * config.head_dim
        self.q_proj = nn.Linear(hidden_size, width, bias=False)
        self.m_proj = nn.Linear(hidden_size, width, bias=False)
        self.u_proj = nn.Linear(hidden_size, width, bias=False)
        self.o_proj = nn.Linear(width, hidden_size, bias=False)
        self.p_proj = nn.Linear(config.peak_channels, hidden_size, bias=False)
        if tp.size > 1:
            rows = parallel.Slices(dim=0, ranges=((first * config.head_dim, width),))
            for proj in (self.q_proj, self.m_proj, self.u_proj):
                parallel.shard(proj.weight, rows)
            parallel.shard(self.o_proj.weight, parallel.Slices(dim=1, ranges=rows.ranges))

    def forward(self, x: torch.Tensor, md: Mamba2Metadata, cache: StateCache) -> torch.Tensor:
        fm = md.forward
        T, H, D = x.shape[0], self.heads, self.head_dim
        state = cache.layer("toy", self.index)
        mem_pool, acc_pool, peak_pool = state["mem"], state["acc"], state["peak"]
        q = self.q_proj(x).view(T, H, D)
        mem_pool[fm.slot_mapping] = self.m_proj(x).view(T, H, D).to(mem_pool.dtype)
        nd = fm.batch.num_decode_tokens
        attended = []
        if fm.decode_attention.num_seqs:
            attended.append(paged_attention(q[:nd], mem_pool, mem_pool, fm.decode_attention, 1.0))
        if fm.prefill_attention.num_seqs:
            attended.append(paged_attention(q[nd:], mem_pool, mem_pool, fm.prefill_attention, 1.0))
        u = self.u_proj(x).view(T, H, D).float()
        seen = x[:, : self.channels].float()
        # every sequence's rows: decode rows one token each, then the prefill sequences
        starts = fm.prefill_attention.query_start_loc.tolist()
        rows = [(r, r + 1) for r in range(nd)] + [
            (nd + a, nd + b) for a, b in zip(starts, starts[1:])
        ]
        slots = torch.cat([md.decode_slots, md.prefill_slots]).tolist()
        acc_rows, peak_rows = torch.empty_like(u), torch.empty_like(seen)
        for (begin, end), slot in zip(rows, slots):
            acc, peak = acc_pool[slot].clone(), peak_pool[slot].clone()
            for t in range(begin, end):
                acc = self.decay * acc + u[t]
                peak = torch.maximum(peak, seen[t])
                acc_rows[t], peak_rows[t] = acc, peak
            if slot:  # (slot 0: the dummy slot of padded rows)
                acc_pool[slot], peak_pool[slot] = acc, peak
        if md.has_mamba_track_mask:
            self.checkpoint(md, state, acc_rows, peak_rows)
        y = torch.cat(attended) + acc_rows.to(x.dtype)
        out = self.tp.all_reduce(self.o_proj(y.reshape(T, H * D)))
        return out + self.p_proj(peak_rows.to(x.dtype))

    def checkpoint(self, md: Mamba2Metadata, state, acc_rows, peak_rows) -> None:
        """The state after each track point's token into its checkpoint slot: a decode entry
        names its decode row, a prefill entry its token within the prefill rows."""
        nd, ndt = md.forward.batch.num_decode_tokens, md.num_decode_tracks
        entries = zip(md.track_window_indices.tolist(), md.track_state_dst.tolist())
        for i, (where, dst) in enumerate(entries):
            row = where if i < ndt else nd + where
            state["acc"][dst], state["peak"][dst] = acc_rows[row], peak_rows[row]


def reference(mixer: ToyMixer, x: torch.Tensor) -> torch.Tensor:
    """The layer over one whole sequence x: (T, hidden), from its definition (no state, no
    pages, no kernels): causal attention with K = V = mem and scale 1, the two recurrences."""
    T, H, D = x.shape[0], mixer.heads, mixer.head_dim
    q = mixer.q_proj(x).view(T, H, D).float()
    mem = mixer.m_proj(x).view(T, H, D).float()
    scores = torch.einsum("thd,shd->hts", q, mem)
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    weights = scores.masked_fill(~causal, float("-inf")).softmax(-1)
    attended = torch.einsum("hts,shd->thd", weights, mem)
    u = mixer.u_proj(x).view(T, H, D).float()
    seen = x[:, : mixer.channels].float()
    acc, peak = torch.zeros(H, D), torch.zeros(mixer.channels)
    acc_rows, peak_rows = [], []
    for t in range(T):
        acc = mixer.decay * acc + u[t]
        peak = torch.maximum(peak, seen[t])
        acc_rows.append(acc)
        peak_rows.append(peak)
    y = attended + torch.stack(acc_rows)
    return mixer.o_proj(y.reshape(T, H * D).to(x.dtype)) + mixer.p_proj(
        torch.stack(peak_rows).to(x.dtype)
    )
