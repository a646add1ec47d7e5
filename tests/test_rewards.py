"""Reward loading and scoring (rewards.py, common.load_rewards / check_rewards / score) on tiny randomly
initialised open_clip / transformers models and the tiny golden ImageReward of tests/data/imagereward
(offline)."""
import gzip
import io
import json
import os
import pickle
import subprocess
import sys
from collections import OrderedDict

import numpy as np
import pytest
import torch
from PIL import Image

import rewards
from common import RewardModels, jpeg_compressibility, load_rewards, score
from rewards import load_safely

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
IMAGEREWARD = os.path.join(ROOT, "tests", "data", "imagereward")
TINY_OPEN_CLIP = {"embed_dim": 16,
                  "vision_cfg": {"image_size": 32, "layers": 1, "width": 32, "patch_size": 8,
                                 "head_width": 16},
                  "text_cfg": {"context_length": 77, "vocab_size": 49408, "width": 32, "heads": 2,
                               "layers": 1}}
PICKSCORE_LOGIT_SCALE = 4.6052  # PickScore_v1's (exp: 100.0); bf16 would round it to 4.59375 (exp: 98.87)


def images(n=3, size=32, seed=0, width=None):
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(0, 256, (n, 3, size, width or size), generator=g) / 255.0).float()


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


def clip_tokenizer_dir(root):
    """A transformers CLIPTokenizer built offline from open_clip's BPE vocabulary (ids match open_clip's)."""
    import open_clip
    from open_clip.tokenizer import bytes_to_unicode
    from transformers import CLIPTokenizer

    path = os.path.join(os.path.dirname(open_clip.__file__), "bpe_simple_vocab_16e6.txt.gz")
    merges = gzip.open(path).read().decode("utf-8").split("\n")[1:49152 - 256 - 2 + 1]
    merges = [tuple(m.split()) for m in merges]
    vocab = list(bytes_to_unicode().values())
    vocab = vocab + [v + "</w>" for v in vocab] + ["".join(m) for m in merges]
    vocab += ["<|startoftext|>", "<|endoftext|>"]
    os.makedirs(root, exist_ok=True)
    with open(os.path.join(root, "vocab.json"), "w") as f:
        json.dump({v: i for i, v in enumerate(vocab)}, f)
    with open(os.path.join(root, "merges.txt"), "w") as f:
        f.write("#version: 0.2\n" + "\n".join(" ".join(m) for m in merges))
    return CLIPTokenizer(os.path.join(root, "vocab.json"), os.path.join(root, "merges.txt"),
                         model_max_length=77)


def tiny_clip_model(root, logit_scale=None, seed=0):
    """A tiny random transformers CLIPModel (32 px, projection 16) saved under root; logit_scale if given."""
    from transformers import CLIPConfig, CLIPModel

    torch.manual_seed(seed)
    cfg = CLIPConfig(text_config=dict(vocab_size=49408, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=1, num_attention_heads=2, max_position_embeddings=77),
                     vision_config=dict(image_size=32, patch_size=8, hidden_size=32, intermediate_size=64,
                                        num_hidden_layers=1, num_attention_heads=2), projection_dim=16)
    model = CLIPModel(cfg)
    if logit_scale is not None:
        model.logit_scale.data.fill_(logit_scale)
    model.save_pretrained(root)
    return str(root)


def tiny_clip_processor(root, tokenizer_root):
    from transformers import CLIPImageProcessor, CLIPProcessor

    processor = CLIPProcessor(image_processor=CLIPImageProcessor(size={"shortest_edge": 32},
                                                                 crop_size={"height": 32, "width": 32}),
                              tokenizer=clip_tokenizer_dir(str(tokenizer_root)))
    processor.save_pretrained(root)
    return processor


def aesthetic_head_file(path, dim=16, seed=0):
    """A random head in the official file's format: a plain state_dict with the keys
    layers.{0,2,4,6,7}.{weight,bias}."""
    g = torch.Generator().manual_seed(seed)
    state = OrderedDict()
    for i, (out, inp) in zip((0, 2, 4, 6, 7), [(1024, dim), (128, 1024), (64, 128), (16, 64), (1, 16)]):
        state[f"layers.{i}.weight"] = torch.randn(out, inp, generator=g) / inp ** 0.5
        state[f"layers.{i}.bias"] = torch.randn(out, generator=g) * 0.1
    torch.save(state, path)
    return str(path)


