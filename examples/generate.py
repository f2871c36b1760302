"""Generate text with a megamoe checkpoint: the ``megamoe generate`` command as a script (same flags; see
``megamoe generate --help`` and :mod:`megamoe.cli.generate`)::

    python examples/generate.py CKPT --prompt "def fibonacci(n):" --max-new-tokens 64
    torchrun --nproc-per-node 4 examples/generate.py CKPT --tp 2 --ep 2 --prompt-ids 1,15,27
"""

import sys

from megamoe.cli import generate
from megamoe.cli.launch import run_script

PROG = "generate.py"


def main(argv=None) -> int:
    return generate.main(argv, prog=PROG)


if __name__ == "__main__":
    sys.exit(run_script(main, prog=PROG))
