"""Fault injection on CPU: a killed rank, corrupted checkpoints, a torn metrics.jsonl, a full disk,
a drifted config, collectives that never complete, bad command lines. Each case checks that nothing
is lost, nothing is silent and nothing hangs.

The multi-rank cases run scripts/train.py under torchrun (2 ranks over gloo) on a tiny model; every
launch has a deadline (tests._dist.run_command kills the whole process tree past it).
"""

from __future__ import annotations

import errno
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from kda_cp.train import ConfigError, Trainer, compose_config, to_train_config, train
from kda_cp.train.metrics import continue_metrics

from tests._dist import descendants, finish, kill_tree, run_command, run_ranks
from tests._utils import ROOT, tiny_train

TINY = tiny_train(optim__warmup_steps=1)
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
OUR_FRAMES = 'scripts/train.py", line'  # a traceback frame of the training script (torchrun prints its own)


def _cfg(overrides):
    return compose_config(overrides)


def _torchrun(args, nproc=2, timeout=240, env=None):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           "scripts/train.py", *args]
    return run_command(cmd, cwd=ROOT, env=env or ENV, timeout=timeout)


def _python(args, timeout=120, env=None):
    clean = {k: v for k, v in (env or ENV).items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_PORT")}
    return run_command([sys.executable, "scripts/train.py", *args], cwd=ROOT, env=clean, timeout=timeout)


def _records(run: Path) -> list[dict]:
    """Every line of metrics.jsonl, parsed (fails on a line that is not JSON)."""
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def _error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("error: ")]


def _flip_bit(path: Path, rng: random.Random) -> None:
    data = bytearray(path.read_bytes())
    data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
    path.write_bytes(bytes(data))


# ------------------------------------------------------------------------------------------------
# A rank dies mid-run
# ------------------------------------------------------------------------------------------------


def _rank_of(pid: int) -> int | None:
    try:
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return None
    if b"scripts/train.py" not in cmdline:
        return None
    for item in env:
        if item.startswith(b"RANK="):
            return int(item[5:])
    return None


def _start_until_records(cmd, run: Path, n: int, env) -> subprocess.Popen:
    """Start a training command (its own session) and return once its metrics.jsonl holds ``n``
    records; fails, killing it, when it ends or takes 180 s before that."""
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    deadline = time.time() + 180
    while time.time() < deadline and proc.poll() is None:
        if (run / "metrics.jsonl").is_file() and (run / "metrics.jsonl").read_text().count("\n") >= n:
            return proc
        time.sleep(0.02)
    kill_tree(proc)
    raise AssertionError(f"the run ended or stalled before {n} records: " + proc.stderr.read()[-3000:])


