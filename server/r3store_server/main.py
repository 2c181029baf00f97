"""`r3store-server`: run the service with uvicorn, configured by `R3STORE_*` variables.

Before anything is logged: the settings are checked (one line naming a bad variable and
what it accepts), unknown `R3STORE_*` variables are warned about, and the port is bound
(a port in use is said so, naming `R3STORE_PORT`).
"""

from __future__ import annotations

import argparse
import errno
import socket
import sys

import r3store
from r3store.errors import InvalidConfig
from r3store_server.settings import Settings, accepted, load_settings, unknown_variables, variables


def _help() -> str:
    lines = []
    for name, field in variables().items():
        default = field.get_default(call_default_factory=True)
        shown = f"; default {default}" if default not in (None, "", []) else ""
        lines.append(f"  {name}\n      {accepted(field)}{shown}")
    return "settings, from the environment:\n" + "\n".join(lines)


def parser() -> argparse.ArgumentParser:
    return argparse.ArgumentParser(
        prog="r3store-server",
        description="Run the r3store service (by default the embedded store in ./data, "
        "on http://127.0.0.1:8330, authentication off on loopback).",
        epilog=_help(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )


def bind(settings: Settings) -> socket.socket:
    """The listening socket, or InvalidConfig when the address cannot be had."""
    family = socket.AF_INET6 if ":" in settings.host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((settings.host, settings.port))
    except OSError as exc:
        sock.close()
        where = f"{settings.host}:{settings.port}"
        if exc.errno == errno.EADDRINUSE:
            raise InvalidConfig(
                f"{where} is already in use: set R3STORE_PORT to a free port "
                "(or stop the other server)"
            ) from None
        raise InvalidConfig(
            f"cannot listen on {where} (R3STORE_HOST, R3STORE_PORT): {exc}"
        ) from None
    sock.set_inheritable(True)
    return sock


def main(argv: list[str] | None = None) -> None:
    p = parser()
    p.add_argument("--version", action="version", version=f"r3store {r3store.__version__}")
    p.parse_args(argv)
    try:
        settings = load_settings()
        for name in unknown_variables():
            print(f"r3store-server: warning: {name} is not a setting (a typo?)", file=sys.stderr)
        sock = bind(settings)
    except InvalidConfig as exc:
        print(f"r3store-server: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    serve(settings, sock)


def serve(settings: Settings, sock: socket.socket) -> None:
    import uvicorn

    from r3store_server import allocator
    from r3store_server.app import create_app
    from r3store_server.connections import fit_open_files, protocol
    from r3store_server.logs import configure

    configure(settings.log_level, settings.log_json)
    allocator.tune()  # before the first request's buffers
    try:
        app = create_app(settings)
    except ValueError as exc:
        print(f"r3store-server: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    connections = fit_open_files(settings.max_connections)
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_config=None,
        access_log=False,
        http=protocol(settings, connections),  # header and connection limits
        ws="none",
        timeout_keep_alive=settings.keep_alive_timeout,
        backlog=settings.backlog,
    )
    server = uvicorn.Server(config)
    app.state.stop = lambda: setattr(server, "should_exit", True)
    server.run(sockets=[sock])
    if getattr(app.state, "fatal", None):  # found after it began to listen (logged)
        print(f"r3store-server: cannot start: {app.state.fatal}", file=sys.stderr)
        raise SystemExit(3)


if __name__ == "__main__":
    main()
