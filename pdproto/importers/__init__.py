"""Importers: turn a real engine's own log lines into a (partial) history.

This layer sits on :mod:`pdproto.spec` alone.
"""

__all__: list[str] = []
