"""chunk_kda's input checks and backend selection."""

import pytest
import torch

from kda_cp import chunk_kda
from tests._utils import make_inputs


@pytest.fixture
def inputs():
    return make_inputs(2, 20, 2, 8, 4, dtype=torch.float32, with_h0=True)


def test_g_with_scalar_gate_shape_is_rejected(inputs):
    q, k, v, g, beta, _ = inputs
    with pytest.raises(ValueError, match=r"g must be the per-channel log decay \[B, T, H, K\].*scalar gate"):
        chunk_kda(q, k, v, g[..., 0], beta)


@pytest.mark.parametrize("which", ["k", "v", "beta"])
def test_mismatched_shapes(inputs, which):
    q, k, v, g, beta, _ = inputs
    args = dict(q=q, k=k, v=v, g=g, beta=beta)
    args[which] = args[which][:, :-1]
    with pytest.raises(ValueError, match=rf"^{which} must (be|have)"):
        chunk_kda(*args.values())


def test_positive_gate(inputs):
    q, k, v, g, beta, _ = inputs
    g = g.clone()
    g[0, 3, 1, 2] = 0.1
    with pytest.raises(ValueError, match=r"g is a log decay and must be finite and <= 0"):
        chunk_kda(q, k, v, g, beta)


def test_bad_initial_state(inputs):
    q, k, v, g, beta, h0 = inputs
    with pytest.raises(ValueError, match=r"initial_state must be \[N, H, K, V\] = \[2, 2, 8, 4\]"):
        chunk_kda(q, k, v, g, beta, initial_state=h0[:, :, :, :3])


def test_bad_cu_seqlens(inputs):
    q, k, v, g, beta, _ = inputs
    one = [x[:1] for x in (q, k, v, g, beta)]
    for cu, pattern in (([0, 5, 3, 20], "must not decrease"), ([2, 5, 20], "must start at 0"),
                        ([0, 5, 19], r"end at the packed length T = 20"), ([0], "at least one sequence")):
        with pytest.raises(ValueError, match=pattern):
            chunk_kda(*one, cu_seqlens=torch.tensor(cu))
        with pytest.raises(ValueError, match=pattern):  # the same rules for a list
            chunk_kda(*one, cu_seqlens=cu)
    with pytest.raises(ValueError, match="integer tensor"):
        chunk_kda(*one, cu_seqlens=torch.tensor([0.0, 20.0]))
    with pytest.raises(ValueError, match="a sequence of ints"):
        chunk_kda(*one, cu_seqlens=[0, 7.5, 20])
    # a list is accepted and means the same as the tensor
    o_list, _ = chunk_kda(*one, cu_seqlens=[0, 7, 7, 20])
    o_tensor, _ = chunk_kda(*one, cu_seqlens=torch.tensor([0, 7, 7, 20]))
    assert torch.equal(o_list, o_tensor)
    with pytest.raises(ValueError, match="B == 1"):
        chunk_kda(q, k, v, g, beta, cu_seqlens=torch.tensor([0, 20]))


def test_bad_chunk_size_and_backend(inputs):
    q, k, v, g, beta, _ = inputs
    with pytest.raises(ValueError, match="chunk_size"):
        chunk_kda(q, k, v, g, beta, chunk_size=40)
    with pytest.raises(ValueError, match="backend"):
        chunk_kda(q, k, v, g, beta, backend="cuda")
    with pytest.raises(NotImplementedError, match="CUDA"):
        chunk_kda(q, k, v, g, beta, backend="tilelang")


