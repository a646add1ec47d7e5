"""The moving-shapes toy world: prompts about one coloured shape moving on black, clips of it, and exact rewards.

Prompts name a colour, a shape, a direction and a speed, e.g. "a red circle moving slowly to the right" or "a blue
square falling quickly" (falling: down, rising: up). A clip moves its object at a constant velocity: `SPEEDS` pixels
per frame (at 32x32) in the named direction. Rewards take videos, float [B, 3, F, H, W] in [0, 1] (each frame resized
to 32x32), or, for `toy_frame`, single frames [B, 3, H, W], and return a float tensor [B] in [0, 1]:

    toy_frame          one frame: the object in its colour and shape, nothing else (an image reward: --frame-reduce
                       first / mean / stride:K says which frames of a video it scores)
    toy_frame_first    toy_frame of a video's first frame; toy_frame_mean: its mean over every frame
    toy_motion         the object's velocity, the weighted least-squares slope of its centroid over the frames, near
                       the prompt's (direction and speed), times its presence in every frame
    toy_consistency    one object throughout: its area steady and its path straight
    toy_video_strict   0/1: every frame right (toy_strict's tests of colour, size, shape and purity), the velocity
                       within 40% of the prompt's, the area steady and the path straight

A reward of the first frame (or any frame alone) is blind to the motion: it cannot reach toy_motion.
"""
import functools
import random
import re

import torch
import torch.nn.functional as F

try:
    from .world import COLOURS, SHAPES, SIZE, _analyse, shape_coverage
except ImportError:  # run as a script, or imported from toy/ itself
    from world import COLOURS, SHAPES, SIZE, _analyse, shape_coverage

DIRECTIONS = {"right": (1.0, 0.0), "left": (-1.0, 0.0), "falling": (0.0, 1.0), "rising": (0.0, -1.0)}
SPEEDS = {"slowly": 1.25, "quickly": 2.5}  # pixels per frame at 32x32
MOTION_SIGMA = 0.5  # pixels per frame: the tolerance of toy_motion's Gaussian in the velocity error
_PROMPT = re.compile(r"an? (red|green|blue|yellow) (circle|square|triangle) (?:moving (slowly|quickly) to the "
                     r"(left|right)|(falling|rising) (slowly|quickly))")
_EXAMPLE = "'a red circle moving slowly to the right' or 'a blue square falling quickly'"


def video_prompts(n: int, seed: int = 0) -> list[str]:
    """n prompts drawn from the grammar; the same (n, seed) always gives the same list."""
    rng, out = random.Random(seed), []
    for _ in range(n):
        colour, shape, speed = rng.choice(sorted(COLOURS)), rng.choice(SHAPES), rng.choice(sorted(SPEEDS))
        direction = rng.choice(sorted(DIRECTIONS))
        motion = f"moving {speed} to the {direction}" if direction in ("left", "right") else f"{direction} {speed}"
        out.append(f"a {colour} {shape} {motion}")
    return out


@functools.lru_cache(maxsize=4096)
def parse_video_prompt(prompt: str) -> tuple[str, str, str, str]:
    """'a red circle moving slowly to the right' -> ('red', 'circle', 'right', 'slowly'); ValueError outside the
    grammar."""
    m = _PROMPT.fullmatch(" ".join(prompt.lower().strip().rstrip(".").split()))
    if not m:
        raise ValueError(f"not a moving-shapes prompt: {prompt!r}; expected e.g. {_EXAMPLE}")
    colour, shape, speed_lr, lr, ud, speed_ud = m.groups()
    return colour, shape, lr or ud, speed_lr or speed_ud


def velocity_of(prompt: str) -> tuple[float, float]:
    """The prompt's velocity (vx, vy) in pixels per frame at 32x32 (y grows downwards)."""
    _, _, direction, speed = parse_video_prompt(prompt)
    dx, dy = DIRECTIONS[direction]
    return dx * SPEEDS[speed], dy * SPEEDS[speed]


