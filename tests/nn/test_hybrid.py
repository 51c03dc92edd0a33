"""Hybrid model (KDA : attention = 3 : 1): attention under CP (K/V all-gather) exact vs unsharded, gloo."""

from __future__ import annotations

import pytest
import torch

from kda_cp.parallel import CPContext, parallelize
from kda_cp.layers import AttentionConfig, AttentionLayer, KDAConfig
from kda_cp.model import KDALanguageModel, ModelConfig
from kda_cp.parallel.layers.attention import causal_attention, cp_attention

from tests._dist import run_ranks
from tests._utils import perturbed


def test_causal_attention_matches_masked_softmax():
    torch.manual_seed(0)
    B, L, H, D, off = 2, 7, 3, 5, 6
    q = torch.randn(B, L, H, D, dtype=torch.float64)
    k = torch.randn(B, off + L, H, D, dtype=torch.float64)
    v = torch.randn(B, off + L, H, D, dtype=torch.float64)
    o = causal_attention(q, k, v, off)
    s = torch.einsum("blhd,bshd->bhls", q, k) * D**-0.5
    allowed = torch.arange(off + L)[None, :] <= (off + torch.arange(L))[:, None]
    p = s.masked_fill(~allowed, float("-inf")).softmax(-1)
    torch.testing.assert_close(o, torch.einsum("bhls,bshd->blhd", p, v), rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match="keys must cover"):
        causal_attention(q, k[:, :-1], v[:, :-1], off)


def _attn_body(rank, world_size, q, k, v, do, lengths):
    import torch.distributed as dist

    start = sum(lengths[:rank])
    sl = slice(start, start + lengths[rank])
    q_r, k_r, v_r = (t[:, sl].clone().requires_grad_(True) for t in (q, k, v))
    o_r = cp_attention(q_r, k_r, v_r, cp_group=dist.group.WORLD)
    (o_r * do[:, sl]).sum().backward()
    return {"o": o_r.detach(), "dq": q_r.grad, "dk": k_r.grad, "dv": v_r.grad}


def _attn_layer_body(rank, world_size, state, x, dy, lengths, cu):
    import torch.distributed as dist

    layer = AttentionLayer(AttentionConfig(d_model=16, num_heads=2, head_dim=8)).double()
    layer.load_state_dict(state)
    start = sum(lengths[:rank])
    x_r = x[:, start:start + lengths[rank]].clone().requires_grad_(True)
    y_r = parallelize(layer, CPContext(dist.group.WORLD))(x_r, cu_seqlens=cu)
    (y_r * dy[:, start:start + lengths[rank]]).sum().backward()
    return {"y": y_r.detach(), "dx": x_r.grad, "grads": {n: p.grad for n, p in layer.named_parameters()}}


def test_packed_attention_layer_with_an_empty_shard_matches_unsharded():
    """A rank holding no token still joins the K/V exchange's backward: no hang, exact result."""
    torch.manual_seed(2)
    layer = perturbed(AttentionLayer(AttentionConfig(d_model=16, num_heads=2, head_dim=8)).double(), 2)
    lengths, cu = [0, 12, 12], [0, 4, 4, 24]
    x = torch.randn(1, 24, 16, dtype=torch.float64, requires_grad=True)
    dy = torch.randn(1, 24, 16, dtype=torch.float64)
    y = layer(x, cu_seqlens=cu)
    (y * dy).sum().backward()
    state = {k: v.detach().clone() for k, v in layer.state_dict().items()}
    res = run_ranks(_attn_layer_body, 3, state, x.detach(), dy, lengths, cu, timeout=120)
    torch.testing.assert_close(torch.cat([r["y"] for r in res], 1), y.detach(), rtol=1e-11, atol=1e-11)
    torch.testing.assert_close(torch.cat([r["dx"] for r in res], 1), x.grad, rtol=1e-11, atol=1e-11)
    for name, p in layer.named_parameters():
        torch.testing.assert_close(sum(r["grads"][name] for r in res), p.grad, rtol=1e-10, atol=1e-11)
    assert layer(torch.randn(1, 0, 16, dtype=torch.float64), cu_seqlens=[0, 0]).shape == (1, 0, 16)