@pytest.mark.parametrize("name", ["q", "k", "v", "beta", "initial_state"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_nan_or_inf_in_an_input_is_an_error_not_a_nan_output(inputs, name, bad):
    args = dict(zip(["q", "k", "v", "g", "beta", "initial_state"], [x.clone() for x in inputs]))
    args[name].view(-1)[7] = bad
    q, k, v, g, beta = (args[n] for n in ("q", "k", "v", "g", "beta"))
    with pytest.raises(ValueError, match=f"{name} must be finite"):
        chunk_kda(q, k, v, g, beta, initial_state=args["initial_state"])
    o, _ = chunk_kda(q, k, v, g, beta, initial_state=args["initial_state"], check_gate=False)  # unchecked: it propagates
    assert not torch.isfinite(o).all()


def test_bad_values_and_types_name_what_was_expected(inputs):
    q, k, v, g, beta, h0 = inputs
    with pytest.raises(ValueError, match=r"beta .* must lie in \[0, 1\]"):
        chunk_kda(q, k, v, g, beta * 3)
    with pytest.raises(ValueError, match="initial_state must be a torch.Tensor"):
        chunk_kda(q, k, v, g, beta, initial_state=h0.numpy())
    for scale in (float("nan"), 1e39, -1e300):  # 1e39: finite in Python, inf in the kernels' float32
        with pytest.raises(ValueError, match="scale must be a finite number"):
            chunk_kda(q, k, v, g, beta, scale=scale)
    with pytest.raises(ValueError, match="chunk_size must be a positive int"):
        chunk_kda(q, k, v, g, beta, chunk_size=16.0)
    with pytest.raises(ValueError, match="initial_state must be a real floating-point tensor"):
        chunk_kda(q, k, v, g, beta, initial_state=h0.to(torch.complex128))
    with pytest.raises(ValueError, match="head dim K >= 1"):
        chunk_kda(q[..., :0], k[..., :0], v, g[..., :0], beta)


def test_gate_below_the_declared_bound(inputs):
    q, k, v, g, beta, _ = inputs
    g = g.clone()
    g[1, 7, 0, 5] = -5.5
    with pytest.raises(ValueError, match=r"g must lie in \[g_min, 0\] = \[-5.0, 0\]"):
        chunk_kda(q, k, v, g, beta)
    with pytest.raises(ValueError, match=r"g must lie in \[g_min, 0\] = \[-2.0, 0\]"):
        chunk_kda(q, k, v, g.clamp(min=-5), beta, g_min=-2.0)
    with pytest.raises(ValueError, match=r"g_min .* must be a number in \[-5, 0\)"):
        chunk_kda(q, k, v, g, beta, g_min=-6.0)
    o, _ = chunk_kda(q, k, v, g, beta, g_min=None)  # no declared bound: the torch backend takes any g <= 0
    assert torch.isfinite(o).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_gate_at_a_bound_that_the_dtype_rounds(dtype):
    """fp32(-4.3) < -4.3: a saturated g = g_min * sigmoid(.) computed in g's dtype lies at the
    rounded bound and is accepted; a value below the rounded bound is not."""
    from kda_cp.reference import naive_recurrent_kda

    gen = torch.Generator().manual_seed(11)
    T, H, K = 70, 2, 8
    q = torch.randn(1, T, H, K, generator=gen, dtype=dtype)
    k = torch.nn.functional.normalize(torch.randn(1, T, H, K, generator=gen, dtype=dtype), dim=-1)
    v = torch.randn(1, T, H, 8, generator=gen, dtype=dtype)
    beta = torch.rand(1, T, H, generator=gen, dtype=dtype)
    z = 40 * torch.randn(1, T, H, K, generator=gen, dtype=dtype)  # many saturated sigmoids
    g = -4.3 * torch.sigmoid(z)
    assert g.min().item() == torch.tensor(-4.3, dtype=dtype).item()  # the gate reaches the rounded bound
    o, _ = chunk_kda(q, k, v, g, beta, g_min=-4.3)
    ref, _ = naive_recurrent_kda(*(x.double() for x in (q, k, v, g, beta)))
    assert (o.double() - ref).norm() / ref.norm() < (1e-5 if dtype == torch.float32 else 1e-12)
    o2, _ = chunk_kda(q, k, v, z, beta, use_gate_in_kernel=True, A_log=torch.zeros(H, dtype=dtype), g_min=-4.3)
    torch.testing.assert_close(o2, o, rtol=0, atol=0)
    g[0, 5, 1, 3] = torch.nextafter(torch.tensor(g.min().item(), dtype=dtype), torch.tensor(-10.0, dtype=dtype))
    with pytest.raises(ValueError, match=r"g must lie in \[g_min, 0\] = \[-4.3, 0\]"):
        chunk_kda(q, k, v, g, beta, g_min=-4.3)


def test_prepared_forward_is_the_same_forward():
    """CP runs the state-independent half during the exchange; the result must not change."""
    from kda_cp.ops import KDAOptions, get_backend

    q, k, v, g, beta, h0 = make_inputs(1, 150, 2, 8, 4, dtype=torch.float32, with_h0=False)
    cu = torch.tensor([0, 40, 41, 150])
    h0 = torch.randn(3, 2, 8, 4)
    backend = get_backend("torch", q, k, v, g, beta)
    opts = KDAOptions(scale=0.3)
    prepared = backend.prepare(q, k, v, g, beta, opts, cu)
    o1, s1 = backend.fwd(q, k, v, g, beta, h0, opts, cu)
    o2, s2 = backend.fwd(q, k, v, g, beta, h0, opts, cu, prepared=prepared)
    assert torch.equal(o1, o2) and torch.equal(s1, s2)


def test_summary_and_state_grad_from_prepared():
    """The CP stages that share the chunk-local half (torch backend, fp64): the summary of each
    packed sequence (and of the last alone) equals the one-pass summary of that sequence, and the
    state gradient per sequence equals autograd of the recurrence, with or without ``prepared``."""
    from kda_cp.ops import KDAOptions, get_backend
    from kda_cp.reference import naive_recurrent_kda

    H, K, V = 2, 8, 4
    lens = [40, 1, 109]
    T = sum(lens)
    q, k, v, g, beta, _ = make_inputs(1, T, H, K, V)
    cu = torch.tensor([0, 40, 41, 150])
    backend = get_backend("torch", q, k, v, g, beta)
    opts = KDAOptions(scale=0.3, chunk_size=16)
    prepared = backend.prepare(q, k, v, g, beta, opts, cu)
    M, St = backend.summary_prepared(prepared, opts, last_only=False)
    Ml, Sl = backend.summary_prepared(prepared, opts, last_only=True)
    assert M.shape == (3, H, K, K) and Ml.shape == (1, H, K, K)
    for i, (a, b) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        Mi, Si = backend.summary(*(x[:, a:b] for x in (k, v, g, beta)), opts)
        torch.testing.assert_close(M[i:i + 1], Mi, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(St[i:i + 1], Si, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(Ml, M[-1:], rtol=0, atol=0)
    torch.testing.assert_close(Sl, St[-1:], rtol=0, atol=0)
    do = torch.randn(1, T, H, V, dtype=torch.float64)
    h0 = torch.randn(3, H, K, V, dtype=torch.float64, requires_grad=True)
    o, _ = naive_recurrent_kda(q, k, v, g, beta, scale=0.3, initial_state=h0, cu_seqlens=cu)
    (ref,) = torch.autograd.grad(o, h0, do)
    for prep in (None, prepared):
        G = backend.state_grad(q, k, v, g, beta, do, opts, cu, prepared=prep)
        torch.testing.assert_close(G, ref, rtol=1e-9, atol=1e-11)


def test_head_first_layout_warns():
    from kda_cp import ops

    ops._warn_once.cache_clear()
    q, k, v, g, beta, _ = make_inputs(1, 3, 40, 8, 4, dtype=torch.float32)
    with pytest.warns(UserWarning, match=r"chunk_kda got q with T < H"):
        chunk_kda(q, k, v, g, beta)


def test_a_chunk_longer_than_the_sequence_costs_only_the_sequence(inputs):
    """chunk_size = 2**15 on T = 20: the torch backend caps the chunk at T rounded up to 16 (it used
    to allocate 2**15 x 2**15 blocks) and gives chunk_size=64's answer."""
    q, k, v, g, beta, h0 = inputs
    o_big, ht_big = chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True, chunk_size=1 << 15)
    o, ht = chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    torch.testing.assert_close(o_big, o, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ht_big, ht, rtol=1e-5, atol=1e-6)


def test_dense_inputs_are_made_aligned_for_the_kernels():
    """What dense_on_cuda does to each CUDA input (the kernels read q, k, v, g by TMA: 16-byte
    aligned rows): a dense aligned tensor is passed through, a strided one or a dense one at an odd
    storage offset becomes an aligned copy with the same values (so the op runs on the kernels
    instead of falling back to torch)."""
    from kda_cp.ops import _aligned_dense

    x = torch.randn(2, 8, 4, 64).bfloat16()
    assert _aligned_dense(x) is x
    shifted = torch.empty(x.numel() + 1, dtype=x.dtype)[1:].view(x.shape).copy_(x)
    assert shifted.data_ptr() % 16
    y = _aligned_dense(shifted)
    assert y.data_ptr() % 16 == 0 and y.is_contiguous() and torch.equal(y, x)
    strided = torch.randn(2, 8, 4, 128).bfloat16()[..., :64]
    z = _aligned_dense(strided)
    assert z.is_contiguous() and z.data_ptr() % 16 == 0 and torch.equal(z, strided)


def test_double_backward_is_a_clear_error():
    """create_graph=True would return gradients without a graph (the backward is hand-written):
    NotImplementedError; first-order gradients through the same graph still work."""
    q, k, v, g, beta, h0 = make_inputs(1, 40, 2, 8, 8, with_h0=True, requires_grad=True)
    o, ht = chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True, chunk_size=16)
    loss = (o * torch.randn_like(o)).sum() + (ht * torch.randn_like(ht)).sum()
    with pytest.raises(NotImplementedError, match=r"chunk_kda: double backward \(create_graph=True\)"):
        torch.autograd.grad(loss, (q, k), create_graph=True, retain_graph=True)
    dq, dk = torch.autograd.grad(loss, (q, k))
    assert dq.abs().sum() > 0 and dk.abs().sum() > 0 and not dq.requires_grad


@pytest.mark.parametrize("segment_len", [None, 64])
def test_an_empty_sequence_returns_a_copy_of_the_initial_state(segment_len):
    """T = 0: the final state equals initial_state but is a new tensor (an in-place edit of one
    never changes the other), with its gradient flowing to initial_state."""
    q = torch.randn(1, 0, 2, 8, dtype=torch.float64)
    g = -torch.rand(1, 0, 2, 8, dtype=torch.float64)
    beta = torch.rand(1, 0, 2, dtype=torch.float64)
    h0 = torch.randn(1, 2, 8, 8, dtype=torch.float64, requires_grad=True)
    o, ht = chunk_kda(q, q, q, g, beta, initial_state=h0, output_final_state=True, segment_len=segment_len)
    assert o.shape == (1, 0, 2, 8) and torch.equal(ht, h0) and ht.data_ptr() != h0.data_ptr()
    ht.mul(3).sum().backward()
    assert torch.equal(h0.grad, torch.full_like(h0, 3.0))
    with torch.no_grad():
        ht.add_(1)
    assert not torch.equal(ht, h0)