def render_clips(prompts: list[str], frames: int, size: int = SIZE, generator=None) -> torch.Tensor:
    """Ground-truth clips [B, 3, frames, size, size] in [0, 1]: the object (9-12 px wide at 32x32) at a constant
    velocity, starting where its whole path stays inside the frame, at a random height (or column) across it."""
    n, margin = len(prompts), 7.0
    u = torch.rand(n, 3, generator=generator)
    colour, shape = torch.zeros(n, 3), torch.zeros(n, dtype=torch.long)
    start, v = torch.zeros(n, 2), torch.zeros(n, 2)
    for i, p in enumerate(prompts):
        c, s, _, _ = parse_video_prompt(p)
        colour[i], shape[i], v[i] = torch.tensor(COLOURS[c]), SHAPES.index(s), torch.tensor(velocity_of(p))
        travel = v[i] * (frames - 1)
        for axis in range(2):  # along the motion: the whole path inside; across it: anywhere away from the edges
            low, high = margin - min(travel[axis], 0), SIZE - margin - max(travel[axis], 0)
            start[i, axis] = low + (high - low) * u[i, axis]
    d = 9 + 3 * u[:, 2]
    t = torch.arange(frames, dtype=torch.float32)
    centre = start[:, None] + v[:, None] * t[None, :, None]  # [B, F, 2]
    scale = size / SIZE
    cov = shape_coverage(shape[:, None].expand(-1, frames), centre[..., 0] * scale, centre[..., 1] * scale,
                         d[:, None].expand(-1, frames) * scale, size)  # [B, F, H, W]
    return (cov[:, None] * colour[:, :, None, None, None]).clamp(0, 1)


def as_image_prompt(prompt: str) -> str:
    """The toy image world's prompt of the same object (its position is not read by toy_frame)."""
    colour, shape, _, _ = parse_video_prompt(prompt)
    return f"a {colour} {shape} on the left"


def _frames(videos: torch.Tensor) -> tuple[torch.Tensor, int]:
    """[B, 3, F, H, W] -> frames [B F, 3, 32, 32] (resized), and F."""
    if videos.ndim != 5:
        raise ValueError(f"a video reward needs videos [B, 3, F, H, W]; got a tensor of shape {tuple(videos.shape)}")
    b, c, f, h, w = videos.shape
    x = videos.float().clamp(0, 1).transpose(1, 2).reshape(b * f, c, h, w)
    if (h, w) != (SIZE, SIZE):
        x = F.interpolate(x, size=(SIZE, SIZE), mode="bilinear", antialias=True, align_corners=False)
    return x, f


def _analyse_video(videos: torch.Tensor, prompts: list[str]) -> dict:
    """world._analyse of every frame (as the image world's one-object prompt), each statistic [B, F]."""
    x, f = _frames(videos)
    a = _analyse(x, [as_image_prompt(p) for p in prompts for _ in range(f)])
    first = {k: v[:, 0] if v.ndim > 1 else v for k, v in a.items()}  # the one object of [B F, 2, ...]
    return {k: v.reshape(len(prompts), f, *v.shape[1:]) for k, v in first.items()}


def _path(a: dict):
    """The presence-weighted least-squares line through the object's centroids: its slope (vx, vy) [B, 2], the rms
    distance of the centroids from it [B] and the weights [B, F]."""
    w = a["present"]
    t = torch.arange(w.shape[1], dtype=torch.float32, device=w.device).expand_as(w)
    sw = w.sum(1, keepdim=True) + 1e-6
    t_mean = (w * t).sum(1, keepdim=True) / sw
    var_t = (w * (t - t_mean) ** 2).sum(1, keepdim=True) + 1e-6
    slopes, residual = [], 0.0
    for c in (a["cx"], a["cy"]):
        c_mean = (w * c).sum(1, keepdim=True) / sw
        slope = (w * (t - t_mean) * (c - c_mean)).sum(1, keepdim=True) / var_t
        slopes.append(slope[:, 0])
        residual = residual + (w * (c - c_mean - slope * (t - t_mean)) ** 2).sum(1) / sw[:, 0]
    return torch.stack(slopes, 1), residual.sqrt(), w


