"""``python -m satjax`` is the ``satjax`` command (child processes start this way)."""

import sys

from satjax.app.cli import main
from satjax.app.launch import follow_parent

follow_parent()  # a child of `satjax train` dies with it (no-op when started by hand)
sys.exit(main())
