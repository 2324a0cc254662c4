"""Hostile and careless input (issue 18): every bad input is exit 2 and ONE
plain line on standard error that names the input, with no traceback, no
hang and bounded memory; nothing a user typed is read as rich markup.

Most cases call ``pdproto._cli.main`` in-process (fast).  Subprocesses only
where they are the point: a bounded address space (``RLIMIT_AS``), a closed
pipe, torch missing.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import textwrap

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from conftest import ROOT
from pdproto._cli import main
from pdproto._errors import LimitError, ModelLoadError, UsageError, parse_int
from pdproto.drivers import load_model
from pdproto.spec import _history
from pdproto.spec import HistoryReader

BIG = "1" + "0" * 400  # 10**400: under Python's 4300-digit limit, over any size
HUGE = "9" * 5000  # over the limit

FAST = settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def one_line(code: int, err: str, *names: str) -> str:
    """Exit 2, exactly one line on stderr naming every one of ``names``."""
    assert code == 2, err
    assert "Traceback" not in err
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("pdproto"), lines[0]
    for name in names:
        assert name in lines[0], (name, lines[0])
    return lines[0]


def write(tmp_path, name: str, data: str | bytes) -> str:
    path = tmp_path / name
    if isinstance(data, str):
        path.write_text(data, encoding="utf-8")
    else:
        path.write_bytes(data)
    return str(path)


SUBMIT = {"ev": "submit", "request": "r1", "gen": 0, "prompt_len": 3}


def jl(*objs: object) -> str:
    return "".join(json.dumps(o) + "\n" for o in objs)


# -- audit: the reader ---------------------------------------------------------


@pytest.mark.parametrize("line", [
    f'{{"ev":"submit","request":"r1","gen":0,"prompt_len":{HUGE}}}',  # a field
    f'{{"ev":"submit","request":"r1","gen":0,"prompt_len":3,"t":{HUGE}}}',  # an extra key
    f'{{"ev":"free","worker":"w","blocks":[1,{HUGE}]}}',  # in a list
])
def test_integer_over_the_int_string_limit(capsys, tmp_path, line):
    path = write(tmp_path, "h.jsonl", line + "\n")
    msg = one_line(*run(capsys, "audit", path)[::2], path + ":1")
    assert "4300 digits" in msg


def test_integer_over_the_limit_in_the_header(capsys, tmp_path):
    path = write(tmp_path, "h.jsonl", f'{{"pdproto":"history","version":{HUGE}}}\n')
    one_line(*run(capsys, "audit", path)[::2], path + ":1")


@pytest.mark.skipif(not os.path.exists("/proc/self/mem"), reason="needs /proc")
def test_read_error(capsys):
    msg = one_line(*run(capsys, "audit", "/proc/self/mem")[::2], "/proc/self/mem")
    assert "cannot read" in msg


@pytest.mark.parametrize("make", [
    lambda d: str(d),  # a directory
    lambda d: str(d / "missing.jsonl"),
    lambda d: str(d / ("x" * 300)),  # a name too long, and a line far over 80 columns
])
def test_unopenable_files(capsys, tmp_path, make):
    path = make(tmp_path)
    one_line(*run(capsys, "audit", path)[::2], path)


def test_conflicting_duplicate_keys_are_refused(capsys, tmp_path):
    path = write(tmp_path, "h.jsonl", jl(SUBMIT) + '{"ev":"free","worker":"w","blocks":[1],"worker":"v"}\n')
    msg = one_line(*run(capsys, "audit", path)[::2], path + ":2", "'worker'", "'w'", "'v'")
    assert "twice" in msg


@pytest.mark.parametrize("text", [
    '{"ev":"submit","request":"r1","request":"r2","gen":0,"prompt_len":3}',
    '{"ev":"submit","request":"r1","gen":0,"prompt_len":3,"t":1,"t":2}',
    '{"ev" : "submit", "request" : "r1", "gen":0, "gen":1, "prompt_len":3}',
    '{"pdproto":"history","version":1,"policy":"push","policy":"pull"}',
    '{"pdproto":"history","version":1,"workers":{"P0":{"role":"prefill","blocks":1,"blocks":2}}}',
])
def test_duplicate_keys_anywhere(capsys, tmp_path, text):
    path = write(tmp_path, "h.jsonl", text + "\n")
    one_line(*run(capsys, "audit", path)[::2], path + ":1")


def test_identical_duplicate_keys_are_harmless(capsys, tmp_path):
    path = write(tmp_path, "h.jsonl", '{"ev":"submit","request":"r1","request":"r1","gen":0,"prompt_len":3}\n')
    code, out, err = run(capsys, "audit", "--json", path)
    assert code == 0 and err == ""
    assert json.loads(out)["events"] == 1


def test_colons_in_strings_take_the_exact_path(capsys, tmp_path):
    # the cheap check counts colons; a colon inside a string is no duplicate
    path = write(tmp_path, "h.jsonl", jl({**SUBMIT, "request": "a:b:c", "t": "12:00:01"}))
    code, out, err = run(capsys, "audit", "--json", path)
    assert code == 0, err
    assert json.loads(out)["requests"] == 1


@pytest.mark.parametrize("data", [
    b"\xff\xfe not utf-8\n",
    b'{"ev":"submit","request":"r1\x00","gen":0,"prompt_len":3\n',
    b"[" * 100_000 + b"\n",  # nested too deeply for any parser
    b'{"ev":"submit"} trailing\n',
    b"\x00\x00\x00\n",
    b'{"ev":"nope"}\n',
    b"[1, 2, 3]\n",
    b'{"ev":"submit","request":"r1","gen":-1,"prompt_len":3}\n',
    b'{"ev":"submit","request":"r1","gen":0,"prompt_len":1e400}\n',
    b'{"ev":"submit","request":"r1","gen":0,"prompt_len":NaN}\n',
    b'{"pdproto":"history","version":1}\n{"pdproto":"history","version":1}\n',
    b'{"pdproto":"history","version":1,"workers":{"P0":{"role":"prefill","blocks":-1}}}\n',
])
def test_malformed_lines(capsys, tmp_path, data):
    path = write(tmp_path, "h.jsonl", data)
    one_line(*run(capsys, "audit", path)[::2], path + ":")


def test_markup_in_user_strings_prints_literally(capsys, tmp_path):
    path = write(tmp_path, "h.jsonl", jl(
        {**SUBMIT, "request": "[/oops]"},
        {"ev": "free", "worker": "[red]w", "blocks": [1]},
    ))
    code, out, err = run(capsys, "audit", path)
    assert code == 1 and err == ""
    assert "[red]w" in out


def test_markup_in_a_file_name_prints_literally(capsys, tmp_path):
    path = write(tmp_path, "[bold]h.jsonl", jl(SUBMIT))
    code, out, err = run(capsys, "audit", path)
    assert code == 0, err
    assert "[bold]h.jsonl" in out.replace("\n", "")  # (a long temporary path wraps the line)


# the reader on its own: the line cap and the chunks

def test_line_cap_names_the_line_and_yields_the_lines_before():
    data = io.BytesIO(jl(SUBMIT, SUBMIT).encode() + b'{"ev":"submit"' + b" " * 5000 + b"}\n")
    reader = HistoryReader(data, "x.jsonl", max_line_bytes=1000)
    seen = []
    with pytest.raises(Exception) as info:
        for line, _event in reader:
            seen.append(line)
    assert seen == [1, 2]
    assert str(info.value).startswith("x.jsonl:3:") and "--max-line-bytes" in str(info.value)


def test_line_cap_on_an_unterminated_endless_line():
    class Endless(io.RawIOBase):
        def readable(self):
            return True

        def readinto(self, b):
            b[:] = b"0" * len(b)
            return len(b)

    with pytest.raises(Exception) as info:
        HistoryReader(io.BufferedReader(Endless()), "zero", max_line_bytes=3 << 20)
    assert str(info.value).startswith("zero:1:")


def test_line_cap_on_an_iterable_of_lines():
    with pytest.raises(Exception) as info:
        list(HistoryReader([json.dumps(SUBMIT), "x" * 100], "it", max_line_bytes=80))
    assert str(info.value).startswith("it:2:")


def test_bad_cap_is_refused():
    with pytest.raises(ValueError):
        HistoryReader([], max_line_bytes=0)


_EVENT_LINES = st.sampled_from([
    json.dumps(SUBMIT),
    json.dumps({"ev": "free", "worker": "w", "blocks": list(range(30))}),
    json.dumps({"ev": "transfer_read_done", "transfer": "x:1"}),
    "",
    "   ",
    json.dumps({**SUBMIT, "t": 1.5, "meta": "a\u00e9\u4e2d"}),
])


@FAST
@given(lines=st.lists(_EVENT_LINES, max_size=30), chunk=st.integers(1, 80),
       crlf=st.booleans(), final_newline=st.booleans())
def test_chunked_reading_equals_line_by_line(lines, chunk, crlf, final_newline):
    nl = "\r\n" if crlf else "\n"
    text = nl.join(lines) + (nl if final_newline and lines else "")
    expected = list(HistoryReader(text.splitlines(), "a"))
    old = _history._CHUNK
    _history._CHUNK = chunk
    try:
        got = list(HistoryReader(io.BytesIO(text.encode()), "b"))
    finally:
        _history._CHUNK = old
    assert got == expected


# Hypothesis: malformed histories never escape the promise

_FIELD_VALUES = st.one_of(
    st.none(), st.booleans(), st.integers(-(10**30), 10**30), st.floats(allow_nan=True),
    st.text(max_size=8), st.lists(st.integers(-3, 10**20), max_size=3),
    st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
    st.sampled_from([BIG, "[red]x[/]", "[/oops]", "\x00", "\u00b2"]),
)

_BASE = [
    {"ev": "submit", "request": "r1", "gen": 0, "prompt_len": 3},
    {"ev": "reserve", "request": "r1", "gen": 0, "ticket": "t1", "worker": "D0", "blocks": [0]},
    {"ev": "prefill_start", "request": "r1", "gen": 0, "worker": "P0", "blocks": [0]},
    {"ev": "prefill_done", "request": "r1", "gen": 0, "worker": "P0", "first_token": 7, "processed_len": 3},
    {"ev": "free", "worker": "P0", "blocks": [0], "request": "r1", "gen": 0},
]


@st.composite
def _malformed_line(draw) -> bytes:
    obj = dict(draw(st.sampled_from(_BASE)))
    how = draw(st.sampled_from(["value", "drop", "dup", "truncate", "bytes", "bigint", "nest"]))
    key = draw(st.sampled_from(sorted(obj)))
    if how == "value":
        obj[key] = draw(_FIELD_VALUES)
    elif how == "drop":
        del obj[key]
    text = json.dumps(obj)
    if how == "dup":
        text = text[:-1] + f', "{key}": {json.dumps(draw(_FIELD_VALUES))}}}'
    elif how == "truncate":
        text = text[: draw(st.integers(0, len(text) - 1))]
    elif how == "bigint":
        text = text[:-1] + f', "{key}": {HUGE}}}'
    elif how == "nest":
        text = "[" * draw(st.integers(500, 3000)) + text
    data = text.encode()
    if how == "bytes":
        pos = draw(st.integers(0, len(data)))
        data = data[:pos] + draw(st.binary(min_size=1, max_size=4)) + data[pos:]
    return data


@FAST
@given(before=st.lists(st.sampled_from(_BASE[:1]), max_size=3), bad=_malformed_line(),
       header=st.booleans())
def test_malformed_histories(tmp_path_factory, before, bad, header):
    d = tmp_path_factory.mktemp("h")
    head = [{"pdproto": "history", "version": 1}] if header else []
    path = str(d / "h.jsonl")
    with open(path, "wb") as fh:
        fh.write(jl(*head, *before).encode() + bad + b"\n")
    out, err = io.StringIO(), io.StringIO()
    old = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = out, err
    try:
        code = main(["audit", "--json", path])
    finally:
        sys.stdout, sys.stderr = old
    if code == 2:
        one_line(code, err.getvalue(), f"{path}:")
    else:
        assert code in (0, 1) and err.getvalue() == ""
        assert json.loads(out.getvalue())["ok"] == (code == 0)


# -- integers on the command line -------------------------------------------------


@pytest.mark.parametrize("argv", [
    ["cost", "--tokens", "\u00b2"],
    ["cost", "--layers", "\u0663"],  # an Arabic-Indic 3: int() takes it, we do not
    ["cost", "--tp", "\u00b2"],
    ["cost", "--dtype", "\u00b2"],
    ["cost", "--first-tokens", "1_0_"],
    ["cost", "--links", HUGE],
    ["check", "--requests", "\u00b2"],
    ["check", "--blocks", "\u0663"],
    ["check", "--max-states", "-1"],
    ["fuzz", "--examples", "\u00b2"],
    ["fuzz", "--steps", "0"],
    ["fuzz", "--workers", "\u00b2:1"],
    ["fuzz", "--workers", "1:"],
    ["fuzz", "--workers", "0"],
])
def test_unicode_digits_and_bad_integers(capsys, argv):
    one_line(*run(capsys, *argv)[::2], argv[-2])


def test_unicode_digits_in_fault_budgets(capsys):
    one_line(*run(capsys, "check", "--faults", "cancel=\u00b2")[::2], "cancel=\u00b2")


@given(st.text(max_size=12))
@settings(max_examples=200, deadline=None)
def test_parse_int_never_raises_anything_else(text):
    try:
        value = parse_int(text, "--x")
    except UsageError as exc:
        assert exc.what == "--x"
    else:
        assert text.strip().isascii() and value == int(text)


@given(st.integers(-(10**50), 10**50), st.integers(-5, 5), st.integers(-5, 5))
@settings(max_examples=100, deadline=None)
def test_parse_int_bounds(value, low, high):
    assume(low <= high)
    ok = low <= value <= high
    try:
        assert parse_int(str(value), "n", minimum=low, maximum=high) == value and ok
    except UsageError:
        assert not ok


@given(argv=st.lists(st.sampled_from([
    "--tokens", "--layers", "--kv-heads", "--head-dim", "--latent-dim", "--tp", "--links",
    "--first-tokens", "--bandwidth", "--latency-ms", "--prefill-ms", "--decode-ms", "--wait-ms",
    "--coord-ms", "--dtype", "--preset",
]).flatmap(lambda flag: st.tuples(st.just(flag), st.sampled_from([
    "0", "-1", "1e-320", "1e308", "inf", "nan", BIG, "\u00b2", "", "x", "2", "7", "100000000", "[red]",
]))), min_size=1, max_size=3))
@settings(max_examples=60, deadline=None)
def test_cost_arguments(argv):
    flat = [x for pair in argv for x in pair]
    out, err = io.StringIO(), io.StringIO()
    old = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = out, err
    try:
        code = main(["cost", "--json", *flat])
    finally:
        sys.stdout, sys.stderr = old
    if code == 2:
        one_line(code, err.getvalue())
    else:
        assert code == 0 and err.getvalue() == ""
        report = json.loads(out.getvalue())
        assert all(isinstance(t, (int, float)) for t in report["colocated"]["token_ms"])


# -- cost ----------------------------------------------------------------------


@pytest.mark.parametrize(("argv", "flag"), [
    (["--tokens", BIG], "--tokens"),
    (["--bandwidth", "1e-320"], "--bandwidth"),
    (["--bandwidth", "0"], "--bandwidth"),
    (["--prefill-ms", "1e308", "--wait-ms", "1e308"], "-ms"),
    (["--decode-ms", "inf"], "--decode-ms"),
    (["--first-tokens", "100000000"], "--first-tokens"),
    (["--layers", BIG], "--layers"),
    (["--dtype", "99999999999999999999"], "--dtype"),
    (["--preset", "[red]x"], "[red]x"),
    (["--plot", "/nonexistent/dir/x.svg"], "--plot"),
])
def test_cost_values(capsys, argv, flag):
    one_line(*run(capsys, "cost", *argv)[::2], flag)


def _closed_pipe(argv: list[str]) -> subprocess.CompletedProcess:
    proc = subprocess.Popen([sys.executable, "-m", "pdproto", *argv], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT})
    proc.stdout.readline()
    proc.stdout.close()  # like `| head -1`
    err = proc.stderr.read()
    proc.stderr.close()
    return subprocess.CompletedProcess(argv, proc.wait(timeout=60), b"", err)


@pytest.mark.parametrize("argv", [["cost"], ["cost", "--json"], ["check", "--list"]])
def test_broken_pipe_is_quiet(argv):
    proc = _closed_pipe(argv)
    assert proc.returncode == 0
    assert proc.stderr == b""


# -- model loading --------------------------------------------------------------

MODEL_FILES = {
    "raises.py": ("raise RuntimeError('boom at import')\n", ":1", "RuntimeError"),
    "syntax.py": ("def build(:\n    pass\n", ":1", "SyntaxError"),
    "nul.py": ("x = 1\x00\n", "nul.py", "null bytes"),
    "build_raises.py": ("EXPECTED = None\nDEFAULT_CONFIG = None\n\ndef build(config):\n    return 1 / 0\n",
                        ":5", "ZeroDivisionError"),
    "exits.py": ("import sys\nsys.exit(3)\n", ":2", "SystemExit"),
    "imports.py": ("import no_such_module_of_pdproto\n", ":1", "ModuleNotFoundError"),
    "recursion.py": ("def f():\n    return f()\nf()\n", "recursion.py", "RecursionError"),
    "nothing.py": ("x = 1\n", "nothing.py", "build"),
    "not_a_model.py": ("def build(config):\n    return 42\n", "not_a_model.py", "model"),
}


@pytest.mark.parametrize("command", ["check", "fuzz"])
@pytest.mark.parametrize("name", sorted(MODEL_FILES))
def test_broken_model_files(capsys, tmp_path, command, name):
    source, where, what = MODEL_FILES[name]
    path = write(tmp_path, name, source)
    msg = one_line(*run(capsys, command, path)[::2], name, what)
    if where.startswith(":"):
        assert f"{name}{where}" in msg


@pytest.mark.parametrize(("spec", "what"), [
    ("math:sqrt", "TypeError"),
    ("builtins:exit", "SystemExit"),
    ("os:no_such_attribute", "os"),
    ("no_such_module_xyz:model", "no_such_module_xyz"),
    ("no-such-catalogue-model", "no-such-catalogue-model"),
    (":", ":"),
])
@pytest.mark.parametrize("command", ["check", "fuzz"])
def test_bad_model_specs(capsys, command, spec, what):
    one_line(*run(capsys, command, spec)[::2], spec, what)


def test_debug_shows_the_traceback(capsys, tmp_path):
    path = write(tmp_path, "raises.py", "def helper():\n    raise KeyError('deep')\nhelper()\n")
    code, _out, err = run(capsys, "--debug", "check", path)
    assert code == 2
    assert "Traceback" in err and "helper" in err
    assert err.splitlines()[-1].startswith("pdproto check: error:")
    code, _out, err2 = run(capsys, "check", path, "--debug")
    assert code == 2 and "Traceback" in err2


def test_model_load_error_carries_its_data(tmp_path):
    path = write(tmp_path, "m.py", "\n\nraise ValueError('third line')\n")
    with pytest.raises(ModelLoadError) as info:
        load_model(path)
    err = info.value
    assert (err.stage, err.line, type(err.error)) == ("import", 3, ValueError)
    assert err.file.endswith("m.py") and err.__cause__ is err.error


_BAD_STATEMENTS = st.sampled_from([
    "raise RuntimeError('x')", "1/0", "import no_such_module_q", "def (:", "x = [",
    "\x00", "raise SystemExit(1)", "assert False, 'no'", "undefined_name", "raise KeyboardError",
    "class C(1): pass", "from . import nothing", "'\\N{NO SUCH NAME}'", "@@", "\tx = 1",
])


@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
@given(prefix=st.lists(st.sampled_from(["x = 1", "import math", "", "# comment"]), max_size=3),
       bad=_BAD_STATEMENTS, in_build=st.booleans())
def test_generated_broken_model_files(tmp_path_factory, prefix, bad, in_build):
    d = tmp_path_factory.mktemp("m")
    if in_build:
        body = "\n".join(prefix) + "\nDEFAULT_CONFIG = None\n\ndef build(config):\n" + textwrap.indent(bad, "    ") + "\n"
    else:
        body = "\n".join(prefix + [bad]) + "\n"
    path = str(d / "model.py")
    with open(path, "w", encoding="utf-8") as fh:
        fh.write(body)
    err = io.StringIO()
    old = sys.stderr
    sys.stderr = err
    try:
        code = main(["check", path])
    finally:
        sys.stderr = old
    one_line(code, err.getvalue(), "model.py")


# -- check: sizes ---------------------------------------------------------------


@pytest.mark.parametrize("argv", [
    ["--requests", "1" + "0" * 30],
    ["--blocks", "1" + "0" * 30],
    ["--requests", "65"],
    ["--blocks", BIG],
])
def test_check_sizes(capsys, argv):
    one_line(*run(capsys, "check", *argv)[::2], argv[0])


def test_flags_that_do_not_apply_are_named(tmp_path):
    path = write(tmp_path, "own.py", textwrap.dedent("""
        import attrs

        @attrs.frozen
        class Config:
            limit: int = 3

        DEFAULT_CONFIG = Config()

        def build(config):
            raise AssertionError("not built")
    """))
    with pytest.raises(UsageError) as info:
        load_model(path, requests=2, blocks=3)
    assert info.value.what == "--blocks --requests"
    assert "limit" in info.value.allowed


def test_out_of_reach_configurations_are_estimated():
    _, small = load_model(None, requests=1)
    _, big = load_model(None, requests=5)
    assert small.warnings == ()
    assert big.warnings and "out of reach" in big.warnings[0]


def test_policy_and_its_alias_mode():
    _, a = load_model(None, policy="pull")
    _, b = load_model(None, mode="pull")
    assert a.config == b.config and a.config.mode == "pull"
    with pytest.raises(UsageError):
        load_model(None, policy="pull", mode="push")


# -- fuzz: output path and torch ------------------------------------------------


@pytest.mark.parametrize("command", ["fuzz", "check"])
def test_output_path_is_checked_before_the_run(capsys, tmp_path, command):
    extra = ["--examples", "1"] if command == "fuzz" else ["--max-states", "5"]
    one_line(*run(capsys, command, "--out", str(tmp_path), *extra)[::2], "--out", str(tmp_path))
    missing = str(tmp_path / "no" / "such" / "f.jsonl")
    one_line(*run(capsys, command, "--out", missing, *extra)[::2], "--out")


def test_torch_missing_names_the_extra():
    code = textwrap.dedent("""
        import sys
        sys.modules["torch"] = None
        from pdproto._cli import main
        sys.exit(main(sys.argv[1:]))
    """)
    for argv in (["fuzz", "--backend", "torch", "--examples", "1"], ["replay", "x.jsonl"],
                 ["check", "--backend", "torch", "--max-states", "5"]):
        proc = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True,
                              cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT}, timeout=120)
        one_line(proc.returncode, proc.stderr, "pdproto[torch]")


# -- replay: sizes, in a bounded address space --------------------------------

_REPLAY_CASES = textwrap.dedent("""
    import io, json, os, resource, sys, contextlib
    resource.setrlimit(resource.RLIMIT_AS, (__LIMIT__, __LIMIT__))
    import torch  # noqa: F401 (its own mappings count once, before the cases)
    from pdproto._cli import main
    out = []
    for argv in json.loads(sys.argv[1]):
        err = io.StringIO()
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            try:
                code = main(argv)
            except BaseException as exc:
                code = repr(exc)
        out.append([code, err.getvalue()])
    print(json.dumps(out))
