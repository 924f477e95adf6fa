"""`Layout`: the interface every batch layout implements, and what they share (live rows, `stepped`).

The scheduler drives one layout object per batch; `rows` holds the live rows in batch-position order,
the order the runner's device-side state follows through the plans' `keep`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import deque

from flashx_batch.runtime.plan import DecodeStep, KVOp, Prefill
from flashx_batch.runtime.rows import Row


class Layout(ABC):
    def __init__(self) -> None:
        self.rows: list[Row] = []

    @abstractmethod
    def admit(self, rows: list[Row]) -> tuple[list[KVOp], Prefill]:
        """Place rows joining the batch; the KV ops to run first and the prefill the runner runs."""

    @abstractmethod
    def admitted(self, rows: list[Row], slots: list[int]) -> None:
        """The prefill ran: `slots[i]` KV slots for `rows[i]` (fewer than its prompt once merged)."""

    @abstractmethod
    def joinable(self, queue: deque[Row]) -> int:
        """How many rows from the front of `queue` fit now (in-flight refill; 0: never)."""

    @abstractmethod
    def before_refill(self, queue: deque[Row]) -> list[KVOp]:
        """Before a refill round: a chance to re-cut the arena for the rows left (the copies it needs)."""

    @abstractmethod
    def decode(self) -> DecodeStep:
        """One token for every live row: what the runner reads and writes."""

    @abstractmethod
    def drop(self, finished: list[int]) -> tuple[list[int], list[KVOp]]:
        """Finished positions leave -> (the positions kept, in their new order; KV copies that keeps need)."""

    @abstractmethod
    def release(self) -> None:
        """Every segment back to the allocator (the batch is over, or a plan failed)."""

    def stepped(self) -> None:
        """A decode step ran: every live row holds one more slot, its next token one position on."""
        for row in self.rows:
            row.slots += 1
            row.position += 1

    def _leave_in_place(self, finished: list[int]) -> list[int]:
        """The finished positions leave and nobody moves (extents, pages): the positions kept, in order."""
        gone = set(finished)
        keep = [j for j in range(len(self.rows)) if j not in gone]
        self.rows = [self.rows[j] for j in keep]
        return keep
