"""``python -m satjax`` is the ``satjax`` command (child processes start this way)."""

import sys

from satjax.app.cli import main

sys.exit(main())
