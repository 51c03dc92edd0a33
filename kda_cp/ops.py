"""chunk_kda: the public single-device KDA op, its input checks, backends and autograd.

Two backends compute the same function:

* ``"torch"``: the chunked form in plain torch (:mod:`kda_cp.reference`); any device, any dtype.
* ``"tilelang"``: the TileLang kernels of :mod:`kda_cp.kernels` on Hopper GPUs.

``backend="auto"`` picks TileLang for CUDA tensors it supports and torch elsewhere. Every backend
offers the four stages that context parallelism composes (docs/design.md §4): ``fwd``, ``bwd``,
``summary`` (the shard's affine map (M, S~)) and ``state_grad`` (dh0 with dht = 0).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import math
import os
import logging
import warnings
from typing import Literal, NamedTuple

import torch

from kda_cp import reference

__all__ = ["chunk_kda", "KDAOptions", "Backend", "get_backend", "check_inputs", "apply_input_options", "BackendName"]

log = logging.getLogger(__name__)

BackendName = Literal["auto", "torch", "tilelang"]
BACKENDS = ("auto", "torch", "tilelang")


class _DefaultGMin(float):
    """The default gate bound, -5.0, told apart from an explicit -5.0: with use_gate_in_kernel the
    caller must name the gate's form (flash-linear-attention's default there is the unbounded one)."""

    def __repr__(self) -> str:
        return "-5.0"


DEFAULT_G_MIN = _DefaultGMin(-5.0)


def check_cu_seqlens_tensor(cu_seqlens: torch.Tensor) -> None:
    """ValueError unless the tensor ``cu_seqlens`` is 1-D integers (its form only: no device read)."""
    if cu_seqlens.dim() != 1 or cu_seqlens.is_floating_point() or cu_seqlens.is_complex() \
            or cu_seqlens.dtype == torch.bool:
        raise ValueError(f"cu_seqlens must be a 1-D integer tensor [N + 1], got {_shape(cu_seqlens)}")
    if cu_seqlens.is_meta:  # no values to read
        raise ValueError("cu_seqlens must hold its offsets (a CPU or CUDA tensor), got a meta tensor")


def check_cu_seqlens(cu_seqlens, total: int | None = None, *, allow_empty: bool = True,
                     batch: int | None = None) -> list[int]:
    """Packed-sequence offsets (FlashAttention convention) as a list of ints, after checking them.

    Args:
        cu_seqlens: a 1-D integer tensor or a sequence of ints [N + 1]: 0, then the running sum of
            the N sequence lengths.
        total: the packed length they must end at (T), or None to skip that check.
        allow_empty: accept zero-length sequences (equal neighbours); CP needs them excluded.
        batch: the input's batch size B, which packed sequences need to be 1 (None: not checked).

    Raises:
        ValueError: ``batch`` not 1, not 1-D integers, a meta tensor, fewer than 2 entries, not
            starting at 0, decreasing (or, with allow_empty=False, not strictly increasing), or not
            ending at ``total``.
    """
    if batch is not None and batch != 1:
        raise ValueError(f"cu_seqlens needs B == 1 (sequences packed along T), got B = {batch}")
    if isinstance(cu_seqlens, torch.Tensor):
        check_cu_seqlens_tensor(cu_seqlens)
        from kda_cp.kernels._common import host_offsets  # no device read for kda_cp's own offsets
        cs = list(host_offsets(cu_seqlens))
    else:
        try:
            cs = list(cu_seqlens)
        except TypeError:
            raise ValueError(f"cu_seqlens must be a 1-D integer tensor or a sequence of ints, "
                             f"got {type(cu_seqlens).__name__}") from None
        if not all(isinstance(c, int) and not isinstance(c, bool) for c in cs):
            raise ValueError(f"cu_seqlens must be a 1-D integer tensor or a sequence of ints, got {cs}")
    if len(cs) < 2 or cs[0] != 0:
        raise ValueError(f"cu_seqlens must start at 0 and hold at least one sequence, got {cs}")
    if allow_empty and any(b < a for a, b in zip(cs[:-1], cs[1:])):
        raise ValueError(f"cu_seqlens must not decrease, got {cs}")
    if not allow_empty and any(b <= a for a, b in zip(cs[:-1], cs[1:])):
        raise ValueError(f"cu_seqlens must be strictly increasing (no empty sequences), got {cs}")
    if total is not None and cs[-1] != total:
        raise ValueError(f"cu_seqlens must end at the packed length T = {total}, got cu_seqlens[-1] = {cs[-1]}")
    return cs


_FP32_MAX = float(torch.finfo(torch.float32).max)


def check_scale(scale) -> None:
    """ValueError unless ``scale`` (the output scale) is None (K ** -0.5) or a real number finite
    in float32 (the kernels' accumulation type)."""
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale)
                              or abs(scale) > _FP32_MAX):
        raise ValueError(f"scale must be a finite number (at most {_FP32_MAX:.4g} in magnitude, float32's "
                         f"largest) or None (K ** -0.5), got {scale!r}")


def check_g_min(g_min) -> None:
    """ValueError unless ``g_min`` (the declared lower bound of g) is a number in [-5, 0) or None."""
    if g_min is not None and (isinstance(g_min, bool) or not isinstance(g_min, (int, float)) or not -5.0 <= g_min < 0.0):
        raise ValueError(f"g_min (the declared lower bound of g) must be a number in [-5, 0) or None, got {g_min!r}")


def check_flags(**flags) -> None:
    """ValueError naming the first flag that is not a bool (a string such as "no" is truthy)."""
    for name, x in flags.items():
        if not isinstance(x, bool):
            raise ValueError(f"{name} must be a bool (True or False), got {x!r}")


def check_chunk_size(chunk_size) -> None:
    """ValueError unless ``chunk_size`` is a positive int that is a multiple of the 16-token
    sub-chunk (or a single sub-chunk shorter than 16)."""
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1 \
            or chunk_size % min(reference.SUB_CHUNK, chunk_size):
        raise ValueError(f"chunk_size must be a positive int, a multiple of {reference.SUB_CHUNK} (or below it), "
                         f"got {chunk_size!r}")


# --------------------------------------------------------------------------------------------
# Input checks
# --------------------------------------------------------------------------------------------


