"""KDA layer and LM: shapes, gate bounds, input checks, and exactness under CP over gloo."""

from __future__ import annotations

import re
import warnings

import pytest
import torch

from kda_cp import chunk_kda
from kda_cp.layers import KDAConfig, KDALayer
from kda_cp.model import KDALanguageModel, ModelConfig
from kda_cp.parallel import CPContext, parallelize

from tests._dist import run_ranks
from tests._utils import perturbed

CFG = dict(d_model=32, num_heads=2, head_dim=16, chunk_size=16)


def test_layer_shapes_and_gate():
    layer = KDALayer(KDAConfig(**CFG))
    x = torch.randn(3, 37, 32)
    y = layer(x)
    assert y.shape == x.shape and y.dtype == x.dtype and torch.isfinite(y).all()
    g = layer.gate(x)
    assert g.shape == (3, 37, 2, 16) and g.dtype == torch.float32
    assert (g < 0).all() and (g > -5).all()
    assert g.std(dim=-1).min() > 0  # per-channel, not one scalar per head
    y.square().mean().backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in layer.parameters())


def test_softplus_gate_layer():
    """g_min=None: the released Kimi Linear gate, unbounded below (A_log = log 16 pushes g past -5),
    initialised to the same decay range as the bounded one."""
    layer = KDALayer(KDAConfig(**{**CFG, "g_min": None}))
    x = torch.randn(2, 37, 32)
    g0 = layer.gate(torch.zeros(1, 1, 32))
    assert (-g0 >= 0.999e-3).all() and (-g0 <= 0.1001).all()
    with torch.no_grad():
        layer.A_log.fill_(torch.log(torch.tensor(16.0)))
    g = layer.gate(10 * x)
    assert (g < 0).all() and (g < -5).any()
    y = layer(x)
    y.square().mean().backward()
    assert torch.isfinite(y).all() and all(torch.isfinite(p.grad).all() for p in layer.parameters())
    with pytest.raises(ValueError, match=r"g_min must be in \[-5, 0\) or None"):
        KDAConfig(**{**CFG, "g_min": -6.0})


def test_layer_is_causal():
    torch.manual_seed(0)
    layer = perturbed(KDALayer(KDAConfig(**CFG)), 1)
    x = torch.randn(2, 40, 32, dtype=torch.float64)
    y = layer(x)
    x2 = x.clone()
    x2[:, 25:] = torch.randn(2, 15, 32, dtype=torch.float64)
    y2 = layer(x2)
    torch.testing.assert_close(y2[:, :25], y[:, :25], rtol=1e-12, atol=1e-12)
    assert not torch.allclose(y2[:, 25:], y[:, 25:])


def test_layer_bad_input():
    layer = KDALayer(KDAConfig(**CFG))
    with pytest.raises(ValueError, match=r"\[B, T, d_model\]"):
        layer(torch.randn(2, 10, 31))
    with pytest.raises(TypeError, match="floating-point tensor, got list"):
        layer([[0.0] * CFG["d_model"]])
    with pytest.raises(ValueError, match="x is torch.float64 but the layer's parameters are torch.float32"):
        layer(torch.randn(1, 10, CFG["d_model"], dtype=torch.float64))
    x = torch.randn(1, 40, CFG["d_model"])
    for cu in (torch.tensor([[0, 40]]), torch.tensor(40), torch.tensor([0.0, 40.0]), [[0, 40]]):
        with pytest.raises(ValueError, match="cu_seqlens must be a 1-D integer tensor"):
            layer(x, cu_seqlens=cu)
    with pytest.raises(ValueError, match="cu_seqlens must not decrease"):
        layer(x, cu_seqlens=torch.tensor([0, 30, 20, 40]))
    with pytest.raises(ValueError, match="cu_seqlens must hold its offsets .* got a meta tensor"):
        layer(x, cu_seqlens=torch.tensor([0, 30, 40], device="meta"))
    with pytest.raises(ValueError, match="g_min"):
        KDAConfig(g_min=-6.0)
    with pytest.raises(ValueError, match="num_v_heads must be a multiple of num_heads = 4"):
        KDAConfig(num_heads=4, num_v_heads=6)
    for bad in (100, 64.0, "on"):
        with pytest.raises(ValueError, match='KDAConfig.segment_len must be "auto", None or a positive multiple of '
                                             'chunk_size = 64'):
            KDAConfig(segment_len=bad)
    for name, bad in (("num_v_heads", "4"), ("num_heads", True), ("allow_neg_eigval", "no")):
        with pytest.raises(ValueError, match=f"KDAConfig.{name} must be an? (int|bool), got"):
            KDAConfig(**{name: bad})
    with pytest.raises(ValueError, match="input_ids"):
        KDALanguageModel(ModelConfig(d_model=32, n_layers=1, kda=KDAConfig(num_heads=2, head_dim=16)))(torch.randn(2, 5))


