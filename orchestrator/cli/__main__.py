"""``python -m orchestrator.cli``: the ``pdserve`` command."""

import sys

from orchestrator.cli import main

sys.exit(main())
