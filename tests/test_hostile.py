"""Hostile input, round two: what a careless or hostile user, server or file system hands a run, and the one line
it gets instead of a traceback, a hang or silent nonsense. By class: (1) every parse of outside data is bounded
(common.parse_json and its copy in rewards.py, reward servers' answers, prompt sets) and property-tested with
hypothesis beside the named cases; (2) numeric flags and environment values (tests/test_bad_input.py and
tests/test_robustness.py hold theirs); the run files, caches, rewards and results further below."""
import json
import os
import pickle
import socketserver
import tempfile
import threading

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import common
import rewards
from common import load_prompt_set

FUZZ = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
SCRATCH = tempfile.mkdtemp(prefix="hostile_")  # hypothesis' examples share one directory (no function fixture)


def one_line(e) -> str:
    """A SystemExit's message, checked to be one printable line (no control character reaches the terminal)."""
    message = str(e.value if hasattr(e, "value") else e)
    assert message.startswith("error: ") and message.isprintable(), repr(message)
    return message


# ---- (1) parse_json: bounds before json.loads recurses or converts ----
DEEP = "[" * 100_000 + "]" * 100_000


@pytest.mark.parametrize("parse", [common.parse_json, rewards.parse_json], ids=["common", "rewards"])
def test_parse_json_refuses_what_would_recurse_or_convert_for_long(parse):
    assert parse('{"a": ["[[[", {"b": "\\"]]{"}], "n": -12, "x": 1e999}') == {
        "a": ["[[[", {"b": '"]]{'}], "n": -12, "x": float("inf")}  # brackets in strings are text
    for text, why in [(DEEP, "nested deeper than 32 levels"),
                      ('{"prompt": "a", "n": ' + "7" * 100_000 + "}", "an integer of 100,000 digits, more than 64"),
                      ("-" + "9" * 65, "an integer of 65 digits, more than 64"),
                      ('"' + "x" * (1 << 20) + '"', "1,048,578 bytes, more than 1,048,576")]:
        with pytest.raises(ValueError) as e:
            parse(text)
        assert str(e.value) == why
    assert parse("[" * 32 + "]" * 32) == eval("[" * 32 + "]" * 32) and parse("9" * 64) == int("9" * 64)
    with pytest.raises(ValueError, match="Expecting value"):  # not JSON at all: json's own ValueError
        parse(b"not json")
    with pytest.raises(ValueError, match="can't decode byte 0x80"):  # no UTF-8: UnicodeDecodeError, a ValueError
        parse(b"\x80\x04")


JSON_VALUES = st.recursive(st.none() | st.booleans() | st.integers(-10**70, 10**70) | st.floats() | st.text(),
                           lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
                           max_leaves=40)


def depth_of(v) -> int:
    items = list(v.values()) if isinstance(v, dict) else v if isinstance(v, list) else None
    return 0 if items is None else 1 + max(map(depth_of, items), default=0)


@FUZZ
@given(JSON_VALUES, st.integers(1, 40))
def test_parse_json_agrees_with_json_within_its_bounds(value, depth):
    """Within the bounds parse_json returns json.loads' value; beyond them ValueError names the bound; never any
    other exception. The copy in rewards.py behaves alike."""
    text = json.dumps(value)
    too_deep, too_long = depth_of(value) > depth, "an integer of" if "e" not in text and any(
        len(t.strip("-[]{},: ")) > 64 for t in text.split()) else None
    for parse in (common.parse_json, rewards.parse_json):
        try:
            out = parse(text, depth=depth)
        except ValueError as e:
            assert too_deep or too_long or "digits" in str(e), (text, e)
            continue
        assert not too_deep and json.dumps(out) == text


@FUZZ
@given(st.text(max_size=200) | st.binary(max_size=200).map(lambda b: b.decode("latin-1")))
def test_parse_json_of_any_text_is_a_value_or_a_value_error(text):
    results = []
    for parse in (common.parse_json, rewards.parse_json):
        try:
            results.append(("value", json.dumps(parse(text, depth=3), sort_keys=True)))
        except ValueError as e:
            results.append(("error", str(e)))
    assert results[0] == results[1]


# ---- (1) prompt sets: lines bounded, rows parsed within bounds, text that a tokenizer takes ----
def prompt_file(name: str, content: bytes) -> str:
    path = os.path.join(SCRATCH, name)
    with open(path, "wb") as f:
        f.write(content)
    return path


