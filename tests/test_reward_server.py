"""The geneval and deqa clients (rewards.geneval_reward, rewards.deqa_reward) against a local stand-in of
Flow-GRPO's reward server (github.com/yifan123/reward-server app_geneval.py / app_deqa.py: POST / with a
pickled body, a pickled answer, HTTP 500 with the traceback on an error) on 127.0.0.1 in a thread. It is no
detector: its answers are known functions of the request. Also: prompts with metadata (common.Prompt), the
plain-data unpickler refusing a payload that would run code, and the one-line errors."""
import io
import json
import os
import pickle
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest
import torch
from PIL import Image

import common
from common import Prompt, load_prompt_set, score
from rewards import deqa_reward, geneval_reward, plain_loads

META = [{"tag": "single_object", "include": [{"class": "cat", "count": 1}], "prompt": "a photo of a cat"},
        {"tag": "counting", "include": [{"class": "dog", "count": 2}],
         "exclude": [{"class": "dog", "count": 3}], "prompt": "a photo of two dogs"},
        {"tag": "position", "include": [{"class": "laptop", "count": 1},
                                        {"class": "cow", "count": 1, "position": ["right of", 0]}],
         "prompt": "a photo of a cow right of a laptop"}]


class StandIn(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self):
        super().__init__(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server_address[1]}"
        self.requests, self.fail_first, self.raw, self.mode = [], 0, None, None


