"""kda_cp.checkpoint: atomic directories sealed by a manifest; torn ones are skipped."""

from __future__ import annotations

import hashlib
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
    sha = lambda b: hashlib.sha256(b).hexdigest()  # noqa: E731
    assert meta == {"step": 9, "files": {"a.bin": {"size": 100, "sha256": sha(bytes([9]) * 100)},
                                         "sub/b.bin": {"size": 200, "sha256": sha(bytes([9]) * 200)}}}
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
    for keep in (0, 1.5, "2"):
        with pytest.raises(ValueError, match="keep_checkpoints"):
            CheckpointManager(tmp_path, 0, lambda: None, keep=keep)
    with pytest.raises(ValueError, match="step must be an int >= 0"):
        m.save(-1, _write(b"x"))
    bad = tmp_path / "checkpoints" / "step_00000099"  # a manifest naming an absurd step is skipped, not a crash
    bad.mkdir()
    (bad / MANIFEST).write_text('{"step": 1e400, "files": {}}')
    assert verify(bad)[0] is None and m.latest().step == 2


def test_resave_of_a_step_never_leaves_it_missing(tmp_path, monkeypatch):
    """keep=1 and the same step saved again (a run resumed from its last checkpoint): killed between
    setting the old copy aside and moving the new one in, the old copy is still found."""
    import kda_cp.checkpoint as ckpt

    m = CheckpointManager(tmp_path, rank=0, barrier=lambda: None, keep=1)
    m.save(4, _write(b"first"))
    real_replace, calls = ckpt.os.replace, []

    def replace_dies_on_the_move_in(src, dst):
        calls.append((str(src), str(dst)))
        if str(src).endswith(".tmp-step_00000004"):
            raise KeyboardInterrupt
        return real_replace(src, dst)

    monkeypatch.setattr(ckpt.os, "replace", replace_dies_on_the_move_in)
    with pytest.raises(KeyboardInterrupt):
        m.save(4, _write(b"second"))
    monkeypatch.setattr(ckpt.os, "replace", real_replace)
    assert any(d.endswith(".old-step_00000004") for _, d in calls)  # the old copy was set aside
    found = m.latest()
    assert found is not None and found.step == 4 and (found.path / "a.bin").read_bytes() == b"first"
    m.save(4, _write(b"third"))  # a later save puts a new copy in place and drops the old one
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_00000004"]
    assert (m.latest().path / "a.bin").read_bytes() == b"third"


def test_prune_never_drops_the_checkpoint_just_written(tmp_path):
    """Checkpoints of higher steps (left by an earlier run) must not push out the one just saved."""
    m = CheckpointManager(tmp_path, rank=0, barrier=lambda: None, keep=2)
    for step in (100, 200):
        m.save(step, _write(bytes([step % 251]) * 10))
    path = m.save(10, _write(b"new"))
    assert path.is_dir() and (path / "a.bin").read_bytes() == b"new"
    m.save(20, _write(b"newer"))
    names = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert names == ["step_00000010", "step_00000020", "step_00000100", "step_00000200"]


def test_sha256_catches_same_size_corruption(tmp_path, caplog):
    """A flipped bit or same-size garbage keeps every size: only the digest tells, and latest()
    falls back to the previous checkpoint with a warning naming the file."""
    import random

    m = CheckpointManager(tmp_path, rank=0, barrier=lambda: None, keep=3)
    rng = random.Random(0)
    for step in (1, 2, 3):
        m.save(step, _write(rng.randbytes(1000)))
    assert m.latest().step == 3
    f = m.path(3) / "a.bin"
    data = bytearray(f.read_bytes())
    data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
    f.write_bytes(bytes(data))
    with caplog.at_level("WARNING"):
        assert m.latest().step == 2
    assert "a.bin does not match its sha256" in caplog.text and "step_00000003" in caplog.text
    assert verify(m.path(3), hashes=False)[0] == 3  # the sizes alone would pass it
    g = m.path(2) / "sub" / "b.bin"
    g.write_bytes(rng.randbytes(g.stat().st_size))
    assert m.latest().step == 1 and len(m.skipped) == 2
    assert m.latest(before=1) is None


