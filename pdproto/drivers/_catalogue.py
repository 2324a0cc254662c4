"""The bug catalogue: every ``models/`` entry's contract fields, the verdict
of each tool on it, the regression corpus of histories and docs/bugs.md.

Each catalogue module (``pdproto.models.NAME``) states, besides ``build``,
``DEFAULT_CONFIG`` and ``EXPECTED`` (see ``models/__init__.py``):
``PROJECT`` (lower-case project), ``LINKS`` (issue and PR URLs), ``FAMILY``
(``"push"`` or ``"pull"``: ``DEFAULT_CONFIG.policy``), ``FAULTS`` (the fault
kinds the bug needs), optionally ``PHASE`` (the phase the fault hits: for a cancel
bug, the phase the cancel hits),
``BENIGN = True`` for a legal variant and ``FAMILIES`` for a correct model
checked in more than one family (the reference).

:func:`entries` reads them (:func:`contract_problems` says what a module
gets wrong); :func:`judge` runs the tools on one entry -- ``check``
(invariant, shortest length), ``fuzz`` (invariant, examples needed, fixed
seed), ``audit`` of the counterexample (same invariant at the same line),
``replay`` on the torch backend (``kv-corruption`` or why not) and
``conform`` against the reference (when :mod:`pdproto.drivers._conform`
exists) -- and writes the entry's histories into the corpus;
:func:`render` makes docs/bugs.md.  ``python -m pdproto.drivers._catalogue
--write docs/bugs.md`` regenerates both (reusing the verdicts of entries
whose model file, protocol and monitor did not change).
"""

from __future__ import annotations

import argparse
import collections
import hashlib
import importlib
import json
import os
import random
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import attrs

from ..protocol import FAULT_KINDS, Phase
from ..spec import INVARIANTS, POLICIES, read_events, write_history

__all__ = [
    "Entry",
    "entries",
    "contract_problems",
    "judge",
    "render",
    "corpus_dir",
    "load_expected",
    "run_corpus",
    "CorpusCase",
    "EXPECTED_FILE",
    "FUZZ_EXAMPLES",
    "FUZZ_SEED",
    "SAMPLES",
]

#: the fuzz budget of every verdict, with its fixed seed
FUZZ_EXAMPLES = 2000
FUZZ_SEED = 0
#: sample clean histories stored per correct entry (and family)
SAMPLES = 3
#: the corpus's index of expected verdicts, in :func:`corpus_dir`
EXPECTED_FILE = "EXPECTED.json"
#: the phases a cancel may hit, lower-case (``PHASE``)
PHASES = tuple(ph.name.lower() for ph in Phase if ph is not Phase.NEW)

_HERE = os.path.dirname(os.path.abspath(__file__))
_PKG = os.path.dirname(_HERE)


@attrs.frozen
class Entry:
    """One row of the catalogue: a model of ``models/`` in one family."""

    name: str  # module name (snake_case); ``row`` is the name shown
    row: str
    summary: str  # the docstring's first line
    project: str
    links: tuple[str, ...]
    family: str
    faults: tuple[str, ...]
    phase: str | None
    expected: str | None
    benign: bool
    config: Any = attrs.field(eq=False)
    module: Any = attrs.field(eq=False, repr=False)
    #: when the verdict holds only by the model's construction or configuration (CAVEAT)
    caveat: str = ""

    @property
    def correct(self) -> bool:
        return self.expected is None


def _first_line(doc: str | None) -> str:
    for line in (doc or "").strip().splitlines():
        if line.strip():
            return line.strip()
    return ""