@pytest.mark.parametrize("lengths", [[13, 19], [9, 20, 4], [0, 11, 7]], ids=["p2-uneven", "p3-uneven", "p3-empty-first"])
def test_cp_attention_matches_unsharded(lengths):
    torch.manual_seed(1)
    B, H, D = 2, 3, 8
    T = sum(lengths)
    q, k, v = (torch.randn(B, T, H, D, dtype=torch.float64, requires_grad=True) for _ in range(3))
    do = torch.randn(B, T, H, D, dtype=torch.float64)
    o = cp_attention(q, k, v)
    (o * do).sum().backward()
    res = run_ranks(_attn_body, len(lengths), q.detach(), k.detach(), v.detach(), do, lengths)
    for name, ref in [("o", o.detach()), ("dq", q.grad), ("dk", k.grad), ("dv", v.grad)]:
        got = torch.cat([r[name] for r in res], 1)
        torch.testing.assert_close(got, ref, rtol=1e-11, atol=1e-11, msg=lambda m: f"{name}: {m}")


HYBRID = dict(d_model=32, n_layers=4, layer_pattern="KKKA", kda=KDAConfig(num_heads=2, head_dim=16, chunk_size=16),
              attention=AttentionConfig(num_heads=2, head_dim=16))


def _hybrid_body(rank, world_size, state, ids, dlogits, lengths, cu_seqlens=None):
    import torch.distributed as dist

    model = KDALanguageModel(ModelConfig(**HYBRID)).double()
    model.load_state_dict(state)
    start = sum(lengths[:rank])
    sl = slice(start, start + lengths[rank])
    parallelize(model, CPContext(dist.group.WORLD))
    logits = model(ids[:, sl], cu_seqlens=cu_seqlens)
    (logits * dlogits[:, sl]).sum().backward()
    return {"logits": logits.detach(), "grads": {n: p.grad for n, p in model.named_parameters()}}


@pytest.mark.parametrize("lengths", [[23, 18], [10, 17, 14]], ids=["p2-uneven", "p3-uneven"])
def test_hybrid_model_cp_matches_unsharded(lengths):
    torch.manual_seed(0)
    model = perturbed(KDALanguageModel(ModelConfig(**HYBRID)), 5)
    assert [b.mixer for b in model.blocks] == ["K", "K", "K", "A"]
    T = sum(lengths)
    ids = torch.randint(0, 256, (2, T))
    dlogits = torch.randn(2, T, 256, dtype=torch.float64)
    logits = model(ids)
    (logits * dlogits).sum().backward()
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    _assert_ranks_match(run_ranks(_hybrid_body, len(lengths), state, ids, dlogits, lengths), logits, model)


def _assert_ranks_match(res, logits, model):
    """The ranks' logits, concatenated, and their gradients, summed, equal the unsharded model's."""
    torch.testing.assert_close(torch.cat([r["logits"] for r in res], 1), logits.detach(), rtol=1e-10, atol=1e-10)
    for name, p in model.named_parameters():
        got = sum(r["grads"][name] for r in res)
        torch.testing.assert_close(got, p.grad, rtol=1e-9, atol=1e-10, msg=lambda m: f"grad of {name}: {m}")


def test_attention_layer_is_causal_and_checks_input():
    torch.manual_seed(0)
    layer = AttentionLayer(AttentionConfig(d_model=16, num_heads=2, head_dim=8)).double()
    x = torch.randn(2, 12, 16, dtype=torch.float64)
    x2 = x.clone()
    x2[:, 8:] = torch.randn(2, 4, 16, dtype=torch.float64)
    torch.testing.assert_close(layer(x2)[:, :8], layer(x)[:, :8], rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match="d_model"):
        layer(torch.randn(2, 5, 15))
    with pytest.raises(ValueError, match="layer_pattern"):
        ModelConfig(layer_pattern="KXA")


def test_model_rejects_token_ids_outside_the_vocabulary():
    model = KDALanguageModel(ModelConfig(**{**HYBRID, "vocab_size": 50}))
    ids = torch.randint(0, 50, (1, 20))
    assert model(ids).shape == (1, 20, 50)
    for bad in (50, -1):
        ids_bad = ids.clone()
        ids_bad[0, 7] = bad
        with pytest.raises(ValueError, match=r"input_ids must lie in \[0, vocab_size\) = \[0, 50\)"):
            model(ids_bad)