def test_manifest_entries_outside_the_checkpoint_or_odd_steps_are_refused(tmp_path):
    """A manifest naming a file outside its directory (absolute, or through ..) or a step that is
    not an int (true, 5.9) marks the checkpoint unreadable: it is skipped, not trusted."""
    m = CheckpointManager(tmp_path, rank=0, barrier=lambda: None)
    m.save(5, _write(b"old"))
    outside = tmp_path / "outside.bin"
    outside.write_bytes(b"xyz")
    good = json.loads((m.path(5) / MANIFEST).read_text())
    for files, step in (({str(outside): 3}, 5), ({"../outside.bin": 3}, 5), (good["files"], True),
                        (good["files"], 5.9)):
        (m.path(5) / MANIFEST).write_text(json.dumps({"step": step, "files": files}))
        step_read, why = verify(m.path(5))
        assert step_read is None and "unreadable" in why, (files, step, why)
        assert m.latest() is None
    (m.path(5) / MANIFEST).write_text(json.dumps(good))
    assert m.latest().step == 5


def test_manifest_without_digests_is_checked_by_size(tmp_path):
    """Manifests written before digests were recorded ({file: size}) still load."""
    m = CheckpointManager(tmp_path, rank=0, barrier=lambda: None)
    m.save(5, _write(b"old"))
    (m.path(5) / MANIFEST).write_text(json.dumps({"step": 5, "files": {"a.bin": 3, "sub/b.bin": 6}}))
    assert m.latest().step == 5
    (m.path(5) / "a.bin").write_bytes(b"ol")
    assert m.latest() is None


def test_failed_write_is_reported_cleaned_and_keeps_earlier(tmp_path):
    """An OSError (a full disk) in any rank's write: "checkpoint step N: <reason> (<path>)", no
    temporary directory left, the earlier checkpoint intact; the other ranks raise the same."""
    import errno

    from kda_cp.checkpoint import CheckpointWriteError

    m = CheckpointManager(tmp_path, rank=0, barrier=lambda: None)
    m.save(1, _write(b"good"))
    before = {p: p.read_bytes() for p in m.path(1).rglob("*") if p.is_file()}

    def full(tmp):
        (tmp / "a.bin").write_bytes(b"partial")
        raise OSError(errno.ENOSPC, "No space left on device", str(tmp / "a.bin"))

    with pytest.raises(CheckpointWriteError, match=r"^checkpoint step 2: no space left on device \(.*a\.bin\)$"):
        m.save(2, full)
    assert sorted(p.name for p in m.root.iterdir()) == ["step_00000001"]
    assert {p: p.read_bytes() for p in m.path(1).rglob("*") if p.is_file()} == before
    # rank 1's view: its own write succeeded, another rank's failed; the agreement names that one
    other = "checkpoint step 3: no space left on device (/elsewhere)"
    m1 = CheckpointManager(tmp_path, rank=1, barrier=lambda: None, agree=lambda err: err or other)
    with pytest.raises(CheckpointWriteError, match=r"step 3: no space left on device \(/elsewhere\)"):
        m1.save(3, _write(b"fine"))
    with pytest.raises(CheckpointWriteError, match=r"step 4: RuntimeError: boom"):
        m.save(4, lambda tmp: (_ for _ in ()).throw(RuntimeError("boom")))
    assert m.latest().step == 1 and not list(m.root.glob(".tmp-*"))


def test_leftovers_of_a_killed_save_or_prune_are_removed_by_the_next_save(tmp_path):
    """A process killed while pruning leaves a step directory without its manifest (or with files
    missing), one killed while writing a .tmp-step directory: the next save removes both, keeps the
    complete checkpoints it should, and latest() no longer warns about them."""
    m = CheckpointManager(tmp_path, rank=0, barrier=lambda: None, keep=2)
    for step in (2, 4):
        m.save(step, _write(bytes([step]) * 10))
    root = tmp_path / "checkpoints"
    (root / "step_00000001").mkdir()  # pruning cut off after emptying it
    (root / "step_00000003").mkdir()
    (root / "step_00000003" / "a.bin").write_bytes(b"half")
    (root / ".tmp-step_00000005").mkdir()  # a save of step 5 killed mid-write
    (root / ".tmp-step_00000005" / "a.bin").write_bytes(b"partial")
    m.save(6, _write(b"\x06" * 10))
    assert sorted(p.name for p in root.iterdir()) == ["step_00000004", "step_00000006"]
    m.latest()
    assert m.skipped == []
