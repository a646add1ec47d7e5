"""The editing toy world: a toy-world scene and an instruction in, the edited scene out; exact rewards for edits.

A source is a toy-world scene (toy/world.py: one or two coloured shapes on black, two objects of different colours
in opposite regions) drawn with random sizes and offsets. An instruction changes one object, named by its colour and
shape:

    make the red circle blue          recolour it (never to the other object's colour)
    move the red circle to the right  move a lone object to the opposite region (size and offsets kept)
    remove the blue square            delete one object of two
    add a green triangle on the right add an object to a one-object scene, in the opposite region

The target is the source with that one change; everything else (the other object, sizes, offsets) is kept. Each
edit is a prompt of the prompt set 'toy-edit': the instruction, its source image, and as metadata the source and
target scenes in the toy world's words (a .jsonl prompt set scores alike: rows {"prompt", "image", "source", "target",
"changed"}). Rewards take the edited images [B, 3, H, W] in [0, 1] (resized to 32x32)
and those prompts, and return a float tensor [B] in [0, 1]:

    toy_edit          the instruction carried out: toy/world.py's colour-position and shape-count rewards of the
                      target scene, averaged (the edited object, and the other one still right)
    toy_preserve      the rest preserved: 1 - (mean |edit - source| outside the edited object's boxes) / 0.25
    toy_edit_strict   0/1: toy_strict of the target scene, and the mean |edit - source| outside the edited
                      boxes at most 0.05 (the evaluation metric)
"""
import random
import re

import torch
import torch.nn.functional as F

try:
    from .world import COLOURS, OPPOSITE, PHRASE, SHAPES, SIZE, parse_toy_prompt, shape_coverage
    from .world import toy_color_position_reward, toy_shape_count_reward, toy_strict_accuracy
except ImportError:  # run as a script, or imported from toy/ itself
    from world import COLOURS, OPPOSITE, PHRASE, SHAPES, SIZE, parse_toy_prompt, shape_coverage
    from world import toy_color_position_reward, toy_shape_count_reward, toy_strict_accuracy

CENTRES = {"left": (8.0, 16.0), "right": (24.0, 16.0), "top": (16.0, 8.0), "bottom": (16.0, 24.0)}
EDITS = ("recolour", "move", "remove", "add")
PRESERVE_SCALE = 0.25  # mean absolute difference outside the edit at which toy_preserve reaches 0
STRICT_PRESERVE = 0.05  # toy_edit_strict: the largest mean absolute difference outside the edit
WORDS = "make move remove add to".split()  # the instructions' words beyond the toy world's
_INSTRUCTION = re.compile(r"make the (\w+) (\w+) (\w+)|move the (\w+) (\w+) to the (\w+)|remove the (\w+) (\w+)|"
                          r"add an? (\w+) (\w+) (?:on|at) the (\w+)")


def describe(objs: list) -> str:
    """Objects [(colour, shape, position, ...)] -> the toy world's prompt for them."""
    return " and ".join(f"a {o[0]} {o[1]} {PHRASE[o[2]]}" for o in objs)


def draw_edits(n: int, seed: int = 0) -> list[dict]:
    """n edits, each {instruction, source, target: toy-world prompts, source_objects, target_objects: [(colour,
    shape, position, across, along, width)]}; the same (n, seed) always gives the same list."""
    rng, out = random.Random(seed), []
    for _ in range(n):
        def obj(colour, shape, pos):  # offsets across / along the middle line and a width, as make_toy.render
            return (colour, shape, pos, 3 * rng.random() - 1.5, 10 * rng.random() - 5, 9 + 3 * rng.random())
        edit, pos = rng.choice(EDITS), rng.choice(sorted(CENTRES))
        colours = rng.sample(sorted(COLOURS), 3)
        first = obj(colours[0], rng.choice(SHAPES), pos)
        source = [first] if edit in ("move", "add") else [first, obj(colours[1], rng.choice(SHAPES), OPPOSITE[pos])]
        k = rng.randrange(len(source)) if edit in ("recolour", "remove") else 0
        c, s = source[k][:2]
        target = list(source)
        if edit == "recolour":
            new = rng.choice([x for x in sorted(COLOURS) if x not in (o[0] for o in source)])
            target[k] = (new, *source[k][1:])
            instruction = f"make the {c} {s} {new}"
        elif edit == "move":
            where = OPPOSITE[pos]  # (a neighbouring region overlaps the source's: toy_strict could pass it)
            target[k] = (c, s, where, *source[k][3:])
            instruction = f"move the {c} {s} to the {where}"
        elif edit == "remove":
            del target[k]
            instruction = f"remove the {c} {s}"
        else:
            added = obj(colours[1], rng.choice(SHAPES), OPPOSITE[pos])
            target.append(added)
            instruction = f"add {'an' if added[0] == 'a' else 'a'} {added[0]} {added[1]} {PHRASE[added[2]]}"
        out.append(dict(instruction=instruction, source=describe(source), target=describe(target),
                        source_objects=source, target_objects=target))
    return out


def centre(obj) -> tuple[float, float]:
    """An object's bounding-box centre in pixels at 32x32."""
    _, _, pos, across, along, _ = obj
    x0, y0 = CENTRES[pos]
    return (x0 + across, y0 + along) if pos in ("left", "right") else (x0 + along, y0 + across)


def changed_boxes(source: list, target: list) -> list:
    """The boxes [x0, y0, x1, y1] (pixels at 32x32, 2 px around the object) of every object that is in one of
    the scenes and not the other: where an edit may change the image."""
    boxes = []
    for o in set(source) ^ set(target):
        (cx, cy), half = centre(o), o[5] / 2 + 2
        boxes.append([round(cx - half, 2), round(cy - half, 2), round(cx + half, 2), round(cy + half, 2)])
    return boxes


