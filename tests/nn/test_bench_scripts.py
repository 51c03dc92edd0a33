"""The layer and end-to-end benchmarks on CPU: their JSON and table, the peer skipped with a message
when absent, and the model option that selects the peer's layer."""
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from kda_cp.layers import KDAConfig
from kda_cp.model import ModelConfig

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))


def test_bench_layer_writes_its_table_and_json(tmp_path):
    out = tmp_path / "layer.json"
    proc = subprocess.run([sys.executable, "scripts/bench_layer.py", "--shapes", "tiny", "--repeats", "1",
                           "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    if importlib.util.find_spec("fla") is None:
        assert "flash-linear-attention is not installed" in proc.stdout
    assert "| shape | layer | forward ms | fwd+bwd ms |" in proc.stdout
    d = json.loads(out.read_text())
    assert {"torch", "device", "repeats"} <= d["meta"].keys()
    (row,) = d["rows"]
    assert row["shape"]["name"] == "tiny"
    assert row["kda_cp"]["fwd_ms"] > 0 and row["kda_cp"]["fwd_bwd_ms"] > 0


def test_bench_hybrid_skips_an_absent_peer_and_records_its_run(tmp_path, monkeypatch, capsys):
    import bench_hybrid

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "fla" else find_spec(name, *a))
    out = tmp_path / "hybrid.json"
    tiny = ["parallel.device=cpu", "model.d_model=32", "model.n_layers=2", "model.layer_pattern=KA",
            "model.kda.num_heads=2", "model.kda.head_dim=16", "model.kda.output_gate_rank=16",
            "model.attention.num_heads=2", "model.attention.head_dim=16", "data.seq_len=128",
            "trainer.precision=fp32"]
    monkeypatch.setattr(sys, "argv", ["bench_hybrid.py", "--steps", "2", "--workdir", str(tmp_path), "--out", str(out),
                                      "--", *tiny])
    bench_hybrid.main()
    printed = capsys.readouterr().out
    assert "flash-linear-attention is not installed: skipping its run" in printed
    d = json.loads(out.read_text())
    assert {"device", "torch", "date", "command"} <= d["meta"].keys() and "fla" not in d["meta"]
    assert list(d["rows"]) == ["kda_cp"] and d["rows"]["kda_cp"]["median_tokens_per_s"] > 0
    assert d["rows"]["kda_cp"]["steps"] == 2

    monkeypatch.setattr(sys, "argv", ["bench_hybrid.py", "--impls", "fla", "--out", str(out)])
    with pytest.raises(SystemExit, match="nothing to run"):
        bench_hybrid.main()


def test_model_kda_impl_names_the_choices():
    with pytest.raises(ValueError, match="model.kda_impl must be 'kda_cp' or 'fla', got 'flax'"):
        ModelConfig(kda_impl="flax")


def test_peer_layer_without_the_package_is_an_import_error_naming_it(monkeypatch):
    from kda_cp.peer import FlaKDALayer

    monkeypatch.setitem(sys.modules, "fla.layers.kda", None)  # import fails as if not installed
    with pytest.raises(ImportError, match="pip install flash-linear-attention"):
        FlaKDALayer(KDAConfig(d_model=32, num_heads=2, head_dim=16, output_gate_rank=16))


def test_bench_layer_prints_the_stream_table_for_rows_that_have_it(capsys):
    import bench_layer

    m = {"fwd_ms": 3.4, "fwd_bwd_ms": 11.9, "peak_MiB": 3136, "fwd_stream_ms": 3.21, "fwd_host_ms": 0.42,
         "fwd_bwd_stream_ms": 11.5, "fwd_bwd_host_ms": 1.37}
    peer = {k: v * 2 for k, v in m.items()}
    row = {"shape": {"name": "L1"}, "kda_cp": m, "fla": peer, "speedup_fwd_ms": 2.0, "speedup_fwd_bwd_ms": 2.0}
    bench_layer.print_rows([row])
    out = capsys.readouterr().out
    assert "| shape | layer | fwd stream ms (host) | fwd+bwd stream ms (host) |" in out
    assert "| L1 | kda_cp | 3.21 (0.42) | 11.50 (1.37) |" in out
    assert "| L1 | fla | 6.42 (0.84) | 23.00 (2.74) |" in out
    bench_layer.print_rows([{"shape": {"name": "tiny"}, "kda_cp": {"fwd_ms": 1.0, "fwd_bwd_ms": 2.0}}])
    assert "stream ms" not in capsys.readouterr().out  # CPU rows carry no stream metrics
