"""kda_cp.checkpoint: atomic directories sealed by a manifest; torn ones are skipped."""

from __future__ import annotations

import json

import pytest

from kda_cp.checkpoint import MANIFEST, CheckpointManager, verify


def _write(payload: bytes):
    def write(tmp):
        (tmp / "a.bin").write_bytes(payload)
        (tmp / "sub").mkdir()
        (tmp / "sub" / "b.bin").write_bytes(payload * 2)

    return write


def test_save_seals_and_latest_skips_torn(tmp_path):
    m = CheckpointManager(tmp_path, rank=0, barrier=lambda: None, keep=2)
    assert m.latest() is None
    for step in (3, 6, 9):
        m.save(step, _write(bytes([step]) * 100))
    names = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert names == ["step_00000006", "step_00000009"]  # keep=2 pruned step 3
    meta = json.loads((tmp_path / "checkpoints" / "step_00000009" / MANIFEST).read_text())
    assert meta == {"step": 9, "files": {"a.bin": 100, "sub/b.bin": 200}}
    assert m.latest().step == 9

    (tmp_path / "checkpoints" / "step_00000009" / "sub" / "b.bin").write_bytes(b"x")  # torn
    assert verify(tmp_path / "checkpoints" / "step_00000009")[0] is None
    assert m.latest().step == 6
    (tmp_path / "checkpoints" / "step_00000006" / MANIFEST).unlink()  # never sealed
    assert m.latest() is None


def test_interrupted_write_leaves_previous(tmp_path):
    m = CheckpointManager(tmp_path, rank=0, barrier=lambda: None)
    m.save(1, _write(b"ok"))

    def dies(tmp):
        (tmp / "a.bin").write_bytes(b"half")
        raise KeyboardInterrupt  # killed mid-write

    with pytest.raises(KeyboardInterrupt):
        m.save(2, dies)
    assert (tmp_path / "checkpoints" / ".tmp-step_00000002").exists()
    assert not (tmp_path / "checkpoints" / "step_00000002").exists()
    assert m.latest().step == 1
    m.save(2, _write(b"again"))  # a later save of the same step replaces the leftover
    assert m.latest().step == 2
    with pytest.raises(ValueError, match="keep_checkpoints"):
        CheckpointManager(tmp_path, 0, lambda: None, keep=0)
