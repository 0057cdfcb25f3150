"""Every rank's part in one save or load, with or without torch.distributed: gather, broadcast,
and agreeing on an error so that no rank walks into a collective alone."""

from __future__ import annotations

import torch.distributed as dist

from . import dcp
from .errors import CheckpointError


class _World:
    def __init__(self):
        self.on = dcp.distributed()
        self.rank = dist.get_rank() if self.on else 0
        self.size = dist.get_world_size() if self.on else 1

    def gather(self, obj) -> list:
        if not self.on:
            return [obj]
        out = [None] * self.size
        dist.all_gather_object(out, obj)
        return out

    def broadcast(self, obj):
        if not self.on:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def agree(self, error: str | None, kind=None) -> None:
        """Raise the first rank's error on every rank (no rank walks into a collective alone)."""
        errors = [e for e in self.gather(error) if e]
        if errors:
            raise (kind or CheckpointError)(errors[0])
