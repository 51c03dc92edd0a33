"""Affine-map algebra: associativity, the two scan schedules agree, transposed reverse scan."""

import pytest
import torch

from kda_cp import scan
from tests._utils import assert_close


def rand_maps(P, K=5, V=3, lead=(2,)):
    return scan.AffineMap(torch.randn(P, *lead, K, K, dtype=torch.float64) / K**0.5,
                          torch.randn(P, *lead, K, V, dtype=torch.float64))


def test_compose_is_associative_and_matches_application():
    m = rand_maps(3)
    a, b, c = (scan.AffineMap(m.M[i], m.S[i]) for i in range(3))
    left = scan.compose(c, scan.compose(b, a))
    right = scan.compose(scan.compose(c, b), a)
    assert_close("M", left.M, right.M, 1e-13)
    assert_close("S", left.S, right.S, 1e-13)
    x = torch.randn(2, 5, 3, dtype=torch.float64)
    assert_close("apply", scan.apply(c, scan.apply(b, scan.apply(a, x))), scan.apply(left, x), 1e-13)


@pytest.mark.parametrize("P", [1, 2, 3, 5, 8, 13])
def test_scan_schedules_agree_with_the_chain(P):
    maps = rand_maps(P)
    x0 = torch.randn(2, 5, 3, dtype=torch.float64)
    seq = scan.exclusive_scan(maps, "sequential")
    tree = scan.exclusive_scan(maps, "log_depth")
    x = x0
    for r in range(P):
        assert_close(f"sequential[{r}]", x, scan.apply(scan.AffineMap(seq.M[r], seq.S[r]), x0), 1e-12)
        assert_close(f"log_depth[{r}]", x, scan.apply(scan.AffineMap(tree.M[r], tree.S[r]), x0), 1e-12)
        x = scan.apply(scan.AffineMap(maps.M[r], maps.S[r]), x)
    tot = scan.total(maps)
    assert_close("total", x, scan.apply(tot, x0), 1e-12)


@pytest.mark.parametrize("method", ["sequential", "log_depth"])
@pytest.mark.parametrize("P", [1, 2, 4, 7])
def test_reverse_transposed_scan(method, P):
    maps = rand_maps(P)
    d_last = torch.randn(2, 5, 3, dtype=torch.float64)
    suffix = scan.reverse_transposed_exclusive_scan(maps, method)
    d = d_last
    for r in range(P - 1, -1, -1):
        assert_close(f"D[{r}]", d, scan.apply(scan.AffineMap(suffix.M[r], suffix.S[r]), d_last), 1e-12)
        d = maps.M[r].transpose(-1, -2) @ d + maps.S[r]


@pytest.mark.parametrize("method", ["sequential", "log_depth"])
@pytest.mark.parametrize("P", [1, 2, 3, 6, 9])
def test_one_ranks_prefix_and_suffix_equal_the_full_scans(method, P):
    """What a rank computes after an all-gather (its own prefix / transposed suffix, by a fold of
    r maps) equals its row of the full scans, for every rank r."""
    maps = rand_maps(P)
    prefix = scan.exclusive_scan(maps, method)
    suffix = scan.reverse_transposed_exclusive_scan(maps, method)
    ident = scan.identity_like(scan.AffineMap(maps.M[0], maps.S[0]))
    for r in range(P):
        for name, full, one in (("prefix", prefix, scan.prefix_at(maps, r, method)),
                                ("suffix", suffix, scan.transposed_suffix_at(maps, r, method))):
            if (name == "prefix" and r == 0) or (name == "suffix" and r == P - 1):
                assert torch.equal(one.M, ident.M) and torch.equal(one.S, ident.S), f"{name}[{r}] not the identity"
                continue
            assert_close(f"{name} M[{r}]", full.M[r], one.M, 1e-12)
            assert_close(f"{name} S[{r}]", full.S[r], one.S, 1e-12)
    with pytest.raises(ValueError, match="outside"):
        scan.prefix_at(maps, P)
    with pytest.raises(ValueError, match="outside"):
        scan.transposed_suffix_at(maps, -1)


def test_bad_stack_and_method():
    with pytest.raises(ValueError, match="M must be"):
        scan.exclusive_scan(scan.AffineMap(torch.randn(3, 4, 5), torch.randn(3, 4, 2)))
    with pytest.raises(ValueError, match="method"):
        scan.exclusive_scan(rand_maps(2), "bogus")
    with pytest.raises(ValueError, match="method"):
        scan.total(rand_maps(2), "bogus")
    with pytest.raises(ValueError, match="empty"):
        scan.total(rand_maps(0))
    with pytest.raises(ValueError, match="empty"):
        scan.exclusive_scan(rand_maps(0))
    maps = rand_maps(3)
    for r in (0, 2):  # the identity ends check the method too
        with pytest.raises(ValueError, match="method"):
            scan.prefix_at(maps, r, "bogus")
        with pytest.raises(ValueError, match="method"):
            scan.transposed_suffix_at(maps, r, "bogus")
    with pytest.raises(ValueError, match="M and S must share one floating dtype"):
        scan.exclusive_scan(scan.AffineMap(maps.M, maps.S.float()))
    state = maps.S[0]
    for bad in (state[..., :-1], state[0], "x"):
        with pytest.raises(ValueError, match=r"x0 must be a state"):
            scan.state_at(maps, 2, bad)
        with pytest.raises(ValueError, match=r"seed must be a state"):
            scan.transposed_state_at(maps, 0, bad)