@pytest.mark.slow
def test_killed_rank_ends_the_job_in_bounded_time(tmp_path):
    """SIGKILL rank 1 while both ranks train: the job (torchrun and rank 0) ends, non-zero, within
    a deadline far below the collective timeout, and the steps written so far stay readable."""
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "scripts/train.py",
           *TINY, "parallel.cp=2", "trainer.max_steps=100000", f"trainer.run_dir={run}", "parallel.timeout_s=120"]
    proc = _start_until_records(cmd, run, 2, ENV)
    try:
        workers = {_rank_of(p): p for p in descendants(proc.pid)}
        assert {0, 1} <= set(workers), workers
        os.kill(workers[1], signal.SIGKILL)
        t0 = time.time()
        _, err = finish(proc, 60)  # far below parallel.timeout_s=120: torchrun stops the survivors
        elapsed = time.time() - t0
    finally:
        if proc.poll() is None:
            kill_tree(proc)
    assert proc.returncode != 0, err[-3000:]
    assert elapsed < 60
    assert not [p for p in workers.values() if Path(f"/proc/{p}").exists()
                and Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"], "a rank survived"
    steps = [m["step"] for m in _records(run) if "loss" in m]
    assert steps[:2] == [1, 2]


@pytest.mark.slow
@pytest.mark.parametrize("launcher, sig", [("python", signal.SIGINT), ("torchrun", signal.SIGTERM)],
                         ids=["python-SIGINT", "torchrun-SIGTERM"])
def test_a_stop_signal_saves_the_step_and_the_resume_matches_an_unstopped_run(tmp_path, launcher, sig):
    """Ctrl-C (SIGINT) of one process, or a scheduler's SIGTERM to torchrun: every rank stops at the
    same step boundary after saving that step's checkpoint (checkpoint_every=0 would otherwise
    keep nothing) and exits non-zero, and trainer.resume=true then gives the loss curve of a run
    that never stopped, bitwise."""
    steps = 300
    args = [*TINY, f"trainer.max_steps={steps}"]
    if launcher == "torchrun":
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "scripts/train.py",
               *args, "parallel.cp=2"]
    else:
        clean = {k: v for k, v in ENV.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_PORT")}
        cmd = [sys.executable, "scripts/train.py", *args, "parallel.cp=1"]
    env = ENV if launcher == "torchrun" else clean
    run, ref = tmp_path / "run", tmp_path / "ref"
    proc = _start_until_records([*cmd, f"trainer.run_dir={run}"], run, 3, env)
    try:
        os.kill(proc.pid, sig)
        _, err = finish(proc, 120)
    finally:
        if proc.poll() is None:
            kill_tree(proc)
    stopped = [m["step"] for m in _records(run) if "loss" in m]
    n = stopped[-1]
    assert 3 <= n < steps, (n, err[-3000:])
    # one process exits 128 + signal; torchrun, itself stopped by the signal, exits 1 once the ranks end
    assert proc.returncode == (128 + sig if launcher == "python" else 1), err[-3000:]
    assert f"stopped: stopped by {sig.name} after step {n}: checkpoint " in err, err[-3000:]
    assert sorted(p.name for p in (run / "checkpoints").glob("step_*")) == [f"step_{n:08d}"]
    assert not (run / "summary.json").exists()
    resumed = run_command([*cmd, f"trainer.run_dir={run}", "trainer.resume=true"], cwd=ROOT, env=env, timeout=240)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    whole = run_command([*cmd, f"trainer.run_dir={ref}"], cwd=ROOT, env=env, timeout=240)
    assert whole.returncode == 0, whole.stderr[-3000:]
    strip = [{k: v for k, v in m.items() if k != "tokens_per_s"} for m in _records(run)]
    assert strip == [{k: v for k, v in m.items() if k != "tokens_per_s"} for m in _records(ref)]


def _group_timeout_rank(rank, world, timeout_s):
    from kda_cp.train.distributed import ParallelDims

    dims = ParallelDims.from_cp(world, world)
    dims.build_mesh("cpu", timeout=timedelta(seconds=timeout_s))
    if rank == 1:  # never joins: rank 0's collectives must give up after timeout_s
        time.sleep(2 * timeout_s + 5)  # then exits: without the deadline rank 0 would wait for that
        return None
    out = {}
    for name, group in (("cp", dims.cp_group), ("dp_cp", dims.dp_cp_group)):
        t0 = time.time()
        try:
            dist.all_reduce(torch.ones(1), group=group)
            out[name] = ("completed", time.time() - t0)
        except RuntimeError as exc:
            out[name] = (str(exc).splitlines()[0][:200], time.time() - t0)
    return out


@pytest.mark.slow
def test_training_groups_have_a_finite_deadline():
    """The mesh's groups get parallel.timeout_s (torch would give new groups 30 min): a collective
    that a rank never joins fails on the waiting rank after about that long."""
    out = run_ranks(_group_timeout_rank, 2, 1, timeout=90)[0]
    for name, (what, elapsed) in out.items():
        assert what != "completed" and elapsed < 4, (name, what, elapsed)


# ------------------------------------------------------------------------------------------------
# Corrupted checkpoints and a torn metrics.jsonl, under torchrun
# ------------------------------------------------------------------------------------------------

CKPT = [*TINY, "parallel.cp=2", "trainer.max_steps=8", "trainer.checkpoint_every=2", "trainer.keep_checkpoints=4"]


@pytest.mark.slow
def test_corrupted_checkpoints_fall_back_then_refuse(tmp_path):
    """Steps 8, 6, 4 corrupted by a bit flip, same-size garbage and truncation, and metrics.jsonl
    torn mid-line: the resume warns about each, continues from step 2, and its losses and metrics
    equal the uninterrupted run's bit for bit. With every checkpoint corrupted, the resume refuses
    with one error line and leaves metrics.jsonl and the checkpoints as they were."""
    rng = random.Random(0)
    run = tmp_path / "run"
    proc = _torchrun([*CKPT, f"trainer.run_dir={run}"])
    assert proc.returncode == 0, proc.stderr[-4000:]
    ref = _records(run)
    ck = run / "checkpoints"
    assert sorted(p.name for p in ck.iterdir()) == [f"step_0000000{s}" for s in (2, 4, 6, 8)]
    _flip_bit(ck / "step_00000008" / "state.pt", rng)
    garbage = ck / "step_00000006" / "state.pt"
    garbage.write_bytes(rng.randbytes(garbage.stat().st_size))
    cut = ck / "step_00000004" / "rng_rank1.pt"
    cut.write_bytes(cut.read_bytes()[:100])
    metrics = run / "metrics.jsonl"
    metrics.write_bytes(metrics.read_bytes()[:-20])  # the last record cut mid-line

    proc = _torchrun([*CKPT, f"trainer.run_dir={run}", "trainer.resume=true"])
    assert proc.returncode == 0, proc.stderr[-4000:]
    err = proc.stderr
    assert "step_00000008 is incomplete or corrupted (file state.pt does not match its sha256" in err, err[-3000:]
    assert "step_00000006 is incomplete or corrupted (file state.pt does not match its sha256" in err
    assert "step_00000004 is incomplete or corrupted (file rng_rank1.pt has 100 bytes" in err
    assert "step_00000002 at step 2" in err
    got = _records(run)  # every line parses: the torn one is gone
    keys = ("step", "loss", "grad_norm", "lr", "val_loss")
    assert [{k: m.get(k) for k in keys} for m in got] == [{k: m.get(k) for k in keys} for m in ref]

    for d in ck.iterdir():
        _flip_bit(d / "state.pt", rng)
    before = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
    proc = _torchrun([*CKPT, f"trainer.run_dir={run}", "trainer.resume=true"])
    assert proc.returncode != 0
    lines = _error_lines(proc.stderr)
    assert len(lines) == 1 and lines[0].startswith("error: trainer.resume=true: no valid checkpoint in "), proc.stderr
    assert "does not match its sha256" in lines[0] and OUR_FRAMES not in proc.stderr
    assert {p: p.read_bytes() for p in run.rglob("*") if p.is_file()} == before


def test_unloadable_checkpoint_falls_back(tmp_path, caplog):
    """A checkpoint whose files pass the manifest (here one without digests) but do not unpickle:
    the resume warns with the loader's error and continues, exactly, from the one before."""
    base = [*TINY, "parallel.cp=1", "trainer.max_steps=4", "trainer.checkpoint_every=2"]
    train(_cfg([*base, f"trainer.run_dir={tmp_path / 'full'}"]))
    run = tmp_path / "run"
    shutil.copytree(tmp_path / "full", run)
    step4 = run / "checkpoints" / "step_00000004"
    state = step4 / "state.pt"
    state.write_bytes(random.Random(1).randbytes(state.stat().st_size))
    manifest = json.loads((step4 / "MANIFEST.json").read_text())
    manifest["files"] = {rel: e["size"] for rel, e in manifest["files"].items()}  # sizes only
    (step4 / "MANIFEST.json").write_text(json.dumps(manifest))
    with caplog.at_level("WARNING"):
        summary = train(_cfg([*base, f"trainer.run_dir={run}", "trainer.resume=true"]))
    assert "step_00000004 could not be loaded (step_00000004: rank 0: UnpicklingError" in caplog.text, caplog.text
    assert summary["start_step"] == 2
    assert [m.get("loss") for m in _records(run)] == [m.get("loss") for m in _records(tmp_path / "full")]


def test_metrics_torn_or_past_the_checkpoint_are_cut_and_appended(tmp_path):
    """metrics.jsonl on resume: the bytes up to the resumed step are kept as they were, the rest
    (records of later steps, a torn line) dropped; a last record without its newline gets one."""
    path = tmp_path / "metrics.jsonl"
    lines = [json.dumps({"step": s, "loss": 1.0 / s}) + "\n" for s in (1, 2, 3)]
    lines.insert(2, json.dumps({"step": 2, "val_loss": 0.7}) + "\n")
    head = "".join(lines)
    path.write_text(head + json.dumps({"step": 4, "loss": 0.2}) + "\n" + '{"step": 5, "lo')
    kept = continue_metrics(path, 3)
    assert path.read_text() == head and [m["step"] for m in kept] == [1, 2, 2, 3]
    path.write_text(head + '{"step": 4, "lo')  # torn right after the resumed step
    assert len(continue_metrics(path, 4)) == 4 and path.read_text() == head
    path.write_text(head.rstrip("\n"))
    assert len(continue_metrics(path, 3)) == 4 and path.read_text() == head


# ------------------------------------------------------------------------------------------------
# A full disk while writing a checkpoint
# ------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_full_disk_while_checkpointing(tmp_path):
    """A tmpfs with room for one checkpoint and a half: step 2's checkpoint is written, step 4's
    fails. Both ranks stop with one line "checkpoint step 4: no space left on device (<path>)",
    no .tmp-step_* directory is left, and step 2's checkpoint still verifies."""
    if os.geteuid() != 0:
        pytest.skip("needs root to mount a small tmpfs (a full disk); not root here")
    # the size of a 2-rank checkpoint: rank 0's state.pt + one rng file per rank (+ manifest, config)
    probe = tmp_path / "probe"
    train(_cfg([*TINY, "parallel.cp=1", "trainer.max_steps=1", f"trainer.run_dir={probe}"]))
    files = list((probe / "checkpoints" / "step_00000001").iterdir())
    page = 4096
    pages = sum(-(-f.stat().st_size // page) for f in files) + 1  # + the second rank's rng file
    state_pages = -(-(probe / "checkpoints" / "step_00000001" / "state.pt").stat().st_size // page)
    mnt = tmp_path / "disk"
    mnt.mkdir()
    size_kb = (pages + 4 + state_pages // 2) * page // 1024  # + config.yaml, metrics.jsonl, dirs
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_kb}k", "tmpfs", str(mnt)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    try:
        run = mnt / "run"
        proc = _torchrun([*TINY, "parallel.cp=2", "trainer.max_steps=6", "trainer.checkpoint_every=2",
                          f"trainer.run_dir={run}"])
        assert proc.returncode != 0
        lines = _error_lines(proc.stderr)
        assert len(lines) == 1, proc.stderr[-4000:]
        assert lines[0].startswith("error: checkpoint step 4: no space left on device ("), lines
        assert str(run / "checkpoints") in lines[0] and OUR_FRAMES not in proc.stderr
        from kda_cp.checkpoint import verify

        assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_00000002"]
        assert verify(run / "checkpoints" / "step_00000002") == (2, "")
        assert [m["step"] for m in _records(run) if "loss" in m] == [1, 2, 3, 4]
    finally:
        subprocess.run(["umount", str(mnt)], check=False)


def test_checkpoint_write_error_message_names_step_reason_and_path(tmp_path):
    """What a full disk reports without a tmpfs: the OSError of a write (ENOSPC), in train's words."""
    from kda_cp.checkpoint import CheckpointManager, CheckpointWriteError

    m = CheckpointManager(tmp_path, rank=0, barrier=lambda: None)

    def full(tmp):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(tmp / "state.pt"))

    with pytest.raises(CheckpointWriteError, match=r"^checkpoint step 7: no space left on device \(.*state\.pt\)$"):
        m.save(7, full)
    assert not list(m.root.iterdir())


# ------------------------------------------------------------------------------------------------
# A resume with a drifted config
# ------------------------------------------------------------------------------------------------


def test_drifted_config_is_refused_and_safe_keys_are_not(tmp_path):
    base = [*TINY, "parallel.cp=1", "trainer.max_steps=4", "trainer.checkpoint_every=2"]
    run = tmp_path / "run"
    train(_cfg([*base, f"trainer.run_dir={run}"]))
    text = tmp_path / "text.txt"
    text.write_bytes(bytes(range(256)) * 200)
    before = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
    resume = [*base, f"trainer.run_dir={run}", "trainer.resume=true"]
    for override, named in (("data.seq_len=32", "data.seq_len (64 -> 32)"), ("data.batch_size=2", "data.batch_size"),
                            ("model.d_model=48", "model.d_model (32 -> 48)"), (f"data.path={text}", "data.path"),
                            ("optim.lr=0.01", "optim.lr"), ("trainer.seed=3", "trainer.seed"),
                            ("trainer.precision=bf16", "trainer.precision ('fp32' -> 'bf16')")):
        with pytest.raises(ConfigError, match="differs from that of .*step_00000004") as info:
            train(_cfg([*resume, override]))
        assert named in str(info.value), (override, str(info.value))
    assert {p: p.read_bytes() for p in run.rglob("*") if p.is_file()} == before
    # one line from the command line, and nothing written
    proc = _python([*resume, "data.seq_len=32", "model.n_layers=4"])
    assert proc.returncode == 1
    lines = _error_lines(proc.stderr)
    assert len(lines) == 1 and "data.seq_len (64 -> 32), model.n_layers (2 -> 4)" in lines[0], proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert {p: p.read_bytes() for p in run.rglob("*") if p.is_file()} == before
    # the loop's and the output's keys may change; precision=fp32 is what "auto" computed on the CPU
    summary = train(_cfg([*resume, "trainer.max_steps=6", "trainer.log_every=1", "trainer.val_every=3",
                          "trainer.checkpoint_every=3", "trainer.keep_checkpoints=3", "trainer.precision=fp32"]))
    assert summary["start_step"] == 4 and [m["step"] for m in _records(run) if "loss" in m] == list(range(1, 7))


# ------------------------------------------------------------------------------------------------
# Command-line errors: one line, once, no run directory
# ------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_errors_under_torchrun_print_one_line_and_leave_no_run_dir(tmp_path):
    run = tmp_path / "run"
    proc = _torchrun([*TINY, "parallel.cp=2", "data.path=/no/such/corpus", f"trainer.run_dir={run}"], timeout=120)
    assert proc.returncode != 0
    assert _error_lines(proc.stderr) == ["error: data.path='/no/such/corpus' is neither a file nor a folder"], \
        proc.stderr[-3000:]
    assert OUR_FRAMES not in proc.stderr and not run.exists()
    proc = _torchrun([*TINY, "+trainer.foo=1", f"trainer.run_dir={run}"], timeout=120)
    assert _error_lines(proc.stderr) == [
        "error: unknown config key(s): trainer.foo (python scripts/train.py --help lists the groups; each group's "
        "keys are the fields of its dataclass)"], proc.stderr[-3000:]
    assert proc.returncode != 0 and not run.exists()


def test_resume_without_a_checkpoint_refuses(tmp_path):
    """trainer.resume=true on a run directory with metrics but no valid checkpoint: exit 1, one
    line, metrics.jsonl untouched (today's behaviour of starting again at step 0 would replace it)."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 1, "loss": 5.0}\n')
    proc = _python([*TINY, "parallel.cp=1", "trainer.max_steps=2", f"trainer.run_dir={run}", "trainer.resume=true"])
    assert proc.returncode == 1
    assert _error_lines(proc.stderr) == [f"error: trainer.resume=true: no valid checkpoint in {run / 'checkpoints'} "
                                         "(no checkpoint was written); nothing was changed. Restore a checkpoint, or "
                                         "start a fresh run with a new trainer.run_dir"], proc.stderr[-3000:]
    assert (run / "metrics.jsonl").read_text() == '{"step": 1, "loss": 5.0}\n'
    assert sorted(p.name for p in run.iterdir()) == ["metrics.jsonl"]


def test_paths_of_the_run_directory(tmp_path, monkeypatch):
    """~ in trainer.run_dir is the home directory (as in data.path), and resuming a run directory
    that does not exist says so instead of 'no valid checkpoint'."""
    monkeypatch.setenv("HOME", str(tmp_path))
    summary = train(_cfg([*TINY, "parallel.cp=1", 'trainer.run_dir="~/home run"', "trainer.max_steps=2"]))
    assert summary["run_dir"] == str(tmp_path / "home run")
    assert (tmp_path / "home run" / "summary.json").is_file()
    with pytest.raises(ConfigError, match=r"LexerNoViableAlt.*quote such a value inside the override"):
        _cfg(["trainer.run_dir=~/unquoted"])
    with pytest.raises(ConfigError, match=r"trainer.run_dir=\S*missing does not exist: pass the directory of the run"):
        _run(tmp_path / "missing", "trainer.resume=true")
    assert not (tmp_path / "missing").exists()


def test_help_and_debug_traceback():
    proc = _python(["--help"])
    assert proc.returncode == 0, proc.stderr
    for text in ("Train a KDA", "Config groups", "deepspeed: none | zero1 | zero2 | zero3", "+experiment:",
                 "parallel.cp=N", "trainer.resume=true", "KDA_CP_DEBUG=1", "timeout_s=300"):
        assert text in proc.stdout, text
    assert "Powered by Hydra" not in proc.stdout
    proc = _python(["model.kda.segment_len=true", "parallel.cp=1"])  # Hydra's reason comes along
    assert proc.returncode == 1 and "Value 'True' of type 'bool' is incompatible" in _error_lines(proc.stderr)[0]
    proc = _python(["+foo=1"])
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert _error_lines(proc.stderr) == [
        "error: unknown config key(s): foo (python scripts/train.py --help lists the groups; each group's keys are "
        "the fields of its dataclass)"]
    proc = _python(["+foo=1"], env={**ENV, "KDA_CP_DEBUG": "1"})
    assert proc.returncode != 0 and "Traceback" in proc.stderr and "ConfigError: unknown config key" in proc.stderr


def test_failure_in_the_first_step_leaves_no_run_dir(tmp_path, monkeypatch):
    """The run directory is made just before the first step and removed if that step fails; once a
    step is recorded it stays."""
    run = tmp_path / "run"
    real = Trainer.loss_sum
    calls = []

    def fails_at(n):
        def loss_sum(*args, **kwargs):
            calls.append(1)
            if len(calls) == n:
                raise RuntimeError("injected failure")
            return real(*args, **kwargs)

        return loss_sum

    monkeypatch.setattr(Trainer, "loss_sum", fails_at(1))
    with pytest.raises(RuntimeError, match="injected failure"):
        train(_cfg([*TINY, "parallel.cp=1", "trainer.max_steps=3", f"trainer.run_dir={run}"]))
    assert not run.exists()
    calls.clear()
    monkeypatch.setattr(Trainer, "loss_sum", fails_at(2))
    with pytest.raises(RuntimeError, match="injected failure"):
        train(_cfg([*TINY, "parallel.cp=1", "trainer.max_steps=3", f"trainer.run_dir={run}"]))
    assert [m["step"] for m in _records(run)] == [1]


# ------------------------------------------------------------------------------------------------
# The run directory, the corpus, the schedule and the end of a run
# ------------------------------------------------------------------------------------------------


def _files(run: Path) -> dict:
    return {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}


def _run(run: Path, *extra):
    steps = [] if any(e.startswith("trainer.max_steps=") for e in extra) else ["trainer.max_steps=3"]
    return train(_cfg([*TINY, "parallel.cp=1", f"trainer.run_dir={run}", *steps, *extra]))


def test_nan_gradients_stop_the_run_before_the_step_is_saved(tmp_path, monkeypatch):
    """A step whose loss is finite but whose gradients are not: the run stops at that step (named
    as metrics.jsonl numbers it), the weights are not updated, nothing of the step is saved, and
    the checkpoint of the step before it (keep_checkpoints=1) survives and resumes."""
    from kda_cp.train.engine import TorchEngine

    run = tmp_path / "run"
    real = TorchEngine.reduce
    calls = []

    def poisoned(self, loss_sum, stop=False):
        out = real(self, loss_sum, stop)
        calls.append(1)
        if len(calls) == 2:
            next(iter(self.params)).grad.view(-1)[0] = float("nan")
        return out

    monkeypatch.setattr(TorchEngine, "reduce", poisoned)
    extra = ["trainer.max_steps=4", "trainer.checkpoint_every=1", "trainer.keep_checkpoints=1"]
    with pytest.raises(FloatingPointError, match=r"gradient norm is nan at step 2 .*the newest checkpoint holds "
                                                 r"step 1 \(trainer.resume=true continues from it\)"):
        _run(run, *extra)
    steps = sorted(p.name for p in (run / "checkpoints").glob("step_*"))
    assert steps == ["step_00000001"], steps
    state = torch.load(run / "checkpoints" / "step_00000001" / "state.pt", weights_only=False)
    assert all(torch.isfinite(t).all() for t in state["model"].values())
    assert [m["step"] for m in _records(run)] == [1]
    monkeypatch.setattr(TorchEngine, "reduce", real)
    assert _run(run, *extra, "trainer.resume=true")["start_step"] == 1


def test_a_second_run_in_the_same_directory_is_refused(tmp_path):
    """A run holds an flock on <run_dir>/.lock while it writes: another run there (fresh or resumed)
    is refused with the holder named and nothing changed; a holder that is killed (SIGKILL) frees
    it, and a finished run frees it."""
    run = tmp_path / "run"
    _run(run, "trainer.checkpoint_every=1")
    holder = subprocess.Popen([sys.executable, "-c", (
        "import fcntl, sys, time; f = open(sys.argv[1], 'a+'); fcntl.flock(f, fcntl.LOCK_EX); "
        "f.seek(0); f.truncate(); f.write('pid 4242 on elsewhere'); f.flush(); print('locked', flush=True); "
        "time.sleep(120)"), str(run / ".lock")], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        before = _files(run)
        with pytest.raises(ConfigError, match=r"being written by another run \(pid 4242 on elsewhere"):
            _run(run, "trainer.max_steps=5", "trainer.resume=true")
        assert _files(run) == before
    finally:
        holder.kill()
        holder.wait()
    assert _run(run, "trainer.max_steps=5", "trainer.resume=true")["start_step"] == 3
    assert _run(run, "trainer.max_steps=6", "trainer.resume=true")["start_step"] == 5  # freed at the end


def test_a_fresh_run_never_overwrites_what_it_did_not_write(tmp_path):
    """An empty trainer.run_dir (the current directory) is refused; a fresh run refuses a directory
    that holds a config.yaml, summary.json or loss.png, or whose checkpoints/ is a file, before any
    step, and leaves those files as they were."""
    with pytest.raises(ValueError, match="trainer.run_dir must not be empty"):
        to_train_config(_cfg([*TINY, "trainer.run_dir="]))
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "config.yaml").write_text("my own config\n")
    with pytest.raises(ConfigError, match="already holds config.yaml"):
        _run(mine)
    assert _files(mine) == {mine / "config.yaml": b"my own config\n"}
    blocked = tmp_path / "blocked"
    blocked.mkdir()
    (blocked / "checkpoints").write_text("not a directory\n")
    t0 = time.time()
    with pytest.raises(ConfigError, match="is a file"):
        _run(blocked, "trainer.max_steps=50")
    assert time.time() - t0 < 30 and not (blocked / "metrics.jsonl").exists()


def test_a_fresh_run_checks_the_directory_again_under_its_lock(tmp_path):
    """Two fresh runs given one trainer.run_dir: B passes the check of its constructor, A then runs
    to the end there and releases the lock; B, taking the lock, must see A's run and refuse,
    leaving every file of A as it was."""
    run = tmp_path / "run"
    b = Trainer(_cfg([*TINY, "parallel.cp=1", f"trainer.run_dir={run}", "trainer.max_steps=3", "optim.lr=1e-3"]))
    _run(run)
    before = _files(run)
    with pytest.raises(ConfigError, match="already holds a run"):
        b.fit()
    assert _files(run) == before


def test_a_resume_refuses_when_the_run_advanced_after_it_loaded(tmp_path):
    """B loads the step-3 checkpoint; another resume then extends the run to step 5 and ends; B,
    taking the lock, must refuse rather than train steps 4-5 again over the newer checkpoint."""
    run = tmp_path / "run"
    _run(run)
    b = Trainer(_cfg([*TINY, "parallel.cp=1", f"trainer.run_dir={run}", "trainer.max_steps=5", "trainer.resume=true"]))
    assert b.start_step == 3
    assert _run(run, "trainer.max_steps=5", "trainer.resume=true")["start_step"] == 3
    before = _files(run)
    with pytest.raises(ConfigError, match="advanced to step 5 while this run loaded step 3"):
        b.fit()
    assert _files(run) == before


def test_a_run_killed_before_its_first_step_leaves_a_reusable_directory(tmp_path):
    """What a run leaves when killed after claiming its directory and before step 1 (.lock,
    config.yaml, an empty metrics.jsonl, an empty checkpoints/): a fresh run there goes ahead; a
    user's own config.yaml without those is still refused."""
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / ".lock").write_text("pid 4242 on elsewhere")
    (run / "config.yaml").write_text("trainer: {}\n")
    (run / "metrics.jsonl").write_text("")
    assert _run(run)["steps"] == 3
    assert len(_records(run)) == 4  # three steps and the final validation
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "config.yaml").write_text("my own config\n")
    (mine / "metrics.jsonl").write_text("")
    with pytest.raises(ConfigError, match="already holds config.yaml"):
        _run(mine)


def test_an_unwritable_checkpoint_directory_fails_before_the_first_step(tmp_path, monkeypatch):
    """Every rank writes a probe file into checkpoints/ before the first step: a read-only
    filesystem there (simulated: the probe's write fails with EROFS) ends the run at once, before
    any training, and a directory the run made is removed."""
    real = Path.write_bytes

    def read_only(self, data):
        if self.name.startswith(".probe-rank"):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(self))
        return real(self, data)

    monkeypatch.setattr(Path, "write_bytes", read_only)
    run = tmp_path / "run"
    with pytest.raises(ConfigError, match="cannot write checkpoints into .*read-only file system"):
        _run(run, "trainer.max_steps=50")
    assert not run.exists()


