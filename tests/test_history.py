"""The history format: events, the streaming reader and the writer."""

from __future__ import annotations

import io
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdproto import (
    EVENT_TYPES,
    FEATURES,
    KVSpec,
    Share,
    TransferStart,
    Free,
    HistoryFormatError,
    HistoryHeader,
    HistoryReader,
    HistoryWriter,
    Reserve,
    WorkerSpec,
    event_from_dict,
    read_events,
    write_history,
)


def read(text: str, name="h.jsonl"):
    reader = HistoryReader(io.StringIO(text), name)
    return reader, list(reader)


def error(text: str) -> HistoryFormatError:
    with pytest.raises(HistoryFormatError) as info:
        read(text)
    return info.value


def test_header_is_optional_and_blank_lines_count():
    reader, events = read('\n{"ev": "free", "worker": "D0", "blocks": [1]}\n\n{"ev": "restart", "worker": "D0", "incarnation": 1}\n')
    assert not reader.has_header and reader.header.policy == "push"
    assert [line for line, _ in events] == [2, 4]
    assert events[0][1] == Free("D0", (1,))


def test_header_fields():
    text = '{"pdproto": "history", "version": 1, "policy": "pull", "complete": true, "workers": {"P0": {"role": "prefill", "blocks": 4}}, "note": "x"}\n'
    reader, events = read(text)
    assert reader.header.policy == "pull" and reader.header.complete
    assert reader.header.workers == {"P0": WorkerSpec("prefill", 4)}
    assert reader.header.extra == {"note": "x"} and events == []


@pytest.mark.parametrize(
    "text, field, needle",
    [
        ('{"pdproto": "history", "version": 2}', "version", "unsupported history version 2"),
        ('{"pdproto": "history", "version": 1, "policy": "both"}', "policy", "'both'"),
        ('{"pdproto": "history", "version": 1, "complete": "yes"}', "complete", "'yes'"),
        ('{"pdproto": "history", "version": 1, "workers": {"P0": {"role": "x", "blocks": 1}}}', "workers.P0.role", "'x'"),
        ('{"pdproto": "history", "version": 1, "workers": {"P0": {"role": "decode", "blocks": -1}}}', "workers.P0.blocks", "-1"),
        ('{"pdproto": "trace", "version": 1}', "pdproto", "'trace'"),
    ],
)
def test_bad_headers(text, field, needle):
    exc = error(text + "\n")
    assert exc.line == 1 and exc.field == field and needle in str(exc)
    assert str(exc).startswith("h.jsonl:1:")


@pytest.mark.parametrize(
    "line, field, needle",
    [
        ('{"ev": "teleport"}', "ev", "unknown event kind 'teleport'"),
        ('{"worker": "D0"}', "ev", "missing required field"),
        ('{"ev": "free", "blocks": [1]}', "worker", "missing required field of 'free'"),
        ('{"ev": "free", "worker": "D0", "blocks": [1, -2]}', "blocks", "[1, -2]"),
        ('{"ev": "free", "worker": "D0", "blocks": "1"}', "blocks", "'1'"),
        ('{"ev": "submit", "request": "r", "gen": true, "prompt_len": 1}', "gen", "True"),
        ('{"ev": "submit", "request": "r", "gen": 0, "prompt_len": 1.5}', "prompt_len", "1.5"),
        ('{"ev": "submit", "request": "", "gen": 0, "prompt_len": 1}', "request", "''"),
        ('{"ev": "restart", "worker": 3, "incarnation": 1}', "worker", "3"),
    ],
)
def test_bad_events_name_file_line_field_and_value(line, field, needle):
    exc = error('{"ev": "cancel", "request": "r", "gen": 0}\n\n' + line + "\n")
    assert exc.line == 3 and exc.field == field and needle in str(exc)
    assert str(exc).startswith("h.jsonl:3:")


def test_bad_json_and_non_objects():
    exc = error('{"ev": "cancel", "request": "r", "gen": 0}\n{"ev": \n')
    assert exc.line == 2 and "not valid JSON" in str(exc)
    exc = error("[1, 2]\n")
    assert exc.line == 1 and "expected a JSON object" in str(exc)
    exc = error('{"ev": "cancel", "request": "r", "gen": 0}\n{"pdproto": "history", "version": 1}\n')
    assert exc.line == 2 and "only as the first line" in str(exc)


def test_undeclared_worker_is_a_format_error():
    text = '{"pdproto": "history", "version": 1, "workers": {"D0": {"role": "decode", "blocks": 2}}}\n{"ev": "free", "worker": "D9", "blocks": [0]}\n'
    exc = error(text)
    assert exc.line == 2 and exc.field == "worker" and exc.value == "D9"


