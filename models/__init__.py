"""The catalogue of handoff models: the reference protocol and its known-buggy
mutants.  Installed as ``pdproto.models``; ``pdproto check NAME`` takes a
module name from here.

Each module defines:

- a docstring naming what it models and, for a mutant, the real bug it
  reproduces (with the public issue);
- ``EXPECTED``: the invariant id the model is meant to violate (``None`` for
  a correct model);
- ``DEFAULT_CONFIG``: the :class:`pdproto.ModelConfig` that ``pdproto check
  NAME`` uses when no flag overrides it;
- ``build(config) -> Model``.
"""
