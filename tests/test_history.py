"""The history format: events, the streaming reader and the writer."""

from __future__ import annotations

import io
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdproto import (
    EVENT_TYPES,
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
    writer = HistoryWriter(buf, HistoryHeader())
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
    from pdproto.spec._events import parse_event

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
