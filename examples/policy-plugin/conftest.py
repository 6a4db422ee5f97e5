"""Lets this example's tests import ``tierserve_short_first`` from the source tree, uninstalled."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
