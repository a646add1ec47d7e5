"""What a run that scores rewards it does not train on logs at each evaluation (rundir.over_rating_metrics: the
over-rating with its paired SE, the drift from the base model) and says at its end (rundir.over_rating_lines)."""
import argparse
import json
import math
import os

import pytest
import torch

from helpers import read_metrics, run_script, tiny_flags
from rundir import over_rating, over_rating_lines, over_rating_metrics, thumbnails


def test_the_over_rating_is_the_trained_gain_minus_the_held_out_gain_per_pair():
    """Two training rewards weighted 3:1 and a held-out one over four pairs, written out by hand."""
    base = {"a": [0.1, 0.2, 0.3, 0.4], "b": [0.5, 0.5, 0.5, 0.5], "h": [0.2, 0.2, 0.2, 0.2]}
    now = {"a": [0.3, 0.2, 0.7, 0.4], "b": [0.9, 0.5, 0.5, 0.1], "h": [0.2, 0.3, 0.2, 0.4]}
    per_pair = [(3 * (na - ba) + (nb - bb)) / 4 - (nh - bh) for na, ba, nb, bb, nh, bh in
                zip(now["a"], base["a"], now["b"], base["b"], now["h"], base["h"])]  # 0.25, -0.1, 0.3, -0.3
    mean = sum(per_pair) / 4
    se = math.sqrt(sum((x - mean) ** 2 for x in per_pair) / 3 / 4)
    assert over_rating(base, now, "h", weights={"a": 3.0, "b": 1.0}) == pytest.approx((mean, se))


def test_the_drift_is_the_rms_difference_of_the_thumbnails(tmp_path):
    """At the base evaluation the thumbnails are kept; later, each pair's RMS difference to them (in [0, 1]) is
    the drift: an image that moved by 0.2 everywhere and one that did not move give 0.1 +- 0.1."""
    images = torch.full((2, 3, 64, 64), 0.4)
    small = thumbnails(images)
    assert small.shape == (2, 3, 32, 32) and small.dtype == torch.uint8 and (small == 102).all()
    assert thumbnails(torch.rand(2, 5, 3, 16, 16)).shape == (2, 5, 3, 32, 32)  # frames: each frame
    scores = {"a": torch.tensor([0.5, 0.5]), "h": torch.tensor([0.5, 0.5])}
    (tmp_path / "eval_0.json").write_text(json.dumps({k: v.tolist() for k, v in scores.items()}))
    assert over_rating_metrics(str(tmp_path), 0, scores, small, held=["h"], weights={"a": 1.0}) == {}
    assert torch.equal(torch.load(tmp_path / "drift_base.pt"), small)
    moved = thumbnails(torch.stack([torch.full((3, 64, 64), 0.6), torch.full((3, 64, 64), 0.4)]))
    later = {"a": torch.tensor([0.7, 0.5]), "h": torch.tensor([0.5, 0.6])}
    m = over_rating_metrics(str(tmp_path), 5, later, moved, held=["h"], weights={"a": 1.0})
    assert m["eval/drift"] == pytest.approx((153 - 102) / 255 / 2) and m["eval/drift_se"] == pytest.approx(0.1)
    assert (m["eval/over_rating/h"], m["eval/over_rating/h_se"]) == pytest.approx((0.05, 0.15))


def test_the_summary_says_when_the_over_rating_exceeds_2_se_and_where_to_stop(tmp_path):
    """Evaluations at 0, 5, 10: the trained reward keeps rising, the held-out one rises to iteration 5 and falls
    back; the over-rating exceeds 2 paired SE at 5 and 10, the checkpoint to keep is iter_5."""
    noise = torch.Generator().manual_seed(0)
    evals = {0: (0.5, 0.5), 5: (0.7, 0.55), 10: (0.9, 0.45)}  # (trained, held-out) means
    for i, (t, h) in evals.items():
        r, held = t + 0.05 * torch.randn(16, generator=noise), h + 0.05 * torch.randn(16, generator=noise)
        (tmp_path / f"eval_{i}.json").write_text(json.dumps({"r": r.tolist(), "h": held.tolist()}))
    os.makedirs(tmp_path / "checkpoints" / "iter_5")
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"iteration": 10, "eval/drift": 0.0312, "eval/drift_se": 0.0021})
                                            + "\n")
    args = argparse.Namespace(rewards=("r",), eval_rewards=("r", "h"))
    lines = over_rating_lines(str(tmp_path), [0, 5, 10], args=args, weights={"r": 1.0})
    d, se = over_rating(json.load(open(tmp_path / "eval_0.json")), json.load(open(tmp_path / "eval_10.json")), "h",
                        weights={"r": 1.0})
    peak = sum(json.load(open(tmp_path / "eval_5.json"))["h"]) / 16
    assert lines[0] == (f"  over-rating (training reward's gain minus h's): exceeds 2 paired SE at iterations 5, 10 "
                        f"({d:+.4f} +- {se:.4f} at 10); h peaked at iteration 5 ({peak:.4f}), the checkpoint to "
                        f"keep: checkpoints/iter_5")
    assert lines[1] == ("  drift from the base model (RMS difference of the pairs' images, 32 x 32, in [0, 1]): "
                        "0.0312 +- 0.0021 at iteration 10")
    assert over_rating_lines(str(tmp_path), [0, 5, 10], args=argparse.Namespace(rewards=("r",), eval_rewards=("r",)),
                             weights={"r": 1.0}) == []  # nothing held out: nothing to say


def test_a_run_logs_the_over_rating_and_the_drift_at_each_evaluation(tiny, tmp_path):
    """Two iterations of flow_grpo.py (full fine-tuning, a large step) trained on jpeg and scored on
    toy_color_position too: each evaluation after the base one logs the over-rating against toy_color_position
    (equal to the one from its eval files) and the drift; the summary says both."""
    prompts = tmp_path / "toy.txt"
    prompts.write_text("a red circle on the left\na blue square on the top\n")
    out = run_script("flow_grpo.py", tiny_flags(tiny["flux"], str(prompts), tmp_path / "run", eval_every=1,
                                                eval_rewards="jpeg toy_color_position", log_images_every=0,
                                                full_finetune=True, no_ema=True, learning_rate=1e-3)).stdout
    run, m = read_metrics(tmp_path / "run")
    assert "eval/over_rating/toy_color_position" not in m[0] and "eval/drift" not in m[0]
    e = {i: json.load(open(os.path.join(run, f"eval_{i}.json"))) for i in (0, 1, 2)}
    for i in (1, 2):
        gain = [(b - a) - (d - c) for a, b, c, d in zip(e[0]["jpeg"], e[i]["jpeg"], e[0]["toy_color_position"],
                                                        e[i]["toy_color_position"])]
        mean = sum(gain) / len(gain)
        assert m[i]["eval/over_rating/toy_color_position"] == pytest.approx(mean, abs=1e-6)
        se = math.sqrt(sum((g - mean) ** 2 for g in gain) / (len(gain) - 1) / len(gain))
        assert m[i]["eval/over_rating/toy_color_position_se"] == pytest.approx(se, abs=1e-6)
    assert m[2]["eval/drift"] > 0 and m[2]["eval/drift_se"] > 0  # the weights moved, and so did the images
    assert torch.load(os.path.join(run, "drift_base.pt")).shape == (4, 3, 32, 32)
    assert "over-rating (training reward's gain minus toy_color_position's): " in out
    assert "the checkpoint to keep: " in out and "drift from the base model" in out
