"""Hostile input, round two: what a careless or hostile user, server or file system hands a run, and the one line
it gets instead of a traceback, a hang or silent nonsense. By class: (1) every parse of outside data is bounded
(common.parse_json and its copy in rewards.py, reward servers' answers, prompt sets) and property-tested with
hypothesis beside the named cases; (2) numeric flags and environment values (tests/test_bad_input.py and
tests/test_robustness.py hold theirs); the run files, caches, rewards and results further below."""
import atexit
import dataclasses
import errno
import json
import os
import pickle
import shutil
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
atexit.register(shutil.rmtree, SCRATCH, ignore_errors=True)


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



# ---- (3) files trusted only once checked: run.json, metrics.jsonl, psi, state.pt, --model directories ----
def checkpoint_dir(root, run: dict | bytes) -> str:
    path = os.path.join(root, "checkpoints", "iter_3")
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "run.json"), "wb") as f:
        f.write(run if isinstance(run, bytes) else json.dumps(run).encode())
    return path


def resume(root):
    import flow_grpo
    import rundir
    return rundir.resume_checkpoint(root, args=flow_grpo.Args(), world=1, script="flow_grpo.py")


def test_a_run_json_that_save_state_did_not_write_is_one_line(tmp_path):
    import dataclasses

    import flow_grpo
    args = json.loads(json.dumps(dataclasses.asdict(flow_grpo.Args())))
    good = {"iteration": 3, "script": "flow_grpo.py", "world": 1, "sharded": False, "args": args}
    for content, why in [({}, "a valid iteration, script, world, sharded, args, args.model, args.full_finetune, "
                              "args.lora_rank, args.lora_alpha, args.ema"),
                         ({**good, "iteration": "3"}, "a valid iteration"),
                         ({**good, "args": {"model": "x"}}, "a valid args.full_finetune, args.lora_rank, "
                                                              "args.lora_alpha, args.ema"),
                         ({**good, "world": 0}, "a valid iteration or world"), ([good], "a valid iteration, script, "
                          "world, sharded, args, args.model, args.full_finetune, args.lora_rank, args.lora_alpha, "
                          "args.ema")]:
        ckpt = checkpoint_dir(tmp_path, content)
        with pytest.raises(SystemExit) as e:
            resume(str(tmp_path))
        assert one_line(e) == (f"error: checkpoint {ckpt!r} has a run.json without {why} (not what save_state "
                               f"writes); resume from another checkpoint")
    ckpt = checkpoint_dir(tmp_path, b'{"iteration": 3, "args": ' + DEEP.encode() + b"}")
    with pytest.raises(SystemExit) as e:
        resume(str(tmp_path))
    assert one_line(e) == (f"error: checkpoint {ckpt!r} cannot be read (ValueError in run.json: nested deeper than 32 "
                           f"levels); resume from another one")
    checkpoint_dir(tmp_path, good)
    assert resume(str(tmp_path)) == (ckpt, 3)


@FUZZ
@given(JSON_VALUES | st.binary(max_size=100))
def test_any_run_json_resumes_or_is_one_line(content):
    root = tempfile.mkdtemp(dir=SCRATCH)
    checkpoint_dir(root, content if isinstance(content, bytes) else json.dumps(content).encode())
    try:
        resume(root)
    except SystemExit as e:
        assert one_line(e).startswith("error: ")