def test_resume_refuses_a_changed_corpus(tmp_path):
    """The checkpoint records the corpus's size and sha256: the same data.path with other bytes is
    refused on resume (the same steps would read other batches), nothing changed."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_bytes(bytes(range(256)) * 400)
    run = tmp_path / "run"
    _run(run, f"data.path={corpus}", "trainer.max_steps=2")
    before = _files(run)
    corpus.write_bytes(bytes(range(255, -1, -1)) * 400)
    with pytest.raises(ConfigError, match="the corpus differs"):
        _run(run, f"data.path={corpus}", "trainer.max_steps=3", "trainer.resume=true")
    assert _files(run) == before


def test_extending_a_run_follows_the_new_schedule_from_the_resumed_step(tmp_path):
    """Resumed with a larger trainer.max_steps, the first resumed step already takes the new
    cosine's learning rate (the optimizer's state holds the old schedule's last value)."""
    from kda_cp.train.config import OptimConfig
    from kda_cp.train.optim import lr_lambda

    run = tmp_path / "run"
    _run(run, "trainer.max_steps=4")
    _run(run, "trainer.max_steps=8", "trainer.resume=true")
    lrs = {m["step"]: m["lr"] for m in _records(run) if "lr" in m}
    peak = _cfg(TINY).optim.lr
    cfg = OptimConfig(lr=peak, warmup_steps=1)
    for step in (5, 6, 7, 8):
        assert lrs[step] == pytest.approx(peak * lr_lambda(cfg, 8)(step - 1), rel=1e-12), (step, lrs)