class Handler(BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def do_POST(self):
        s: StandIn = self.server
        data = pickle.loads(self.rfile.read(int(self.headers["Content-Length"])))  # it trusts the client
        s.requests.append(data)
        if s.mode == "silent":  # never answers
            time.sleep(3600)
        if s.mode == "drip":  # an answer that never ends: a byte at a time
            self.send_response(200)
            self.send_header("Content-Length", "1000000")
            self.end_headers()
            while True:
                self.wfile.write(b"x")
                self.wfile.flush()
                time.sleep(0.2)
        if s.mode == "drop" and len(s.requests) == 1:  # the connection dropped mid-answer, once
            self.send_response(200)
            self.send_header("Content-Length", "1000")
            self.end_headers()
            self.wfile.write(b"\x80\x04")
            self.close_connection = True
            return
        if len(s.requests) <= s.fail_first:
            code, body = 500, b"Traceback (most recent call last):\n  ...\nValueError: boom\n"
        elif s.raw is not None:
            code, body = 200, s.raw
        else:
            images = [Image.open(io.BytesIO(d), formats=["jpeg"]) for d in data["images"]]
            bright = [float(np.asarray(img.convert("L")).mean()) / 255 for img in images]
            if "meta_datas" in data:  # GenEval: score = brightness, correct: > 0.5, strict: not counting
                strict = [float(m["tag"] != "counting") for m in data["meta_datas"]]
                answer = {"scores": bright, "rewards": [0.0 if data["only_strict"] else float(b > 0.5)
                                                        for b in bright],
                          "strict_rewards": strict, "group_rewards": {}, "group_strict_rewards": {}}
            else:  # DeQA: outputs = (1 + 4 brightness) / 5
                answer = {"outputs": [(1 + 4 * b) / 5 for b in bright]}
            code, body = 200, pickle.dumps(answer)
        self.send_response(code)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


@pytest.fixture
def server():
    s = StandIn()
    thread = threading.Thread(target=s.serve_forever, daemon=True)
    thread.start()
    yield s
    s.shutdown()
    s.server_close()


def gray(values):
    return torch.tensor(values).view(-1, 1, 1, 1).expand(-1, 3, 8, 8).contiguous()


def prompts():
    return [Prompt(m["prompt"], m) for m in META]


def test_geneval_training_and_evaluation(server):
    fn = geneval_reward(server.url, retries=0)
    images = gray([0.2, 0.6, 1.0])
    r = fn(images, prompts())
    assert r.dtype == torch.float32 and r.tolist() == pytest.approx([0.2, 0.6, 1.0], abs=0.01)
    sent = server.requests[-1]
    assert sent["only_strict"] is True and sent["meta_datas"] == META
    assert all(Image.open(io.BytesIO(d)).format == "JPEG" for d in sent["images"])
    out = score({"geneval": fn}, images, prompts(), evaluation=True)  # as common.evaluate_policy calls it
    assert server.requests[-1]["only_strict"] is False
    assert list(out) == ["geneval", "geneval_accuracy", "geneval_strict_accuracy"]
    assert out["geneval_accuracy"].tolist() == [0.0, 1.0, 1.0]
    assert out["geneval_strict_accuracy"].tolist() == [1.0, 0.0, 1.0]
    assert score({"geneval": fn}, images, prompts())["geneval"].shape == (3,)  # training: the score only
    tags = fn.breakdown(out, prompts())
    assert {k: v.tolist() for k, v in tags.items()} == {
        "geneval_counting_accuracy": [1.0], "geneval_counting_strict_accuracy": [0.0],
        "geneval_position_accuracy": [1.0], "geneval_position_strict_accuracy": [1.0],
        "geneval_single_object_accuracy": [0.0], "geneval_single_object_strict_accuracy": [1.0]}


def test_batches_as_the_official_array_split(server):
    fn = geneval_reward(server.url, retries=0)
    fn(torch.rand(70, 3, 8, 8), prompts() * 23 + prompts()[:1])
    assert [len(r["images"]) for r in server.requests] == [35, 35]  # np.array_split(70, ceil(70 / 64))


def test_deqa(server):
    r = deqa_reward(server.url, retries=0)(gray([0.0, 0.5, 1.0]), ["ignored"] * 3)
    assert r.tolist() == pytest.approx([0.2, 0.6, 1.0], abs=0.01)
    assert list(server.requests[-1]) == ["images"]


def test_a_payload_that_would_run_code_is_refused(server, tmp_path):
    marker = tmp_path / "ran"

    class Hostile:
        def __reduce__(self):
            return os.system, (f"touch {marker}",)

    server.raw = pickle.dumps({"outputs": [Hostile()]})
    with pytest.raises(SystemExit) as e:
        deqa_reward(server.url, retries=0)(gray([0.5]), ["p"])
    assert str(e.value) == (f"error: the reward server {server.url} answered with a pickle that is not plain "
                            f"data (refused {os.system.__module__}.system); nothing of it was run: is it the "
                            f"reward server?")
    assert not marker.exists()
    assert plain_loads(pickle.dumps({"a": [1, 2.5, True, None, "s", b"b", (1,)]}), "u") == {
        "a": [1, 2.5, True, None, "s", b"b", (1,)]}


def test_errors_name_the_url(server):
    server.fail_first = 1  # a 500 (the server's traceback) is retried
    assert deqa_reward(server.url, retries=1)(gray([1.0]), ["p"]).tolist() == pytest.approx([1.0], abs=0.01)
    server.requests, server.fail_first = [], 5
    with pytest.raises(SystemExit) as e:
        deqa_reward(server.url, retries=1)(gray([1.0]), ["p"])
    assert str(e.value) == (f"error: the reward server {server.url} failed after 2 tries (HTTP 500: "
                            f"ValueError: boom); start it (docs/rewards.md: reward servers) or pass its URL")
    assert len(server.requests) == 2
    server.fail_first, server.raw = 0, pickle.dumps({"outputs": [0.5]})
    with pytest.raises(SystemExit) as e:
        deqa_reward(server.url, retries=0)(gray([1.0, 0.0]), ["p", "p"])
    assert str(e.value) == (f"error: the reward server {server.url} answered without 2 numbers in 'outputs' "
                            f"(got [0.5])")
    server.raw = b"<html>not found</html>"
    with pytest.raises(SystemExit, match=f"^error: the reward server {server.url} answered with no pickle"):
        deqa_reward(server.url, retries=0)(gray([1.0]), ["p"])
    closed = StandIn()
    url = closed.url
    closed.server_close()
    with pytest.raises(SystemExit) as e:
        deqa_reward(url, retries=0)(gray([1.0]), ["p"])
    assert str(e.value) == (f"error: the reward server {url} failed after 1 try (URLError: [Errno 111] "
                            f"Connection refused); start it (docs/rewards.md: reward servers) or pass its URL")


@pytest.mark.parametrize("mode", ["silent", "drip"])
def test_a_server_that_stalls_or_drips_is_cut_off_at_the_deadline(server, mode):
    """A server that never answers, or sends a byte every 0.2 s for ever (each socket read succeeds: a timeout
    per read would never fire), costs the batch its --reward-timeout (here 1.5 s) and no more."""
    server.mode = mode
    t = time.monotonic()
    with pytest.raises(SystemExit) as e:
        deqa_reward(server.url, deadline=1.5, retries=3)(gray([0.5]), ["p"])
    assert 1.4 < time.monotonic() - t < 5
    assert str(e.value) == (f"error: the reward server {server.url} failed after 1 try (no whole answer within the "
                            f"deadline (--reward-timeout)); start it (docs/rewards.md: reward servers) or pass its URL")


def test_a_connection_dropped_mid_answer_is_retried(server):
    server.mode = "drop"  # http.client.IncompleteRead on the first request
    assert deqa_reward(server.url, retries=1)(gray([1.0]), ["p"]).tolist() == pytest.approx([1.0], abs=0.01)
    assert len(server.requests) == 2


@pytest.mark.parametrize("answer,message", [
    ({"outputs": [10**400]}, "outputs[0] = an integer of 1329 bits, not a number in [0.199, 1.001]"),
    ({"outputs": [float("nan")]}, "outputs[0] = nan, not a number in [0.199, 1.001]"),
    ({"outputs": [4.2]}, "outputs[0] = 4.2, not a number in [0.199, 1.001]"),  # a 1-5 score not divided by 5
    ({"outputs": [True]}, "outputs[0] = True, not a number in [0.199, 1.001]"),
    ({"outputs": ["0.5"]}, "outputs[0] = '0.5', not a number in [0.199, 1.001]"),
])
def test_deqa_values_are_checked(server, answer, message):
    server.raw = pickle.dumps(answer)
    with pytest.raises(SystemExit) as e:
        deqa_reward(server.url, retries=0)(gray([0.5]), ["p"])
    assert str(e.value) == f"error: the reward server {server.url} answered {message}"


def test_geneval_values_are_checked(server):
    server.raw = pickle.dumps({"scores": [0.5, -0.5, 1.0], "rewards": [0, 1, 1], "strict_rewards": [1, 1, 1]})
    with pytest.raises(SystemExit) as e:
        geneval_reward(server.url, retries=0)(gray([0.2, 0.6, 1.0]), prompts())
    assert str(e.value) == f"error: the reward server {server.url} answered scores[1] = -0.5, not a number in [0.0, 1.0]"
    server.raw = pickle.dumps({"scores": [0.5, 0.5, 1.0], "rewards": [0, 2, 1], "strict_rewards": [1, 1, 1]})
    with pytest.raises(SystemExit, match=r"answered rewards\[1\] = 2, not a number in \[0.0, 1.0\]$"):
        score({"geneval": geneval_reward(server.url, retries=0)}, gray([0.2, 0.6, 1.0]), prompts(), evaluation=True)


def test_prompts_carry_their_metadata(tmp_path):
    path = tmp_path / "geneval.jsonl"
    path.write_text("".join(json.dumps(m) + "\n" for m in META))
    loaded = load_prompt_set(str(path), rewards=("geneval",))
    assert loaded == [m["prompt"] for m in META] and [p.metadata for p in loaded] == META
    kept = [loaded[i] for i in torch.tensor([2, 0]).repeat_interleave(2)]  # as the algorithm files index them
    assert [p.metadata["tag"] for p in kept] == ["position", "position", "single_object", "single_object"]
    assert pickle.loads(pickle.dumps(kept))[0].metadata == META[2]  # across ranks
    assert json.dumps(loaded[:1]) == '["a photo of a cat"]'
    pipe, kind = common.load_pipeline("toy", torch.device("cpu"))
    emb = common.encode_prompts(pipe, kind, loaded, max_sequence_length=16, cfg=3.5)
    ref = common.encode_prompts(pipe, kind, [str(p) for p in loaded], max_sequence_length=16, cfg=3.5)
    assert all(torch.equal(emb[k], ref[k]) for k in ref if torch.is_tensor(ref[k]))


def test_bad_metadata_is_one_line_with_its_line_number(tmp_path):
    path = tmp_path / "geneval.jsonl"
    bad = dict(META[2], include=[{"class": "laptop", "count": 1}, {"class": "cow", "count": 1,
                                                                   "position": ["behind", 0]}])
    path.write_text(json.dumps(META[0]) + "\n" + json.dumps(bad) + "\n")
    with pytest.raises(SystemExit) as e:
        load_prompt_set(str(path), rewards=("geneval",))
    assert str(e.value) == (f"error: line 2 of {str(path)!r}: include[1]'s position is not [relation, "
                            f"index of an earlier include] with a relation in left of, right of, above, "
                            f"below (GenEval metadata)")
    path.write_text(json.dumps(META[0]) + "\n" + json.dumps(dict(META[1], tag="colour")) + "\n")
    with pytest.raises(SystemExit) as e:
        load_prompt_set(str(path), rewards=("geneval",))
    assert str(e.value) == (f"error: line 2 of {str(path)!r}: its tag is not one of single_object, "
                            f"two_object, counting, colors, position, color_attr (GenEval metadata)")
    path.write_text(json.dumps(dict(META[1], include=[{"class": "dog", "count": 0}])) + "\n")
    with pytest.raises(SystemExit) as e:
        load_prompt_set(str(path), rewards=("geneval",))
    assert str(e.value) == (f"error: line 1 of {str(path)!r}: include[0] needs a class (a string) and a "
                            f"count (an integer >= 1) (GenEval metadata)")
    path.write_text(json.dumps(META[0]) + "\n{not json\n")
    with pytest.raises(SystemExit, match="^error: line 2 of prompt file .* is not a JSON object"):
        load_prompt_set(str(path), rewards=("geneval",))
    text = tmp_path / "plain.txt"
    text.write_text("a photo of a cat\n")
    with pytest.raises(SystemExit) as e:
        load_prompt_set(str(text), rewards=("geneval",))
    assert str(e.value) == (f"error: the geneval reward needs GenEval metadata; line 1 of {str(text)!r} is "
                            f"plain text: pass a .jsonl metadata file (data/geneval/test_metadata.jsonl)")


def test_urls_are_checked_before_loading():
    import rewards
    with pytest.raises(SystemExit) as e:
        rewards.check("geneval", common.RewardModels(geneval_url="127.0.0.1:18085"))
    assert str(e.value) == ("error: --geneval-url '127.0.0.1:18085' is not an http:// address of the reward "
                            "server (a host, a port in 1-65535, no spaces)")
    assert common.RewardModels().geneval_url == "http://127.0.0.1:18085"
    assert common.RewardModels().deqa_url == "http://127.0.0.1:18086"


@pytest.mark.slow
@pytest.mark.parametrize("script", ["flow_grpo.py", "diffusion_nft.py"])
def test_an_algorithm_file_trains_and_evaluates_on_geneval(server, tiny, tmp_path, script):
    """A whole run on the tiny Flux pipeline with metadata prompts: every training request carries each image's
    own prompt metadata (through the groups and the rollout) with only_strict, the evaluation's without, and the
    run logs the training score and the evaluation's accuracies, per tag too."""
    from helpers import read_metrics, run_script, tiny_flags

    path = tmp_path / "meta.jsonl"
    path.write_text("".join(json.dumps(m) + "\n" for m in META))
    flags = tiny_flags(tiny["flux"], str(path), tmp_path / "out", rewards="geneval", num_iterations=1, eval_every=1,
                       eval_num=3, save_every=0, log_images_every=0)
    run_script(script, flags + ["--geneval-url", server.url])
    _, m = read_metrics(tmp_path / "out")
    training = [r for r in server.requests if r["only_strict"]]
    assert len(training) == 1 and len(training[0]["images"]) == 2 * 4  # 2 prompts x G = 4, one batch
    by_prompt = {m["prompt"]: m for m in META}
    sent = training[0]["meta_datas"]
    assert all(s == by_prompt[s["prompt"]] for s in sent) and all(s == sent[4 * (i // 4)] for i, s in enumerate(sent))
    assert [r["meta_datas"] for r in server.requests if not r["only_strict"]][0] == META  # pairs 0, 1, 2
    assert 0 <= m[1]["reward/geneval_mean"] <= 1
    assert {"eval/geneval_accuracy", "eval/geneval_strict_accuracy", "eval/geneval_counting_accuracy"} <= set(m[1])
