"""DCP's ``.metadata`` read without running code: a restricted unpickler and a structure check.

torch.distributed.checkpoint writes its metadata with :mod:`pickle`, and its own reader loads it
with the standard unpickler, which calls whatever a file names (``os.system``, ``exec``, ...).
A checkpoint is something people copy and share, so atorch never does that (docs/DESIGN.md).
:func:`loads` builds only the classes DCP's metadata is made of, torch dtypes, layouts and
sizes, paths and plain data; any other global, a ``BUILD`` that would set attributes on a class
instead of an instance (or a dunder name on an instance), and persistent ids are refused with
:class:`CheckpointError`. Nothing is imported: a name outside the allow-list is refused as it is,
and a ``__setstate__`` is only ever the record class's own.

Example::

    metadata = safe_pickle.loads(Path("ckpt/latest/.metadata").read_bytes(), "ckpt/latest/.metadata")
"""

import io
import pathlib
import pickle

import torch
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from atorch.errors import CheckpointError


def _layout(name: str) -> torch.layout:
    """``torch.layout`` pickles as ``torch.serialization._get_layout("torch.strided")``: a lookup by name."""
    found = getattr(torch, str(name).removeprefix("torch."), None)
    if not isinstance(found, torch.layout):
        raise pickle.UnpicklingError(f"{name!r} is not a torch layout")
    return found


# Instances the metadata is made of: the only objects a BUILD may fill in.
_RECORDS = (Metadata, MetadataIndex, StorageMeta, TensorProperties, TensorStorageMetadata, BytesStorageMetadata,
            ChunkStorageMetadata, _StorageInfo)
_GLOBALS = {
    **{("torch.distributed.checkpoint.metadata", cls.__name__): cls for cls in _RECORDS if cls is not _StorageInfo},
    ("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING"): dcp_metadata._MEM_FORMAT_ENCODING,
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): _StorageInfo,
    ("torch", "Size"): torch.Size,
    ("torch.serialization", "_get_layout"): _layout,
    **{("pathlib", name): getattr(pathlib, name) for name in ("PosixPath", "PurePosixPath", "WindowsPath",
                                                             "PureWindowsPath")},
}
_CALLABLE = {id(value) for value in _GLOBALS.values()}
# torch's dtypes by name, taken once from torch's namespace: ``getattr(torch, name)`` would import a
# submodule a pickle names (torch's lazy ``__getattr__``: ``torch._inductor`` took 17 s).
_DTYPES = {name: value for name, value in vars(torch).items() if isinstance(value, torch.dtype)}


class _Restricted(pickle._Unpickler):  # the Python implementation: its opcodes can be checked one by one
    dispatch = dict(pickle._Unpickler.dispatch)

    def find_class(self, module: str, name: str):
        if (module, name) in _GLOBALS:
            return _GLOBALS[(module, name)]
        if module == "torch" and name in _DTYPES:
            return _DTYPES[name]  # a dtype is a constant, not something to call
        raise pickle.UnpicklingError(f"refused global {module}.{name}: not part of a torch.distributed.checkpoint "
                                     "metadata file (unpickling it could run code)")

    def persistent_load(self, pid):
        raise pickle.UnpicklingError("refused a persistent id: DCP metadata has none")

    def _build(self):
        state, target = self.stack[-1], self.stack[-2]
        if type(target) not in _RECORDS:  # never a class (that would patch it for the whole process)
            raise pickle.UnpicklingError(f"refused to set the state of a {type(target).__name__}")
        # The class's own __setstate__ only: pickle's load_build looks it up on the instance, where
        # an earlier BUILD could have put any callable the file can name.
        setstate = vars(type(target)).get("__setstate__")
        if setstate is None and not isinstance(state, dict):
            raise pickle.UnpicklingError("refused slot state: DCP metadata classes have none")
        if setstate is None and any(not isinstance(key, str) or key.startswith("__") for key in state):
            raise pickle.UnpicklingError(f"refused state keys {[k for k in state if not isinstance(k, str) or k.startswith('__')]!r}")
        self.stack.pop()
        if setstate is not None:
            setstate(target, state)
        else:
            target.__dict__.update(state)

    def _reduce(self):
        if id(self.stack[-2]) not in _CALLABLE:
            raise pickle.UnpicklingError(f"refused a call to {type(self.stack[-2]).__name__}")
        pickle._Unpickler.load_reduce(self)

    def _new_object(self):
        if self.stack[-2] not in _RECORDS:
            raise pickle.UnpicklingError(f"refused to create a {getattr(self.stack[-2], '__name__', '?')}")
        pickle._Unpickler.load_newobj(self)

    def _refuse(self):
        raise pickle.UnpicklingError("refused opcode: DCP metadata does not use it")

    dispatch[pickle.BUILD[0]] = _build
    dispatch[pickle.REDUCE[0]] = _reduce
    dispatch[pickle.NEWOBJ[0]] = _new_object
    for _op in (pickle.NEWOBJ_EX, pickle.INST, pickle.OBJ, pickle.PERSID, pickle.BINPERSID):
        dispatch[_op[0]] = _refuse
    del _op


