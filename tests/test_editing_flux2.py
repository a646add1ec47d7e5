"""Editing with FLUX.2 [dev] and [klein] base: reference images on tiny random pipelines (toy/tiny_families.py, VAE
2x) saved with save_pretrained and loaded by path. The project's deterministic sampler reproduces Flux2Pipeline's and
Flux2KleinPipeline's own latents from the same reference image(s), prompt and noise, with one and with two
references, at the pipeline's own sizing, as they are and at --condition-size S; a reference over 1 MP is resized
as the pipeline resizes it; a batch's references of other counts or sizes are one line; the text cache keeps them;
every algorithm file trains [klein] base with references."""
import os

import pytest
import torch
from PIL import Image

import common
import models
from helpers import read_metrics, run_script, tiny_flags
from test_editing import one_line_error, source, write_edits

PROMPT = "make the red circle blue"


@pytest.fixture(scope="module")
def flux2_dirs(tmp_path_factory):
    """Tiny random Flux2Pipeline ([dev], guidance embedding) and Flux2KleinPipeline (base: true CFG) on disk."""
    import tiny_families
    root = tmp_path_factory.mktemp("flux2_editing")
    dirs = {"flux2": str(root / "flux2"), "flux2-klein": str(root / "flux2-klein")}
    tiny_families.build_flux2(seed=0).save_pretrained(dirs["flux2"])
    tiny_families.build_flux2_klein(seed=0).save_pretrained(dirs["flux2-klein"])
    return dirs


def load(flux2_dirs, name, condition_size):
    pipe, kind = common.load_pipeline(flux2_dirs[name], torch.device("cpu"))
    assert kind == "flux2" and models.FAMILIES[kind]["editing"]
    pipe.set_progress_bar_config(disable=True)
    pipe.condition_size = condition_size
    return pipe, kind


def resized(image: Image.Image, size: int) -> Image.Image:
    """A source resized before the pipeline's call to the area of a size x size square at its aspect ratio."""
    scale = size / (image.width * image.height) ** 0.5
    return image.resize((round(image.width * scale), round(image.height * scale)), Image.Resampling.LANCZOS)


@pytest.mark.parametrize("name,sizes,condition_size", [
    ("flux2", [(64, 64)], None), ("flux2", [(70, 90)], 0), ("flux2", [(64, 96), (70, 90)], 80),
    ("flux2-klein", [(70, 90)], None), ("flux2-klein", [(64, 96)], 80), ("flux2-klein", [(70, 90), (64, 64)], 0)])
