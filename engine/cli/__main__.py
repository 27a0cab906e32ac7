"""``python -m multilane.engine.cli``: the ``multilane`` command (how the app and the ddp launcher start a run)."""

import sys

from multilane.engine.cli import main

sys.exit(main())