def test_jpeg_values_on_known_images():
    """-(JPEG quality-95 size in kB) / 500 of each image, and a flat image scores above a noisy one."""
    flat, noisy = torch.full((1, 3, 32, 32), 0.5), images(1)
    r = jpeg_compressibility(torch.cat([flat, noisy]), ["", ""])
    for k, img in enumerate([flat, noisy]):
        buf = io.BytesIO()
        pixels = (img[0] * 255).round().byte().permute(1, 2, 0).numpy()
        Image.fromarray(pixels).save(buf, format="JPEG", quality=95)
        assert r[k].item() == pytest.approx(-buf.tell() / 1000 / 500)
    assert r[0] > r[1]  # a flat image compresses better


def test_hps_strict_load_and_cosine(tmp_path):
    """HPS: a checkpoint loaded strictly onto the architecture gives the plain cosine of the saved model; a
    checkpoint missing keys is refused, never half-loaded."""
    import open_clip
    from open_clip.constants import OPENAI_DATASET_MEAN, OPENAI_DATASET_STD

    arch = str(tmp_path / "arch")
    model = tiny_open_clip_dir(arch, with_weights=False)
    torch.save({"state_dict": model.state_dict()}, tmp_path / "HPS_v2.1_compressed.pt")
    fn = rewards.open_clip_reward(arch, "cpu", str(tmp_path / "HPS_v2.1_compressed.pt"), pad_square=True)
    x, prompts = images(), ["a cat", "a dog", "a red circle"]
    mean = torch.tensor(OPENAI_DATASET_MEAN).view(1, 3, 1, 1)
    std = torch.tensor(OPENAI_DATASET_STD).view(1, 3, 1, 1)
    tokenizer = open_clip.get_tokenizer(f"local-dir:{arch}")
    expected = manual_cosine(model.eval(), (x - mean) / std, prompts, tokenizer)
    torch.testing.assert_close(fn(x, prompts), expected, rtol=1e-4, atol=1e-5)
    bad = {"state_dict": {k: v for k, v in model.state_dict().items() if "visual" not in k}}
    torch.save(bad, tmp_path / "broken.pt")
    with pytest.raises(SystemExit, match="does not fit the model: [0-9]+ missing keys"):  # never half-loaded
        rewards.open_clip_reward(arch, "cpu", str(tmp_path / "broken.pt"), pad_square=True)


