"""
A sharded checkpoint's .metadata read as data: DCP's own reader unpickles it with pickle.load, which calls whatever
the file names; ours admits only the types DCP writes there, and checks the folder holds what our sharded saves write.

    import torch.distributed.checkpoint as dcp
    from lib.dcp_metadata import CheckedReader
    dcp.load(state, storage_reader=CheckedReader("out/ckpt"))   # UserError for metadata that is not DCP's own
"""

import math
import os
import pickle

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from lib.files import UserError

DCP_TYPES = {  # module -> names, as torch 2.13 pickles a checkpoint's metadata (torch's dtypes besides)
    "torch.distributed.checkpoint.metadata": {"Metadata", "TensorStorageMetadata", "ChunkStorageMetadata",
                                              "TensorProperties", "BytesStorageMetadata", "MetadataIndex",
                                              "StorageMeta", "_MEM_FORMAT_ENCODING"},
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},  # a layout by its name: torch.strided
    "torch": {"Size"},
    "pathlib": {"PosixPath", "WindowsPath"},  # where the checkpoint was written, kept as a note
    "pathlib._local": {"PosixPath", "WindowsPath"},  # the same, as Python 3.13 names them
    "collections": {"OrderedDict"},
}


class MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP's metadata types only. A pickle runs code only by calling the classes and functions it
    names, and every name goes through find_class: these build plain records, nothing else is handed out."""

    def find_class(self, module, name):
        if name in DCP_TYPES.get(module, ()) or module == "torch" and isinstance(getattr(torch, name, None),
                                                                               torch.dtype):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"it names {module}.{name}, not one of torch.distributed.checkpoint's "
                                     f"metadata types")


def read_metadata(folder):
    """The Metadata in folder/.metadata, read without running anything in it, checked to be what our sharded saves
    write: tensors only (DCP reads "bytes" entries with torch.load(weights_only=False)), in the folder's own files."""
    path = os.path.join(folder, ".metadata")
    try:
        with open(path, "rb") as f:
            metadata = MetadataUnpickler(f).load()
    except pickle.UnpicklingError as e:
        raise UserError(f"{path} is refused: {e}; only load checkpoints you trust") from None
    except Exception as e:  # a damaged pickle fails in many ways
        raise UserError(f"{path} is not a readable checkpoint's metadata ({type(e).__name__}: {e}); use another "
                         f"checkpoint, e.g. ckpt_best or a ckpt_NNNNNNN") from None
    entries = getattr(metadata, "state_dict_metadata", None)
    files = getattr(metadata, "storage_data", None)
    if not isinstance(metadata, Metadata) or not isinstance(entries, dict) or not isinstance(files, dict):
        raise UserError(f"{path} does not hold a sharded checkpoint's metadata; only load checkpoints you trust")
    odd = [type(m).__name__ for m in entries.values() if not isinstance(m, TensorStorageMetadata)]
    if odd:
        raise UserError(f"{path} lists a {odd[0]} entry, where this project's sharded checkpoints hold tensors "
                         f"only (DCP would unpickle it); refusing it")
    for name, entry in entries.items():
        why = untiled(entry)
        if why:  # DCP would leave the rest of the tensor as torch.empty left it: whatever was in memory
            raise UserError(f"{path}: the shards of {name} {why}; use another checkpoint, e.g. ckpt_best or a "
                            f"ckpt_NNNNNNN")
    stored = {}  # the bytes the shards hold of each tensor
    for index, info in files.items():
        name = getattr(info, "relative_path", None)
        if not isinstance(info, _StorageInfo) or not isinstance(name, str) or os.path.basename(name) != name \
                or name in ("", ".", "..") or type(info.length) is not int or type(info.offset) is not int \
                or info.length < 0 or info.offset < 0:
            raise UserError(f"{path} points at {name!r}, not a file of its own folder; refusing it")
        fqn = getattr(index, "fqn", None)
        stored[fqn] = stored.get(fqn, 0) + info.length
    for name, entry in entries.items():  # a size its shards cannot hold would be allocated whole before any read
        dtype = getattr(getattr(entry, "properties", None), "dtype", None)
        needed = math.prod(entry.size) * dtype.itemsize if isinstance(dtype, torch.dtype) else None
        if needed is None or stored.get(name, 0) < needed:
            raise UserError(f"{path}: {name} is said to be {tuple(entry.size)} of {dtype}, which its shards do not "
                            f"hold ({stored.get(name, 0):,} bytes); use another checkpoint, e.g. ckpt_best or a "
                            f"ckpt_NNNNNNN")
    return metadata


