"""Plain-torch KDA: the per-token oracle and the chunked CPU backend.

Two implementations of the same function, side by side:

* :func:`naive_recurrent_kda` runs the recurrence of Kimi Linear (arXiv:2510.26692, Eq. 1) one token
  at a time. It is the oracle every test compares to (run it in fp64).
* :func:`chunk_kda_torch` computes the chunked form (docs/design.md §2; Kimi Linear Eqs. 7-9; the UT
  transform of Gated DeltaNet, arXiv:2412.06464) with torch ops. It mirrors what the TileLang
  kernels compute, runs on any device, and is differentiable through torch autograd. It is the
  backend that CPU users and CI run.

Conventions (flash-linear-attention's layout)::

    q, k: [B, T, H, K]    v: [B, T, H, V]    g: [B, T, H, K] (natural-log decay per step, g <= 0)
    beta: [B, T, H]       state S: [B, H, K, V]              o: [B, T, H, V]

    S_t = (I - beta_t k_t k_t^T) Diag(exp(g_t)) S_{t-1} + beta_t k_t v_t^T
    o_t = scale * S_t^T q_t                                        scale defaults to K ** -0.5

:func:`naive_recurrent_kda` (public) checks its inputs' shapes as :func:`kda_cp.ops.chunk_kda` does;
the chunked functions do not (``chunk_kda`` is their checked entry point).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from kda_cp.scan import ieee_fp32

__all__ = ["naive_recurrent_kda", "chunk_kda_torch", "chunk_kda_torch_prepare", "chunk_kda_summary_torch",
           "chunk_kda_summary_torch_prepared", "SUB_CHUNK"]

#: Length of the sub-chunks inside a chunk. Decay factors are only ever formed between positions
#: of one sub-chunk or through the boundary between two sub-chunks, so no exponent is positive.
SUB_CHUNK = 16


def _segments(cu_seqlens: torch.Tensor | None, total: int) -> list[tuple[int, int]]:
    if cu_seqlens is None:
        return [(0, total)]
    bounds = cu_seqlens.tolist()
    return list(zip(bounds[:-1], bounds[1:]))


def naive_recurrent_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Token-by-token KDA recurrence (Kimi Linear Eq. 1), computed in the inputs' dtype.

    Math:
        S_t = (I - beta_t k_t k_t^T) Diag(exp(g_t)) S_{t-1} + beta_t k_t v_t^T,   o_t = scale S_t^T q_t
        Decay first, then the delta-rule erase/write.

    Args:
        q, k: [B, T, H, K].
        v: [B, T, H, V].
        g: [B, T, H, K], natural-log decay of each step (g <= 0).
        beta: [B, T, H], write strength.
        scale: output scale, default K ** -0.5.
        initial_state: [N, H, K, V] with N = B, or N = number of sequences with cu_seqlens.
        output_final_state: return the state after the last token (of each sequence).
        cu_seqlens: int tensor [N + 1], FlashAttention convention (B must be 1).

    Returns:
        o: [B, T, H, V] in q's dtype; final_state: [N, H, K, V] or None.

    Raises:
        ValueError: the shape, dtype, device and cu_seqlens checks of :func:`kda_cp.chunk_kda`
            (e.g. k's batch differs from q's, cu_seqlens does not end at T or decreases, B > 1
            with cu_seqlens), naming the argument; not its value checks (any g, beta are taken).

    Numerics:
        Everything in the dtype of q (use fp64 in tests: the error is then ~1e-15).
    """
    from kda_cp.ops import check_cu_seqlens, check_inputs  # ops imports this module

    if cu_seqlens is not None and not isinstance(cu_seqlens, torch.Tensor):
        cu_seqlens = torch.tensor(check_cu_seqlens(cu_seqlens), dtype=torch.int64)
    check_inputs(q, k, v, g, beta, initial_state, cu_seqlens, 64, False, None, layout_warning=False)
    B, T, H, K = q.shape
    V = v.shape[-1]
    scale = K**-0.5 if scale is None else scale
    dtype = q.dtype
    o = torch.zeros(B, T, H, V, dtype=dtype, device=q.device)
    segs = _segments(cu_seqlens, T)
    n_states = len(segs) if cu_seqlens is not None else B
    finals = q.new_zeros(n_states, H, K, V)
    finals_list = []
    for b in range(B):
        for i, (bos, eos) in enumerate(segs):
            n = i if cu_seqlens is not None else b
            if initial_state is None:
                S = q.new_zeros(H, K, V)
            else:
                S = initial_state[n].to(dtype)
            for t in range(bos, eos):
                kt, vt, qt = k[b, t].to(dtype), v[b, t].to(dtype), q[b, t].to(dtype)
                S = S * g[b, t].to(dtype).exp()[..., None]
                bt = beta[b, t].to(dtype)[:, None]
                pred = torch.einsum("hk,hkv->hv", kt, S)
                S = S + torch.einsum("hk,hv->hkv", kt, bt * (vt - pred))
                o[b, t] = torch.einsum("hk,hkv->hv", qt, S) * scale
            finals_list.append((n, S))
    if output_final_state:
        if finals_list:  # B = 0 (or no sequence) leaves the zero [n_states, H, K, V] made above
            finals = torch.stack([s for _, s in sorted(finals_list, key=lambda x: x[0])])
        return o, finals
    return o, None


