"""Pure-torch mirror of the TileLang KDA backward: the specification the kernels implement.

No autograd: every gradient is written out per chunk, in the order and with the factorisations the
kernels use, so a CPU run in fp64 checks the algebra (tests/kernels/test_kernels_bwd_mirror.py compares it
with torch autograd of :func:`kda_cp.reference.chunk_kda_torch` and of the per-token recurrence).
This module imports torch only; it never needs tilelang or a GPU.

Forward per chunk of C tokens (docs/design.md §2), rows i, columns j, key channel d, q~ = scale * q:

    gamma   = cumsum(g)                      (chunk-local, natural log)     Gamma = exp(gamma)
    B_ij    = sum_d k_id k_jd exp(gamma_id - gamma_jd)            j < i      (decayed K K^T)
    A       = Diag(beta) B,   X = (I + A)^-1,   Kb = Diag(beta)(Gamma*K),   Vb = Diag(beta) V
    W = X Kb,  U = X Vb                                                     (UT transform)
    Aqk_ij  = sum_d q~_id k_jd exp(gamma_id - gamma_jd)           j <= i
    Qg = Gamma*q~,  Kd = exp(gamma_C - gamma)*K,  eC = exp(gamma_C)
    V' = U - W S,   O = Qg S + Aqk V',   S_next = Diag(eC) S + Kd^T V'

Backward, given dO and dS_next (the gradient of the state leaving the chunk):

  stage "state" (bwd_state.py; sequential over chunks, columns of V independent)
    forward walk   : S_n = state entering chunk n                          (stored, [NC, H, K, V])
    reverse walk   : dS_next_n stored; dV' = Aqk^T dO + Kd dS_next
                     dS_n = Qg^T dO + Diag(eC) dS_next - W^T dV'           (dh0 = dS_0 of sequence)
    With dht = 0 and no stores, the reverse walk alone is the CP state gradient G (docs/design.md §4.2).

  stage "dv" (bwd_intra.py, kernel 1; chunk-parallel)
    V' = U - W S;  dV' = Aqk^T dO + Kd dS_next;  dU = dV';  dW = -dV' S^T
    dAqk = Tril(dO V'^T);  dQg = dO S^T;  dKd = V' dS_next^T;  deC_d = sum_v S_dv dS_next_dv

  stage "dk" (bwd_intra.py, kernel 2; chunk-parallel)
    dKb = X^T dW,  dVb = X^T dU,  dA = -StrictTril(dKb W^T + dVb U^T)
    dv = beta * dVb;   dbeta_i = <dKb_i, Gamma_i k_i> + <dVb_i, v_i> + sum_j dA_ij B_ij
    dB = Diag(beta) dA
    decayed products M_ij = sum_d x_id k_jd E_ijd (E = exp(gamma_i - gamma_j)) with upstream dM:
        dx_id = sum_j dM_ij k_jd E_ijd         ("row" side)
        dk_jd = sum_i dM_ij x_id E_ijd         ("column" side)
        dgamma_id += x_id dx_id,   dgamma_jd -= k_jd dk_jd
      for (x, dM) = (q~, dAqk) and (k, dB).
    dq~ = Gamma*dQg + dx(Aqk);   dq = scale * dq~
    dk  = Gamma*beta*dKb + exp(gamma_C - gamma)*dKd + dx(B) + dk(B) + dk(Aqk)
    dgamma = q~*dq~ + k*(Gamma*beta*dKb + dx(B) - dk(B) - dk(Aqk)) - Kd*dKd
    dgamma_C += sum_i Kd_i*dKd_i + eC*deC;   dg = reverse cumsum of dgamma within the chunk

Sub-chunk factorisation (16 tokens; what keeps every exponential finite for g in [-5, 0]).
The forward products, row sub-chunk I, reference r_I = gamma[16 I - 1] (0 for I = 0):
    M_i = exp(gamma_i - r_I) * sum_j (k_j exp(r_I - gamma_j)),  columns j < 16(I+1).
Their gradients ("dk" kernel), with bounded tables and the large factor in fp32:
    row side, by column sub-chunk J, reference s_J = gamma[16 J + 15], rows i >= 16 J:
        dx_i += exp(gamma_i - s_J) * sum_{j in J} dM_ij (k_j exp(s_J - gamma_j))
    column side, by row sub-chunk I, reference r_I, columns j < 16(I+1):
        dk_j += exp(r_I - gamma_j) * sum_{i in I} dM_ij (x_i exp(gamma_i - r_I))
    Every table entry is |x| or |k| times a factor <= 1; the fp32 factors are <= 1 except inside
    the own sub-chunk, where they are <= exp(75) (row side, 15 steps of g >= -5) or exp(80)
    (column side, 16 steps). Factors outside these ranges are set to zero, never formed. A table
    entry can be as small as exp(-80) |x| (every step of a sub-chunk at g = -5); its second bf16
    piece is then below bf16's smallest normal (~1.2e-38) for |x| < ~0.3, and a tensor core that
    flushed it would leave that pair's term with one piece's accuracy.

Padding: a chunk's rows past its sequence end carry q = k = v = 0, g = 0, beta = 0; they neither
write nor decay and receive gradients that are discarded (the packed API returns zeros there).
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from kda_cp.reference import decay_floor

__all__ = ["chunk_kda_bwd_mirror", "chunk_kda_state_grad_mirror", "SUB"]

SUB = 16


class _Recompute(NamedTuple):
    gamma: torch.Tensor  # [B, H, N, C, K]
    qs: torch.Tensor  # scale * q
    k: torch.Tensor
    v: torch.Tensor
    beta: torch.Tensor  # [B, H, N, C]
    Bkk: torch.Tensor  # strict decayed K K^T (without beta)
    X: torch.Tensor  # (I + Diag(beta) Bkk)^-1
    W: torch.Tensor
    U: torch.Tensor
    Aqk: torch.Tensor
    Qg: torch.Tensor
    Kd: torch.Tensor
    eC: torch.Tensor  # [B, H, N, K]


def _row_factors(gamma: torch.Tensor):
    """(exp(gamma_i - r_I) [.., C, K], list over I of the column factor exp(r_I - gamma_j) masked to j < 16(I+1))."""
    C = gamma.shape[-2]
    ns = C // SUB
    ref = torch.zeros_like(gamma)
    for I in range(1, ns):
        ref[..., SUB * I : SUB * (I + 1), :] = gamma[..., SUB * I - 1 : SUB * I, :]
    row = (gamma - ref).exp()
    cols = []
    for I in range(ns):
        rI = gamma[..., SUB * I - 1 : SUB * I, :] if I else torch.zeros_like(gamma[..., :1, :])
        j_ok = (torch.arange(C, device=gamma.device) < SUB * (I + 1))[:, None]
        cols.append(torch.where(j_ok, torch.where(j_ok, rI - gamma, gamma.new_zeros(())).exp(), gamma.new_zeros(())))
    return row, cols


def _pairwise(x, k, gamma, I):
    """[.., 16, 16, K] terms x_id k_jd exp(gamma_id - gamma_jd) of sub-chunk I's own block, j <= i,
    each exponent <= 0 (the general gate's diagonal blocks, no anchor); zero above the diagonal."""
    rs = slice(SUB * I, SUB * (I + 1))
    diff = gamma[..., rs, None, :] - gamma[..., None, rs, :]
    tri = torch.tril(torch.ones(SUB, SUB, dtype=torch.bool, device=x.device))[:, :, None]
    e = torch.where(tri, torch.where(tri, diff, diff.new_zeros(())).exp(), diff.new_zeros(()))
    return x[..., rs, None, :] * k[..., None, rs, :] * e


def _decayed(x, k, gamma, strict, general=False):
    """M_ij = sum_d x_id k_jd exp(gamma_id - gamma_jd) for j < i (strict) or j <= i, factorised per sub-chunk.

    general: any g <= 0. The columns before sub-chunk I go through r_I (both factors <= 1) and
    the own 16 x 16 block is summed pairwise, exp(gamma_i - gamma_j) per (i, j, d) (the bounded
    path's column factor exp(r_I - gamma_j) there is unbounded)."""
    C = gamma.shape[-2]
    row, cols = _row_factors(gamma)
    out = x.new_zeros(*x.shape[:-1], C)
    for I in range(C // SUB):
        rs = slice(SUB * I, SUB * (I + 1))
        col = cols[I]
        if general:
            col = torch.where((torch.arange(C, device=x.device) < SUB * I)[:, None], col, col.new_zeros(()))
        out[..., rs, :] = (x[..., rs, :] * row[..., rs, :]) @ (k * col).transpose(-1, -2)
        if general:
            out[..., rs, rs] = _pairwise(x, k, gamma, I).sum(-1)
    mask = torch.tril(torch.ones(C, C, dtype=torch.bool, device=x.device), diagonal=-1 if strict else 0)
    return out * mask


def _bf16_pieces(x, pieces):
    """x as the sum of ``pieces`` bf16 values (hi, then the bf16 of each remainder); 0 keeps x."""
    if not pieces:
        return x
    out = torch.zeros_like(x)
    for _ in range(pieces):
        out = out + (x - out).to(torch.bfloat16).to(x.dtype)
    return out


def _decayed_grads(dM, x, k, gamma, pieces=0, general=False):
    """Row and column gradients of M = decayed(x, k): returns (dx, dk) with dM already masked.

    Factorised as the "dk" kernel computes them (module docstring): the row side by column
    sub-chunk J, the column side by row sub-chunk I, each a [C, 16] x [16, K] product scaled per
    (token, channel) by an fp32 factor. pieces > 0 emulates the kernel's GEMM operands: dM rounded
    to bf16 and each factor table split into that many bf16 pieces (the kernel uses 2), products
    accumulated exactly.

    general: any g <= 0. The anchored sums skip the own sub-chunk (rows i >= 16 (J + 1) on the row
    side, columns j < 16 I on the column side: every factor <= 1) and the own 16 x 16 blocks are
    summed pairwise in the dtype of x, as the forward's (:func:`_decayed`).
    """
    C = gamma.shape[-2]
    if pieces:
        dM = dM.to(torch.bfloat16).to(x.dtype)
    ar = torch.arange(C, device=x.device)[:, None]
    zero = gamma.new_zeros(())
    own = 1 if general else 0  # sub-chunks the anchored sums leave to the pairwise blocks
    dx = torch.zeros_like(x)
    for J in range(C // SUB):
        cs = slice(SUB * J, SUB * (J + 1))
        sJ = gamma[..., SUB * J + SUB - 1 : SUB * J + SUB, :]
        table = k[..., cs, :] * (sJ - gamma[..., cs, :]).exp()
        ok = ar >= SUB * (J + own)
        factor = torch.where(ok, torch.where(ok, gamma - sJ, zero).exp(), zero)
        dx = dx + factor * (dM[..., :, cs] @ _bf16_pieces(table, pieces))
    dk = torch.zeros_like(k)
    for I in range(C // SUB):
        rs = slice(SUB * I, SUB * (I + 1))
        rI = gamma[..., SUB * I - 1 : SUB * I, :] if I else torch.zeros_like(gamma[..., :1, :])
        table = x[..., rs, :] * (gamma[..., rs, :] - rI).exp()
        ok = ar < SUB * (I + 1 - own)
        factor = torch.where(ok, torch.where(ok, rI - gamma, zero).exp(), zero)
        dk = dk + factor * (dM[..., rs, :].transpose(-1, -2) @ _bf16_pieces(table, pieces))
        if general:  # own block: dx_i += sum_j dM_ij k_j e_ij, dk_j += sum_i dM_ij x_i e_ij
            e = _pairwise(torch.ones_like(x), torch.ones_like(k), gamma, I)  # [.., i, j, K]
            dMb = dM[..., rs, rs, None]
            dx[..., rs, :] += (dMb * e * k[..., None, rs, :]).sum(-2)
            dk[..., rs, :] += (dMb * e * x[..., rs, None, :]).sum(-3)
    return dx, dk


def _chunks(x, B, N, C, H):
    return x.reshape(B, N, C, H, -1).permute(0, 3, 1, 2, 4)


def _recompute(q, k, v, g, beta, scale, C, general=False) -> tuple[_Recompute, int]:
    B, T, H, K = k.shape
    N = (T + C - 1) // C
    pad = N * C - T
    if pad:
        q, k, v, g = (torch.nn.functional.pad(x, (0, 0, 0, 0, 0, pad)) for x in (q, k, v, g))
        beta = torch.nn.functional.pad(beta, (0, 0, 0, pad))
    qc, kc, vc, gc = (_chunks(x, B, N, C, H) for x in (q, k, v, g))
    bc = beta.reshape(B, N, C, H).permute(0, 3, 1, 2)
    if general:  # the kernels' fp32 floor on each step (kda_cp.reference.decay_floor)
        gc = gc.clamp(min=decay_floor(torch.float32))
    gamma = gc.cumsum(-2)
    Gam = gamma.exp()
    qs = qc * scale
    Bkk = _decayed(kc, kc, gamma, strict=True, general=general)
    eye = torch.eye(C, dtype=k.dtype, device=k.device)
    X = torch.linalg.solve_triangular(eye + bc[..., None] * Bkk, eye.expand_as(Bkk), upper=False, unitriangular=True)
    W = X @ (bc[..., None] * Gam * kc)
    U = X @ (bc[..., None] * vc)
    Aqk = _decayed(qs, kc, gamma, strict=False, general=general)
    gC = gamma[..., -1:, :]
    return _Recompute(gamma, qs, kc, vc, bc, Bkk, X, W, U, Aqk, Gam * qs, kc * (gC - gamma).exp(),
                      gC[..., 0, :].exp()), N


def _state_pass(r: _Recompute, h0, dO, dht, need_states: bool):
    """Forward walk (chunk-start states) and reverse walk (chunk-end state gradients, dh0)."""
    N = r.W.shape[2]
    Hs = []
    if need_states:
        S = h0
        for n in range(N):
            Hs.append(S)
            vn = r.U[:, :, n] - r.W[:, :, n] @ S
            S = r.eC[:, :, n, :, None] * S + r.Kd[:, :, n].transpose(-1, -2) @ vn
    dS = dht
    dHs = [None] * N
    for n in reversed(range(N)):
        dHs[n] = dS
        dvn = r.Aqk[:, :, n].transpose(-1, -2) @ dO[:, :, n] + r.Kd[:, :, n] @ dS
        dS = (r.Qg[:, :, n].transpose(-1, -2) @ dO[:, :, n] + r.eC[:, :, n, :, None] * dS
              - r.W[:, :, n].transpose(-1, -2) @ dvn)
    return Hs, dHs, dS


def _dense_bwd(q, k, v, g, beta, scale, h0, do, dht, C, stages=None, dk_pieces=0, general=False):
    B, T, H, K = k.shape
    V = v.shape[-1]
    if T == 0:  # nothing happens: the state passes through unchanged
        return (*(torch.zeros_like(x) for x in (q, k, v, g, beta)), dht.clone())
    r, N = _recompute(q, k, v, g, beta, scale, C, general)
    if N * C != T:
        do = torch.nn.functional.pad(do, (0, 0, 0, 0, 0, N * C - T))
    dO = _chunks(do, B, N, C, H)
    Hs, dHs, dh0 = _state_pass(r, h0, dO, dht, need_states=True)
    S = torch.stack(Hs, 2)  # [B, H, N, K, V]
    dSn = torch.stack(dHs, 2)

    # ---- stage "dv" ----
    vn = r.U - r.W @ S
    dvn = r.Aqk.transpose(-1, -2) @ dO + r.Kd @ dSn
    dAqk = torch.tril(dO @ vn.transpose(-1, -2))
    dQg = dO @ S.transpose(-1, -2)
    dKd = vn @ dSn.transpose(-1, -2)
    deC = (S * dSn).sum(-1)
    dW = -dvn @ S.transpose(-1, -2)
    dU = dvn

    # ---- stage "dk" ----
    Gam = r.gamma.exp()
    dKb = r.X.transpose(-1, -2) @ dW
    dVb = r.X.transpose(-1, -2) @ dU
    dA = -torch.tril(dKb @ r.W.transpose(-1, -2) + dVb @ r.U.transpose(-1, -2), diagonal=-1)
    dv = r.beta[..., None] * dVb
    dbeta = (dKb * Gam * r.k).sum(-1) + (dVb * r.v).sum(-1) + (dA * r.Bkk).sum(-1)
    dB = r.beta[..., None] * dA
    dxq, dkq = _decayed_grads(dAqk, r.qs, r.k, r.gamma, dk_pieces, general)
    dxk, dkk = _decayed_grads(dB, r.k, r.k, r.gamma, dk_pieces, general)
    dGk = r.beta[..., None] * dKb  # gradient of Gamma * k
    dqs = Gam * dQg + dxq
    dk = Gam * dGk + (r.gamma[..., -1:, :] - r.gamma).exp() * dKd + dxk + dkk + dkq
    dgam = r.qs * dqs + r.k * (Gam * dGk + dxk - dkk - dkq) - r.Kd * dKd
    dgam[..., -1, :] += (r.Kd * dKd).sum(-2) + r.eC * deC
    dgc = dgam.flip(-2).cumsum(-2).flip(-2)
    if stages is not None:  # per-chunk intermediates [B, H, N, C, *] for stage-by-stage kernel checks
        stages.update(W=r.W, U=r.U, Qg=r.Qg, Kd=r.Kd, Aqk=r.Aqk, eC=r.eC, Hs=S, dHs=dSn, dAqk=dAqk,
                      dQg=dQg, dKd=dKd, deC=deC, dW=dW, dU=dU, dB=dB, dGk=dGk)

    def back(x):  # [B, H, N, C, D] -> [B, T, H, D]
        return x.permute(0, 2, 3, 1, 4).reshape(B, N * C, H, -1)[:, :T]

    dbeta_t = dbeta.permute(0, 2, 3, 1).reshape(B, N * C, H)[:, :T]
    return back(dqs * scale), back(dk), back(dv), back(dgc), dbeta_t, dh0


def _segments(cu_seqlens, T):
    if cu_seqlens is None:
        return None
    b = cu_seqlens.tolist()
    return list(zip(b[:-1], b[1:]))


def chunk_kda_bwd_mirror(q, k, v, g, beta, *, scale, initial_state=None, do, dht=None, cu_seqlens=None,
                         chunk_size=64, stages=None, dk_pieces=0, general=False):
    """Gradients of <o, do> + <ht, dht> for KDA, computed stage by stage as the kernels do.

    Args:
        q, k: [B, T, H, K]; v: [B, T, H, V]; g: [B, T, H, K] log decay per step (g <= 0);
        beta: [B, T, H]; all one float dtype (fp64 for checks). scale: output scale.
        initial_state: [N, H, K, V] or None (zero). do: [B, T, H, V]. dht: [N, H, K, V] or None (zero).
        cu_seqlens: [N + 1] packed-sequence offsets (B = 1), or None. Tokens past cu_seqlens[-1]
            get zero gradients. chunk_size: a multiple of 16.
        stages: a dict to fill with the per-chunk intermediates ([B, H, N, C, *]: W, U, Qg, Kd, Aqk,
            eC, Hs, dHs, dAqk, dQg, dKd, deC, dW, dU, dB, dGk), dense inputs only; for kernel checks.
        dk_pieces: 0 (exact), or emulate the "dk" kernel's operands: dAqk and dB rounded to bf16
            and the decayed factors split into this many bf16 pieces (the kernel: 2).
        general: the general-gate kernels' factorisation (any g <= 0: pairwise own sub-chunk
            blocks, each step floored at decay_floor(float32) before the cumsum).
    Returns:
        (dq, dk, dv, dg, dbeta, dh0) with the shapes of q, k, v, g, beta and [N, H, K, V].
    """
    B, T, H, K = q.shape
    V = v.shape[-1]
    if chunk_size % SUB:
        raise ValueError(f"chunk_size must be a multiple of {SUB}, got {chunk_size}")
    segs = _segments(cu_seqlens, T)
    NS = B if segs is None else len(segs)
    h0 = q.new_zeros(NS, H, K, V) if initial_state is None else initial_state.to(q.dtype)
    dht_ = q.new_zeros(NS, H, K, V) if dht is None else dht.to(q.dtype)
    if segs is None:
        return _dense_bwd(q, k, v, g, beta, scale, h0, do, dht_, chunk_size, stages, dk_pieces, general)
    outs = [torch.zeros_like(x) for x in (q, k, v, g, beta)]
    dh0 = torch.zeros_like(h0)
    for i, (a, b) in enumerate(segs):
        sl = slice(a, b)
        res = _dense_bwd(q[:, sl], k[:, sl], v[:, sl], g[:, sl], beta[:, sl], scale, h0[i : i + 1],
                         do[:, sl], dht_[i : i + 1], chunk_size, dk_pieces=dk_pieces, general=general)
        for o_, r_ in zip(outs, res[:5]):
            o_[:, sl] = r_
        dh0[i] = res[5][0]
    return (*outs, dh0)


def chunk_kda_state_grad_mirror(q, k, v, g, beta, *, scale, do, chunk_size=64, general=False):
    """dh0 of <o, do> with dht = 0 (the CP state gradient G, docs/design.md §4.2): the reverse walk alone.

    Args as :func:`chunk_kda_bwd_mirror` (no cu_seqlens). Returns dh0 [B, H, K, V].
    """
    B, T, H, K = q.shape
    V = v.shape[-1]
    if T == 0:
        return q.new_zeros(B, H, K, V)
    r, N = _recompute(q, k, v, g, beta, scale, chunk_size, general)
    if N * chunk_size != T:
        do = torch.nn.functional.pad(do, (0, 0, 0, 0, 0, N * chunk_size - T))
    dO = _chunks(do, B, N, chunk_size, H)
    _, _, dh0 = _state_pass(r, None, dO, q.new_zeros(B, H, K, V), need_states=False)
    return dh0