def test_resuming_a_finished_run_changes_nothing(tmp_path):
    """Resumed at its last step with its summary.json: nothing is written and that summary comes
    back. Without it (killed after the last checkpoint): the summary is made again from an
    evaluation, with no duplicate val_loss record and no new checkpoint."""
    run = tmp_path / "run"
    summary = _run(run)
    before = _files(run)
    again = _run(run, "trainer.resume=true")
    assert _files(run) == before
    assert again == json.loads((run / "summary.json").read_text()) and again["val_loss"] == summary["val_loss"]
    (run / "summary.json").unlink()
    records = _records(run)
    ckpt = {p: p.read_bytes() for p in (run / "checkpoints").rglob("*") if p.is_file()}
    remade = _run(run, "trainer.resume=true")
    assert remade["val_loss"] == summary["val_loss"] and remade["tokens"] == 0
    assert remade["median_tokens_per_s"] is None
    def no_nan(constant):
        raise AssertionError(f"summary.json holds {constant}: not JSON")

    assert json.loads((run / "summary.json").read_text(), parse_constant=no_nan) == remade
    assert _records(run) == records
    assert {p: p.read_bytes() for p in (run / "checkpoints").rglob("*") if p.is_file()} == ckpt


def test_damaged_metrics_line_drops_only_itself(tmp_path):
    """A damaged record in the middle of metrics.jsonl is dropped alone (with a warning); the
    records after it up to the resumed step stay."""
    path = tmp_path / "metrics.jsonl"
    good = [json.dumps({"step": s, "loss": 1.0 / s}) + "\n" for s in (1, 2, 3, 4, 5)]
    path.write_text(good[0] + good[1] + '{"step": 3, "lo\x00ss": \n' + good[3] + good[4])
    kept = continue_metrics(path, 5)
    assert [m["step"] for m in kept] == [1, 2, 4, 5]
    assert path.read_text() == good[0] + good[1] + good[3] + good[4]