def test_clip_score_from_local_dir(tmp_path):
    """CLIP score from a local open_clip directory through load_rewards: the cosine of the saved weights after
    shortest-side resize, centre crop and OpenAI normalisation."""
    import open_clip
    from open_clip.constants import OPENAI_DATASET_MEAN, OPENAI_DATASET_STD

    model = tiny_open_clip_dir(str(tmp_path / "clip"), with_weights=True)
    fn = load_rewards(["clip"], "cpu", models=RewardModels(clip_model=str(tmp_path / "clip")))["clip"]
    x, prompts = images(2, size=64), ["a cat", "a dog"]
    r = fn(x, prompts)
    assert r.shape == (2,) and (r.abs() <= 1).all()
    # 64 px -> shortest side to 32, centre crop, OpenAI normalisation; same model weights as saved
    xp = rewards._clip_preprocess(x, 32, OPENAI_DATASET_MEAN, OPENAI_DATASET_STD, pad_square=False)
    expected = manual_cosine(model.eval(), xp, prompts, open_clip.get_tokenizer("ViT-H-14"))
    torch.testing.assert_close(r, expected, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("width", [32, 35])
def test_pickscore_matches_processor_and_formula(tmp_path, width):
    """PickScore = logit_scale.exp() cos / 26 with the inputs CLIPProcessor makes from the PIL images, square
    and 32 x 35 (a 3-pixel margin: CLIPImageProcessor floors the crop offset)."""
    from transformers import CLIPModel

    tiny_clip_model(tmp_path / "model")
    processor = tiny_clip_processor(tmp_path / "processor", tmp_path / "tok")
    fn = rewards.pickscore_reward(str(tmp_path / "model"), str(tmp_path / "processor"), "cpu")
    x, prompts = images(width=width), ["a cat", "a dog on the left", "a photo"]
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


def smooth_image(h, w, seed):
    """A [1, 3, h, w] image of 8-bit values varying smoothly (as photographs do), for comparing resizes."""
    base = torch.rand(1, 3, 6, 6, generator=torch.Generator().manual_seed(seed))
    return (torch.nn.functional.interpolate(base, size=(h, w), mode="bilinear") * 255).round() / 255


@pytest.mark.parametrize("h, w", [(227, 224), (224, 231), (260, 256), (256, 360)])
def test_clip_preprocessing_crops_like_the_processors(h, w):
    """PickScore and the aesthetic predictor crop as transformers' CLIPImageProcessor (the offset floored), the
    CLIP score and ImageReward as torchvision's CenterCrop (rounded), on non-square sizes whose margins round
    differently (3, 7; after the resize 3 and 91 pixels). Without a resize (one side 224) both are exact on noise;
    with one, torch's antialiased bicubic and PIL's differ a little on a smooth image (measured 0.016 in normalised
    units), while the other offset rule is off by > 0.05."""
    from torchvision import transforms
    from transformers import CLIPImageProcessor

    x = images(1, size=h, width=w, seed=h + w) if min(h, w) == 224 else smooth_image(h, w, h + w)
    pil = Image.fromarray((x[0] * 255).round().byte().permute(1, 2, 0).numpy())
    ip = CLIPImageProcessor()  # shortest edge 224, crop 224, the OpenAI mean / std
    processor = ip(images=pil, return_tensors="pt").pixel_values
    floor = rewards._clip_preprocess(x, 224, ip.image_mean, ip.image_std, pad_square=False, crop_offset="floor")
    rounded = rewards._clip_preprocess(x, 224, ip.image_mean, ip.image_std, pad_square=False)
    bicubic = transforms.InterpolationMode.BICUBIC
    tv = transforms.Compose([transforms.Resize(224, interpolation=bicubic, antialias=True),
                             transforms.CenterCrop(224), transforms.Normalize(ip.image_mean, ip.image_std)])
    torch.testing.assert_close(rounded, tv(x), rtol=0, atol=1e-5)
    tolerance = 1e-5 if min(h, w) == 224 else 0.03
    assert (floor - processor).abs().max() < tolerance
    assert (rounded - processor).abs().max() > 0.05


def test_pickle_checkpoints_cannot_run_code(tmp_path):
    """load_safely refuses a pickle that would run a command, and the command never runs."""
    class Exploit:
        def __reduce__(self):
            return (os.system, (f"touch {tmp_path / 'pwned'}",))

    with open(tmp_path / "evil.pt", "wb") as f:
        pickle.dump({"state_dict": Exploit()}, f)
    with pytest.raises(SystemExit, match=r"weights '.*evil.pt' cannot be read \(UnpicklingError: "):
        load_safely(str(tmp_path / "evil.pt"))
    assert not (tmp_path / "pwned").exists()


def test_non_finite_reward_is_an_error():
    """A NaN reward stops scoring with an error naming the reward."""
    with pytest.raises(SystemExit, match="reward 'nan' returned non-finite values"):
        score({"nan": lambda im, p: torch.tensor([0.0, float("nan")])}, images(2), ["a", "b"])


def test_check_rewards_fails_in_one_line_before_any_model_loads():
    """Unknown names (the message lists the allowed ones), a local path that does not exist (the message
    names its flag) and unifiedreward without a server URL: one-line errors from load_rewards, raised before
    the first named reward ('clip', from the hub) loads: a fresh interpreter that runs them never imports
    open_clip or transformers, with the hub offline (a load attempt would fail differently); rewards.py itself, a
    leaf that imports torch only, is imported for its checks of the reward files."""
    code = """if True:
        import sys, common
        models = common.RewardModels(hps_checkpoint="/nonexistent/HPS_v2.1_compressed.pt")
        for names in (["clip", "hps2"], ["clip", "hps"], ["clip", "unifiedreward"]):
            try:
                common.load_rewards(names, "cpu", models=models)
            except SystemExit as e:
                print(e)
        print(sorted(m for m in ("open_clip", "transformers", "diffusers") if m in sys.modules))"""
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=ROOT)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env=env,
                          timeout=120)
    lines = proc.stdout.splitlines()
    assert proc.returncode == 0 and len(lines) == 4, (proc.stdout, proc.stderr)
    unknown, missing, unified, imported = lines
    assert unknown.startswith("error: unknown reward 'hps2'; choose from [")
    assert all(repr(n) in unknown for n in ("hps", "clip", "pickscore", "imagereward", "aesthetic",
                                            "unifiedreward", "jpeg", "toy_strict"))
    assert missing == ("error: --hps-checkpoint '/nonexistent/HPS_v2.1_compressed.pt' does not exist; "
                       "pass an existing path or a hub id")
    assert unified.startswith("error: ") and "--unifiedreward-url" in unified
    assert imported == "[]"  # nothing of the reward models was imported, so none was built


