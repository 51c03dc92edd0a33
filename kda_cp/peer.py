"""flash-linear-attention's KDA layer behind kda_cp's token-mixer interface, for side-by-side runs.

``FlaKDALayer(config)`` builds ``fla.layers.kda.KimiDeltaAttention`` with the parameterization of
a :class:`kda_cp.layers.KDALayer` of the same config: D, heads, head dims, the width-4 short conv,
the bounded gate g = g_min * sigmoid(exp(A_log) * (f + dt_bias)) (``safe_gate=True``,
``lower_bound=g_min``) and a low-rank sigmoid output gate of rank V with a bias. It needs the
optional dependency flash-linear-attention (``pip install flash-linear-attention==0.6.0``) and a
CUDA device; it has no context parallelism.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from kda_cp.kernels._common import device_offsets
from kda_cp.layers import KDAConfig
from kda_cp.parallel.layers.context import CPContext

__all__ = ["FlaKDALayer"]


class FlaKDALayer(nn.Module):
    """The peer's KDA layer: x [B, T, D] -> y [B, T, D], as :class:`kda_cp.layers.KDALayer`.

    Raises:
        ImportError: flash-linear-attention is not installed.
        ValueError: a config the peer cannot express (output_gate_rank other than V, gate_rank
            other than V).
        NotImplementedError: a CP group of more than one rank.
    """

    def __init__(self, config: KDAConfig) -> None:
        super().__init__()
        try:
            from fla.layers.kda import KimiDeltaAttention
        except ImportError as exc:
            raise ImportError("the flash-linear-attention KDA layer needs the package flash-linear-attention "
                              "(pip install flash-linear-attention==0.6.0)") from exc
        c = self.config = config
        V = c.v_dim
        if c.output_gate_rank != V:
            raise ValueError(f"flash-linear-attention's output gate has rank V = {V}: set output_gate_rank={V}, "
                             f"got {c.output_gate_rank}")
        if c.gate_rank not in (None, V) or (c.gate_rank is None and c.head_dim != V):
            raise ValueError(f"flash-linear-attention's decay gate has rank V = {V}: got gate_rank {c.gate_rank}")
        self.inner = KimiDeltaAttention(
            hidden_size=c.d_model, head_dim=c.head_dim, num_heads=c.num_heads, num_v_heads=c.v_heads,
            expand_v=V / c.head_dim,
            use_short_conv=c.conv_size > 0, conv_size=max(c.conv_size, 1), safe_gate=c.g_min is not None,
            lower_bound=c.g_min, allow_neg_eigval=c.allow_neg_eigval,
            norm_eps=c.norm_eps, mode="chunk",
        )
        self.cp = CPContext()  # set by kda_cp.parallel.parallelize; only the unsharded case runs

    def forward(self, x: torch.Tensor, cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
        if self.cp.rank_and_size()[1] > 1:
            raise NotImplementedError("flash-linear-attention's KDA layer has no context parallelism: use cp=1")
        if cu_seqlens is not None and not isinstance(cu_seqlens, torch.Tensor):  # the model hands host offsets
            cu_seqlens = device_offsets(cu_seqlens, x.device)  # one cached int64 copy for every layer
        return self.inner(x, cu_seqlens=cu_seqlens)[0]
