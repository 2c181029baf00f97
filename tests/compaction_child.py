"""Runs maintenance passes over a data directory until killed.

Usage: compaction_child.py DATA_DIR
"""

from __future__ import annotations

import sys
from pathlib import Path

from r3store.engine import Engine
from r3store.engine.maintenance import MaintenanceOptions
from r3store.storage.catalog import Catalog
from r3store.storage.store import LocalStore


def main() -> None:
    data = Path(sys.argv[1])
    engine = Engine(LocalStore(data / "objects"), Catalog(f"sqlite:///{data / 'catalog.db'}"))
    maintenance = engine.upkeep.maintenance(MaintenanceOptions(grace_seconds=0))
    sys.stdout.write("READY\n")
    sys.stdout.flush()
    while True:
        maintenance.run()


if __name__ == "__main__":
    main()
