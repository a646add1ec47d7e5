"""The toy world: grammar, reward calibration on ground truth and corruptions, the saved pipeline, the maker."""
import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "toy"))
from make_toy import render  # noqa: E402
from world import COLOURS, OPPOSITE, PHRASE, SHAPES, parse_toy_prompt, toy_prompts  # noqa: E402
from world import toy_color_position_reward, toy_shape_count_reward, toy_strict_accuracy  # noqa: E402

TOY = os.path.join(ROOT, "toy", "flux-shapes")
PROMPTS = toy_prompts(256, seed=123)


def _scores(images, prompts=PROMPTS):
    return (toy_color_position_reward(images, prompts), toy_shape_count_reward(images, prompts),
            toy_strict_accuracy(images, prompts))


def _edit(prompts, colour=False, position=False, shape=False):
    """The same scenes with each object's colour, position or shape changed (still within the grammar)."""
    out = []
    for p in prompts:
        objs = parse_toy_prompt(p)
        free = [c for c in COLOURS if c not in [o[0] for o in objs]]
        new = [(free[j] if colour else c, SHAPES[(SHAPES.index(s) + 1) % 3] if shape else s,
                OPPOSITE[q] if position else q) for j, (c, s, q) in enumerate(objs)]
        out.append(" and ".join(f"a {c} {s} {PHRASE[q]}" for c, s, q in new))
    return out


@pytest.fixture(scope="module")
def truth():
    torch.manual_seed(0)
    images = render(PROMPTS, generator=torch.Generator().manual_seed(0))
    return images, _scores(images)


def test_grammar_round_trip():
    prompts = toy_prompts(200, seed=5)
    assert prompts == toy_prompts(200, seed=5) and prompts != toy_prompts(200, seed=6)
    assert 0.3 < sum(" and " in p for p in prompts) / len(prompts) < 0.7
    for p in prompts:
        objs = parse_toy_prompt(p)
        assert " and ".join(f"a {c} {s} {PHRASE[q]}" for c, s, q in objs) == p
        if len(objs) == 2:
            assert objs[0][0] != objs[1][0] and OPPOSITE[objs[0][2]] == objs[1][2]
    assert parse_toy_prompt("A red circle on the left.") == [("red", "circle", "left")]
    assert parse_toy_prompt("a blue square at the top and a green triangle at the bottom") == [
        ("blue", "square", "top"), ("green", "triangle", "bottom")]


THREE = "a red circle on the left and a blue square on the right and a green circle at the top"


@pytest.mark.parametrize("bad", ["a purple circle on the left", "a photo of a cat", "", "a red circle", THREE])
def test_grammar_rejects(bad):
    with pytest.raises(ValueError, match="not a toy-world prompt") as e:
        parse_toy_prompt(bad)
    assert "\n" not in str(e.value)


def test_grammar_rejects_inconsistent_pair():
    with pytest.raises(ValueError, match="different colours and opposite positions"):
        parse_toy_prompt("a red circle on the left and a red square on the right")
    with pytest.raises(ValueError, match="different colours and opposite positions"):
        parse_toy_prompt("a red circle on the left and a blue square at the top")


def test_ground_truth_scores_high(truth):
    images, (a, b, strict) = truth
    assert images.shape == (256, 3, 32, 32) and 0 <= images.min() and images.max() <= 1
    assert a.shape == b.shape == strict.shape == (256,) and a.dtype == torch.float32
    assert a.mean() >= 0.95 and b.mean() >= 0.9 and strict.mean() >= 0.95, (a.mean(), b.mean(), strict.mean())
    assert a.min() >= 0.8 and b.min() >= 0.7


def test_other_sizes(truth):
    _, (a, b, strict) = truth
    a64, b64, s64 = _scores(render(PROMPTS, size=64, generator=torch.Generator().manual_seed(0)))
    assert abs(a64.mean() - a.mean()) < 0.03 and abs(b64.mean() - b.mean()) < 0.03 and s64.mean() >= 0.95


@pytest.mark.parametrize("kind", ["colour", "position", "shape", "blank", "noise"])
def test_corruptions_score_low(truth, kind):
    _, (a, b, strict) = truth
    g = torch.Generator().manual_seed(1)
    if kind == "blank":
        images = torch.zeros(256, 3, 32, 32)
    elif kind == "noise":
        images = torch.rand(256, 3, 32, 32, generator=g)
    else:
        images = render(_edit(PROMPTS, **{kind: True}), generator=g)
    ca, cb, cs = _scores(images)
    assert cs.mean() <= 0.02, cs.mean()
    if kind in ("colour", "blank", "noise"):  # the object is not there at all: both rewards collapse
        assert ca.mean() <= 0.1 and cb.mean() <= 0.1, (ca.mean(), cb.mean())
    if kind == "position":  # right objects in the wrong places: colour/position drops, shape/count does not
        assert ca.mean() <= a.mean() - 0.8 and cb.mean() >= b.mean() - 0.05, (ca.mean(), cb.mean())
    if kind == "shape":  # right colours in the right places, wrong shapes: shape/count drops
        assert cb.mean() <= b.mean() - 0.8 and ca.mean() >= a.mean() - 0.05, (ca.mean(), cb.mean())


