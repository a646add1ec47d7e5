"""The ocr reward (rewards.ocr_reward): Flow-GRPO's formula (flow_grpo/ocr.py:31-60) on its own cases, the
reward path on a stand-in engine with the engine's interface (fn(pixels) -> [(text, confidence)]), the
real engine (RapidOCR) reading text rendered with PIL when it is installed, and the one-line errors before any
model loads: a missing engine, a prompt without a quoted text, an empty quoted text."""
import importlib.util

import numpy as np
import pytest
import torch
from PIL import Image, ImageDraw, ImageFont

import rewards
from common import RewardModels, load_prompt_set
from rewards import levenshtein, ocr_reward, ocr_score, ocr_target

PROMPT = 'New York Skyline with "Hello World" written with fireworks on the sky'  # ocr.py's example


def test_target_is_the_first_quoted_text():
    assert ocr_target(PROMPT) == "Hello World"
    assert ocr_target('a sign "OPEN" and a "CLOSED" one') == "OPEN"  # prompt.split('"')[1]
    assert ocr_target('a sign "" here') == ""
    assert ocr_target("no quotes") is None and ocr_target('one " only') is None


@pytest.mark.parametrize("recognised,expected", [
    ("Hello World", 1.0), ("HELLO WORLD", 1.0),  # spaces removed, lowercased on both sides
    ("Big sign: hello world!!", 1.0),  # a substring scores 1
    ("Hello Wor1d", 0.9), ("HelloWrld", 0.9), ("Hello", 0.5),  # 1 - Levenshtein / len(helloworld)
    ("", 0.0),  # nothing read: the distance is the target's length
    ("zzzzzzzzzzzzzzzzzzzzzzzzzzzzzz", 0.0),  # a distance above the length is clipped to it
])
def test_official_formula(recognised, expected):
    assert ocr_score(recognised, "Hello World") == pytest.approx(expected)


def test_levenshtein():
    for a, b, d in [("kitten", "sitting", 3), ("", "abc", 3), ("abc", "", 3), ("flaw", "lawn", 2), ("a", "a", 0)
                    ]:
        assert levenshtein(a, b) == d
    if importlib.util.find_spec("Levenshtein"):  # the official code's package, where installed
        from Levenshtein import distance
        rng = np.random.default_rng(0)
        for _ in range(200):
            a, b = ("".join(rng.choice(list("abc1 "), rng.integers(0, 12))) for _ in range(2))
            assert levenshtein(a, b) == distance(a, b)


def test_reward_path_on_a_stand_in_engine():
    seen = []

    def engine(pixels):  # the engine's interface: one image [H, W, 3] uint8 -> [(text, confidence)] per line
        seen.append((pixels.dtype, pixels.shape))
        return [("Hello", 0.9), ("zzz", 0.0), ("Wor1d", 0.8)]  # a line of confidence 0 is left out

    score = ocr_reward(engine)
    r = score(torch.rand(3, 3, 16, 24), [PROMPT, 'a "hello" sign', 'a "Goodbye" sign'])
    assert r.dtype == torch.float32 and r.tolist() == pytest.approx([0.9, 1.0, 1 - 7 / 7])
    assert seen == [(np.uint8, (16, 24, 3))] * 3
    with pytest.raises(SystemExit, match="needs a non-empty text in double quotes"):
        score(torch.rand(1, 3, 8, 8), ["no quotes"])

    def broken(pixels):
        raise RuntimeError("no model")

    with pytest.raises(SystemExit) as e:
        ocr_reward(broken)(torch.rand(1, 3, 8, 8), [PROMPT])
    assert str(e.value) == "error: the OCR engine failed on an image (RuntimeError: no model)"


def render(text: str, size: int = 512, font_size: int = 48) -> torch.Tensor:
    img = Image.new("RGB", (size, size), (235, 225, 200))
    draw = ImageDraw.Draw(img)
    font = ImageFont.load_default(size=font_size)
    draw.text(((size - draw.textlength(text, font=font)) / 2, size / 2 - font_size / 2), text, font=font,
              fill=(20, 20, 60))
    return torch.from_numpy(np.array(img)).permute(2, 0, 1).float() / 255


ENGINE = all(importlib.util.find_spec(m) for m in ("rapidocr", "onnxruntime"))


@pytest.mark.skipif(not ENGINE, reason="the OCR engine is not installed: pip install -r requirements-ocr.txt")
def test_the_real_engine_reads_rendered_text():
    words = ["Hello World", "Flow GRPO", "OPEN", "Coffee Shop", "SALE 50%", "Keep Calm", "No Parking",
             "Reward 2025"]
    score = ocr_reward()
    images = torch.stack([render(w) for w in words] + [render("Hello Wor"), torch.ones(3, 512, 512)])
    prompts = [f'a sign that says "{w}"' for w in words] + [PROMPT, PROMPT]
    r = score(images, prompts)
    assert r.tolist() == pytest.approx([1.0] * len(words) + [0.8, 0.0])  # "hellowor": distance 2 of 10


def test_missing_engine_is_one_line_before_loading(monkeypatch):
    real = importlib.util.find_spec
    engine = ("rapidocr", "onnxruntime")
    monkeypatch.setattr(importlib.util, "find_spec", lambda m, *a: None if m in engine else real(m, *a))
    with pytest.raises(SystemExit) as e:
        rewards.check("ocr", RewardModels())
    assert str(e.value) == ("error: the ocr reward needs an OCR engine (rapidocr and onnxruntime not "
                            "installed): pip install -r requirements-ocr.txt (rapidocr, onnxruntime)")


def test_prompts_without_a_quoted_text_are_refused(tmp_path):
    path = tmp_path / "ocr.txt"
    path.write_text(f"{PROMPT}\n\na street sign with no text\n")
    assert load_prompt_set(str(path), rewards=("pickscore",))[1] == "a street sign with no text"
    with pytest.raises(SystemExit) as e:
        load_prompt_set(str(path), rewards=("ocr",))
    assert str(e.value) == (f"error: line 3 of {str(path)!r} has no text in double quotes for the ocr "
                            f"reward: 'a street sign with no text'")
    path.write_text('a sign with " " on it\n')
    with pytest.raises(SystemExit) as e:
        load_prompt_set(str(path), rewards=("ocr",))
    assert str(e.value) == (f"error: line 1 of {str(path)!r} quotes an empty text; the ocr reward needs a "
                            f"text to render: 'a sign with \" \" on it'")
