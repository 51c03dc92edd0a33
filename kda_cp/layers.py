"""The KDA token mixer (Kimi Delta Attention) as an ``nn.Module``, exact under context parallelism.

Per head h, for input x_t in R^D (Kimi Linear, arXiv:2510.26692, Eqs. 15-16; Kimi K3, Eqs. 17-18):

    q_t, k_t = L2Norm(SiLU(ShortConv(W_{q/k} x_t)))        per head, over the K channels   (Eq. 15)
    v_t      = SiLU(ShortConv(W_v x_t))                                                      (Eq. 15)
    g_t      = g_min * Sigmoid(exp(A_h) * (W_g_up W_g_down x_t + b_g)),  g_min = -5          (K3 Eq. 17)
               or, with g_min None, -exp(A_h) * Softplus(W_g_up W_g_down x_t + b_g)     (Kimi Linear)
    alpha_t  = exp(g_t) in (0, 1)^K                               per-channel decay
    beta_t   = Sigmoid(W_beta x_t)                                write strength           (Eq. 15)
               (2 Sigmoid(.) with allow_neg_eigval)
    o~_t     = KDA(q, k, v, g, beta)_t       S_t = (I - beta_t k_t k_t^T) Diag(alpha_t) S_{t-1}
                                                    + beta_t k_t v_t^T,   o~_t = K^-1/2 S_t^T q_t
    y_t      = W_o [Sigmoid(W_og x_t) * RMSNorm(o~_t)]            per-head RMSNorm        (Eq. 16, K3 Eq. 18)

ShortConv is the causal depthwise convolution of width 4 (:func:`kda_cp.parallel.layers.conv.causal_conv1d`);
under context parallelism it fetches its W-1 token halo from the previous rank, and the KDA op is
:func:`kda_cp.parallel.cp_chunk_kda`, so a layer on a sharded sequence equals the unsharded layer.
The output gate is full rank by default (K3 Eq. 18); ``output_gate_rank`` gives the low-rank form
of Kimi Linear Eq. 16.

Shapes: x [B, T, D] -> y [B, T, D]; under CP, T is this rank's shard length T_r.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from kda_cp import glue
from kda_cp.kernels._common import device_offsets
from kda_cp.ops import (BACKENDS, check_chunk_size, check_cu_seqlens, check_cu_seqlens_tensor, check_segment_len, chunk_kda,
                        layout_known)
from kda_cp.parallel.layers.attention import cp_attention
from kda_cp.parallel.layers.context import CP_STRATEGIES, CPContext
from kda_cp.parallel.exchange import check_and_agree, digest, dtype_code
from kda_cp.parallel.layers.conv import causal_conv1d, halo_exchange
from kda_cp.parallel.cp import cp_chunk_kda
from kda_cp.parallel.layers.ulysses import ulysses_kda

__all__ = ["KDAConfig", "KDALayer", "ShortConv", "RMSNorm", "AttentionConfig", "AttentionLayer", "CP_STRATEGIES"]


def gate_bias_for_decay(decay: torch.Tensor, g_min: float | None) -> torch.Tensor:
    """The gate bias b with -g = decay at z = 0, A_log = 0 (fp32): softplus(b) = decay for the
    unbounded gate, -g_min * sigmoid(b) = decay for the bounded one."""
    decay = decay.float()
    if g_min is None:
        return torch.log(torch.expm1(decay))
    return torch.logit(decay / -g_min)


def check_layer_input(x, d_model: int, w_dtype: torch.dtype) -> None:
    """A token-mixing layer's input: a floating-point [B, T, d_model] tensor in the parameters'
    dtype (any dtype under autocast). TypeError or ValueError saying what was expected."""
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        raise TypeError(f"x must be a floating-point tensor, got {type(x).__name__}"
                        f"{' of ' + str(x.dtype) if isinstance(x, torch.Tensor) else ''}")
    if x.dim() != 3 or x.shape[-1] != d_model:
        raise ValueError(f"x must be [B, T, d_model] = [B, T, {d_model}], got shape {tuple(x.shape)}")
    if x.dtype != w_dtype and not torch.is_autocast_enabled(x.device.type):
        raise ValueError(f"x is {x.dtype} but the layer's parameters are {w_dtype}: cast one to the other "
                         "(layer.to(dtype)) or run under torch.autocast")


@dataclass
class KDAConfig:
    """Hyper-parameters of one KDA layer."""

    d_model: int = 128
    """Model width D (input and output features)."""
    num_heads: int = 4
    """Number of KDA heads H (q and k heads)."""
    num_v_heads: int | None = None
    """Value heads HV, a multiple of H (grouped value attention: value head j reads key head
    j // (HV / H); v, g, beta, the output gate and the states have HV heads); None means H."""
    head_dim: int = 32
    """Key/query head dimension K (the state is K x V per head)."""
    value_dim: int | None = None
    """Value head dimension V; None means V = K."""
    conv_size: int = 4
    """Width W of the causal depthwise short convolution on q, k, v (0 disables it)."""
    gate_rank: int | None = None
    """Rank of the low-rank decay-gate projection W_g_up W_g_down; None means head_dim (Kimi Linear)."""
    output_gate_rank: int | None = None
    """Rank of the sigmoid output gate; None means full rank (K3 Eq. 18)."""
    g_min: float | None = -5.0
    """Lower bound of the per-step log decay g = g_min * sigmoid(.), in [-5, 0) (K3 Eq. 17); None:
    the unbounded gate g = -exp(A_log) * softplus(.) of the released Kimi Linear checkpoints (the
    op's general-gate kernels on Hopper)."""
    allow_neg_eigval: bool = False
    """beta = 2 * sigmoid(W_beta x) in [0, 2]: the transition I - beta k k^T may have negative
    eigenvalues (flash-linear-attention's allow_neg_eigval); False: beta = sigmoid(.) in [0, 1]."""
    decay_init_min: float = 1e-3
    """Initial -g spans [decay_init_min, decay_init_max] log-uniformly over channels (like Mamba's dt)."""
    decay_init_max: float = 0.1
    """See decay_init_min."""
    chunk_size: int = 64
    """Chunk length of the chunked KDA op."""
    segment_len: int | str | None = "auto"
    """Cut each sequence (each CP rank's shard) into segments of this many tokens, a multiple of
    chunk_size, run as parallel chains (kda_cp.chunk_kda's segment_len, docs/design.md §10);
    "auto": where the state passes would leave the GPU underfilled; None: no split."""
    norm_eps: float = 1e-6
    """Epsilon of the per-head RMSNorm and of the L2 normalization of q and k."""
    backend: str = "auto"
    """KDA op backend: "auto", "torch" or "tilelang" (see kda_cp.ops.get_backend)."""

    def __post_init__(self) -> None:
        for name in ("d_model", "num_heads", "head_dim", "conv_size", "chunk_size", "num_v_heads", "value_dim",
                     "gate_rank", "output_gate_rank"):
            x = getattr(self, name)
            if x is not None and (isinstance(x, bool) or not isinstance(x, int)):
                raise ValueError(f"KDAConfig.{name} must be an int, got {x!r}")
        for name in ("g_min", "norm_eps", "decay_init_min", "decay_init_max"):
            x = getattr(self, name)
            if (x is not None or name != "g_min") and (isinstance(x, bool) or not isinstance(x, (int, float))):
                raise ValueError(f"KDAConfig.{name} must be a number{' or None' if name == 'g_min' else ''}, got {x!r}")
        if not isinstance(self.allow_neg_eigval, bool):
            raise ValueError(f"KDAConfig.allow_neg_eigval must be a bool, got {self.allow_neg_eigval!r}")
        for name in ("d_model", "num_heads", "head_dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"KDAConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.g_min is not None and not -5.0 <= self.g_min < 0.0:
            raise ValueError(f"KDAConfig.g_min must be in [-5, 0) or None, got {self.g_min}")
        if self.conv_size < 0:
            raise ValueError(f"KDAConfig.conv_size must be >= 0, got {self.conv_size}")
        for name in ("num_v_heads", "value_dim", "gate_rank", "output_gate_rank"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"KDAConfig.{name} must be >= 1 or None, got {getattr(self, name)}")
        if self.v_heads % self.num_heads:
            raise ValueError(f"KDAConfig.num_v_heads must be a multiple of num_heads = {self.num_heads} "
                             f"(grouped value attention), got {self.num_v_heads}")
        if not (self.norm_eps > 0 and math.isfinite(self.norm_eps)):  # inf would zero every output
            raise ValueError(f"KDAConfig.norm_eps must be > 0 and finite, got {self.norm_eps}")
        try:
            check_chunk_size(self.chunk_size)
        except ValueError as exc:
            raise ValueError(f"KDAConfig.{exc}") from None
        try:
            check_segment_len(self.segment_len, self.chunk_size)
        except ValueError as exc:
            raise ValueError(f"KDAConfig.{exc}") from None
        if self.backend not in BACKENDS:
            raise ValueError(f"KDAConfig.backend must be one of {BACKENDS}, got {self.backend!r}")
        if not 0 < self.decay_init_min <= self.decay_init_max < (math.inf if self.g_min is None else -self.g_min):
            raise ValueError(
                "KDAConfig needs 0 < decay_init_min <= decay_init_max < -g_min, got "
                f"{self.decay_init_min}, {self.decay_init_max}, g_min={self.g_min}"
            )
        ends = gate_bias_for_decay(torch.tensor([self.decay_init_min, self.decay_init_max]), self.g_min)
        if not bool(torch.isfinite(ends).all()):
            raise ValueError(
                f"KDAConfig: decay_init_min = {self.decay_init_min} and decay_init_max = {self.decay_init_max} give an "
                f"initial gate bias of {ends.tolist()} in fp32; choose decays "
                + ("below 88 (softplus(b) overflows past it)" if self.g_min is None
                   else f"that stay below -g_min = {-self.g_min} in fp32 (the sigmoid saturates at 1)")
            )

    @property
    def v_dim(self) -> int:
        return self.head_dim if self.value_dim is None else self.value_dim

    @property
    def v_heads(self) -> int:
        return self.num_heads if self.num_v_heads is None else self.num_v_heads


class RMSNorm(nn.Module):
    """RMSNorm over the last dim: x / sqrt(mean(x^2) + eps) * weight, computed in fp32 (fp64 for fp64).

    Args:
        dim: size of the last dim.
        eps: added to the mean square.
    """

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        cdt = torch.promote_types(x.dtype, torch.float32)
        xf = x.to(cdt)
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * self.weight.to(cdt)).to(x.dtype)


class ShortConv(nn.Module):
    """Causal depthwise convolution of width W over [B, T, D], with the CP halo when sharded.

    The weight is [D, W] (``nn.Conv1d(D, D, W, groups=D)``'s weight without its middle dim),
    initialized like nn.Conv1d. No bias (as in Kimi Linear's short convolutions). Under CP (its
    ``cp`` context, set by :func:`kda_cp.parallel.parallelize`) x is this rank's shard.
    """

    def __init__(self, dim: int, width: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim, width))
        bound = 1.0 / math.sqrt(width)
        nn.init.uniform_(self.weight, -bound, bound)
        self.cp = CPContext()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # .to(x.dtype): under bf16 autocast the input is bf16 and the fp32 weight must follow it.
        self.cp.rank_and_size()  # a context whose group was pickled away raises here
        return causal_conv1d(x, self.weight.to(x.dtype), None, cp_group=self.cp.group)


