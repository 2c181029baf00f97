"""`r3store-server`: run the service with uvicorn."""

from __future__ import annotations

import sys

import uvicorn

from r3store_server.app import create_app
from r3store_server.logs import configure
from r3store_server.settings import Settings


def main() -> None:
    settings = Settings()
    configure(settings.log_level, settings.log_json)
    try:
        app = create_app(settings)
    except ValueError as exc:
        print(f"r3store-server: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    uvicorn.run(app, host=settings.host, port=settings.port, log_config=None)


if __name__ == "__main__":
    main()
