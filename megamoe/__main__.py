"""``python -m megamoe``: the ``megamoe`` command (:mod:`megamoe.cli.main`)."""

import sys

from megamoe.cli.main import main

if __name__ == "__main__":
    sys.exit(main())
