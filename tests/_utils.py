"""Shared test helpers: random KDA inputs drawn fresh per case, and one closeness check."""

from __future__ import annotations

import re
from pathlib import Path

import torch

#: The checkout's root (scripts/, conf/ and the package live here).
ROOT = Path(__file__).resolve().parents[1]

_TINY_TRAIN = {
    "model.d_model": 32, "model.n_layers": 2, "model.kda.num_heads": 2, "model.kda.head_dim": 16,
    "model.kda.chunk_size": 16, "model.attention.num_heads": 2, "model.attention.head_dim": 16,
    "data.seq_len": 64, "data.batch_size": 4, "data.val_batches": 1, "data.max_bytes": 300000,
    "trainer.val_every": 0, "trainer.progress": "false", "trainer.plot": "false", "parallel.threads_per_rank": 1,
}


def tiny_train(**changes) -> list[str]:
    """Hydra overrides of a tiny CPU training run on the embedded corpus; ``changes`` replace or add
    keys, written with "__" for "." (``tiny_train(model__kda__num_heads=4)``)."""
    cfg = {**_TINY_TRAIN, **{k.replace("__", "."): v for k, v in changes.items()}}
    return [f"{k}={v}" for k, v in cfg.items()]

# In generated kernel CUDA: a gam_s address of the form base + (...) - n, i.e. the sub-chunk
# reference row 16 I - 1 read unguarded (for I = 0 it lies before the tile; the kernels clamp it,
# kernels._common.sub_chunk_ref).
NEGATIVE_GAM_OFFSET = re.compile(r"gam_s\) \+ \([^;]*\) - \d+\)\)")


def rel_rms(ref: torch.Tensor, out: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in fp64."""
    ref, out = ref.double(), out.double()
    return ((out - ref).norm() / ref.norm().clamp_min(1e-300)).item()


def assert_close(name: str, ref: torch.Tensor, out: torch.Tensor, ratio: float) -> float:
    """Fail unless ``out`` is finite, has ``ref``'s shape, and rel. RMS error <= ratio; returns the error."""
    assert out.shape == ref.shape, f"{name}: shape {tuple(out.shape)} != {tuple(ref.shape)}"
    assert torch.isfinite(out).all(), f"{name}: non-finite values"
    assert ref.abs().max() > 0, f"{name}: the reference is all zeros: the case tests nothing"
    err = rel_rms(ref, out)
    print(f"{name}: rel_rms={err:.3e} (tol {ratio:.0e})")
    assert err <= ratio, f"{name}: relative RMS error {err:.3e} > {ratio:.1e}"
    return err


def make_inputs(B, T, H, K, V, *, dtype=torch.float64, g_min=-5.0, seed=None, requires_grad=False,
                with_h0=False, device="cpu", gates="mixed"):
    """q, k (L2-normalized), v, g, beta ~ U(0, 1), optional h0.

    gates="mixed" (default): g = g_min * sigmoid(randn + b_hd) with a per-(head, channel) bias b
    spread over [-8, 3]: some channels forget within a token, some keep the state over thousands
    (g ~ -2e-3), as trained models do; without slow channels a shard's transition M underflows to
    zero and a test cannot see errors in M or in the scan. gates="fast": g = g_min * sigmoid(randn).
    """
    gen = torch.Generator().manual_seed(seed) if seed is not None else None

    def rnd(*s):
        return torch.randn(*s, generator=gen, dtype=torch.float64)

    q = rnd(B, T, H, K)
    k = torch.nn.functional.normalize(rnd(B, T, H, K), dim=-1)
    v = rnd(B, T, H, V)
    z = rnd(B, T, H, K)
    if gates == "mixed":
        bias = torch.stack([torch.linspace(-8.0, 3.0, K, dtype=torch.float64)[torch.randperm(K, generator=gen)]
                            for _ in range(H)])
        z = z + bias
    elif gates != "fast":
        raise ValueError(f"gates must be 'mixed' or 'fast', got {gates!r}")
    g = g_min * torch.sigmoid(z)
    beta = torch.rand(B, T, H, generator=gen, dtype=torch.float64)
    h0 = rnd(B, H, K, V) if with_h0 else None
    out = [x.to(device=device, dtype=dtype) for x in (q, k, v)]
    out += [x.to(device=device, dtype=dtype if dtype == torch.float64 else torch.float32) for x in (g, beta)]
    if h0 is not None:
        h0 = h0.to(device=device, dtype=torch.float64 if dtype == torch.float64 else torch.float32)
    if requires_grad:
        out = [x.requires_grad_(True) for x in out]
        if h0 is not None:
            h0.requires_grad_(True)
    return (*out, h0)


def perturbed(module: torch.nn.Module, seed: int) -> torch.nn.Module:
    """fp64 copy with every parameter moved off its init (norm weights != 1, A_log != 0, ...), so
    a test cannot pass on an identity-like initialization."""
    gen = torch.Generator().manual_seed(seed)
    module = module.double()
    with torch.no_grad():
        for p in module.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=gen, dtype=p.dtype))
    return module