""")


def _hist(tmp_path, name: str, *lines: str) -> str:
    return write(tmp_path, name, "".join(line + "\n" for line in lines))


def test_replay_sizes_are_refused_in_bounded_memory(tmp_path):
    pytest.importorskip("torch")
    sub = '{"ev":"submit","request":"r","gen":0,"prompt_len":%s}'
    ok = _hist(tmp_path, "ok.jsonl", sub % 3)
    cases = [
        (["replay", "--layers", "1000000000", ok], "--max-memory"),
        (["replay", "--tp", "400000000:1", ok], "--max-memory"),
        (["replay", "--tp", "\u00b2:1", ok], "--tp"),
        (["replay", "--max-memory", "1K", ok], "--max-memory"),
        (["replay", "--max-memory", "\u00b2G", ok], "--max-memory"),
        (["replay", "--layers", "\u0663", ok], "--layers"),
        (["replay", "--max-line-bytes", "10", ok], "--max-line-bytes"),
        (["replay", "--head-dim", "100000000", ok], "--max-memory"),
        (["replay", _hist(tmp_path, "bid.jsonl", sub % 3,
                             '{"ev":"prefill_start","request":"r","gen":0,"worker":"P0","blocks":[%d]}' % 10**12)],
         "history line 2"),
        (["replay", _hist(tmp_path, "bid400.jsonl", sub % 3,
                             '{"ev":"alloc","request":"r","gen":0,"worker":"D0","blocks":[%s]}' % BIG)],
         "history line 2"),
    ]
    # not errors, but bounded: sizes past the block table are reported, never
    # allocated; declared pools are allocated lazily, to the blocks events name
    clean = [

        ["replay", _hist(tmp_path, "pl.jsonl", sub % BIG,
                            '{"ev":"prefill_start","request":"r","gen":0,"worker":"P0","blocks":[0]}',
                            '{"ev":"prefill_done","request":"r","gen":0,"worker":"P0","first_token":1,'
                            '"processed_len":%s}' % BIG)],
        ["replay", _hist(tmp_path, "pos.jsonl",
                            '{"ev":"alloc","request":"r","gen":0,"worker":"D0","blocks":[0]}',
                            '{"ev":"decode","request":"r","gen":0,"worker":"D0","position":%d,'
                            '"input_token":1,"output_token":2,"blocks":[0]}' % 10**12)],
    ]
    # huge declared pools are fine: pools are allocated lazily, to the blocks events name
    use = ('{"ev":"prefill_start","request":"r","gen":0,"worker":"P0","blocks":[0, 7]}',
           '{"ev":"fail","request":"r","gen":0}', '{"ev":"free","worker":"P0","blocks":[0, 7]}')
    lazy = [
        ["replay", _hist(tmp_path, "hb.jsonl", '{"pdproto":"history","version":1,"policy":"pull",'
                         '"workers":{"P0":{"role":"prefill","blocks":%d}}}' % 10**12, sub % 3, *use)],
        ["replay", _hist(tmp_path, "hb400.jsonl", '{"pdproto":"history","version":1,"policy":"pull",'
                         '"workers":{"P0":{"role":"prefill","blocks":%s}}}' % BIG, sub % 3, *use)],
    ]
    clean += lazy
    argvs = [c[0] for c in cases] + clean
    proc = subprocess.run(
        [sys.executable, "-c", _REPLAY_CASES.replace("__LIMIT__", str(3 << 30)), json.dumps(argvs)],
        capture_output=True, text=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT}, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    results = json.loads(proc.stdout)
    for (argv, name), (code, err) in zip(cases, results):
        one_line(code, err, name)
    for argv, (code, err) in zip(clean, results[len(cases):]):
        assert code == (0 if argv in lazy else 1) and err == "", (argv, code, err)


def test_limit_error_carries_its_data():
    torch_backend = pytest.importorskip("pdproto.backends._torch")
    with pytest.raises(LimitError) as info:
        torch_backend.TorchBackend(layers=10**6, max_memory=1 << 20)
    err = info.value
    assert err.limit == 1 << 20 and err.needed > err.limit and "--max-memory" in err.flag


# -- bounded memory of the reader ---------------------------------------------


def test_endless_line_in_bounded_memory():
    code = textwrap.dedent("""
        import resource, sys
        resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))
        from pdproto._cli import main
        sys.exit(main(["audit", "/dev/zero"]))
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": ROOT}, timeout=120)
    msg = one_line(proc.returncode, proc.stderr, "/dev/zero:1")
    assert "--max-line-bytes" in msg