def test_unknown_fields_are_kept_and_written_back():
    obj = {"ev": "free", "worker": "D0", "blocks": [1], "t": 12.5, "rank": 3}
    event = event_from_dict(obj)
    assert event.extra == {"t": 12.5, "rank": 3}
    assert event.to_dict() == obj


def test_invalid_utf8_names_the_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_bytes(b'{"ev": "cancel", "request": "r", "gen": 0}\n{"ev": "cancel", "request": "\xff", "gen": 0}\n')
    with pytest.raises(HistoryFormatError) as info:
        list(read_events(path))
    assert info.value.line == 2 and str(info.value).startswith(f"{path}:2:")


def test_missing_file():
    with pytest.raises(HistoryFormatError) as info:
        list(read_events("/nonexistent/h.jsonl"))
    assert "cannot open" in str(info.value) and "/nonexistent/h.jsonl" in str(info.value)


def test_write_history_is_atomic_and_round_trips(tmp_path):
    path = tmp_path / "out.jsonl"
    events = [Reserve("r", 0, "t", "D0", (1, 2)), Free("D0", (1, 2), request="r", gen=0)]
    header = HistoryHeader(policy="pull", complete=True, workers={"D0": WorkerSpec("decode", 4)})
    assert write_history(path, events, header) == 3
    assert [e for _, e in read_events(path)] == events

    def boom():
        yield events[0]
        raise RuntimeError("disk on fire")

    with pytest.raises(RuntimeError):
        write_history(path, boom(), header)
    assert [e for _, e in read_events(path)] == events  # the old file is intact
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.jsonl"]


# -- properties -----------------------------------------------------------------

_ident = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), min_size=1, max_size=6)
_nat = st.integers(min_value=0, max_value=2**40)
_KIND_STRATEGY = {
    "str": _ident,
    "nat": _nat,
    "blocks": st.lists(st.integers(0, 64), max_size=5).map(tuple),
    "str?": st.none() | _ident,
    "nat?": st.none() | _nat,
    "range?": st.none() | st.tuples(st.integers(0, 64), st.integers(1, 64)).filter(lambda r: r[0] < r[1]),
}


@st.composite
def events(draw):
    cls = draw(st.sampled_from(list(EVENT_TYPES.values())))
    kwargs = {name: draw(_KIND_STRATEGY[kind]) for name, kind in cls.FIELDS.items()}
    extra = draw(st.dictionaries(st.sampled_from(["t", "rank", "note"]), st.integers() | st.text(max_size=3), max_size=2))
    return cls(**kwargs, extra=extra)


@given(st.lists(events(), max_size=20))
@settings(max_examples=200, deadline=None)
def test_write_then_read_round_trips_every_event(evs):
    buf = io.StringIO()
    writer = HistoryWriter(buf, HistoryHeader(features=FEATURES, kv=KVSpec(layers=64)))
    for e in evs:
        writer.write(e)
    reader = HistoryReader(io.StringIO(buf.getvalue()))
    back = [e for _, e in reader]
    assert back == evs
    assert [e.extra for e in back] == [e.extra for e in evs]


@given(st.binary(max_size=300))
@settings(max_examples=300, deadline=None)
def test_reader_never_crashes_on_arbitrary_bytes(data):
    try:
        list(HistoryReader(io.BytesIO(data), "fuzz"))
    except HistoryFormatError as exc:
        assert str(exc).startswith("fuzz")


_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=5),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=10,
)
_field_names = st.sampled_from(["ev", "request", "gen", "worker", "blocks", "transfer", "ticket", "pdproto", "version"])
_eventish = st.dictionaries(
    _field_names,
    st.sampled_from(list(EVENT_TYPES)) | _json,
    max_size=8,
)


@given(st.lists(_eventish | _json, max_size=5))
@settings(max_examples=300, deadline=None)
def test_reader_never_crashes_on_arbitrary_json(objs):
    text = "\n".join(json.dumps(o) for o in objs)
    try:
        list(HistoryReader(io.StringIO(text), "fuzz"))
    except HistoryFormatError as exc:
        assert str(exc).startswith("fuzz:")


@given(_eventish | events().map(lambda e: e.to_dict()))
@settings(max_examples=300, deadline=None)
def test_fast_parser_agrees_with_the_strict_one(obj):
    from pdproto.spec import parse_event

    try:
        slow = event_from_dict(obj)
    except HistoryFormatError as exc:
        with pytest.raises(HistoryFormatError) as info:
            parse_event(obj)
        assert str(info.value) == str(exc)
    else:
        fast = parse_event(obj)
        assert fast == slow and fast.extra == slow.extra and type(fast) is type(slow)


