"""kda_cp.kernels launchers on the CPU: input validation, routing, chunk tables (no GPU, no compile)."""
import pytest
import torch

from kda_cp import kernels
from kda_cp.kernels._common import build_chunk_tables


def _inputs(B=1, T=64, H=2, K=128, V=128, dtype=torch.bfloat16):
    q = torch.randn(B, T, H, K).to(dtype)
    k = torch.nn.functional.normalize(torch.randn(B, T, H, K), dim=-1).to(dtype)
    v = torch.randn(B, T, H, V).to(dtype)
    g = -5.0 * torch.sigmoid(torch.randn(B, T, H, K))
    beta = torch.rand(B, T, H)
    return q, k, v, g, beta


def test_validation_messages_show_shapes():
    q, k, v, g, beta = _inputs()
    with pytest.raises(ValueError, match=r"\(1, 63, 2, 128\)"):
        kernels.chunk_kda_fwd(q, k, v[:, :63].contiguous(), g, beta, scale=0.1)
    with pytest.raises(ValueError, match="K == V"):
        kernels.chunk_kda_fwd(q, k, v[..., :64].contiguous(), g, beta, scale=0.1)
    with pytest.raises(ValueError, match="contiguous"):
        kernels.chunk_kda_fwd(q.transpose(1, 2).contiguous().transpose(1, 2), k, v, g, beta, scale=0.1)
    with pytest.raises(ValueError, match="dtype"):
        kernels.chunk_kda_fwd(q, k, v, g.bfloat16(), beta, scale=0.1)
    with pytest.raises(ValueError, match="dtype"):
        kernels.chunk_kda_fwd(q.float(), k.float(), v.float(), g, beta, scale=0.1)
    with pytest.raises(ValueError, match="g_min"):
        kernels.chunk_kda_fwd(q, k, v, g, beta, scale=0.1, g_min=-6.0)
    with pytest.raises(ValueError, match="chunk_size"):
        kernels.chunk_kda_fwd(q, k, v, g, beta, scale=0.1, chunk_size=32)
    with pytest.raises(ValueError, match="B == 1"):
        q2, k2, v2, g2, b2 = _inputs(B=2)
        kernels.chunk_kda_fwd(q2, k2, v2, g2, b2, scale=0.1, cu_seqlens=torch.tensor([0, 64]))
    with pytest.raises(ValueError, match=r"initial_state has shape \(1, 2, 128, 64\)"):
        kernels.chunk_kda_fwd(q, k, v, g, beta, scale=0.1, initial_state=torch.zeros(1, 2, 128, 64))
    with pytest.raises(ValueError, match=r"\(1, 64, 2, 96\)"):
        q3, k3, v3, g3, b3 = _inputs(K=96, V=96)
        kernels.chunk_kda_summary(k3, v3, g3, b3)


def test_unaligned_inputs_are_an_error():
    """q, k, v and g are read by TMA, which needs 16-byte aligned data pointers: a contiguous view
    at an odd storage offset is refused with a clear error by both forward entry points (checked
    before any CUDA work, so on the CPU too)."""
    q, k, v, g, beta = _inputs()
    for name in ("q", "k", "v", "g"):
        x = {"q": q, "k": k, "v": v, "g": g}[name]
        shifted = torch.empty(x.numel() + 1, dtype=x.dtype)[1:].view(x.shape).copy_(x)
        assert shifted.is_contiguous() and shifted.data_ptr() % kernels.TMA_ALIGN
        args = {"q": q, "k": k, "v": v, "g": g, "beta": beta, name: shifted}
        with pytest.raises(ValueError, match=f"{name} starts at a data pointer that is not 16-byte aligned"):
            kernels.chunk_kda_fwd(args["q"], args["k"], args["v"], args["g"], args["beta"], scale=0.1)
        with pytest.raises(ValueError, match=f"{name} starts at a data pointer that is not 16-byte aligned"):
            kernels.chunk_kda_fwd_prepare(args["q"], args["k"], args["v"], args["g"], args["beta"], scale=0.1)


