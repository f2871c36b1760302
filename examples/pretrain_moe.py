"""Pretrain or fine-tune a MoE language model: the ``megamoe train`` command as a script (same flags and
``--config`` files; see ``megamoe train --help``, :mod:`megamoe.cli.train` and, for the loop as a library
function, :func:`megamoe.training.pretrain.pretrain`)::

    torchrun --nproc-per-node 4 examples/pretrain_moe.py --tp 2 --ep 2 --dispatcher allgather
    torchrun --nproc-per-node 4 examples/pretrain_moe.py --config configs/demo.toml
"""

import sys

from megamoe.cli import train
from megamoe.cli.launch import run_script

PROG = "pretrain_moe.py"


def main(argv=None) -> int:
    return train.main(argv, prog=PROG)


if __name__ == "__main__":
    sys.exit(run_script(main, prog=PROG))