@pytest.mark.parametrize("name,content,message", [
    ("nul.txt", b"a red circle\n\x00\x00\x00\n", "line 2 of prompt file '{}' has a NUL character ('\\x00') in its "
     "prompt; a prompt is text: no control character but tab, no lone surrogate"),
    ("nul.jsonl", b'{"prompt": "a dog"}\n{"prompt": "\\u0000"}\n', "line 2 of prompt file '{}' has a NUL character "
     "('\\x00') in its prompt; a prompt is text: no control character but tab, no lone surrogate"),
    ("surrogate.jsonl", b'{"prompt": "a cat \\ud800"}\n', "line 1 of prompt file '{}' has a lone surrogate "
     "('\\ud800') in its prompt; a prompt is text: no control character but tab, no lone surrogate"),
    ("escape.txt", b"a cat\x1b[2J on the left\n", "line 1 of prompt file '{}' has a control character ('\\x1b') "
     "in its prompt; a prompt is text: no control character but tab, no lone surrogate"),
    ("deep.jsonl", b'{"prompt": "a dog", "m": ' + DEEP.encode() + b"}\n", "line 1 of prompt file '{}' is not a "
     "JSON object with a prompt field (nested deeper than 32 levels); each line of a .jsonl file must be one"),
    ("digits.jsonl", b'{"prompt": "a dog", "n": ' + b"1" * 100_000 + b"}\n", "line 1 of prompt file '{}' is not "
     "a JSON object with a prompt field (an integer of 100,000 digits, more than 64); each line of a .jsonl file "
     "must be one"),
    ("long.txt", b"a dog\n" + b"x" * (1 << 20) + b"y\n", "line 2 of prompt file '{}' is longer than 1,048,576 "
     "characters; a prompt per line"),
])
def test_prompts_that_are_no_text_are_refused_with_their_line(name, content, message):
    path = prompt_file(name, content)
    with pytest.raises(SystemExit) as e:
        load_prompt_set(path)
    assert one_line(e) == "error: " + message.format(path)


@FUZZ
@given(st.binary(max_size=300), st.sampled_from(["fuzz.txt", "fuzz.jsonl"]))
def test_any_prompt_file_gives_text_prompts_or_one_line(content, name):
    path = prompt_file(name, content)
    try:
        prompts = load_prompt_set(path)
    except SystemExit as e:
        assert one_line(e).startswith(f"error: prompt file {path!r} ") or f" of prompt file {path!r}" in str(e)
        return
    assert prompts and all(isinstance(p, str) and p.strip() and p.isprintable() or "\t" in p for p in prompts)
    assert all(p.encode("utf-8") for p in prompts)  # no lone surrogate


@FUZZ
@given(st.lists(st.dictionaries(st.sampled_from(["prompt", "tag", "include"]), JSON_VALUES, max_size=3), min_size=1,
                max_size=4))
def test_any_jsonl_rows_give_prompts_with_their_rows_or_one_line(rows):
    path = prompt_file("rows.jsonl", "".join(json.dumps(r) + "\n" for r in rows).encode())
    try:
        prompts = load_prompt_set(path)
    except SystemExit as e:
        assert f" of prompt file {path!r} " in one_line(e)
        return
    assert [p.metadata for p in prompts] == rows and [str(p) for p in prompts] == [r["prompt"] for r in rows]


# ---- (1) reward servers: answers read, parsed and quoted within bounds ----
class Raw(socketserver.ThreadingTCPServer):
    """A server that reads one HTTP request and answers with the raw bytes of `reply` (any status line)."""
    daemon_threads = True

    def __init__(self):
        super().__init__(("127.0.0.1", 0), RawHandler)
        self.url, self.reply = f"http://127.0.0.1:{self.server_address[1]}", b""


class RawHandler(socketserver.BaseRequestHandler):
    def handle(self):
        data = b""
        while b"\r\n\r\n" not in data:
            data += self.request.recv(65536)
        head, _, body = data.partition(b"\r\n\r\n")
        length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(
            b"content-length"))
        while len(body) < length:
            body += self.request.recv(65536)
        self.request.sendall(self.server.reply)


@pytest.fixture
def raw():
    server = Raw()
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server
    server.shutdown()
    server.server_close()


def http(body: bytes, status: bytes = b"200 OK") -> bytes:
    return b"HTTP/1.1 " + status + b"\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body


def gray(n: int = 1):
    return torch.full((n, 3, 8, 8), 0.5)


def expanding_pickle() -> bytes:
    """1.4 kB that unpickle to a list of 64 references to a list of 64 ... 7 levels: 64^7 values to visit."""
    x = []
    for _ in range(7):
        x = [x] * 64
    return pickle.dumps({"outputs": x})


def test_answers_that_would_expand_recurse_or_flood_are_one_line(raw, monkeypatch):
    import time

    deqa = rewards.deqa_reward(raw.url, retries=0)
    deep = b"\x80\x02}X\x07\x00\x00\x00outputs" + b"]" * 100_000 + b"a" * 99_999 + b"s."  # {"outputs": [[[...]]]}
    payload = expanding_pickle()
    assert len(payload) < 1500
    for body, why in [(payload, f"a pickle of more than 100,000 values ({len(payload):,} bytes)"),
                      (deep, f"a pickle of nested deeper than 32 levels ({len(deep):,} bytes)")]:
        raw.reply = http(body)
        t = time.monotonic()
        with pytest.raises(SystemExit) as e:
            deqa(gray(), ["p"])
        assert one_line(e) == f"error: the reward server {raw.url} answered with {why}; is it the reward server?"
        assert time.monotonic() - t < 5
    monkeypatch.setattr(rewards, "ANSWER_LIMIT", 1000)
    raw.reply = http(b"x" * 5000)
    with pytest.raises(SystemExit) as e:
        deqa(gray(), ["p"])
    assert one_line(e) == (f"error: the reward server {raw.url} answered with more than 1,000 bytes; is it the "
                           f"right server?")
    raw.reply = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + b"1388\r\n" + b"x" * 5000 + b"\r\n0\r\n\r\n"
    with pytest.raises(SystemExit) as e:  # no Content-Length: read up to the bound, no further
        deqa(gray(), ["p"])
    assert one_line(e).endswith("answered with more than 1,000 bytes; is it the right server?")


