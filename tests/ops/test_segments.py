"""chunk_kda(segment_len=...): every sequence cut into segments run as parallel chains joined by a
scan of their affine maps (kda_cp.parallel.segments), against the fp64 per-token recurrence:
dense and packed, initial and final states, T not a multiple of the chunk or the segment, every
gradient. Fresh random inputs per case (fp64, torch backend)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kda_cp import chunk_kda, naive_recurrent_kda
from kda_cp.ops import ChunkKDAFunction, KDAOptions, get_backend, segmented
from kda_cp.parallel import segments
from kda_cp.parallel.segments import SegmentedBackend, auto_segment_len, segment_plan

from tests._utils import assert_close, make_inputs

NAMES = ("o", "final_state", "dq", "dk", "dv", "dg", "dbeta", "dh0")


def _run(fn, q, k, v, g, beta, h0, do, dht, cu):
    leaves = [x.clone().requires_grad_(True) for x in (q, k, v, g, beta, h0)]
    o, ht = fn(*leaves[:5], initial_state=leaves[5], output_final_state=True, cu_seqlens=cu)
    return [o, ht, *torch.autograd.grad((o, ht), leaves, (do, dht))]


@pytest.mark.parametrize("B,T,cu,L", [
    (2, 77, None, 16),  # 5 segments per sequence, the last one 13 tokens
    (1, 150, None, 32),
    (1, 150, [0, 40, 41, 41, 150], 16),  # packed: a 1-token and an empty sequence among long ones
    (1, 93, [0, 16, 93], 48),  # a sequence exactly one segment long
    (1, 100, [0, 40, 100], 32),  # packed, both sequences two segments (the chains run by depth)
], ids=["dense-B2", "dense-B1", "packed", "packed-one-segment", "packed-regular"])
def test_segments_match_the_recurrence(B, T, cu, L):
    H, K, V = 2, 8, 6
    n = B if cu is None else len(cu) - 1
    q, k, v, g, beta, _ = make_inputs(B, T, H, K, V, seed=T + L)
    gen = torch.Generator().manual_seed(T * L)
    h0 = torch.randn(n, H, K, V, generator=gen, dtype=torch.float64)
    do = torch.randn(B, T, H, V, generator=gen, dtype=torch.float64)
    dht = torch.randn(n, H, K, V, generator=gen, dtype=torch.float64)
    cu_t = None if cu is None else torch.tensor(cu)
    want = _run(naive_recurrent_kda, q, k, v, g, beta, h0, do, dht, cu_t)

    def split(*a, **kw):
        return chunk_kda(*a, **kw, chunk_size=16, segment_len=L)

    got = _run(split, q, k, v, g, beta, h0, do, dht, cu_t)
    for name, w, x in zip(NAMES, want, got):
        assert_close(name, w, x, 1e-10)


@pytest.mark.parametrize("g_min", [-5.0, None], ids=["bounded", "general"])
def test_segments_on_the_chunk_grid_equal_the_unsplit_op(g_min):
    """Cuts on the chunk grid change only the order of fp arithmetic: the split equals the plain
    chunked op to rounding, initial and final states and every gradient included; with the bounded
    gate and with general gates (g_min=None: steps below -20 next to slow channels)."""
    B, T, H, K, V = 1, 200, 2, 8, 8  # segments of 64, 64, 64 and 8 tokens
    q, k, v, g, beta, _ = make_inputs(B, T, H, K, V, seed=5 if g_min is not None else 6)
    gen = torch.Generator().manual_seed(55 if g_min is not None else 66)
    if g_min is None:
        g = -40.0 * torch.rand(B, T, H, K, generator=gen, dtype=torch.float64)
        g[..., :2] = -1e-3 * (0.5 + torch.rand(B, T, H, 2, generator=gen, dtype=torch.float64))
        assert g.min() < -20
    h0 = torch.randn(B, H, K, V, generator=gen, dtype=torch.float64)
    do = torch.randn(B, T, H, V, generator=gen, dtype=torch.float64)
    dht = torch.randn(B, H, K, V, generator=gen, dtype=torch.float64)

    def op(L):
        return lambda *a, **kw: chunk_kda(*a, **kw, chunk_size=16, segment_len=L, g_min=g_min)

    plain = _run(op(None), q, k, v, g, beta, h0, do, dht, None)
    split = _run(op(64), q, k, v, g, beta, h0, do, dht, None)
    for name, a, b in zip(NAMES, plain, split):
        assert_close(name, a, b, 1e-12)


def test_plan_and_bad_segment_len():
    plan = segment_plan((0, 40, 41, 41, 150), 16)
    assert plan.cu == (0, 16, 32, 40, 41, 41, 57, 73, 89, 105, 121, 137, 150)
    assert plan.first == (0, 3, 4, 5) and plan.last == (2, 3, 4, 11)
    assert plan.steps[0] == ((0, 5), (1, 6)) and plan.steps[-1] == ((10,), (11,))
    assert plan.per_sequence == 0  # 3, 1, 1 and 7 segments: chains by index
    assert segment_plan((0, 77, 154), 16).per_sequence == 5  # dense rows: chains by depth
    q, k, v, g, beta, _ = make_inputs(1, 20, 1, 4, 4, seed=1)
    for bad in (0, 24, 16.0, True, "always"):
        with pytest.raises(ValueError, match='segment_len must be "auto", None or a positive multiple of chunk_size = 16'):
            chunk_kda(q, k, v, g, beta, chunk_size=16, segment_len=bad)


def test_auto_rule_splits_only_few_long_chains():
    """segment_len="auto": a split for few (sequence, value head) chains over long sequences only."""
    L = segments.AUTO_SEGMENT_LEN
    assert auto_segment_len((0, 65536), 8, 128) == L  # B=1, H=8, T=64k
    assert auto_segment_len((0, 131072), 4, 128) == L
    assert auto_segment_len((0, 100, 70000), 4, 128) == L  # packed: 2 sequences x 4 heads, one long
    assert auto_segment_len((0, 65536), 16, 64) == L  # the same walk blocks with half the columns
    assert auto_segment_len((0, 65536), 16, 128) is None  # enough chains
    assert auto_segment_len((0, 65536, 131072), 8, 128) is None  # two rows: 16 chains
    assert auto_segment_len((0, 32768), 8, 128) is None  # too short to pay for the summary pass
    assert auto_segment_len((0, 0), 1, 128) is None and auto_segment_len((0,), 1, 128) is None
    assert auto_segment_len((0, 0, 0, 70000, 70000), 8, 128) == L  # empty sequences run no chain


def test_auto_is_off_on_the_torch_backend():
    q, k, v, g, beta, _ = make_inputs(1, 20, 1, 4, 4, seed=2)
    impl = get_backend("torch", q, k, v, g, beta)
    assert segmented(impl, "auto", 64) is impl and segmented(impl, None, 64) is impl
    assert isinstance(segmented(impl, 64, 64), SegmentedBackend)


@pytest.mark.parametrize("T,cu,splits", [
    (150, None, True), (40, None, False),  # long enough / too short for the (lowered) thresholds
    (150, [0, 10, 150], True),  # packed: one long sequence among a short one
    (150, [0, 50, 100, 150], False),  # packed: too many chains
], ids=["dense-split", "dense-short", "packed-split", "packed-many"])
def test_auto_wrapper_matches_the_recurrence(monkeypatch, T, cu, splits):
    """The "auto" wrapper (as the TileLang backend gets it) on the torch backend with the thresholds
    lowered to these sizes: it splits where the rule says and equals the fp64 recurrence either way."""
    monkeypatch.setattr(segments, "AUTO_SEGMENT_LEN", 32)
    monkeypatch.setattr(segments, "AUTO_MIN_TOKENS", 100)
    monkeypatch.setattr(segments, "AUTO_MAX_COLUMNS", 2 * 2 * 6)
    H, K, V = 2, 8, 6
    n = 1 if cu is None else len(cu) - 1
    q, k, v, g, beta, _ = make_inputs(1, T, H, K, V, seed=T + n)
    gen = torch.Generator().manual_seed(T * n)
    h0 = torch.randn(n, H, K, V, generator=gen, dtype=torch.float64)
    do = torch.randn(1, T, H, V, generator=gen, dtype=torch.float64)
    dht = torch.randn(n, H, K, V, generator=gen, dtype=torch.float64)
    cu_t = None if cu is None else torch.tensor(cu)
    opts = KDAOptions(scale=K**-0.5, chunk_size=16, output_final_state=True)
    auto = SegmentedBackend(get_backend("torch", q, k, v, g, beta), "auto")
    assert (auto._plan(q, v, cu_t, opts) is not None) == splits
    assert auto._plan(q, v, cu_t, dataclasses.replace(opts, g_min=None)) is None  # the general gate: unsplit

    def run(*a, initial_state, output_final_state, cu_seqlens):
        return ChunkKDAFunction.apply(*a, initial_state, cu_seqlens, auto, opts)

    want = _run(naive_recurrent_kda, q, k, v, g, beta, h0, do, dht, cu_t)
    got = _run(run, q, k, v, g, beta, h0, do, dht, cu_t)
    for name, w, x in zip(NAMES, want, got):
        assert_close(name, w, x, 1e-10)


def _cp_rank(rank, world, inputs, lengths, cu, L):
    import torch.distributed as dist

    from kda_cp.parallel import cp_chunk_kda, split_sequence

    q, k, v, g, beta, h0, do, dht = inputs
    local = [split_sequence(x, world, 1, lengths)[rank].clone().requires_grad_(True) for x in (q, k, v, g, beta)]
    h = h0.clone().requires_grad_(True)
    o, ht = cp_chunk_kda(*local, cp_group=dist.group.WORLD, initial_state=h, output_final_state=True,
                         cu_seqlens=cu, chunk_size=16, segment_len=L[rank])
    grads = torch.autograd.grad((o, ht), [*local, h], (split_sequence(do, world, 1, lengths)[rank], dht / world))
    return [o.detach(), ht.detach(), *grads]


@pytest.mark.parametrize("lengths,cu,L", [
    ([70, 61], None, [16, 32]),
    ([40, 57, 33], [0, 20, 21, 100, 130], [16, 48, 16]),  # packed sequences crossing rank boundaries
], ids=["p2-dense", "p3-packed"])
def test_each_cp_rank_splits_its_shard(lengths, cu, L):
    from tests._dist import run_ranks

    T, H, K, V = sum(lengths), 2, 8, 6
    n = 1 if cu is None else len(cu) - 1
    q, k, v, g, beta, _ = make_inputs(1, T, H, K, V, seed=T)
    gen = torch.Generator().manual_seed(len(lengths))
    h0 = torch.randn(n, H, K, V, generator=gen, dtype=torch.float64)
    do = torch.randn(1, T, H, V, generator=gen, dtype=torch.float64)
    dht = torch.randn(n, H, K, V, generator=gen, dtype=torch.float64)
    cu_t = None if cu is None else torch.tensor(cu)
    want = _run(naive_recurrent_kda, q, k, v, g, beta, h0, do, dht, cu_t)
    res = run_ranks(_cp_rank, len(lengths), (q, k, v, g, beta, h0, do, dht), lengths, cu_t, L)
    got = [torch.cat([r[0] for r in res], 1), res[0][1],
           *(torch.cat([r[2 + i] for r in res], 1) for i in range(5)), res[0][7]]  # dh0: full on every rank
    for name, w, x in zip(NAMES, want, got):
        assert_close(name, w, x, 1e-10)


def test_a_backend_that_keeps_tensors_for_the_backward():
    """The forward's kept tensors (the TileLang backend keeps part of its chunk-local ones) pass
    through the split's keep/restore: a torch backend that keeps a marker and re-prepares."""
    from kda_cp.ops import ChunkKDAFunction, KDAOptions, TorchBackend
    from kda_cp.parallel.segments import SegmentedBackend

    class Keeping(TorchBackend):
        restored = 0

        def keep_for_backward(self, prepared):
            return (torch.ones(1),)

        def restore_prepared(self, q, k, v, g, beta, kept, opts, cu_seqlens=None):
            assert cu_seqlens is not None and q.shape[0] == 1 and torch.equal(kept[0], torch.ones(1))
            Keeping.restored += 1
            return self.prepare(q, k, v, g, beta, opts, cu_seqlens)

    q, k, v, g, beta, _ = make_inputs(2, 70, 2, 8, 6, seed=2)
    h0 = torch.randn(2, 2, 8, 6, dtype=torch.float64)
    do, dht = torch.randn(2, 70, 2, 6, dtype=torch.float64), torch.randn(2, 2, 8, 6, dtype=torch.float64)
    want = _run(naive_recurrent_kda, q, k, v, g, beta, h0, do, dht, None)
    opts = KDAOptions(scale=8 ** -0.5, chunk_size=16, output_final_state=True)

    def split(q, k, v, g, beta, initial_state, output_final_state, cu_seqlens):
        return ChunkKDAFunction.apply(q, k, v, g, beta, initial_state, cu_seqlens, SegmentedBackend(Keeping(), 32), opts)

    got = _run(split, q, k, v, g, beta, h0, do, dht, None)
    assert Keeping.restored == 1
    for name, w, x in zip(NAMES, want, got):
        assert_close(name, w, x, 1e-10)