def test_metrics_and_psi_files_are_read_within_bounds(tmp_path):
    import rundir
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"iteration": 1, "a": 0.5}\n{"a": 0.7}\n{"iteration": 2}\n{"iter')  # the last: a kill's half line
    with pytest.raises(SystemExit) as e:
        rundir.read_jsonl(str(path))
    assert one_line(e) == (f"error: {path} line 2 is no metrics row (a JSON object with an integer \"iteration\", at "
                           f"most 1 MiB): b'{{\"a\": 0.7}}\\n'; remove that line")
    path.write_text('{"iteration": 1, "a": 0.5}\n{"iteration": 2}\n{"iter')
    assert rundir.read_jsonl(str(path)) == [{"iteration": 1, "a": 0.5}, {"iteration": 2}]
    psi = tmp_path / "psi.json"
    psi.write_text('{"psi": ' + DEEP + "}")
    with pytest.raises(SystemExit) as e:
        rundir.load_psi(str(psi), 2)
    assert one_line(e) == (f"error: --psi file {str(psi)!r} cannot be read as JSON (ValueError); write one with "
                           f"--calibrate")


@FUZZ
@given(st.binary(max_size=300))
def test_any_metrics_file_gives_rows_or_one_line(content):
    import rundir
    path = prompt_file("metrics.jsonl", content)
    try:
        rows = rundir.read_jsonl(path)
    except SystemExit as e:
        assert one_line(e).startswith(f"error: {path} line ")
        return
    assert all(isinstance(r, dict) and type(r["iteration"]) is int for r in rows)


def test_a_state_that_does_not_fit_the_run_is_one_line():
    import rundir
    params = {"a.lora_A.weight": torch.zeros(4, 8), "a.lora_B.weight": torch.zeros(8, 4)}
    state = {"trainable": {k: v.clone() for k, v in params.items()}, "optimizer": {}, "ema": None, "extra": {}}
    assert rundir.state_misfit(state, params, extra={}, ema=False) is None
    full = {**state, "trainable": {"a.weight": torch.zeros(8, 8)}}  # a full fine-tuning state.pt in a LoRA run
    assert rundir.state_misfit(full, params, extra={}, ema=False) == (
        "its trainable weights lack 2 of this run's 2 tensors (a.lora_A.weight) and hold 1 others (a.weight)")
    wide = {**state, "trainable": {**params, "a.lora_A.weight": torch.zeros(4, 16)}}  # another architecture
    assert rundir.state_misfit(wide, params, extra={}, ema=False) == (
        "its trainable weights hold a.lora_A.weight of shape (4, 16), this run's is (4, 8)")
    assert rundir.state_misfit(state, params, extra={"old": []}, ema=True) == (
        "its EMA lack 2 of this run's 2 tensors (a.lora_A.weight) and hold 0 others (-)")
    assert rundir.state_misfit([1], params, extra={}, ema=False) == (
        "its state.pt is none that save_state writes (trainable, optimizer, ema, extra)")


@pytest.fixture(scope="module")
def toy_copy(tmp_path_factory):
    """A copy of the toy pipeline directory to break in turn."""
    import shutil
    root = tmp_path_factory.mktemp("toy_copy")
    shutil.copytree(os.path.join(common.HERE, "toy", "flux-shapes"), root / "model")
    return str(root / "model")


def edit_json(path, change):
    with open(path) as f:
        content = json.load(f)
    before = json.dumps(content, indent=1)
    change(content)
    with open(path, "w") as f:
        json.dump(content, f)
    return before


@pytest.mark.parametrize("part,change,misfit", [
    ("transformer", lambda c: c.update(num_layers=1), "transformer/ is not what model_index.json and its config say: "
     "its config builds 80 tensors, its weights hold 112 (0 missing, e.g. -; 32 others, e.g. "
     "transformer_blocks.1.attn.add_k_proj.bias)"),
    ("transformer", lambda c: c.update(num_layers=-1), "transformer/ is not what model_index.json and its config say: "
     "its config builds 48 tensors, its weights hold 112 (0 missing, e.g. -; 64 others, e.g. "
     "transformer_blocks.0.attn.add_k_proj.bias)"),
    ("transformer", lambda c: c.update(axes_dims_rope=[8, 8, 8]), "transformer/ is not what model_index.json and its "
     "config say: its rotary axes [8, 8, 8] add up to 24, not the attention head size 32"),
    ("transformer", lambda c: c.update(joint_attention_dim=64), "transformer/ is not what model_index.json and its "
     "config say: its weights hold context_embedder.weight of shape [128, 32], its config builds [128, 64]"),
    ("text_encoder_2", lambda c: c.update(model_type="qwen3"), "text_encoder_2/ is not what model_index.json and its "
     "config say: its config.json is a 'qwen3' model, not a T5EncoderModel ('t5')"),
    ("vae", lambda c: c.update(_class_name="AutoencoderKLQwenImage"), "vae/ is not what model_index.json and its "
     "config say: its config.json is a 'AutoencoderKLQwenImage', model_index.json names a AutoencoderKL"),
])
def test_a_model_directory_whose_parts_disagree_is_one_line_before_anything_is_built(toy_copy, part, change, misfit):
    import rundir
    path = os.path.join(toy_copy, part, "config.json")
    before = edit_json(path, change)
    try:
        with pytest.raises(SystemExit) as e:
            rundir.check_model_directory(toy_copy)
        assert one_line(e) == f"error: --model {toy_copy!r}: {misfit}"
    finally:
        with open(path, "w") as f:
            f.write(before)
    rundir.check_model_directory(toy_copy)  # the copy as it was: fits


def test_a_model_directory_with_unreadable_json_or_weights_is_one_line(toy_copy, tmp_path):
    import shutil

    import rundir
    config = os.path.join(toy_copy, "transformer", "config.json")
    shutil.copy(config, tmp_path / "config.json")
    with open(config, "w") as f:
        f.write(DEEP)
    with pytest.raises(SystemExit) as e:
        rundir.check_model_directory(toy_copy)
    assert one_line(e) == (f"error: --model {toy_copy!r}: its model_index.json or a config.json cannot be read (nested "
                           f"deeper than 32 levels)")
    shutil.copy(tmp_path / "config.json", config)
    weights = os.path.join(toy_copy, "transformer", "diffusion_pytorch_model.safetensors")
    shutil.copy(weights, tmp_path / "w.safetensors")
    header = b"{" + b'"a": ' * 1 + b"[" * 50_000 + b"]" * 50_000 + b"}"
    with open(weights, "wb") as f:  # a header nested 50,000 deep: safetensors_header reads it within bounds
        f.write(len(header).to_bytes(8, "little") + header)
    try:
        with pytest.raises(SystemExit) as e:
            rundir.check_model_directory(toy_copy)
        assert one_line(e) == (f"error: --model {toy_copy!r}: transformer/ is not what model_index.json and its config "
                               f"say: its weights cannot be read (nested deeper than 4 levels)")
        with open(weights, "wb") as f:
            f.write((tmp_path / "w.safetensors").read_bytes()[:5000])  # cut short
        with pytest.raises(SystemExit) as e:
            rundir.check_model_directory(toy_copy)
        assert one_line(e).endswith("its weights cannot be read (cut short or no safetensors file (5,000 bytes))")
    finally:
        shutil.copy(tmp_path / "w.safetensors", weights)


def test_a_broken_model_directory_stops_the_script_before_any_model_loads(toy_copy, tmp_path):
    from helpers import run_script
    path = os.path.join(toy_copy, "transformer", "config.json")
    before = edit_json(path, lambda c: c.update(num_layers=1))
    try:
        proc = run_script("flow_grpo.py", ["--model", toy_copy, "--output-dir", str(tmp_path / "o")], check=False)
    finally:
        with open(path, "w") as f:
            f.write(before)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr and "loading the rewards" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith(f"error: --model {toy_copy!r}: transformer/ is not what")
    assert not os.path.exists(tmp_path / "o")  # nothing was left behind


@FUZZ
@given(st.binary(max_size=120), st.integers(0, 200))
def test_any_safetensors_file_gives_its_shapes_or_a_value_error(data, n):
    import rundir
    path = prompt_file("w.safetensors", n.to_bytes(8, "little") + data)
    try:
        shapes = rundir.safetensors_header(path)
    except ValueError:
        return
    assert all(isinstance(s, tuple) for s in shapes.values())


# ---- (4) caches and checkpoints checked against a fingerprint of what made them ----
def test_a_text_cache_is_checked_before_the_model_loads(tmp_path):
    import rundir
    cache = tmp_path / "cache"
    cache.mkdir()
    row = cache / ("a" * 40 + ".safetensors")
    from safetensors.torch import save_file
    save_file({"embeds": torch.zeros(3, 4)}, str(row))
    with pytest.raises(SystemExit) as e:  # meta.json deleted: what made the rows is unknown
        rundir.check_text_cache(str(cache))
    assert one_line(e) == (f"error: --text-cache {str(cache)!r} holds 1 embeddings without the meta.json that says "
                           f"what made them; pass an empty or a new directory")
    for meta in (b"not json", b"[1, 2]", DEEP.encode(), b'{"family": "flux"}'):
        (cache / "meta.json").write_bytes(meta)
        with pytest.raises(SystemExit) as e:
            rundir.check_text_cache(str(cache))
        assert one_line(e) == (f"error: --text-cache {str(cache)!r}: its meta.json is no text cache's description; "
                               f"pass an empty or a new directory")
    (cache / "meta.json").write_text('{"family": "flux", "text_encoders": {}, "max_sequence_length": 16}')
    rundir.check_text_cache(str(cache))
    whole = row.read_bytes()
    for content, why in [(whole[:-3], f"cut short or no safetensors file ({len(whole) - 3:,} bytes, its header: "
                                      f"{len(whole):,})"),
                         (pickle.dumps({"embeds": [0.0] * 4}), "cut short or no safetensors file "
                                                               f"({len(pickle.dumps({'embeds': [0.0] * 4}))} bytes)")]:
        row.write_bytes(content)
        with pytest.raises(SystemExit) as e:
            rundir.check_text_cache(str(cache))
        assert one_line(e) == (f"error: --text-cache {str(cache)!r}: {row.name} is no embedding ({why}); delete it (it "
                               f"is encoded again) or pass another directory")


def test_the_text_cache_knows_its_encoders_weights(tiny, tmp_path):
    """Text encoders of the same configuration and other weights (embeddings that differ) do not reuse the cache;
    the same weights loaded again do."""
    import rundir
    cache = str(tmp_path / "cache")
    prompts = ["a red circle on the left", "a blue square"]
    pipe, kind = common.load_pipeline(tiny["flux"], torch.device("cpu"))
    rundir.fill_text_cache(pipe, kind, prompts, directory=cache, device=torch.device("cpu"), max_sequence_length=16,
                           cfg=1.0)
    again, _ = common.load_pipeline(tiny["flux"], torch.device("cpu"))
    rundir.fill_text_cache(again, kind, prompts, directory=cache, device=torch.device("cpu"), max_sequence_length=16,
                           cfg=1.0)  # the same weights: reused
    other, _ = common.load_pipeline(tiny["flux"], torch.device("cpu"))
    with torch.no_grad():
        for p in other.text_encoder_2.parameters():
            p.mul_(1.01)  # a fine-tune: every weight moved a little
    with pytest.raises(SystemExit) as e:
        rundir.fill_text_cache(other, kind, prompts, directory=cache, device=torch.device("cpu"),
                               max_sequence_length=16, cfg=1.0)
    assert one_line(e) == (f"error: --text-cache {cache!r} holds the embeddings of another text encoder; pass an empty "
                           f"or a new directory")


def test_the_weights_fingerprint_sees_other_weights_not_another_dtype(tiny):
    import rundir
    pipe, _ = common.load_pipeline(tiny["flux"], torch.device("cpu"))
    bf16, _ = common.load_pipeline(tiny["flux"], torch.device("cpu"), dtype=torch.bfloat16)
    mine = rundir.weights_fingerprint(pipe.transformer)
    assert mine == rundir.weights_fingerprint(bf16.transformer) and len(mine) == 16
    with torch.no_grad():
        next(pipe.transformer.parameters()).add_(0.05)
    assert rundir.weights_fingerprint(pipe.transformer) != mine


@pytest.fixture(scope="module")
def lora_run(tiny, tmp_path_factory):
    """A 1-iteration LoRA run with its checkpoint on a copy of the tiny Flux, and other_weights(), a context in
    which that copy holds other weights of the same architecture (as a model directory replaced in place)."""
    import contextlib
    import shutil

    from safetensors.torch import load_file, save_file

    from helpers import run_script, tiny_flags
    root = tmp_path_factory.mktemp("lora_run")
    model = root / "model"
    shutil.copytree(tiny["flux"], model)
    flags = lambda **over: tiny_flags(str(model), tiny["prompts"], root / "runs", **{  # noqa: E731
        **dict(num_iterations=1, eval_every=0, save_every=1, log_images_every=0), **over})
    run_script("flow_grpo.py", flags())
    (name,) = os.listdir(root / "runs")
    weights = model / "transformer" / "diffusion_pytorch_model.safetensors"

    @contextlib.contextmanager
    def other_weights():
        whole = weights.read_bytes()
        save_file({k: v * 1.01 for k, v in load_file(str(weights)).items()}, str(weights), metadata={"format": "pt"})
        try:
            yield
        finally:
            weights.write_bytes(whole)
    return {"run": str(root / "runs" / name), "flags": flags, "model": str(model), "other_weights": other_weights,
            "prompts": tiny["prompts"]}


def test_a_resume_refuses_what_its_checkpoint_does_not_fit(lora_run, tmp_path):
    """On other base weights of the same architecture, with a state.pt of other trainable weights, or with a metrics
    row without its iteration: one line each, and the run directory keeps what it had."""
    import shutil

    import rundir
    from helpers import run_script
    run = str(tmp_path / "run")
    shutil.copytree(lora_run["run"], run)
    ckpt = os.path.join(run, "checkpoints", "iter_1")
    base = rundir.read_run_json(ckpt)["base_weights"]
    flags = lora_run["flags"](resume=run, num_iterations=2)
    with lora_run["other_weights"]():
        proc = run_script("flow_grpo.py", flags, check=False)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    line = proc.stderr.strip().splitlines()[-1]
    assert line.startswith(f"error: checkpoint {ckpt!r} was trained from other weights than --model "
                           f"{lora_run['model']!r} holds now (same architecture; base fingerprint {base}, now ")
    assert line.endswith("); resume with its model") and not line.endswith(f"now {base}); resume with its model")
    state_path = os.path.join(ckpt, "state.pt")
    saved = torch.load(state_path, weights_only=True)
    full = dict(saved, trainable={"transformer_blocks.0.attn.to_q.weight": torch.zeros(32, 32)})
    torch.save(full, state_path)  # a full fine-tuning state.pt where the LoRA's was
    proc = run_script("flow_grpo.py", flags, check=False)
    some = sorted(saved["trainable"])[0]
    assert proc.stderr.strip().splitlines()[-1] == (
        f"error: checkpoint {ckpt!r} does not fit this run: its trainable weights lack {len(saved['trainable'])} of "
        f"this run's {len(saved['trainable'])} tensors ({some}) and hold 1 others "
        f"(transformer_blocks.0.attn.to_q.weight); resume a checkpoint of this model and these trainable weights")
    torch.save(saved, state_path)
    metrics = os.path.join(run, "metrics.jsonl")
    with open(metrics, "a") as f:
        f.write('{"reward": 1.0}\n')
    proc = run_script("flow_grpo.py", flags, check=False)
    assert proc.stderr.strip().splitlines()[-1].startswith(f"error: {metrics} line 2 is no metrics row (a JSON object "
                                                           f"with an integer \"iteration\", at most 1 MiB): ")


def test_a_lora_scored_on_other_base_weights_is_said_in_one_line(lora_run, tmp_path):
    """A warning, not a refusal: scoring a LoRA on another release of its base model can be the point."""
    from helpers import run_script
    flags = ["--model", lora_run["model"], "--prompts", lora_run["prompts"], "--checkpoints", lora_run["run"],
             "--metrics", "jpeg", "--steps", "2", "--resolution", "32", "--max-sequence-length", "16",
             "--mixed-precision", "no", "--no-base"]
    proc = run_script("evaluate.py", [*flags, "--out", str(tmp_path / "same")])
    assert "warning" not in proc.stderr
    with lora_run["other_weights"]():
        proc = run_script("evaluate.py", [*flags, "--out", str(tmp_path / "other")], check=False)
    warnings = [line for line in proc.stderr.splitlines() if line.startswith("warning: ")]
    assert proc.returncode == 0 and len(warnings) == 1, proc.stderr[-2000:]
    assert warnings[0].startswith(f"warning: --checkpoints {lora_run['run']!r} was trained from other weights of this "
                                  f"architecture than --model {lora_run['model']!r} holds (base fingerprint ")
    assert warnings[0].endswith("): it is scored on this model as it is")


# ---- (5) the toy proxy reward: loaded and checked at the start ----
def test_the_toy_proxy_reward_is_checked_when_it_loads(tmp_path, monkeypatch):
    import ast
    import importlib
    import shutil

    proxy = importlib.import_module("toy.proxy")  # as common.load_rewards imports it
    with open(os.path.join(common.HERE, "toy", "world.py")) as f:
        imported = [n for node in ast.walk(ast.parse(f.read())) if isinstance(node, (ast.Import, ast.ImportFrom))
                    for n in [getattr(node, "module", None) or node.names[0].name]]
    assert not [m for m in imported if "proxy" in (m or "")]  # world.py imports no proxy: no cycle
    folder = tmp_path / "proxy"
    shutil.copytree(os.path.dirname(proxy.WEIGHTS), folder)
    weights, about = folder / "proxy.safetensors", folder / "proxy.json"
    monkeypatch.setattr(proxy, "WEIGHTS", str(weights))
    remake = "copy this project's toy/proxy/ there, or remake them with python toy/make_proxy.py"
    assert common.load_rewards(["toy_proxy"], "cpu", models=common.RewardModels())["toy_proxy"](
        torch.rand(2, 3, 32, 32), ["a red circle on the left"] * 2).shape == (2,)  # the copy loads
    whole, arch = weights.read_bytes(), about.read_text()
    cases = [(lambda: weights.write_bytes(whole[:1000]), f"the toy proxy reward's weights {str(weights)!r} do not load "
              f"into the architecture of proxy.json {{'width': 24, 'hidden': 64}} ('SafetensorError'); {remake}"),
             (lambda: about.unlink(), f"the toy proxy reward's proxy.json is not at {str(about)!r}: {remake}"),
             (lambda: about.write_text(DEEP), f"the toy proxy reward's {str(about)!r} holds no architecture "
              f"(RecursionError); {remake}"),
             (lambda: about.write_text('{"architecture": {"width": -1}}'), f"the toy proxy reward's {str(about)!r} "
              f"holds no architecture (ValueError); {remake}"),
             (lambda: about.write_text('{"architecture": {"width": 16, "hidden": 64}}'), "the toy proxy reward's "
              f"weights {str(weights)!r} do not load into the architecture of proxy.json {{'width': 16, 'hidden': 64}} "
              f"('size mismatch for convs.0.weight'); {remake}")]
    for damage, message in cases:
        damage()
        with pytest.raises(SystemExit) as e:  # at load time (the run's start), not at the first reward call
            common.load_rewards(["toy_proxy"], "cpu", models=common.RewardModels())
        assert one_line(e) == "error: " + message
        weights.write_bytes(whole)
        about.write_text(arch)


# ---- (7) results and evaluation: one writer per output, whole files, no result replaced unasked ----
HOLD = ("import sys, time; sys.path.insert(0, sys.argv[1]); import rundir; "
        "assert rundir.hold_run_directory(sys.argv[2]) is None; print('held', flush=True); time.sleep(600)")


def held(path):
    """A process that holds `path` as rundir.hold_run_directory does (a live run, evaluate.py, compare.py)."""
    import subprocess
    import sys
    p = subprocess.Popen([sys.executable, "-c", HOLD, common.HERE, str(path)], stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "held"
    return p


@pytest.mark.slow  # another process holds the lock
def test_two_evaluations_into_one_out_and_a_full_disk_are_one_line(tiny, tmp_path, monkeypatch):
    from helpers import run_script
    out = tmp_path / "eval"
    out.mkdir()
    flags = ["--model", tiny["flux"], "--prompts", tiny["prompts"], "--metrics", "jpeg", "--steps", "2", "--resolution",
             "32", "--max-sequence-length", "16", "--mixed-precision", "no", "--out", str(out)]
    holder = held(out)
    try:
        proc = run_script("evaluate.py", flags, check=False)
    finally:
        holder.kill()
        holder.wait()
    line = proc.stderr.strip().splitlines()[-1]
    assert proc.returncode == 1 and line.startswith(f"error: --out {str(out)!r} is in use by pid {holder.pid} on ")
    assert line.endswith("; wait until that run ends or stop it (two evaluations into one --out would replace each "
                         "other's scores.json)")

    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    monkeypatch.setattr(os, "posix_fallocate", full)
    proc = run_script("evaluate.py", flags, check=False)
    assert proc.stderr.strip().splitlines()[-1] == (
        f"error: --out {str(out)!r} has no room for the 68,292 bytes of scores.json and table.md (No space left on "
        f"device); free space or pass another --out") and "base:" not in proc.stdout  # before any work
    monkeypatch.undo()
    run_script("evaluate.py", flags)
    assert sorted(os.listdir(out)) == ["run.lock", "scores.json", "table.md"]
    proc = run_script("evaluate.py", flags, check=False)
    assert proc.stderr.strip().splitlines()[-1] == (f"error: --out {str(out)!r} holds an earlier evaluation's "
                                                    f"scores.json; pass another --out, or --overwrite to replace it")


@pytest.mark.slow  # another process holds the lock
def test_a_live_runs_pruning_leaves_a_checkpoint_that_evaluate_reads(tmp_path):
    import subprocess
    import sys

    import rundir
    ckpt = tmp_path / "checkpoints" / "iter_1"
    ckpt.mkdir(parents=True)
    (ckpt / "run.json").write_text("{}")
    prune = ("import sys; sys.path.insert(0, sys.argv[1]); import rundir; rundir.say = print; "
             "rundir.prune(sys.argv[2])")
    assert rundir.use_checkpoint(str(ckpt))  # as evaluate.py's resolve_checkpoint holds what it reads
    try:
        out = subprocess.run([sys.executable, "-c", prune, common.HERE, str(ckpt)], capture_output=True, text=True)
        assert out.stdout.strip() == (f"keeping {ckpt}: another process reads it (evaluate.py); a later checkpoint "
                                      f"removes it") and ckpt.is_dir()
    finally:
        while rundir.HELD_CHECKPOINTS:
            os.close(rundir.HELD_CHECKPOINTS.pop())
    subprocess.run([sys.executable, "-c", prune, common.HERE, str(ckpt)], check=True)
    assert not ckpt.exists() and not rundir.use_checkpoint(str(ckpt))


@pytest.mark.slow  # another process holds the lock
def test_compare_holds_its_runs_dir_and_redoes_a_run_whose_record_a_kill_emptied(tmp_path, capsys):
    import subprocess
    import sys
    compare = os.path.join(common.HERE, "results", "compare.py")
    runs = tmp_path / "runs"
    runs.mkdir()
    holder = held(runs)
    try:
        proc = subprocess.run([sys.executable, compare, "--configs", "flow_grpo", "--seeds", "0", "--iterations", "1",
                               "--runs-dir", str(runs), "--out", str(tmp_path / "out")], capture_output=True, text=True,
                              timeout=300)
    finally:
        holder.kill()
        holder.wait()
    line = proc.stderr.strip().splitlines()[-1]
    assert proc.returncode == 1 and line.startswith(f"error: --runs-dir {str(runs)!r} is in use by pid {holder.pid} ")
    assert line.endswith("(two comparisons in one --runs-dir would start the same runs twice)")
    sys.path.insert(0, os.path.join(common.HERE, "results"))
    import compare as compare_module
    seed = runs / "flow_grpo" / "seed0"
    (seed / "toy__flow_grpo__0__1").mkdir(parents=True)
    (runs / "flow_grpo" / "seed0.json").write_text("")  # an older version's record, emptied by a kill
    assert compare_module.run_record(str(seed)) is None and not seed.exists()
    assert capsys.readouterr().out == f"{seed}.json cannot be read (a kill while it was written?): {seed} starts over\n"


# ---- (8) a full disk: "no space left on device", nothing half-written, no thread's traceback ----
def test_tensorboards_writer_thread_fails_quietly_and_the_run_says_it_in_one_line(tmp_path, capfd, monkeypatch):
    import types

    import rundir
    from tensorboard.summary.writer import record_writer

    def full(self, data):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    args = types.SimpleNamespace(track=False, a=1)
    monkeypatch.setattr(rundir, "loggable", lambda a: {"a": 1})
    writer = rundir.make_writer(str(tmp_path), args)
    monkeypatch.setattr(record_writer.RecordWriter, "write", full)
    with pytest.raises(SystemExit) as e:
        with rundir.stop_on_write_error(str(tmp_path)):
            for step in range(1000):
                writer.add_scalar("x", 1.0, step)
            writer.flush()
    assert one_line(e) == f"error: cannot write {str(tmp_path)!r} (No space left on device): the run stops here"
    err = capfd.readouterr().err
    assert "Traceback" not in err and "Exception in thread" not in err, err


@pytest.mark.parametrize("name", ["flow_grpo", "densegrpo", "diffusion_nft", "awm", "dancegrpo", "g2rpo", "mixgrpo",
                                  "dgpo", "flow_dppo"])
def test_every_files_arguments_and_toy_preset_come_back_from_run_json_as_they_were(name):
    """What run.json records (loggable: JSON) reads back as the same Args, its unions (densegrpo's
    --dense-ode-steps int or 't') and tuples of floats included."""
    import importlib

    import rundir
    module = importlib.import_module(name)
    for args in (module.Args(), dataclasses.replace(module.Args(), **module.TOY)):
        saved = json.loads(json.dumps(dataclasses.asdict(args)))
        assert rundir.arguments_from(module.Args, saved) == args
    if name == "densegrpo":
        assert rundir.arguments_from(module.Args, {"dense_ode_steps": 2}).dense_ode_steps == 2


def test_resume_alone_takes_only_arguments_of_their_type_from_run_json():
    """--resume DIR alone takes the checkpoint's arguments as the defaults (rundir.arguments_from): one of another
    type (a string, a list where a number goes) is one line, not a traceback in the checks that follow."""
    import flow_grpo
    import rundir
    good = {"num_steps": 4, "guidance": 4, "rewards": ["jpeg"], "reward_models": {"reward_timeout": 60}}
    args = rundir.arguments_from(flow_grpo.Args, good)
    assert (args.num_steps, args.guidance, args.rewards, args.reward_models.reward_timeout) == (4, 4.0, ("jpeg",), 60.0)
    for saved, shown in [({"num_steps": "abc"}, "--num-steps 'abc', not the int"),
                         ({"group_size": [1, 2]}, "--group-size (1, 2), not the int"),
                         ({"seed": True}, "--seed True, not the int"),
                         ({"rewards": ["jpeg", 3]}, "--rewards ('jpeg', 3), not the tuple"),
                         ({"reward_models": {"reward_timeout": "x"}}, "--reward-timeout 'x', not the float"),
                         ({"text_cache": 3}, "--text-cache 3, not the str or None")]:
        with pytest.raises(SystemExit) as e:
            rundir.arguments_from(flow_grpo.Args, saved)
        assert one_line(e) == (f"error: the checkpoint's run.json has {shown} it takes; resume from another checkpoint, "
                               f"or give the flag")
