"""Packed sequences across CP ranks: each rank's local view of a global cu_seqlens (docs/design.md §5).

With varlen input (B = 1, cu_seqlens in the FlashAttention convention) a sequence may start on
one rank and end several ranks later, and a rank may hold many whole sequences. Rank r holds
global tokens [start, end); its tokens split into local segments at the sequence starts inside
it. Only the first segment can continue a sequence from an earlier rank (it needs the incoming
state), and only the last segment can continue into the next rank (it gives the outgoing state).
"""

from __future__ import annotations

import bisect
import dataclasses

import torch

from kda_cp.kernels._common import device_offsets
from kda_cp.ops import check_cu_seqlens as _check

__all__ = ["ShardSegments", "check_cu_seqlens", "nonempty_sequences", "shard_segments"]


@dataclasses.dataclass(frozen=True)
class ShardSegments:
    """One rank's segments of a packed batch.

    Attributes:
        start, end: the rank's global token range [start, end).
        cu_seqlens: local offsets of the segments, [n + 1] ints from 0 to end - start.
        seq_ids: the global sequence index of each local segment.
        first_continues: the first segment continues a sequence that began on an earlier rank.
        ends: for each segment, whether its sequence ends inside this shard (at its local end).
    """

    start: int
    end: int
    cu_seqlens: tuple[int, ...]
    seq_ids: tuple[int, ...]
    first_continues: bool
    ends: tuple[bool, ...]

    @property
    def num_segments(self) -> int:
        return len(self.seq_ids)

    @property
    def chained(self) -> bool:
        """The shard's end state depends on its incoming state: one segment that continues."""
        return self.num_segments == 1 and self.first_continues

    @property
    def starts(self) -> tuple[bool, ...]:
        """For each segment, whether its sequence starts inside this shard."""
        return tuple(i > 0 or not self.first_continues for i in range(self.num_segments))

    def local_cu_seqlens(self, device) -> torch.Tensor:
        """The local offsets as int64 on ``device``, kda_cp's copy: the kernels never read it back
        (its host values are recorded). Shared between calls: do not modify it."""
        return device_offsets(self.cu_seqlens, device)


def check_cu_seqlens(cu_seqlens, total: int | None = None) -> list[int]:
    """The global offsets as a list: :func:`kda_cp.ops.check_cu_seqlens` without empty sequences
    (a CP shard boundary must fall inside or between non-empty sequences).

    Raises:
        ValueError: not 1-D integers, fewer than 2 entries, not starting at 0, not strictly
            increasing, or (when ``total`` is given) not ending at the total length.
    """
    return _check(cu_seqlens, total, allow_empty=False)


def nonempty_sequences(cs: list[int]) -> tuple[list[int], tuple[int, ...] | None]:
    """Offsets without the zero-length sequences, and the indices of the sequences kept (None when
    none is empty). An empty sequence holds no token: its final state is its initial state."""
    keep = tuple(i for i in range(len(cs) - 1) if cs[i + 1] > cs[i])
    if len(keep) == len(cs) - 1:
        return list(cs), None
    return [0] + [cs[i + 1] for i in keep], keep


def shard_segments(cu_seqlens, start: int, end: int) -> ShardSegments:
    """The segments of global tokens [start, end) under the global offsets ``cu_seqlens``.

    Args:
        cu_seqlens: global offsets (checked with :func:`check_cu_seqlens`).
        start, end: this rank's global token range, 0 <= start < end <= cu_seqlens[-1].

    Raises:
        ValueError: bad offsets or an empty/out-of-range shard.
    """
    cs = check_cu_seqlens(cu_seqlens)
    if not 0 <= start < end <= cs[-1]:
        raise ValueError(f"shard [{start}, {end}) must be non-empty and inside [0, {cs[-1]})")
    first = bisect.bisect_right(cs, start) - 1  # sequence holding token `start`
    last = bisect.bisect_right(cs, end - 1) - 1  # sequence holding token `end - 1`
    seq_ids = tuple(range(first, last + 1))
    cuts = [start] + [cs[s] for s in seq_ids[1:]] + [end]
    local = tuple(c - start for c in cuts)
    ends = tuple(cs[s + 1] <= end for s in seq_ids)
    return ShardSegments(start, end, local, seq_ids, cs[first] < start, ends)
