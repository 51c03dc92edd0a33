"""Training at scale on CPU (gloo): dp x cp layouts x ZeRO stages x CP strategies give the loss curve
of one process; SIGKILL + resume continues exactly; a torn checkpoint falls back to the previous one.

Each layout test is ONE torchrun of 4 ranks that trains the three layouts (dp 2 x cp 2, dp 1 x cp 4,
dp 4 x cp 1) one after the other (tests/_train_layouts.py), compared with one in-process run.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kda_cp.train import train

from tests._deepspeed import has_deepspeed, require_deepspeed
from tests._dist import finish, kill_tree, run_command
from tests._utils import ROOT, tiny_train

pytestmark = pytest.mark.slow

STEPS = 20
# Tiny hybrid model ("KA": a KDA and an attention block), 4 heads so ulysses runs at cp = 4.
TINY = tiny_train(model__kda__num_heads=4, model__kda__head_dim=8, model__attention__num_heads=4,
                  model__attention__head_dim=8, model__layer_pattern="KA", trainer__max_steps=STEPS,
                  parallel__timeout_s=60)
LAYOUTS = {"dp2xcp2": 2, "dp1xcp4": 4, "dp4xcp1": 1}
CONFIGS = {
    "scan": ["parallel.strategy=scan"],
    "ulysses": ["parallel.strategy=ulysses"],
    "zero1": ["deepspeed=zero1"],
    "zero2": ["deepspeed=zero2"],
    "zero3": ["deepspeed=zero3", "deepspeed.param_persistence_threshold=0"],  # partition every parameter
}
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"}


def _compose(overrides):
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return compose(config_name="config", overrides=overrides)


def _metrics(run_dir: Path, key: str) -> dict[int, float]:
    lines = [json.loads(s) for s in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {m["step"]: m[key] for m in lines if key in m}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """One process, the same global batches: the curve every layout must reproduce."""
    run = tmp_path_factory.mktemp("ref") / "run"
    train(_compose(TINY + ["parallel.cp=1", f"trainer.run_dir={run}"]))
    return run


@pytest.mark.parametrize("name", list(CONFIGS))
def test_layouts_give_the_loss_curve_of_one_process(reference, tmp_path, name):
    if name.startswith("zero") or (name == "ulysses" and has_deepspeed()):
        require_deepspeed()  # ulysses_impl=auto takes DeepSpeed's all-to-all when it is installed
    cases = [TINY + CONFIGS[name] + [f"parallel.cp={cp}", f"trainer.run_dir={tmp_path / lay}"] for lay, cp in LAYOUTS.items()]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=4",
           "tests/_train_layouts.py", json.dumps(cases)]
    proc = run_command(cmd, cwd=ROOT, env=ENV, timeout=300)
    assert proc.returncode == 0, f"stdout:\n{proc.stdout[-1500:]}\nstderr:\n{proc.stderr[-6000:]}"
    ref_loss, ref_gn = _metrics(reference, "loss"), _metrics(reference, "grad_norm")
    assert len(ref_loss) == STEPS and ref_loss[STEPS] < ref_loss[1] - 0.3  # it trains
    for lay in LAYOUTS:
        loss, gn = _metrics(tmp_path / lay, "loss"), _metrics(tmp_path / lay, "grad_norm")
        assert sorted(loss) == list(range(1, STEPS + 1)), lay
        for s in range(1, STEPS + 1):
            # Only the order of reductions differs: measured at most 1.9e-7 (loss) and 3.8e-7 (grad
            # norm) relative over all layouts and configs on 2 CPU cores.
            assert abs(loss[s] - ref_loss[s]) / abs(ref_loss[s]) < 2e-6, (name, lay, s, loss[s], ref_loss[s])
            # AdamW and clipping hide a wrong gradient scale from the loss; the grad norm does not.
            assert abs(gn[s] - ref_gn[s]) / abs(ref_gn[s]) < 2e-6, (name, lay, s, gn[s], ref_gn[s])
        summary = json.loads((tmp_path / lay / "summary.json").read_text())
        assert summary["cp"] == LAYOUTS[lay] and summary["dp"] == 4 // LAYOUTS[lay]
        assert summary["zero_stage"] == (int(name[-1]) if name.startswith("zero") else 0)


# ------------------------------------------------------------------------------------------------
# SIGKILL after a checkpoint, resume, same losses
# ------------------------------------------------------------------------------------------------

KILL = [o for o in TINY if not o.startswith(("trainer.max_steps", "data.seq_len"))] + [
    "data.seq_len=256", "trainer.max_steps=40", "trainer.checkpoint_every=5", "parallel.cp=2",
]


def _launch(run_dir: Path, extra=()) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           "scripts/train.py", *KILL, f"trainer.run_dir={run_dir}", *extra]
    return subprocess.Popen(cmd, cwd=ROOT, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.mark.parametrize("ds", ["none", "zero3"])
def test_sigkill_then_resume_continues_exactly(tmp_path, ds):
    if ds != "none":
        require_deepspeed()
    extra = [f"deepspeed={ds}"]
    full = _launch(tmp_path / "full", extra)
    _, err = finish(full, 300)
    assert full.returncode == 0, err[-6000:]

    run = tmp_path / "killed"
    proc = _launch(run, extra)
    marker = run / "checkpoints" / "step_00000010" / "MANIFEST.json"
    deadline = time.time() + 240
    while not marker.exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.02)
    assert proc.poll() is None, "the run ended before it could be killed: " + proc.stderr.read()[-3000:]
    # SIGKILL the ranks and the launcher (torchrun starts its workers in sessions of their own, so
    # killing the launcher's process group alone would leave the ranks training).
    victims = kill_tree(proc)
    assert victims, "no rank processes found under the launcher"
    time.sleep(1.0)
    assert not any(_alive(p) for p in victims), "a rank survived SIGKILL"
    proc.stderr.close()
    assert not (run / "checkpoints" / "step_00000040").exists(), "killed too late"
    steps_before = max(_metrics(run, "loss"))

    resumed = _launch(run, extra + ["trainer.resume=true"])
    _, err = finish(resumed, 300)
    assert resumed.returncode == 0, err[-6000:]
    import re

    at = re.search(r"resumed from \S+step_(\d+) at step (\d+)", err)
    assert at is not None, err[-3000:]
    resumed_at = int(at.group(2))
    assert 10 <= resumed_at < 40 and resumed_at % 5 == 0, resumed_at
    ref, got = _metrics(tmp_path / "full", "loss"), _metrics(run, "loss")
    assert sorted(got) == list(range(1, 41)), sorted(got)
    assert steps_before >= 10
    # the same batches, weights, optimizer state, schedule and layout: bit-identical losses
    assert [got[s] for s in range(1, 41)] == [ref[s] for s in range(1, 41)]
    assert _metrics(run, "val_loss")[40] == _metrics(tmp_path / "full", "val_loss")[40]
    if ds == "none":  # resuming a 2-rank checkpoint in one process: a clear error, not a missing-file crash
        with pytest.raises(ValueError, match="written by 2 ranks, this run has 1"):
            train(_compose([o for o in KILL if o != "parallel.cp=2"]
                                           + ["parallel.cp=1", f"trainer.run_dir={run}", "trainer.resume=true"]))


# ------------------------------------------------------------------------------------------------
# A checkpoint cut off mid-write is detected and the previous one used
# ------------------------------------------------------------------------------------------------


def test_torn_checkpoint_falls_back_to_the_previous_one(tmp_path, caplog):
    base = [o for o in TINY if not o.startswith("trainer.max_steps")] + [
        "parallel.cp=1", "trainer.max_steps=8", "trainer.checkpoint_every=2", "trainer.keep_checkpoints=4",
    ]
    full = tmp_path / "full"
    train(_compose(base + [f"trainer.run_dir={full}"]))
    ckpts = full / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir()) == [f"step_0000000{s}" for s in (2, 4, 6, 8)]

    run = tmp_path / "torn"
    shutil.copytree(full, run)
    ck = run / "checkpoints"
    shutil.rmtree(ck / "step_00000008")  # the run "died" after step 8's write began:
    state = ck / "step_00000006" / "state.pt"  # step 6 torn (a file shorter than its manifest says)
    state.write_bytes(state.read_bytes()[: state.stat().st_size // 2])
    (ck / "step_00000007").mkdir()  # a directory that was never sealed (no manifest)
    (ck / "step_00000007" / "state.pt").write_bytes(b"partial")
    (ck / ".tmp-step_00000008").mkdir()  # an unfinished write
    with caplog.at_level("INFO"):
        train(_compose(base + [f"trainer.run_dir={run}", "trainer.resume=true"]))
    assert "step_00000006 is incomplete" in caplog.text and "step_00000007 is incomplete" in caplog.text
    ref, got = _metrics(full, "loss"), _metrics(run, "loss")
    assert sorted(got) == list(range(1, 9))
    assert [got[s] for s in range(5, 9)] == [ref[s] for s in range(5, 9)]  # resumed from step 4, bit for bit
    assert "step_00000004 at step 4" in caplog.text  # "resumed from <...>/step_00000004 at step 4"
