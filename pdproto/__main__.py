"""``python -m pdproto`` runs the command line."""

from ._cli import entry

entry()