def test_the_sampler_reproduces_flux2_with_references(flux2_dirs, tmp_path, name, sizes, condition_size):
    """The references' tokens after the target's (time coordinate 10, 20, ...), in [klein]'s negative pass too, the
    prediction cut back: common.ode_complete ends where the pipeline's __call__ ends (max abs difference < 1e-5),
    [dev] with its guidance embedding and [klein] base with true CFG 4, for references at the pipeline's own sizing
    (centre-cropped to the multiple 4), as they are (--condition-size 0) and at --condition-size 80 (the pipeline
    given the source resized to 80 x 80 pixels' area)."""
    pipe, kind = load(flux2_dirs, name, condition_size)
    paths = []
    for i, size in enumerate(sizes):
        paths.append(str(tmp_path / f"reference{i}.png"))
        source(*size, seed=i).save(paths[-1])
    prompt = common.Prompt(PROMPT, {"prompt": PROMPT, "images": paths}, images=tuple(paths))
    steps, guidance = 2, 4.0
    shape = common.latent_shape(pipe, kind, 32)
    sigmas = common.pipeline_sigmas(pipe, kind, num_steps=steps, shape=shape)
    emb = common.encode_prompts(pipe, kind, [prompt], max_sequence_length=16, cfg=guidance)
    assert ("neg_embeds" in emb) == (name == "flux2-klein")
    images = [Image.open(p) for p in paths]
    images = [resized(i, condition_size) for i in images] if condition_size else images
    grids = [(i.height // 4, i.width // 4) for i in images]  # sides floored to 4: VAE 2x, 2x2 patches
    times = torch.cat([torch.full((h * w,), 10 * (k + 1)) for k, (h, w) in enumerate(grids)])
    assert emb["cond"].shape == (1, len(times), shape[0]) and torch.equal(emb["cond_ids"][0, :, 0], times)
    noise = torch.randn((1, *shape), generator=torch.Generator().manual_seed(7))
    ours = common.ode_complete(pipe.transformer, kind, noise, [list(range(steps + 1))], sigmas, emb,
                               guidance=guidance, micro_batch=4)
    theirs = pipe(prompt=PROMPT, image=images, height=32, width=32, num_inference_steps=steps,
                  guidance_scale=guidance, generator=torch.Generator().manual_seed(7), output_type="latent",
                  max_sequence_length=16).images
    if name == "flux2":  # the packed tokens [1, H W, C]; [klein]: the VAE's latents
        theirs, ours = theirs.permute(0, 2, 1).reshape(1, *shape), ours
    else:
        ours = models.flux2_vae_latents(pipe, ours)
    assert (ours - theirs).abs().max() < 1e-5, (ours - theirs).abs().max()
    plain = {k: v for k, v in emb.items() if not k.startswith("cond")}
    without = common.ode_complete(pipe.transformer, kind, noise, [list(range(steps + 1))], sigmas, plain,
                                  guidance=guidance, micro_batch=4)
    without = models.flux2_vae_latents(pipe, without) if name == "flux2-klein" else without
    assert (without - ours).abs().max() > 1e-4  # the references act


class Prepared(Exception):
    """Stops the pipeline's __call__ once it has prepared its reference images."""


@pytest.mark.parametrize("condition_size", [None, 0, 600])
def test_a_reference_over_1_mp_is_prepared_as_the_pipeline_prepares_it(flux2_dirs, monkeypatch, condition_size):
    """A 1110 x 1001 source: the pipeline resizes it to 1 MP (LANCZOS, sides truncated) and centre-crops it to the
    multiple 4, and so does flux2_reference by default (bitwise the pixels the pipeline encodes: its __call__
    stopped there); --condition-size 0 keeps it as it is, 600 resizes it to 600 x 600 pixels' area first."""
    pipe, _ = load(flux2_dirs, "flux2-klein", condition_size)
    image = source(1001, 1110)
    ours = models.flux2_reference(pipe, image)
    scale = (2 ** 20 / (1001 * 1110)) ** 0.5  # 0.97145...: 972 x 1078, cropped to 972 x 1076
    expected = {None: (int(1001 * scale) // 4 * 4, int(1110 * scale) // 4 * 4), 0: (1000, 1108),
                600: (568, 632)}[condition_size]  # 600: 570 x 632 (rounded), cropped to 568 x 632
    assert ours.shape == (1, 3, *expected)
    if condition_size is not None:
        return
    seen = {}

    def prepare_image_latents(images, **kwargs):
        seen["images"] = images
        raise Prepared

    monkeypatch.setattr(pipe, "prepare_image_latents", prepare_image_latents)
    with pytest.raises(Prepared):
        pipe(prompt=PROMPT, image=image, height=32, width=32, num_inference_steps=1, max_sequence_length=16)
    assert len(seen["images"]) == 1 and torch.equal(seen["images"][0], ours)


def test_the_size_a_reference_enters_the_vae_at_is_the_encodes(flux2_dirs):
    """models.flux2_reference_hw (what rundir.check_editing reads) gives flux2_reference's size: over 1 MP and
    under, at --condition-size and without."""
    pipe, _ = load(flux2_dirs, "flux2-klein", None)
    for size, condition_size in [((1001, 1110), None), ((1400, 800), None), ((30, 50), None), ((1001, 1110), 0),
                                 ((1001, 1110), 600), ((41, 75), 48)]:
        pipe.condition_size = condition_size
        shape = models.flux2_reference(pipe, source(*size)).shape[-2:]
        assert tuple(shape) == models.flux2_reference_hw(pipe, *size), (size, condition_size)


def test_references_of_other_counts_or_sizes_in_one_batch_are_one_line(flux2_dirs, tmp_path):
    pipe, kind = load(flux2_dirs, "flux2-klein", 0)
    paths = []
    for i, size in enumerate([(32, 32), (32, 48), (3, 3)]):
        paths.append(str(tmp_path / f"{i}.png"))
        source(*size).save(paths[-1])
    one, two = common.Prompt(PROMPT, {}, images=paths[:1]), common.Prompt(PROMPT, {}, images=paths[:2])
    message = one_line_error(lambda: common.encode_prompts(pipe, kind, [one, two], max_sequence_length=16))
    assert "have [1, 2] reference images" in message
    other = common.Prompt(PROMPT, {}, images=paths[1:2])
    message = one_line_error(lambda: common.encode_prompts(pipe, kind, [one, other], max_sequence_length=16))
    assert "source images of one batch have different sizes" in message and "--condition-size" in message
    tiny = common.Prompt(PROMPT, {}, images=paths[2:])
    message = one_line_error(lambda: common.encode_prompts(pipe, kind, [tiny], max_sequence_length=16))
    assert "is smaller than this model's multiple 4" in message
    emb = common.encode_prompts(pipe, kind, [two, two], max_sequence_length=16)  # 8x8 + 8x12 tokens each
    assert emb["cond"].shape[:2] == emb["cond_ids"].shape[:2] == (2, 64 + 96)


def test_the_text_cache_keeps_each_prompts_references(flux2_dirs, tmp_path):
    """Two edits with one instruction and other references (two each): two cache rows, each with its own negative
    (an editing set's negative may see its images: rundir.fill_text_cache), each bitwise the encoder's own, the
    position ids integers as the pipeline's."""
    import rundir
    path = write_edits(tmp_path, [{"prompt": PROMPT, "images": ["a.png", "b.png"]},
                                  {"prompt": PROMPT, "images": ["b.png", "a.png"]}])
    prompts = common.load_prompt_set(path)
    pipe, kind = load(flux2_dirs, "flux2-klein", 0)
    direct = common.encode_prompts(pipe, kind, prompts, max_sequence_length=16, cfg=4.0)
    assert (direct["cond"][0] - direct["cond"][1]).abs().max() > 1e-3
    rundir.fill_text_cache(pipe, kind, prompts, directory=str(tmp_path / "cache"), device="cpu",
                           max_sequence_length=16, cfg=4.0)
    assert len([f for f in os.listdir(tmp_path / "cache") if f.endswith(".safetensors")]) == 2
    cached = common.encode_prompts(pipe, kind, prompts[::-1], max_sequence_length=16, cfg=4.0)
    assert cached.keys() == direct.keys() and cached["cond_ids"].dtype == torch.int64
    for k in direct:
        assert torch.equal(cached[k], direct[k].flip(0)), k


@pytest.mark.slow
@pytest.mark.parametrize("script", list(__import__("test_families").CASES))
def test_every_file_trains_flux2_klein_with_references(flux2_dirs, tmp_path, script):
    """One iteration of each file with LoRA on FLUX.2 [klein] base (true CFG) and an editing prompt set (.jsonl
    rows with reference images): the rollout NFE is the file's planned_nfe, a gradient, the LoRA saved, and the
    summary's loading snippet passes the reference image."""
    from test_families import CASES
    prompts = write_edits(tmp_path, [{"prompt": PROMPT, "image": "a.png"}, {"prompt": "remove it", "image": "b.png"}])
    flags = dict(CASES[script], num_iterations=1, eval_every=0, log_images_every=0, save_every=1, condition_size=0,
                 guidance=4.0)
    proc = run_script(script, tiny_flags(flux2_dirs["flux2-klein"], prompts, tmp_path / "runs", **flags))
    run, m = read_metrics(tmp_path / "runs")
    assert m[1]["perf/nfe_rollout_per_prompt"] == m[1]["perf/nfe_min_per_prompt"] > 0
    assert os.path.isfile(os.path.join(run, "checkpoints", "iter_1", "lora", "pytorch_lora_weights.safetensors"))
    assert m[1]["train/grad_norm"] > 0
    assert "from diffusers import Flux2KleinPipeline" in proc.stdout and "image=[source]" in proc.stdout
