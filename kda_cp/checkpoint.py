"""Atomic, verifiable checkpoint directories: written aside, sealed with a manifest, renamed into place.

Layout under a run directory::

    checkpoints/step_00000040/      a complete checkpoint (whatever the writer put there:
        ...                         torch.save files, or DeepSpeed's per-rank shards)
        MANIFEST.json               written LAST: step, and every file's relative path, size
                                    and sha256
    checkpoints/.tmp-step_00000050/ a checkpoint being written (ignored when reading)

Saving (collective over all ranks): rank 0 makes an empty ``.tmp-step_N``; every rank writes its
files into it (``write(tmp_dir)``); once every rank has written, rank 0 lists the files with their
sizes and sha256 digests into ``MANIFEST.json`` (itself written to a temporary name and
os.replace'd), fsyncs, and renames the
directory to ``step_N`` with os.replace (atomic on one filesystem); older checkpoints beyond
``keep`` are deleted, never the one just written, and so are what a process killed mid-save or
mid-prune left (``.tmp-step_*`` directories, ``step_N`` directories that fail the size check). A process killed at any point leaves either the
previous complete checkpoint or the new one, never a half-written ``step_N`` that passes
verification. Saving a step that already has a checkpoint (a run resumed before it) first renames
the old copy to ``.old-step_N``, which :meth:`CheckpointManager.latest` still reads should the
process die before the new copy is in place, and deletes it after. An error while saving on any
rank (an OSError such as a full disk, or torch's own write errors) removes the temporary directory
on rank 0, leaves the earlier checkpoints as they were, and raises :class:`CheckpointWriteError`
("checkpoint step N: <reason> (<path>)") on every rank.

Reading: :meth:`CheckpointManager.complete` walks the ``step_*`` directories from the newest and
keeps those whose manifest exists, parses, names the step, and matches every listed file's size and
sha256; a directory that fails (cut off mid-write, truncated or corrupted file, missing manifest) is
logged with the reason and skipped, so an earlier checkpoint is used. Manifests written before
digests were recorded (sizes only) are checked by size. :meth:`CheckpointManager.latest` is the
first of them.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

__all__ = ["CheckpointManager", "CheckpointInfo", "CheckpointWriteError", "MANIFEST", "verify", "sha256_file"]

logger = logging.getLogger(__name__)

MANIFEST = "MANIFEST.json"
_PREFIX = "step_"
_TMP_PREFIX = ".tmp-"
_OLD_PREFIX = ".old-"


class CheckpointWriteError(OSError):
    """Saving a checkpoint failed on some rank; the message is "checkpoint step N: <reason> (<path>)"."""


@dataclass(frozen=True)
class CheckpointInfo:
    step: int
    path: Path


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def sha256_file(path: Path, block: int = 1 << 22) -> str:
    """Hex sha256 of a file's bytes, read in blocks of ``block`` bytes."""
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(block):
            h.update(chunk)
    return h.hexdigest()


def _listing(root: Path) -> dict[str, dict]:
    return {
        str(p.relative_to(root)): {"size": p.stat().st_size, "sha256": sha256_file(p)}
        for p in sorted(root.rglob("*"))
        if p.is_file() and p.name != MANIFEST
    }


def verify(path: Path, hashes: bool = True) -> tuple[int | None, str]:
    """(step, "") when ``path`` holds a complete checkpoint, else (None, the reason).

    ``hashes``: also compare every file's sha256 with the manifest (reads every byte); False
    checks the sizes only.
    """
    manifest = path / MANIFEST
    if not manifest.is_file():
        return None, f"no {MANIFEST} (cut off before it was sealed)"
    try:
        meta = json.loads(manifest.read_text())
        step, files = meta["step"], dict(meta["files"])
        if isinstance(step, bool) or not isinstance(step, int):
            raise ValueError(f"step must be an int, got {step!r}")
        # an entry is {"size": n, "sha256": hex}, or the bare size of a manifest without digests
        entries = {rel: (e, None) if isinstance(e, int) else (int(e["size"]), e.get("sha256"))
                   for rel, e in files.items()}
    except (ValueError, KeyError, TypeError, OverflowError, AttributeError, UnicodeDecodeError) as exc:
        return None, f"unreadable {MANIFEST}: {exc}"
    for rel, (size, digest) in entries.items():
        if Path(rel).is_absolute() or ".." in Path(rel).parts:
            return None, f"unreadable {MANIFEST}: entry {rel!r} is not a path inside the checkpoint"
        f = path / rel
        if not f.is_file():
            return None, f"missing file {rel}"
        if f.stat().st_size != size:
            return None, f"file {rel} has {f.stat().st_size} bytes, the manifest says {size}"
        if hashes and digest is not None and sha256_file(f) != digest:
            return None, f"file {rel} does not match its sha256 in the manifest (corrupted)"
    return step, ""