def contract_problems(module: Any) -> list[str]:
    """What ``module`` gets wrong of the catalogue entry contract (empty: nothing)."""
    out = []
    name = module.__name__.rpartition(".")[2]
    for field in ("build", "DEFAULT_CONFIG", "EXPECTED", "PROJECT", "LINKS", "FAMILY", "FAULTS"):
        if not hasattr(module, field):
            out.append(f"{name}: no {field}")
    if out:
        return out
    expected, benign = module.EXPECTED, getattr(module, "BENIGN", False)
    if expected is not None and expected not in INVARIANTS:
        out.append(f"{name}: EXPECTED {expected!r} is no invariant id")
    if benign and expected is not None:
        out.append(f"{name}: BENIGN with EXPECTED {expected!r} (a benign variant expects None)")
    project = module.PROJECT
    if not isinstance(project, str) or not project or project != project.lower():
        out.append(f"{name}: PROJECT {project!r} is not a lower-case name")
    links = module.LINKS
    if not isinstance(links, tuple) or not all(
        isinstance(u, str) and u.startswith("https://") for u in links
    ):
        out.append(f"{name}: LINKS {links!r} is not a tuple of https URLs")
    elif expected is not None and not links:
        out.append(f"{name}: a mutant needs at least one link")
    if module.FAMILY not in POLICIES:
        out.append(f"{name}: FAMILY {module.FAMILY!r} is not one of {', '.join(POLICIES)}")
    elif getattr(module.DEFAULT_CONFIG, "policy", module.FAMILY) != module.FAMILY:
        out.append(
            f"{name}: FAMILY {module.FAMILY!r} but DEFAULT_CONFIG.policy is {module.DEFAULT_CONFIG.policy!r}"
        )
    faults = module.FAULTS
    if not isinstance(faults, tuple) or any(k not in FAULT_KINDS for k in faults):
        out.append(f"{name}: FAULTS {faults!r} is not a tuple of {', '.join(FAULT_KINDS)}")
    phase = getattr(module, "PHASE", None)
    if phase is not None and phase not in PHASES:
        out.append(f"{name}: PHASE {phase!r} is not one of {', '.join(PHASES)}")
    caveat = getattr(module, "CAVEAT", "")
    if not isinstance(caveat, str):
        out.append(f"{name}: CAVEAT {caveat!r} is not a string")
    if not _first_line(module.__doc__):
        out.append(f"{name}: no docstring")
    return out


def _catalogue_names() -> list[str]:
    from ._loader import _model_names

    return _model_names()


def entries(names: Iterable[str] | None = None, problems: list[str] | None = None) -> list[Entry]:
    """The catalogue's entries (one per model and family), reference first,
    then the mutants and the benign variants by name.  A module that breaks
    the contract is left out and its problems appended to ``problems``."""
    out = []
    for name in list(names) if names is not None else _catalogue_names():
        try:
            module = importlib.import_module(f"pdproto.models.{name}")
        except Exception as exc:  # a broken module is reported, not fatal
            if problems is not None:
                problems.append(f"{name}: cannot import ({type(exc).__name__}: {exc})")
            continue
        wrong = contract_problems(module)
        if wrong:
            if problems is not None:
                problems.extend(wrong)
            continue
        families = tuple(getattr(module, "FAMILIES", (module.FAMILY,)))
        for family in families:
            config = module.DEFAULT_CONFIG
            if family != module.FAMILY:
                config = attrs.evolve(config, policy=family)
            row = name if family == module.FAMILY else f"{name} ({family})"
            out.append(
                Entry(
                    name=name,
                    row=row,
                    summary=_first_line(module.__doc__),
                    project=module.PROJECT,
                    links=tuple(module.LINKS),
                    family=family,
                    faults=tuple(module.FAULTS),
                    phase=getattr(module, "PHASE", None),
                    expected=module.EXPECTED,
                    benign=bool(getattr(module, "BENIGN", False)),
                    config=config,
                    module=module,
                    caveat=getattr(module, "CAVEAT", "") or "",
                )
            )
    out.sort(key=lambda e: (e.name != "reference", e.benign, e.name, e.family != e.module.FAMILY))
    return out


# -- the corpus -------------------------------------------------------------------


def corpus_dir() -> str:
    """Where the shipped corpus lives: ``corpus/`` inside the catalogue
    package (``models/corpus`` in the repository, ``pdproto/models/corpus``
    when installed)."""
    from ._loader import _catalogue

    _, pkg = _catalogue()
    paths = list(getattr(pkg, "__path__", [])) if pkg is not None else []
    base = paths[0] if paths else os.path.join(os.path.dirname(_PKG), "models")
    return os.path.join(base, "corpus")


def load_expected(directory: str | None = None) -> dict[str, Any]:
    """The corpus's index: history file name -> its expected verdicts."""
    path = os.path.join(directory or corpus_dir(), EXPECTED_FILE)
    with open(path, encoding="utf-8") as f:
        return json.load(f)  # type: ignore[no-any-return]


def _config_keys(config: Any) -> dict[str, Any]:
    """The loader keywords that rebuild ``config`` (for ``model:`` adapters)."""
    return {
        "mode": config.policy,
        "requests": config.requests,
        "blocks": config.blocks,
        "faults": {k: v for k, v in config.faults.items() if v},
        "prefix_cache": config.prefix_cache,
        "chunks": config.chunks,
        "layerwise": config.layerwise,
        "block_size": config.block_size,
        "prompt_len": config.prompt_len,
    }


