"""Affine-map algebra for context parallelism (docs/design.md §3; Kimi K3 report, CP by prefix scan).

A segment of tokens maps the state entering it to the state leaving it::

    S_out = M @ S_in + S          M: [..., K, K]   S: [..., K, V]

so a segment is a pair (M, S). Composition, "first X, then Y", is associative::

    (M_Y, S_Y) o (M_X, S_X) = (M_Y M_X,  M_Y S_X + S_Y)

Ranks r = 0..P-1 hold consecutive segments. The state entering rank r is the exclusive prefix
(pair_{r-1} o ... o pair_0) applied to the initial state. In backward the gradient D_r of rank r's
end state is the reverse exclusive scan of the transposed maps x -> M_j^T x + G_j over j > r.

Pairs of all ranks are stacked on dim 0 ([P, ...]). Pure math: no process groups here. Two
schedules compute the same scans: ``"sequential"`` (P - 1 steps) and ``"log_depth"``
(a shift, then Hillis-Steele: ceil(log2(P - 1)) steps of batched products). Matrix products run in the tensors'
dtype; keep M in fp32 or fp64 (never bf16/TF32: the error would grow with the chain length). Every
product here runs in IEEE fp32 even when the caller allowed TF32 for fp32 matmuls
(``torch.set_float32_matmul_precision("high")``, common in training scripts): see ``ieee_fp32``.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Literal, NamedTuple

import torch

__all__ = [
    "AffineMap",
    "compose",
    "apply",
    "identity_like",
    "exclusive_scan",
    "reverse_transposed_exclusive_scan",
    "total",
    "prefix_at",
    "transposed_suffix_at",
    "state_at",
    "transposed_state_at",
    "ScanMethod",
    "ieee_fp32_matmul",
]

ScanMethod = Literal["sequential", "log_depth"]


@contextlib.contextmanager
def ieee_fp32_matmul():
    """Within the block, fp32 matmuls are IEEE fp32 (precision "highest"), never TF32 or bf16x3;
    the caller's setting is restored on exit. Products of transitions M must keep fp32 accuracy."""
    prev = torch.get_float32_matmul_precision()
    if prev == "highest":
        yield
        return
    torch.set_float32_matmul_precision("highest")
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(prev)


def ieee_fp32(fn):
    """Decorator: run ``fn`` under :func:`ieee_fp32_matmul`."""

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        with ieee_fp32_matmul():
            return fn(*args, **kwargs)

    return wrapped


class AffineMap(NamedTuple):
    """x -> M @ x + S. M: [..., K, K]; S: [..., K, V]."""

    M: torch.Tensor
    S: torch.Tensor


@ieee_fp32
def compose(second: AffineMap, first: AffineMap) -> AffineMap:
    """The map "apply ``first``, then ``second``": (M2 M1, M2 S1 + S2)."""
    return AffineMap(second.M @ first.M, second.M @ first.S + second.S)


@ieee_fp32
def apply(f: AffineMap, x: torch.Tensor) -> torch.Tensor:
    """f(x) = M @ x + S."""
    return f.M @ x + f.S


def identity_like(f: AffineMap) -> AffineMap:
    """The identity map with the shapes, dtype and device of ``f`` (one element of a stack)."""
    K = f.M.shape[-1]
    eye = torch.eye(K, dtype=f.M.dtype, device=f.M.device).expand_as(f.M).clone()
    return AffineMap(eye, torch.zeros_like(f.S))


def _check_stack(maps: AffineMap) -> None:
    M, S = maps
    if M.dim() >= 1 and M.shape[0] == 0:
        raise ValueError("the stack of maps is empty (P = 0): a scan needs at least one segment")
    if M.dim() < 3 or M.shape[-1] != M.shape[-2]:
        raise ValueError(f"M must be [P, ..., K, K], got {tuple(M.shape)}")
    if S.shape[:-1] != M.shape[:-1]:
        raise ValueError(f"S must be [P, ..., K, V] matching M {tuple(M.shape)}, got {tuple(S.shape)}")
    if M.dtype != S.dtype or not M.is_floating_point():
        raise ValueError(f"M and S must share one floating dtype, got {M.dtype} and {S.dtype}")


def _check_method(method) -> None:
    if method not in ("sequential", "log_depth"):
        raise ValueError(f"method must be 'sequential' or 'log_depth', got {method!r}")


def _check_state(name: str, x: torch.Tensor, maps: AffineMap) -> None:
    """ValueError unless x is one state [..., K, V] of the maps' stack (S without its P dim)."""
    want = tuple(maps.S.shape[1:])
    if not isinstance(x, torch.Tensor) or tuple(x.shape) != want:
        raise ValueError(f"{name} must be a state {list(want)} (S [P, ..., K, V] without P), got "
                         f"{list(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}")


