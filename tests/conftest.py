"""Test-wide settings.

OMP_WAIT_POLICY=PASSIVE must be set before torch (and its OpenMP runtime) loads: spinning OpenMP threads slow
torch several-fold when the cores are shared (the CLI sets the same default).
"""

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
