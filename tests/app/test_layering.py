"""The library does not depend on the application."""

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_train_library_does_not_import_the_app():
    code = ("import sys, satjax.train.trainer, satjax.train.metrics, satjax.train.checkpoint; "
            "sys.exit(sorted(m for m in sys.modules if m.startswith('satjax.app')) or 0)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       env={**os.environ, "PYTHONPATH": str(REPO), "JAX_PLATFORMS": "cpu"})
    assert r.returncode == 0, r.stderr[-2000:]
