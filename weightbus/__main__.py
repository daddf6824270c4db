"""``python -m weightbus``: the same command line as ``weightbus``."""

from weightbus.cli import main

raise SystemExit(main())