def test_model_shapes():
    model = KDALanguageModel(ModelConfig(d_model=32, n_layers=2, kda=KDAConfig(num_heads=2, head_dim=16, chunk_size=16)))
    logits = model(torch.randint(0, 256, (2, 21)))
    assert logits.shape == (2, 21, 256)
    assert model.head.weight is model.embed.weight
    untied = KDALanguageModel(ModelConfig(d_model=32, n_layers=1, kda=KDAConfig(num_heads=2, head_dim=16), tie_embeddings=False))
    assert untied.head.weight is not untied.embed.weight


def _layer_body(rank, world_size, state, x, dy, lengths, cu=None, cfg=CFG):
    import torch.distributed as dist

    torch.manual_seed(0)
    layer = KDALayer(KDAConfig(**cfg)).double()
    layer.load_state_dict(state)
    start = sum(lengths[:rank])
    sl = slice(start, start + lengths[rank])
    x_r = x[:, sl].clone().requires_grad_(True)
    y_r = parallelize(layer, CPContext(dist.group.WORLD))(x_r, cu_seqlens=cu)
    (y_r * dy[:, sl]).sum().backward()
    return {"y": y_r.detach(), "dx": x_r.grad, "grads": {n: p.grad for n, p in layer.named_parameters()}}


SOFTPLUS = {**CFG, "g_min": None}  # Kimi Linear's unbounded gate g = -exp(A_log) * softplus(.)
GVA = {**CFG, "num_v_heads": 4}  # two value heads per key head
NEG = {**CFG, "num_v_heads": 4, "allow_neg_eigval": True, "g_min": None}  # beta in [0, 2], softplus gate
SEG = {**CFG, "segment_len": 16}  # each rank's shard cut into segments of one chunk


@pytest.mark.parametrize("lengths,cu,cfg", [
    ([29, 21], None, CFG), ([10, 25, 15], None, CFG),
    # packed sequences crossing rank boundaries, one starting 1 and 2 tokens before a shard (inside the conv halo)
    ([29, 21], [0, 3, 27, 50], CFG), ([10, 25, 15], [0, 9, 12, 33, 34, 50], CFG),
    ([13, 12, 14, 11], [0, 11, 12, 37, 50], CFG),
    ([20, 2, 1, 27], [0, 21, 22, 50], CFG),  # shards shorter than the conv's halo of 3 rows
    ([10, 25, 15], [0, 9, 12, 33, 34, 50], SOFTPLUS), ([13, 12, 14, 11], None, SOFTPLUS),
    ([10, 25, 15], [0, 9, 12, 33, 34, 50], GVA), ([29, 21], None, GVA), ([13, 12, 14, 11], [0, 11, 12, 37, 50], NEG),
    ([40, 35], [0, 9, 12, 50, 75], SEG),
    ([10, 25, 15], [0, 0, 9, 9, 10, 35, 35, 50, 50], CFG),  # empty sequences, also on shard edges
], ids=["p2-uneven", "p3-uneven", "p2-packed", "p3-packed", "p4-packed", "p4-short-shards", "p3-packed-softplus",
        "p4-softplus", "p3-packed-gva", "p2-gva", "p4-packed-gva-neg-eigval-softplus", "p2-packed-segments",
        "p3-packed-empty-sequences"])
def test_layer_cp_matches_unsharded(lengths, cu, cfg):
    torch.manual_seed(0)
    layer = perturbed(KDALayer(KDAConfig(**cfg)), 7)
    T = sum(lengths)
    B = 1 if cu else 2
    x = torch.randn(B, T, 32, dtype=torch.float64, requires_grad=True)
    dy = torch.randn(B, T, 32, dtype=torch.float64)
    y = layer(x, cu_seqlens=None if cu is None else torch.tensor(cu))
    (y * dy).sum().backward()
    state = {k: v.detach().clone() for k, v in layer.state_dict().items()}

    res = run_ranks(_layer_body, len(lengths), state, x.detach(), dy, lengths, cu, cfg)
    torch.testing.assert_close(torch.cat([r["y"] for r in res], 1), y.detach(), rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(torch.cat([r["dx"] for r in res], 1), x.grad, rtol=1e-10, atol=1e-10)
    for name, p in layer.named_parameters():
        got = sum(r["grads"][name] for r in res)
        torch.testing.assert_close(got, p.grad, rtol=1e-9, atol=1e-10, msg=lambda m: f"grad of {name}: {m}")


MODEL_CFG = dict(d_model=32, n_layers=2, kda=KDAConfig(num_heads=2, head_dim=16, chunk_size=16))


def _model_body(rank, world_size, state, ids, dlogits):
    import torch.distributed as dist

    from kda_cp.parallel.sharding import shard_sequence

    model = KDALanguageModel(ModelConfig(**MODEL_CFG)).double()
    model.load_state_dict(state)
    group = dist.group.WORLD
    logits = parallelize(model, CPContext(group))(shard_sequence(ids, group))
    (logits * shard_sequence(dlogits, group)).sum().backward()
    return {"logits": logits.detach(), "grads": {n: p.grad for n, p in model.named_parameters()}}


def test_model_cp2_matches_unsharded():
    torch.manual_seed(0)
    model = perturbed(KDALanguageModel(ModelConfig(**MODEL_CFG)), 3)
    ids = torch.randint(0, 256, (2, 45))
    dlogits = torch.randn(2, 45, 256, dtype=torch.float64)
    logits = model(ids)
    (logits * dlogits).sum().backward()
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}

    res = run_ranks(_model_body, 2, state, ids, dlogits)
    torch.testing.assert_close(torch.cat([r["logits"] for r in res], 1), logits.detach(), rtol=1e-10, atol=1e-10)
    for name, p in model.named_parameters():
        got = sum(r["grads"][name] for r in res)
        torch.testing.assert_close(got, p.grad, rtol=1e-9, atol=1e-10, msg=lambda m: f"grad of {name}: {m}")


