"""Protocol rules as data: one :class:`RuleTable` per protocol family, and a
:class:`RuleBook` of the families by policy.

A :class:`Rule` is one row of a family's transition table: its name, what it
is about (``kind``), who acts, when it may fire (``guard``, with its text
``when``), what it does (``effect``, with its text ``doc``) and the history
events it emits.  The model enumerates and steps a family's action rules in
table order; handler rules (a message received, a transfer's completion, the
cleanup of an ended generation) run when another rule's effect calls them.
The transition tables in docs/protocol.md are rendered from the same rules.

A variant of a protocol (a mutant reproducing a bug) replaces one rule by
name: ``REFERENCE.replace("recv_notify", guard=...)``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

import attrs

from ..spec import EVENT_TYPES
from ._state import End, Phase

__all__ = ["Kind", "Rule", "RuleTable", "RuleBook", "AT"]

#: Where a message or transfer rule applies, checked before its guard:
#: the oldest message in flight or another one; a transfer running (neither
#: aborted nor doomed), aborted by its initiator, or doomed (an endpoint
#: restarted).
AT = {
    "message": ("oldest", "other"),
    "transfer": ("running", "aborted", "doomed"),
}


class Kind:
    """What a rule is about; the action kinds say what the model enumerates
    it over, in table order.  Guard and effect signatures, by kind (``m`` is
    the model, ``s`` the state, ``ev`` the list the effect appends events to):

    - ``client``: effect(m, s, (r, p, d), ev), offered for the next request;
    - ``request``: guard(m, s, r, q) / effect(m, s, r, q, ev), per submitted
      request ``r`` whose record ``q`` is in one of ``phases`` and ``ends``;
    - ``transfer``: guard(m, s, x) / effect(m, s, i, x, ev), per transfer;
    - ``message``: guard(m, s, i, msg) / effect(m, s, i, msg, ev), per message;
    - ``worker``: guard(m, s, w) / effect(m, s, w, ev), per worker;
    - ``handler``: run by another rule's effect, with the signature its
      caller documents.
    """

    CLIENT = "client"
    REQUEST = "request"
    TRANSFER = "transfer"
    MESSAGE = "message"
    WORKER = "worker"
    HANDLER = "handler"
    ACTIONS = (CLIENT, REQUEST, TRANSFER, MESSAGE, WORKER)
    ALL = ACTIONS + (HANDLER,)


def _kind(instance: Any, attribute: Any, value: str) -> None:
    if value not in Kind.ALL:
        raise ValueError(f"rule kind {value!r}: expected one of {', '.join(Kind.ALL)}")


def _events(instance: Any, attribute: Any, value: tuple) -> None:
    unknown = [e for e in value if e not in EVENT_TYPES]
    if unknown:
        raise ValueError(f"rule events {unknown!r}: expected event kinds of the history format")


@attrs.frozen
class Rule:
    """One rule of a protocol family (one row of its transition table).

    ``action`` is the kind of the :class:`~pdproto.Action` it offers (its
    name unless given: a reordered delivery is a ``deliver``); ``fault`` the
    fault kind whose budget gates it and that it spends; ``phases`` and
    ``ends`` (request rules) the records it may fire on, checked before the
    guard; ``at`` (message and transfer rules) likewise, from :data:`AT`
    (empty: everywhere).  ``guard`` ``None``
    means always; ``unless`` names an earlier rule of the same run that,
    where enabled, disables this one; ``calls`` names the handler rules the
    effect may run (their events count as this rule's too).
    """

    name: str
    kind: str = attrs.field(validator=_kind)
    actor: str
    when: str  # the guard, in words
    doc: str  # the effect, in words
    events: tuple = attrs.field(converter=tuple, validator=_events)
    guard: Callable[..., bool] | None = attrs.field(default=None, eq=False)
    effect: Callable[..., Any] | None = attrs.field(default=None, eq=False)
    fault: str | None = None
    phases: tuple = attrs.field(default=tuple(Phase)[1:], converter=tuple)
    ends: tuple = attrs.field(default=(End.LIVE,), converter=tuple)
    calls: tuple = attrs.field(default=(), converter=tuple)  # handler rules its effect may run
    unless: str | None = None  # offered only where this other rule of the same kind is not
    at: tuple = attrs.field(
        default=(), converter=tuple
    )  # message/transfer rules: where (see AT); () everywhere
    action: str = attrs.field()

    @action.default
    def _action_default(self) -> str:
        return self.name

    def __attrs_post_init__(self) -> None:
        wrong = [a for a in self.at if a not in AT.get(self.kind, ())]
        if wrong:
            raise ValueError(f"rule {self.name!r}: at {wrong!r} is not one of {AT.get(self.kind, ())!r}")

    def row(self) -> dict[str, str]:
        """This rule's row of the transition table."""
        label = self.name if self.action == self.name else f"{self.name} ({self.action})"
        when = f"[fault: {self.fault}] {self.when}" if self.fault else self.when
        if self.unless:
            when += f" (unless {self.unless})"
        return {
            "action": label,
            "kind": self.kind,
            "actor": self.actor,
            "guard": when,
            "effect": self.doc,
            "events": (", ".join(self.events) or "(none)")
            + ("; via " + ", ".join(self.calls) if self.calls else ""),
        }


class RuleTable:
    """The ordered rules of one protocol family.  Each rule is also an
    attribute: ``table.recv_notify``.  ``phases`` lists the phases a
    generation of this family passes through, in order (each must be
    reachable: the model's ``sometimes``)."""

    def __init__(
        self, family: str, rules: tuple[Rule, ...] | list[Rule], phases: tuple[Phase, ...] = ()
    ) -> None:
        self.family = family
        self.rules = tuple(rules)
        self.phases = tuple(phases)
        for rule in self.rules:
            if not rule.name.isidentifier() or rule.name.startswith("_") or hasattr(RuleTable, rule.name):
                raise ValueError(
                    f"rule name {rule.name!r}: expected an identifier that names no RuleTable attribute"
                )
            if rule.name in self.__dict__:
                raise ValueError(f"rule name {rule.name!r} appears twice in family {family!r}")
            self.__dict__[rule.name] = rule
        for rule in self.rules:
            missing = [c for c in rule.calls if c not in self.__dict__]
            if missing:
                raise ValueError(f"rule {rule.name!r} calls {missing!r}, not rules of family {family!r}")

    def __iter__(self) -> Iterator[Rule]:
        return iter(self.rules)

    def __contains__(self, name: object) -> bool:
        return any(rule.name == name for rule in self.rules)

    def __getitem__(self, name: str) -> Rule:
        for rule in self.rules:
            if rule.name == name:
                return rule
        raise KeyError(f"no rule {name!r} in family {self.family!r}; rules: {', '.join(self.names())}")

    def __repr__(self) -> str:
        return f"RuleTable({self.family!r}, [{', '.join(self.names())}])"

    def get(self, name: str) -> Rule | None:
        """Rule ``name``, or None when this family has none."""
        rule = self.__dict__.get(name)
        return rule if isinstance(rule, Rule) else None

    def names(self) -> tuple[str, ...]:
        return tuple(rule.name for rule in self.rules)

    def replace(self, name: str, **changes: Any) -> RuleTable:
        """This table with rule ``name`` changed (``guard=``, ``effect=``, ...)."""
        self[name]  # raises on an unknown name
        rules = [attrs.evolve(r, **changes) if r.name == name else r for r in self.rules]
        return RuleTable(self.family, rules, self.phases)

    def rows(self) -> list[dict[str, str]]:
        return [rule.row() for rule in self.rules]

    def markdown(self) -> str:
        """The transition table as Markdown."""
        lines = [
            f"| rule ({self.family}) | kind | actor | guard | effect | events |",
            "|---|---|---|---|---|---|",
        ]
        for row in self.rows():
            cells = (row["action"], row["kind"], row["actor"], row["guard"], row["effect"], row["events"])
            lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
        return "\n".join(lines) + "\n"


class RuleBook(Mapping[str, RuleTable]):
    """The rule tables of a protocol's families, by policy."""

    def __init__(self, **families: RuleTable) -> None:
        self._families = dict(families)

    def __getitem__(self, policy: str) -> RuleTable:
        return self._families[policy]

    def __iter__(self) -> Iterator[str]:
        return iter(self._families)

    def __len__(self) -> int:
        return len(self._families)

    def __repr__(self) -> str:
        return "RuleBook(" + ", ".join(f"{k}={v!r}" for k, v in self._families.items()) + ")"

    def replace(self, name: str, **changes: Any) -> RuleBook:
        """This book with rule ``name`` changed in every family that has it."""
        if not any(name in table for table in self._families.values()):
            raise KeyError(f"no rule {name!r} in any family")
        return RuleBook(
            **{
                policy: table.replace(name, **changes) if name in table else table
                for policy, table in self._families.items()
            }
        )