def _reason(exc: BaseException, where: Path) -> tuple[str, str]:
    """(reason, path) of a failed write, for "checkpoint step N: <reason> (<path>)".

    torch.save to a path reports a full disk as RuntimeError("... iostream error"): when the
    filesystem has no space left, the reason says so.
    """
    path = str(getattr(exc, "filename", None) or where)
    code = getattr(exc, "errno", None)
    if isinstance(exc, OSError) and code:
        return os.strerror(code).lower(), path
    try:
        full = os.statvfs(where if where.exists() else where.parent).f_bavail == 0
    except OSError:
        full = False
    if full:
        return os.strerror(errno.ENOSPC).lower(), path
    return f"{type(exc).__name__}: {exc}", path


class CheckpointManager:
    """Writes and finds the checkpoints of one run (see the module docstring).

    Args:
        run_dir: the run directory (shared by all ranks).
        rank: this process's global rank (rank 0 creates, seals, renames and prunes).
        barrier: a callable that blocks until every rank reached it (``lambda: None`` for one process).
        keep: number of complete checkpoints kept (>= 1; 2 keeps a fallback).
        agree: collective ``agree(error: str | None) -> str | None``: every rank passes its own
            error (or None) and gets the first failing rank's error (or None when all succeeded).
            Every stage of a save ends in it. The default calls ``barrier`` and returns the
            argument: right for one process; with several, a rank whose write failed would
            leave the others waiting in the next barrier, so pass a real ``agree``.

    Raises:
        ValueError: keep is not an int >= 1.
    """

    def __init__(self, run_dir: str | Path, rank: int, barrier: Callable[[], None], keep: int = 2,
                 agree: Callable[[str | None], str | None] | None = None) -> None:
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
            raise ValueError(f"trainer.keep_checkpoints must be an int >= 1, got {keep!r}")
        self.root = Path(run_dir) / "checkpoints"
        self.rank = rank
        self.barrier = barrier
        self.keep = keep
        self.agree = agree or self._barrier_only

    def _barrier_only(self, error: str | None) -> str | None:
        """The default ``agree``: synchronizes through ``barrier``; shares no other rank's error."""
        self.barrier()
        return error

    def path(self, step: int) -> Path:
        return self.root / f"{_PREFIX}{step:08d}"

    def save(self, step: int, write: Callable[[Path], None]) -> Path:
        """Collective: every rank calls ``write(tmp_dir)`` to put its files in; returns the final dir.

        Raises:
            ValueError: step is not an int >= 0 (checked before anything is written).
            CheckpointWriteError: on every rank, when making the directory, any rank's ``write``
                or the sealing raised an Exception: "checkpoint step N: <reason> (<path>)", e.g.
                "no space left on device". The temporary directory is removed; earlier
                checkpoints are untouched.
        """
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"checkpoint step must be an int >= 0, got {step!r}")
        final = self.path(step)
        tmp = self.root / f"{_TMP_PREFIX}{final.name}"

        def stage(fn) -> None:  # run fn on this rank, then fail together if any rank failed
            error = None
            try:
                fn()
            except Exception as exc:
                reason, where = _reason(exc, tmp)
                error = f"checkpoint step {step}: {reason} ({where})"
            error = self.agree(error)
            if error is not None:
                if self.rank == 0:
                    shutil.rmtree(tmp, ignore_errors=True)
                raise CheckpointWriteError(error)

        def make() -> None:
            if self.rank == 0:
                self.root.mkdir(parents=True, exist_ok=True)
                for stale in self.root.glob(f"{_TMP_PREFIX}{_PREFIX}*"):  # left by a run killed mid-save
                    shutil.rmtree(stale, ignore_errors=True)
                tmp.mkdir()

        stage(make)
        stage(lambda: write(tmp))
        stage(lambda: self._seal(step, tmp) if self.rank == 0 else None)
        stage(lambda: self._publish(step, tmp, final) if self.rank == 0 else None)
        return final

    def _publish(self, step: int, tmp: Path, final: Path) -> None:
        """Rename the sealed ``tmp`` to ``final`` (an existing copy set aside first), then prune."""
        old = self.root / f"{_OLD_PREFIX}{final.name}"
        if final.exists():  # a re-run of the same step: the old copy is set aside, not deleted yet
            if old.exists():
                shutil.rmtree(old)
            os.replace(final, old)
        os.replace(tmp, final)
        _fsync_dir(self.root)
        if old.exists():
            shutil.rmtree(old)
        self._prune(step)
        logger.info("checkpoint step %d -> %s", step, final)

    def _seal(self, step: int, tmp: Path) -> None:
        """fsync every file, then write MANIFEST.json (sizes and sha256) by an atomic rename."""
        for f in tmp.rglob("*"):
            if f.is_file():
                with open(f, "rb+") as fh:
                    os.fsync(fh.fileno())
        files = _listing(tmp)  # before the manifest's own temporary file exists
        sealed = tmp / (MANIFEST + ".tmp")
        with open(sealed, "w") as fh:
            fh.write(json.dumps({"step": step, "files": files}, indent=1))
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(sealed, tmp / MANIFEST)
        _fsync_dir(tmp)

    def _prune(self, written: int) -> None:
        """Keep the checkpoint just written and the ``keep - 1`` newest complete ones before it
        (complete by the sizes in their manifests: pruning does not read every byte). Incomplete
        directories before it (a process killed while pruning or writing) go too: no resume can
        use them."""
        older, broken = [], []
        for c in self._candidates():
            if c.step < written:
                (older if verify(c.path, hashes=False)[0] is not None else broken).append(c)
        for c in broken:
            logger.warning("removing incomplete checkpoint %s (%s)", c.path, verify(c.path, hashes=False)[1])
        for c in older[self.keep - 1 :] + broken:
            shutil.rmtree(c.path, ignore_errors=True)

    def _candidates(self) -> list[CheckpointInfo]:
        """``step_N`` directories, newest first; a ``.old-step_N`` (set aside by a re-save of step N
        that did not finish) stands in for a missing ``step_N``."""
        if not self.root.is_dir():
            return []
        found: dict[int, Path] = {}
        for prefix in (_OLD_PREFIX + _PREFIX, _PREFIX):  # step_N wins over .old-step_N
            for p in self.root.iterdir():
                if p.is_dir() and p.name.startswith(prefix) and p.name[len(prefix) :].isdigit():
                    found[int(p.name[len(prefix) :])] = p
        return [CheckpointInfo(s, found[s]) for s in sorted(found, reverse=True)]

    def complete_steps(self) -> list[int]:
        """Steps of the checkpoints whose manifest and files are all there (sizes only, no sha256),
        newest first."""
        return [c.step for c in self._candidates() if verify(c.path, hashes=False)[0] is not None]

    def latest(self, before: int | None = None) -> CheckpointInfo | None:
        """The newest complete checkpoint (of a step < ``before`` when given), or None.

        Incomplete or corrupted directories met on the way are logged as warnings with the reason
        and skipped (and listed in :attr:`skipped`). Verifying reads every byte (sha256), so call
        it on one rank.
        """
        self.skipped: list[str] = []
        for c in self._candidates():
            if before is not None and c.step >= before:
                continue
            step, why = verify(c.path)
            if step is not None and step != c.step:
                why = f"its manifest names step {step}"
            if not why:
                return c
            self.skipped.append(f"{c.path.name}: {why}")
            logger.warning("checkpoint %s is incomplete or corrupted (%s): using an earlier one", c.path, why)
        return None