def _bad_cp_rank(rank, world_size, case):
    import torch.distributed as dist

    from kda_cp.layers import AttentionConfig, AttentionLayer

    torch.manual_seed(0)
    group = dist.group.WORLD
    T = {"empty-shard": [5, 0]}.get(case, [6, 6])[rank]
    B = 2 if case in ("batch", "attention-batch") and rank == 1 else 1
    x = torch.randn(B, T, 32)
    try:
        if case == "model-ids":  # a local check that used to leave rank 0 waiting in the first layer
            model = parallelize(KDALanguageModel(ModelConfig(d_model=32, n_layers=2, layer_pattern="AK",
                                                             kda=KDAConfig(num_heads=2, head_dim=16))),
                                CPContext(group))
            ids = torch.randint(0, 256, (1, 6))
            ids[0, 0] = 300 if rank == 1 else 0
            model(ids)
        elif case == "attention-batch":  # rank 1's batch of 2 used to abort gloo's all-gather (SIGABRT)
            parallelize(AttentionLayer(AttentionConfig(d_model=32, num_heads=2, head_dim=16)), CPContext(group))(x)
        else:
            layer = parallelize(KDALayer(KDAConfig(**CFG)), CPContext(group))
            if case == "dtype":
                x = x.double() if rank == 1 else x
            cu = torch.tensor([0, 3, 12]) if case == "cu-one-rank" and rank == 1 else None
            layer(x, cu_seqlens=cu)
    except ValueError as exc:
        return str(exc)
    return "no error"


@pytest.mark.parametrize("case,patterns", [
    ("empty-shard", [r"rank\(s\) \[1\] of the cp_group rejected", "at least 1 token"]),
    ("batch", ["ranks disagree on", "ranks disagree on"]),
    ("dtype", [r"rank\(s\) \[1\] of the cp_group rejected", "x is torch.float64 but the layer's parameters"]),
    ("cu-one-rank", ["ranks disagree on", "ranks disagree on"]),
    ("model-ids", [r"KDALanguageModel: rank\(s\) \[1\]", r"input_ids must lie in \[0, vocab_size\)"]),
    ("attention-batch", ["AttentionLayer: ranks disagree on", "AttentionLayer: ranks disagree on"]),
])
def test_layer_bad_shards_raise_on_every_rank(case, patterns):
    for rank, (msg, pattern) in enumerate(zip(run_ranks(_bad_cp_rank, 2, case, timeout=90), patterns)):
        assert re.search(pattern, msg), f"rank {rank}: {msg}"


def _pickled_rank(rank, world_size):
    import io

    import torch.distributed as dist

    torch.manual_seed(0)
    model = parallelize(KDALanguageModel(ModelConfig(d_model=32, n_layers=1, kda=KDAConfig(num_heads=2, head_dim=16))),
                        CPContext(dist.group.WORLD))
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    ids = torch.randint(0, 256, (1, 8))
    try:
        loaded(ids)
        return "no error"
    except ValueError as exc:
        msg = str(exc)
    parallelize(loaded, CPContext(dist.group.WORLD))
    return msg, (loaded(ids) - model(ids)).abs().max().item()


def test_a_pickled_parallelized_model_refuses_to_run_unsharded():
    """A process group does not pickle: the loaded model used to run its shard as a whole sequence
    (a silently wrong answer); it raises until parallelize is called again, then equals the original."""
    for msg, diff in run_ranks(_pickled_rank, 2, timeout=90):
        assert "parallelized when it was pickled" in msg and diff == 0.0


