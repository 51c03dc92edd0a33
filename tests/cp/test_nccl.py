"""Multi-GPU equivalence over NCCL (one process per GPU): cp_chunk_kda through the TileLang kernels
and one training step of the hybrid model give, on P GPUs, what one GPU gives.

Skipped unless P GPUs are present; P in {2, 4, 8} as far as the machine allows.
"""

from __future__ import annotations

import pytest
import torch

from kda_cp.layers import AttentionConfig, KDAConfig
from tests._dist import run_ranks
from test_cp_gpu import _fp64_reference, _inputs, _unsharded_tilelang, check_cp
from tests._utils import assert_close

pytestmark = pytest.mark.gpu

N_GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0


def _needs(P):
    return pytest.mark.skipif(N_GPUS < P, reason=f"needs {P} GPUs, found {N_GPUS}")


def _cp_body(rank, world_size, inputs, lengths, cu, exchange):
    import torch.distributed as dist

    from kda_cp.parallel import cp_chunk_kda

    dev = torch.device("cuda", rank)
    q, k, v, g, beta, h0, do, dfinal = (t.to(dev) for t in inputs)
    start = sum(lengths[:rank])
    sl = slice(start, start + lengths[rank])
    leaves = [t[:, sl].clone().requires_grad_(True) for t in (q, k, v, g, beta)] + [h0.clone().requires_grad_(True)]
    o, f = cp_chunk_kda(*leaves[:5], cp_group=dist.group.WORLD, initial_state=leaves[5], output_final_state=True,
                        cu_seqlens=cu, backend="tilelang", exchange=exchange)
    # the final state is replicated and its gradient summed over ranks: split <f, dfinal> unevenly
    weight = (rank + 1) / (world_size * (world_size + 1) / 2)
    ((o.float() * do[:, sl].float()).sum() + weight * (f * dfinal).sum()).backward()
    return {"o": o.detach().cpu(), "f": f.detach().cpu(), "grads": [x.grad.cpu() for x in leaves]}


def _assert_transitions_matter(inputs, lengths):
    """Guard against a test that cannot fail: at some shard boundary the part of the outgoing state
    carried by the shard's transition, M s_in, must be a visible share of the state s_out = M s_in + S~
    handed to the next rank, or errors in M and in the scan would not show (fp64 torch reference,
    each batch row one sequence)."""
    from kda_cp.reference import chunk_kda_summary_torch, chunk_kda_torch

    q, k, v, g, beta, h0 = (x.double().cpu() for x in inputs[:6])
    h0 = h0[: q.shape[0]]
    share, start = [], 0
    for n in lengths[:-1]:
        sl = slice(start, start + n)
        M, St = chunk_kda_summary_torch(*(x[:, sl] for x in (k, v, g, beta)))
        if start:
            _, s_in = chunk_kda_torch(q[:, :start], k[:, :start], v[:, :start], g[:, :start], beta[:, :start],
                                      1.0, initial_state=h0, output_final_state=True)
        else:
            s_in = h0
        carried = M @ s_in
        share.append((carried.norm() / (carried + St).norm()).item())
        start += n
    assert max(share) > 0.05, f"M s_in is a negligible share of the handed-over states: {share}"


def _gather(res):
    o = torch.cat([r["o"] for r in res], 1)
    grads = [torch.cat([r["grads"][i] for r in res], 1) for i in range(5)]
    # initial_state.grad is the full dL/dS_0 on every rank (cp_chunk_kda's contract): take rank 0's
    grads.append(res[0]["grads"][5])
    return o, res[0]["f"], grads


CASES = [
    # id, P, T, shard lengths (None: equal), cu_seqlens (None: dense B=2), cuts on each sequence's
    # chunk grid, gates (see test_cp_gpu.check_cp)
    ("P2-dense-fast", 2, 1024, [256, 768], None, True, "fast"),
    ("P2-dense", 2, 1024, [256, 768], None, True, "mixed"),
    ("P2-packed-aligned", 2, 2003, [1268, 735], [0, 15, 256, 756, 1956, 2003], True, "mixed"),
    ("P2-packed-uneven", 2, 2003, [1001, 1002], [0, 15, 256, 756, 1956, 2003], False, "mixed"),
    ("P4-packed-3ranks", 4, 3000, [300, 200, 1700, 800], [0, 100, 2500, 3000], False, "mixed"),
    ("P8-dense-uneven", 8, 3000, [300, 63, 200, 137, 250, 100, 150, 1800], None, False, "mixed"),
]


@pytest.mark.parametrize("exchange", ["allgather", "p2p"])
@pytest.mark.parametrize("P,T,lengths,cu,aligned,gates",
                         [pytest.param(*c[1:], marks=_needs(c[1]), id=c[0]) for c in CASES])
