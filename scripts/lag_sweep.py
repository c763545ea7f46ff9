#!/usr/bin/env python
"""Runs the lag experiment (same as ``satjax lag-sweep``); see docs/results/README.md."""

import sys

from satjax.app.lag_sweep import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