@ieee_fp32
def exclusive_scan(maps: AffineMap, method: ScanMethod = "log_depth") -> AffineMap:
    """Exclusive prefix compositions of a stack of maps.

    Args:
        maps: (M [P, ..., K, K], S [P, ..., K, V]); maps[r] is segment r.
        method: "sequential" or "log_depth"; both give the same result up to rounding.

    Returns:
        prefix with prefix[0] = identity and prefix[r] = maps[r-1] o ... o maps[0].

    Raises:
        ValueError: on malformed shapes or an unknown method.
    """
    _check_stack(maps)
    M, S = maps
    P = M.shape[0]
    ident = identity_like(AffineMap(M[0], S[0]))
    if method == "sequential":
        outM, outS = [ident.M], [ident.S]
        acc = ident
        for r in range(P - 1):
            acc = compose(AffineMap(M[r], S[r]), acc)
            outM.append(acc.M)
            outS.append(acc.S)
        return AffineMap(torch.stack(outM), torch.stack(outS))
    if method == "log_depth":
        # Shift right by one (exclusive), then Hillis-Steele inclusive scan: after the step with
        # offset d, element r holds the composition of the (up to) 2d elements ending at r.
        accM = torch.cat([ident.M[None], M[:-1]])
        accS = torch.cat([ident.S[None], S[:-1]])
        d = 1
        while d < P - 1:  # after the shift each element covers 1 map; P - 1 is the most needed
            newM, newS = accM.clone(), accS.clone()
            # element r <- acc[r] o acc[r - d]
            newM[d:] = accM[d:] @ accM[:-d]
            newS[d:] = accM[d:] @ accS[:-d] + accS[d:]
            accM, accS = newM, newS
            d *= 2
        return AffineMap(accM, accS)
    _check_method(method)


@ieee_fp32
def total(maps: AffineMap, method: ScanMethod = "log_depth") -> AffineMap:
    """maps[P-1] o ... o maps[0]: the map of the whole sequence (P >= 1).

    "log_depth" composes neighbours pairwise, ceil(log2 P) rounds of batched products and P - 1
    compositions in all; "sequential" folds left to right in P - 1 steps.

    The result may share memory with ``maps`` (a single map is returned as a view).

    Raises:
        ValueError: on malformed shapes, an empty stack or an unknown method.
    """
    _check_stack(maps)
    M, S = maps
    if M.shape[0] == 0:
        raise ValueError("total of an empty stack of maps")
    if method == "sequential":
        acc = AffineMap(M[0], S[0])
        for r in range(1, M.shape[0]):
            acc = compose(AffineMap(M[r], S[r]), acc)
        return acc
    if method != "log_depth":
        _check_method(method)
    while M.shape[0] > 1:
        n = M.shape[0] // 2 * 2  # pairs (2i, 2i + 1); an odd last map carries over unchanged
        first, second = AffineMap(M[0:n:2], S[0:n:2]), AffineMap(M[1:n:2], S[1:n:2])
        pairM, pairS = compose(second, first)
        M, S = torch.cat([pairM, M[n:]]), torch.cat([pairS, S[n:]])
    return AffineMap(M[0], S[0])


def prefix_at(maps: AffineMap, r: int, method: ScanMethod = "log_depth") -> AffineMap:
    """``exclusive_scan(maps)[r]`` alone: maps[r-1] o ... o maps[0], the identity for r = 0.

    What one rank needs after an all-gather: r - 1 compositions (a tree of depth ceil(log2 r))
    instead of a scan over all P maps.
    """
    _check_stack(maps)
    _check_method(method)
    if not 0 <= r < maps.M.shape[0]:
        raise ValueError(f"r={r} outside the stack of {maps.M.shape[0]} maps")
    if r == 0:
        return identity_like(AffineMap(maps.M[0], maps.S[0]))
    return total(AffineMap(maps.M[:r], maps.S[:r]), method)


def transposed_suffix_at(maps: AffineMap, r: int, method: ScanMethod = "log_depth") -> AffineMap:
    """``reverse_transposed_exclusive_scan(maps)[r]`` alone: t_{r+1} o ... o t_{P-1} with
    t_j(x) = M_j^T x + G_j, the identity for r = P - 1 (P - r - 2 compositions)."""
    _check_stack(maps)
    _check_method(method)
    P = maps.M.shape[0]
    if not 0 <= r < P:
        raise ValueError(f"r={r} outside the stack of {P} maps")
    if r == P - 1:
        return identity_like(AffineMap(maps.M[0], maps.S[0]))
    return total(AffineMap(maps.M[r + 1:].flip(0).transpose(-1, -2), maps.S[r + 1:].flip(0)), method)


