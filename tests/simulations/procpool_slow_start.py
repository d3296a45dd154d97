"""The process-pool tests' tiny task behind a module that takes 3 s to import: a worker is still starting (loading
the task factory) when its pool may be killed."""

from __future__ import annotations

import time

from tests.simulations.procpool_tasks import tiny_task

time.sleep(3.0)

__all__ = ["tiny_task"]
