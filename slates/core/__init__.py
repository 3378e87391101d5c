"""slates.core: the pure volume state machine (no I/O, clocks, threads or randomness).

Read in this order:
- records.py: one frozen record type per operation, msgpack at the edges;
- extents.py: a file's content as base, chunk, page and hole ranges;
- host.py: the chunk store and the capacity rules every volume shares;
- volume.py: `Volume.apply(record)`, the match over records, and the
  operation methods that settle names against the base before applying.
"""

from slates.core.extents import PAGE
from slates.core.host import Host
from slates.core.records import Attr, BaseEntry, DirItem, Fingerprint, Kind
from slates.core.volume import (
    ROOT_INO,
    BaseReader,
    Capacity,
    Counters,
    DirInfo,
    SealReport,
    Snapshot,
    Volume,
    chunk_ids,
)

__all__ = [
    "PAGE",
    "ROOT_INO",
    "Attr",
    "BaseEntry",
    "BaseReader",
    "Capacity",
    "Counters",
    "DirInfo",
    "DirItem",
    "Fingerprint",
    "Host",
    "Kind",
    "SealReport",
    "Snapshot",
    "Volume",
    "chunk_ids",
]