def loads(data: bytes, source: str) -> Metadata:
    """The :class:`Metadata` pickled in ``data``; :class:`CheckpointError` for anything else."""
    try:
        metadata = _Restricted(io.BytesIO(data)).load()
        _check_structure(metadata, source)
    except CheckpointError:
        raise
    except Exception as error:  # noqa: BLE001 - garbage can raise anything (OverflowError, MemoryError, ...)
        first = str(error).splitlines()[0] if str(error) else ""
        raise CheckpointError(f"{source} is not valid torch.distributed.checkpoint metadata "
                              f"({type(error).__name__}: {first}); the checkpoint is corrupt or was not "
                              "written by atorch.checkpoint.save, and it will not be loaded") from None
    return metadata


def _check_structure(metadata, source: str) -> None:
    """Refuse metadata whose pieces are not what DCP's planner and reader expect."""
    def fail(what: str):
        raise CheckpointError(f"{source} is not valid torch.distributed.checkpoint metadata: {what}")

    if not isinstance(metadata, Metadata):
        fail(f"it holds a {type(metadata).__name__}, not a Metadata")
    if not isinstance(metadata.state_dict_metadata, dict):
        fail("state_dict_metadata is not a dict")
    for key, entry in metadata.state_dict_metadata.items():
        if not isinstance(key, str) or not isinstance(entry, (TensorStorageMetadata, BytesStorageMetadata)):
            fail(f"entry {key!r} is a {type(entry).__name__}")
        if isinstance(entry, TensorStorageMetadata) and not (
                isinstance(entry.size, torch.Size) and isinstance(entry.properties, TensorProperties)
                and isinstance(entry.chunks, list)
                and all(isinstance(c, ChunkStorageMetadata) and isinstance(c.offsets, torch.Size)
                        and isinstance(c.sizes, torch.Size) for c in entry.chunks)):
            fail(f"tensor entry {key!r} is malformed")
    if not isinstance(metadata.storage_data, dict):
        fail("storage_data is not a dict")
    for index, where in metadata.storage_data.items():
        if not isinstance(index, MetadataIndex) or not isinstance(where, _StorageInfo):
            fail(f"storage entry {index!r} is malformed")
        if not (isinstance(where.relative_path, str) and isinstance(where.offset, int)
                and isinstance(where.length, int) and where.offset >= 0 and where.length >= 0):
            fail(f"storage entry {index.fqn!r} points at {where!r}")
    if metadata.storage_meta is not None and not isinstance(metadata.storage_meta, StorageMeta):
        fail("storage_meta is malformed")


def referenced_files(metadata: Metadata) -> set[str]:
    """Every file DCP would open to read this metadata's entries."""
    return {where.relative_path for where in metadata.storage_data.values()}
