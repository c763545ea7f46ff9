"""Building satjax (what ``pip install -e .`` and scripts/test.sh run) warns of nothing."""

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_building_the_metadata_prints_no_setuptools_warning(tmp_path):
    """Before: setuptools' deprecation of a TOML-table ``project.license`` (a 13-line box,
    once per build step: 69 lines in scripts/test.sh's output), a build error from
    2027-02-18 on."""
    code = ("import sys; from setuptools import build_meta; "
            "build_meta.prepare_metadata_for_build_wheel(sys.argv[1])")
    r = subprocess.run([sys.executable, "-W", "default", "-c", code, str(tmp_path)], cwd=REPO,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "Warning" not in r.stderr, r.stderr[-3000:]
    assert (tmp_path / "satjax-0.1.0.dist-info" / "METADATA").is_file()