# Hypothesis: sizes never allocate past the limit, never raise anything else

_SIZES = st.one_of(st.integers(-2, 40), st.integers(0, 10**13), st.just(10**400))


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(layers=_SIZES, kv_heads=st.integers(-1, 200), head_dim=_SIZES, block_size=_SIZES,
       tp=st.tuples(_SIZES, _SIZES), declared=st.lists(_SIZES, max_size=3),
       ids=st.lists(st.lists(_SIZES, min_size=1, max_size=3), max_size=4))
def test_generated_replay_sizes(layers, kv_heads, head_dim, block_size, tp, declared, ids):
    torch_backend = pytest.importorskip("pdproto.backends._torch")
    from pdproto import Alloc, HistoryHeader, WorkerSpec

    limit = 8 << 20
    workers = {f"P{i}": WorkerSpec("prefill", n) for i, n in enumerate(declared) if n >= 0}
    try:
        backend = torch_backend.TorchBackend(
            HistoryHeader(workers=workers or None), layers=layers, kv_heads=kv_heads,
            head_dim=head_dim, block_size=block_size, tp=tp, max_memory=limit)
    except (UsageError, LimitError):
        return
    assert backend.memory <= limit
    for line, blocks in enumerate(ids, 1):
        if min(blocks) < 0:
            continue
        try:
            backend.apply(Alloc("r", 0, "D0", tuple(blocks)), line)
        except LimitError as exc:
            assert exc.line == line
        assert backend.memory <= limit