def test_the_chain_runs_in_the_compute_dtype_and_empty_inputs_pass_through():
    """An fp32 initial_state with fp64 inputs: the segment chain stays fp64 (as the unsplit op);
    no tokens: the split runs the op unsplit."""
    q, k, v, g, beta, _ = make_inputs(1, 100, 2, 8, 6, seed=8)
    h0 = torch.randn(1, 2, 8, 6, generator=torch.Generator().manual_seed(8))  # fp32
    plain = chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True, chunk_size=16)
    split = chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True, chunk_size=16, segment_len=32)
    for name, a, b in zip(("o", "final_state"), plain, split):
        assert_close(name, a, b, 1e-12)
    empty = [x[:, :0] for x in (q, k, v, g, beta)]
    o, ht = chunk_kda(*empty, initial_state=h0.double(), output_final_state=True, chunk_size=16, segment_len=32)
    assert o.shape == (1, 0, 2, 6) and torch.equal(ht, h0.double())


def test_ulysses_refuses_a_bad_segment_len_on_every_rank_before_the_exchange():
    from tests._dist import run_ranks

    errs = run_ranks(_ulysses_bad_rank, 2, timeout=90)
    assert "rank(s) [1]" in errs[0] and "a positive multiple of chunk_size = 16, got 24" in errs[1], errs