_LOOP_HEADER = re.compile(r"for \(int (\w+) = 0; \1 < (\w+); \+\+\1\) \{")


def loop_headers(src, var, extent=None):
    """Headers of the generated loops over the kernel's own loop variable ``var`` (matched with any
    numeric suffix TileLang adds, var_1, var_2, ...), with this constant ``extent`` when given."""
    out = []
    for m in _LOOP_HEADER.finditer(src):
        if re.fullmatch(rf"{var}(?:_\d+)?", m.group(1)) and (extent is None or m.group(2) == str(extent)):
            out.append(m.group(0))
    return out


def mma_loop(src, var="c"):
    """Header of the loop over ``var`` that issues the asynchronous MMAs (the consumer's loop of
    a warp-specialised kernel, whose producer loop runs over the same variable)."""
    loops = [h for h in loop_headers(src, var) if "warpgroup_commit_batch" in loop_text(src, h)]
    assert len(loops) == 1, f"expected one MMA loop over {var}, found {loops}"
    return loops[0]


def loop_text(src, loop_header):
    """The text of the loop of generated CUDA that opens with `loop_header` (up to its closing brace)."""
    start = src.index(loop_header)
    depth, end = 0, start
    for end in range(start, len(src)):
        depth += {"{": 1, "}": -1}.get(src[end], 0)
        if depth == 0 and src[end] == "}":
            break
    return src[start:end]


# A store into a shared MMA operand in generated CUDA, either form TileLang emits (indexed, or
# pointer plus offset), for each 16-bit and TF32 element type; group 1 is the buffer's name.
SHARED_OPERAND_STORE = re.compile(r"\((?:tfloat32_t|bfloat16_t|half_t)\*\)(\w+_s)\)(?:\[.*[\]\)]| \+.*\)) =")


def _is_mma_wait(line):
    return "warpgroup_wait<0>" in line or "wait_wgmma<0>" in line


_WAIT_N = re.compile(r"(?:warpgroup_wait|wait_wgmma)<(\d+)>")
# a pipeline barrier of stage c % S (or c & 1) plus a base, in any of TileLang's spellings
_BARRIER = r"mbarrier\[\(+c(?:_\d+)? (?:%|&) \d+\)(?: \+ (\d+)\))?\]"
_EMPTY_WAIT = re.compile(_BARRIER + r"\.wait\(.*\^ 1\)")  # the producer waits for a slot to be free
_TMA_LOAD = re.compile(r"tma_load\(.*\(\((?:\w+)\*\)(\w+)\)\[")
_RELEASE_AT = re.compile(_BARRIER + r"\.arrive\(\)")
_DESCRIPTOR = re.compile(r"initialize_wgmma_descriptor.*\((?:tfloat32_t|bfloat16_t|half_t)\*\)(\w+)\)")


def _released_tiles(src):
    """{release barrier base: shared tile} of TileLang's TMA pipeline, read off the producer: it
    waits on a tile's "empty" barrier (mbarrier[c % S + base], parity ^ 1) before the TMA load into
    that tile, and the consumer arrives on the same barrier to hand the tile back."""
    tiles, base = {}, None
    for line in src.splitlines():
        m = _EMPTY_WAIT.search(line)
        if m:
            base = int(m.group(1) or 0)
            continue
        m = _TMA_LOAD.search(line)
        if m and base is not None:
            tiles.setdefault(base, m.group(1))
            base = None
    return tiles


