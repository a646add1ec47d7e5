"""The toy world's learned proxy reward: the maker is reproducible, the committed weights load and score, they
agree with the exact reward on held-out samples, and missing weights stop in one line."""
import json
import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "toy"))
import proxy  # noqa: E402
from world import toy_prompts  # noqa: E402

TOY = os.path.join(ROOT, "toy", "flux-shapes")
ABOUT = os.path.join(ROOT, "toy", "proxy", "proxy.json")
MAKE = os.path.join(ROOT, "toy", "make_proxy.py")


def _make(out):
    cmd = [sys.executable, MAKE, "--out", str(out), "--train-images", "24", "--heldout-images", "12", "--steps", "6",
           "--batch-size", "16", "--threads", "1"]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    from safetensors.torch import load_file
    return load_file(os.path.join(out, "proxy.safetensors")), json.load(open(os.path.join(out, "proxy.json")))


@pytest.mark.skipif(not os.path.exists(os.path.join(TOY, "model_index.json")), reason="toy pipeline not made yet")
def test_maker_is_reproducible(tmp_path):
    """A tiny version of the maker (24 samples, 6 steps), twice: the same weights and the same agreement."""
    (w1, a1), (w2, a2) = _make(tmp_path / "a"), _make(tmp_path / "b")
    assert w1.keys() == w2.keys() and all(torch.equal(w1[k], w2[k]) for k in w1)
    assert a1["heldout_agreement"] == a2["heldout_agreement"] and a1["parameters"] == a2["parameters"]
    net = proxy.ProxyNet(**a1["architecture"])
    net.load_state_dict(w1)  # the saved weights fit the architecture the json names


def test_committed_weights_load_and_score():
    about = json.load(open(ABOUT))
    assert 1e5 <= about["bytes"] <= 1.5e6 and os.path.getsize(proxy.WEIGHTS) == about["bytes"]
    prompts = toy_prompts(5, seed=3)
    images = torch.rand(5, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    r = proxy.toy_proxy_reward(images, prompts)
    assert r.shape == (5,) and r.dtype == torch.float32 and torch.isfinite(r).all()
    assert 0 <= r.min() and r.max() <= 1
    big = torch.nn.functional.interpolate(images, size=64, mode="nearest")
    assert proxy.toy_proxy_reward(big, prompts).shape == (5,)  # other sizes are resized to 32x32
    import common  # the reward as every file and evaluate.py load it (--rewards / --metrics toy_proxy)
    fn = common.load_rewards(["toy_proxy"], "cpu", models=common.RewardModels())["toy_proxy"]
    assert torch.allclose(fn(images, prompts), r)
    with pytest.raises(ValueError, match="not a toy-world prompt"):
        proxy.toy_proxy_reward(images[:1], ["a photo of a cat"])


@pytest.mark.skipif(not os.path.exists(os.path.join(TOY, "model_index.json")), reason="toy pipeline not made yet")
def test_committed_weights_agree_on_held_out_samples():
    """96 base-model samples (ODE and SDE) of prompts and noise the maker never used: the proxy tracks the exact
    training reward (Pearson >= 0.8; the maker's 1024 held-out images: proxy.json)."""
    from common import load_pipeline
    from make_proxy import agreement, gold, sample
    pipe, kind = load_pipeline("toy", "cpu")
    prompts = toy_prompts(96, seed=777)
    images = sample(pipe, kind, prompts, list(range(9_000_000, 9_000_096)), [0.0, 0.7, 1.4] * 32)
    a = agreement(proxy.toy_proxy_reward(images, prompts), gold(images, prompts))
    assert a["pearson"] >= 0.8 and a["spearman"] >= 0.75 and a["mse"] <= 0.03, a


def test_missing_weights_is_one_line(tmp_path):
    with pytest.raises(SystemExit) as e:
        proxy.load_proxy(str(tmp_path / "proxy.safetensors"))
    assert str(e.value).startswith("error: ") and "\n" not in str(e.value) and "make_proxy.py" in str(e.value)
