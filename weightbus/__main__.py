"""``python -m weightbus``: the same command line as ``weightbus``."""

from weightbus.tools.cli import entry

entry()