class KDALayer(nn.Module):
    """One KDA token-mixing layer (module docstring has the equations).

    Args:
        config: a :class:`KDAConfig`.

    Context parallelism: the layer's ``cp`` (a :class:`kda_cp.parallel.CPContext`, unsharded by
    default) is set by :func:`kda_cp.parallel.parallelize`. When its group has P > 1 ranks, forward
    and backward are collective: every rank of the group calls them in the same order, and the
    strategy ("scan" or "ulysses", which needs num_heads % P == 0 and equal shards) picks the op.

    Forward:
        x: [B, T, D], the parameters' dtype (or any float under torch.autocast). Under CP, this
            rank's contiguous shard of the sequence.
        cu_seqlens: int [N + 1] GLOBAL offsets of packed sequences (B = 1), the same on every CP
            rank; neither the short conv nor the recurrence crosses a sequence start. Zero-length
            sequences are allowed, also under CP.
        Returns y: [B, T, D] in x's dtype (under autocast, the autocast dtype for an fp32 x, as
        nn.Linear).

    On CUDA the glue around the KDA op (conv + SiLU + L2Norm, gate and beta, RMSNorm times the
    output gate) runs fused (:mod:`kda_cp.glue`: TileLang conv kernels where they cover the
    layer, torch.compile elsewhere); on CPU the same functions run eagerly. With num_v_heads > H
    (GVA) the op repeats q and k per group of value heads.

    Raises:
        TypeError: x not a floating-point tensor.
        ValueError: x not [B, T, d_model], or of another dtype than the parameters outside autocast;
            cu_seqlens not 1-D integers from 0, non-decreasing (the last from the op).
        NotImplementedError: cu_seqlens with the "ulysses" strategy.
    """

    def __init__(self, config: KDAConfig) -> None:
        super().__init__()
        self.config = c = config
        D, H, HV, K, V = c.d_model, c.num_heads, c.v_heads, c.head_dim, c.v_dim
        # W_q, W_k, W_v stacked in one projection, and their three depthwise short convolutions in
        # one conv over the stacked channels (identical math; one halo exchange per layer under CP).
        self.qkv_proj = nn.Linear(D, 2 * H * K + HV * V, bias=False)
        if c.conv_size > 0:
            self.qkv_conv = ShortConv(2 * H * K + HV * V, c.conv_size)
        rank = K if c.gate_rank is None else c.gate_rank
        self.g_down = nn.Linear(D, rank, bias=False)
        self.g_up = nn.Linear(rank, HV * K, bias=True)
        self.A_log = nn.Parameter(torch.zeros(HV))  # per-head log scale of the gate input (K3 Eq. 17)
        self.b_proj = nn.Linear(D, HV, bias=False)
        if c.output_gate_rank is None:
            self.og_proj = nn.Sequential(nn.Linear(D, HV * V, bias=False))
        else:
            self.og_proj = nn.Sequential(
                nn.Linear(D, c.output_gate_rank, bias=False), nn.Linear(c.output_gate_rank, HV * V, bias=True)
            )
        self.o_norm = RMSNorm(V, eps=c.norm_eps)
        self.o_proj = nn.Linear(HV * V, D, bias=False)
        self.cp = CPContext()
        self._init_gate_bias()

    @torch.no_grad()
    def _init_gate_bias(self) -> None:
        """Bias so the initial per-step decay -g spans [decay_init_min, decay_init_max] (log-uniform)."""
        c = self.config
        n = self.g_up.bias.numel()
        decay = torch.exp(
            torch.linspace(math.log(c.decay_init_min), math.log(c.decay_init_max), n)[torch.randperm(n)]
        )
        self.g_up.bias.copy_(gate_bias_for_decay(decay, c.g_min))

    def gate(self, x: torch.Tensor) -> torch.Tensor:
        """g = g_min * sigmoid(exp(A_h) * (W_up W_down x + b)): [B, T, HV, K] in (g_min, 0); with
        g_min None, g = -exp(A_h) * softplus(W_up W_down x + b) < 0.

        Computed and returned in fp32 (fp64 when x is fp64).
        """
        c = self.config
        B, T, _ = x.shape
        z = F.linear(self.g_down(x), self.g_up.weight).view(B, T, c.v_heads, c.head_dim)
        return glue.kda_gate(z, self.A_log, self.g_up.bias, c.g_min)[0]

    def _check_input(self, x, cu_seqlens):
        """This rank's checks of forward's arguments (TypeError, ValueError, NotImplementedError);
        returns cu_seqlens as a tensor on x's device, or None."""
        c = self.config
        check_layer_input(x, c.d_model, self.qkv_proj.weight.dtype)
        if cu_seqlens is not None and self.cp.strategy == "ulysses":
            raise NotImplementedError("cu_seqlens with the 'ulysses' CP strategy is not supported; use 'scan'")
        if cu_seqlens is None:
            return None
        if not isinstance(cu_seqlens, torch.Tensor):  # host offsets (the model's): a device copy never read back
            return device_offsets(check_cu_seqlens(cu_seqlens), x.device)
        check_cu_seqlens_tensor(cu_seqlens)  # its form before the copy and the conv read it; the op checks the values
        return cu_seqlens.to(x.device)

    def forward(self, x: torch.Tensor, cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
        c = self.config
        cp_group, cp_strategy = self.cp.group, self.cp.strategy
        rank, size = self.cp.rank_and_size()
        if size > 1:  # every rank checks its arguments, then all agree: a bad one raises everywhere, never hangs
            checked = []

            def check():
                checked.append(self._check_input(x, cu_seqlens))
                if x.shape[1] < 1:
                    raise ValueError(f"every rank's shard must hold at least 1 token, got T_r = {x.shape[1]}")
                cs = [] if checked[0] is None else check_cu_seqlens(checked[0])
                checked.append(cs)
                return x.shape[1], [x.shape[0], c.d_model, self.qkv_proj.out_features, dtype_code(x.dtype),
                                    c.conv_size, CP_STRATEGIES.index(cp_strategy), len(cs), digest(cs)]

            lengths = check_and_agree(check, cp_group, "KDALayer", ("B", "d_model", "q/k/v width", "dtype", "conv_size",
                                                                   "strategy", "len(cu_seqlens)", "cu_seqlens digest"),
                                      device=x.device if isinstance(x, torch.Tensor) else None)
            cu_seqlens = checked[0]
            cu_host = checked[1] if cu_seqlens is not None else None  # the op takes the offsets read once here
        else:
            cu_seqlens = self._check_input(x, cu_seqlens)
        B, T, _ = x.shape
        H, HV, K, V = c.num_heads, c.v_heads, c.head_dim, c.v_dim
        # W_qkv, W_g_down, W_beta and the output gate's first matrix read x in one GEMM; its
        # backward takes the q/k/v gradient as the conv wrote it (no concatenation into one of y's size).
        og_first = self.og_proj[0]
        widths = [self.qkv_proj.out_features, self.g_down.out_features, HV, og_first.out_features]
        w_in = torch.cat([self.qkv_proj.weight, self.g_down.weight, self.b_proj.weight, og_first.weight])
        qkv, zd, b, og = glue.linear_split(x, w_in, widths)
        if len(self.og_proj) > 1:  # as one 2-D GEMM: its bias in the GEMM's epilogue, not a separate add
            og = self.og_proj[1](og.flatten(0, 1)).view(B, T, self.og_proj[1].out_features)
        # Short conv + SiLU + L2Norm of q, k in one fused pass (kda_cp.glue); under CP the W-1 rows
        # before the shard (the halo) come from the previous ranks and feed the taps directly.
        weight = halo = lags = None
        if c.conv_size > 0:
            weight, start = self.qkv_conv.weight, 0
            if size > 1:  # the shard lengths were agreed above, before any exchange
                start = sum(lengths[:rank])
                halo = halo_exchange(qkv, c.conv_size - 1, cp_group, lengths)
            if cu_seqlens is not None:
                lags = glue.lags_in_sequence(cu_seqlens, start, T, c.conv_size - 1, x.device)
        q, k, v = glue.conv_silu_norm(qkv, weight, (H * K, H * K, HV * V), K, c.norm_eps, halo=halo, lags=lags)
        v = v.view(B, T, HV, V)  # glue splits v into H heads; value heads are its contiguous slices
        z = F.linear(zd.reshape(B * T, zd.shape[-1]), self.g_up.weight).view(B, T, HV, K)
        # No value checks (check_gate=False): g = g_min * sigmoid(.) lies in [g_min, 0] (or is the
        # softplus gate's -exp(.) * softplus(.) <= 0, which declares no bound) and beta in
        # [0, 1] (or [0, 2]) by construction, and a NaN from upstream reaches the loss, which training
        # checks every step; the checks would cost a read of q, k, v, g and a device sync per layer.
        kw = dict(chunk_size=c.chunk_size, backend=c.backend, g_min=c.g_min, check_gate=False,
                  allow_neg_eigval=c.allow_neg_eigval, segment_len=c.segment_len)
        with layout_known():  # q is [B, T, H, K] by construction, also for T < H (a single token)
            if size == 1:  # the gate and beta's sigmoid from their pre-activations inside the op (its kernels)
                o, _ = chunk_kda(q, k, v, z, b, cu_seqlens=cu_seqlens, use_gate_in_kernel=True, A_log=self.A_log,
                                 dt_bias=self.g_up.bias, use_beta_sigmoid_in_kernel=True, **kw)
            else:
                g, beta = glue.kda_gate(z, self.A_log, self.g_up.bias, c.g_min, b,
                                        beta_scale=2.0 if c.allow_neg_eigval else 1.0)
                if cp_strategy == "ulysses":
                    o = ulysses_kda(q, k, v, g, beta, cp_group=cp_group, impl=self.cp.ulysses_impl, **kw)
                else:
                    o, _ = cp_chunk_kda(q, k, v, g, beta, cp_group=cp_group, cu_seqlens=cu_host, **kw)
        # Per-head RMSNorm times the sigmoid output gate in one fused pass.
        o = glue.rms_norm_gated(o, self.o_norm.weight, og, c.norm_eps)
        return self.o_proj(o)


@dataclass
class AttentionConfig:
    """Hyper-parameters of one full (softmax) attention layer of the hybrid model."""

    d_model: int = 128
    """Model width D."""
    num_heads: int = 4
    """Attention heads H."""
    head_dim: int = 32
    """Head dimension (queries, keys and values)."""

    def __post_init__(self) -> None:
        for name in ("d_model", "num_heads", "head_dim"):
            x = getattr(self, name)
            if isinstance(x, bool) or not isinstance(x, int) or x < 1:
                raise ValueError(f"AttentionConfig.{name} must be an int >= 1, got {x!r}")


class AttentionLayer(nn.Module):
    """Causal multi-head softmax attention without positional encoding (NoPE, as Kimi Linear's
    full-attention layers), exact under context parallelism.

        q, k, v = W_q x, W_k x, W_v x          per head [B, T, H, D]
        o       = softmax(q k^T / sqrt(D) + causal mask) v
        y       = W_o o

    Under CP (its ``cp`` context, set by :func:`kda_cp.parallel.parallelize`), K and V are
    all-gathered over the CP group and this rank's queries attend with the causal offset of their
    global positions (:func:`kda_cp.parallel.layers.attention.cp_attention`); both CP strategies use this
    path.

    Forward: x [B, T_r, D] (collective under CP) -> y [B, T_r, D]; with ``cu_seqlens`` (int
    [N + 1] GLOBAL offsets of packed sequences, B = 1, the same on every rank) each token attends
    within its own sequence.

    Raises:
        TypeError, ValueError: x not a float [B, T, d_model] tensor in the parameters' dtype (any
            under autocast); cu_seqlens not offsets from 0, non-decreasing, ending at the whole
            length, or given with B > 1. Under CP on every rank when any rank fails.
    """

    def __init__(self, config: AttentionConfig) -> None:
        super().__init__()
        self.config = c = config
        self.qkv_proj = nn.Linear(c.d_model, 3 * c.num_heads * c.head_dim, bias=False)
        self.o_proj = nn.Linear(c.num_heads * c.head_dim, c.d_model, bias=False)
        self.cp = CPContext()

    def _check_input(self, x, cu_seqlens) -> list[int] | None:
        c = self.config
        check_layer_input(x, c.d_model, self.qkv_proj.weight.dtype)
        if cu_seqlens is None:
            return None
        return check_cu_seqlens(cu_seqlens, batch=x.shape[0])

    def forward(self, x: torch.Tensor, cu_seqlens: torch.Tensor | list[int] | None = None) -> torch.Tensor:
        c = self.config
        lengths = None
        if self.cp.rank_and_size()[1] > 1:  # the shard lengths with every rank's checks: nothing hangs or aborts
            checked = []

            def check():
                checked.append(self._check_input(x, cu_seqlens))
                cs = checked[0] or []
                return x.shape[1], [x.shape[0], c.d_model, c.num_heads * c.head_dim, dtype_code(x.dtype), len(cs),
                                    digest(cs)]

            lengths = check_and_agree(check, self.cp.group, "AttentionLayer", ("B", "d_model", "heads x head_dim",
                                                                             "dtype", "len(cu_seqlens)",
                                                                             "cu_seqlens digest"),
                                      device=x.device if isinstance(x, torch.Tensor) else None)
            cs, total = checked[0], sum(lengths)
        else:
            cs, total = self._check_input(x, cu_seqlens), x.shape[1]
        if cs is not None and cs[-1] != total:  # the same on every rank (agreed offsets and lengths)
            raise ValueError(f"cu_seqlens ends at {cs[-1]} but the sequence holds {total} tokens")
        B, T, _ = x.shape
        q, k, v = self.qkv_proj(x).view(B, T, 3, c.num_heads, c.head_dim).unbind(2)
        o = cp_attention(q, k, v, cp_group=self.cp.group, lengths=lengths, cu_seqlens=cs)
        return self.o_proj(o.reshape(B, T, c.num_heads * c.head_dim))