def test_products_are_ieee_fp32_even_when_the_caller_allows_tf32(monkeypatch):
    """Training scripts often call torch.set_float32_matmul_precision("high") (TF32 on CUDA); the
    scans must still multiply transitions in IEEE fp32, and leave the caller's setting as it was."""
    seen = []
    matmul = torch.Tensor.__matmul__

    def spy(a, b):
        seen.append(torch.get_float32_matmul_precision())
        return matmul(a, b)

    P, K, V = 5, 4, 3
    maps = scan.AffineMap(torch.randn(P, 2, K, K), torch.randn(P, 2, K, V))
    prev = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high")
    try:
        monkeypatch.setattr(torch.Tensor, "__matmul__", spy)
        for method in ("sequential", "log_depth"):
            scan.exclusive_scan(maps, method)
            scan.reverse_transposed_exclusive_scan(maps, method)
            scan.total(maps, method)
            scan.prefix_at(maps, 3, method)
            scan.transposed_suffix_at(maps, 1, method)
        f = scan.AffineMap(maps.M[0], maps.S[0])
        scan.apply(scan.compose(f, f), maps.S[1])
        assert torch.get_float32_matmul_precision() == "high", "the caller's precision was not restored"
    finally:
        monkeypatch.undo()
        torch.set_float32_matmul_precision(prev)
    assert seen and set(seen) == {"highest"}, f"products ran at {sorted(set(seen))}"


@pytest.mark.parametrize("P", [1, 2, 5, 8])
def test_one_ranks_state_chains_equal_its_folded_maps_applied(P):
    """state_at / transposed_state_at (the chains CP's "sequential" fold runs: no product of two
    M's) equal the rank's prefix / transposed suffix applied to the zero state or to a seed, for
    every rank, on the non-contiguous slices of a packed all-gather buffer."""
    K, V = 5, 3
    m = rand_maps(P, K, V)
    packed = torch.cat([m.S, m.M], dim=-1)  # CP's all-gather row: [S | M]
    maps = scan.AffineMap(packed[..., V:], packed[..., :V])
    seed = torch.randn(2, V, K, dtype=torch.float64).transpose(-1, -2)  # non-contiguous
    for r in range(P):
        pre, suf = scan.prefix_at(maps, r), scan.transposed_suffix_at(maps, r)
        for x in (None, seed):
            want_f = pre.S if x is None else scan.apply(pre, x)
            want_b = suf.S if x is None else scan.apply(suf, x)
            got_f, got_b = scan.state_at(maps, r, x), scan.transposed_state_at(maps, r, x)
            assert got_f.is_contiguous() and got_b.is_contiguous()
            assert x is None or (got_f.data_ptr() != x.data_ptr() and got_b.data_ptr() != x.data_ptr())
            if want_f.abs().max() == 0:  # the zero state entering rank 0
                assert r == 0 and x is None and torch.equal(got_f, want_f)
            else:
                assert_close(f"state_at[{r}]", want_f, got_f, 1e-13)
            if want_b.abs().max() == 0:
                assert r == P - 1 and x is None and torch.equal(got_b, want_b)
            else:
                assert_close(f"transposed_state_at[{r}]", want_b, got_b, 1e-13)
            # scratch: the chain may write over a gathered buffer's S rows (never its M rows), and
            # returns a contiguous tensor of its own with the same values
            for fn, want, name in ((scan.state_at, got_f, "state_at"), (scan.transposed_state_at, got_b, "transposed")):
                buf = packed.clone()
                got = fn(scan.AffineMap(buf[..., V:], buf[..., :V]), r, x, scratch=True)
                ends = (buf.data_ptr(), buf.data_ptr() + buf.numel() * buf.element_size())
                assert got.is_contiguous() and not ends[0] <= got.data_ptr() < ends[1], name
                assert torch.equal(buf[..., V:], packed[..., V:]), f"{name}[{r}] wrote over an M"
                if want.abs().max() == 0:
                    assert torch.equal(got, want), f"{name}[{r}] scratch"
                else:
                    assert_close(f"{name}[{r}] scratch", want, got, 1e-13)
    with pytest.raises(ValueError, match="outside"):
        scan.state_at(maps, P)
    with pytest.raises(ValueError, match="outside"):
        scan.transposed_state_at(maps, -1)