def test_partial_credit_is_graded():
    """Half the request right earns part of the reward; a second, unrequested object costs."""
    g = torch.Generator().manual_seed(2)
    pairs = [p for p in PROMPTS if " and " in p][:64]
    first_only = [p.split(" and ")[0] for p in pairs]
    a, b, s = _scores(render(first_only, generator=g), pairs)  # one of two objects drawn
    assert 0.3 < a.mean() < 0.7 and 0.3 < b.mean() < 0.7 and s.mean() == 0
    a, b, s = _scores(render(pairs, generator=g), first_only)  # an extra object drawn
    assert 0.3 < a.mean() < 0.8 and 0.3 < b.mean() < 0.8 and s.mean() == 0


def test_rewards_reject_unknown_prompt():
    with pytest.raises(ValueError, match="not a toy-world prompt"):
        toy_color_position_reward(torch.zeros(1, 3, 32, 32), ["a photo of a cat"])


@pytest.mark.skipif(not os.path.exists(os.path.join(TOY, "model_index.json")), reason="toy pipeline not made yet")
def test_saved_pipeline_generates():
    from diffusers import FluxPipeline
    pipe = FluxPipeline.from_pretrained(TOY, local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    prompts = ["a red circle on the left", "a blue square at the top and a green triangle at the bottom", ""]
    out = pipe(prompts, height=32, width=32, num_inference_steps=4, max_sequence_length=16, output_type="pt",
               generator=torch.Generator().manual_seed(0))
    images = out.images
    assert images.shape == (3, 3, 32, 32) and torch.isfinite(images).all()
    assert 0 <= images.min() and images.max() <= 1 and images.std() > 0.05
    assert toy_color_position_reward(images[:2], prompts[:2]).shape == (2,)


@pytest.mark.skipif(not os.path.exists(os.path.join(TOY, "model_index.json")), reason="toy pipeline not made yet")
def test_saved_pipeline_leaves_headroom():
    """The base model gets colours and places mostly right but is far from solving the task."""
    from diffusers import FluxPipeline
    from make_toy import sample
    pipe = FluxPipeline.from_pretrained(TOY, local_files_only=True)
    prompts = toy_prompts(48, seed=77)
    a, b, strict = _scores(sample(pipe, prompts, list(range(48))), prompts)
    assert 0.4 < (a.mean() + b.mean()) / 2 < 0.8 and strict.mean() <= 0.65, (a.mean(), b.mean(), strict.mean())


@pytest.mark.slow
def test_maker_runs_end_to_end(tmp_path):
    out, png = tmp_path / "pipe", tmp_path / "samples.png"
    cmd = [sys.executable, os.path.join(ROOT, "toy", "make_toy.py"), "--out", str(out), "--vae-steps", "2",
           "--dit-steps", "2", "--batch-size", "4", "--vae-batch-size", "4", "--pool", "8", "--threads", "1",
           "--eval-prompts", "8", "--samples", str(png)]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    assert (out / "model_index.json").exists() and (out / "transformer" / "config.json").exists()
    assert "strict=" in run.stdout and png.stat().st_size > 1000


@pytest.mark.slow
def test_the_editing_maker_runs_end_to_end(tmp_path):
    """toy/make_edit_toy.py from the toy world's pipeline: a FluxKontextPipeline saved with save_pretrained that
    loads by path, its toy_world.json naming the editing world, its measurements and its sample grid."""
    import json

    from diffusers import FluxKontextPipeline
    out, png = tmp_path / "pipe", tmp_path / "samples.png"
    cmd = [sys.executable, os.path.join(ROOT, "toy", "make_edit_toy.py"), "--out", str(out), "--steps", "2",
           "--batch-size", "4", "--pool", "8", "--threads", "1", "--eval-num", "8", "--samples", str(png)]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert run.returncode == 0, run.stderr[-2000:]
    assert json.loads((out / "toy_world.json").read_text())["world"] == "edit"
    assert type(FluxKontextPipeline.from_pretrained(str(out))).__name__ == "FluxKontextPipeline"
    assert "strict=" in run.stdout and "preserve=" in run.stdout and png.stat().st_size > 1000