def test_too_many_sequences_is_an_error():
    """The state passes launch one block row per sequence (CUDA grid z <= 65535): more sequences in
    one call is a clear error, not a failed launch."""
    q, k, v, g, beta = _inputs(T=64)
    cu = torch.zeros(kernels.MAX_GRID_YZ + 2, dtype=torch.int32)
    cu[-1] = 64  # 65535 empty sequences, then one of 64 tokens
    with pytest.raises(ValueError, match="65536 sequences"):
        kernels.chunk_kda_fwd(q, k, v, g, beta, scale=0.1, cu_seqlens=cu)
    with pytest.raises(ValueError, match="65536 sequences"):
        kernels.chunk_kda_fwd_prepare(q, k, v, g, beta, scale=0.1, cu_seqlens=cu)


def test_is_supported_routes_cpu_and_odd_head_dims():
    ok, why = kernels.is_supported(*_inputs())
    assert not ok and why  # CPU tensors (or no tilelang): never claimed
    q, k, v, g, beta = _inputs(K=96, V=96)
    assert not kernels.is_supported(q, k, v, g, beta)[0]


def test_chunk_tables_fixed_and_packed():
    t = build_chunk_tables(2, 100, None, 64, torch.device("cpu"))
    assert t.chunk_table.tolist() == [[0, 100], [64, 100], [100, 200], [164, 200]]
    assert t.seq_table.tolist() == [[0, 2, 0, 100], [2, 2, 100, 200]]
    cu = torch.tensor([0, 15, 15, 256, 300])  # an empty sequence, a multiple of 64, a tail
    t = build_chunk_tables(1, 300, cu, 64, torch.device("cpu"))
    assert t.chunk_table.tolist() == [[0, 15], [15, 256], [79, 256], [143, 256], [207, 256],
                                      [256, 300]]
    assert t.seq_table.tolist() == [[0, 1, 0, 15], [1, 0, 15, 15], [1, 4, 15, 256], [5, 1, 256, 300]]


def test_state_launch_fills_the_gpu():
    """The launch picked for the benchmark shapes on an H200 (132 SMs), the ones measured fastest
    there (docs/results/h200_tune_launches.json), and the rule's boundaries: waves x measured step
    time (state_launch's docstring). Needs no tilelang."""
    from kda_cp.kernels._common import STATE_LAUNCHES, STATE_STEP_US, state_launch

    assert state_launch(132, 1, 32, 128) == (32, 128)  # S1: 128 blocks, one wave (0.51 vs 0.63 / 0.77 ms)
    assert state_launch(132, 8, 32, 128) == (64, 128)  # S2: 4 waves of the widest (0.40 vs 0.53 / 0.79)
    assert state_launch(132, 1, 16, 128) == (16, 128)  # S3: 128 blocks of 16 columns (1.54 vs 1.97 / 2.47)
    assert state_launch(132, 1, 1, 64) == (16, 128)  # few heads: the most blocks
    assert state_launch(132, 1, 33, 128) == (32, 128)  # 132 blocks of 32 columns: exactly one wave
    assert state_launch(132, 1, 34, 128) == (64, 128)  # 136: a second wave of 32 columns costs more
    assert state_launch(132, 1, 33, 64) == (16, 128)  # 132 blocks of 16 columns: one wave
    assert state_launch(132, 1, 34, 64) == (32, 128)  # 136 of 16 would take two
    assert state_launch(78, 1, 16, 128) == (32, 128)  # a smaller GPU: 64 blocks of 32 in one wave
    assert set(STATE_STEP_US) == set(STATE_LAUNCHES)
    assert all(state_launch(132, n, h, v) in STATE_LAUNCHES
               for n in (1, 2, 7, 64) for h in (1, 3, 16, 40) for v in (64, 128))


