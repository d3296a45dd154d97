"""Per-client persistent state: named groups of tensors that live with the client between rounds (DESIGN.md,
"Client state"), such as SCAFFOLD's control variate c_i.

A :class:`ClientStateStore` is a directory holding one safetensors file per client (``<client>.safetensors``,
its groups stored as in a payload: :func:`fedcore.payload.pack_groups`). A daemon keeps its store in its state
directory; a simulation keeps one directory under its output, keyed by client id. Nothing is read until a mod
asks for a group of the client being trained (:meth:`ClientState.get`), and nothing is cached by the store, so
10,000 idle clients cost a directory entry each and no memory. Every :meth:`ClientState.put` writes the client's
file atomically (temporary file, fsync, rename, directory fsync: :func:`fedcore.payload.save_payload`), so a
crash leaves the previous state or the new one, never a torn file.
"""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Mapping
from pathlib import Path

import numpy as np

from fedcore.errors import ConfigError, PayloadError
from fedcore.payload import check_group_name, open_safetensors, pack_groups, save_payload, unpack_groups
from fedcore.tensors import NamedArrays

_PLAIN_ID = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,99}")


def state_file_name(client_id: str) -> str:
    """The file name of ``client_id``'s state: the id itself when it is a plain name (letters, digits, ``_``,
    ``.``, ``-``; at most 100 characters, not starting with a dot), else ``id-`` and the SHA-256 of the id, so that
    any id maps to one safe name of its own."""
    if _PLAIN_ID.fullmatch(client_id):
        return f"{client_id}.safetensors"
    return f"id-{hashlib.sha256(client_id.encode('utf-8', 'surrogatepass')).hexdigest()}.safetensors"


class ClientState:
    """One client's state in a :class:`ClientStateStore`: groups of tensors, read from its file on first use.

    Implements :class:`fedcore.mods.StateEntry`.
    """

    def __init__(self, path: Path, client_id: str) -> None:
        self._path = path
        self._client_id = client_id
        self._groups: dict[str, NamedArrays] | None = None

    @property
    def client_id(self) -> str:
        """The client the state belongs to."""
        return self._client_id

    @property
    def path(self) -> Path:
        """The client's state file (absent until the first :meth:`put`)."""
        return self._path

    def _load(self) -> dict[str, NamedArrays]:
        if self._groups is None:
            try:
                arrays, metadata = open_safetensors(self._path, client_id=self._client_id)
            except FileNotFoundError:
                self._groups = {}
            except (OSError, PayloadError) as exc:
                raise PayloadError(
                    f"the state file {str(self._path)!r} cannot be read ({exc}); restore it from a backup, or remove "
                    "it to start this client's state afresh, which discards what the client keeps between rounds "
                    "(SCAFFOLD's control variate; DP-SGD's record of the rounds it trained, so its epsilon would "
                    "restart at 0 and understate what the client has spent)",
                    client_id=self._client_id,
                ) from None
            else:
                model, groups = unpack_groups(arrays, metadata, client_id=self._client_id)
                if model:
                    raise PayloadError(
                        f"the state file {str(self._path)!r} holds tensors outside any group; it is not a client "
                        "state file (remove it to start afresh)",
                        client_id=self._client_id,
                    )
                # copied into memory: the file is replaced by the next put while these may still be used
                self._groups = {g: {n: np.array(a) for n, a in t.items()} for g, t in groups.items()}
        return self._groups

    def get(self, group: str) -> NamedArrays | None:
        """The tensors of ``group``, or None if the client has none.

        Raises:
            PayloadError: the state file is damaged (it says which file to remove).
        """
        return self._load().get(group)

    def put(self, groups: Mapping[str, NamedArrays]) -> None:
        """Replace the given groups (each a non-empty ``name -> array``), keep the others, and write the client's
        file durably, all groups in one atomic write.

        Raises:
            PayloadError: a group name that cannot be stored, or an empty group.
            OSError: the file cannot be written (the previous state stays).
        """
        merged = dict(self._load())
        for group, arrays in groups.items():
            check_group_name(group)
            merged[group] = dict(arrays)
        flat, metadata = pack_groups({}, merged)
        self._path.parent.mkdir(parents=True, exist_ok=True)
        save_payload(self._path, flat, metadata, durable=True)
        self._groups = merged


class ClientStateStore:
    """A directory of client states, one file per client (see the module docstring).

    Args:
        root: the directory (created by the first write, so a run whose clients keep no state leaves none).

    Raises:
        ConfigError: ``root`` exists and is not a directory.
    """

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)
        if self.root.exists() and not self.root.is_dir():
            raise ConfigError(f"the client state directory {str(self.root)!r} exists and is not a directory")

    def entry(self, client_id: str) -> ClientState:
        """The state of ``client_id`` (nothing is read until a group is asked for)."""
        return ClientState(self.root / state_file_name(client_id), client_id)