@ieee_fp32
def reverse_transposed_exclusive_scan(maps: AffineMap, method: ScanMethod = "log_depth") -> AffineMap:
    """Suffix compositions of the transposed maps x -> M_j^T x + G_j, for the CP backward.

    Args:
        maps: (M [P, ..., K, K], G [P, ..., K, V]) where M_j is segment j's forward transition and
            G_j the gradient of segment j's incoming state from its own outputs alone.

    Returns:
        suffix with suffix[P-1] = identity and suffix[r] = t_{r+1} o t_{r+2} o ... o t_{P-1},
        t_j(x) = M_j^T x + G_j. The gradient of rank r's end state is D_r = suffix[r](D_{P-1}).
    """
    _check_stack(maps)
    flipped = AffineMap(maps.M.flip(0).transpose(-1, -2), maps.S.flip(0))
    out = exclusive_scan(flipped, method)
    return AffineMap(out.M.flip(0), out.S.flip(0))


def _mv_add(M: torch.Tensor, x: torch.Tensor, S: torch.Tensor, into_S: bool = False) -> torch.Tensor:
    """M @ x + S in one batched GEMM (baddbmm over the flattened leading dims); with ``into_S``
    written over S (a strided view is fine: cuBLAS takes its row stride), else a new tensor (one copy
    of S plus the GEMM)."""
    M, x = M.reshape(-1, *M.shape[-2:]), x.reshape(-1, *x.shape[-2:])
    if into_S:
        return S.reshape(-1, *S.shape[-2:]).baddbmm_(M, x).view(S.shape)
    return torch.baddbmm(S.reshape(-1, *S.shape[-2:]), M, x).view(S.shape)


def _chain(maps: AffineMap, x: torch.Tensor, steps, transposed: bool, scratch: bool) -> torch.Tensor:
    """x <- M_j x + S_j (M_j^T with ``transposed``) for j in ``steps``. With ``scratch`` every step
    but the last writes over S_j (the caller's buffer), so the chain makes one copy, not one per step."""
    steps = list(steps)
    for i, j in enumerate(steps):
        M = maps.M[j].transpose(-1, -2) if transposed else maps.M[j]
        x = _mv_add(M, x, maps.S[j], into_S=scratch and i < len(steps) - 1)
    return x


@ieee_fp32
def state_at(maps: AffineMap, r: int, x0: torch.Tensor | None = None, scratch: bool = False) -> torch.Tensor:
    """``apply(prefix_at(maps, r), x0)`` as a chain of states: x_{j+1} = M_j x_j + S_j from x_0 =
    ``x0`` (zero when None), one product per map and none of two M's (r - 1 batched GEMMs with
    x0 None). What one rank's forward needs after an all-gather: its incoming state [..., K, V],
    a new contiguous tensor. ``scratch``: ``maps`` is a buffer the caller discards (a gathered
    one), so the chain may overwrite its S rows below r - 1 instead of copying each step's addend.

    Raises:
        ValueError: on malformed shapes or r outside the stack.
    """
    _check_stack(maps)
    if not 0 <= r < maps.M.shape[0]:
        raise ValueError(f"r={r} outside the stack of {maps.M.shape[0]} maps")
    if x0 is None:
        if r == 0:
            return torch.zeros_like(maps.S[0], memory_format=torch.contiguous_format)
        if r == 1:
            return maps.S[0].clone(memory_format=torch.contiguous_format)  # M_0 0 + S_0
        x, first = maps.S[0], 1  # read, never written: every product below writes elsewhere
    else:  # a copy: the result never aliases the caller's tensor
        _check_state("x0", x0, maps)
        x, first = x0.to(maps.S.dtype, copy=True, memory_format=torch.contiguous_format), 0
    return _chain(maps, x, range(first, r), transposed=False, scratch=scratch) if r > first else x


@ieee_fp32
def transposed_state_at(maps: AffineMap, r: int, seed: torch.Tensor | None = None,
                        scratch: bool = False) -> torch.Tensor:
    """``apply(transposed_suffix_at(maps, r), seed)`` as a chain: d = seed (zero when None), then
    d = M_j^T d + G_j for j = P-1 down to r+1. What one rank's backward needs: the gradient of its
    end state [..., K, V], a new contiguous tensor. ``scratch``: as in :func:`state_at` (the S
    rows above r + 1 may be overwritten).

    Raises:
        ValueError: on malformed shapes or r outside the stack.
    """
    _check_stack(maps)
    P = maps.M.shape[0]
    if not 0 <= r < P:
        raise ValueError(f"r={r} outside the stack of {P} maps")
    if seed is None:
        if r == P - 1:
            return torch.zeros_like(maps.S[0], memory_format=torch.contiguous_format)
        if r == P - 2:
            return maps.S[P - 1].clone(memory_format=torch.contiguous_format)  # M^T 0 + G
        d, last = maps.S[P - 1], P - 2  # read, never written
    else:
        _check_state("seed", seed, maps)
        d, last = seed.to(maps.S.dtype, copy=True, memory_format=torch.contiguous_format), P - 1
    return _chain(maps, d, range(last, r, -1), transposed=True, scratch=scratch) if last > r else d