def test_a_single_token_through_the_layer_does_not_warn_of_the_layout():
    """The layer builds q as [B, T, H, K] itself: T = 1 < H is no head-first mistake. A direct
    chunk_kda call with T < H still warns."""
    from kda_cp import ops

    torch.manual_seed(0)
    layer = KDALayer(KDAConfig(d_model=32, num_heads=4, head_dim=8, backend="torch"))
    ops._warn_once.cache_clear()
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="chunk_kda got q with T < H")
        y = layer(torch.randn(2, 1, 32))
    assert y.shape == (2, 1, 32) and torch.isfinite(y).all()
    q = torch.randn(1, 1, 4, 8)
    with pytest.warns(UserWarning, match=r"chunk_kda got q with T < H"):
        chunk_kda(q, q, q, -torch.rand(1, 1, 4, 8), torch.rand(1, 1, 4), backend="torch")


def test_layer_empty_sequence():
    layer = KDALayer(KDAConfig(**CFG))
    x = torch.randn(2, 0, 32, requires_grad=True)
    y = layer(x)
    assert y.shape == (2, 0, 32)
    y.sum().backward()
    assert x.grad.shape == x.shape and all(p.grad is None or torch.count_nonzero(p.grad) == 0
                                           for p in layer.parameters())


def test_layer_empty_sequence_with_a_low_rank_output_gate():
    """The fla / Kimi Linear layouts have a low-rank output gate; T = 0 still gives [B, 0, D]."""
    layer = KDALayer(KDAConfig(**CFG, output_gate_rank=4))
    x = torch.randn(1, 0, CFG["d_model"], requires_grad=True)
    y = layer(x)
    assert y.shape == (1, 0, CFG["d_model"])
    y.sum().backward()
    assert x.grad.shape == x.shape


@pytest.mark.parametrize("make, kw, pattern", [
    ("model", dict(n_layers=2.0), "ModelConfig.n_layers must be an int >= 1, got 2.0"),
    ("model", dict(vocab_size="256"), "ModelConfig.vocab_size must be an int >= 1"),
    ("model", dict(tie_embeddings="no"), "ModelConfig.tie_embeddings must be a bool"),
    ("model", dict(norm_eps=0), "ModelConfig.norm_eps must be a number > 0 and finite"),
    ("attention", dict(d_model="32"), "AttentionConfig.d_model must be an int >= 1"),
    ("kda", dict(norm_eps=float("inf")), "KDAConfig.norm_eps must be > 0 and finite"),
])
def test_configs_name_the_bad_field(make, kw, pattern):
    """Each config names its own field (a float layer count used to fail in the model's construction,
    "no" to tie the embeddings to read as true, norm_eps=inf to zero the layer's output)."""
    from kda_cp.layers import AttentionConfig

    cls = {"model": ModelConfig, "attention": AttentionConfig, "kda": KDAConfig}[make]
    with pytest.raises(ValueError, match=pattern):
        cls(**kw)


@pytest.mark.parametrize("kw, pattern", [
    (dict(g_min=None, decay_init_max=100.0), "decay_init_max = 100.0 give an initial gate bias .* below 88"),
    (dict(decay_init_min=4.9999999, decay_init_max=4.9999999), "stay below -g_min = 5.0 in fp32"),
    (dict(g_min="x"), "KDAConfig.g_min must be a number or None, got 'x'"),
    (dict(norm_eps="1e-6"), "KDAConfig.norm_eps must be a number, got '1e-6'"),
])
def test_config_refuses_an_initial_gate_that_is_not_finite(kw, pattern):
    """An infinite initial gate bias gives a finite g but NaN gradients in A_log at the first step."""
    with pytest.raises(ValueError, match=pattern):
        KDAConfig(**{**CFG, **kw})
    near = KDALayer(KDAConfig(**{**CFG, "g_min": None, "decay_init_max": 80.0}))  # near the limit
    assert torch.isfinite(near.g_up.bias).all()


def test_fp64_layer_under_cpu_autocast_stays_fp64():
    """Autocast leaves fp64 alone (torch casts only other floating dtypes): an fp64 layer under a
    bf16 autocast region gives exactly its result outside it; an fp32 one returns bf16, as
    nn.Linear does."""
    layer = KDALayer(KDAConfig(d_model=16, num_heads=2, head_dim=8)).double()
    x = torch.randn(1, 10, 16, dtype=torch.float64)
    ref = layer(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = layer(x)
        y32 = KDALayer(KDAConfig(d_model=16, num_heads=2, head_dim=8))(x.float())
    assert y.dtype == torch.float64 and torch.equal(y, ref)
    assert y32.dtype == torch.bfloat16