def _shape(x: torch.Tensor) -> str:
    return f"{list(x.shape)} ({x.dtype}, {x.device})"


def check_inputs(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    chunk_size: int = 64,
    check_gate: bool = True,
    g_min: float | None = -5.0,
    *,
    layout_warning: bool = True,
    allow_neg_eigval: bool = False,
) -> None:
    """Validate KDA inputs; raise ValueError naming the argument, its shape and what was expected.
    With ``allow_neg_eigval`` beta may lie in [0, 2] (else [0, 1]).

    ``layout_warning``: warn once when T < H (a likely head-first layout); CP shards may be short.
    """
    if not isinstance(allow_neg_eigval, bool):
        raise ValueError(f"allow_neg_eigval must be a bool, got {allow_neg_eigval!r}")
    for name, x in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
        if not isinstance(x, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
        if not x.is_floating_point():
            raise ValueError(f"{name} must be a floating-point tensor, got {x.dtype}")
    if q.dim() != 4:
        raise ValueError(f"q must be [B, T, H, K], got {_shape(q)}")
    B, T, H, K = q.shape
    if layout_warning and 0 < T < H and not _LAYOUT_KNOWN.get():
        _warn_once(
            "chunk_kda got q with T < H: the layout is [B, T, H, K] (time before heads); "
            "head-first [B, H, T, K] input would be silently wrong"
        )
    if k.shape != q.shape:
        raise ValueError(f"k must have q's shape [B, T, H, K] = {list(q.shape)}, got {_shape(k)}")
    if v.dim() != 4 or v.shape[:3] != q.shape[:3]:
        raise ValueError(f"v must be [B, T, H, V] = [{B}, {T}, {H}, V], got {_shape(v)}")
    if g.shape != q.shape:
        raise ValueError(
            f"g must be the per-channel log decay [B, T, H, K] = {list(q.shape)}, got {_shape(g)}"
            + (" (a scalar gate per head is GDN, not KDA: expand it over K)" if g.shape == q.shape[:3] else "")
        )
    if beta.shape != q.shape[:3]:
        raise ValueError(f"beta must be [B, T, H] = {list(q.shape[:3])}, got {_shape(beta)}")
    for name, x in (("k", k), ("v", v), ("g", g), ("beta", beta)):
        if x.device != q.device:
            raise ValueError(f"{name} is on {x.device} but q is on {q.device}")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    check_chunk_size(chunk_size)
    check_g_min(g_min)
    if initial_state is not None and not isinstance(initial_state, torch.Tensor):
        raise ValueError(f"initial_state must be a torch.Tensor [N, H, K, V] or None, got {type(initial_state).__name__}")
    if initial_state is not None and not initial_state.is_floating_point():
        raise ValueError(f"initial_state must be a real floating-point tensor (fp32), got {initial_state.dtype}")
    if K < 1:
        raise ValueError(f"q and k need a head dim K >= 1, got q {_shape(q)}")
    n_states = B
    if cu_seqlens is not None:
        n_states = len(check_cu_seqlens(cu_seqlens, T, batch=B)) - 1
    if initial_state is not None:
        V = v.shape[-1]
        want = [n_states, H, K, V]
        if list(initial_state.shape) != want:
            raise ValueError(
                f"initial_state must be [N, H, K, V] = {want} (N = {'number of sequences' if cu_seqlens is not None else 'B'}), "
                f"got {_shape(initial_state)}"
            )
        if initial_state.device != q.device:
            raise ValueError(f"initial_state is on {initial_state.device} but q is on {q.device}")
    if check_gate and g.numel():
        # one device sync for every value check: (min, max) of each input
        named = [("g", g), ("q", q), ("k", k), ("v", v), ("beta", beta), ("initial_state", initial_state)]
        named = [(n, x) for n, x in named if x is not None and x.numel()]
        stats = torch.stack([torch.stack(torch.aminmax(x.detach())).to(torch.float64) for _, x in named]).tolist()
        ranges = {n: tuple(st) for (n, _), st in zip(named, stats)}
        lo, hi = ranges["g"]
        if not math.isfinite(lo) or not math.isfinite(hi) or hi > 0:
            raise ValueError(f"g is a log decay and must be finite and <= 0; min(g) = {lo:.4g}, max(g) = {hi:.4g}")
        # a gate computed in g's dtype reaches g_min rounded to that dtype (fp32(-4.3) < -4.3)
        if g_min is not None and lo < min(g_min, torch.tensor(g_min, dtype=g.dtype).item()):
            raise ValueError(
                f"g must lie in [g_min, 0] = [{g_min}, 0] (the declared gate bound); min(g) = {lo:.4g}. "
                "Bound the gate (g = g_min * sigmoid(.)) or pass g_min=None (any g <= 0)"
            )
        for name, (lo, hi) in ranges.items():
            if not (math.isfinite(lo) and math.isfinite(hi)):
                raise ValueError(f"{name} must be finite; min = {lo:.4g}, max = {hi:.4g} (NaN or Inf in the input)")
        lo, hi = ranges["beta"]
        top = 2 if allow_neg_eigval else 1
        if lo < 0 or hi > top:
            raise ValueError(
                f"beta (the write strength, sigmoid of a projection) must lie in [0, {top}]"
                f"{' (allow_neg_eigval)' if allow_neg_eigval else ' (allow_neg_eigval=True allows [0, 2])'}; "
                f"min = {lo:.7g}, max = {hi:.7g}. Pass check_gate=False to skip the value checks"
            )


# --------------------------------------------------------------------------------------------
# Backends
# --------------------------------------------------------------------------------------------


class Grads(NamedTuple):
    dq: torch.Tensor
    dk: torch.Tensor
    dv: torch.Tensor
    dg: torch.Tensor
    dbeta: torch.Tensor
    dh0: torch.Tensor


@dataclasses.dataclass(frozen=True)
class KDAOptions:
    """Static options of one chunk_kda call."""

    scale: float
    chunk_size: int = 64
    output_final_state: bool = False
    g_min: float | None = -5.0


class Backend:
    """The four stages of KDA that chunk_kda and context parallelism compose.

    All states are [N, H, K, V] and all maps' M are [N, H, K, K], in fp32 (fp64 for fp64 inputs).
    """

    name = "abstract"

    def prepare(self, q, k, v, g, beta, opts: KDAOptions, cu_seqlens=None):
        """The state-independent half of ``fwd`` (gates, UT transform), or None where the backend
        does not split. Context parallelism runs it once per shard and shares it between the
        summary and the forward (``summary_prepared``, ``fwd``), or the state gradient and the backward."""
        return None

    def fwd(self, q, k, v, g, beta, h0, opts: KDAOptions, cu_seqlens=None, prepared=None):
        """-> (o [B, T, H, V], ht [N, H, K, V]); ``prepared`` is ``prepare``'s result for these inputs."""
        raise NotImplementedError

    def bwd(self, q, k, v, g, beta, h0, do, dht, opts: KDAOptions, cu_seqlens=None, prepared=None) -> Grads:
        """Gradients of <o, do> + <ht, dht> with respect to q, k, v, g, beta and h0. ``prepared``:
        ``prepare``'s result for these inputs, which the backend may use (and consume) or ignore."""
        raise NotImplementedError

    def summary(self, k, v, g, beta, opts: KDAOptions):
        """-> (M [B, H, K, K], S_tilde [B, H, K, V]) with S_out = M S_in + S_tilde."""
        raise NotImplementedError

    def summary_prepared(self, prepared, opts: KDAOptions, last_only: bool):
        """``summary`` of each sequence of a ``prepare`` result (only the last one with
        ``last_only``): the chunk-local work is shared with the forward that follows."""
        raise NotImplementedError

    def state_grad(self, q, k, v, g, beta, do, opts: KDAOptions, cu_seqlens=None, prepared=None):
        """dh0 [N, H, K, V] of <o, do> alone (dht = 0), one row per sequence; independent of h0
        because o is affine in h0. ``prepared`` as in ``bwd``, read and not consumed."""
        raise NotImplementedError

    def keep_for_backward(self, prepared) -> tuple:
        """The tensors of a ``prepare`` result worth keeping from the forward for ``bwd`` (autograd
        saves them), or () where the backward recomputes everything."""
        return ()

    def restore_prepared(self, q, k, v, g, beta, kept: tuple, opts: KDAOptions, cu_seqlens=None):
        """A ``prepared`` for ``state_grad`` / ``bwd`` from ``keep_for_backward``'s tensors (not
        empty) and the forward's inputs as autograd hands them back."""
        raise NotImplementedError


class TorchBackend(Backend):
    """Chunked KDA in torch; backward by recomputing the forward under autograd."""

    name = "torch"

    def prepare(self, q, k, v, g, beta, opts, cu_seqlens=None):
        return reference.chunk_kda_torch_prepare(q, k, v, g, beta, cu_seqlens, opts.chunk_size)

    def fwd(self, q, k, v, g, beta, h0, opts, cu_seqlens=None, prepared=None):
        o, ht = reference.chunk_kda_torch(
            q, k, v, g, beta, opts.scale, h0, True, cu_seqlens=cu_seqlens, chunk_size=opts.chunk_size,
            prepared=prepared,
        )
        return o.contiguous(), ht  # [B, T, H, V] rows, as the kernels write them (o.view(B, T, -1) works)

    def bwd(self, q, k, v, g, beta, h0, do, dht, opts, cu_seqlens=None, prepared=None):
        # autograd recomputes the chunk-local half itself: ``prepared`` is not needed here
        leaves = [x.detach().requires_grad_(True) for x in (q, k, v, g, beta, h0)]
        with torch.enable_grad():
            o, ht = reference.chunk_kda_torch(
                *leaves[:5], opts.scale, leaves[5], True, cu_seqlens=cu_seqlens, chunk_size=opts.chunk_size
            )
            outs, grads = [o], [do]
            if dht is not None:
                outs.append(ht)
                grads.append(dht.to(ht.dtype))
            res = torch.autograd.grad(outs, leaves, grads, allow_unused=True)
        return Grads(*(torch.zeros_like(x) if r is None else r for x, r in zip(leaves, res)))

    def summary(self, k, v, g, beta, opts):
        return reference.chunk_kda_summary_torch(k, v, g, beta, chunk_size=opts.chunk_size)

    def summary_prepared(self, prepared, opts, last_only):
        return reference.chunk_kda_summary_torch_prepared(prepared, last_only=last_only)

    def state_grad(self, q, k, v, g, beta, do, opts, cu_seqlens=None, prepared=None):
        B, _, H, K = q.shape
        N = B if cu_seqlens is None else cu_seqlens.numel() - 1
        h0 = q.new_zeros(N, H, K, v.shape[-1], dtype=reference._compute_dtype(q.dtype)).requires_grad_(True)
        with torch.enable_grad():
            o, _ = reference.chunk_kda_torch(
                q.detach(), k.detach(), v.detach(), g.detach(), beta.detach(), opts.scale, h0, False,
                cu_seqlens=cu_seqlens, chunk_size=opts.chunk_size, prepared=prepared,
            )
            (dh0,) = torch.autograd.grad(o, h0, do)
        return dh0


class TileLangBackend(Backend):
    """The TileLang kernels of :mod:`kda_cp.kernels` (forward, summary, backward, state gradient)."""

    name = "tilelang"

    def __init__(self, kernels):
        self.kernels = kernels

    def prepare(self, q, k, v, g, beta, opts, cu_seqlens=None):
        return self.kernels.chunk_kda_fwd_prepare(q, k, v, g, beta, scale=opts.scale, cu_seqlens=cu_seqlens,
                                                  chunk_size=opts.chunk_size, g_min=opts.g_min)

    def fwd(self, q, k, v, g, beta, h0, opts, cu_seqlens=None, prepared=None):
        return self.kernels.chunk_kda_fwd(
            q, k, v, g, beta, scale=opts.scale, initial_state=h0.float().contiguous(), output_final_state=True,
            cu_seqlens=cu_seqlens, chunk_size=opts.chunk_size, g_min=opts.g_min, prepared=prepared,
        )

    def bwd(self, q, k, v, g, beta, h0, do, dht, opts, cu_seqlens=None, prepared=None):
        from kda_cp.kernels.backward import chunk_kda_bwd

        if do is None:  # only the final state was used downstream
            do = torch.zeros(*q.shape[:3], v.shape[-1], device=q.device, dtype=q.dtype)
        return Grads(*chunk_kda_bwd(
            q, k, v, g, beta, scale=opts.scale, initial_state=h0.float().contiguous(),
            do=do.to(q.dtype).contiguous(), dht=None if dht is None else dht.float().contiguous(),
            cu_seqlens=cu_seqlens, chunk_size=opts.chunk_size, g_min=opts.g_min, prepared=prepared,
        ))

    def summary(self, k, v, g, beta, opts):
        return self.kernels.chunk_kda_summary(k, v, g, beta, chunk_size=opts.chunk_size, g_min=opts.g_min)

    def summary_prepared(self, prepared, opts, last_only):
        return self.kernels.chunk_kda_summary_prepared(prepared, last_only=last_only)

    def keep_for_backward(self, prepared):
        return () if prepared is None else self.kernels.keep_for_backward(prepared)

    def restore_prepared(self, q, k, v, g, beta, kept, opts, cu_seqlens=None):
        return self.kernels.restore_prepared(q, k, v, g, beta, kept, scale=opts.scale, cu_seqlens=cu_seqlens,
                                             chunk_size=opts.chunk_size, g_min=opts.g_min)

    def state_grad(self, q, k, v, g, beta, do, opts, cu_seqlens=None, prepared=None):
        from kda_cp.kernels.backward import chunk_kda_state_grad

        return chunk_kda_state_grad(q, k, v, g, beta, scale=opts.scale, do=do.to(q.dtype).contiguous(),
                                    cu_seqlens=cu_seqlens, chunk_size=opts.chunk_size, g_min=opts.g_min,
                                    prepared=prepared)


_LAYOUT_KNOWN = contextvars.ContextVar("kda_cp_layout_known", default=False)


@contextlib.contextmanager
def layout_known():
    """Within the block chunk_kda does not warn on T < H: for callers that build the [B, T, H, K]
    layout themselves (the layer, whose inputs may be a single token)."""
    token = _LAYOUT_KNOWN.set(True)
    try:
        yield
    finally:
        _LAYOUT_KNOWN.reset(token)


@functools.lru_cache(maxsize=None)
def _warn_once(msg: str) -> None:
    warnings.warn(msg, stacklevel=3)


@functools.lru_cache(maxsize=None)
def _tilelang_kernels():
    try:
        from kda_cp import kernels
    except Exception as exc:  # tilelang missing or broken
        return None, f"kda_cp.kernels could not be imported ({type(exc).__name__}: {exc})"
    if not hasattr(kernels, "chunk_kda_fwd"):
        return None, "kda_cp.kernels has no chunk_kda_fwd"
    return kernels, ""


_TORCH = TorchBackend()


def _aligned_dense(x: torch.Tensor) -> torch.Tensor:
    """x itself when contiguous and kernels.TMA_ALIGN-byte aligned (the kernels read q, k, v, g by
    TMA), else a contiguous, aligned copy."""
    from kda_cp.kernels import TMA_ALIGN  # torch only: no tilelang import

    x = x.contiguous()
    return x.clone() if x.data_ptr() % TMA_ALIGN else x


def dense_on_cuda(*xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Contiguous, 16-byte aligned copies of strided or misaligned CUDA inputs (the kernels read
    dense [B, T, H, *] rows, q/k/v/g by TMA); inputs already dense and aligned are returned as
    they are.

    A layer's q, k, v are usually views of one fused projection; copying them costs far less than
    running the op off the kernels (the torch fallback). CPU tensors are returned as they are (the
    torch backend reads any strides).
    """
    return tuple(_aligned_dense(x) if x.is_cuda else x for x in xs)


def get_backend(name: BackendName, q, k, v, g, beta, cu_seqlens=None, g_min: float | None = -5.0,
                chunk_size: int = 64) -> Backend:
    """Resolve a backend name for these inputs.

    "auto": TileLang for CUDA inputs the kernels support, else torch (with a one-time warning on
    CUDA). "tilelang": the kernels, or NotImplementedError saying why not. "torch": torch.
    A bound ``g_min`` in [-5, 0) selects the bounded kernels, None the general-gate ones.

    Raises:
        ValueError: unknown name. NotImplementedError: "tilelang" for inputs it does not cover.
    """
    if name == "torch":
        return _TORCH
    if name not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {name!r}")
    if not q.is_cuda:
        if name == "tilelang":
            raise NotImplementedError(f"the TileLang backend needs CUDA tensors, got q on {q.device}")
        return _TORCH
    kernels, why = _tilelang_kernels()
    if chunk_size != 64:
        kernels, why = None, f"the kernels use chunk_size 64, got {chunk_size}"
    elif not all(x.is_contiguous() for x in (q, k, v, g, beta)):
        kernels, why = None, "the kernels need contiguous q, k, v, g, beta"
    if kernels is not None:
        ok, why = kernels.is_supported(q, k, v, g, beta, cu_seqlens)
        if ok:
            return TileLangBackend(kernels)
    if name == "tilelang":
        raise NotImplementedError(f"the TileLang backend does not cover these inputs: {why}")
    _warn_once(f"chunk_kda falls back to the torch backend on CUDA: {why}")
    return _TORCH


def check_segment_len(segment_len, chunk_size: int) -> None:
    """ValueError unless segment_len is "auto", None or a positive int multiple of chunk_size."""
    if segment_len is None or (isinstance(segment_len, str) and segment_len == "auto"):
        return
    if isinstance(segment_len, bool) or not isinstance(segment_len, int) or segment_len < 1 or segment_len % chunk_size:
        raise ValueError(f"segment_len must be \"auto\", None or a positive multiple of chunk_size = {chunk_size}, "
                         f"got {segment_len!r}")


def segmented(impl: Backend, segment_len, chunk_size: int) -> Backend:
    """``impl`` run on segments of ``segment_len`` tokens (:class:`kda_cp.parallel.segments.SegmentedBackend`);
    None: ``impl`` itself. "auto": on the TileLang kernels at chunk size 64, a wrapper that splits
    each call where :func:`kda_cp.parallel.segments.auto_segment_len` says so; elsewhere ``impl``.

    Raises:
        ValueError: segment_len not "auto", None or a positive int multiple of chunk_size.
    """
    check_segment_len(segment_len, chunk_size)
    if segment_len is None or (segment_len == "auto" and (impl.name != "tilelang" or chunk_size != 64)):
        return impl
    from kda_cp.parallel.segments import SegmentedBackend  # kda_cp.parallel imports this module

    return SegmentedBackend(impl, segment_len)


def expand_value_heads(q, k, v):
    """GVA (grouped value attention): with v [B, T, HV, V] and q, k [B, T, H, K], HV a multiple of
    H, value head j reads key head j // (HV / H); q and k are repeated to HV heads (differentiable:
    their gradients sum over each group). Returns (q, k) unchanged when HV == H.

    Raises:
        ValueError: HV not a multiple of H.
    """
    if not all(isinstance(x, torch.Tensor) and x.dim() == 4 for x in (q, k, v)) or v.shape[2] == q.shape[2]:
        return q, k
    H, HV = q.shape[2], v.shape[2]
    if H == 0 or HV % H or k.shape != q.shape:
        raise ValueError(f"v has HV = {HV} value heads and q, k have H = {H} heads {list(q.shape)}, {list(k.shape)}: "
                         "grouped value attention needs HV a multiple of H and k shaped like q")
    return q.repeat_interleave(HV // H, dim=2), k.repeat_interleave(HV // H, dim=2)


def apply_input_options(q, k, g, beta, *, use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False, A_log=None,
                        dt_bias=None, use_beta_sigmoid_in_kernel=False, g_min: float | None = DEFAULT_G_MIN,
                        allow_neg_eigval: bool = False):
    """The input transforms that chunk_kda and cp_chunk_kda take as options (flash-linear-attention's
    names), differentiable, fused on CUDA (:mod:`kda_cp.glue`).

    Math: q, k <- x / max(||x||_2, 1e-6) per head; g <- g_min * sigmoid(exp(A_log_h) * (g + dt_bias))
    (g_min set) or -exp(A_log_h) * softplus(g + dt_bias) (g_min None); beta <- sigmoid(beta), or
    2 * sigmoid(beta) with allow_neg_eigval (as flash-linear-attention).

    Returns:
        (q, k, g, beta): g and beta in fp32 (fp64 for fp64) where transformed, else as given.

    Raises:
        ValueError: A_log or dt_bias given without use_gate_in_kernel, g_min not passed with it
            (the gate's form must be named), A_log missing or not [H],
            dt_bias not [H * K] or [H, K], or g not [B, T, H, K] with q's H and K.
    """
    from kda_cp import glue

    for name, x in (("q", q), ("k", k), ("g", g), ("beta", beta)):
        if not isinstance(x, torch.Tensor) or not x.is_floating_point():
            raise ValueError(f"{name} must be a floating-point torch.Tensor, got "
                             f"{x.dtype if isinstance(x, torch.Tensor) else type(x).__name__}")
    check_gate_args(q, g, A_log, dt_bias, use_gate_in_kernel=use_gate_in_kernel, g_min=g_min)
    if use_qk_l2norm_in_kernel:
        q, k = glue.l2_norm(q), glue.l2_norm(k)
    if use_gate_in_kernel:
        scale = 2.0 if allow_neg_eigval else 1.0
        g, b = glue.kda_gate(g, A_log, dt_bias, g_min, beta if use_beta_sigmoid_in_kernel else None, beta_scale=scale)
        if use_beta_sigmoid_in_kernel:
            beta = b
    elif use_beta_sigmoid_in_kernel:
        beta = (2.0 if allow_neg_eigval else 1.0) * torch.sigmoid(beta.to(torch.promote_types(beta.dtype, torch.float32)))
    return q, k, g, beta


def check_gate_args(q, g, A_log, dt_bias, *, use_gate_in_kernel: bool, g_min) -> None:
    """The argument checks of use_gate_in_kernel (ValueError, see :func:`apply_input_options`)."""
    if not use_gate_in_kernel and (A_log is not None or dt_bias is not None):
        raise ValueError("A_log and dt_bias are the gate's parameters: pass them with use_gate_in_kernel=True")
    if use_gate_in_kernel and g_min is DEFAULT_G_MIN:
        raise ValueError("with use_gate_in_kernel, pass g_min to name the gate's form: a bound in [-5, 0) for "
                         "g = g_min * sigmoid(exp(A_log) * (g + dt_bias)) (flash-linear-attention's lower_bound), "
                         "or g_min=None for g = -exp(A_log) * softplus(g + dt_bias) (its default)")
    if use_gate_in_kernel:
        check_g_min(g_min)
        if q.dim() != 4 or g.shape != q.shape:
            raise ValueError(f"with use_gate_in_kernel, g (the gate's pre-activation) must be [B, T, H, K] like q "
                             f"{list(q.shape)}, got {_shape(g)}")
        H, K = q.shape[2], q.shape[3]  # H: the value heads HV (q is expanded to them under GVA)
        if not isinstance(A_log, torch.Tensor) or tuple(A_log.shape) != (H,) or not A_log.is_floating_point():
            raise ValueError(f"A_log must be a float tensor [HV] = [{H}] (one per value head) with "
                             f"use_gate_in_kernel, got {_shape(A_log) if isinstance(A_log, torch.Tensor) else A_log!r}")
        if dt_bias is not None and (not isinstance(dt_bias, torch.Tensor) or not dt_bias.is_floating_point()
                                    or tuple(dt_bias.shape) not in ((H * K,), (H, K))):
            raise ValueError(f"dt_bias must be a float tensor [HV * K] = [{H * K}] or [HV, K] = [{H}, {K}], got "
                             f"{_shape(dt_bias) if isinstance(dt_bias, torch.Tensor) else dt_bias!r}")
        for name, x in (("A_log", A_log), ("dt_bias", dt_bias)):
            if x is not None and x.device != g.device:
                raise ValueError(f"{name} is on {x.device} but g is on {g.device}")


# --------------------------------------------------------------------------------------------
# Autograd and the public op
# --------------------------------------------------------------------------------------------


def first_order_only(op: str):
    """Decorate an autograd backward (outside ``once_differentiable``): NotImplementedError when it
    runs under ``create_graph=True``, where the gradient would otherwise carry no graph."""

    def wrap(backward):
        @functools.wraps(backward)
        def checked(ctx, *grads):
            if torch.is_grad_enabled():  # autograd runs backward in grad mode iff create_graph=True
                raise NotImplementedError(
                    f"{op}: double backward (create_graph=True) is not implemented; the backward is hand-written "
                    "and not differentiable. Take first-order gradients only (create_graph=False)"
                )
            return backward(ctx, *grads)

        return checked

    return wrap


class ChunkKDAFunction(torch.autograd.Function):
    """Autograd for chunk_kda: forward by the backend's fwd, backward by its bwd."""

    @staticmethod
    def forward(ctx, q, k, v, g, beta, h0, cu_seqlens, backend: Backend, opts: KDAOptions):
        prepared = backend.prepare(q, k, v, g, beta, opts, cu_seqlens) if q.numel() > 0 else None
        o, ht = backend.fwd(q, k, v, g, beta, h0, opts, cu_seqlens, prepared=prepared)
        kept = backend.keep_for_backward(prepared)  # what the backward need not recompute
        del prepared
        ctx.save_for_backward(q, k, v, g, beta, h0, cu_seqlens, *kept)
        ctx.backend, ctx.opts = backend, opts
        if not opts.output_final_state:
            return o, None
        return o, ht

    @staticmethod
    @first_order_only("chunk_kda")
    @torch.autograd.function.once_differentiable
    def backward(ctx, do, dht):
        q, k, v, g, beta, h0, cu_seqlens, *kept = ctx.saved_tensors
        if q.shape[1] == 0:  # no tokens: the final state is the initial state
            dh0 = torch.zeros_like(h0) if dht is None else dht
            return (*(torch.zeros_like(x) for x in (q, k, v, g, beta)), dh0.to(h0.dtype), None, None, None)
        prepared = ctx.backend.restore_prepared(q, k, v, g, beta, kept, ctx.opts, cu_seqlens) if kept else None
        grads = ctx.backend.bwd(q, k, v, g, beta, h0, do, dht, ctx.opts, cu_seqlens, prepared=prepared)
        return (
            grads.dq.to(q.dtype), grads.dk.to(k.dtype), grads.dv.to(v.dtype), grads.dg.to(g.dtype),
            grads.dbeta.to(beta.dtype), grads.dh0.to(h0.dtype), None, None, None,
        )


class GatedChunkKDAFunction(torch.autograd.Function):
    """Autograd for chunk_kda with the gate (and beta's sigmoid) inside the TileLang chunk-local
    kernel: the forward reads the pre-activations z (q's dtype) and b and never writes the fp32 g.
    The backward remakes g and beta from them with the fused glue (:func:`kda_cp.glue.kda_gate`),
    runs the kernels' backward and chains dg, dbeta through the gate: dz, dA_log, ddt_bias, db."""

    @staticmethod
    def forward(ctx, q, k, v, z, b, A_log, dt_bias, h0, cu_seqlens, backend, opts: KDAOptions, beta_scale):
        H, K = q.shape[2], q.shape[3]
        kern = backend.kernels
        bias = (torch.zeros(H, K, device=q.device) if dt_bias is None else dt_bias.reshape(H, K)).float().contiguous()
        gate = kern.KernelGate(A_log.float().contiguous(), bias, beta_scale)
        kw = dict(scale=opts.scale, cu_seqlens=cu_seqlens, chunk_size=opts.chunk_size, g_min=opts.g_min, gate=gate)
        prepared = kern.chunk_kda_fwd_prepare(q, k, v, z, b, **kw)
        o, ht = kern.chunk_kda_fwd(q, k, v, z, b, initial_state=h0.float().contiguous(), output_final_state=True,
                                   prepared=prepared, **kw)
        kept = kern.keep_for_backward(prepared)
        del prepared
        ctx.save_for_backward(q, k, v, z, b, A_log, dt_bias, h0, cu_seqlens, *kept)
        ctx.backend, ctx.opts, ctx.beta_scale = backend, opts, beta_scale
        return o, (ht if opts.output_final_state else None)

    @staticmethod
    @first_order_only("chunk_kda")
    @torch.autograd.function.once_differentiable
    def backward(ctx, do, dht):
        from kda_cp import glue

        q, k, v, z, b, A_log, dt_bias, h0, cu_seqlens, *kept = ctx.saved_tensors
        backend, opts, beta_scale = ctx.backend, ctx.opts, ctx.beta_scale
        leaves = [x.detach().requires_grad_(True) if x is not None else None for x in (z, A_log, dt_bias)]
        bl = b.detach().requires_grad_(True) if beta_scale is not None else None
        with torch.enable_grad():
            g, beta = glue.kda_gate(leaves[0], leaves[1], leaves[2], opts.g_min, bl,
                                    beta_scale=1.0 if beta_scale is None else beta_scale)
        beta_in = b if beta is None else beta.detach()
        g_in = g.detach()
        prepared = backend.restore_prepared(q, k, v, g_in, beta_in, kept, opts, cu_seqlens)
        grads = backend.bwd(q, k, v, g_in, beta_in, h0, do, dht, opts, cu_seqlens, prepared=prepared)
        outs, outs_grad = [g], [grads.dg]
        ins = [x for x in leaves if x is not None]
        if bl is not None:
            outs.append(beta)
            outs_grad.append(grads.dbeta)
            ins.append(bl)
        d = list(torch.autograd.grad(outs, ins, outs_grad))
        dz, dA = d.pop(0), d.pop(0)
        ddt = d.pop(0) if dt_bias is not None else None
        db = d.pop(0) if bl is not None else grads.dbeta.to(b.dtype)
        return (grads.dq.to(q.dtype), grads.dk.to(k.dtype), grads.dv.to(v.dtype), dz, db, dA, ddt,
                grads.dh0.to(h0.dtype), None, None, None, None)


def _kernel_gate_backend(backend, q, k, v, z, b, cu_seqlens, g_min, chunk_size, segment_len):
    """The TileLang backend when the gate can run inside its chunk-local kernel for these inputs
    (bounded gate, no segment split, inputs the kernels cover), else None (the gate then runs as glue)."""
    if os.environ.get("KDA_CP_GATE_IN_KERNEL", "0") != "1":  # opt-in: no faster in the layer (docs/kernels.md)
        return None
    if backend == "torch" or g_min is None or chunk_size != 64 or not q.is_cuda:
        return None
    if segment_len == "auto" and q.dim() == v.dim() == 4:  # (malformed shapes fail the checks that follow)
        from kda_cp.parallel.segments import auto_split

        segment_len = auto_split(q, v, cu_seqlens, g_min)
    if segment_len is not None:
        return None
    kernels, _ = _tilelang_kernels()
    if kernels is None or not hasattr(kernels, "KernelGate"):
        return None
    if not all(x.is_contiguous() for x in (q, k, v, z)):
        return None
    ok, _ = kernels.is_supported(q, k, v, z, b, cu_seqlens, gated=True)
    return TileLangBackend(kernels) if ok else None


def _check_finite(named) -> None:
    """ValueError naming the first tensor holding a NaN or Inf (one device sync for all)."""
    named = [(n, x) for n, x in named if x is not None and x.numel()]
    if not named:
        return
    ok = torch.stack([torch.isfinite(x.detach()).all() for _, x in named]).tolist()
    for (name, _), fine in zip(named, ok):
        if not fine:
            raise ValueError(f"{name} must be finite (NaN or Inf in the input)")


def check_preactivations(g, beta, A_log, dt_bias, *, use_gate_in_kernel: bool, use_beta_sigmoid_in_kernel: bool) -> None:
    """With the gate or beta's sigmoid taken from pre-activations: ValueError naming the first of g
    (the gate's pre-activation), A_log, exp(A_log) (in the gate's compute dtype), dt_bias and beta
    (with use_beta_sigmoid_in_kernel) that holds a NaN or Inf. The gate itself stays finite there
    (a saturated sigmoid), but its backward is NaN. One device sync."""
    named = []
    if use_gate_in_kernel:
        cdt = torch.float64 if g.dtype == torch.float64 else torch.float32
        named += [("g (the gate's pre-activation)", g), ("A_log", A_log),
                  ("exp(A_log)", None if A_log is None else A_log.detach().to(cdt).exp()), ("dt_bias", dt_bias)]
    if use_beta_sigmoid_in_kernel:
        named.append(("beta (the pre-activation of its sigmoid)", beta))
    _check_finite(named)


def chunk_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    chunk_size: int = 64,
    backend: BackendName = "auto",
    check_gate: bool = True,
    g_min: float | None = DEFAULT_G_MIN,
    use_qk_l2norm_in_kernel: bool = False,
    use_gate_in_kernel: bool = False,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    segment_len: int | str | None = "auto",
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Kimi Delta Attention, chunked (Kimi Linear arXiv:2510.26692, Eq. 1 and Eqs. 7-9).

    Math:
        S_t = (I - beta_t k_t k_t^T) Diag(exp(g_t)) S_{t-1} + beta_t k_t v_t^T,   o_t = scale S_t^T q_t

    Args:
        q, k: [B, T, H, K], fp32/fp64 (any backend) or bf16/fp16 (TileLang on Hopper).
            k is expected L2-normalized per head (the layer does this), though not required.
        v: [B, T, H, V], q's dtype; or [B, T, HV, V] with HV a multiple of H (GVA: value head j
            reads key head j // (HV / H); g, beta, the states and o then have HV heads).
        g: [B, T, H, K], natural-log decay per step, fp32 (g <= 0). Not cumsummed.
        beta: [B, T, H], write strength in [0, 1] (in [0, 2] with allow_neg_eigval).
        scale: output scale; default K ** -0.5.
        initial_state: [N, H, K, V], fp32; N = B, or the number of sequences with cu_seqlens.
        output_final_state: also return the state after the last token of each sequence.
        cu_seqlens: int tensor (or list of ints) [N + 1] of packed-sequence offsets (FlashAttention
            convention, B = 1); zero-length sequences are allowed. Read to the host once per call.
        chunk_size: tokens per chunk (64; a multiple of 16, or any size below 16; the kernels use 64).
        backend: "auto", "torch" or "tilelang" (see :func:`get_backend`).
        check_gate: check the values (one device sync, one read of each input): g finite, <= 0 and
            >= g_min; q, k, v, beta and initial_state finite; beta in [0, 1]. False skips them
            (a NaN or Inf then propagates into o and the state).
        g_min: the declared lower bound of g, in [-5, 0) (Kimi K3: g = g_min * sigmoid(.), g_min = -5
            by default); the TileLang kernels rely on it to keep exp(+-cumsum(g)) in range over a
            16-token sub-chunk. None declares no bound (any g <= 0; the kernels' general-gate variants).
        use_qk_l2norm_in_kernel: L2-normalize q and k per head first (x / max(||x||, 1e-6));
            flash-linear-attention's x * rsqrt(sum x^2 + 1e-6) differs by ~5e-7 / ||x||^2 relative:
            about bf16's resolution at ||x|| = 1e-2, below it from ~3e-2 up, O(1) at ~1e-3 and below (docs/design.md §9).
        use_gate_in_kernel: g is the gate's pre-activation [B, T, H, K]; the op applies
            g_min * sigmoid(exp(A_log) * (g + dt_bias)), or -exp(A_log) * softplus(g + dt_bias)
            when g_min is None. g_min must then be passed explicitly
            (flash-linear-attention's default gate is the softplus one, kda_cp's default bound -5).
            A_log: [HV]; dt_bias: [HV * K] or [HV, K] or None (HV = H without GVA).
        use_beta_sigmoid_in_kernel: beta is a pre-activation; the op applies sigmoid (2 * sigmoid
            with allow_neg_eigval, as flash-linear-attention).
            These three are differentiable in every input, A_log and dt_bias included. With
            KDA_CP_GATE_IN_KERNEL=1, on the TileLang kernels with bf16 inputs, a bound g_min and
            no segment_len, the gate and beta's sigmoid run inside the chunk-local kernel: g in q's dtype, the fp32 g is never written
            (:class:`GatedChunkKDAFunction`); elsewhere they run as one fused pass first
            (:func:`apply_input_options`). check_gate then checks the pre-activations finite.
        allow_neg_eigval: beta may lie in [0, 2] (negative eigenvalues of the transition,
            flash-linear-attention's allow_neg_eigval); every backend.
        segment_len: cut every sequence into segments of this many tokens (a multiple of
            chunk_size) run as parallel chains joined by a scan of their affine maps
            (:mod:`kda_cp.parallel.segments`): more parallel work for few sequences x heads, at
            the cost of a summary pass and a state-gradient pass. "auto" (default): split where
            the state passes would leave the GPU underfilled
            (:func:`kda_cp.parallel.segments.auto_segment_len`; TileLang kernels, bounded gate); None: never.

    Returns:
        o: [B, T, H, V] in q's dtype; final_state: [N, H, K, V] fp32 (fp64 for fp64 inputs), or None.
        Both are differentiable in q, k, v, g, beta and initial_state.

    Raises:
        ValueError: shapes, dtypes or devices that do not fit (the message names the argument and
            the expected shape), g > 0 or g < g_min, NaN/Inf in an input, beta outside [0, 1]
            (the last three with check_gate), malformed cu_seqlens, a bad chunk_size or scale,
            A_log not [HV], dt_bias not [HV * K] / [HV, K] or g_min not given with
            use_gate_in_kernel; a flag (output_final_state, check_gate, use_*) that is not a bool.
        NotImplementedError: backend="tilelang" for inputs the kernels do not cover; in backward,
            a double backward (``create_graph=True``).

    Numerics:
        Exponentials, cumsums, the triangular solve and the state are fp32 (fp64 for fp64 inputs).
    """
    check_flags(output_final_state=output_final_state, check_gate=check_gate,
                use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, use_gate_in_kernel=use_gate_in_kernel,
                use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel)
    if cu_seqlens is not None and isinstance(q, torch.Tensor):
        # Read once here; the stages get kda_cp's copy on q's device, whose host values are
        # recorded, so no later stage reads it back (each read would wait for the GPU).
        from kda_cp.kernels._common import device_offsets
        cu_seqlens = device_offsets(check_cu_seqlens(cu_seqlens), q.device)
    q, k = expand_value_heads(q, k, v)
    if use_qk_l2norm_in_kernel:
        q, k, _, _ = apply_input_options(q, k, g, beta, use_qk_l2norm_in_kernel=True)
    fused = None
    if use_gate_in_kernel and isinstance(g, torch.Tensor) and isinstance(q, torch.Tensor):
        fused = _kernel_gate_backend(backend, q, k, v, g, beta, cu_seqlens, g_min, chunk_size, segment_len)
    if fused is not None:
        # the gate (and beta's sigmoid) inside the chunk-local kernel: the argument checks of
        # apply_input_options, then those of check_inputs on the shapes; the values are checked
        # finite (a gate of finite pre-activations lies in (g_min, 0), beta in range)
        check_gate_args(q, g, A_log, dt_bias, use_gate_in_kernel=True, g_min=g_min)
        check_inputs(q, k, v, g, beta, initial_state, cu_seqlens, chunk_size, False, g_min,
                     allow_neg_eigval=allow_neg_eigval)
        check_scale(scale)
        if check_gate:
            _check_finite([("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta), ("A_log", A_log),
                           ("exp(A_log)", A_log.detach().float().exp()), ("dt_bias", dt_bias),
                           ("initial_state", initial_state)])
            top = 2 if allow_neg_eigval else 1
            if not use_beta_sigmoid_in_kernel and beta.numel() and not bool(((beta >= 0) & (beta <= top)).all()):
                raise ValueError(f"beta (the write strength) must lie in [0, {top}]; pass use_beta_sigmoid_in_kernel="
                                 "True for a pre-activation, or check_gate=False to skip the value checks")
        q, k, v, g = dense_on_cuda(q, k, v, g)
        beta = beta.contiguous()  # [B, T, H]: a small copy where it is a view of a wider projection
        B, T, H, K = q.shape
        opts = KDAOptions(scale=K**-0.5 if scale is None else float(scale), chunk_size=chunk_size,
                          output_final_state=output_final_state, g_min=g_min)
        n_states = B if cu_seqlens is None else cu_seqlens.numel() - 1
        h0 = q.new_zeros(n_states, H, K, v.shape[-1], dtype=torch.float32) if initial_state is None else initial_state
        beta_scale = (2.0 if allow_neg_eigval else 1.0) if use_beta_sigmoid_in_kernel else None
        return GatedChunkKDAFunction.apply(q, k, v, g, beta, A_log, dt_bias, h0, cu_seqlens, fused, opts, beta_scale)
    if use_gate_in_kernel or use_beta_sigmoid_in_kernel or A_log is not None or dt_bias is not None:
        if check_gate and isinstance(g, torch.Tensor) and isinstance(beta, torch.Tensor):
            check_gate_args(q, g, A_log, dt_bias, use_gate_in_kernel=use_gate_in_kernel, g_min=g_min)
            check_preactivations(g, beta, A_log, dt_bias, use_gate_in_kernel=use_gate_in_kernel,
                                 use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel)
        q, k, g, beta = apply_input_options(
            q, k, g, beta, use_gate_in_kernel=use_gate_in_kernel,
            A_log=A_log, dt_bias=dt_bias, use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel, g_min=g_min,
            allow_neg_eigval=allow_neg_eigval)
    check_inputs(q, k, v, g, beta, initial_state, cu_seqlens, chunk_size, check_gate, g_min,
                 allow_neg_eigval=allow_neg_eigval)
    check_scale(scale)
    q, k, v, g, beta = dense_on_cuda(q, k, v, g, beta)
    B, T, H, K = q.shape
    V = v.shape[-1]
    opts = KDAOptions(scale=K**-0.5 if scale is None else float(scale), chunk_size=chunk_size,
                      output_final_state=output_final_state, g_min=g_min)
    impl = get_backend(backend, q, k, v, g, beta, cu_seqlens, g_min, chunk_size)
    impl = segmented(impl, segment_len, chunk_size)
    n_states = B if cu_seqlens is None else cu_seqlens.numel() - 1
    sdt = reference._compute_dtype(q.dtype)
    h0 = q.new_zeros(n_states, H, K, V, dtype=sdt) if initial_state is None else initial_state
    o, ht = ChunkKDAFunction.apply(q, k, v, g, beta, h0, cu_seqlens, impl, opts)
    return o, ht
