"""Adapters: drive real engine code with pdproto's actions and observe the
history events it really produces (docs/adapters.md).

Each adapter lives in its own subpackage and imports its engine only there:
``import pdproto.adapters`` imports no engine.  The drivers find an adapter
by name (``pdproto fuzz --adapter vllm:pull``) through
:func:`pdproto.drivers.load_adapter`.
"""

__all__: list[str] = []