# --------------------------------------------------------------------------------------------
# Chunked form
# --------------------------------------------------------------------------------------------


def decay_floor(dtype: torch.dtype) -> float:
    """The per-step log decay below which g is raised before the within-chunk cumsum:
    log(eps) - 20 (-35.9 in fp32, -56.0 in fp64). exp of it is e^-20 of the dtype's resolution, so
    the clamp changes results far below rounding, while one step of, say, -1e8 among steps of
    -0.1 would otherwise erase the small ones from the fp32 cumsum (or overflow it to -inf)."""
    return math.log(torch.finfo(dtype).eps) - 20.0


def _decayed_products(
    x: torch.Tensor, k: torch.Tensor, gamma: torch.Tensor, strict: bool, anchored_diagonal: bool
) -> torch.Tensor:
    """A[c, i] = sum_d x_c[d] k_i[d] exp(gamma_c[d] - gamma_i[d]) for i < c (or i <= c).

    x, k, gamma: [..., C, K] (gamma = within-chunk cumsum of g). Returns [..., C, C].
    Rows of sub-chunk a against all earlier sub-chunks factor through the last position e of
    sub-chunk a - 1: exp(gamma_c - gamma_i) = exp(gamma_c - gamma_e) * exp(gamma_e - gamma_i),
    both exponents <= 0. Diagonal blocks anchor at the sub-chunk's first row (one GEMM; never in
    the future of a row) when ``anchored_diagonal`` (the gate is bounded so that
    exp((SUB_CHUNK - 1) max|g|) is finite), else use pairwise differences (any g <= 0).
    """
    *lead, C, K = x.shape
    s = min(SUB_CHUNK, C)
    ns = C // s
    xs = x.reshape(*lead, ns, s, K)
    ks = k.reshape(*lead, ns, s, K)
    gs = gamma.reshape(*lead, ns, s, K)
    tri = torch.tril(torch.ones(s, s, dtype=torch.bool, device=x.device), diagonal=-1 if strict else 0)
    if anchored_diagonal:
        g_first = gs[..., :1, :]
        diag = (xs * (gs - g_first).exp()) @ (ks * (g_first - gs).exp()).transpose(-1, -2)
        diag = diag.masked_fill(~tri, 0.0)
    else:
        diff = gs[..., :, None, :] - gs[..., None, :, :]  # [..., ns, s, s, K]
        diff = diff.masked_fill(~tri[..., None], float("-inf"))
        diag = torch.einsum("...ik,...jk,...ijk->...ij", xs, ks, diff.exp())
    out = x.new_zeros(*lead, C, C)
    for a in range(ns):
        r0 = a * s
        out[..., r0 : r0 + s, r0 : r0 + s] = diag[..., a, :, :]
        if a:
            g_e = gamma[..., r0 - 1 : r0, :]  # last position of sub-chunk a - 1
            left = xs[..., a, :, :] * (gs[..., a, :, :] - g_e).exp()
            right = k[..., :r0, :] * (g_e - gamma[..., :r0, :]).exp()
            out[..., r0 : r0 + s, :r0] = left @ right.transpose(-1, -2)
    return out


