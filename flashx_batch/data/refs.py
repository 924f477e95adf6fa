"""A plan's compact row bookkeeping: refs (file index, row index) packed 8 bytes a row (`PackedRefs`),
the input's ids in input order (`IdColumn`) and the ref -> id mapping computed from them (`RefIds`),
so a million-row plan holds megabytes, not a Python object per row (`data.plan` builds them).
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

Ref = tuple[int, int]  # (file index, row index)
ROW_BITS = 40  # a packed ref: file index << 40 | row index (a trillion rows a file, 8 million files)
ROW_MASK = (1 << ROW_BITS) - 1


class PackedRefs(Sequence):
    """A shard's row refs, (file index, row index) each, packed 8 bytes a row: a million-row plan
    holds megabytes of refs, not a Python tuple per row. Iterates, slices and compares as the
    tuple of refs it stands for."""

    __slots__ = ("codes",)

    def __init__(self, refs: Iterable[Ref] | array = ()) -> None:
        if isinstance(refs, array):
            self.codes = refs
        else:
            self.codes = array("q", ((fi << ROW_BITS) | ri for fi, ri in refs))

    def __len__(self) -> int:
        return len(self.codes)

    def __getitem__(self, i):  # type: ignore[override]
        if isinstance(i, slice):
            return PackedRefs(self.codes[i])
        c = self.codes[i]
        return c >> ROW_BITS, c & ROW_MASK

    def __iter__(self) -> Iterator[Ref]:
        return ((c >> ROW_BITS, c & ROW_MASK) for c in self.codes)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, PackedRefs):
            return self.codes == other.codes
        return isinstance(other, tuple | list) and tuple(self) == tuple(other)

    def __hash__(self) -> int:
        return hash(self.codes.tobytes())

    def __add__(self, other: Iterable[Ref]) -> PackedRefs:
        other = other if isinstance(other, PackedRefs) else PackedRefs(other)
        return PackedRefs(self.codes + other.codes)

    def __repr__(self) -> str:
        return f"PackedRefs({tuple(self)!r})"

    def __reduce__(self):  # an array pickles as its bytes
        return PackedRefs, (self.codes,)


class IdColumn(Sequence):
    """Every input id in input order: 8 bytes a row for integer ids, the strings themselves otherwise."""

    def __init__(self, kind: str) -> None:
        self.values: array | list = array("q") if kind == "int" else []

    def append(self, value: Any) -> None:
        self.values.append(value)

    def __len__(self) -> int:
        return len(self.values)

    def __getitem__(self, i):  # type: ignore[override]
        return self.values[i]

    def __iter__(self) -> Iterator[Any]:
        return iter(self.values)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, IdColumn):
            return list(self.values) == list(other.values)
        return isinstance(other, list | tuple) and list(self.values) == list(other)

    __hash__ = None  # type: ignore[assignment]  (mutable, like the list it stands for)

    def __repr__(self) -> str:
        return f"IdColumn({list(self.values)[:10]!r}{', ...' if len(self.values) > 10 else ''})"


class RefIds(Mapping):
    """ref (file index, row index) -> id, for every planned row, computed from the id column and
    where each file's rows start (no dict of a million entries)."""

    def __init__(self, ids: IdColumn, starts: list[int]) -> None:
        self.ids, self.starts = ids, starts

    def _index(self, ref: Ref) -> int | None:
        fi, ri = ref
        if not 0 <= fi < len(self.starts) or ri < 0:
            return None
        end = self.starts[fi + 1] if fi + 1 < len(self.starts) else len(self.ids)
        g = self.starts[fi] + ri
        return g if g < end else None

    def __getitem__(self, ref: Ref) -> Any:
        g = self._index(ref)
        if g is None:
            raise KeyError(ref)
        return self.ids[g]

    def __contains__(self, ref: object) -> bool:
        return isinstance(ref, tuple) and len(ref) == 2 and self._index(ref) is not None  # type: ignore[arg-type]

    def __iter__(self) -> Iterator[Ref]:
        for fi, start in enumerate(self.starts):
            end = self.starts[fi + 1] if fi + 1 < len(self.starts) else len(self.ids)
            yield from ((fi, ri) for ri in range(end - start))

    def __len__(self) -> int:
        return len(self.ids)