def test_miscompiled_state_launch_is_refused():
    """32 value columns per warpgroup (block_v 64 on two warpgroups) gave wrong states on an H200
    with tilelang 0.1.15: the builders refuse it before compiling, and no offered launch is one."""
    from kda_cp.kernels._common import STATE_LAUNCHES, check_state_launch

    with pytest.raises(ValueError, match="miscompiled"):
        check_state_launch(64, 256)
    with pytest.raises(ValueError, match="miscompiled"):
        check_state_launch(128, 512)
    with pytest.raises(ValueError, match="unmeasured"):  # 64 per warpgroup: never measured
        check_state_launch(128, 256)
    for block_v, threads in STATE_LAUNCHES + ((64, 128), (32, 128)):
        check_state_launch(block_v, threads)


def test_state_builders_refuse_the_miscompiled_launch():
    """64 value columns on two warpgroups produce wrong states on an H200 with tilelang 0.1.15
    (docs/kernels.md): both state builders raise before compiling (needs tilelang installed, no nvcc)."""
    pytest.importorskip("tilelang")
    from kda_cp.kernels.bwd_state import build_bwd_state_kernel
    from kda_cp.kernels.state import build_state_output_kernel

    with pytest.raises(ValueError, match="miscompiled"):
        build_state_output_kernel(None, 128, 128, 64, "bfloat16", with_h0=True, store_ht=True, block_v=64,
                                  threads=256)
    with pytest.raises(ValueError, match="miscompiled"):
        build_bwd_state_kernel(None, 128, 128, 64, "bfloat16", walk="forward", block_v=64, threads=256)


def test_packed_offsets_made_by_kda_cp_are_not_read_back():
    """Offsets kda_cp copies to the device (device_offsets) keep their host values, so the chunk
    tables and checks never read them back: a meta tensor, which has no data to read, passes.
    A caller's tensor is read every time (it may change without a version bump), a reused copy
    that was modified in place is made afresh, and inference mode works."""
    from kda_cp.kernels._common import build_chunk_tables, device_offsets, host_offsets
    from kda_cp.parallel.segments import _device_plan, segment_plan

    cu = torch.tensor([0, 5, 71])
    assert host_offsets(cu) == (0, 5, 71)
    cu.data[1] = 9  # through .data: no version bump, and the new values are read
    assert host_offsets(cu) == (0, 9, 71)
    meta = device_offsets((0, 9, 71), "meta")
    assert device_offsets([0, 9, 71], "meta") is meta
    tables = build_chunk_tables(1, 71, meta, 64, torch.device("cpu"))
    assert tables.num_chunks == 2 and tables.seq_table.tolist() == [[0, 1, 0, 9], [1, 1, 9, 71]]
    plan = segment_plan((0, 150, 300), 64)
    assert host_offsets(_device_plan(plan, "meta")[0]) == plan.cu
    shared = device_offsets((0, 3, 6), "cpu")
    shared[1] = 4  # a caller wrote into the shared copy: the next call makes a fresh one
    assert device_offsets((0, 3, 6), "cpu").tolist() == [0, 3, 6]
    with torch.inference_mode():
        inf = device_offsets((0, 2, 7), "cpu")
        assert host_offsets(inf) == (0, 2, 7) and host_offsets(torch.tensor([0, 7])) == (0, 7)
    assert not device_offsets((0, 2, 7), "cpu").is_inference()  # not the inference-mode copy


def test_general_gate_floor_and_options():
    """The general-gate kernels' step floor is the torch backend's fp32 decay floor, and g_min=None
    (any g <= 0) is refused with the gate inside the kernel, which is the bounded form."""
    from kda_cp.kernels._common import GENERAL_FLOOR
    from kda_cp.kernels.launch import KernelGate, validate_inputs
    from kda_cp.reference import decay_floor

    assert abs(GENERAL_FLOOR - decay_floor(torch.float32)) < 1e-7
    q, k, v, g, beta = _inputs()
    assert validate_inputs(q, k, v, g, beta, None, 64, None) == (1, 64, 2, 128, 128)
    gate = KernelGate(torch.zeros(2), torch.zeros(2, 128), None)
    with pytest.raises(ValueError, match="g_min"):
        validate_inputs(q, k, v, g.bfloat16(), beta, None, 64, None, gate=gate)
