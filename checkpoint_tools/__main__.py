"""``python -m checkpoint_tools``: the ``megamoe-convert`` CLI."""

import sys

from checkpoint_tools.cli import main

sys.exit(main())