def test_unifiedreward_json_nested_thousands_deep_is_one_line(raw):
    fn = rewards.unifiedreward_reward(raw.url, model="m", retries=0)
    endpoint = f"{raw.url}/v1/chat/completions"
    for body, why in [(DEEP.encode(), "nested deeper than 32 levels"),
                      (b'{"choices": ' + b"9" * 5000 + b"}", "an integer of 5,000 digits, more than 64")]:
        raw.reply = http(body)
        with pytest.raises(SystemExit) as e:
            fn(gray(), ["a cat"])
        assert one_line(e) == (f"error: the UnifiedReward server {endpoint} answered with JSON {why}; is it the "
                               f"right server?")


def test_a_server_that_sends_terminal_escapes_cannot_reach_the_screen(raw):
    """The server's status line and its error text are quoted escaped and cut short (they used to clear the
    screen and print the server's own text)."""
    deqa = rewards.deqa_reward(raw.url, retries=0)
    raw.reply = b"\x1b[2J\x1b[H" + b"PWNED " * 100 + b"\r\n\r\n"
    with pytest.raises(SystemExit) as e:
        deqa(gray(), ["p"])
    assert one_line(e) == (f"error: the reward server {raw.url} failed after 1 try (BadStatusLine: \\x1b[2J\\x1b[HPWNED"
                           f" PWNED PW...PWNED PWNED PWNED PWNED \\r\\n); start it "
                           f"(docs/rewards.md: reward servers) or pass its URL")
    raw.reply = http(b"Traceback ...\nValueError: \x1b]0;owned\x07 boom\n", status=b"400 Bad Request")
    with pytest.raises(SystemExit) as e:
        deqa(gray(), ["p"])
    assert one_line(e) == (f"error: the reward server {raw.url} failed after 1 try (HTTP 400: ValueError: "
                           f"\\x1b]0;owned\\x07 boom); start it (docs/rewards.md: reward servers) or pass its URL")
    raw.reply = http(b"\x1b[31mnot a pickle")
    with pytest.raises(SystemExit) as e:
        deqa(gray(), ["p"])
    assert one_line(e) == (f"error: the reward server {raw.url} answered with no pickle (invalid load key, "
                           f"'\\\\x1b'.; 17 bytes: b'\\x1b[31mnot a pickle')")


PLAIN = st.recursive(st.none() | st.booleans() | st.integers() | st.integers(-10**400, 10**400) | st.floats() |
                     st.text(max_size=20) | st.binary(max_size=20),
                     lambda inner: st.lists(inner, max_size=4) | st.tuples(inner, inner) |
                     st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=30)


@FUZZ
@given(PLAIN, st.integers(1, 3))
def test_any_plain_answer_gives_checked_numbers_or_one_line(answer, n):
    """rewards.numbers on any plain value a server could pickle (as {"outputs": value} or the value itself):
    n numbers in [0, 1], or one printable line naming the server."""
    for value in ({"outputs": answer}, answer):
        try:
            out = rewards.numbers(rewards.plain_loads(pickle.dumps(value), "u"), "outputs", n, "u", low=0.0,
                                  high=1.0)
        except SystemExit as e:
            assert one_line(e).startswith("error: the reward server u answered ")
            continue
        assert len(out) == n and all(0 <= v <= 1 for v in out)


@FUZZ
@given(st.binary(max_size=200))
def test_any_bytes_from_a_server_unpickle_to_plain_data_or_one_line(data):
    try:
        value = rewards.plain_loads(data, "u")
    except SystemExit as e:
        assert one_line(e).startswith("error: the reward server u answered with ")
        return
    assert rewards.plain_bounds(value) is None


def test_reward_server_addresses_and_keys_are_checked_before_loading(monkeypatch):
    for url in ("http://", "http://127.0.0.1:99999", "http://a b:1", "http://h\x1b[2J/"):
        with pytest.raises(SystemExit) as e:
            rewards.check("deqa", common.RewardModels(deqa_url=url))
        assert one_line(e) == (f"error: --deqa-url {common.shown(url)} is not an http:// address of the reward "
                               f"server (a host, a port in 1-65535, no spaces)")
    monkeypatch.setenv("UNIFIEDREWARD_API_KEY", "sk-123\r\nX-Injected: 1")
    with pytest.raises(SystemExit) as e:
        rewards.check("unifiedreward", common.RewardModels(unifiedreward_url="http://127.0.0.1:1"))
    assert one_line(e) == ("error: the UnifiedReward API key (--unifiedreward-api-key or $UNIFIEDREWARD_API_KEY) "
                           "holds a space, a control or a non-ASCII character, which an HTTP header cannot carry; pass "
                           "the key alone") and "sk-123" not in str(e.value)

