"""Reward loading and scoring on tiny randomly initialised open_clip / transformers models (offline)."""
import gzip
import io
import json
import os
import pickle

import pytest
import torch
from PIL import Image

from common import hps_reward, jpeg_compressibility, load_rewards, load_safely, pickscore_reward, score

TINY_OPEN_CLIP = {"embed_dim": 16, "vision_cfg": {"image_size": 32, "layers": 1, "width": 32, "patch_size": 8,
                                                  "head_width": 16},
                  "text_cfg": {"context_length": 77, "vocab_size": 49408, "width": 32, "heads": 2, "layers": 1}}


def images(n=3, size=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(0, 256, (n, 3, size, size), generator=g) / 255.0).float()


def tiny_open_clip_dir(root, with_weights):
    import open_clip
    from safetensors.torch import save_file

    os.makedirs(root, exist_ok=True)
    with open(os.path.join(root, "open_clip_config.json"), "w") as f:
        json.dump({"model_cfg": TINY_OPEN_CLIP, "preprocess_cfg": {}}, f)
    model = open_clip.create_model(f"local-dir:{root}")
    if with_weights:
        save_file(model.state_dict(), os.path.join(root, "open_clip_model.safetensors"))
    return model


def manual_cosine(model, x, prompts, tokenizer):
    img = torch.nn.functional.normalize(model.encode_image(x).float(), dim=-1)
    txt = torch.nn.functional.normalize(model.encode_text(tokenizer(prompts)).float(), dim=-1)
    return (img * txt).sum(-1)


def test_jpeg_values_on_known_images():
    flat, noisy = torch.full((1, 3, 32, 32), 0.5), images(1)
    r = jpeg_compressibility(torch.cat([flat, noisy]), ["", ""])
    for k, img in enumerate([flat, noisy]):
        buf = io.BytesIO()
        Image.fromarray((img[0] * 255).round().byte().permute(1, 2, 0).numpy()).save(buf, format="JPEG", quality=95)
        assert r[k].item() == pytest.approx(-buf.tell() / 1000 / 500)
    assert r[0] > r[1]  # a flat image compresses better


def test_hps_strict_load_and_cosine(tmp_path):
    import open_clip
    from open_clip.constants import OPENAI_DATASET_MEAN, OPENAI_DATASET_STD

    arch = f"local-dir:{tmp_path / 'arch'}"
    model = tiny_open_clip_dir(str(tmp_path / "arch"), with_weights=False)
    torch.save({"state_dict": model.state_dict()}, tmp_path / "HPS_v2.1_compressed.pt")
    fn = hps_reward(str(tmp_path / "HPS_v2.1_compressed.pt"), "cpu", arch=arch)
    x, prompts = images(), ["a cat", "a dog", "a red circle"]
    mean, std = torch.tensor(OPENAI_DATASET_MEAN).view(1, 3, 1, 1), torch.tensor(OPENAI_DATASET_STD).view(1, 3, 1, 1)
    expected = manual_cosine(model.eval(), (x - mean) / std, prompts, open_clip.get_tokenizer(arch))
    torch.testing.assert_close(fn(x, prompts), expected, rtol=1e-4, atol=1e-5)
    bad = {"state_dict": {k: v for k, v in model.state_dict().items() if "visual" not in k}}
    torch.save(bad, tmp_path / "broken.pt")
    with pytest.raises(RuntimeError, match="Missing key"):  # strict: a wrong checkpoint is never half-loaded
        hps_reward(str(tmp_path / "broken.pt"), "cpu", arch=arch)


def test_clip_score_from_local_dir(tmp_path):
    import open_clip

    model = tiny_open_clip_dir(str(tmp_path / "clip"), with_weights=True)
    fn = load_rewards(["clip"], "cpu", clip_model=str(tmp_path / "clip"))["clip"]
    x, prompts = images(2, size=64), ["a cat", "a dog"]
    r = fn(x, prompts)
    assert r.shape == (2,) and (r.abs() <= 1).all()
    # 64 px -> shortest side to 32, centre crop, OpenAI normalisation; same model weights as saved
    from common import _clip_preprocess
    from open_clip.constants import OPENAI_DATASET_MEAN, OPENAI_DATASET_STD

    xp = _clip_preprocess(x, 32, OPENAI_DATASET_MEAN, OPENAI_DATASET_STD, False)
    torch.testing.assert_close(r, manual_cosine(model.eval(), xp, prompts, open_clip.get_tokenizer("ViT-H-14")),
                               rtol=1e-4, atol=1e-5)


