"""The LAION aesthetic reward (rewards.aesthetic_reward) on a tiny random transformers CLIPModel (32 px,
projection 16) and a random head saved in the official file's format (a plain state_dict, keys
layers.{0,2,4,6,7}.{weight,bias}, as sac+logos+ava1-l14-linearMSE.pth); offline. bf16 against float32 on
these models: tests/test_rewards.py."""
from collections import OrderedDict

import pytest
import torch
from PIL import Image

from rewards import aesthetic_reward

LINEAR = (0, 2, 4, 6, 7)  # the Linear layers of the official nn.Sequential (dropouts between)
SIZES = [(1024, 16), (128, 1024), (64, 128), (16, 64), (1, 16)]  # (out, in) of layers 0, 2, 4, 6, 7
OPENAI_MEAN, OPENAI_STD = [0.48145466, 0.4578275, 0.40821073], [0.26862954, 0.26130258, 0.27577711]


def images(n=3, size=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(0, 256, (n, 3, size, size), generator=g) / 255.0).float()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(head path, clip dir): a random head in the official format; a CLIPModel and its CLIPImageProcessor."""
    from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel

    root = tmp_path_factory.mktemp("aesthetic")
    torch.manual_seed(0)
    text = {"vocab_size": 49408, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
            "num_attention_heads": 2, "max_position_embeddings": 77}
    vision = {"image_size": 32, "patch_size": 8, "hidden_size": 32, "intermediate_size": 64,
              "num_hidden_layers": 1, "num_attention_heads": 2}
    model = CLIPModel(CLIPConfig(text_config=text, vision_config=vision, projection_dim=16))
    model.save_pretrained(root / "clip")
    ip = CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    ip.save_pretrained(root / "clip")  # no tokenizer: the aesthetic reward never reads text
    state = OrderedDict()
    for i, (out, inp) in zip(LINEAR, SIZES):
        state[f"layers.{i}.weight"] = torch.randn(out, inp) / inp ** 0.5
        state[f"layers.{i}.bias"] = torch.randn(out) * 0.1
    torch.save(state, root / "head.pth")
    return str(root / "head.pth"), str(root / "clip")


def by_hand(head_path, clip_dir, x):
    """float64: normalise at the native size, projected image features, L2 norm, five matmuls."""
    from transformers import CLIPModel

    model = CLIPModel.from_pretrained(clip_dir).eval().double()
    state = torch.load(head_path, weights_only=True)
    mean = torch.tensor(OPENAI_MEAN, dtype=torch.float64).view(1, 3, 1, 1)
    std = torch.tensor(OPENAI_STD, dtype=torch.float64).view(1, 3, 1, 1)
    with torch.no_grad():
        pooled = model.vision_model(pixel_values=(x.double() - mean) / std).pooler_output
        h = model.visual_projection(pooled)
    h = h / h.norm(dim=-1, keepdim=True)
    for i in LINEAR:
        h = h @ state[f"layers.{i}.weight"].double().T + state[f"layers.{i}.bias"].double()
    return h.squeeze(-1)


def flow_grpo_way(head_path, clip_dir, x):
    """As Flow-GRPO's aesthetic_scorer.py: CLIPProcessor on uint8 PIL images, get_image_features, x / |x|,
    the MLP (float32)."""
    from transformers import CLIPImageProcessor, CLIPModel

    model, ip = CLIPModel.from_pretrained(clip_dir).eval(), CLIPImageProcessor.from_pretrained(clip_dir)
    state = torch.load(head_path, weights_only=True)
    pil = [Image.fromarray((im * 255).round().byte().permute(1, 2, 0).numpy()) for im in x]
    with torch.no_grad():
        out = model.get_image_features(**ip(images=pil, return_tensors="pt"))
        h = out if torch.is_tensor(out) else out.pooler_output
        h = h / h.norm(dim=-1, keepdim=True)
        for i in LINEAR:
            h = torch.nn.functional.linear(h, state[f"layers.{i}.weight"], state[f"layers.{i}.bias"])
    return h.squeeze(-1)


def test_matches_hand_computation_in_float64(tiny):
    """The reward at the native size equals the float64 hand computation to 1e-5 (measured 1.7e-7), and
    the head changes the scores from image to image (not a constant)."""
    x = images()
    r = aesthetic_reward(*tiny, "cpu")(x, ["", "", ""])
    assert r.shape == (3,) and r.dtype == torch.float32
    expected = by_hand(*tiny, x)
    torch.testing.assert_close(r.double(), expected, rtol=1e-5, atol=1e-5)
    assert expected.max() - expected.min() > 1e-3


@pytest.mark.parametrize("width", [32, 35])
def test_matches_the_processor_path_of_flow_grpo(tiny, width):
    """At the native size (and 32 x 35: the processor floors the crop offset) the reward equals Flow-GRPO's
    CLIPProcessor + get_image_features path."""
    x = images(4, seed=1)
    x = torch.cat([x, x[..., :width - 32]], dim=-1)
    torch.testing.assert_close(aesthetic_reward(*tiny, "cpu")(x, [""] * 4), flow_grpo_way(*tiny, x),
                               rtol=1e-4, atol=1e-4)


def test_resize_and_crop_follow_the_processor(tiny):
    """96 x 64 images: shortest side 64 -> 32, centre crop. torch's antialiased bicubic and the processor's
    PIL bicubic differ a little: measured max |diff| 5.9e-4 here, on scores spread over ~0.09."""
    x = images(4, seed=2, size=64).repeat(1, 1, 1, 2)[..., :96]  # [4, 3, 64, 96]
    diff = (aesthetic_reward(*tiny, "cpu")(x, [""] * 4) - flow_grpo_way(*tiny, x)).abs().max()
    assert diff < 5e-3, diff


def test_batched_equals_one_at_a_time(tiny):
    """Five 48 px images in one batch score as they do one at a time (measured 1.5e-7)."""
    fn, x = aesthetic_reward(*tiny, "cpu"), images(5, size=48, seed=3)
    one = torch.cat([fn(x[i:i + 1], [""]) for i in range(5)])
    torch.testing.assert_close(fn(x, [""] * 5), one, rtol=1e-5, atol=1e-5)


def test_missing_paths_name_the_flag(tiny):
    """A missing head or CLIP is a one-line error naming the path and its flag."""
    with pytest.raises(SystemExit, match=r"^error: --aesthetic-head '/nonexistent/h\.pth' .*local path") as e:
        aesthetic_reward("/nonexistent/h.pth", tiny[1], "cpu")
    assert "\n" not in str(e.value)
    clip_error = r"^error: cannot load the aesthetic CLIP '/nonexistent/clip' .*; pass --aesthetic-clip$"
    with pytest.raises(SystemExit, match=clip_error) as e:
        aesthetic_reward(tiny[0], "/nonexistent/clip", "cpu")
    assert "\n" not in str(e.value)


def test_wrong_head_is_a_one_line_error(tiny, tmp_path):
    """A head with other key names, or one for another CLIP (768-d input, ViT-L/14's, against this 16-d
    CLIP), is a one-line error saying what the head must be."""
    state = torch.load(tiny[0], weights_only=True)
    torch.save({k.replace("layers.", ""): v for k, v in state.items()}, tmp_path / "renamed.pth")
    torch.save({**state, "layers.0.weight": torch.zeros(1024, 768)}, tmp_path / "l14.pth")
    for path in (tmp_path / "renamed.pth", tmp_path / "l14.pth"):
        with pytest.raises(SystemExit, match=r"^error: --aesthetic-head .* is not the aesthetic predictor's "
                                             r"head for .*\(keys layers\.0/2/4/6/7, input 16\)$") as e:
            aesthetic_reward(str(path), tiny[1], "cpu")
        assert "\n" not in str(e.value) and str(path) in str(e.value)


def test_safetensors_head(tiny, tmp_path):
    """The head as a .safetensors file scores exactly as the .pth."""
    from safetensors.torch import save_file

    save_file(torch.load(tiny[0], weights_only=True), str(tmp_path / "head.safetensors"))
    x, fn = images(2), aesthetic_reward(str(tmp_path / "head.safetensors"), tiny[1], "cpu")
    torch.testing.assert_close(fn(x, ["", ""]), aesthetic_reward(*tiny, "cpu")(x, ["", ""]), rtol=0, atol=0)
