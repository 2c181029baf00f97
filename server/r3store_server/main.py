"""`r3store-server`: run the service with uvicorn."""

from __future__ import annotations

import logging

import uvicorn

from r3store_server.app import create_app
from r3store_server.settings import Settings


def main() -> None:
    settings = Settings()
    logging.basicConfig(
        level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s %(message)s"
    )
    uvicorn.run(create_app(settings), host=settings.host, port=settings.port, log_config=None)


if __name__ == "__main__":
    main()
