"""The toy world's learned proxy reward: a small CNN that imitates the training reward from a limited sample.

`toy_proxy_reward(images, prompts)` scores images [B, 3, H, W] in [0, 1] (resized to 32x32) for toy-world prompts,
one float in [0, 1] per image, as ProxyNet with the committed weights toy/proxy/proxy.safetensors (made by
toy/make_proxy.py, which says how) predicts the toy preset's training reward (toy_color_position +
toy_shape_count) / 2. It is a stand-in for a learned reward model: trained on some 12,000 of the base model's
own samples, it is right where those samples are and wrong, in ways nobody chose, where they are not, so an
optimiser can find images it overrates (docs/toy_world.md: "The learned proxy reward"). The run's rewards load it with
`load_reward(device)`, which reads and checks the weights and proxy.json at the start (one line if they are missing,
cut short or of another width). It imports world.py, never the other way.
"""
import functools
import json
import os

import torch
import torch.nn as nn
import torch.nn.functional as F

if __package__:  # toy.proxy, next to toy.world (common.load_rewards)
    from .world import COLOURS, POSITIONS, SHAPES, SIZE, parse_toy_prompt
else:  # toy/ on sys.path (toy/make_proxy.py, the tests)
    from world import COLOURS, POSITIONS, SHAPES, SIZE, parse_toy_prompt

HERE = os.path.dirname(os.path.abspath(__file__))
WEIGHTS = os.path.join(HERE, "proxy", "proxy.safetensors")
COND = 2 * (len(COLOURS) + len(SHAPES) + len(POSITIONS)) + 1  # two object slots of one-hots, and "two objects"


def prompt_features(prompts: list[str]) -> torch.Tensor:
    """[B, COND] float: per object slot the one-hots of its colour, shape and position (zeros for a missing second
    object), then 1 for two objects; ValueError outside the grammar."""
    out = torch.zeros(len(prompts), COND)
    k = COND // 2
    for i, p in enumerate(prompts):
        objs = parse_toy_prompt(p)
        for j, (c, s, pos) in enumerate(objs):
            out[i, j * k + list(COLOURS).index(c)] = 1
            out[i, j * k + len(COLOURS) + SHAPES.index(s)] = 1
            out[i, j * k + len(COLOURS) + len(SHAPES) + POSITIONS.index(pos)] = 1
        out[i, -1] = float(len(objs) == 2)
    return out


class ProxyNet(nn.Module):
    """Conv layers (32 -> 16 -> 8 -> 4 px), each FiLM-modulated by an MLP of the prompt's features, then an MLP on
    the flattened 4x4 map (positions stay where they are) and a sigmoid: one score per image."""

    def __init__(self, width: int = 16, hidden: int = 64):
        super().__init__()
        chans = [3, width, 2 * width, 4 * width, 4 * width]
        self.convs = nn.ModuleList(nn.Conv2d(chans[i], chans[i + 1], 3, stride=1 if i == 0 else 2, padding=1)
                                   for i in range(4))
        self.cond = nn.Sequential(nn.Linear(COND, hidden), nn.SiLU(), nn.Linear(hidden, hidden), nn.SiLU())
        self.film = nn.ModuleList(nn.Linear(hidden, 2 * c) for c in chans[1:])
        self.head = nn.Sequential(nn.Linear(chans[-1] * 16 + hidden, hidden), nn.SiLU(), nn.Linear(hidden, 1))

    def forward(self, images: torch.Tensor, cond: torch.Tensor) -> torch.Tensor:
        h, e = images * 2 - 1, self.cond(cond)
        for conv, film in zip(self.convs, self.film):
            scale, shift = film(e)[..., None, None].chunk(2, dim=1)
            h = F.silu(conv(h) * (1 + scale) + shift)
        return torch.sigmoid(self.head(torch.cat([h.flatten(1), e], 1))[:, 0])


def load_proxy(path: str = WEIGHTS, device="cpu") -> ProxyNet:
    """ProxyNet with the weights at `path` (its architecture from proxy.json beside them), frozen, in eval mode;
    weights or a proxy.json that are missing, cut short, not JSON or of another architecture stop in one line."""
    remake = "copy this project's toy/proxy/ there, or remake them with python toy/make_proxy.py"
    about = os.path.join(os.path.dirname(path), "proxy.json")
    for what, where in (("weights are", path), ("proxy.json is", about)):
        if not os.path.isfile(where):
            raise SystemExit(f"error: the toy proxy reward's {what} not at {where!r}: {remake}")
    try:
        with open(about, "rb") as f:
            arch = json.loads(f.read(1 << 16))["architecture"]  # (a small file: 64 kB at most)
        if not (set(arch) <= {"width", "hidden"} and all(type(v) is int and 1 <= v <= 4096 for v in arch.values())):
            raise ValueError("architecture: not {width, hidden} in 1..4096")
    except (OSError, ValueError, KeyError, TypeError, RecursionError) as e:
        raise SystemExit(f"error: the toy proxy reward's {about!r} holds no architecture ({type(e).__name__}); "
                         f"{remake}") from None
    from safetensors.torch import load_file
    net = ProxyNet(**arch)
    try:
        net.load_state_dict(load_file(path))
    except Exception as e:  # cut short, another format, another width
        why = next((line.strip().split(":")[0] for line in str(e).splitlines() if "mismatch" in line or "key(s)"
                    in line), type(e).__name__)  # e.g. "size mismatch for convs.0.weight"
        raise SystemExit(f"error: the toy proxy reward's weights {path!r} do not load into the architecture of "
                         f"proxy.json {arch} ({why!r}); {remake}") from None
    return net.to(device).eval().requires_grad_(False)


def load_reward(device="cpu"):
    """The proxy as a reward, fn(images, prompts) -> float [B], its weights loaded and checked now (a run's
    start: common.load_rewards), not at the first call."""
    net = load_proxy(WEIGHTS, device)
    _cached.cache_clear()
    return functools.partial(_score, net)


@functools.lru_cache(maxsize=4)
def _cached(device: str) -> ProxyNet:
    return load_proxy(WEIGHTS, device)


def toy_proxy_reward(images: torch.Tensor, prompts: list[str]) -> torch.Tensor:
    """The learned proxy of (toy_color_position + toy_shape_count) / 2: float [B] in [0, 1] on images' device
    (the committed weights, loaded at the first call)."""
    return _score(_cached(str(images.device)), images, prompts)


@torch.no_grad()
def _score(net: ProxyNet, images: torch.Tensor, prompts: list[str]) -> torch.Tensor:
    x = images.float().clamp(0, 1)
    if x.shape[-2:] != (SIZE, SIZE):
        x = F.interpolate(x, size=(SIZE, SIZE), mode="bilinear", antialias=True, align_corners=False)
    net = net.to(x.device)
    return net(x, prompt_features(prompts).to(x.device))
