"""A small causal byte-level language model built from KDA layers, shardable along the sequence.

    h_0 = Embed(x)
    h_l = h_{l-1} + Mix_l(RMSNorm(h_{l-1}));  h_l = h_l + SwiGLU(RMSNorm(h_l))      (pre-norm blocks)
    logits = Head(RMSNorm(h_N))                                                  (head tied or not)

Mix_l is a KDA layer or, in the hybrid model of Kimi Linear, a full causal attention layer without
positional encoding: ``layer_pattern`` is repeated over the blocks, "K" for KDA and "A" for
attention ("KKKA": 3 KDA layers per attention layer, Kimi Linear's ratio; "K": KDA only).

Every op is position-wise except the KDA layer's short convolution and recurrence and the attention
layers, all exact under context parallelism (:mod:`kda_cp.layers`, :mod:`kda_cp.parallel.layers.attention`).
So rank r of a CP group can run the model on its contiguous shard of the tokens and get exactly its
slice of the unsharded logits.
"""

from __future__ import annotations

import math
import dataclasses
from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F

from kda_cp.layers import AttentionConfig, AttentionLayer, KDAConfig, KDALayer, RMSNorm
from kda_cp.ops import check_cu_seqlens
from kda_cp.parallel.exchange import check_and_agree
from kda_cp.parallel.layers.context import CPContext

__all__ = ["ModelConfig", "KDALanguageModel", "SwiGLU", "train_flops_per_token"]


