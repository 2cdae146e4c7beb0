"""Entry point for `python -m soakd`."""

from soakd.cli import main

raise SystemExit(main())