def sample_history(model: Any, seed: int, limit: int = 400) -> tuple[list, Any]:
    """A random run of ``model`` (actions picked uniformly with ``seed``,
    faults included within their budgets) until it goes quiet: its events
    and header (``complete`` when it went quiet within ``limit`` steps)."""
    rng = random.Random(seed)
    state = model.initial_states()[0]
    events: list = []
    quiet = False
    for _ in range(limit):
        acts = model.actions(state)
        if not acts:
            quiet = True
            break
        state, evs = model.step(state, acts[rng.randrange(len(acts))])
        events.extend(evs)
    return events, attrs.evolve(model.header, complete=quiet)


# -- the verdicts -----------------------------------------------------------------


def _key(entry: Entry) -> str:
    """What the verdicts of ``entry`` depend on: its model file and the
    protocol (a change to either recomputes them).  A change of the monitor
    that moves a verdict shows in tests/test_catalogue.py (the corpus is
    audited against its index) and in the slow test that regenerates all."""
    h = hashlib.sha256()
    files = [entry.module.__file__]
    d = os.path.join(_PKG, "protocol")
    files += sorted(os.path.join(d, f) for f in os.listdir(d) if f.endswith(".py"))
    for path in files:
        with open(path, "rb") as f:
            h.update(f.read())
    h.update(repr((entry.family, FUZZ_EXAMPLES, FUZZ_SEED, SAMPLES)).encode())
    return h.hexdigest()[:16]


def _conform() -> Any:
    try:
        from ._conform import conform
    except ImportError:
        return None
    return conform


def _replay_verdict(path: str, expected: str | None, events: Sequence[Any]) -> dict[str, Any]:
    """The torch backend's verdict on a history: kv-corruption or not, and why not."""
    try:
        from ._replay import replay

        result = replay(path)
    except Exception as exc:  # torch missing, or a backend limit: say so
        return {"kv_corruption": None, "why": f"not run ({type(exc).__name__}: {exc})"}
    kv = [v for v in result.violations if v.invariant == "kv-corruption"]
    if kv:
        return {"kv_corruption": True, "line": kv[0].line, "why": ""}
    if expected is None:
        return {"kv_corruption": False, "why": "clean"}
    if expected in ("leak", "stuck"):
        why = "an end-of-run check: nothing is read wrong, the blocks or the request are held for good"
    elif not any(e.EV == "decode" for e in events):
        why = "no decode reads the KV: the run stops at the violation"
    else:
        why = f"every decode read its own generation's KV: {expected} breaks the bookkeeping, not the bytes"
    return {"kv_corruption": False, "why": why}


def judge(
    entry: Entry, out_dir: str, *, examples: int = FUZZ_EXAMPLES, seed: int = FUZZ_SEED
) -> dict[str, Any]:
    """Run every tool on ``entry``; write its histories into ``out_dir``;
    return its verdicts (the corpus index's entries under ``"histories"``)."""
    from ._audit import audit
    from ._explore import explore, trace_header
    from ._fuzz import fuzz
    from ._loader import load_model

    model, info = load_model(entry.name, mode=entry.family)
    stem = entry.name if entry.family == entry.module.FAMILY else f"{entry.name}.{entry.family}"
    verdict: dict[str, Any] = {"row": entry.row, "key": _key(entry), "histories": {}}
    t0 = time.perf_counter()
    result = explore(model)
    found = result.failures
    check: dict[str, Any] = {
        "ok": result.ok,
        "states": result.states,
        "seconds": round(time.perf_counter() - t0, 2),
    }
    histories: list[tuple[str, dict[str, Any]]] = []
    if found:
        cx = found[0]
        check.update(invariant=cx.invariant, length=len(cx.trace), line=cx.line)
        name = f"{stem}.jsonl"
        write_history(os.path.join(out_dir, name), cx.events, trace_header(result.header, cx))
        histories.append((name, {"invariant": cx.invariant, "line": cx.line}))
    else:
        check["unmet_sometimes"] = list(result.unmet_sometimes) if result.complete else []
        for k in range(1, SAMPLES + 1):
            events, header = sample_history(model, seed=k)
            name = f"{stem}.{k}.jsonl"
            write_history(os.path.join(out_dir, name), events, header)
            histories.append((name, {"invariant": None, "line": None}))
    verdict["check"] = check

    t0 = time.perf_counter()
    fz = fuzz(model, examples=examples, seed=seed, database=None, name=entry.name, expected=entry.expected)
    verdict["fuzz"] = {
        "ok": fz.ok,
        "invariant": fz.violation.invariant if fz.violation else None,
        "examples": fz.counters.get("found_at_example") if fz.violation else fz.counters.get("examples"),
        "seconds": round(time.perf_counter() - t0, 2),
    }

    conform = _conform()
    for name, want in histories:
        path = os.path.join(out_dir, name)
        au = audit(path)
        first = au.violations[0] if au.violations else None
        got = {"invariant": first.invariant if first else None, "line": first.line if first else None}
        rec: dict[str, Any] = {
            "model": entry.name,
            "family": entry.family,
            "expected": want["invariant"],
            "line": want["line"],
            "audit": got,
            "config": _config_keys(info.config),
        }
        events = [e for _, e in read_events(path)]
        rec["replay"] = _replay_verdict(path, want["invariant"], events)
        if conform is None:
            rec["conform"] = None
        else:
            try:
                c = conform(path, model="reference")
                rec["conform"] = {"ok": bool(c.ok), "line": getattr(c, "line", None)}
            except Exception as exc:
                rec["conform"] = {"ok": None, "line": None, "error": f"{type(exc).__name__}: {exc}"}
        verdict["histories"][name] = rec
    return verdict


