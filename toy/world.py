"""The toy world: prompts about coloured shapes on black, and exact rewards for images of them.

Prompts name one or two objects, e.g. "a red circle on the left" or "a red square on the left and a blue circle
on the right" (two objects always have different colours and opposite positions). Every reward takes images, float
[B, 3, H, W] in [0, 1] (resized to 32x32), and prompts, and returns a float tensor [B] in [0, 1].
"""
import functools
import random
import re

import torch
import torch.nn.functional as F

COLOURS = {"red": (0.95, 0.1, 0.1), "green": (0.1, 0.85, 0.15), "blue": (0.15, 0.35, 1.0), "yellow": (0.95, 0.9, 0.1)}
SHAPES = ("circle", "square", "triangle")
POSITIONS = ("left", "right", "top", "bottom")
OPPOSITE = {"left": "right", "right": "left", "top": "bottom", "bottom": "top"}
PHRASE = {"left": "on the left", "right": "on the right", "top": "at the top", "bottom": "at the bottom"}
SIZE = 32  # the rewards look at 32x32 images
MIN_AREA = 40.0  # pixels of the requested colour that count as a fully present object
SHAPE_AREA = (torch.pi / 4, 0.88 ** 2, 0.5)  # area / d^2 for a shape of bounding width d
SHAPE_SHARPNESS, NONE_IOU = 20.0, 0.55  # softmax temperature of the shape classifier; IoU of the "no shape" class
_CLAUSE = re.compile(r"an? (red|green|blue|yellow) (circle|square|triangle) (?:on|at) the (left|right|top|bottom)")
_EXAMPLE = "'a red circle on the left' or 'a red square on the left and a blue circle on the right'"


def toy_prompts(n: int, seed: int = 0, two_object_fraction: float = 0.5) -> list[str]:
    """n prompts drawn from the grammar; the same (n, seed) always gives the same list."""
    rng, out = random.Random(seed), []
    for _ in range(n):
        colours, shapes = rng.sample(sorted(COLOURS), 2), [rng.choice(SHAPES) for _ in range(2)]
        pos = rng.choice(POSITIONS)
        objs = [(colours[0], shapes[0], pos), (colours[1], shapes[1], OPPOSITE[pos])]
        objs = objs[:1 + (rng.random() < two_object_fraction)]
        out.append(" and ".join(f"a {c} {s} {PHRASE[p]}" for c, s, p in objs))
    return out


def parse_toy_prompt(prompt: str) -> list[tuple[str, str, str]]:
    """'a red circle on the left and ...' -> [('red', 'circle', 'left'), ...]; ValueError outside the grammar."""
    return list(_parse(prompt))


@functools.lru_cache(maxsize=4096)
def _parse(prompt: str) -> tuple[tuple[str, str, str], ...]:
    clauses = " ".join(prompt.lower().strip().rstrip(".").split()).split(" and ")
    matches = [_CLAUSE.fullmatch(c) for c in clauses]
    if not 1 <= len(clauses) <= 2 or not all(matches):
        raise ValueError(f"not a toy-world prompt: {prompt!r}; expected e.g. {_EXAMPLE}")
    objs = tuple(m.groups() for m in matches)
    if len(objs) == 2 and (objs[0][0] == objs[1][0] or OPPOSITE[objs[0][2]] != objs[1][2]):
        raise ValueError(f"two objects need different colours and opposite positions: {prompt!r}")
    return objs


def shape_coverage(shape: torch.Tensor, cx: torch.Tensor, cy: torch.Tensor, d: torch.Tensor, size: int = SIZE):
    """Anti-aliased coverage in [0, 1], [..., size, size], of shapes (0 circle, 1 square, 2 triangle pointing up)
    with bounding-box centre (cx, cy) and width d in pixels; the arguments broadcast together."""
    grid = torch.arange(size, dtype=torch.float32, device=cx.device) + 0.5
    dx, dy, h = grid - cx[..., None, None], grid[:, None] - cy[..., None, None], d[..., None, None] / 2
    circle = (dx * dx + dy * dy).sqrt() - h
    square = torch.maximum(dx.abs(), dy.abs()) - 0.88 * h
    triangle = torch.maximum(dy - h, (dx.abs() - (dy + h) / 2) / 1.25 ** 0.5)
    shape = shape[..., None, None]
    sdf = torch.where(shape == 0, circle, torch.where(shape == 1, square, triangle))
    return (0.5 - sdf).clamp(0, 1)


def _objects(prompts: list[str], device) -> tuple[torch.Tensor, ...]:
    """Prompts -> colour, shape, position indices [B, 2] and a validity mask [B, 2] (one-object prompts pad)."""
    idx = torch.zeros(len(prompts), 2, 4, dtype=torch.long)
    for i, p in enumerate(prompts):
        for j, (c, s, pos) in enumerate(_parse(p)):
            idx[i, j] = torch.tensor([list(COLOURS).index(c), SHAPES.index(s), POSITIONS.index(pos), 1])
    return idx.to(device).unbind(-1)