@dataclass
class ModelConfig:
    """Hyper-parameters of :class:`KDALanguageModel`: the model's own, and its layers' as nested
    configs (``kda`` for the "K" blocks, ``attention`` for the "A" blocks)."""

    vocab_size: int = 256
    """Vocabulary size (256: raw bytes)."""
    d_model: int = 128
    """Residual width D; the nested layer configs take it (leave their d_model unset)."""
    n_layers: int = 3
    """Number of blocks (each: a token mixer + SwiGLU MLP)."""
    layer_pattern: str = "K"
    """Token mixer of each block, repeated over n_layers: "K" KDA, "A" full attention (NoPE,
    causal). n_layers must be a whole number of repeats (n_layers % len(layer_pattern) == 0).
    "KKKA" is Kimi Linear's 3:1 hybrid (n_layers 4, 8, ...); "K" a pure KDA model."""
    kda: KDAConfig = field(default_factory=KDAConfig)
    """The KDA layers: heads, head dims, short conv, gates, chunk size, backend (kda_cp.layers.KDAConfig)."""
    attention: AttentionConfig = field(default_factory=AttentionConfig)
    """The attention layers: heads and head dim (kda_cp.layers.AttentionConfig)."""
    kda_impl: str = "kda_cp"
    """Which KDA layer the "K" blocks use: "kda_cp" (:class:`kda_cp.layers.KDALayer`) or "fla"
    (flash-linear-attention's layer, :class:`kda_cp.peer.FlaKDALayer`, for side-by-side runs: an
    optional dependency, one GPU, needs kda.output_gate_rank = kda.head_dim)."""
    mlp_hidden: int | None = None
    """SwiGLU hidden width; None means 8/3 * d_model rounded up to a multiple of 64."""
    tie_embeddings: bool = True
    """Share the input embedding and the output head weights."""
    norm_eps: float = 1e-6
    """Epsilon of the blocks' RMSNorms, and of the KDA layers' unless kda.norm_eps is set apart."""
    init_std: float = 0.02
    """Std of the normal init of linear and embedding weights (output projections scaled by 1/sqrt(2 n_layers))."""

    def __post_init__(self) -> None:
        for name in ("vocab_size", "d_model", "n_layers"):
            x = getattr(self, name)
            if isinstance(x, bool) or not isinstance(x, int) or x < 1:
                raise ValueError(f"ModelConfig.{name} must be an int >= 1, got {x!r}")
        if not isinstance(self.tie_embeddings, bool):
            raise ValueError(f"ModelConfig.tie_embeddings must be a bool, got {self.tie_embeddings!r}")
        if isinstance(self.norm_eps, bool) or not isinstance(self.norm_eps, (int, float)) \
                or not (self.norm_eps > 0 and math.isfinite(self.norm_eps)):
            raise ValueError(f"ModelConfig.norm_eps must be a number > 0 and finite, got {self.norm_eps!r}")
        for name, default in (("kda", KDAConfig.d_model), ("attention", AttentionConfig.d_model)):
            sub = getattr(self, name)
            if sub.d_model not in (default, self.d_model):
                raise ValueError(f"model.{name}.d_model={sub.d_model} differs from model.d_model={self.d_model}: "
                                 "the layers take the model's width, set model.d_model")
            setattr(self, name, dataclasses.replace(sub, d_model=self.d_model))
        if self.kda.norm_eps == KDAConfig.norm_eps:  # one eps for the whole model unless kda.norm_eps is set
            self.kda = dataclasses.replace(self.kda, norm_eps=self.norm_eps)
        if not self.layer_pattern or set(self.layer_pattern) - {"K", "A"}:
            raise ValueError(
                f"model.layer_pattern must be a non-empty string of 'K' (KDA) and 'A' (attention), "
                f"got {self.layer_pattern!r}"
            )
        if self.n_layers % len(self.layer_pattern):  # a cut-off pattern would drop its later mixers
            raise ValueError(
                f"model.layer_pattern={self.layer_pattern!r} ({len(self.layer_pattern)} blocks) does not fit "
                f"model.n_layers={self.n_layers}: n_layers must be a multiple of len(layer_pattern)"
            )
        if self.mlp_hidden is not None and self.mlp_hidden < 1:
            raise ValueError(f"ModelConfig.mlp_hidden must be >= 1 or None (8/3 d_model rounded to 64), got {self.mlp_hidden}")
        if not (self.init_std > 0 and math.isfinite(self.init_std)):
            raise ValueError(f"ModelConfig.init_std must be > 0 and finite, got {self.init_std}")
        if self.kda_impl not in ("kda_cp", "fla"):
            raise ValueError(f"model.kda_impl must be 'kda_cp' or 'fla', got {self.kda_impl!r}")

    def mixer(self, layer: int) -> str:
        """"K" or "A": the token mixer of block ``layer``."""
        return self.layer_pattern[layer % len(self.layer_pattern)]

    @property
    def hidden(self) -> int:
        if self.mlp_hidden is not None:
            return self.mlp_hidden
        return -(-(8 * self.d_model) // (3 * 64)) * 64


class SwiGLU(nn.Module):
    """y = W_down(SiLU(W_gate x) * W_up x): [B, T, D] -> [B, T, D]."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.gate_up = nn.Linear(dim, 2 * hidden, bias=False)
        self.down = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)


class Block(nn.Module):
    """Pre-norm residual block: token mixer (KDA, or attention when ``mixer == "A"``), then SwiGLU MLP."""

    def __init__(self, config: ModelConfig, mixer: str = "K") -> None:
        super().__init__()
        self.mixer = mixer
        self.attn_norm = RMSNorm(config.d_model, config.norm_eps)
        if mixer == "A":
            self.attn = AttentionLayer(config.attention)
        elif config.kda_impl == "fla":
            from kda_cp.peer import FlaKDALayer

            self.attn = FlaKDALayer(config.kda)
        else:
            self.attn = KDALayer(config.kda)
        self.mlp_norm = RMSNorm(config.d_model, config.norm_eps)
        self.mlp = SwiGLU(config.d_model, config.hidden)

    def forward(self, h: torch.Tensor, cu_seqlens=None) -> torch.Tensor:
        h = h + self.attn(self.attn_norm(h), cu_seqlens=cu_seqlens)
        return h + self.mlp(self.mlp_norm(h))


class KDALanguageModel(nn.Module):
    """Causal LM over bytes: embedding, ``n_layers`` KDA blocks, final RMSNorm, LM head.

    Args:
        config: a :class:`ModelConfig`.

    Forward:
        input_ids: [B, T] integer token ids in [0, vocab_size); under CP, this rank's contiguous
            shard of each sequence (rank r of the group holds the r-th piece).
        cu_seqlens: optional int [N + 1] GLOBAL offsets of packed sequences (B = 1, the same on
            every CP rank, zero-length sequences allowed): no layer mixes tokens of two sequences
            (KDA restarts from a zero state, attention stays within the sequence). The loss at a
            sequence's last token (predicting the next sequence's first) is the caller's to mask.
        Returns logits: [B, T, vocab_size], fp32 when the weights are fp32.

    Context parallelism is set once, ``kda_cp.parallel.parallelize(model, CPContext(group, strategy))``;
    forward and backward are then collective over the group (every rank in the same order).

    Raises:
        ValueError: input_ids not 2-D integer, or a token id outside [0, vocab_size); cu_seqlens
            not offsets from 0, non-decreasing, ending at the whole length, or with B > 1; under CP
            on every rank when any rank's input_ids fail or the ranks' batch sizes differ.
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.d_model)
        self.blocks = nn.ModuleList(Block(config, config.mixer(i)) for i in range(config.n_layers))
        self.norm = RMSNorm(config.d_model, config.norm_eps)
        self.head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        self._init_weights()
        if config.tie_embeddings:
            self.head.weight = self.embed.weight

    @torch.no_grad()
    def _init_weights(self) -> None:
        std = self.config.init_std
        for name, m in self.named_modules():
            if isinstance(m, nn.Linear):
                if name.endswith("g_up"):  # the decay gate keeps its bias-driven init (KDALayer)
                    nn.init.normal_(m.weight, std=std)
                    continue
                scale = (2 * self.config.n_layers) ** -0.5 if name.endswith(("o_proj", "down")) else 1.0
                nn.init.normal_(m.weight, std=std * scale)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
            elif isinstance(m, nn.Embedding):
                nn.init.normal_(m.weight, std=std)

    def _check_ids(self, input_ids, cu_seqlens=None) -> list[int] | None:
        """Checks input_ids (and cu_seqlens); returns the offsets as a host list, or None."""
        if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 \
                or input_ids.dtype not in (torch.int32, torch.int64, torch.uint8):
            got = (f"shape {tuple(input_ids.shape)} dtype {input_ids.dtype}" if isinstance(input_ids, torch.Tensor)
                   else type(input_ids).__name__)
            raise ValueError(f"input_ids must be a [B, T] integer tensor, got {got}")
        if input_ids.numel():
            lo, hi = (int(x) for x in torch.aminmax(input_ids))  # one sync; on CUDA a bad id would be a device assert
            if lo < 0 or hi >= self.config.vocab_size:
                raise ValueError(f"input_ids must lie in [0, vocab_size) = [0, {self.config.vocab_size}), got min {lo}, max {hi}")
        if cu_seqlens is not None:
            if input_ids.shape[0] != 1:
                raise ValueError(f"cu_seqlens needs B == 1 (sequences packed along T), got input_ids "
                                 f"{list(input_ids.shape)}")
            return check_cu_seqlens(cu_seqlens)
        return None

    def forward(self, input_ids: torch.Tensor, cu_seqlens: torch.Tensor | list[int] | None = None) -> torch.Tensor:
        # every block's token mixer carries the context parallelize set (a look at n_layers attributes)
        cp = next((b.attn.cp for b in self.blocks if isinstance(getattr(b.attn, "cp", None), CPContext)), None)
        if cp is not None and cp.rank_and_size()[1] > 1:
            # every rank checks its ids and all agree before the first layer's collectives: a bad
            # shard raises ValueError on every rank instead of leaving the others waiting
            checked = []

            def check():
                checked.append(self._check_ids(input_ids, cu_seqlens))
                return input_ids.shape[1], [input_ids.shape[0]]

            check_and_agree(check, cp.group, "KDALanguageModel", ("B",), device=getattr(input_ids, "device", None))
            cu_seqlens = checked[0]
        else:
            cu_seqlens = self._check_ids(input_ids, cu_seqlens)  # read once: every layer takes the host offsets
        h = self.embed(input_ids.long())
        for block in self.blocks:
            h = block(h, cu_seqlens=cu_seqlens)
        return self.head(self.norm(h))

    def num_params(self) -> int:
        """Number of distinct parameters (a tied head counted once)."""
        return sum(p.numel() for p in self.parameters())