def assert_released_after_wait(src, loop_header):
    """In the (consumer) loop opening with `loop_header`, taken cyclically: no mbarrier arrive (which
    hands a pipelined tile back to the TMA producer, who may then overwrite it) and no store into a
    shared operand (stmatrix or SHARED_OPERAND_STORE) while an MMA group committed before it, not yet
    waited for, may read it. Groups complete in order (wait<N>: all but the last N); a group reads
    the buffers of the descriptors built since the previous group (none seen: anything). A release
    is allowed with groups pending only if its tile is known from the producer (_released_tiles), no
    pending group reads it, and no MMA of the iteration reads it later (a release comes after the
    tile's last read); a store only if it names its buffer and no pending group reads that."""
    lines = loop_text(src, loop_header).splitlines()[1:]
    release = re.compile(r"(?<!warpgroup_)(?<!tma_store_)arrive\(|mbarrier_arrive\(")  # not the MMA fence
    tiles = _released_tiles(src)
    last_read = {}
    for n, line in enumerate(lines):
        m = _DESCRIPTOR.search(line)
        if m:
            last_read[m.group(1)] = n
    pending, reads = [], set()
    for sweep in range(2):  # the second sweep starts with what the end of the loop left pending
        for n, line in enumerate(lines):
            m = _DESCRIPTOR.search(line)
            if m:
                reads.add(m.group(1))
            if "warpgroup_commit_batch" in line:
                pending.append((n, frozenset(reads) if reads else None))
                reads = set()
                continue
            w = _WAIT_N.search(line)
            if w:
                keep = int(w.group(1))
                pending = pending[len(pending) - keep:] if keep else []
                continue
            if release.search(line):
                r = _RELEASE_AT.search(line)
                tile = tiles.get(int(r.group(1) or 0)) if r else None
                if tile is not None and last_read.get(tile, -1) > n:
                    raise AssertionError(f"line {n} of the loop ({line.strip()[:60]}) hands {tile} back "
                                         f"before the MMA at line {last_read[tile]} reads it")
                if not pending or (tile is not None and not any(g is None or tile in g for _, g in pending)):
                    continue
            elif not pending:
                continue
            elif "stmatrix" in line:  # the buffer when named, else any
                st = re.search(r"\((?:tfloat32_t|bfloat16_t|half_t)\*\)(\w+_s)\)", line)
                if st and not any(g is None or st.group(1) in g for _, g in pending):
                    continue
            else:
                st = SHARED_OPERAND_STORE.search(line)
                if not st or not any(g is None or st.group(1) in g for _, g in pending):
                    continue
            raise AssertionError(f"line {n} of the loop ({line.strip()[:60]}) while the MMA group "
                                 f"committed at line {pending[0][0]} may still read shared memory")


def async_mma_events(src, loop_header):
    """The loop of generated CUDA that opens with `loop_header`, as a list of events: ("bar",),
    ("fence",), ("wait",), ("issue", {buffers the MMA group reads}), ("store", buffer) for stores
    into 16-bit or TF32 shared operands (SHARED_OPERAND_STORE)."""
    events, reads = [], set()
    for line in loop_text(src, loop_header).splitlines():
        if "__syncthreads()" in line:
            events.append(("bar",))
        elif "fence_proxy_async" in line:
            events.append(("fence",))
        elif _is_mma_wait(line):
            events.append(("wait",))
        elif "initialize_wgmma_descriptor" in line:
            reads.add(re.search(r"\((?:tfloat32_t|bfloat16_t|half_t)\*\)(\w+)\)", line).group(1))
        elif "warpgroup_commit_batch" in line:
            events.append(("issue", frozenset(reads)))
            reads = set()
        else:
            m = SHARED_OPERAND_STORE.search(line)
            if m:
                events.append(("store", m.group(1)))
    return events


def assert_async_mma_order(events):
    """Asynchronous MMAs of two warpgroups and the stores into their shared operands, in a loop
    taken cyclically (iterations follow each other): every store into a shared operand must come
    after the wait of the last MMA group that read it and a block barrier after that wait (else the
    other warpgroup's MMA may still read it), and every MMA group must come after a barrier and a
    proxy fence that follow the last store into what it reads."""
    stored = {e[1] for e in events if e[0] == "store"}
    read = set().union(*(e[1] for e in events if e[0] == "issue"))
    assert stored and read and stored <= read, (stored, read)
    n = len(events)
    for i, e in enumerate(events):
        if e[0] == "store":  # backwards: a barrier, then a wait, before any group reading it
            seen_bar = False
            for j in range(1, n):
                f = events[(i - j) % n]
                if f[0] == "bar":
                    seen_bar = True
                elif f[0] == "wait" and seen_bar:
                    break
                elif f[0] == "issue" and e[1] in f[1]:
                    raise AssertionError(f"store into {e[1]} (event {i}) can race an MMA that reads it")
        if e[0] == "issue":  # backwards: a fence, then a barrier, before any store into what it reads
            seen_fence = seen_bar = False
            for j in range(1, n):
                f = events[(i - j) % n]
                if f[0] == "fence":
                    seen_fence = True
                elif f[0] == "bar" and seen_fence:
                    seen_bar = True
                elif f[0] == "issue" and seen_bar:
                    break
                elif f[0] == "store" and f[1] in e[1]:
                    assert seen_bar, f"MMA group (event {i}) may read {f[1]} before its store is visible"
                    break