# ---- bf16 towers, float32 projections / scales / heads --------------------------------------------------
# max |bf16 - float32| of each reward on its tiny random model, measured on the CPU (torch 2.14.1, 1 or 2
# threads alike) with the inputs of test_bf16_towers_float32_heads (pytest -s prints them):
#   hps 1.7e-3 (cosines -0.31 to -0.17), clip 2.5e-3 (cosines -0.10 to 0.27), pickscore 1.0e-2
#   (100 cos / 26: -0.34 to 0.42), imagereward 1.4e-2 (-0.74 to 0.48), aesthetic 1.7e-3 (-0.38 to -0.33).
# Random tiny towers, not the real ones (ViT-H-14, BLIP, ViT-L/14 were not measured); the bounds are ~2x.
BF16_BOUND = {"hps": 4e-3, "clip": 5e-3, "pickscore": 2e-2, "imagereward": 4e-2, "aesthetic": 4e-3}
# what the towers are in each reward's score function (bf16); everything else it holds must be float32
TOWERS = {"hps": {"model"}, "clip": {"model"}, "pickscore": {"vision", "text"},
          "imagereward": {"vision", "text"}, "aesthetic": {"vision"}}
FLOAT32 = {"hps": {"image_head.weight", "text_head.weight"},
           "clip": {"image_head.weight", "text_head.weight"},
           "pickscore": {"scale", "image_head", "text_head"}, "imagereward": {"head"},
           "aesthetic": {"mlp", "image_head"}}