def train_flops_per_token(model: KDALanguageModel, seq_len: int) -> float:
    """Model FLOPs of one training token (forward + backward = 3 x forward), for MFU.

    Counted per token, forward, then times 3 (backward = 2 x forward):

    - every nn.Linear (projections, gates, MLP, LM head; a tied head counted as the matmul it is):
      2 * in * out;
    - short convolution: 2 * W * channels;
    - KDA chunk op, per head, chunk C, head dims K, V (the chunked form of docs/design.md §2, full
      C x C blocks, no credit for triangles): A_kk 2CK, W = T(Gamma K) 2CK, U = TV 2CV,
      W S 2KV, (Gamma Q) S 2KV, Q K^T 2CK, (.) V' 2CV, state update 2KV, i.e.
      2 * (3 C K + 2 C V + 3 K V);
    - causal attention, per head of dim D at sequence length T: Q K^T and P V over T/2 keys on
      average, 2 * 2 * (T / 2) * D = 2 T D.

    Elementwise work (norms, activations, gates' exp, the triangular solve) is not counted.
    MFU = tokens/s * train_flops_per_token / (GPUs * peak FLOP/s); peak 989 TFLOP/s is the H200's
    (= H100 SXM) dense bf16 tensor-core rate.
    """
    fwd = 0.0
    for m in model.modules():
        if isinstance(m, nn.Linear):
            fwd += 2.0 * m.in_features * m.out_features
        elif isinstance(m, KDALayer) or type(m).__name__ == "FlaKDALayer":
            c = m.config
            if c.conv_size > 0:
                fwd += 2.0 * c.conv_size * (2 * c.num_heads * c.head_dim + c.v_heads * c.v_dim)
            C, K, V = c.chunk_size, c.head_dim, c.v_dim
            fwd += c.v_heads * 2.0 * (3 * C * K + 2 * C * V + 3 * K * V)  # the op runs on HV heads
        elif isinstance(m, AttentionLayer):
            fwd += m.config.num_heads * 2.0 * seq_len * m.config.head_dim
    return 3.0 * fwd