# -- docs/bugs.md -----------------------------------------------------------------


def _link_cell(links: Sequence[str]) -> str:
    cells = []
    for url in links:
        parts = url.rstrip("/").split("/")
        label = f"{parts[4]}#{parts[6]}" if len(parts) >= 7 and "github.com" in url else url
        cells.append(f"[{label}]({url})")
    return "<br>".join(cells) or "-"


def _cells(entry: Entry, v: Mapping[str, Any]) -> dict[str, str]:
    c, f = v["check"], v["fuzz"]
    hist = list(v["histories"].values())
    if entry.correct:
        check = (
            f"clean ({c['states']:,} states)"
            if c["ok"]
            else (f"**{c.get('invariant') or 'unmet ' + ', '.join(c.get('unmet_sometimes', []))}**")
        )
        fuzz = (
            f"clean ({f['examples']:,} examples)"
            if f["ok"]
            else f"**{f['invariant']}** at example {f['examples']}"
        )
        bad = [h for h in hist if h["audit"]["invariant"] is not None]
        audit = f"clean ({len(hist)} samples)" if not bad else f"**{bad[0]['audit']['invariant']}**"
        kv = [h for h in hist if h["replay"]["kv_corruption"]]
        replay = "clean" if not kv else "**kv-corruption**"
        if any(h["replay"]["kv_corruption"] is None for h in hist):
            replay = hist[0]["replay"]["why"]
    else:
        h = hist[0] if hist else None
        check = f"`{c['invariant']}`, {c['length']} steps" if c.get("invariant") else "**missed**"
        if c.get("invariant") and c["invariant"] != entry.expected:
            check = f"**{c['invariant']}** (expected {entry.expected}), {c['length']} steps"
        fuzz = (
            f"`{f['invariant']}` at example {f['examples']}"
            if f["invariant"]
            else f"**missed** in {f['examples']:,}"
        )
        if f["invariant"] and f["invariant"] != entry.expected:
            fuzz = f"**{f['invariant']}** at example {f['examples']}"
        if h is None:
            audit = replay = "-"
        else:
            a = h["audit"]
            same = a["invariant"] == c.get("invariant") and a["line"] == c.get("line")
            audit = (
                f"same, line {a['line']}"
                if same
                else f"**{a['invariant']} at line {a['line']}** (check: line {c.get('line')})"
            )
            r = h["replay"]
            replay = "kv-corruption" if r["kv_corruption"] else f"no: {r['why']}"
    conf = [h.get("conform") for h in hist]
    if not conf or any(x is None for x in conf):
        conform = "n/a (conform not built)"
    elif entry.correct:
        conform = (
            "conforms"
            if all(x["ok"] for x in conf)
            else "; ".join(f"deviates at line {x['line']}" for x in conf if not x["ok"])
        )
    else:
        x = conf[0]
        conform = "conforms" if x["ok"] else f"deviates at line {x['line']}"
    return {"check": check, "fuzz": fuzz, "audit": audit, "replay": replay, "conform": conform}