@pytest.fixture(scope="module")
def tiny_rewards(tmp_path_factory):
    """{name: (load(dtype) -> fn, images, prompts)} on tiny models for the five learned local rewards."""
    root = tmp_path_factory.mktemp("rewards")
    torch.manual_seed(0)
    arch = str(root / "arch")
    torch.save({"state_dict": tiny_open_clip_dir(arch, with_weights=False).state_dict()}, root / "hps.pt")
    tiny_open_clip_dir(str(root / "clip"), with_weights=True)
    tiny_clip_model(root / "pick", logit_scale=PICKSCORE_LOGIT_SCALE)
    tiny_clip_processor(root / "processor", root / "tok")
    tiny_clip_model(root / "aesthetic_clip", seed=1)
    tiny_clip_processor(root / "aesthetic_clip", root / "tok")
    models = RewardModels(clip_model=str(root / "clip"), pickscore_model=str(root / "pick"),
                          pickscore_processor=str(root / "processor"),
                          imagereward_checkpoint=os.path.join(IMAGEREWARD, "ImageReward.pt"),
                          imagereward_med_config=os.path.join(IMAGEREWARD, "med_config.json"),
                          imagereward_tokenizer=IMAGEREWARD, aesthetic_clip=str(root / "aesthetic_clip"),
                          aesthetic_head=aesthetic_head_file(root / "head.pth"))

    def learned(name):
        return lambda dtype: load_rewards([name], "cpu", models=models, dtype=dtype)[name]

    with open(os.path.join(IMAGEREWARD, "golden.json")) as f:
        golden = json.load(f)
    pixels = [np.array(Image.open(os.path.join(IMAGEREWARD, p))) for p in golden["images"][:4]]  # 224 x 224
    ir_images = torch.stack([torch.from_numpy(p).permute(2, 0, 1).float() / 255 for p in pixels])
    prompts = ["a cat", "a dog on the left", "a red circle", "a photo of two cubes"]
    return {
        "hps": (lambda dtype: rewards.open_clip_reward(arch, "cpu", str(root / "hps.pt"), pad_square=True,
                                                       dtype=dtype),
                images(4, 48, seed=3, width=64), prompts),  # 48 x 64: resized to 24 x 32 and padded
        "clip": (learned("clip"), images(4, 64, seed=3), prompts),
        "pickscore": (learned("pickscore"), images(4, 64, seed=3), prompts),
        "imagereward": (learned("imagereward"), ir_images, golden["prompts"][:4]),
        "aesthetic": (learned("aesthetic"), images(4, 64, seed=3), [""] * 4),
    }, models


def held(fn):
    """What a score function holds: its closure's values by name, the lambdas in it opened up (name.inner)."""
    fn = getattr(fn, "__wrapped__", fn)  # under torch.no_grad()
    out = {}
    for name, cell in zip(fn.__code__.co_freevars, fn.__closure__ or ()):
        value = cell.cell_contents
        if callable(value) and getattr(value, "__closure__", None) and not isinstance(value, torch.nn.Module):
            out.update({f"{name}.{k}": v for k, v in held(value).items()})
        else:
            out[name] = value
    return out


def dtypes(value):
    """The dtypes of a tensor or of a module's parameters (None for anything else)."""
    if isinstance(value, torch.Tensor):
        return {value.dtype}
    if isinstance(value, torch.nn.Module):
        return {p.dtype for p in value.parameters()}
    return None


@pytest.mark.parametrize("name", ["hps", "clip", "pickscore", "imagereward", "aesthetic"])
def test_bf16_towers_float32_heads(tiny_rewards, name):
    """Towers in bf16 (half the memory: 2 GiB instead of 4 for a ViT-H-14) move each score by less than the
    measured bound (and really ran: the scores differ); the scores are float32; every projection, logit
    scale and head the score function holds stays float32 and the towers are bf16."""
    load, x, prompts = tiny_rewards[0][name]
    fp32, bf16 = load(torch.float32), load(torch.bfloat16)
    r32, r16 = fp32(x, prompts), bf16(x, prompts)
    diff = (r16 - r32).abs().max().item()
    print(f"\n{name}: max |bf16 - float32| = {diff:.2e} (scores {r32.min():.3f} to {r32.max():.3f})")
    assert r16.dtype == r32.dtype == torch.float32 and r16.shape == (len(prompts),)
    assert 0 < diff < BF16_BOUND[name], diff
    state = {k: dtypes(v) for k, v in held(bf16).items() if dtypes(v)}
    assert {k for k, d in state.items() if d == {torch.bfloat16}} == TOWERS[name], state
    assert {k for k, d in state.items() if d == {torch.float32}} == FLOAT32[name], state


