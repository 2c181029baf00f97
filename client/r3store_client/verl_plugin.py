"""The `verl.plugins` entry point: `import verl` imports it in every verl process, which
registers r3store's TransferQueue backend (`r3store_client.transferqueue`) there.

verl logs a plugin that fails to import at debug level only, and TransferQueue would
then say no more than that the backend is unknown. So a failure here is logged as an
error and leaves a stand-in registered under the backend's name, whose bootstrap and
manager raise an error naming r3store and what failed to import: a process that
chose the backend stops, and never runs on another one.
"""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger("r3store_client.verl_plugin")

NAME = "R3Store"

try:
    from r3store_client import transferqueue  # noqa: F401 (registers the backend)
except Exception as failure:  # noqa: BLE001 (any failure must reach the user)
    why = (
        f"r3store's TransferQueue backend {NAME!r} (r3store_client.transferqueue) could not "
        f"be imported: {type(failure).__name__}: {failure}"
    )
    log.error("%s", why)
    cause = failure  # the except clause unbinds its own name

    def _unavailable(*_args: Any, **_kwargs: Any) -> Any:
        raise ImportError(why) from cause

    try:
        from transfer_queue.storage.bootstrap.provider import StorageBootstrapProvider
        from transfer_queue.storage.managers.base import StorageManager, StorageManagerFactory
    except ImportError:
        pass  # no TransferQueue here: nothing can choose the backend
    else:

        class Unavailable(StorageManager):  # type: ignore[misc]
            """Stands in for the backend that failed to import: refuses to start."""

            __init__ = _unavailable

        StorageManagerFactory.register(NAME)(Unavailable)
        StorageBootstrapProvider.register_provider(NAME)(_unavailable)
