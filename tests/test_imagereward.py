"""ImageReward on transformers' BLIP modules (rewards.imagereward_reward) against THUDM's ORIGINAL code.

The golden vectors in tests/data/imagereward/ were made by tests/data/imagereward/make_golden.py with the
PyPI package image-reward 1.5 (transformers 4.44.2, timm 0.6.13, torch 2.14.1, torchvision 0.29.1, pillow
13.0.0, fairscale 0.4.13: golden.json["versions"]), in a side venv that holds the original package and
nothing of this project:
    python -m venv /work/scratch/irvenv
    /work/scratch/irvenv/bin/pip install image-reward==1.5 transformers==4.44.2 timm==0.6.13 fairscale \\
        torch==2.14.1 torchvision==0.29.1 "huggingface_hub<0.25" clip-anytorch
    /work/scratch/irvenv/bin/pip install "setuptools<70"  # clip needs pkg_resources
    /work/scratch/irvenv/bin/python tests/data/imagereward/make_golden.py [OUT_DIR]
(a rerun writes bitwise the same files; scores within ~1e-6 on another CPU). The model is SMALL and
RANDOM-INITIALISED (seeded O(1) weights), built from the package's own classes at small sizes but at
ImageReward's own image size 224: BLIP ViT of width 128 (2 heads of 64 as in ViT-L, 2 blocks, MLP 256, patch
16: 197 tokens), BERT with cross-attention of hidden 32 (2 heads of 16, 2 layers, med_config.json), MLP(32)
-> 1024-128-64-16-1, a 36-entry vocab.txt plus the [DEC] / [ENC] tokens BLIP adds. ImageReward.pt (2.5 MB)
is `torch.save(model.state_dict())` with the original key names (the unused vision_proj / text_proj, 16 wide
here, and position_ids included). golden.json holds, for 7 images x 6 prompts: the original
`ImageReward.score(prompt, pil_image)`, one pair per call (`scores_pil`); the same model after the original
torchvision transforms applied to the float tensor instead of PIL (`scores_tensor`); the original
tokenizer's ids. Images 0-3 are at the native 224x224 (3 is pure noise); 300x256, 227x320 and 384x512 are
resized by the shorter side (262x224, 224x315, 224x298) and centre-cropped (offsets 19 rows, round(45.5) =
46 and 37 columns). Prompts: a 42-piece one that the original truncates at 35 tokens in the middle of
"circle ##s", unknown words, case and punctuation, an empty one. bf16 towers against float32 on this model:
tests/test_rewards.py.
"""
import json
import os

import numpy as np
import pytest
import torch
from PIL import Image

from rewards import imagereward_reward

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "imagereward")
NATIVE = 4  # images 0..3 are 224x224; 4 (300x256), 5 (227x320) and 6 (384x512) are resized and cropped


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One torch thread here: on these tiny models a second one only spin-waits, and when the CPUs are busy
    that makes the forwards 100x slower (the scores are the same to 1e-6); restored afterwards."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def golden():
    with open(os.path.join(DATA, "golden.json")) as f:
        g = json.load(f)
    pixels = [np.array(Image.open(os.path.join(DATA, name))) for name in g["images"]]
    g["pixels"] = [torch.from_numpy(p).permute(2, 0, 1).float() / 255 for p in pixels]
    return g


def reward(dtype=torch.float32):
    files = os.path.join(DATA, "ImageReward.pt"), os.path.join(DATA, "med_config.json")
    return imagereward_reward(*files, DATA, "cpu", dtype=dtype)


@pytest.fixture(scope="module")
def fp32():
    return reward()


def grid(fn, g):
    """[image, prompt] scores: each image with all the prompts, in one batch of different prompts."""
    n = len(g["prompts"])
    return torch.stack([fn(x[None].expand(n, -1, -1, -1), g["prompts"]) for x in g["pixels"]])


def test_tokenizer_is_the_originals(fp32, golden):
    """Padded to and truncated at 35, [CLS] first (not [ENC]), unknown words -> [UNK], [DEC] / [ENC] added."""
    ids = fp32.tokenize(golden["prompts"] + golden["tokenized_only"]).input_ids
    assert ids.tolist() == golden["input_ids"]
    assert (ids[:, 0] == golden["special_tokens"]["[CLS]"]).all()


def test_scores_match_the_original(fp32, golden):
    """Every (image, prompt) score equals the original's: to 1e-5 where no resize happens or the original's
    transforms ran on the float tensor, to 5e-3 against the official PIL path on the resized images."""
    r = grid(fp32, golden)
    assert r.dtype == torch.float32 and r.shape == (7, 6)
    pil, tensor = torch.tensor(golden["scores_pil"]), torch.tensor(golden["scores_tensor"])
    assert pil.max() - pil.min() > 1 and pil.std(0).min() > 0.05  # scores depend on both image and prompt
    # native size: no resize on either side; equal up to float32 summation order (measured 1.1e-6). One ViT
    # head of 128 instead of 2 of 64 would move these scores by 0.13, one BERT head instead of 2 by 0.51
    torch.testing.assert_close(r[:NATIVE], pil[:NATIVE], rtol=0, atol=1e-5)
    # resized: the original's torchvision transforms on the float tensor (torch bicubic + antialias, clamped
    # as PIL's uint8), the same size rule (227x320 -> 224x315, not 316) and crop rounding (round(45.5) = 46)
    # (measured 1.3e-6); rounding the size instead of truncating it, or flooring the crop offset, would move
    # scores by 1.1e-2, no antialias by 1.4e-2 (measured)
    torch.testing.assert_close(r[NATIVE:], tensor[NATIVE:], rtol=0, atol=1e-5)
    # the official PIL path: PIL's fixed-point bicubic on uint8 differs from torch's float bicubic, moving
    # scores by up to 1.1e-3 (measured)
    torch.testing.assert_close(r[NATIVE:], pil[NATIVE:], rtol=0, atol=5e-3)


