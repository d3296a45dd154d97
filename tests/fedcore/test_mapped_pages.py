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


def test_a_file_written_without_its_digest_holds_the_same_bytes_and_maps_the_same_tensors(tmp_path: Path) -> None:
    """A file written with digest=False (the process pool's shared memory) holds the same bytes as with the digest,
    whose SHA-256 is the file's; its tensors (the 2NN's first layer, an empty one, int64) map read-only with the
    saved values, and releasing one leaves the others' values readable. digest=False with self_digest is refused."""
    import hashlib

    import pytest

    from fedcore.errors import PayloadError
    from fedcore.payload import read_safetensors_header

    rng = np.random.default_rng(0)
    arrays: dict[str, np.ndarray] = {
        "fc1.weight": rng.standard_normal((200, 784), dtype=np.float32),
        "fc1.bias": rng.standard_normal(200, dtype=np.float32),
        "empty": np.zeros((0, 3), dtype=np.float32),
        "steps": np.arange(5, dtype=np.int64),
    }
    with_digest = save_payload(tmp_path / "a.safetensors", arrays)
    without = save_payload(tmp_path / "b.safetensors", arrays, durable=False, digest=False)
    data = (tmp_path / "a.safetensors").read_bytes()
    assert (tmp_path / "b.safetensors").read_bytes() == data and without.size == with_digest.size == len(data)
    assert with_digest.sha256 == hashlib.sha256(data).digest() and without.sha256 == b""
    mapped, _ = open_safetensors(tmp_path / "b.safetensors")
    assert list(mapped) == list(read_safetensors_header(tmp_path / "b.safetensors")[0])
    for name, value in arrays.items():
        assert mapped[name].dtype == value.dtype and np.array_equal(mapped[name], value)
        view = mapped[name]
        assert name == "empty" or (isinstance(view, np.memmap) and view.mode == "r")
    release_mapped({"fc1.weight": mapped["fc1.weight"]})
    assert np.array_equal(mapped["fc1.bias"], arrays["fc1.bias"])
    assert np.array_equal(mapped["fc1.weight"], arrays["fc1.weight"])
    with pytest.raises(PayloadError, match="digest=False"):
        save_payload(tmp_path / "c.safetensors", arrays, digest=False, self_digest=True)