@settings(max_examples=40, deadline=None)
@given(requests=_SIZES, blocks=_SIZES,
       workers=st.tuples(*[st.sampled_from([None, -1, 0, 1, 2, 7, 10**13, 10**400])] * 2))
def test_generated_model_sizes(requests, blocks, workers):
    try:
        _, info = load_model(None, requests=requests, blocks=blocks, prefill_workers=workers[0],
                             decode_workers=workers[1])
    except UsageError as exc:
        assert exc.what in ("--requests", "--blocks", "--workers")
    else:
        assert info.config.requests == requests and info.config.blocks == blocks


def test_max_line_bytes_raises_the_cap(capsys, tmp_path):
    path = write(tmp_path, "h.jsonl", jl({**SUBMIT, "note": "x" * 300}))
    one_line(*run(capsys, "audit", "--max-line-bytes", "100", path)[::2], path + ":1", "--max-line-bytes")
    code, out, err = run(capsys, "audit", "--max-line-bytes", "1000", "--json", path)
    assert code == 0 and err == "" and json.loads(out)["events"] == 1


def test_check_warns_in_one_line_when_out_of_reach(capsys):
    code, out, err = run(capsys, "check", "--requests", "6", "--max-states", "20", "--json")
    assert code in (0, 1) and "Traceback" not in err
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("pdproto check: warning:") and "out of reach" in lines[0]
    json.loads(out)