def test_bf16_pickscore_logit_scale_stays_float32(tiny_rewards, tmp_path):
    """A bf16 PickScore's score divided by its cosine (26 x the score of the same model with logit scale 0)
    is exp(4.6052) computed in float32 to 1e-6 relative: bf16 would make it exp(4.59375), 1.1% less."""
    import shutil

    _, models = tiny_rewards
    zero = tmp_path / "pick0"
    shutil.copytree(models.pickscore_model, zero)
    from transformers import CLIPModel

    model = CLIPModel.from_pretrained(zero)
    model.logit_scale.data.zero_()
    model.save_pretrained(zero)
    x, prompts = images(4, 64, seed=3), ["a cat", "a dog on the left", "a red circle", "a photo of two cubes"]
    scaled = rewards.pickscore_reward(models.pickscore_model, models.pickscore_processor, "cpu",
                                      dtype=torch.bfloat16)(x, prompts)
    cosine = 26 * rewards.pickscore_reward(str(zero), models.pickscore_processor, "cpu",
                                           dtype=torch.bfloat16)(x, prompts)
    expected = torch.tensor(PICKSCORE_LOGIT_SCALE).exp() / 26
    assert cosine.abs().min() > 0.01  # away from 0: the ratio is well defined
    torch.testing.assert_close(scaled / cosine, expected.expand(4), rtol=1e-6, atol=0)
    assert not torch.allclose(scaled / cosine, torch.tensor(4.59375).exp().expand(4) / 26, rtol=1e-3)


def test_rewards_is_a_leaf_that_imports_nothing_of_the_project(tmp_path):
    """rewards.py imports no module of this project (the dependency reads one way: common -> rewards), so it works
    copied alone into an empty directory: it imports there and reports a missing file in one line."""
    import ast
    import shutil

    tree = ast.parse(open(os.path.join(ROOT, "rewards.py")).read())
    imported = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    ours = {os.path.splitext(f)[0] for f in os.listdir(ROOT) if f.endswith(".py")} | {"toy", "tests", "results"}
    assert not imported & ours, imported & ours
    shutil.copy(os.path.join(ROOT, "rewards.py"), tmp_path)
    code = ("import types, rewards; rewards.check('hps', types.SimpleNamespace(hps_checkpoint='/nowhere/x.pt'))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True,
                          env=dict(os.environ, PYTHONPATH=""))
    assert proc.returncode == 1 and proc.stderr.strip() == ("error: --hps-checkpoint '/nowhere/x.pt' does not exist; "
                                                            "pass an existing path or a hub id"), proc.stderr


@pytest.mark.slow
def test_a_reward_of_your_own_trains_as_the_docs_say(tiny, tmp_path):
    """docs/rewards.md "Adding your own reward", literally, from another directory: a launcher registers
    `brightness` in common.REWARD_FUNCTIONS and runs flow_grpo.py; the run trains on it (its batch mean logged),
    evaluates with it (every pair's score, the mean brightness of its image), resumes through the launcher, and an
    unknown name lists it among the allowed ones."""
    import re
    import subprocess
    import sys

    from helpers import read_metrics, tiny_flags

    with open(os.path.join(ROOT, "docs", "rewards.md")) as f:
        launcher = re.search(r"```python\n(# my_train.py.*?)```", f.read(), flags=re.S).group(1)
    (tmp_path / "my_train.py").write_text(launcher)
    flags = tiny_flags(tiny["flux"], tiny["prompts"], tmp_path / "out", num_iterations=1, eval_every=1,
                       rewards="brightness", eval_rewards="brightness")
    env = dict(os.environ, FLOW_RL=ROOT, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")

    def run(*args):
        return subprocess.run([sys.executable, "my_train.py", *args], cwd=tmp_path, env=env, capture_output=True,
                              text=True, timeout=600)
    proc = run(*flags)
    assert proc.returncode == 0, proc.stderr[-2000:]
    run_dir, m = read_metrics(tmp_path / "out")
    assert 0 < m[1]["reward/brightness_mean"] < 1 and "eval/brightness" in m[1]
    pairs = json.load(open(os.path.join(run_dir, "eval_1.json")))["brightness"]
    assert len(pairs) == 4 and all(0 < p < 1 for p in pairs)
    resumed = run("--resume", run_dir, "--num-iterations", "2", "--eval-every", "0")
    assert resumed.returncode == 0 and "2 iterations in" in resumed.stdout, resumed.stderr[-2000:]
    unknown = run(*flags[:-2], "--eval-rewards", "brightnes")
    assert unknown.returncode == 1 and "error: unknown reward 'brightnes'; choose from [" in unknown.stderr
    assert "'brightness'" in unknown.stderr.splitlines()[-1]
