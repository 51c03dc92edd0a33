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
from kda_cp.ops import Backend, Grads, KDAOptions

__all__ = ["SegmentedBackend", "SegmentPlan", "segment_plan"]


@dataclass(frozen=True)
class SegmentPlan:
    """How a call's sequences map to segments (packed over the flattened B * T tokens)."""

    cu: tuple[int, ...]  # segment offsets over the flattened tokens, [N' + 1]
    first: tuple[int, ...]  # each sequence's first segment, [N]
    last: tuple[int, ...]  # each sequence's last segment, [N]
    steps: tuple[tuple[tuple[int, ...], tuple[int, ...]], ...]  # per depth j: (segments, their next)


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
    return SegmentPlan(tuple(cu), tuple(first), tuple(last), steps)


@dataclass
class _Prepared:
    plan: SegmentPlan
    inner: object  # the wrapped backend's prepare() result on the segments, or None
    maps: scan.AffineMap | None = None  # (M, S~) of every segment, once the forward computed them
    s_in: torch.Tensor | None = None  # every segment's incoming state


class SegmentedBackend(Backend):
    """``inner`` run on every sequence cut into segments of ``segment_len`` tokens (module
    docstring). Same interface and results as ``inner``; q, k, v, g, beta dense [B, T, H, *]
    (any B) or packed (B = 1 with cu_seqlens).

    Raises:
        ValueError: segment_len not a positive multiple of the chunk size (at the first call).
    """

    def __init__(self, inner: Backend, segment_len: int) -> None:
        self.inner, self.segment_len = inner, int(segment_len)
        self.name = f"{inner.name}+segments"

    # -- layout ----------------------------------------------------------------------------
    def _plan(self, q, cu_seqlens, opts) -> SegmentPlan:
        L = self.segment_len
        if L < 1 or L % opts.chunk_size:
            raise ValueError(f"segment_len must be a positive multiple of chunk_size = {opts.chunk_size}, got {L}")
        B, T = q.shape[:2]
        if cu_seqlens is None:
            bounds = tuple(range(0, B * T + 1, T)) if T else (0,) * (B + 1)
        else:
            bounds = tuple(int(x) for x in cu_seqlens.tolist())
        return segment_plan(bounds, L)

    @staticmethod
    def _flat(x):
        return x if x is None else x.reshape(1, x.shape[0] * x.shape[1], *x.shape[2:])

    def _cu(self, plan, device):
        return torch.tensor(plan.cu, dtype=torch.int64, device=device)

    def _idx(self, ids, device):
        return torch.tensor(ids, dtype=torch.int64, device=device)

    # -- the two chains ----------------------------------------------------------------------
    @scan.ieee_fp32
    def _states_in(self, plan, maps, h0):
        """s_j of every segment: the sequence's h0 at its first segment, then s_{j+1} = M_j s_j + S~_j."""
        dev = h0.device
        s = h0.new_empty(maps.S.shape[0], *h0.shape[1:])
        s[self._idx(plan.first, dev)] = h0.to(s.dtype)
        for src, dst in plan.steps:
            src, dst = self._idx(src, dev), self._idx(dst, dev)
            s[dst] = (maps.M[src].to(s.dtype) @ s[src] + maps.S[src].to(s.dtype))
        return s

    @scan.ieee_fp32
    def _grads_out(self, plan, M, G, dht):
        """d_j, the gradient of every segment's final state: dht at a sequence's last segment
        (zero when None), then d_j = G_{j+1} + M_{j+1}^T d_{j+1} backwards."""
        dev = G.device
        d = torch.zeros_like(G)
        if dht is not None:
            d[self._idx(plan.last, dev)] = dht.to(d.dtype)
        for src, dst in reversed(plan.steps):
            src, dst = self._idx(src, dev), self._idx(dst, dev)
            d[src] = G[dst] + M[dst].to(d.dtype).transpose(-1, -2) @ d[dst]
        return d

    def _inner_prepared(self, q, k, v, g, beta, opts, plan, prepared):
        if prepared is not None and prepared.inner is not None:
            return prepared.inner
        return self.inner.prepare(*map(self._flat, (q, k, v, g, beta)), opts, self._cu(plan, q.device))

    def _maps(self, q, k, v, g, beta, opts, plan, prepared):
        """Every segment's (M, S~): kept from the forward, else one summary pass."""
        if prepared is not None and prepared.maps is not None:
            return prepared.maps
        inner = self._inner_prepared(q, k, v, g, beta, opts, plan, prepared)
        if inner is None:  # a backend without a prepared form (summaries from the inputs)
            raise NotImplementedError(f"segments need a backend with prepare/summary_prepared; {self.inner.name} "
                                      "has none")
        M, St = self.inner.summary_prepared(inner, opts, last_only=False)
        if prepared is not None:
            prepared.inner = inner
        return scan.AffineMap(M, St)

    # -- Backend -----------------------------------------------------------------------------
    def prepare(self, q, k, v, g, beta, opts, cu_seqlens=None):
        plan = self._plan(q, cu_seqlens, opts)
        return _Prepared(plan, self.inner.prepare(*map(self._flat, (q, k, v, g, beta)), opts, self._cu(plan, q.device)))

    def fwd(self, q, k, v, g, beta, h0, opts, cu_seqlens=None, prepared=None):
        plan = self._plan(q, cu_seqlens, opts)
        prepared = prepared if prepared is not None else _Prepared(plan, None)
        prepared.inner = self._inner_prepared(q, k, v, g, beta, opts, plan, prepared)
        prepared.maps = self._maps(q, k, v, g, beta, opts, plan, prepared)
        prepared.s_in = self._states_in(plan, prepared.maps, h0)
        o, ht = self.inner.fwd(*map(self._flat, (q, k, v, g, beta)), prepared.s_in, opts, self._cu(plan, q.device),
                               prepared=prepared.inner)
        return o.reshape(*q.shape[:3], v.shape[-1]), ht[self._idx(plan.last, ht.device)]

    def bwd(self, q, k, v, g, beta, h0, do, dht, opts, cu_seqlens=None, prepared=None):
        plan = self._plan(q, cu_seqlens, opts)
        cu = self._cu(plan, q.device)
        flat = list(map(self._flat, (q, k, v, g, beta)))
        inner = self._inner_prepared(q, k, v, g, beta, opts, plan, prepared)
        maps = self._maps(q, k, v, g, beta, opts, plan, _Prepared(plan, inner) if prepared is None else prepared)
        s_in = prepared.s_in if prepared is not None and prepared.s_in is not None else self._states_in(plan, maps, h0)
        do_f = self._flat(do)
        G = self.inner.state_grad(*flat, do_f, opts, cu, prepared=inner)
        d_end = self._grads_out(plan, maps.M, G.to(s_in.dtype), dht)
        gr = self.inner.bwd(*flat, s_in, do_f, d_end, opts, cu, prepared=inner)
        shape = lambda x, like: x.reshape(like.shape)  # noqa: E731
        return Grads(shape(gr.dq, q), shape(gr.dk, k), shape(gr.dv, v), shape(gr.dg, g), shape(gr.dbeta, beta),
                     gr.dh0[self._idx(plan.first, gr.dh0.device)])

    def summary(self, k, v, g, beta, opts):
        return self.inner.summary(k, v, g, beta, opts)

    @scan.ieee_fp32
    def summary_prepared(self, prepared, opts, last_only):
        """Each sequence's map, its segments' maps composed (the segment maps stay in ``prepared``
        for the forward that follows)."""
        plan = prepared.plan
        if prepared.maps is None:
            M, St = self.inner.summary_prepared(prepared.inner, opts, last_only=False)
            prepared.maps = scan.AffineMap(M, St)
        M, S = prepared.maps.M.clone(), prepared.maps.S.clone()
        for src, dst in plan.steps:  # acc[next] = maps[next] o acc[segment]
            src, dst = self._idx(src, M.device), self._idx(dst, M.device)
            M[dst], S[dst] = scan.compose(scan.AffineMap(M[dst], S[dst]), scan.AffineMap(M[src], S[src]))
        last = self._idx(plan.last[-1:] if last_only else plan.last, M.device)
        return M[last], S[last]

    def state_grad(self, q, k, v, g, beta, do, opts, cu_seqlens=None, prepared=None):
        plan = self._plan(q, cu_seqlens, opts)
        flat = list(map(self._flat, (q, k, v, g, beta)))
        inner = self._inner_prepared(q, k, v, g, beta, opts, plan, prepared)
        maps = self._maps(q, k, v, g, beta, opts, plan, _Prepared(plan, inner) if prepared is None else prepared)
        G = self.inner.state_grad(*flat, self._flat(do), opts, self._cu(plan, q.device), prepared=inner)
        d_end = self._grads_out(plan, maps.M, G.to(maps.S.dtype), None)
        with scan.ieee_fp32_matmul():
            first = self._idx(plan.first, G.device)
            return G[first] + maps.M[first].transpose(-1, -2) @ d_end[first]

    def keep_for_backward(self, prepared):
        if prepared is None:
            return ()
        inner = self.inner.keep_for_backward(prepared.inner)
        extra = () if prepared.s_in is None else (prepared.maps.M, prepared.maps.S, prepared.s_in)
        return (torch.tensor(len(inner)), *inner, *extra)

    def restore_prepared(self, q, k, v, g, beta, kept, opts, cu_seqlens=None):
        n = int(kept[0])
        inner_kept, extra = kept[1:1 + n], kept[1 + n:]
        inner = None
        if n:
            inner = self.inner.restore_prepared(*map(self._flat, (q, k, v, g, beta)), inner_kept, opts,
                                                self._cu(self._plan(q, cu_seqlens, opts), q.device))
        out = _Prepared(self._plan(q, cu_seqlens, opts), inner)
        if extra:
            out.maps, out.s_in = scan.AffineMap(extra[0], extra[1]), extra[2]
        return out
