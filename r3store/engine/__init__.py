"""The engine: the one door to a namespace's routes (`Engine`, in `core`), its parts
(`namespaces`, `api_keys`, `analytics`, `upkeep`; `encoding`, the write half of a put
that `core` and `direct` both use), and what they drive over the store
and the catalog: group commit (`writer`), ranged reads (`reader`), retention, compaction
and collection (`maintenance`), a catalog rebuilt from the store (`rebuild`) and
statistics kept as routes arrive (`analytics`)."""

from r3store.engine.core import Engine, EngineConfig
from r3store.engine.encoding import EncodedPut, put_row_bytes
from r3store.engine.maintenance import MaintenanceOptions

__all__ = ["EncodedPut", "Engine", "EngineConfig", "MaintenanceOptions", "put_row_bytes"]
