"""Train a KDA byte-level language model with context parallelism (Hydra + torchrun).

    torchrun --nproc_per_node=2 scripts/train.py [KEY=VALUE | GROUP=OPTION ...]
    python scripts/train.py --help

The trainer lives in kda_cp.train (this is its command line, kda_cp.train.cli.main).
"""

from kda_cp.train.cli import exit_process, main

if __name__ == "__main__":
    exit_process(main())
