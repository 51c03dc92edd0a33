"""The trainer (kda_cp.train) end to end: a tiny in-process run, resume, and CP / DP invariance of the loss."""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir

from kda_cp.model import KDALanguageModel
from kda_cp.train import ConfigError, TrainConfig, build_layout, compose_config, to_train_config, train

from tests._dist import run_command
from tests._utils import ROOT, tiny_train

TINY = tiny_train(data__seq_len=96, trainer__max_steps=3)


def _cfg(overrides):
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return compose(config_name="config", overrides=overrides)


def _losses(run_dir: Path, key: str = "loss") -> list[float]:
    lines = [json.loads(s) for s in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [m[key] for m in lines if key in m]


def _in_process(run_dir: Path, extra=()):
    cfg = _cfg(TINY + ["parallel.cp=1", f"trainer.run_dir={run_dir}", *extra])
    return train(cfg)


def test_overrides_compose():
    cfg = _cfg(["parallel.cp=4", "trainer.max_steps=7", "data.seq_len=300", "model.n_layers=5"])
    from omegaconf import OmegaConf

    tc = OmegaConf.to_object(cfg)
    assert isinstance(tc, TrainConfig)
    assert (tc.parallel.cp, tc.trainer.max_steps, tc.data.seq_len, tc.model.n_layers) == (4, 7, 300, 5)
    with pytest.raises(Exception):
        _cfg(["model.no_such_field=1"])


def test_layout():
    lay = build_layout(world_size=6, rank=4, cp=2, device=torch.device("cpu"))
    assert (lay.dp, lay.cp, lay.dp_rank, lay.cp_rank) == (3, 2, 2, 0)
    with pytest.raises(ValueError, match="parallel.cp"):
        build_layout(world_size=4, rank=0, cp=3, device=torch.device("cpu"))


def test_bad_train_config(tmp_path):
    with pytest.raises(ValueError, match="parallel.cp=2"):
        train(_cfg(TINY + ["parallel.cp=2"]))
    with pytest.raises(ValueError, match="trainer.run_dir"):
        train(_cfg(TINY + ["trainer.resume=true"]))
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="parallel.device=cuda, but"):
            train(_cfg(TINY + ["parallel.cp=1", "parallel.device=cuda"]))
    with pytest.raises(ValueError, match="parallel.backend=nccl needs CUDA tensors"):
        train(_cfg(TINY + ["parallel.cp=1", "parallel.device=cpu", "parallel.backend=nccl"]))
    (tmp_path / "a_file").write_text("notes")
    with pytest.raises(ValueError, match="trainer.run_dir must be a directory"):
        train(_cfg(TINY + ["parallel.cp=1", f"trainer.run_dir={tmp_path / 'a_file'}"]))
    assert (tmp_path / "a_file").read_text() == "notes"


def test_tiny_run_writes_outputs(tmp_path):
    summary = _in_process(tmp_path / "run")
    run = tmp_path / "run"
    losses = _losses(run)
    assert len(losses) == 3 and all(math.isfinite(v) for v in losses)
    lines = [json.loads(s) for s in (run / "metrics.jsonl").read_text().splitlines()]
    assert {"step", "loss", "tokens_per_s", "lr"} <= set(lines[0])
    assert any("val_loss" in m for m in lines)
    ckpt_dir = run / "checkpoints" / "step_00000003"
    ckpt = torch.load(ckpt_dir / "state.pt", weights_only=False)
    assert ckpt["step"] == 3 and {"model", "optim", "scheduler"} <= set(ckpt)
    assert (ckpt_dir / "MANIFEST.json").exists() and (ckpt_dir / "rng_rank0.pt").exists()
    assert not list((run / "checkpoints").glob(".tmp-*"))
    summary_file = json.loads((run / "summary.json").read_text())
    assert summary_file["peak_memory_gib"] > 0 and summary_file["train_flops_per_token"] > 0
    assert (run / "config.yaml").exists() and (run / "summary.json").exists()
    assert math.isfinite(summary["val_loss"]) and 2.0 < summary["unigram_entropy"] < 5.0
    before = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
    with pytest.raises(ValueError, match="trainer.resume=true"):  # a fresh run would overwrite this one
        _in_process(run)
    assert {p: p.read_bytes() for p in run.rglob("*") if p.is_file()} == before


