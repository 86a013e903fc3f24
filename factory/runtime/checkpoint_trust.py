"""Reading a checkpoint folder as data: nothing in it can make the reader run code.

A checkpoint folder may come from someone else (a shared filesystem, a run
handed over). Three of its parts are pickles, and an unrestricted unpickler
calls whatever function a pickle names:

* ``rankN.pt``, each rank's own state, is read with ``torch.load(...,
  weights_only=True)``: tensors, numbers, strings, lists, tuples and dicts,
  and no function (:func:`load_local`; :func:`check_local` holds each save to
  the same rule);
* DCP's ``.metadata``, which torch.distributed.checkpoint reads with plain
  ``pickle.load``, is read here by :class:`MetadataReader`, whose unpickler
  finds only the names a DCP metadata pickle holds (DCP's metadata classes,
  torch's dtypes, sizes and layouts, paths); it also refuses a data file
  named outside the folder;
* a DCP entry that is not a tensor is a ``torch.save`` pickle, which DCP's
  default planner reads with ``weights_only=False``. factory stores tensors
  only, so :class:`TensorsOnlyPlanner` refuses such an entry unread.

Tensors themselves are read by DCP with ``weights_only=True``. A refusal is an
``UnpicklingError`` naming what was refused; ``read_checkpoint`` reports it as
a checkpoint that cannot be read. What is still trusted: the numbers. A
checkpoint someone altered trains the model they altered.
"""

from __future__ import annotations

import io
import pathlib
import pickle
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint.filesystem as dcp_files
import torch.distributed.checkpoint.metadata as dcp_metadata
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.planner import ReadItem

__all__ = ["MetadataReader", "TensorsOnlyPlanner", "check_local", "load_local"]

_PLAIN = "tensors, numbers, strings, lists and dicts"

_METADATA_NAMES = {
    dcp_metadata: (
        "Metadata",
        "StorageMeta",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "TensorProperties",
        "MetadataIndex",
        "_MEM_FORMAT_ENCODING",
    ),
    dcp_files: ("_StorageInfo",),
}


def _metadata_globals() -> dict[tuple[str, str], Any]:
    """Every global a DCP metadata pickle names, by the (module, name) the pickle uses."""
    found: list[Any] = [
        getattr(module, name)
        for module, names in _METADATA_NAMES.items()
        for name in names
        if hasattr(module, name)  # one torch release has a class another lacks
    ]
    # Plain constructors and lookups: torch.Size of ints, a layout by its name, a path.
    found += [torch.Size, torch.serialization._get_layout, pathlib.PosixPath, pathlib.PurePosixPath]
    return {(value.__module__, value.__qualname__): value for value in found}


class _MetadataUnpickler(pickle.Unpickler):
    allowed = _metadata_globals()

    def find_class(self, module: str, name: str) -> Any:
        value = self.allowed.get((module, name))
        if value is None and module == "torch":
            value = vars(torch).get(name)  # not getattr: torch imports submodules lazily
            if not isinstance(value, torch.dtype | torch.layout | torch.memory_format):
                value = None
        if value is None:
            raise pickle.UnpicklingError(
                f".metadata names {module}.{name}, which no DCP metadata holds: refused unread"
            )
        return value

    def persistent_load(self, pid: Any) -> Any:
        raise pickle.UnpicklingError(".metadata holds a persistent id: refused unread")


class MetadataReader(FileSystemReader):
    """DCP's file reader, reading ``.metadata`` with :class:`_MetadataUnpickler`.

    ``read_metadata`` takes no ``rank``: DCP then never falls back to a rank's own
    metadata file, which factory does not write."""

    def read_metadata(self) -> dcp_metadata.Metadata:
        with open(Path(self.path) / ".metadata", "rb") as handle:
            metadata = _MetadataUnpickler(handle).load()
        if not isinstance(metadata, dcp_metadata.Metadata):
            raise pickle.UnpicklingError(".metadata holds no DCP metadata: refused")
        for info in (metadata.storage_data or {}).values():
            name = str(getattr(info, "relative_path", ""))
            if Path(name).name != name or name in ("", ".", ".."):
                raise pickle.UnpicklingError(
                    f".metadata names a data file {name!r} outside its folder: refused unread"
                )
        if metadata.storage_meta is None:
            metadata.storage_meta = dcp_metadata.StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class TensorsOnlyPlanner(DefaultLoadPlanner):
    """DCP's load planner, refusing an entry stored as a pickle rather than as a tensor."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        raise pickle.UnpicklingError(
            f"{read_item.dest_index.fqn} is stored as a pickle, not a tensor (factory writes "
            "tensors only): refused unread"
        )


def check_local(saved: io.BytesIO) -> None:
    """Raise ``TypeError`` unless ``saved`` (a rank's state as ``torch.save`` wrote it) is what
    :func:`load_local` reads: a state that resume would refuse fails its save, not a resume
    hours later."""
    saved.seek(0)
    try:
        torch.load(saved, weights_only=True)
    except pickle.UnpicklingError as exc:
        raise TypeError(f"a rank's own state must hold only {_PLAIN} ({_refused(exc)})") from None


def load_local(path: Path) -> dict[str, Any]:
    """A rank's own state (``rankN.pt``): :data:`_PLAIN` only, read with ``weights_only``."""
    try:
        return torch.load(path, weights_only=True)
    except pickle.UnpicklingError as exc:
        # Not chained: torch's own message advises loading with weights_only=False.
        raise pickle.UnpicklingError(
            f"{path.name} holds more than {_PLAIN} ({_refused(exc)}): refused unread"
        ) from None


def _refused(exc: pickle.UnpicklingError) -> str:
    """The line of torch's weights-only refusal that names what it refused (the others
    advise ``weights_only=False``, which is what must not happen here)."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    advice = ("Weights only load failed", "(1)", "(2)", "Please file", "Check the documentation")
    for line in lines:
        if not line.startswith(advice):
            line = line.removeprefix("WeightsUnpickler error:").strip()
            return line.split(". Please use")[0].rstrip(".")
    return "torch.load(weights_only=True) refused it"