PACKED = [0, 0, 9, 10, 26, 26, 41]  # empty sequences, a 1-token one, sequences across shard edges


def _packed_model_step(seed):
    """A perturbed fp64 hybrid, packed ids and a logits gradient; the model has run forward and
    backward on them with cu_seqlens=PACKED. Returns (model, ids, dlogits, logits)."""
    torch.manual_seed(0)
    model = perturbed(KDALanguageModel(ModelConfig(**HYBRID)), seed)
    ids = torch.randint(0, 256, (1, PACKED[-1]))
    dlogits = torch.randn(1, PACKED[-1], 256, dtype=torch.float64)
    logits = model(ids, cu_seqlens=torch.tensor(PACKED))
    (logits * dlogits).sum().backward()
    return model, ids, dlogits, logits


def test_packed_hybrid_equals_its_sequences_run_apart():
    """cu_seqlens through the model: the logits and every parameter gradient equal those of each
    sequence run on its own (KDA restarts from a zero state, attention stays in the sequence)."""
    model, ids, dlogits, logits = _packed_model_step(6)
    packed_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    apart = []
    for s, e in zip(PACKED[:-1], PACKED[1:]):
        if e > s:
            out = model(ids[:, s:e])
            (out * dlogits[:, s:e]).sum().backward()
            apart.append(out.detach())
    torch.testing.assert_close(logits.detach(), torch.cat(apart, 1), rtol=1e-10, atol=1e-10)
    for name, p in model.named_parameters():
        torch.testing.assert_close(packed_grads[name], p.grad, rtol=1e-9, atol=1e-10, msg=lambda m: f"{name}: {m}")
    assert not torch.allclose(logits.detach(), model(ids).detach(), atol=1e-6)  # packing changes the result


@pytest.mark.parametrize("lengths", [[26, 15], [10, 16, 15], [9, 1, 16, 15]],
                         ids=["p2-edge-at-empty", "p3-edges-at-starts", "p4-one-token-shard"])
def test_packed_hybrid_cp_matches_unsharded(lengths):
    model, ids, dlogits, logits = _packed_model_step(7)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    _assert_ranks_match(run_ranks(_hybrid_body, len(lengths), state, ids, dlogits, lengths, PACKED), logits, model)


def test_packed_model_bad_offsets_name_what_was_expected():
    model = KDALanguageModel(ModelConfig(**HYBRID))
    ids = torch.randint(0, 256, (1, 20))
    with pytest.raises(ValueError, match=r"cu_seqlens needs B == 1"):
        model(torch.randint(0, 256, (2, 20)), cu_seqlens=[0, 20])
    with pytest.raises(ValueError, match="must not decrease"):
        model(ids, cu_seqlens=[0, 12, 5, 20])
    with pytest.raises(ValueError, match=r"cu_seqlens.* 19"):
        model(ids, cu_seqlens=[0, 12, 19])


def _ulysses_packed_rank(rank, world_size):
    import torch.distributed as dist

    model = KDALanguageModel(ModelConfig(**{**HYBRID, "n_layers": 2, "layer_pattern": "AK"}))
    parallelize(model, CPContext(dist.group.WORLD, "ulysses"))
    try:
        model(torch.randint(0, 256, (1, 8)), cu_seqlens=[0, 4, 16])
    except NotImplementedError as exc:
        return str(exc)
    return "no NotImplementedError"


def test_packed_sequences_with_ulysses_are_not_implemented_on_every_rank():
    for rank, msg in enumerate(run_ranks(_ulysses_packed_rank, 2, timeout=90)):
        assert "'ulysses' CP strategy is not supported" in msg, f"rank {rank}: {msg!r}"



@pytest.mark.parametrize("cu,B,what", [([0, 3, 9], 1, "end at the packed length T = 10"),
                                       ([2, 5, 10], 1, "start at 0"), ([0, 7, 3, 10], 1, "not decrease"),
                                       ([0, 3, 10], 2, "needs B == 1")])
def test_cp_attention_bad_offsets_name_what_was_expected(cu, B, what):
    q = torch.randn(B, 10, 2, 4)
    with pytest.raises(ValueError, match=what):
        cp_attention(q, q, q, cp_group=None, cu_seqlens=cu)
