"""The discrete-event simulator of ``pdproto simulate`` (docs/simulate.md)."""