def clip_tokenizer_dir(root):
    """A transformers CLIPTokenizer built offline from open_clip's BPE vocabulary (ids match open_clip's)."""
    import open_clip
    from open_clip.tokenizer import bytes_to_unicode
    from transformers import CLIPTokenizer

    path = os.path.join(os.path.dirname(open_clip.__file__), "bpe_simple_vocab_16e6.txt.gz")
    merges = gzip.open(path).read().decode("utf-8").split("\n")[1:49152 - 256 - 2 + 1]
    merges = [tuple(m.split()) for m in merges]
    vocab = list(bytes_to_unicode().values())
    vocab = vocab + [v + "</w>" for v in vocab] + ["".join(m) for m in merges] + ["<|startoftext|>", "<|endoftext|>"]
    os.makedirs(root, exist_ok=True)
    with open(os.path.join(root, "vocab.json"), "w") as f:
        json.dump({v: i for i, v in enumerate(vocab)}, f)
    with open(os.path.join(root, "merges.txt"), "w") as f:
        f.write("#version: 0.2\n" + "\n".join(" ".join(m) for m in merges))
    return CLIPTokenizer(os.path.join(root, "vocab.json"), os.path.join(root, "merges.txt"), model_max_length=77)


def test_pickscore_matches_processor_and_formula(tmp_path):
    from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel, CLIPProcessor

    torch.manual_seed(0)
    cfg = CLIPConfig(text_config=dict(vocab_size=49408, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=2, max_position_embeddings=77),
                     vision_config=dict(image_size=32, patch_size=8, hidden_size=32, intermediate_size=64,
                                        num_hidden_layers=1, num_attention_heads=2), projection_dim=16)
    CLIPModel(cfg).save_pretrained(tmp_path / "model")
    processor = CLIPProcessor(image_processor=CLIPImageProcessor(size={"shortest_edge": 32},
                                                                 crop_size={"height": 32, "width": 32}),
                              tokenizer=clip_tokenizer_dir(str(tmp_path / "tok")))
    processor.save_pretrained(tmp_path / "processor")
    fn = pickscore_reward(str(tmp_path / "model"), str(tmp_path / "processor"), "cpu")
    x, prompts = images(), ["a cat", "a dog on the left", "a photo"]
    model = CLIPModel.from_pretrained(tmp_path / "model").eval()
    pil = [Image.fromarray((im * 255).round().byte().permute(1, 2, 0).numpy()) for im in x]
    inputs = processor(text=prompts, images=pil, padding="max_length", max_length=77, truncation=True,
                       return_tensors="pt")
    with torch.no_grad():
        out = model(**inputs)
        img = torch.nn.functional.normalize(out.image_embeds, dim=-1)
        txt = torch.nn.functional.normalize(out.text_embeds, dim=-1)
    expected = model.logit_scale.exp() * (img * txt).sum(-1) / 26
    torch.testing.assert_close(fn(x, prompts), expected, rtol=1e-4, atol=1e-4)


def test_pickle_checkpoints_cannot_run_code(tmp_path):
    class Exploit:
        def __reduce__(self):
            return (os.system, (f"touch {tmp_path / 'pwned'}",))

    with open(tmp_path / "evil.pt", "wb") as f:
        pickle.dump({"state_dict": Exploit()}, f)
    with pytest.raises(pickle.UnpicklingError):
        load_safely(str(tmp_path / "evil.pt"))
    assert not (tmp_path / "pwned").exists()


def test_non_finite_reward_is_an_error():
    with pytest.raises(SystemExit, match="reward 'nan' returned non-finite values"):
        score({"nan": lambda im, p: torch.tensor([0.0, float("nan")])}, images(2), ["a", "b"])


def test_rewards_in_bf16_stay_close_to_float32(tmp_path):
    """On GPUs the reward models run in bf16 (half the memory: 2 GiB instead of 4 for a ViT-H-14); their scores stay
    within 0.01 of float32 here (cosines in [-1, 1]; measured max |diff| 5.4e-3 on these tiny random models)."""
    tiny_open_clip_dir(str(tmp_path / "clip"), with_weights=True)
    x, prompts = images(4, size=64, seed=3), ["a cat", "a dog", "a red circle on the left", "a photo"]
    fp32, bf16 = (load_rewards(["clip", "jpeg"], "cpu", clip_model=str(tmp_path / "clip"), dtype=d) for d in
                  (torch.float32, torch.bfloat16))
    diff = (fp32["clip"](x, prompts) - bf16["clip"](x, prompts)).abs().max().item()
    assert 0 < diff < 0.01, diff  # bf16 really ran, and stayed close
    assert bf16["clip"](x, prompts).dtype == torch.float32 and torch.equal(fp32["jpeg"](x, prompts), bf16["jpeg"](x, prompts))