def test_batched_equals_one_at_a_time(fp32, golden):
    """Different prompts (short, long, empty) per row in one forward with padding masks. Not bitwise: MKL's
    float32 GEMMs take other paths for 1 row than for 6 (the head alone differs by 9e-7, as much as its
    float32 vs float64 error); measured 7.5e-7, while ignoring the padding mask moves these scores by up to
    1.5."""
    rows = [0, 1, 2, 3, 0, 1]
    x = torch.stack([golden["pixels"][i] for i in rows])
    batched = fp32(x, golden["prompts"])
    single = torch.cat([fp32(x[i:i + 1], golden["prompts"][i:i + 1]) for i in range(6)])
    torch.testing.assert_close(batched, single, rtol=0, atol=5e-6)
    expected = torch.tensor([golden["scores_pil"][i][j] for j, i in enumerate(rows)])
    torch.testing.assert_close(batched, expected, rtol=0, atol=1e-5)


def test_long_prompt_is_truncated_as_the_original(fp32, golden):
    """A prompt of 42 word pieces ends in [SEP] at 35 like the original's, cut inside "circle ##s" as the
    original cuts it, words past it change nothing, and its score is the original's (measured <= 1.1e-6;
    truncating at 34 or 36 tokens would move it by 0.022 or 0.036, not truncating by 0.19)."""
    long = golden["prompts"][4]
    ids = fp32.tokenize([long]).input_ids[0]
    assert len(ids) == 35 and ids[-1] == golden["special_tokens"]["[SEP]"]
    assert ids.tolist() == golden["input_ids"][4]
    with open(os.path.join(DATA, "vocab.txt")) as f:
        vocab = f.read().split("\n")
    assert vocab[ids[-2]] == "circle"  # of "two red circles": its "##s" would be the 36th token
    longer = long + " and many more words that the original never reads"
    assert fp32.tokenize([longer]).input_ids.tolist() == [ids.tolist()]
    x = golden["pixels"][0][None]
    assert fp32(x, [long]).item() == fp32(x, [longer]).item()  # the same inputs: bitwise the same score
    assert abs(fp32(x, [long]).item() - golden["scores_pil"][0][4]) < 1e-5


def test_golden_data_covers_heads_resizing_and_truncation(golden):
    """The golden model has >= 2 heads in both towers at ImageReward's 224 px, non-square images larger than
    224 px on both sides (so the original's Resize + CenterCrop really runs) and a prompt over 35 tokens."""
    with open(os.path.join(DATA, "med_config.json")) as f:
        med = json.load(f)
    assert golden["image_size"] == 224 and golden["vision"]["heads"] >= 2 and med["num_attention_heads"] >= 2
    assert golden["vision"]["width"] // 64 == golden["vision"]["heads"]  # ViT-L's 64-wide heads
    sizes = [tuple(x.shape[1:]) for x in golden["pixels"]]
    assert sizes[:NATIVE] == [(224, 224)] * NATIVE
    assert sum(h != w and min(h, w) > 224 for h, w in sizes[NATIVE:]) >= 2
    assert sum(i != 0 for i in golden["input_ids"][4]) == 35


@pytest.mark.parametrize("which,flag", [(0, "--imagereward-checkpoint"), (1, "--imagereward-med-config"),
                                        (2, "--imagereward-tokenizer")])
def test_missing_files_give_one_line_errors(tmp_path, which, flag):
    """A missing checkpoint, med_config or tokenizer is a one-line error naming the path and its flag."""
    args = [os.path.join(DATA, "ImageReward.pt"), os.path.join(DATA, "med_config.json"), DATA]
    args[which] = str(tmp_path / "missing" / ["ImageReward.pt", "med_config.json", "tokenizer"][which])
    with pytest.raises(SystemExit) as e:
        imagereward_reward(*args, "cpu")
    message = str(e.value)
    assert message.startswith("error: ") and "\n" not in message
    assert args[which] in message and flag in message


def test_wrong_checkpoints_are_never_half_loaded(tmp_path):
    """A checkpoint missing keys fails the strict load; one with keys ImageReward does not have (here a
    momentum encoder's) is a one-line error naming them."""
    state = torch.load(os.path.join(DATA, "ImageReward.pt"), map_location="cpu", weights_only=True)
    cfg = os.path.join(DATA, "med_config.json")
    torch.save({k: v for k, v in state.items() if "crossattention.self.key" not in k}, tmp_path / "short.pt")
    with pytest.raises(SystemExit, match="does not fit the model: [0-9]+ missing keys"):
        imagereward_reward(str(tmp_path / "short.pt"), cfg, DATA, "cpu")
    torch.save(dict(state, **{"blip.visual_encoder_m.cls_token": state["blip.visual_encoder.cls_token"]}),
               tmp_path / "foreign.pt")
    with pytest.raises(SystemExit, match="not ImageReward's .blip.visual_encoder_m.cls_token"):
        imagereward_reward(str(tmp_path / "foreign.pt"), cfg, DATA, "cpu")