class _ChunkIntra(NamedTuple):
    """The state-independent part of the chunked forward for one dense batch ([B, H, N, C, *])."""

    w: torch.Tensor
    u: torch.Tensor
    k_out: torch.Tensor  # k_r * exp(gamma_C - gamma_r)
    decay_last: torch.Tensor  # exp(gamma_C), [B, H, N, K, 1]
    qg: torch.Tensor | None  # q * exp(gamma)
    a_qk: torch.Tensor | None  # Tril((Gamma*Q)(K/Gamma)^T), diagonal included
    T: int


def _chunk_intra(q, k, v, g, beta, chunk_size, with_output=True) -> _ChunkIntra:
    """Gates, decayed products and the UT transform of every chunk: no state needed."""
    B, T, H, K = k.shape
    # A chunk longer than the sequence only adds inert padding: cap it at T rounded up to whole
    # sub-chunks (chunk_size=32768 on T=20 would otherwise build 32768 x 32768 blocks).
    C = chunk_size if chunk_size <= SUB_CHUNK else min(chunk_size, -(-max(T, 1) // SUB_CHUNK) * SUB_CHUNK)
    N = (T + C - 1) // C
    pad = N * C - T
    if pad:
        # Padded tokens have k = 0, beta = 0 and g = 0: they neither write nor decay the state.
        q, k, v, g = (torch.nn.functional.pad(x, (0, 0, 0, 0, 0, pad)) for x in (q, k, v, g))
        beta = torch.nn.functional.pad(beta, (0, 0, 0, pad))

    def chunks(x):  # [B, T, H, D] -> [B, H, N, C, D]
        return x.reshape(B, N, C, H, x.shape[-1]).permute(0, 3, 1, 2, 4)

    qc, kc, vc, gc = chunks(q), chunks(k), chunks(v), chunks(g)
    bc = beta.reshape(B, N, C, H).permute(0, 3, 1, 2)  # [B, H, N, C]
    # within-chunk cumsum of the natural-log decay, each step first floored where exp(g) is far
    # below the dtype's resolution (decay_floor): a huge step otherwise rounds away the small ones
    gamma = gc.clamp(min=decay_floor(gc.dtype)).cumsum(-2)
    Gam = gamma.exp()
    gam_last = gamma[..., -1:, :]
    # Largest exponent the anchored diagonal blocks form: (SUB_CHUNK - 1) * max|g|.
    limit = 0.5 * math.log(torch.finfo(k.dtype).max)  # a Python float: fp64's max overflows an fp32 tensor
    anchored = g.numel() == 0 or (-g.min().item()) * (min(SUB_CHUNK, C) - 1) < limit
    a_kk = _decayed_products(kc, kc, gamma, True, anchored) * bc[..., None]
    eye = torch.eye(C, dtype=k.dtype, device=k.device)
    rhs = torch.cat([Gam * kc, vc], dim=-1) * bc[..., None]
    wu = torch.linalg.solve_triangular(eye + a_kk, rhs, upper=False, unitriangular=True)
    qg = a_qk = None
    if with_output:
        qg = qc * Gam
        a_qk = _decayed_products(qc, kc, gamma, False, anchored)
    return _ChunkIntra(wu[..., :K], wu[..., K:], kc * (gam_last - gamma).exp(), gam_last.exp()[..., 0, :, None],
                       qg, a_qk, T)


def _chunk_state_pass(intra: _ChunkIntra, h0, scale):
    """The sequential pass over chunks from h0: -> (o [B, T, H, V] or None, final state)."""
    B, H, N, C, V = intra.u.shape
    S = h0
    outs = []
    for n in range(N):
        v_new = intra.u[:, :, n] - intra.w[:, :, n] @ S
        if intra.qg is not None:
            outs.append(intra.qg[:, :, n] @ S + intra.a_qk[:, :, n] @ v_new)
        S = intra.decay_last[:, :, n] * S + intra.k_out[:, :, n].transpose(-1, -2) @ v_new
    o = None
    if intra.qg is not None:
        if N:
            o = torch.stack(outs, dim=2).permute(0, 2, 3, 1, 4).reshape(B, N * C, H, V)[:, : intra.T] * scale
        else:
            o = h0.new_zeros(B, 0, H, V)
    return o, S if N else h0.clone()  # no chunks: the final state is h0's value, never h0 itself


def _chunk_kda_dense(q, k, v, g, beta, scale, h0, chunk_size, with_output=True):
    """Chunked KDA for one dense batch. Inputs already in the compute dtype; returns (o, ht)."""
    return _chunk_state_pass(_chunk_intra(q, k, v, g, beta, chunk_size, with_output), h0, scale)


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def chunk_kda_torch_prepare(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    cu_seqlens: torch.Tensor | None = None,
    chunk_size: int = 64,
) -> list[_ChunkIntra]:
    """The state-independent half of :func:`chunk_kda_torch` (gates, decayed products, UT transform),
    one entry per sequence (or one for a dense batch). Context parallelism runs it once per shard and
    passes it to :func:`chunk_kda_summary_torch_prepared` and :func:`chunk_kda_torch` as ``prepared``."""
    cdt = _compute_dtype(q.dtype)
    q_, k_, v_, g_, b_ = (x.to(cdt) for x in (q, k, v, g, beta))
    if cu_seqlens is None:
        return [_chunk_intra(q_, k_, v_, g_, b_, chunk_size)]
    return [_chunk_intra(q_[:, a:b], k_[:, a:b], v_[:, a:b], g_[:, a:b], b_[:, a:b], chunk_size)
            for a, b in _segments(cu_seqlens, q.shape[1])]


def chunk_kda_torch(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    chunk_size: int = 64,
    prepared: list[_ChunkIntra] | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Chunked KDA in plain torch (docs/design.md §2), differentiable by autograd.

    Math (per chunk of C tokens, gamma = within-chunk cumsum of g, Gamma = exp(gamma)):
        A_kk = StrictTril(Diag(beta) (Gamma*K)(K/Gamma)^T)
        [W | U] = (I + A_kk)^-1 Diag(beta) [Gamma*K | V]          (UT transform)
        V' = U - W S;  O = (Gamma*Q) S + Tril((Gamma*Q)(K/Gamma)^T) V'
        S <- Diag(exp(gamma_C)) S + (exp(gamma_C - gamma)*K)^T V'
    The decayed products are formed per 16-token sub-chunk so no exponent is ever positive: any
    g <= 0 works here, bounded or not.

    Args/Returns: as :func:`naive_recurrent_kda`, plus ``chunk_size`` (a multiple of 16, or less
    than 16) and ``prepared`` (the output of :func:`chunk_kda_torch_prepare` for the same inputs,
    to skip the state-independent half). T need not be a multiple of ``chunk_size``.

    Numerics:
        Computed in promote(q.dtype, fp32); o is cast back to q's dtype, the state is fp32 (fp64 for
        fp64 inputs). Against the fp64 recurrence the fp64 error is ~1e-14.
    """
    cdt = _compute_dtype(q.dtype)
    B, T, H, K = q.shape
    V = v.shape[-1]
    if prepared is None:
        prepared = chunk_kda_torch_prepare(q, k, v, g, beta, cu_seqlens, chunk_size)
    if cu_seqlens is None:
        h0 = q.new_zeros(B, H, K, V, dtype=cdt) if initial_state is None else initial_state.to(cdt)
        o, ht = _chunk_state_pass(prepared[0], h0, scale)
    else:
        outs, finals = [], []
        for i, intra in enumerate(prepared):
            h0 = q.new_zeros(1, H, K, V, dtype=cdt) if initial_state is None else initial_state[i : i + 1].to(cdt)
            o_i, h_i = _chunk_state_pass(intra, h0, scale)
            outs.append(o_i)
            finals.append(h_i)
        o = torch.cat(outs, dim=1) if outs else q.new_zeros(1, 0, H, V, dtype=cdt)
        ht = torch.cat(finals, dim=0)
    return o.to(q.dtype), (ht if output_final_state else None)


@ieee_fp32
def chunk_kda_summary_torch(
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The affine map of a segment: S_out = M @ S_in + S_tilde (docs/design.md §3), in one state pass.

    The recurrence acts on the V columns of the state independently, so one pass from the
    augmented state [0 | I] with values [V | 0] ends in [S_tilde | M].

    Args:
        k: [B, T, H, K]; v: [B, T, H, V]; g: [B, T, H, K]; beta: [B, T, H].

    Returns:
        M: [B, H, K, K] = M_{T-1} ... M_0 with M_t = (I - beta_t k_t k_t^T) Diag(exp(g_t));
        S_tilde: [B, H, K, V], the end state from a zero initial state. Both in promote(dtype, fp32).
    """
    cdt = _compute_dtype(k.dtype)
    B, T, H, K = k.shape
    V = v.shape[-1]
    k_, v_, g_, b_ = (x.to(cdt) for x in (k, v, g, beta))
    v_aug = torch.cat([v_, v_.new_zeros(B, T, H, K)], dim=-1)
    eye = torch.eye(K, dtype=cdt, device=k.device).expand(B, H, K, K)
    h0 = torch.cat([k_.new_zeros(B, H, K, V), eye], dim=-1)
    _, s_aug = _chunk_kda_dense(k_, k_, v_aug, g_, b_, 1.0, h0, chunk_size, with_output=False)
    return s_aug[..., V:], s_aug[..., :V]


@ieee_fp32
def chunk_kda_summary_torch_prepared(prepared: list[_ChunkIntra], last_only: bool = False):
    """:func:`chunk_kda_summary_torch` from a :func:`chunk_kda_torch_prepare` result, without
    recomputing the chunk-local half: the state pass from [0 | I] with pseudo-values [U | 0].

    Args:
        prepared: one entry per packed sequence, or one for a dense batch.
        last_only: only the last entry (for packed sequences: the last sequence).
    Returns:
        (M [N, H, K, K], S_tilde [N, H, K, V]) in the prepared compute dtype; N = the dense batch,
        the number of sequences, or (``last_only`` with packed sequences) 1.
    """
    parts = prepared[-1:] if last_only else prepared
    Ms, Ss = [], []
    for intra in parts:
        B, H, N, C, V = intra.u.shape
        K = intra.w.shape[-1]
        aug = intra._replace(u=torch.cat([intra.u, intra.u.new_zeros(B, H, N, C, K)], dim=-1), qg=None, a_qk=None)
        eye = torch.eye(K, dtype=intra.u.dtype, device=intra.u.device).expand(B, H, K, K)
        _, s_aug = _chunk_state_pass(aug, torch.cat([intra.u.new_zeros(B, H, K, V), eye], dim=-1), 1.0)
        Ms.append(s_aug[..., V:])
        Ss.append(s_aug[..., :V])
    return torch.cat(Ms, dim=0), torch.cat(Ss, dim=0)