@pytest.mark.parametrize("bad", ['{"step": Infinity, "loss": 1.0}', '{"step": 1e400}', '{"step": NaN}'])
def test_a_step_that_is_no_integer_is_a_damaged_line(tmp_path, bad):
    """json reads Infinity, 1e400 and NaN as floats that int() refuses (OverflowError, ValueError):
    such a line is dropped like any damaged one, and the resume goes on."""
    path = tmp_path / "metrics.jsonl"
    good = [json.dumps({"step": s, "loss": 1.0 / s}) + "\n" for s in (1, 2, 3)]
    path.write_text(good[0] + bad + "\n" + good[1] + good[2])
    assert [m["step"] for m in continue_metrics(path, 3)] == [1, 2, 3]
    assert path.read_text() == "".join(good)


@pytest.mark.parametrize("override,field", [("optim.eps=inf", "optim.eps"), ("parallel.threads_per_rank=0",
                                                                           "parallel.threads_per_rank"),
                                            ("parallel.threads_per_rank=-1", "parallel.threads_per_rank")])
def test_bad_numbers_name_their_key(override, field):
    with pytest.raises(ValueError, match=field):
        to_train_config(_cfg([*TINY, override]))


def test_nan_before_any_checkpoint_says_there_is_nothing_to_resume(tmp_path, monkeypatch):
    """With no checkpoint written yet (checkpoint_every=0 saves at the end only), the error says
    so and where to go instead of naming checkpoints that do not exist."""
    from kda_cp.train.engine import TorchEngine

    real = TorchEngine.reduce

    def poisoned(self, loss_sum, stop=False):
        out = real(self, loss_sum, stop)
        next(iter(self.params)).grad.view(-1)[0] = float("nan")
        return out

    monkeypatch.setattr(TorchEngine, "reduce", poisoned)
    with pytest.raises(FloatingPointError, match=r"at step 1 .*no checkpoint was written yet "
                                                 r"\(trainer.checkpoint_every=0\).*new trainer.run_dir"):
        _run(tmp_path / "run", "trainer.max_steps=3", "trainer.checkpoint_every=0")