def test_cp_chunk_kda_nccl_matches_one_gpu(P, T, lengths, cu, aligned, gates, exchange):
    B = 2 if cu is None else 1
    n = B if cu is None else len(cu) - 1
    H, K = 4, 128
    lengths = lengths or [T // P] * P
    inputs = _inputs(B, T, H, K, n, seed=P * T + len(exchange), gates=gates)
    if gates == "mixed" and (cu is None or P > 2):  # (P2 packed: the cut sequence starts in shard 0)
        _assert_transitions_matter(inputs, lengths)
    res = run_ranks(_cp_body, P, [t.cpu() for t in inputs], lengths, cu, exchange, backend="nccl", timeout=300)
    o, f, grads = _gather(res)
    for r in res[1:]:  # replicated outputs are identical on every rank
        assert torch.equal(r["f"], res[0]["f"]) and torch.equal(r["grads"][5], res[0]["grads"][5])
    check_cp(o, f, grads, _fp64_reference(*inputs, cu), _unsharded_tilelang(*inputs, cu) if aligned else None, gates)


# One training step of the hybrid model (KKKA, TileLang KDA under bf16 autocast, attention all-gather):
# loss and summed parameter gradients on P GPUs vs one GPU. Shards are multiples of the chunk size, so
# the KDA layers run the same chunks; what differs is the CP exchange and bf16 rounding of the
# shard-wise weight-gradient sums.
HYBRID = dict(d_model=256, n_layers=4, layer_pattern="KKKA",
              kda=KDAConfig(num_heads=8, head_dim=128, chunk_size=64, backend="tilelang"),
              attention=AttentionConfig(num_heads=8, head_dim=128))
LOSS_TOL, LOGIT_TOL, GRAD_TOL = 2e-3, 1e-2, 2e-2


def _hybrid_body(rank, world_size, state, ids, strategy):
    import torch.distributed as dist
    import torch.nn.functional as F

    from kda_cp.model import KDALanguageModel, ModelConfig
    from kda_cp.parallel import CPContext, parallelize

    dev = torch.device("cuda", rank)
    model = KDALanguageModel(ModelConfig(**HYBRID)).to(dev)
    model.load_state_dict(state)
    ids = ids.to(dev)
    T = ids.shape[1]
    L = T // world_size
    sl = slice(rank * L, (rank + 1) * L)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        logits = parallelize(model, CPContext(dist.group.WORLD, strategy))(ids[:, sl])
    # next-token targets of this shard: the first token of the next shard closes the last position
    tgt = ids[:, rank * L + 1: (rank + 1) * L + 1]
    lg = logits.float()[:, : tgt.shape[1]]
    loss = F.cross_entropy(lg.flatten(0, 1), tgt.flatten(), reduction="sum") / (ids.shape[0] * (T - 1))
    loss.backward()
    return {"loss": loss.detach().cpu(), "logits": logits.detach().float().cpu(),
            "grads": {n: p.grad.float().cpu() for n, p in model.named_parameters()}}


@pytest.mark.parametrize("strategy", ["scan", "ulysses"])
@pytest.mark.parametrize("P", [pytest.param(p, marks=_needs(p), id=f"P{p}") for p in (2, 4, 8)])
def test_hybrid_training_step_nccl_matches_one_gpu(P, strategy):
    import torch.nn.functional as F

    from kda_cp.model import KDALanguageModel, ModelConfig

    torch.manual_seed(P)
    model = KDALanguageModel(ModelConfig(**HYBRID)).cuda()
    T = 1024 * P
    ids = torch.randint(0, 256, (1, T))
    state = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    idc = ids.cuda()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        logits = model(idc)
    loss = F.cross_entropy(logits.float()[:, :-1].flatten(0, 1), idc[:, 1:].flatten(), reduction="sum") / (T - 1)
    loss.backward()
    res = run_ranks(_hybrid_body, P, state, ids, strategy, backend="nccl", timeout=300)
    logits_cp = torch.cat([r["logits"] for r in res], 1)
    ref = logits.detach().float().cpu()
    assert_close("logits", ref, logits_cp, LOGIT_TOL)
    L = T // P
    for r in range(1, P):  # the tokens right after a shard boundary (conv halo, incoming state)
        edge = slice(r * L, r * L + 64)
        assert_close(f"logits after boundary {r}", ref[:, edge], logits_cp[:, edge], LOGIT_TOL)
    got = sum(r["loss"] for r in res)
    assert abs(got.item() - loss.item()) <= LOSS_TOL * abs(loss.item()), (got.item(), loss.item())
    for name, p in model.named_parameters():
        g = sum(r["grads"][name] for r in res)
        assert_close(f"grad of {name}", p.grad.float().cpu(), g, GRAD_TOL)
