"""Dropping what was read from read-only file mappings (fedcore.aggregation.blocks): only such mappings lose pages,
and their values come back from the file."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from fedcore.aggregation.blocks import release_mapped
from fedcore.payload import open_safetensors, save_payload
from tests.residency import mapping_rss, needs_smaps


@needs_smaps
def test_release_mapped_drops_only_read_only_file_mappings(tmp_path: Path) -> None:
    """A read-only map of a file leaves the resident set and reads the same values again; a copy-on-write map with a
    changed value and an array in memory keep theirs."""
    values = np.arange(1 << 20, dtype=np.float32)
    save_payload(tmp_path / "m.safetensors", {"w": values})
    mapped, _ = open_safetensors(tmp_path / "m.safetensors")
    private = np.memmap(tmp_path / "m.safetensors", dtype=np.float32, mode="c", offset=0, shape=(1 << 19,))
    private[:] = 7.0  # private pages: MADV_DONTNEED would give them back as the file's bytes
    in_memory = values.copy()
    assert float(np.sum(mapped["w"], dtype=np.float64)) == float(np.sum(values, dtype=np.float64))
    assert mapping_rss(mapped["w"]) >= values.nbytes - 4096

    release_mapped({"w": mapped["w"], "private": private, "memory": in_memory})
    assert mapping_rss(mapped["w"]) <= 8192
    assert np.array_equal(mapped["w"], values)
    assert np.all(private == 7.0) and np.array_equal(in_memory, values)
