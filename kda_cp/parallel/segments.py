"""Sequences split into segments inside one device: CP's three stages over the segments of a batch.

With few sequences and heads (B = 1, H = 8), the state passes run one chain per (sequence, head,
value block) and leave most SMs idle. Cutting each sequence into segments of ``segment_len``
tokens (a multiple of the chunk size, counted from the sequence start) gives one chain per
segment. As under context parallelism (docs/design.md §3-§4), with the segments run as packed
sequences of one batch:

    forward   (M_j, S~_j) of every segment from the chunk-local tensors of the forward (one
              summary-state pass); s_0 = h0, s_{j+1} = M_j s_j + S~_j in IEEE fp32 (a scan over
              the segments); then every segment's state + output pass from its s_j.
    backward  G_j = d<o_j, do_j>/d s_j (the state gradient); d_last = dht, d_j = G_{j+1} +
              M_{j+1}^T d_{j+1}; then the backward of every segment from (s_j, d_j).

:class:`SegmentedBackend` wraps a :class:`kda_cp.ops.Backend` with this, so chunk_kda and each CP
rank (which splits its own shard) run it unchanged. Segments never cross a sequence start.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from kda_cp import scan
from kda_cp.kernels._common import device_offsets, host_offsets
from kda_cp.ops import Backend, Grads, KDAOptions

__all__ = ["SegmentedBackend", "SegmentPlan", "segment_plan", "auto_segment_len", "AUTO_SEGMENT_LEN"]

#: segment_len="auto" (kda_cp.ops.segmented) on the TileLang kernels, bounded gate: segments of
#: AUTO_SEGMENT_LEN tokens when every (sequence, value head) chain together carries at most
#: AUTO_MAX_COLUMNS value columns and the longest sequence has at least AUTO_MIN_TOKENS tokens.
#: H100, forward+backward (docs/benchmarks.md, "Segments inside one GPU"): B=1, K=V=128,
#: unsplit / split at 8192: H=8 T=65536 6.16 / 5.31 ms, H=4 T=131072 8.41 / 5.45 ms, both split;
#: H=16 T=32768 4.86 / 5.23 ms and H=32 T=16384 4.49 / 5.18 ms, both unsplit. Segments of 4096
#: lose to 8192 in every row (more chains, each with its summary and scan step).
AUTO_SEGMENT_LEN = 8192
AUTO_MAX_COLUMNS = 8 * 128
AUTO_MIN_TOKENS = 65536


def auto_segment_len(bounds: tuple[int, ...], heads: int, V: int) -> int | None:
    """The "auto" segment length for sequences with host offsets ``bounds`` [N + 1], ``heads``
    value heads of V columns each: AUTO_SEGMENT_LEN where the state passes would leave the GPU
    underfilled (few chains, long sequences), else None (no split). Empty sequences run no chain
    and do not count."""
    lengths = [b - a for a, b in zip(bounds[:-1], bounds[1:]) if b > a]
    n, longest = len(lengths), max(lengths, default=0)
    if n < 1 or n * heads * V > AUTO_MAX_COLUMNS or longest < AUTO_MIN_TOKENS:
        return None
    return AUTO_SEGMENT_LEN


def sequence_bounds(B: int, T: int, cu_seqlens) -> tuple[int, ...]:
    """A call's sequence offsets on the host: cu_seqlens' recorded values (no device read for
    kda_cp's own copy), else B rows of T tokens."""
    if cu_seqlens is None:
        return tuple(range(0, B * T + 1, T)) if T else (0,) * (B + 1)
    return host_offsets(cu_seqlens)


def auto_split(q, v, cu_seqlens, g_min) -> int | None:
    """What segment_len="auto" runs for these inputs: :func:`auto_segment_len` of their sequences
    and value heads; None (no split) for the general gate (g_min None), where the rule was not
    measured."""
    if g_min is None:
        return None
    return auto_segment_len(sequence_bounds(q.shape[0], q.shape[1], cu_seqlens), v.shape[2], v.shape[3])


@dataclass(frozen=True)
class SegmentPlan:
    """How a call's sequences map to segments (packed over the flattened B * T tokens)."""

    cu: tuple[int, ...]  # segment offsets over the flattened tokens, [N' + 1]
    first: tuple[int, ...]  # each sequence's first segment, [N]
    last: tuple[int, ...]  # each sequence's last segment, [N]
    steps: tuple[tuple[tuple[int, ...], tuple[int, ...]], ...]  # per depth j: (segments, their next)
    per_sequence: int = 0  # segments of every sequence when all have the same number (dense), else 0


@functools.lru_cache(maxsize=256)
def segment_plan(bounds: tuple[int, ...], segment_len: int) -> SegmentPlan:
    """Segments of ``segment_len`` tokens from each sequence start (the last one of a sequence may
    be shorter; an empty sequence keeps one empty segment). ``bounds``: sequence offsets [N + 1]."""
    cu, first, last, chains = [0], [], [], []
    for bos, eos in zip(bounds[:-1], bounds[1:]):
        starts = list(range(bos, eos, segment_len)) or [bos]
        ids = list(range(len(cu) - 1, len(cu) - 1 + len(starts)))
        cu.extend(starts[1:] + [eos])
        first.append(ids[0])
        last.append(ids[-1])
        chains.append(ids)
    depth = max(len(c) for c in chains) if chains else 0
    steps = tuple(
        (tuple(c[j] for c in chains if len(c) > j + 1), tuple(c[j + 1] for c in chains if len(c) > j + 1))
        for j in range(depth - 1)
    )
    regular = depth if chains and all(len(c) == depth for c in chains) else 0
    return SegmentPlan(tuple(cu), tuple(first), tuple(last), steps, regular)


def _by_depth(x: torch.Tensor, N: int, n: int) -> torch.Tensor:
    """[N * n, H, *, *] in sequence order -> [n, N * H, *, *], depth j's maps contiguous (a view
    for N = 1)."""
    return x.view(N, n, *x.shape[1:]).transpose(0, 1).reshape(n, N * x.shape[1], *x.shape[2:])


def _by_sequence(x: torch.Tensor, N: int, H: int) -> torch.Tensor:
    """[n, N * H, *, *] -> [N * n, H, *, *] in sequence order (a view for N = 1)."""
    n = x.shape[0]
    return x.view(n, N, H, *x.shape[2:]).transpose(0, 1).reshape(N * n, H, *x.shape[2:])


@functools.lru_cache(maxsize=256)
def _device_plan(plan: SegmentPlan, device: str):
    """The plan's offsets and index lists as int64 tensors on ``device``, made once per plan; the
    offsets' host values are recorded, so the kernels never read them back (no host sync)."""
    t = lambda ids: torch.tensor(ids, dtype=torch.int64, device=device)  # noqa: E731
    return device_offsets(plan.cu, device), t(plan.first), t(plan.last), tuple((t(a), t(b)) for a, b in plan.steps)


@dataclass
class _Prepared:
    plan: SegmentPlan
    inner: object  # the wrapped backend's prepare() result on the segments, or None
    M: torch.Tensor | None = None  # every segment's transition, once computed
    St: torch.Tensor | None = None  # every segment's S~ (the forward's chain and the CP summary)
    s_in: torch.Tensor | None = None  # every segment's incoming state (the forward's)
    G: torch.Tensor | None = None  # every segment's state gradient (CP computes it before the backward)


class SegmentedBackend(Backend):
    """``inner`` run on every sequence cut into segments of ``segment_len`` tokens (module
    docstring). Same interface and results as ``inner``; q, k, v, g, beta dense [B, T, H, *]
    (any B) or packed (B = 1 with cu_seqlens). Calls without tokens run ``inner`` unsplit.

    Raises:
        ValueError: segment_len not a positive multiple of the chunk size (at the first call).
    """

    def __init__(self, inner: Backend, segment_len: int | str) -> None:
        self.inner = inner
        self.segment_len = segment_len if segment_len == "auto" else int(segment_len)
        self.name = f"{inner.name}+segments"

    # -- layout ----------------------------------------------------------------------------
    def _plan(self, q, v, cu_seqlens, opts, prepared=None) -> SegmentPlan | None:
        """The call's segments, or None where it runs ``inner`` unsplit (no tokens, or "auto"
        chose no split)."""
        if isinstance(prepared, _Prepared):  # made by prepare(): no second read of cu_seqlens
            return prepared.plan
        if prepared is not None:  # prepare() ran inner unsplit
            return None
        L = self.segment_len
        if L != "auto" and (L < 1 or L % opts.chunk_size):
            raise ValueError(f"segment_len must be a positive multiple of chunk_size = {opts.chunk_size}, got {L}")
        bounds = sequence_bounds(q.shape[0], q.shape[1], cu_seqlens)
        if L == "auto":
            L = auto_split(q, v, cu_seqlens, opts.g_min)
        if L is None or not bounds[-1]:  # no split chosen, or no tokens to split
            return None
        return segment_plan(bounds, L)

    @staticmethod
    def _flat(x):
        return x if x is None else x.reshape(1, x.shape[0] * x.shape[1], *x.shape[2:])

    @staticmethod
    def _dev(plan, x):
        return _device_plan(plan, str(x.device))

    # -- the two chains ----------------------------------------------------------------------
    @scan.ieee_fp32
    def _states_in(self, plan, M, St, h0):
        """s_j of every segment, in the maps' dtype (the compute dtype): the sequence's h0 at its
        first segment, then s_{j+1} = M_j s_j + S~_j."""
        if plan.per_sequence:  # every sequence n segments: one product per depth on contiguous maps
            N, n, H = len(plan.first), plan.per_sequence, h0.shape[1]
            Mj, Sj = _by_depth(M, N, n), _by_depth(St, N, n)
            s = torch.empty_like(Sj)
            s[0].view(N, H, *s.shape[2:]).copy_(h0)  # any strides (an expanded h0), cast to the maps' dtype
            for j in range(n - 1):
                torch.baddbmm(Sj[j], Mj[j], s[j], out=s[j + 1])
            return _by_sequence(s, N, H)
        _, first, _, steps = self._dev(plan, M)
        s = St.new_empty(St.shape[0], *h0.shape[1:])
        s[first] = h0.to(s.dtype)
        for src, dst in steps:
            s[dst] = M[src] @ s[src] + St[src]
        return s

    @scan.ieee_fp32
    def _grads_out(self, plan, M, G, dht):
        """d_j, the gradient of every segment's final state: dht at a sequence's last segment
        (zero when None), then d_j = G_{j+1} + M_{j+1}^T d_{j+1} backwards."""
        G = G.to(M.dtype)
        if plan.per_sequence:
            N, n, H = len(plan.first), plan.per_sequence, G.shape[1]
            Mj, Gj = _by_depth(M, N, n), _by_depth(G, N, n)
            d = torch.empty_like(Gj)
            if dht is None:
                d[n - 1].zero_()
            else:
                d[n - 1].view(N, H, *d.shape[2:]).copy_(dht)
            for j in reversed(range(n - 1)):
                torch.baddbmm(Gj[j + 1], Mj[j + 1].transpose(-1, -2), d[j + 1], out=d[j])
            return _by_sequence(d, N, H)
        _, _, last, steps = self._dev(plan, M)
        d = torch.zeros_like(G)
        if dht is not None:
            d[last] = dht.to(d.dtype)
        for src, dst in reversed(steps):
            d[src] = G[dst] + M[dst].transpose(-1, -2) @ d[dst]
        return d

    def _inner_prepared(self, flat, opts, plan, prepared):
        if prepared is not None and prepared.inner is not None:
            return prepared.inner
        return self.inner.prepare(*flat, opts, self._dev(plan, flat[0])[0])

    def _maps(self, flat, opts, plan, prepared):
        """Every segment's (M, S~), stored in ``prepared``: kept from earlier, else one summary pass."""
        if prepared.M is None:
            prepared.inner = self._inner_prepared(flat, opts, plan, prepared)
            if prepared.inner is None:  # a backend without a prepared form
                raise NotImplementedError(f"segments need a backend with prepare/summary_prepared; "
                                          f"{self.inner.name} has none")
            prepared.M, prepared.St = self.inner.summary_prepared(prepared.inner, opts, last_only=False)
        return prepared.M, prepared.St

    def _state_grads(self, flat, do, opts, plan, prepared):
        if prepared.G is None:
            prepared.inner = self._inner_prepared(flat, opts, plan, prepared)
            prepared.G = self.inner.state_grad(*flat, self._flat(do), opts, self._dev(plan, flat[0])[0],
                                               prepared=prepared.inner)
        return prepared.G

    # -- Backend -----------------------------------------------------------------------------
    def prepare(self, q, k, v, g, beta, opts, cu_seqlens=None):
        plan = self._plan(q, v, cu_seqlens, opts)
        if plan is None:
            return self.inner.prepare(q, k, v, g, beta, opts, cu_seqlens)
        flat = list(map(self._flat, (q, k, v, g, beta)))
        return _Prepared(plan, self.inner.prepare(*flat, opts, self._dev(plan, q)[0]))

    def fwd(self, q, k, v, g, beta, h0, opts, cu_seqlens=None, prepared=None):
        plan = self._plan(q, v, cu_seqlens, opts, prepared)
        if plan is None:
            return self.inner.fwd(q, k, v, g, beta, h0, opts, cu_seqlens, prepared=prepared)
        flat = list(map(self._flat, (q, k, v, g, beta)))
        prepared = prepared if prepared is not None else _Prepared(plan, None)
        M, St = self._maps(flat, opts, plan, prepared)
        prepared.s_in = self._states_in(plan, M, St, h0)
        cu, _, last, _ = self._dev(plan, q)
        o, ht = self.inner.fwd(*flat, prepared.s_in, opts, cu, prepared=prepared.inner)
        return o.reshape(*q.shape[:3], v.shape[-1]), ht[last]

    def bwd(self, q, k, v, g, beta, h0, do, dht, opts, cu_seqlens=None, prepared=None):
        plan = self._plan(q, v, cu_seqlens, opts, prepared)
        if plan is None:
            return self.inner.bwd(q, k, v, g, beta, h0, do, dht, opts, cu_seqlens, prepared=prepared)
        flat = list(map(self._flat, (q, k, v, g, beta)))
        prepared = prepared if prepared is not None else _Prepared(plan, None)
        M, St = self._maps(flat, opts, plan, prepared)
        s_in = prepared.s_in if prepared.s_in is not None else self._states_in(plan, M, St, h0)
        d_end = self._grads_out(plan, M, self._state_grads(flat, do, opts, plan, prepared), dht)
        cu, first, _, _ = self._dev(plan, q)
        gr = self.inner.bwd(*flat, s_in, self._flat(do), d_end, opts, cu, prepared=prepared.inner)
        return Grads(*(x.reshape(like.shape) for x, like in zip(gr[:5], (q, k, v, g, beta))), gr.dh0[first])

    def summary(self, k, v, g, beta, opts):
        return self.inner.summary(k, v, g, beta, opts)

    @scan.ieee_fp32
    def summary_prepared(self, prepared, opts, last_only):
        """Each sequence's map, its segments' maps composed (the segment maps stay in ``prepared``
        for the forward that follows)."""
        if not isinstance(prepared, _Prepared):  # a call without tokens
            return self.inner.summary_prepared(prepared, opts, last_only)
        plan = prepared.plan
        if prepared.M is None:
            prepared.M, prepared.St = self.inner.summary_prepared(prepared.inner, opts, last_only=False)
        if plan.per_sequence:
            N, n, H = len(plan.first), plan.per_sequence, prepared.M.shape[1]
            accM, accS = scan.total(scan.AffineMap(_by_depth(prepared.M, N, n), _by_depth(prepared.St, N, n)),
                                    "sequential")  # maps[n-1] o ... o maps[0] of every sequence at once
            if n == 1:  # no product made: do not hand out views of the prepared maps
                accM, accS = accM.clone(), accS.clone()
            accM, accS = accM.view(N, H, *accM.shape[1:]), accS.view(N, H, *accS.shape[1:])
            return (accM[-1:], accS[-1:]) if last_only else (accM, accS)
        M, S = prepared.M.clone(), prepared.St.clone()
        _, _, last, steps = self._dev(plan, M)
        for src, dst in steps:  # acc[next] = maps[next] o acc[segment]
            M[dst], S[dst] = scan.compose(scan.AffineMap(M[dst], S[dst]), scan.AffineMap(M[src], S[src]))
        last = last[-1:] if last_only else last
        return M[last], S[last]

    def state_grad(self, q, k, v, g, beta, do, opts, cu_seqlens=None, prepared=None):
        plan = self._plan(q, v, cu_seqlens, opts, prepared)
        if plan is None:
            return self.inner.state_grad(q, k, v, g, beta, do, opts, cu_seqlens, prepared=prepared)
        flat = list(map(self._flat, (q, k, v, g, beta)))
        if prepared is None:  # nothing to share with a backward that follows
            prepared = _Prepared(plan, None)
        M, _ = self._maps(flat, opts, plan, prepared)
        G = self._state_grads(flat, do, opts, plan, prepared).to(M.dtype)
        d_end = self._grads_out(plan, M, G, None)
        first = self._dev(plan, q)[1]
        with scan.ieee_fp32_matmul():
            return G[first] + M[first].transpose(-1, -2) @ d_end[first]

    def keep_for_backward(self, prepared):
        if not isinstance(prepared, _Prepared):
            return self.inner.keep_for_backward(prepared)
        inner = self.inner.keep_for_backward(prepared.inner)
        extra = () if prepared.s_in is None else (prepared.M, prepared.s_in)
        return (torch.tensor(len(inner)), *inner, *extra)

    def restore_prepared(self, q, k, v, g, beta, kept, opts, cu_seqlens=None):
        plan = self._plan(q, v, cu_seqlens, opts)
        if plan is None:
            return self.inner.restore_prepared(q, k, v, g, beta, kept, opts, cu_seqlens)
        n = int(kept[0])
        inner_kept, extra = kept[1:1 + n], kept[1 + n:]
        inner = None
        if n:
            flat = list(map(self._flat, (q, k, v, g, beta)))
            inner = self.inner.restore_prepared(*flat, inner_kept, opts, self._dev(plan, q)[0])
        out = _Prepared(plan, inner)
        if extra:
            out.M, out.s_in = extra
        return out