def render(objs: list, size: int = SIZE) -> torch.Tensor:
    """An image [3, size, size] in [0, 1] of objects [(colour, shape, position, across, along, width)] on black."""
    image = torch.zeros(3, size, size)
    for o in objs:
        (cx, cy), s = centre(o), size / 32
        cov = shape_coverage(torch.tensor(SHAPES.index(o[1])), torch.tensor(cx * s), torch.tensor(cy * s),
                             torch.tensor(o[5] * s), size)
        image = torch.maximum(image, cov * torch.tensor(COLOURS[o[0]])[:, None, None])
    return image.clamp(0, 1)


def edit_prompts(n: int, seed: int = 0) -> list:
    """The prompt set 'toy-edit': n edits as Prompts (the instruction; its source image, uint8 [3, 32, 32];
    metadata: the source and target scenes, and the boxes where they differ)."""
    from common import Prompt
    return [Prompt(e["instruction"], {"source": e["source"], "target": e["target"],
                                      "changed": changed_boxes(e["source_objects"], e["target_objects"])},
                   images=((render(e["source_objects"]) * 255).round().byte(),)) for e in draw_edits(n, seed)]


def parse_edit(prompt) -> tuple[str, str]:
    """An edit prompt -> its (source, target) scenes, checked against its instruction; ValueError otherwise."""
    meta = getattr(prompt, "metadata", None) or {}
    source, target = meta.get("source"), meta.get("target")
    if not isinstance(source, str) or not isinstance(target, str) or not getattr(prompt, "images", ()):
        raise ValueError(f"not an editing toy-world prompt: {str(prompt)[:60]!r}; it needs a source image and "
                         f"the source and target scenes (toy/edit_world.py)")
    parse_toy_prompt(source), parse_toy_prompt(target)  # noqa: B018 (the grammar's ValueError)
    changed = meta.get("changed", [])
    if not isinstance(changed, list) or len(changed) > 4 or not all(
            isinstance(b, list) and len(b) == 4 and all(type(v) in (int, float) and -64 <= v <= 96 for v in b)
            for b in changed):
        raise ValueError(f"the edit {str(prompt)[:60]!r} has a \"changed\" field that is not a list of at most 4 "
                         f"boxes [x0, y0, x1, y1] in pixels at 32 x 32: {str(changed)[:60]}")
    if not _INSTRUCTION.fullmatch(" ".join(str(prompt).lower().split())):
        raise ValueError(f"not a toy-world instruction: {str(prompt)[:60]!r}; expected e.g. 'make the red circle "
                         f"blue' or 'remove the blue square'")
    return source, target


def source_image(prompt) -> torch.Tensor:
    """An edit prompt's source image, uint8 [3, H, W]: the tensor of the prompt set 'toy-edit', or the file a
    .jsonl row names (common.Prompt.images holds its path)."""
    image = prompt.images[0]
    if isinstance(image, str):
        import numpy as np
        from PIL import Image
        with Image.open(image) as f:
            image = torch.from_numpy(np.asarray(f.convert("RGB")).copy()).permute(2, 0, 1)
    return image


def _at_size(images: torch.Tensor) -> torch.Tensor:
    x = images.float().clamp(0, 1)
    if x.shape[-2:] != (SIZE, SIZE):
        x = F.interpolate(x, size=(SIZE, SIZE), mode="bilinear", antialias=True, align_corners=False)
    return x


def _difference_outside(images: torch.Tensor, prompts: list) -> torch.Tensor:
    """Mean |edit - source| over the pixels outside the boxes of the objects the edit changes (metadata
    "changed": the old and the new place of a moved object, the recoloured, removed or added one)."""
    x = _at_size(images)
    grid = torch.arange(SIZE, device=x.device, dtype=torch.float32) + 0.5
    out = torch.zeros(len(prompts), device=x.device)
    for i, p in enumerate(prompts):
        parse_edit(p)
        src = _at_size(source_image(p)[None].float().to(x.device) / 255)[0]
        keep = torch.ones(SIZE, SIZE, device=x.device)
        for x0, y0, x1, y1 in p.metadata.get("changed", []):
            inside = ((grid[:, None] >= y0) & (grid[:, None] <= y1) & (grid >= x0) & (grid <= x1)).float()
            keep = keep * (1 - inside)
        out[i] = ((x[i] - src).abs().mean(0) * keep).sum() / keep.sum().clamp(min=1)
    return out


def toy_edit_reward(images: torch.Tensor, prompts: list) -> torch.Tensor:
    """The instruction carried out: the target scene's colour-position and shape-count rewards, averaged."""
    targets = [parse_edit(p)[1] for p in prompts]
    return (toy_color_position_reward(images, targets) + toy_shape_count_reward(images, targets)) / 2


def toy_preserve_reward(images: torch.Tensor, prompts: list) -> torch.Tensor:
    """The rest preserved: 1 - (mean |edit - source| outside the edited boxes) / PRESERVE_SCALE, in [0, 1]."""
    return (1 - _difference_outside(images, prompts) / PRESERVE_SCALE).clamp(0, 1)


def toy_edit_strict_accuracy(images: torch.Tensor, prompts: list) -> torch.Tensor:
    """0/1: toy_strict of the target scene, and the rest within STRICT_PRESERVE of the source."""
    targets = [parse_edit(p)[1] for p in prompts]
    kept = _difference_outside(images, prompts) <= STRICT_PRESERVE
    return (toy_strict_accuracy(images, targets).bool() & kept.cpu()).float()