COLUMNS = (
    "#",
    "entry",
    "bug",
    "project",
    "link",
    "family",
    "faults",
    "expected",
    "check",
    "fuzz",
    "audit",
    "replay (torch)",
    "conform",
)


def _esc(text: str) -> str:
    return text.replace("|", "\\|")


def render(
    rows: Sequence[Entry], verdicts: Mapping[str, Mapping[str, Any]], problems: Sequence[str] = ()
) -> str:
    """docs/bugs.md: one row per entry, then the totals."""
    mutants = [e for e in rows if not e.correct]
    benign = [e for e in rows if e.benign]
    lines = [
        "# The bug catalogue",
        "",
        "Generated by `python -m pdproto.drivers._catalogue --write docs/bugs.md` from the contract",
        "fields of every `models/` module (`PROJECT`, `LINKS`, `FAMILY`, `FAULTS`, `PHASE`, `EXPECTED`,",
        "`BENIGN`, `CAVEAT`) and the verdict of each tool; do not edit by hand (tests/test_catalogue.py",
        "compares).  A *caveat* says when a verdict holds only by the model's construction or configuration",
        "(for example a real hold that a timeout bounds, which the model does not have).",
        "",
        f"{len(mutants)} mutants of real public bugs, {len(benign)} benign variants and the reference "
        "(in both families).",
        "Columns: `check` the invariant of the shortest counterexample and its length (a correct model:",
        "clean and the states explored); `fuzz` the invariant and the example that found it "
        f"({FUZZ_EXAMPLES:,} examples, seed {FUZZ_SEED});",
        "`audit` the stored counterexample re-audited (the same invariant at the same line); `replay`",
        "the counterexample on the torch backend's real KV buffers (`kv-corruption`, or why not);",
        "`conform` the history against the reference model.  The histories are the regression corpus",
        "(models/corpus/, shipped as `pdproto.models/corpus`): `pdproto corpus [--adapter NAME]`.",
        "",
        "| " + " | ".join(COLUMNS) + " |",
        "|" + "---|" * len(COLUMNS),
    ]
    for i, e in enumerate(rows, 1):
        v = verdicts[e.row]
        c = _cells(e, v)
        expected = f"`{e.expected}`" if e.expected else ("none (benign)" if e.benign else "none (correct)")
        faults = ", ".join(e.faults) or "-"
        if e.phase:
            faults += f" ({e.phase})"
        bug = e.summary + (f" *Caveat:* {e.caveat}" if e.caveat else "")
        cells = [
            str(i),
            f"`{e.row}`",
            bug,
            e.project,
            _link_cell(e.links),
            e.family,
            faults,
            expected,
            c["check"],
            c["fuzz"],
            c["audit"],
            c["replay"],
            c["conform"],
        ]
        lines.append("| " + " | ".join(_esc(x) for x in cells) + " |")
    lines += ["", "## Totals", ""]
    lines += _totals(mutants, verdicts)
    if problems:
        lines += ["", "## Modules left out (contract problems)", ""]
        lines += [f"- {_esc(p)}" for p in problems]
    return "\n".join(lines) + "\n"


#: why a fault kind no mutant needs is not covered yet (printed under the totals)
UNCOVERED_WHY = {
    "reorder": (
        "No mutant needs `reorder`.  In the reference, at most one message of a generation is in flight "
        "(besides duplicates), every message carries its generation and its sender's incarnation, and "
        "every other fact a worker acts on (that a generation ended, that a transfer is in flight) comes "
        "from the router's tombstone, which every worker sees at once.  So no handler's outcome depends "
        "on the order of delivery, and a receiver that assumes FIFO order has nothing to get wrong.  "
        "Bugs of that kind (sgl-project/sglang#30352: D's `ABORT` reaches P before or after the transfer "
        "worker's completion, and without a sticky `Failed` the later one wins) need a worker that learns "
        "of an abort only by a message: an extension of the reference not built yet."
    ),
}


def _count_table(title: str, counts: Mapping[str, int]) -> list[str]:
    out = [f"| {title} | mutants |", "|---|---|"]
    out += [f"| {k} | {n} |" for k, n in counts.items()]
    return out + [""]