@given(st.lists(_eventish | _json | events().map(lambda e: e.to_dict()), max_size=4), st.booleans())
@settings(max_examples=200, deadline=None)
def test_reading_with_or_without_orjson_agrees(objs, as_bytes):
    from pdproto.spec import _history

    text = "\n".join(json.dumps(o) for o in objs) + "\n"
    data = text.encode() if as_bytes else text

    def outcome():
        stream = io.BytesIO(data) if as_bytes else io.StringIO(data)
        try:
            return [(line, e, e.extra) for line, e in HistoryReader(stream, "h")]
        except HistoryFormatError as exc:
            return str(exc)

    fast = outcome()
    saved = _history._fast_loads
    _history._fast_loads = None
    try:
        slow = outcome()
    finally:
        _history._fast_loads = saved
    assert fast == slow


# -- format 1.1 -------------------------------------------------------------------

V11 = {"pdproto": "history", "version": "1.1", "features": ["share", "ranges", "kv", "parallel"],
       "kv": {"layers": 4, "block_size": 4}}
XFER = {"ev": "transfer_start", "transfer": "x", "ticket": "t", "request": "r", "gen": 0, "src": "P0",
        "src_blocks": [0, 1], "dst": "D0", "dst_blocks": [2, 3]}
SHARE = {"ev": "share", "request": "r2", "gen": 0, "worker": "P0", "blocks": [0], "tokens": 4}


def lines(*objs) -> str:
    return "".join(json.dumps(o) + "\n" for o in objs)


def test_v11_header_round_trips():
    header = HistoryHeader(
        features={"kv", "parallel"},
        kv=KVSpec(layers=8, kv_heads=1, head_dim=576, dtype="fp8", scale="per-block", layout="mla"),
        workers={"P0": WorkerSpec("prefill", 8, tp=2, pp=2), "D0": WorkerSpec("decode", 8, tp=1)},
    )
    assert header.version == "1.1" and header.kv.dtype == "float8_e4m3fn"
    obj = header.to_dict()
    assert obj["features"] == ["kv", "parallel"] and obj["kv"]["layout"] == "mla"
    assert obj["workers"]["P0"] == {"role": "prefill", "blocks": 8, "tp": 2, "pp": 2}
    assert HistoryHeader.from_dict(obj) == header
    assert HistoryHeader().to_dict()["version"] == 1 and "features" not in HistoryHeader().to_dict()


def test_v11_events_parse_with_their_features():
    reader, evs = read(lines(V11, XFER | {"layers": [0, 2], "tokens": [2, 7]}, SHARE))
    assert reader.header.version == "1.1" and reader.header.features == set(FEATURES) - {"boundary", "observed"}
    (_, xfer), (_, share) = evs
    assert xfer.layers == (0, 2) and xfer.tokens == (2, 7) and not xfer.extra
    assert share == Share("r2", 0, "P0", (0,), tokens=4)
    assert xfer.to_dict()["layers"] == [0, 2]


def test_version_1_reads_exactly_as_before():
    v1 = {"pdproto": "history", "version": 1, "kv": {"layers": "whatever"},
          "workers": {"P0": {"role": "prefill", "blocks": 4, "tp": "x"}, "D0": {"role": "decode", "blocks": 4}}}
    reader, [(_, xfer)] = read(lines(v1, XFER | {"layers": [0, 2]}))
    assert xfer.layers is None and xfer.extra == {"layers": [0, 2]}  # an unknown key, kept
    assert reader.header.kv is None and reader.header.extra["kv"] == {"layers": "whatever"}
    assert reader.header.workers["P0"] == WorkerSpec("prefill", 4)
    assert xfer.to_dict()["layers"] == [0, 2]  # written back unchanged
    exc = error(lines(v1, SHARE))
    assert exc.line == 2 and "unknown event kind 'share'" in str(exc) and '"1.1"' in str(exc)
    # no header at all is version 1 too
    assert "unknown event kind 'share'" in str(error(lines(SHARE)))


@pytest.mark.parametrize("header, event, needle", [
    ({"features": ["ranges"]}, SHARE, "belongs to feature 'share'"),
    ({"features": ["share"]}, XFER | {"tokens": [0, 4]}, "transfer_start.tokens belongs to feature 'ranges'"),
    ({"features": ["share"]}, XFER | {"layers": 3}, "belongs to feature 'ranges'"),
    ({"features": ["ranges"]}, XFER | {"layers": [0, 2]}, "needs the header's kv.layers"),
    ({"features": ["ranges", "kv"], "kv": {"layers": 2}}, XFER | {"layers": [1, 3]}, "goes past the 2 layers"),
    ({"features": ["ranges"]}, XFER | {"layers": [2, 2]}, "0 <= lo < hi"),
    ({"features": ["ranges", "kv"], "kv": {"block_size": 4}}, XFER | {"tokens": [2, 10]}, "span 3 block(s)"),
])
def test_v11_event_errors_name_line_and_feature(header, event, needle):
    exc = error(lines({"pdproto": "history", "version": "1.1"} | header, event))
    assert exc.line == 2 and needle in str(exc), str(exc)