def test_a_bool_key_takes_true_or_false_only():
    """Hydra reads any nonzero int as true: trainer.resume=4 (meant as "step 4") would resume the
    newest checkpoint. Bool keys take true or false (any case), else a ConfigError naming the key."""
    with pytest.raises(ConfigError, match=r"trainer.resume must be true or false, got '4'.*newest"):
        compose_config(["trainer.resume=4"])
    with pytest.raises(ConfigError, match="trainer.plot must be true or false"):
        compose_config(["trainer.plot=yes"])
    assert compose_config(["trainer.progress=False"]).trainer.progress is False


def test_hydra_settings_and_sweeps_are_refused_not_ignored():
    with pytest.raises(ConfigError, match="the run directory is trainer.run_dir"):
        compose_config(["hydra.run.dir=/tmp/elsewhere"])
    with pytest.raises(ConfigError, match="sweeps"):
        compose_config(["--multirun", "trainer.max_steps=1,2"])


_FAIL_CONFIG_ON_RANK0 = """
import errno, os, runpy, sys
from pathlib import Path
real = Path.write_text
def full(self, data, *a, **k):
    if self.name == "config.yaml" and os.environ.get("RANK") == "0":
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self))
    return real(self, data, *a, **k)
Path.write_text = full
sys.argv = ["scripts/train.py", *sys.argv[1:]]
runpy.run_path("scripts/train.py", run_name="__main__")
"""


def test_rank0_failing_to_write_the_run_metadata_stops_every_rank_at_once(tmp_path):
    """Only rank 0 writes config.yaml: when that write fails (a full disk, simulated), every rank
    stops before the first step with that one error (not the other rank's lost connection or a
    collective timeout), and the run directory the job made is removed."""
    wrapper = tmp_path / "train_full_disk.py"
    wrapper.write_text(_FAIL_CONFIG_ON_RANK0)
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(wrapper),
           *TINY, "parallel.cp=2", "trainer.max_steps=3", f"trainer.run_dir={run}"]
    t0 = time.monotonic()
    proc = run_command(cmd, cwd=ROOT, env=ENV, timeout=240)
    assert proc.returncode != 0
    lines = _error_lines(proc.stderr)
    assert len(lines) == 1, proc.stderr[-4000:]
    assert "cannot write the run's metadata" in lines[0] and "no space left on device" in lines[0].lower(), lines
    assert time.monotonic() - t0 < 120  # not the training groups' deadline
    assert not run.exists()