def _totals(mutants: Sequence[Entry], verdicts: Mapping[str, Mapping[str, Any]]) -> list[str]:
    projects = collections.Counter(e.project for e in mutants)
    invariants = collections.Counter(e.expected for e in mutants)
    faults: collections.Counter[str] = collections.Counter()
    for e in mutants:
        faults.update(e.faults or ("(none)",))
    phases = collections.Counter(e.phase for e in mutants if e.phase and "cancel" in e.faults)
    families = collections.Counter(e.family for e in mutants)
    agree = sum(1 for e in mutants if _agrees(e, verdicts[e.row]))
    kv = sum(
        1 for e in mutants if any(h["replay"]["kv_corruption"] for h in verdicts[e.row]["histories"].values())
    )
    out = [
        f"- {len(mutants)} mutants; check, fuzz and audit agree on the expected invariant for {agree}; "
        f"the torch replay finds kv-corruption in {kv} counterexamples.",
        "",
    ]
    out += _count_table("project", dict(sorted(projects.items(), key=lambda kv: (-kv[1], kv[0]))))
    out += _count_table("invariant", {k: invariants.get(k, 0) for k in INVARIANTS})
    out += _count_table(
        "fault kind", {**{k: faults.get(k, 0) for k in FAULT_KINDS}, "(none)": faults.get("(none)", 0)}
    )
    out += [UNCOVERED_WHY[k] + "\n" for k in FAULT_KINDS if not faults.get(k) and k in UNCOVERED_WHY]
    out += _count_table("cancel phase", {p: phases.get(p, 0) for p in PHASES})
    out += _count_table("family", {k: families.get(k, 0) for k in POLICIES})
    return out[:-1]


def _agrees(e: Entry, v: Mapping[str, Any]) -> bool:
    c, f = v["check"], v["fuzz"]
    hist = list(v["histories"].values())
    return bool(
        c.get("invariant") == e.expected
        and f["invariant"] == e.expected
        and hist
        and hist[0]["audit"]["invariant"] == e.expected
        and hist[0]["audit"]["line"] == c.get("line")
    )


# -- the generator ----------------------------------------------------------------


def _judged(
    verdicts: dict[str, Any],
    old: dict[str, Any],
    row: str,
    verdict: dict[str, Any],
    seconds: float,
    corpus: str,
    log: Any,
) -> None:
    """Record one entry's verdict, on disk too (an interrupted run keeps what it judged)."""
    verdicts[row] = old[row] = verdict
    _dump(os.path.join(corpus, "VERDICTS.json"), old)
    if log is not None:
        print(f"{row}: {seconds:.1f} s", file=log, flush=True)


def _judge_row(row: str, corpus: str) -> tuple[str, dict[str, Any], float]:
    """Judge the entry shown as ``row`` (in a worker process, too)."""
    (entry,) = [e for e in entries() if e.row == row]
    t0 = time.perf_counter()
    return row, judge(entry, corpus), time.perf_counter() - t0


def generate(
    out: str | None,
    corpus: str | None = None,
    *,
    fresh: bool = False,
    only: Sequence[str] = (),
    log: Any = None,
    jobs: int = 1,
) -> tuple[str, list[str]]:
    """Judge every entry (reusing the verdicts of unchanged ones unless
    ``fresh``; ``only``: judge just those, keep the rest), rewrite the
    corpus and its index, and return docs/bugs.md's text (written to
    ``out`` when given) with the contract problems.  ``jobs``: judge that
    many entries at once (worker processes)."""
    corpus = corpus or corpus_dir()
    os.makedirs(corpus, exist_ok=True)
    problems: list[str] = []
    rows = entries(problems=problems)
    try:
        old = json.load(open(os.path.join(corpus, "VERDICTS.json"), encoding="utf-8"))
    except (OSError, ValueError):
        old = {}
    verdicts: dict[str, Any] = {}
    todo = []
    for e in rows:
        prev = old.get(e.row)
        keep = prev is not None and (
            not fresh and (prev.get("key") == _key(e) or (only and e.name not in only))
        )
        keep = keep and all(os.path.exists(os.path.join(corpus, n)) for n in prev["histories"])
        if keep:
            verdicts[e.row] = prev
        else:
            todo.append(e.row)
    if jobs > 1 and len(todo) > 1:
        import concurrent.futures

        with concurrent.futures.ProcessPoolExecutor(jobs) as pool:
            futures = {pool.submit(_judge_row, row, corpus): row for row in todo}
            for fut in concurrent.futures.as_completed(futures):
                row, verdict, seconds = fut.result()
                _judged(verdicts, old, row, verdict, seconds, corpus, log)
    else:
        for row in todo:
            _, verdict, seconds = _judge_row(row, corpus)
            _judged(verdicts, old, row, verdict, seconds, corpus, log)
    wanted = {n for v in verdicts.values() for n in v["histories"]}
    for name in os.listdir(corpus):  # histories of entries that are gone
        if name.endswith(".jsonl") and name not in wanted:
            os.remove(os.path.join(corpus, name))
    index = {n: h for v in verdicts.values() for n, h in v["histories"].items()}
    _dump(os.path.join(corpus, EXPECTED_FILE), dict(sorted(index.items())))
    _dump(os.path.join(corpus, "VERDICTS.json"), verdicts)
    text = render(rows, verdicts, problems)
    if out is not None:
        with open(out, "w", encoding="utf-8") as f:
            f.write(text)
    return text, problems


