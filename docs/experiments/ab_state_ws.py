"""EXPERIMENT: time docs/experiments/state_ws.py against the package's state + output pass on a GPU
and compare O and the final state bitwise (both start from a zero state and store it at the end).

    python docs/experiments/ab_state_ws.py          # S1 with block_v 32 and 16, S3 with 16 and 32

Needs a Hopper GPU with tilelang (the same bf16 inputs as scripts/bench_kernels.py); prints one
line per case: the three medians of 20 CUDA-event timings of each kernel, and whether O and the
final state are bitwise equal. Never run yet (written in the thirteenth session, no device time
left).
"""
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "..", "scripts"))

import torch  # noqa: E402
from _bench import SHAPES, make_inputs, time_ms  # noqa: E402

import state_ws  # noqa: E402
from kda_cp.kernels import chunk_kda_fwd_prepare  # noqa: E402
from kda_cp.kernels.state import build_state_output_kernel  # noqa: E402


def main():
    for name, bv in (("S1", 32), ("S1", 16), ("S3", 16), ("S3", 32)):
        s = SHAPES[name]
        B, T, H, K, V = s["B"], s["T"], s["H"], s["K"], s["V"]
        q, k, v, g, beta = make_inputs(**s)
        W, U, Qg, Kd, Aqk, Ec, tab = chunk_kda_fwd_prepare(q, k, v, g, beta, scale=K ** -0.5).tensors
        N = tab.seq_table.shape[0]
        ref = build_state_output_kernel(None, K, V, 64, "bfloat16", with_h0=False, store_ht=True, block_v=bv,
                                        threads=128)
        ws = state_ws.build(K, V, 64, "bfloat16", bv)
        o1, o2 = torch.empty_like(v), torch.empty_like(v)
        h1, h2 = (torch.empty(N, H, K, V, device="cuda") for _ in range(2))
        f1 = lambda: ref(W, U, Qg, Kd, Aqk, Ec, tab.seq_table, h1, o1.view(B * T, H, V), h1)  # noqa: E731
        f2 = lambda: ws(W, U, Qg, Kd, Aqk, Ec, tab.seq_table, o2.view(B * T, H, V), h2)  # noqa: E731
        f1()
        f2()
        torch.cuda.synchronize()
        equal = (torch.equal(o1, o2), torch.equal(h1, h2))
        times = [(time_ms(f1, 20), time_ms(f2, 20)) for _ in range(3)]
        print(f"{name} block_v={bv}: state.py {[round(a, 3) for a, _ in times]} ms, "
              f"state_ws {[round(b, 3) for _, b in times]} ms, O / final state bitwise equal {equal}", flush=True)


if __name__ == "__main__":
    main()