@pytest.mark.parametrize("header, needle", [
    ({"version": "1.2"}, "unsupported history version '1.2'"),
    ({"version": 1.1}, "unsupported history version 1.1"),
    ({"version": "1.1"}, 'needs "features"'),
    ({"version": "1.1", "features": ["shared"]}, "unknown feature 'shared'"),
    ({"version": "1.1", "features": [], "kv": {"layers": 2}}, "kv belongs to feature 'kv'"),
    ({"version": "1.1", "features": ["kv"], "kv": {"layers": 0}}, "kv.layers must be an integer >= 1, got 0"),
    ({"version": "1.1", "features": ["kv"], "kv": {"dtype": "int4"}}, "kv.dtype must be one of"),
    ({"version": "1.1", "features": ["kv"], "kv": {"heads": 2}}, "kv.heads is not a kv key"),
    ({"version": "1.1", "features": ["kv"], "kv": {"dtype": "fp8_e5m2"}}, "scale is required"),
    ({"version": "1.1", "features": ["kv"], "kv": {"dtype": "bf16", "scale": "per-block"}}, "only for an fp8"),
    ({"version": "1.1", "features": ["kv"], "kv": {"layout": "mla", "kv_heads": 8}}, "kv_heads must be absent or 1"),
    ({"version": "1.1", "features": [], "workers": {"P0": {"role": "prefill", "blocks": 2, "tp": 2}}},
     "workers.P0.tp belongs to feature 'parallel'"),
    ({"version": "1.1", "features": ["parallel"], "workers": {"P0": {"role": "prefill", "blocks": 2, "tp": 0}}},
     "workers.P0.tp must be an integer >= 1"),
    ({"version": "1.1", "features": ["parallel", "kv"], "kv": {"layers": 3},
      "workers": {"P0": {"role": "prefill", "blocks": 2, "pp": 2}}}, "pp 2 does not divide kv.layers 3"),
])
def test_v11_header_errors(header, needle):
    exc = error(lines({"pdproto": "history"} | header))
    assert exc.line == 1 and needle in str(exc), str(exc)


def test_header_constructor_refuses_what_it_cannot_say():
    with pytest.raises(ValueError, match="need version '1.1'"):
        HistoryHeader(version=1, features={"share"})
    with pytest.raises(ValueError, match="without declaring"):
        HistoryHeader(features={"share"}, kv=KVSpec(layers=2))
    with pytest.raises(ValueError, match="unknown feature"):
        HistoryHeader(features={"sharing"})


def test_fast_and_careful_paths_agree_on_feature_fields():
    """A scalar in a feature field is an extra key in version 1 and an error in 1.1,
    whichever parser reads it."""
    pytest.importorskip("orjson")
    v1 = lines({"pdproto": "history", "version": 1}, XFER | {"tokens": 3})
    [(_, ev)] = read(v1)[1]
    assert ev.tokens is None and ev.extra == {"tokens": 3}
    assert "belongs to feature 'ranges'" in str(error(lines(V11 | {"features": ["kv"]}, XFER | {"tokens": 3})))


def test_v11_with_no_features_refuses_feature_fields_and_kinds():
    """An empty features list is version 1.1 without features, not version 1:
    a ranged transfer there is an error, never a silently ignored range."""
    empty = {"pdproto": "history", "version": "1.1", "features": []}
    exc = error(lines(empty, XFER | {"tokens": [0, 4]}))
    assert exc.line == 2 and "transfer_start.tokens belongs to feature 'ranges'" in str(exc)
    exc = error(lines(empty, SHARE))
    assert exc.line == 2 and "event kind 'share' belongs to feature 'share'" in str(exc)


def test_writer_refuses_an_event_its_header_cannot_say(tmp_path):
    from pdproto import UsageError

    path = tmp_path / "out.jsonl"
    share = Share("r2", 0, "P0", (0,), tokens=4)
    ranged = TransferStart("x", "t", "r", 0, "P0", (0,), "D0", (1,), tokens=(0, 2))
    for header in (None, HistoryHeader(), HistoryHeader(features={"ranges"})):
        with pytest.raises(UsageError, match="feature"):
            write_history(path, [share], header)
    with pytest.raises(UsageError, match=r"\['ranges'\]"):
        write_history(path, [ranged], HistoryHeader())
    assert not path.exists()
    assert write_history(path, [share, ranged], HistoryHeader(features={"share", "ranges"})) == 3
    assert [e for _, e in read_events(path)] == [share, ranged]