def test_resume_continues_exactly(tmp_path):
    """Resume at step 2 of 5, past the warmup, where the learning rate, AdamW's moments and the
    RNG all matter: every later loss, grad norm and the final validation loss equal the
    uninterrupted run's, bit for bit (same process, same kernels)."""
    import shutil

    extra = ["trainer.max_steps=5", "trainer.checkpoint_every=2", "trainer.keep_checkpoints=3", "optim.warmup_steps=1"]
    _in_process(tmp_path / "full", extra)
    part = tmp_path / "part"
    shutil.copytree(tmp_path / "full", part)
    for step in (4, 5):  # the run "died" after its step-2 checkpoint
        shutil.rmtree(part / "checkpoints" / f"step_{step:08d}")
    resumed = _in_process(part, extra + ["trainer.resume=true"])
    full = [json.loads(s) for s in (tmp_path / "full" / "metrics.jsonl").read_text().splitlines()]
    got = [json.loads(s) for s in (part / "metrics.jsonl").read_text().splitlines()]
    keys = ("step", "loss", "grad_norm", "lr", "val_loss")
    assert [{k: m.get(k) for k in keys} for m in got] == [{k: m.get(k) for k in keys} for m in full]
    assert [m["step"] for m in got if "loss" in m] == [1, 2, 3, 4, 5]
    lrs = [m["lr"] for m in got if "lr" in m]
    assert lrs[2] > lrs[3] > lrs[4] > 0  # past the warmup: the cosine moves at every resumed step
    assert (resumed["steps"], resumed["start_step"], resumed["tokens"]) == (5, 2, 3 * 4 * 96)  # steps 3..5 this time
    with pytest.raises(ValueError, match=r"at step 5, past trainer.max_steps=3"):  # never a mislabelled checkpoint
        _in_process(part, extra[1:] + ["trainer.max_steps=3", "trainer.resume=true"])


def _torchrun(nproc: int, cp: int, run_dir: Path):
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
        "scripts/train.py", *TINY, f"parallel.cp={cp}", f"trainer.run_dir={run_dir}",
        "parallel.threads_per_rank=1", "parallel.timeout_s=60",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return run_command(cmd, cwd=ROOT, env=env, timeout=180)