def _ulysses_bad_rank(rank, world):
    import torch.distributed as dist

    from kda_cp.parallel.layers.ulysses import ulysses_kda

    q, k, v, g, beta, _ = make_inputs(1, 32, 2, 8, 8, seed=3)
    try:
        ulysses_kda(q, k, v, g, beta, cp_group=dist.group.WORLD, chunk_size=16, impl="torch",
                    segment_len=16 if rank == 0 else 24)
    except ValueError as exc:
        return str(exc)
    return "no error"


def test_expanded_initial_state_and_dht_pass_the_by_depth_chains():
    """An expanded (stride-0) h0 and a dht with zero strides go through the depth-major chains as
    through the unsplit op."""
    B, T, H, K, V = 3, 40, 2, 4, 3
    q, k, v, g, beta, _ = make_inputs(B, T, H, K, V, seed=5)
    gen = torch.Generator().manual_seed(6)
    h0 = torch.randn(1, H, K, V, generator=gen, dtype=torch.float64).expand(B, H, K, V)
    w = torch.randn(B, generator=gen, dtype=torch.float64)
    out = []
    for L in (None, 16):
        leaves = [x.clone().requires_grad_(True) for x in (q, k, v, g, beta)]
        o, ht = chunk_kda(*leaves, initial_state=h0, output_final_state=True, chunk_size=16, segment_len=L)
        loss = (o ** 2).sum() + ht.sum((1, 2, 3)).dot(w)  # dht = w[:, None, None, None].expand(...)
        out.append([o, ht, *torch.autograd.grad(loss, leaves)])
    for name, a, b in zip(("o", "ht", "dq", "dk", "dv", "dg", "dbeta"), *out):
        assert_close(name, a, b, 1e-10)
