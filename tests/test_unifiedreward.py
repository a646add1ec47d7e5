"""The UnifiedReward client (rewards.unifiedreward_reward) against a small local stand-in server on
127.0.0.1 (a free port, a thread of this process) that speaks the OpenAI chat-completions protocol as sglang /
vLLM serve it: POST /v1/chat/completions with one user message of an image_url part (a base64 PNG data
URL) and a text part, answered in the chat-completion JSON shape. It is no model: its 'Final Score' is
1 + 4 x the PNG's mean brightness, so every score is known in advance; it records what it received."""
import base64
import io
import json
import os
import re
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest
import torch
from PIL import Image

from rewards import UNIFIEDREWARD_QUESTION, unifiedreward_reward


class StandIn(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self):
        super().__init__(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server_address[1]}"
        self.delay, self.fail_first, self.status, self.answer, self.key = 0.0, 0, 503, None, None
        self.lock, self.requests, self.errors, self.active, self.peak = threading.Lock(), [], [], 0, 0


class Handler(BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def reply(self, code: int, obj):
        data = json.dumps(obj).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_POST(self):
        s: StandIn = self.server
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if s.key is not None and self.headers.get("Authorization") != f"Bearer {s.key}":
            return self.reply(401, {"error": "unauthorized"})  # sglang's --api-key check
        with s.lock:
            s.requests.append({"body": body, "path": self.path})
            n, s.active = len(s.requests), s.active + 1
            s.peak = max(s.peak, s.active)
        try:
            time.sleep(s.delay)
            if n <= s.fail_first:
                return self.reply(s.status, {"error": "transient"})
            try:  # the protocol: anything else is recorded as an error (the fixture fails) and answered 400
                assert self.path == "/v1/chat/completions", self.path
                assert body["temperature"] == 0 and set(body) == {"model", "messages", "temperature"}, body
                (message,) = body["messages"]
                image_part, text_part = message["content"]
                assert message["role"] == "user" and image_part["type"] == "image_url", message
                prefix, b64 = image_part["image_url"]["url"].split(",", 1)
                assert prefix == "data:image/png;base64", prefix
                image = Image.open(io.BytesIO(base64.b64decode(b64, validate=True)))
                assert image.format == "PNG" and image.mode == "RGB", (image.format, image.mode)
                assert text_part["type"] == "text", text_part
            except (AssertionError, KeyError, TypeError, ValueError, OSError) as e:
                s.errors.append(repr(e))
                return self.reply(400, {"error": repr(e)})
            s.requests[n - 1].update(image=image, text=text_part["text"], model=body["model"])
            brightness = float(np.asarray(image.convert("L"), dtype=np.float64).mean()) / 255
            content = f"The image matches the caption.\nFinal Score: {1 + 4 * brightness:.2f}" \
                if s.answer is None else s.answer
            self.reply(200, {"id": f"chatcmpl-{n}", "object": "chat.completion", "model": body["model"],
                             "choices": [{"index": 0, "finish_reason": "stop",
                                          "message": {"role": "assistant", "content": content}}]})
        finally:
            with s.lock:
                s.active -= 1


@pytest.fixture
def server():
    s = StandIn()
    thread = threading.Thread(target=s.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True)
    thread.start()
    yield s
    s.shutdown()
    s.server_close()
    assert not s.errors, s.errors  # every request the client sent followed the protocol


def flat(values, size=64):
    """Images of constant grey levels, and the score that the stand-in gives each (resizing keeps it)."""
    x = torch.stack([torch.full((3, size, size), v) for v in values])
    levels = (x[:, 0, 0, 0] * 255).round()
    return x, [float(f"{1 + 4 * b / 255:.2f}") for b in levels.tolist()]


def as_sent(x):
    """What the server should receive for each image: its uint8 pixels resized to 512 x 512 by PIL's bicubic
    (as Flow-GRPO's client does), and the stand-in's score for that."""
    pixels = (x.clamp(0, 1) * 255).round().byte().permute(0, 2, 3, 1).numpy()
    sent = [np.asarray(Image.fromarray(p).resize((512, 512), Image.BICUBIC)) for p in pixels]
    grey = [np.asarray(Image.fromarray(p).convert("L"), dtype=np.float64) for p in sent]  # as the stand-in
    brightness = [float(g.mean()) / 255 for g in grey]
    return sent, [float(f"{1 + 4 * b:.2f}") for b in brightness]


def test_scores_and_what_the_server_received(server):
    """Scores are the answers' 'Final Score' / 5 (scale=1: the raw 1-5), float32, in the images' order; the
    server got, per image, the model name, UNIFIEDREWARD_QUESTION with the prompt, and exactly the image's
    pixels resized to 512 x 512 as a PNG data URL; a URL ending in /v1/ reaches the same endpoint."""
    g = torch.Generator().manual_seed(0)
    x = torch.rand(5, 3, 48, 64, generator=g) * torch.linspace(0.1, 1, 5).view(5, 1, 1, 1)  # 5 brightnesses
    x[0] = 0.0
    sent, expected = as_sent(x)
    prompts = ["a cat", "a dog {with braces}", "two red cubes", "", "a photo"]
    r = unifiedreward_reward(server.url + "/v1/", model="UnifiedReward-stand-in")(x, prompts)
    assert r.dtype == torch.float32 and r.shape == (5,) and len(set(expected)) == 5
    torch.testing.assert_close(r, torch.tensor(expected) / 5)  # the training reward: score / 5
    by_text = {q["text"]: q for q in server.requests}
    assert sorted(by_text) == sorted(UNIFIEDREWARD_QUESTION.format(prompt=p) for p in prompts)
    assert "Text Caption: [a dog {with braces}]" in UNIFIEDREWARD_QUESTION.format(prompt=prompts[1])
    for prompt, image in zip(prompts, sent):  # PNG is lossless: bit for bit the resized pixels
        received = by_text[UNIFIEDREWARD_QUESTION.format(prompt=prompt)]["image"]
        assert np.array_equal(np.asarray(received), image)
    assert {q["model"] for q in server.requests} == {"UnifiedReward-stand-in"}
    raw = unifiedreward_reward(server.url, model="m", scale=1)(x, prompts)
    torch.testing.assert_close(raw, torch.tensor(expected))  # the papers' raw 1-5 score, for evaluation


def test_requests_run_in_parallel(server):
    """Eight requests to a server that takes 0.2 s each finish in well under 8 x 0.2 s, at least 4 at once."""
    server.delay = 0.2
    x, expected = flat([i / 7 for i in range(8)])
    fn = unifiedreward_reward(server.url, model="m", workers=8)
    start = time.perf_counter()
    r = fn(x, ["p"] * 8)
    elapsed = time.perf_counter() - start
    print(f"8 requests of 0.2 s: {elapsed:.3f} s, {server.peak} at once")
    assert elapsed < 1.0 and server.peak >= 4, (elapsed, server.peak)  # one at a time would take 1.6 s
    torch.testing.assert_close(r, torch.tensor(expected) / 5)  # in the order of the images


def test_transient_503_is_retried(server):
    """A 503 on the first request is retried (after 0.5 s) and the scores come out right."""
    server.fail_first = 1
    x, expected = flat([0.3, 0.6])
    r = unifiedreward_reward(server.url, model="m", workers=1)(x, ["a", "b"])
    torch.testing.assert_close(r, torch.tensor(expected) / 5)
    assert len(server.requests) == 3


def test_retries_run_out_and_4xx_is_not_retried(server):
    """503s past the retries, and a 400 at once, stop the run with a one-line error naming the endpoint."""
    server.fail_first = 10
    fn = unifiedreward_reward(server.url, model="m", workers=1, retries=1)
    endpoint = re.escape(server.url + "/v1/chat/completions")
    with pytest.raises(SystemExit, match=rf"^error: the UnifiedReward server {endpoint} failed after 2 tries "
                                         r"\(HTTP 503: \{\"error\": \"transient\"\}\); start it or pass --unifiedreward-url$") as e:
        fn(flat([0.5])[0], ["a"])
    assert "\n" not in str(e.value) and len(server.requests) == 2
    server.status = 400
    with pytest.raises(SystemExit, match=r"failed after 1 try \(HTTP 400[:)]"):
        fn(flat([0.5])[0], ["a"])
    assert len(server.requests) == 3


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_unreachable_server_is_a_one_line_error():
    """Nothing listening on the port: after the retries, a one-line SystemExit naming the URL's endpoint."""
    url = f"http://127.0.0.1:{free_port()}"
    fn = unifiedreward_reward(url + "/v1", model="m", retries=1)  # no request until scoring
    with pytest.raises(SystemExit) as e:
        fn(flat([0.5])[0], ["a"])
    message = str(e.value)
    assert message.startswith(f"error: the UnifiedReward server {url}/v1/chat/completions failed after 2 "
                              f"tries (")
    assert "\n" not in message and "--unifiedreward-url" in message


def test_answer_without_a_score_is_a_one_line_error(server):
    """An answer without 'Final Score: <1-5>' (none, or 0) is a one-line SystemExit quoting the answer."""
    server.answer = "I cannot rate this image.\nIt is too dark. Score: high"
    fn = unifiedreward_reward(server.url, model="m")
    endpoint = re.escape(server.url + "/v1/chat/completions")
    message = (rf"^error: the UnifiedReward answer from {endpoint} has no 'Final Score: <1-5>': "
               r"'I cannot rate this image\.\\nIt is too dark\. Score: high'$")
    with pytest.raises(SystemExit, match=message) as e:
        fn(flat([0.1, 0.9])[0], ["a", "b"])
    assert "\n" not in str(e.value)
    for written in ("0", "10", "-3", "5.5"):  # read as the model wrote it: "10" is ten, not a 1 and a 0
        server.answer = f"The image is sharp.\nFinal Score: {written}"
        with pytest.raises(SystemExit) as e:
            fn(flat([0.5])[0], ["a"])
        assert str(e.value) == (f"error: the UnifiedReward server {server.url}/v1/chat/completions answered 'Final "
                                f"Score: {written}', outside the question's scale of 1 to 5 (in {server.answer!r})")


def test_a_server_started_with_an_api_key(server, monkeypatch):
    """A server started with --api-key (sglang answers 401 without it): the key from --unifiedreward-api-key or
    $UNIFIEDREWARD_API_KEY goes as 'Authorization: Bearer <key>'; a missing or wrong key is a one-line error
    that says so (not 'start it'), after one try."""
    import rewards
    from common import RewardModels

    server.key = "flowgrpo"
    x, expected = flat([0.2, 0.7])
    r = unifiedreward_reward(server.url, model="m", api_key="flowgrpo")(x, ["a", "b"])
    torch.testing.assert_close(r, torch.tensor(expected) / 5)
    monkeypatch.setenv("UNIFIEDREWARD_API_KEY", "flowgrpo")
    fn = rewards.load("unifiedreward", "cpu", models=RewardModels(unifiedreward_url=server.url))
    torch.testing.assert_close(fn(x, ["a", "b"]), torch.tensor(expected) / 5)
    monkeypatch.delenv("UNIFIEDREWARD_API_KEY")
    endpoint = re.escape(server.url + "/v1/chat/completions")
    for key, why in [(None, "needs an API key and none was given"), ("wrong", "refused the API key")]:
        with pytest.raises(SystemExit, match=rf"^error: the UnifiedReward server {endpoint} {why} \(HTTP 401\); "
                                             r"pass the key it was started with") as e:
            unifiedreward_reward(server.url, model="m", api_key=key, workers=1)(flat([0.5])[0], ["a"])
        assert "\n" not in str(e.value) and "wrong" not in str(e.value)
    assert len(server.requests) == 4  # the 401s were not retried (nor recorded)


def test_the_api_key_is_never_logged_or_saved(server, tiny, tmp_path):
    """A run that scores UnifiedReward with a key: the key appears in no file of the run directory (run.json,
    metrics, TensorBoard events, checkpoints) and nowhere in what the run printed; run.json says it was hidden."""
    import glob
    import json

    from helpers import read_metrics, run_script, tiny_flags

    server.key = "s3cr3t-key-4242"
    flags = tiny_flags(tiny["flux"], tiny["prompts"], tmp_path / "out", num_iterations=1, eval_every=1,
                       eval_rewards="unifiedreward", unifiedreward_url=server.url,
                       unifiedreward_api_key=server.key)
    proc = run_script("flow_grpo.py", flags)
    run_dir, m = read_metrics(tmp_path / "out")
    assert "eval/unifiedreward" in m[1] and server.requests
    for path in glob.glob(os.path.join(run_dir, "**", "*"), recursive=True):
        if os.path.isfile(path):
            with open(path, "rb") as f:
                assert server.key.encode() not in f.read(), path
    assert server.key not in proc.stdout + proc.stderr
    (run_json,) = glob.glob(os.path.join(run_dir, "checkpoints", "*", "run.json"))
    with open(run_json) as f:
        assert json.load(f)["args"]["reward_models"]["unifiedreward_api_key"] == "<hidden>"


@pytest.mark.parametrize("given", [["--unifiedreward-api-key", "k3y-1"], ["--unifiedreward-api-key=k3y-1"]])
def test_the_api_key_leaves_sys_argv_once_parsed(monkeypatch, given):
    """wandb uploads sys.argv with a run's metadata: after parsing, the key is in the arguments only."""
    import sys

    import flow_grpo
    from rundir import parse_args

    monkeypatch.setattr(sys, "argv", ["flow_grpo.py", "--beta", "0", *given, "--seed", "3"])
    args = parse_args(flow_grpo.Args, toy=flow_grpo.TOY, description="")
    assert args.reward_models.unifiedreward_api_key == "k3y-1" and args.seed == 3
    assert not any("k3y-1" in a for a in sys.argv) and "--seed" in sys.argv