def test_deepspeed_runs_as_one_process_without_a_launcher(tmp_path):
    """`python scripts/train.py deepspeed=zero1 parallel.cp=1` (no torchrun) gets a one-rank group,
    and its curve is the plain single-process one."""
    from tests._deepspeed import require_deepspeed

    require_deepspeed()
    _in_process(tmp_path / "plain", ["optim.warmup_steps=1"])
    cmd = [sys.executable, "scripts/train.py", *TINY, "parallel.cp=1", "deepspeed=zero1", "optim.warmup_steps=1",
           f"trainer.run_dir={tmp_path / 'ds'}"]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    proc = run_command(cmd, cwd=ROOT, env={**env, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"}, timeout=180)
    assert proc.returncode == 0, proc.stderr[-4000:]
    ref, got = _losses(tmp_path / "plain"), _losses(tmp_path / "ds")
    assert len(got) == 3 and all(abs(a - b) / abs(a) < 1e-5 for a, b in zip(ref, got)), (ref, got)


@pytest.mark.parametrize("nproc,cp", [(2, 2), (2, 1), (4, 2)], ids=["cp2", "dp2", "dp2xcp2"])
def test_parallel_layouts_give_the_same_loss(tmp_path, nproc, cp):
    """CP (and DP) change nothing but speed: same losses as one process for the first 3 steps."""
    _in_process(tmp_path / "single")
    proc = _torchrun(nproc, cp, tmp_path / "multi")
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "validation loss" in proc.stdout and "unigram entropy" in proc.stdout
    ref, got = _losses(tmp_path / "single"), _losses(tmp_path / "multi")
    assert len(ref) == len(got) == 3
    for a, b in zip(ref, got):
        assert abs(a - b) / abs(a) < 2e-6, (ref, got)
    assert ref[0] != ref[2]  # the model did train between the compared steps
    # AdamW and clipping hide a wrong gradient scale from the loss; the global grad norm does not.
    ref_gn, got_gn = _losses(tmp_path / "single", "grad_norm"), _losses(tmp_path / "multi", "grad_norm")
    for a, b in zip(ref_gn, got_gn):
        assert abs(a - b) / abs(a) < 2e-6, (ref_gn, got_gn)


@pytest.mark.parametrize(
    "override,field",
    [
        ("parallel.strategy=zigzag", "parallel.strategy"),
        ("parallel.ulysses_impl=mpi", "parallel.ulysses_impl"),
        ("trainer.precision=fp8", "trainer.precision"),
        ("trainer.keep_checkpoints=0", "trainer.keep_checkpoints"),
        ("deepspeed.stage=4", "deepspeed.stage"),
        ("model.layer_pattern=KKX", "model.layer_pattern"),
        ("trainer.log_every=0", "trainer.log_every"),
        ("trainer.max_steps=0", "trainer.max_steps"),
        ("optim.lr=-1e-3", "optim.lr"),
        ("optim.min_lr_ratio=2.0", "optim.min_lr_ratio"),
        ("optim.warmup_steps=-1", "optim.warmup_steps"),
        ("optim.beta2=1.0", "optim.beta2"),
        ("model.kda.chunk_size=40", "chunk_size"),
        ("model.kda.backend=cuda", "KDAConfig.backend"),
        ("model.kda.d_model=64", "model.kda.d_model=64 differs from model.d_model"),
        ("model.mlp_hidden=0", "ModelConfig.mlp_hidden"),
        ("model.init_std=-1", "ModelConfig.init_std"),
        ("parallel.device=tpu", "parallel.device"),
        ("parallel.backend=foo", "parallel.backend must be null"),
        ("parallel.timeout_s=0", "parallel.timeout_s must be > 0"),
        ("parallel.timeout_s=-30", "parallel.timeout_s must be > 0"),
        ("model.layer_pattern=KKKA", "does not fit model.n_layers=3"),
        ("data.seq_len=1", "data.seq_len=1 is too short for parallel.cp=2"),
    ],
)
def test_bad_scale_config_names_the_field(override, field):
    from omegaconf import OmegaConf

    with pytest.raises(Exception, match=field.replace(".", r"\.")) as info:
        OmegaConf.to_object(_cfg([override]))
    assert isinstance(info.value, ValueError) or isinstance(info.value.__cause__, ValueError)


def test_unknown_keys_are_rejected():
    """Hydra adds +trainer.foo=1 and +foo=1 to the struct config, and OmegaConf.to_object drops
    them silently: to_train_config names them."""
    for override, key in (("+trainer.foo=1", "trainer.foo"), ("+foo=1", "foo"), ("+model.heads=2", "model.heads")):
        with pytest.raises(ConfigError, match=rf"unknown config key\(s\): {key} "):
            to_train_config(_cfg([override]))
    with pytest.raises(ConfigError, match="unknown config key"):
        train(_cfg(TINY + ["parallel.cp=1", "+trainer.foo=1"]))
    with pytest.raises(ConfigError, match="Could not override 'trainer.foo'"):
        compose_config(["trainer.foo=1"])
    with pytest.raises(ConfigError, match=r"model\.num_heads is now model\.kda\.num_heads and model\.attention\.num_heads"):
        compose_config(["model.num_heads=8"])


def test_layer_patterns_that_fit():
    """n_layers a whole number of pattern repeats; the README's hybrid example composes and
    builds one attention layer per four blocks."""
    from kda_cp.layers import AttentionLayer

    cfg = to_train_config(_cfg(["model.layer_pattern=KKKA", "model.n_layers=4"]))
    model = KDALanguageModel(cfg.model)
    assert sum(isinstance(m, AttentionLayer) for m in model.modules()) == 1
    assert to_train_config(_cfg(["model.layer_pattern=KA", "model.n_layers=6"])).model.n_layers == 6
    for pattern, n in (("KKKA", 6), ("KA", 3), ("KKA", 2)):
        with pytest.raises(ConfigError, match=f"model.layer_pattern='{pattern}'.*model.n_layers={n}"):
            to_train_config(_cfg([f"model.layer_pattern={pattern}", f"model.n_layers={n}"]))
    cfg = to_train_config(_cfg(["parallel.cp=4", "data.seq_len=4"]))  # one token per rank is enough
    assert cfg.data.seq_len == 4
    with pytest.raises(ConfigError, match="ulysses needs data.seq_len % parallel.cp == 0"):
        to_train_config(_cfg(["parallel.strategy=ulysses", "data.seq_len=101"]))


def test_deepspeed_and_experiment_configs_compose():
    from omegaconf import OmegaConf

    for stage in (1, 2, 3):
        assert OmegaConf.to_object(_cfg([f"deepspeed=zero{stage}"])).deepspeed.stage == stage
    assert OmegaConf.to_object(_cfg([])).deepspeed.stage == 0
    exp = OmegaConf.to_object(_cfg(["+experiment=h200_hybrid_64k"]))
    assert (exp.data.seq_len, exp.model.layer_pattern, exp.parallel.cp, exp.trainer.precision) == (65536, "KKKA", 1, "bf16")
    assert exp.model.kda.backend == "auto" and exp.parallel.device == "cuda" and exp.trainer.max_steps >= 200


def test_bf16_autocast_hybrid_runs(tmp_path):
    """trainer.precision=bf16 (the GPU default) through KDA and attention layers: finite, trains."""
    summary = _in_process(tmp_path / "bf16", ["trainer.precision=bf16", "model.layer_pattern=KA", "trainer.max_steps=4"])
    losses = _losses(tmp_path / "bf16")
    assert len(losses) == 4 and all(math.isfinite(v) for v in losses) and math.isfinite(summary["val_loss"])
    fp32 = _in_process(tmp_path / "fp32", ["trainer.precision=fp32", "model.layer_pattern=KA", "trainer.max_steps=4"])
    assert losses[0] != _losses(tmp_path / "fp32")[0]  # autocast did change the arithmetic
    assert abs(summary["val_loss"] - fp32["val_loss"]) < 0.05


def test_resume_compares_a_flat_model_config_with_the_nested_one():
    """A checkpoint's config written with model.num_heads (before the layer configs nested) is
    compared key by key with model.kda.num_heads / model.attention.num_heads: a change refuses the
    resume, the same values do not."""
    from dataclasses import asdict

    from kda_cp.train.config import config_drift

    now = asdict(to_train_config(_cfg(TINY)))
    old = {**now, "model": {k: v for k, v in now["model"].items() if k not in ("kda", "attention")}}
    old["model"].update(num_heads=2, head_dim=16, chunk_size=16)
    assert config_drift(old, now) == []
    old["model"]["backend"] = "torch"  # an execution key: may change on resume
    assert config_drift(old, now) == []
    old["model"]["segment_len"] = None  # so is the split (None was the default before "auto")
    assert now["model"]["kda"]["segment_len"] == "auto" and config_drift(old, now) == []
    old["model"]["num_heads"] = 8
    old["model"]["norm_eps"] = 1e-5  # the flat config's eps was the KDA layers' eps too
    assert config_drift(old, now) == ["model.attention.num_heads (8 -> 2)", "model.kda.norm_eps (1e-05 -> 1e-06)",
                                      "model.kda.num_heads (8 -> 2)", "model.norm_eps (1e-05 -> 1e-06)"]
