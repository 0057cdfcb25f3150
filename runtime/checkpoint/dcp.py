"""torch.distributed.checkpoint (DCP) with boxes: every rank writes the blocks it holds of each
full-shape tensor, and on load asks for the blocks it needs; DCP's resharding reads each wanted
block from whichever saved blocks overlap it, whatever layout wrote them.

DCP's default planners handle whole tensors, DTensors and ShardedTensors; a rank's fused-segment
shard is several blocks of one tensor, which is none of these, so two small planners describe
`Boxes` to DCP directly, through DCP's own chunk metadata (WriteItem / ReadItem with offsets).
Everything that is not `Boxes` is stored as one pickled object (DCP's BYTE_IO). Writes of the same
block from several ranks (replicated parameters, data-parallel replicas) are deduplicated by DCP.
"""

from __future__ import annotations

import io
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    ReadItem,
    SavePlan,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from .boxes import Boxes


class DCPError(Exception):
    """A DCP save or load that failed. DCP gathers every rank's failure and raises them on every
    rank as its CheckpointException, a BaseException that `except Exception` lets through, with a
    traceback per rank as its text. This is an Exception whose message is one line (the first
    failing rank's, by rank); `errors` holds each failing rank's exception, and the first one is
    the cause."""

    def __init__(self, message: str, errors: list):
        super().__init__(message)
        self.errors = errors


def _one_error(e: CheckpointException) -> DCPError:
    failures = sorted(e.failures.items(), key=lambda kv: kv[0])
    errors = [failure[0] if isinstance(failure, tuple) else failure for _, failure in failures]
    if not errors:
        return DCPError("the checkpoint library failed on no named rank", [])
    rank, first = failures[0][0], errors[0]
    text = str(first).strip().splitlines()
    return DCPError(f"rank {rank}: {type(first).__name__}: {text[0] if text else ''}", errors)


def distributed() -> bool:
    """Whether this process is one of several torch.distributed ranks."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _write_items(fqn: str, obj: Boxes) -> list:
    items = []
    for offsets, view in obj.boxes:
        offsets = torch.Size(offsets)
        items.append(WriteItem(
            index=MetadataIndex(fqn, offsets),
            type=WriteItemType.SHARD,
            tensor_data=TensorWriteData(
                chunk=ChunkStorageMetadata(offsets=offsets, sizes=view.size()),
                properties=TensorProperties.create_from_tensor(view),
                size=torch.Size(obj.shape),
            ),
        ))
    return items


class _SavePlanner(DefaultSavePlanner):
    def __init__(self):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def create_local_plan(self) -> SavePlan:
        items = []
        for fqn, obj in self.state_dict.items():
            if isinstance(obj, Boxes):
                items += _write_items(fqn, obj)
            else:
                items.append(WriteItem(index=MetadataIndex(fqn), type=WriteItemType.BYTE_IO))
        self.plan = SavePlan(items)
        return self.plan

    def lookup_object(self, index: MetadataIndex):
        obj = self.state_dict[index.fqn]
        if not isinstance(obj, Boxes):
            return obj
        for offsets, view in obj.boxes:
            if torch.Size(offsets) == index.offset:
                return view.detach()
        raise KeyError(f"{index.fqn}: no block at offsets {tuple(index.offset)}")


class _LoadPlanner(DefaultLoadPlanner):
    def __init__(self):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def set_up_planner(self, state_dict, metadata=None, is_coordinator: bool = False) -> None:
        # The default also walks the state dict to materialize meta tensors, and replaces every
        # value of a type it does not know (our Boxes) by None: keep the dict as it is.
        self.original_state_dict = self.state_dict = state_dict
        self.metadata = metadata
        self.is_coordinator = is_coordinator

    def create_local_plan(self) -> LoadPlan:
        items = []
        for fqn, obj in self.state_dict.items():
            md = self.metadata.state_dict_metadata.get(fqn)
            if md is None:
                raise KeyError(f"the checkpoint has no entry {fqn!r}")
            if isinstance(obj, Boxes):
                if not isinstance(md, TensorStorageMetadata) or tuple(md.size) != tuple(obj.shape):
                    raise ValueError(f"{fqn}: saved as {getattr(md, 'size', 'an object')}, wanted {tuple(obj.shape)}")
                chunks = [ChunkStorageMetadata(offsets=torch.Size(o), sizes=v.size()) for o, v in obj.boxes]
                items += create_read_items_for_chunk_list(fqn, md, chunks)
            else:
                items.append(ReadItem(type=LoadItemType.BYTE_IO, dest_index=MetadataIndex(fqn),
                                      dest_offsets=torch.Size((0,)), storage_index=MetadataIndex(fqn),
                                      storage_offsets=torch.Size((0,)), lengths=torch.Size((0,))))
        return LoadPlan(items)

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        # weights_only: a checkpoint holds tensors and plain Python values, never code to run
        self.state_dict[read_item.dest_index.fqn] = torch.load(value, weights_only=True)

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        return self.state_dict[index.fqn].boxes[index.index][1]


def save(path: str, entries: dict) -> None:
    """Write `entries` (name -> Boxes, or a picklable object) into directory `path` on every rank."""
    writer = dcp.FileSystemWriter(path, single_file_per_rank=True, sync_files=True, thread_count=1)
    with warnings.catch_warnings():  # "assuming the intent is to save in a single process": it is
        warnings.simplefilter("ignore")
        try:
            dcp.save(entries, storage_writer=writer, planner=_SavePlanner(), no_dist=not distributed())
        except CheckpointException as e:
            error = _one_error(e)
            raise error from (error.errors[0] if error.errors else None)


def load(path: str, entries: dict) -> dict:
    """Fill every Boxes of `entries` in place from directory `path`; other entries (give None)
    come back as the objects that were saved. Returns `entries`."""
    reader = dcp.FileSystemReader(path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            dcp.load(entries, storage_reader=reader, planner=_LoadPlanner(), no_dist=not distributed())
        except CheckpointException as e:
            error = _one_error(e)
            raise error from (error.errors[0] if error.errors else None)
    return entries


def read_metadata(path: str):
    """DCP's metadata of a checkpoint directory (names, full sizes, saved chunks)."""
    return dcp.FileSystemReader(path).read_metadata()