def _analyse(images: torch.Tensor, prompts: list[str]) -> dict:
    """Per-object statistics shared by the rewards (all vectorised over the batch)."""
    x = images.float().clamp(0, 1)
    if x.shape[-2:] != (SIZE, SIZE):
        x = F.interpolate(x, size=(SIZE, SIZE), mode="bilinear", antialias=True, align_corners=False)
    colour, shape, pos, valid = _objects(prompts, x.device)
    palette = torch.tensor(list(COLOURS.values()), device=x.device)  # [K, 3]
    level = lambda t: ((t - 0.1) / 0.6).clamp(0, 1)  # noqa: E731  (intensity -> "ink"; dark noise counts as none)
    t = torch.einsum("bchw,kc->bkhw", x, palette) / (palette * palette).sum(1)[:, None, None]
    resid = (x[:, None] - t[:, :, None] * palette[None, :, :, None, None]).square().sum(2) / t.clamp(min=0.1) ** 2
    masks = level(t) * torch.exp(-resid / (2 * 0.25 ** 2))  # [B, K, H, W] membership: intensity x hue match
    ink = level(x.amax(1))  # [B, H, W] anything bright
    m = masks.gather(1, colour[..., None, None].expand(-1, -1, SIZE, SIZE)) * valid[..., None, None]  # [B, 2, H, W]
    grid = torch.arange(SIZE, device=x.device, dtype=torch.float32) + 0.5
    soft = torch.sigmoid((SIZE / 2 - grid) / 1.0)  # 1 on the low side of the middle line
    regions = torch.stack([soft[None].expand(SIZE, -1), soft.flip(0)[None].expand(SIZE, -1),  # left, right,
                           soft[:, None].expand(-1, SIZE), soft.flip(0)[:, None].expand(-1, SIZE)])  # top, bottom
    inside = (m * regions[pos]).sum((-1, -2))
    area = m.sum((-1, -2))
    cx, cy = (m * grid).sum((-1, -2)) / (area + 1e-6), (m * grid[:, None]).sum((-1, -2)) / (area + 1e-6)
    shapes = torch.arange(3, device=x.device)
    d = (area[..., None] / torch.tensor(SHAPE_AREA, device=x.device)).sqrt()  # [B, 2, 3] size of each template
    cy_box = cy[..., None] - torch.where(shapes == 2, d / 6, 0.0)  # a triangle's centroid sits d/6 below its box centre
    tmpl = shape_coverage(shapes.expand_as(d), cx[..., None].expand_as(d), cy_box, d)  # [B, 2, 3, H, W]
    iou = torch.minimum(m[:, :, None], tmpl).sum((-1, -2)) / (torch.maximum(m[:, :, None], tmpl).sum((-1, -2)) + 1e-6)
    logits = SHAPE_SHARPNESS * torch.cat([iou, torch.full_like(iou[..., :1], NONE_IOU)], -1)
    p_shape = logits.softmax(-1).gather(-1, shape[..., None])[..., 0]
    explained = torch.minimum(m.sum(1), ink).sum((-1, -2))
    purity = (explained + 1e-3) / (ink.sum((-1, -2)) + 1e-3)
    return dict(valid=valid.float(), presence=(inside / MIN_AREA).clamp(max=1), placement=inside / (area + 1e-6),
                present=(area / MIN_AREA).clamp(max=1), p_shape=p_shape, iou=iou, shape=shape, purity=purity,
                hard_area=(m > 0.5).float().sum((-1, -2)), area=area, cx=cx, cy=cy)


def _mean_objects(v: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    return (v * valid).sum(1) / valid.sum(1)


def toy_color_position_reward(images: torch.Tensor, prompts: list[str]) -> torch.Tensor:
    """Colour and position: per object, the mass of its colour inside its region (graded up to MIN_AREA pixels)
    times the share of that colour's mass that lies there; averaged over objects, times the share of all bright
    pixels that have a requested colour."""
    a = _analyse(images, prompts)
    return (_mean_objects(a["presence"] * a["placement"], a["valid"]) * a["purity"]).clamp(0, 1)


def toy_shape_count_reward(images: torch.Tensor, prompts: list[str]) -> torch.Tensor:
    """Shape and count: per object, the probability of the requested shape under a soft classifier of template IoUs
    (circle / square / triangle / none) on the object's colour mask, times its presence; averaged over objects,
    times the share of bright pixels that have a requested colour (extra objects and colours cost)."""
    a = _analyse(images, prompts)
    return (_mean_objects(a["p_shape"] * a["present"], a["valid"]) * a["purity"]).clamp(0, 1)


def toy_strict_accuracy(images: torch.Tensor, prompts: list[str]) -> torch.Tensor:
    """GenEval-like 0/1: every object present in its colour (>= 20 px), >= 75% of it in its region, its best
    template the requested shape with IoU >= 0.6, and >= 85% of bright pixels of requested colours."""
    a = _analyse(images, prompts)
    iou_req = a["iou"].gather(-1, a["shape"][..., None])[..., 0]
    ok = (a["hard_area"] >= 20) & (a["placement"] >= 0.75) & (a["iou"].argmax(-1) == a["shape"]) & (iou_req >= 0.6)
    return ((ok | (a["valid"] == 0)).all(1) & (a["purity"] >= 0.85)).float()