def _dump(path: str, obj: Any) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=1, sort_keys=True)
        f.write("\n")


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m pdproto.drivers._catalogue",
        description="Regenerate the corpus and docs/bugs.md from models/.",
    )
    p.add_argument("--write", metavar="FILE", help="write the catalogue here (e.g. docs/bugs.md)")
    p.add_argument("--corpus", metavar="DIR", help="the corpus directory (default: models/corpus)")
    p.add_argument("--fresh", action="store_true", help="recompute every entry's verdicts")
    p.add_argument("--only", nargs="*", default=(), metavar="NAME", help="recompute only these models")
    p.add_argument("--problems", action="store_true", help="only list the contract problems")
    p.add_argument("--jobs", type=int, default=1, metavar="N", help="judge N entries at once (processes)")
    args = p.parse_args(argv)
    if args.problems:
        problems: list[str] = []
        entries(problems=problems)
        print("\n".join(problems) or "no contract problems")
        return 1 if problems else 0
    text, problems = generate(
        args.write, args.corpus, fresh=args.fresh, only=args.only, log=sys.stderr, jobs=args.jobs
    )
    for line in problems:
        print(f"contract problem: {line}", file=sys.stderr)
    if args.write is None:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())


# -- running the corpus -----------------------------------------------------------


@attrs.frozen
class CorpusCase:
    """One history of the corpus, judged: ``ok`` when it got its expected
    verdict (no adapter: audit reports the expected invariant first, at the
    expected line, or nothing for a clean history; with an adapter: the
    engine re-enacting it broke no invariant).  ``got`` says what happened;
    ``skipped`` says why it was not run (another family than the adapter's)."""

    history: str
    model: str
    expected: str | None
    line: int | None
    ok: bool
    got: str
    skipped: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "history": self.history,
            "model": self.model,
            "expected": self.expected,
            "line": self.line,
            "ok": self.ok,
            "got": self.got,
            "skipped": self.skipped,
        }


def run_corpus(directory: str | None = None, adapter: str | None = None) -> list[CorpusCase]:
    """Judge every history of the corpus at ``directory`` (default: the
    shipped one, :func:`corpus_dir`) by its ``EXPECTED.json``: with
    :func:`~pdproto.drivers.audit`, or, given ``adapter`` (an
    :func:`~pdproto.drivers.load_adapter` name), by re-enacting it on that
    system (:func:`~pdproto.drivers.replay_on_adapter`): a correct system
    must not reproduce any bug of the corpus (it refuses the buggy step, or
    takes it without breaking an invariant) and must run the clean histories
    without breaking one.  A ``model:NAME`` adapter is built with each
    history's configuration."""
    from .._errors import UsageError
    from ._adapter import load_adapter
    from ._adapter_replay import replay_on_adapter
    from ._audit import audit

    directory = directory if directory is not None else corpus_dir()
    try:
        index = load_expected(directory)
    except FileNotFoundError:
        raise UsageError(
            "corpus directory", directory, f"a directory holding {EXPECTED_FILE} and its histories"
        ) from None
    except ValueError as exc:
        raise UsageError(f"{os.path.join(directory, EXPECTED_FILE)}", str(exc), "a JSON object") from None
    out = []
    shared = None
    if adapter is not None and not adapter.startswith("model:"):
        shared = load_adapter(adapter)
    try:
        for name in sorted(index):
            rec = index[name]
            path = os.path.join(directory, name)
            if not os.path.exists(path):
                raise UsageError("corpus history", path, f"a file listed in {EXPECTED_FILE} that exists")
            want, line = rec.get("expected"), rec.get("line")
            if adapter is None:
                found = audit(path).violations
                first = found[0] if found else None
                got = "clean" if first is None else f"{first.invariant} at line {first.line}"
                ok = (first is None and want is None) or (
                    first is not None and first.invariant == want and first.line == line
                )
                out.append(CorpusCase(name, rec.get("model", ""), want, line, ok, got))
                continue
            engine = shared
            if engine is None:
                engine = load_adapter(adapter, **rec.get("config", {}))
            family = getattr(getattr(engine, "header", None), "policy", None)
            if family is not None and family != rec.get("family", family):
                out.append(
                    CorpusCase(
                        name,
                        rec.get("model", ""),
                        want,
                        line,
                        True,
                        "-",
                        skipped=f"a {rec['family']} history; the adapter is {family}",
                    )
                )
                continue
            try:
                res, violations = _reenact(path, engine, replay_on_adapter)
            finally:
                if engine is not shared:
                    engine.close()
            refused = sum(1 for d in res.divergences if d.kind == "refused")
            if violations:
                v = violations[0]
                got = f"{v.invariant} at line {v.line}"
            else:
                got = "no invariant broken" + (
                    f" ({len(res.divergences)} divergences, {refused} refused)"
                    if res.divergences
                    else ", followed it all"
                )
            out.append(CorpusCase(name, rec.get("model", ""), want, line, not violations, got))
    finally:
        if shared is not None:
            shared.close()
    return out