def toy_frame_reward(images: torch.Tensor, prompts: list[str]) -> torch.Tensor:
    """Colour and shape in one frame [B, 3, H, W]: the probability of the requested shape on the object's colour
    mask times its presence, times the share of bright pixels in that colour (the image world's toy_shape_count)."""
    a = _analyse(images, [as_image_prompt(p) for p in prompts])
    return (a["p_shape"][:, 0] * a["present"][:, 0] * a["purity"]).clamp(0, 1)


def toy_frame_first_reward(videos: torch.Tensor, prompts: list[str]) -> torch.Tensor:
    """toy_frame of each video's first frame."""
    return toy_frame_reward(videos[:, :, 0], prompts)


def toy_frame_mean_reward(videos: torch.Tensor, prompts: list[str]) -> torch.Tensor:
    """toy_frame averaged over every frame."""
    a = _analyse_video(videos, prompts)
    return (a["p_shape"] * a["present"] * a["purity"]).mean(1).clamp(0, 1)


def toy_motion_reward(videos: torch.Tensor, prompts: list[str]) -> torch.Tensor:
    """Direction and speed: exp(-|v - v*|^2 / (2 MOTION_SIGMA^2)) of the measured velocity v (the slope of the
    centroid path) and the prompt's v*, times the object's mean presence over the frames."""
    a = _analyse_video(videos, prompts)
    v, _, w = _path(a)
    target = torch.tensor([velocity_of(p) for p in prompts], device=v.device)
    error = (v - target).square().sum(1)
    return (w.mean(1) * torch.exp(-error / (2 * MOTION_SIGMA**2))).clamp(0, 1)


def toy_consistency_reward(videos: torch.Tensor, prompts: list[str]) -> torch.Tensor:
    """One object throughout: exp(-cv^2 / (2 0.15^2)) of the coefficient of variation of its area over the frames,
    times exp(-r^2 / 2) of the rms distance r (pixels) of its centroids from a straight path, times its mean
    presence."""
    a = _analyse_video(videos, prompts)
    _, residual, w = _path(a)
    area = a["area"]
    cv = area.std(1, unbiased=False) / (area.mean(1) + 1e-6)
    return (w.mean(1) * torch.exp(-cv.square() / (2 * 0.15**2)) * torch.exp(-residual.square() / 2)).clamp(0, 1)


def toy_video_strict_accuracy(videos: torch.Tensor, prompts: list[str]) -> torch.Tensor:
    """0/1: in every frame the object has >= 20 px of its colour, its best template is the requested shape with
    IoU >= 0.6 and >= 85% of bright pixels are its colour (toy_strict's tests); its velocity is within 40% of the
    prompt's speed of the prompt's velocity; its area varies by <= 25% (coefficient of variation) and its centroids
    lie within 1.5 px (rms) of a straight path."""
    a = _analyse_video(videos, prompts)
    iou_req = a["iou"].gather(-1, a["shape"][..., None])[..., 0]
    frames_ok = (a["hard_area"] >= 20) & (a["iou"].argmax(-1) == a["shape"]) & (iou_req >= 0.6) & \
        (a["purity"] >= 0.85)
    v, residual, _ = _path(a)
    target = torch.tensor([velocity_of(p) for p in prompts], device=v.device)
    speed = target.norm(dim=1)
    motion_ok = (v - target).norm(dim=1) <= 0.4 * speed
    area = a["area"]
    steady = area.std(1, unbiased=False) / (area.mean(1) + 1e-6) <= 0.25
    return (frames_ok.all(1) & motion_ok & steady & (residual <= 1.5)).float()


for _fn in (toy_frame_first_reward, toy_frame_mean_reward, toy_motion_reward, toy_consistency_reward,
            toy_video_strict_accuracy):
    _fn.video = True  # common.load_rewards: scores whole videos (never reduced per frame)
