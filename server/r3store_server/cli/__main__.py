"""`python -m r3store_server.cli`: the `r3store` command line."""

from r3store_server.cli import main

raise SystemExit(main())
