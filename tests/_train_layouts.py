"""Run kda_cp.train.train() for several configs inside ONE torchrun world (tests/train/test_train_scale.py).

    torchrun --standalone --nproc_per_node=4 tests/_train_layouts.py '<json: list of override lists>'

Every rank composes each config with Hydra and calls train(); the process group is made once (by
the first train() call) and reused, so one launch covers several dp x cp layouts.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch.distributed as dist
from hydra import compose, initialize_config_dir

from kda_cp.train import train

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    cases = json.loads(sys.argv[1])
    try:
        for overrides in cases:
            with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
                cfg = compose(config_name="config", overrides=overrides)
            train(cfg)
        if dist.is_initialized():
            # every rank's outstanding collectives (gloo runs them in order) done before teardown:
            # a rank that tore down while another's asynchronous work was in flight aborted once
            # ("terminate called without an active exception") on a loaded CPU machine
            dist.barrier()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