MAX_CHUNKS = 1 << 14  # of one tensor: a chunk a process that wrote it (FSDP x TP), checked pairwise where they meet


def untiled(entry):
    """Why a tensor's chunks do not cover it exactly once (None where they do): each inside its size, none overlapping
    another, as many values as the tensor's. Only chunks meeting along the dim their starts vary most along are
    compared (FSDP's row shards, tensor parallel's columns: a chunk meets a few)."""
    size = getattr(entry, "size", None)
    if not isinstance(size, torch.Size) or not all(type(n) is int and n >= 0 for n in size):
        return f"have no size but {size!r}"
    if len(getattr(entry, "chunks", None) or []) > MAX_CHUNKS:
        return f"are {len(entry.chunks):,} chunks, past the {MAX_CHUNKS:,} a tensor of a run of this project has"
    boxes = []
    for chunk in getattr(entry, "chunks", None) or []:
        start, extent = tuple(getattr(chunk, "offsets", ())), tuple(getattr(chunk, "sizes", ()))
        if not (len(start) == len(extent) == len(size) and all(type(n) is int for n in start + extent)
                and all(0 <= a and 0 <= n and a + n <= whole for a, n, whole in zip(start, extent, size))):
            return f"hold a chunk at {start} of {extent}, outside its size {tuple(size)}"
        boxes.append((start, extent))
    if sum(math.prod(extent) for _, extent in boxes) != math.prod(size):
        return f"hold {sum(math.prod(e) for _, e in boxes):,} values where it has {math.prod(size):,}"
    d = max(range(len(size)), key=lambda k: len({start[k] for start, _ in boxes}), default=0)
    boxes.sort(key=lambda box: box[0][d:] + box[0][:d])
    for i, (start, extent) in enumerate(boxes):
        for other, other_extent in boxes[i + 1:]:
            if size and other[d] >= start[d] + extent[d]:
                break
            if all(a < b + m and b < a + n for a, n, b, m in zip(start, extent, other, other_extent)) \
                    and math.prod(extent) and math.prod(other_extent):
                return f"overlap at {other}"
    return None


def missing_shards(folder, metadata):
    # the shard files metadata names that folder lacks or holds cut short, sorted: each looked at once (a chunk of
    # every tensor a process holds is in its file: 1024 processes' 7B model, 0.9M chunks in 1024 files)
    ends = {}
    for info in metadata.storage_data.values():
        ends[info.relative_path] = max(ends.get(info.relative_path, 0), info.offset + info.length)
    return sorted(name for name, end in ends.items()
                  if not os.path.isfile(path := os.path.join(folder, name)) or os.path.getsize(path) < end)


class CheckedReader(dcp.FileSystemReader):
    """DCP's reader of a folder, given the metadata read_metadata checked (its own would pickle.load it), every shard
    file it names whole in the folder."""

    def __init__(self, folder):
        super().__init__(folder)
        self.metadata = read_metadata(folder)
        if missing := missing_shards(folder, self.metadata):
            raise UserError(f"{folder} lacks its shard file {missing[0]} (of {len(missing)} missing or cut short); "
                            f"use another checkpoint, e.g. ckpt_best or a ckpt_NNNNNNN")

    def read_metadata(self):
        return self.metadata
