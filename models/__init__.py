"""The catalogue of handoff models: the reference protocol, its known-buggy
mutants and benign variants.  Installed as ``pdproto.models``; ``pdproto
check NAME`` takes a module name from here.

Each module defines:

- a docstring: first line what goes wrong (or, for a correct model, what it
  models); then the project and the public issue or PR, the mechanism in two
  sentences, the protocol family and the invariant that must catch it;
- ``EXPECTED``: the invariant id the model is meant to violate (``None`` for
  a correct model);
- ``DEFAULT_CONFIG``: the :class:`pdproto.ModelConfig` that ``pdproto check
  NAME`` uses when no flag overrides it;
- ``build(config) -> Model``;
- the catalogue entry's fields: ``PROJECT`` (lower-case: vllm, sglang,
  dynamo, nixl, mooncake, lmcache, ...), ``LINKS`` (the issue and/or PR
  URLs; ``()`` only for a correct model), ``FAMILY`` (``"push"`` or
  ``"pull"``, = ``DEFAULT_CONFIG.policy``), ``FAULTS`` (the fault kinds the
  bug needs, from :data:`pdproto.protocol.FAULT_KINDS`), optionally
  ``PHASE`` (lower-case phase the fault hits; for a cancel bug, the phase
  the cancel hits), ``BENIGN = True`` for a legal variant that every tool
  must pass, ``FAMILIES`` for a correct model checked in several
  families (the reference), and optionally ``CAVEAT`` (a string: when the
  verdict holds only by the model's construction or configuration, e.g. a
  real hold that a timeout the model lacks would bound; docs/bugs.md shows it).

A mutant is the reference with one named rule replaced
(``REFERENCE.replace("rule", guard=..., effect=..., phases=...)``).
``python -m pdproto.drivers._catalogue --write docs/bugs.md`` runs every tool
on every entry, writes docs/bugs.md and the regression corpus of histories
in ``corpus/`` here (``pdproto corpus`` runs it).
"""
