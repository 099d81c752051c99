"""ReqToTokenPool: the int32 table that maps (request row, token position) -> KV slot."""

from __future__ import annotations

import torch

from eaglekv.errors import AllocatorError, ConfigError, OutOfKVMemoryError


class ReqToTokenPool:
    """Table `[max_running_requests + 1, max_context_len + extra]` of int32 slot ids.

    Row 0 is the padding row: it is never handed out, and padded batch rows point at it so
    that dummy reads land on the padding page. `extra` leaves room for a draft/verify window.
    """

    def __init__(self, max_running_requests: int, max_context_len: int, extra: int = 0,
                 device: str | torch.device = "cpu"):
        if max_running_requests < 1:
            raise ConfigError(f"max_running_requests={max_running_requests} must be >= 1")
        if max_context_len < 1:
            raise ConfigError(f"max_context_len={max_context_len} must be >= 1")
        self.max_running_requests = max_running_requests
        self.max_context_len = max_context_len
        self.width = max_context_len + extra
        # (R + 1, W) int32; row 0 stays all zeros (the padding page's first slot)
        self.req_to_token = torch.zeros((max_running_requests + 1, self.width), dtype=torch.int32,
                                        device=device)
        self._free_rows = list(range(max_running_requests, 0, -1))  # pop() hands out 1 first
        self._used_rows: set[int] = set()

    @property
    def free_rows(self) -> int:
        return len(self._free_rows)

    def alloc(self) -> int:
        if not self._free_rows:
            raise OutOfKVMemoryError(1, 0, self.max_running_requests)
        row = self._free_rows.pop()
        self._used_rows.add(row)
        return row

    def free(self, row: int) -> None:
        if row not in self._used_rows:
            raise AllocatorError(f"request row {row} freed but not in use "
                                 f"(rows in use: {len(self._used_rows)})")
        self._used_rows.remove(row)
        self.req_to_token[row].zero_()
        self._free_rows.append(row)

    def check_integrity(self) -> None:
        free, used = len(self._free_rows), len(self._used_rows)
        if free + used != self.max_running_requests or len(set(self._free_rows)) != free:
            raise AllocatorError(f"req_to_token rows: {free} free + {used} used "
                                 f"!= {self.max_running_requests} total")
        if self.req_to_token[0].any():
            raise AllocatorError("req_to_token padding row 0 was written")