#: most steps an engine takes after a re-enacted history to go quiet
QUIET_STEPS = 1000


def _reenact(path: str, engine: Any, replay_on_adapter: Any) -> tuple[Any, list[Any]]:
    """Re-enact the history at ``path`` on ``engine``; then, for a complete
    history, let the engine go quiet (its non-fault actions, first offered
    first) before the end-of-run checks: the history's end is where the
    buggy system went quiet, not where a correct one does (it may still have
    a transfer to finish or a block to free).  An engine that did not do
    every event the history has (a ``missing`` divergence) went another way
    and gets no end-of-run checks.  Returns the replay result and
    the violations of the engine's own events."""
    import tempfile

    from ..spec import Monitor, open_history

    with open_history(path) as reader:
        header = reader.header
        events = [e for _, e in reader]
    if not header.complete:
        res = replay_on_adapter(path, engine)
        return res, list(res.violations)
    with tempfile.TemporaryDirectory() as tmp:
        partial = os.path.join(tmp, os.path.basename(path))
        write_history(partial, events, attrs.evolve(header, complete=False))
        res = replay_on_adapter(partial, engine)
    if any(d.kind == "missing" for d in res.divergences):
        return res, list(res.violations)  # the engine went another way: its end is not this history's
    after = []
    for _ in range(QUIET_STEPS):
        acts = [a for a in engine.actions() if not a.fault]
        if not acts:
            break
        after.extend(engine.apply(acts[0]))
    monitor = Monitor.from_header(attrs.evolve(engine.header, complete=True))
    line = 1
    for line, e in enumerate(list(res.engine_events) + after, 2):
        monitor.feed(e, line)
    monitor.line = line
    monitor.finish()
    found = list(res.violations) + [
        v
        for v in monitor.violations
        if v.invariant in ("leak", "stuck") or v.line > 1 + len(res.engine_events)
    ]
    return res, found


def list_rows(models: Sequence[tuple[str, str | None, str]]) -> list[dict[str, Any]]:
    """``pdproto check --list``'s rows: each of :func:`~pdproto.drivers.list_models`'s
    ``(name, expected, summary)`` with the entry's contract fields (project,
    family, fault kinds, links; empty where a module lacks them)."""
    out = []
    for name, expected, summary in models:
        try:
            module = importlib.import_module(f"pdproto.models.{name.replace('-', '_')}")
        except Exception:
            module = None
        family = getattr(module, "FAMILY", "")
        families = getattr(module, "FAMILIES", None)
        out.append(
            {
                "model": name,
                "expected": expected,
                "summary": summary,
                "project": getattr(module, "PROJECT", ""),
                "family": ", ".join(families) if families else family,
                "faults": list(getattr(module, "FAULTS", ())),
                "links": list(getattr(module, "LINKS", ())),
                "benign": bool(getattr(module, "BENIGN", False)),
            }
        )
    return out
