"""How much of a file-mapped array is resident in this process: the ``Rss`` of its mapping in /proc/self/smaps."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

SMAPS = Path("/proc/self/smaps")


def mapping_rss(array: np.ndarray) -> int:
    """Resident bytes of the mapping that holds ``array``'s first byte (Linux ``/proc/self/smaps``).

    Raises:
        LookupError: no mapping holds that address.
    """
    address = array.ctypes.data
    inside = False
    for line in SMAPS.read_text().splitlines():
        head = line.split(maxsplit=1)[0]
        if "-" in head and not head.endswith(":"):
            low, high = (int(part, 16) for part in head.split("-"))
            inside = low <= address < high
        elif inside and head == "Rss:":
            return int(line.split()[1]) * 1024
    raise LookupError(f"no mapping holds address {address:#x}")


needs_smaps = pytest.mark.skipif(not SMAPS.exists(), reason="needs Linux's /proc/self/smaps")
