"""Image editing with Qwen-Image-Edit on tiny random pipelines saved with save_pretrained and loaded by path: the
project's deterministic sampler reproduces QwenImageEditPlusPipeline's (2509; 2511's zero_cond_t transformer) and
QwenImageEditPipeline's (2508) own latents from the same sources, instruction and noise under true CFG, whose negative
prompt sees the sources too; the text cache keeps each prompt's negative; every algorithm file trains it with LoRA.

The pipelines resize each source for the VAE to 1024 x 1024 pixels' area (Plus: VAE_IMAGE_SIZE; 2508: the literal
1024 * 1024 its calculate_dimensions gets), 65,536 tokens on the tiny 4x VAE: the tests scale that area down to 96 x 96
in the pipelines' modules, which models.qwen_edit_sources reads as the pipelines do."""
import os

import numpy as np
import pytest
import torch
from PIL import Image
from test_editing import one_line_error, source, write_edits

import common
import models
from helpers import read_metrics, run_script, tiny_flags

PROMPT = "make the red circle blue"
AREA = 96 * 96  # the VAE's area in the tests (the pipelines' 1024 x 1024)
BUILDERS = {"plus": ("build_qwenimage_edit_plus", {}), "plus-2511": ("build_qwenimage_edit_plus", {"zero_cond_t": True}),
            "edit": ("build_qwenimage_edit", {})}


@pytest.fixture(autouse=True)
def small_vae_area(monkeypatch):
    """The pipelines' 1024 x 1024 VAE area scaled to AREA, in both pipeline modules (as models.py reads them)."""
    from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit as edit
    from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit_plus as plus
    monkeypatch.setattr(plus, "VAE_IMAGE_SIZE", AREA)
    original = edit.calculate_dimensions
    monkeypatch.setattr(edit, "calculate_dimensions", lambda area, ratio: original(area * AREA / 1024 ** 2, ratio))


@pytest.fixture(scope="module")
def edit_dirs(tmp_path_factory):
    """Each tiny Qwen-Image-Edit pipeline on disk."""
    import tiny_families
    root, dirs = tmp_path_factory.mktemp("qwen-edit"), {}
    for name, (builder, kwargs) in BUILDERS.items():
        dirs[name] = str(root / name)
        getattr(tiny_families, builder)(**kwargs).save_pretrained(dirs[name])
    return dirs


def test_the_tiny_tokenizer_drops_the_edit_template_as_the_real_one(edit_dirs):
    """The tiny vocabulary makes the edit template's 64 dropped tokens end where the user's turn starts (as Qwen's)."""
    import tiny_families
    pipe, _ = common.load_pipeline(edit_dirs["plus"], torch.device("cpu"))
    assert pipe.prompt_template_encode_start_idx == tiny_families.QWENIMAGE_EDIT_DROP
    ids = pipe.tokenizer(pipe.prompt_template_encode.format("Picture 1: " + PROMPT)).input_ids
    assert pipe.tokenizer.decode(ids[:64]).endswith("<|im_start|>user\n")
    assert pipe.tokenizer.decode(ids[64:]).startswith("Picture 1: " + PROMPT + "<|im_end|>")


@pytest.mark.parametrize("name,sizes", [("plus", [(40, 56)]), ("plus", [(64, 32)]), ("plus", [(40, 56), (48, 48)]),
                                        ("plus-2511", [(40, 56)]), ("plus-2511", [(40, 56), (48, 48)]),
                                        ("edit", [(40, 56)]), ("edit", [(64, 32)])])
def test_the_sampler_reproduces_qwen_image_edit(edit_dirs, tmp_path, name, sizes):
    """The sources' tokens after the target's, their shapes in img_shapes, the predictions cut back before true CFG,
    the negative " " encoded with the sources: common.ode_complete ends where the pipeline's __call__ ends (max abs
    difference < 1e-5) with the pipeline's own resizing (--condition-size unset), one or two sources."""
    pipe, kind = common.load_pipeline(edit_dirs[name], torch.device("cpu"))
    assert kind == "qwenimage_edit"
    pipe.condition_size = None
    paths = []
    for i, size in enumerate(sizes):
        paths.append(str(tmp_path / f"source{i}.png"))
        source(*size, seed=i).save(paths[-1])
    prompt = common.Prompt(PROMPT, {"prompt": PROMPT, "images": paths}, images=tuple(paths))
    steps, guidance = 2, 4.0
    shape = common.latent_shape(pipe, kind, 32)
    sigmas = common.pipeline_sigmas(pipe, kind, num_steps=steps, shape=shape)
    emb = common.encode_prompts(pipe, kind, [prompt], max_sequence_length=64, cfg=guidance)
    assert emb["cond_shapes"].shape == (1, len(sizes), 2) and "neg_embeds" in emb
    noise = torch.randn((1, *shape), generator=torch.Generator().manual_seed(7))
    ours = common.ode_complete(pipe.transformer, kind, noise, [list(range(steps + 1))], sigmas, emb,
                               guidance=guidance, micro_batch=4)
    images = [Image.open(p) for p in paths]
    theirs = pipe(image=images if name != "edit" else images[0], prompt=PROMPT, negative_prompt=" ", true_cfg_scale=guidance,
                  height=32, width=32, num_inference_steps=steps, generator=torch.Generator().manual_seed(7),
                  output_type="latent").images
    theirs = models.unpack(theirs, (1, *shape))
    diff = (ours - theirs).abs().max()
    print(f"{name} {sizes}: max |ours - pipeline| {diff:.1e}")
    assert diff < 1e-5, diff
    plain = {k: v for k, v in emb.items() if k not in ("cond", "cond_shapes")}
    without = common.ode_complete(pipe.transformer, kind, noise, [list(range(steps + 1))], sigmas, plain,
                                  guidance=guidance, micro_batch=4)
    assert (without - ours).abs().max() > 1e-4  # the sources' tokens act


def test_the_size_a_source_enters_the_vae_at_is_the_encodes(edit_dirs):
    """models.qwen_edit_source_hw (what rundir.check_editing reads) gives the VAE's size of qwen_edit_sources,
    for Plus and 2508, at the pipelines' area (AREA here) and at --condition-size."""
    for name in ("plus", "edit"):
        pipe, _ = common.load_pipeline(edit_dirs[name], torch.device("cpu"))
        for size, condition_size in [((32, 32), None), ((30, 50), None), ((41, 75), 0), ((50, 30), 40)]:
            pipe.condition_size = condition_size
            image = torch.from_numpy(np.asarray(source(*size))).permute(2, 0, 1)  # uint8 [3, H, W]
            _, (pixels,) = models.qwen_edit_sources(pipe, [image])
            assert tuple(pixels.shape[-2:]) == models.qwen_edit_source_hw(pipe, *size), (name, size)


def test_the_condition_size_and_one_line_errors(edit_dirs, tmp_path):
    """--condition-size sets the VAE's size of the sources (0: as they are); sources of other sizes in one batch, a
    text-only prompt, two sources for 2508 and a prompt longer than --max-sequence-length are one-line errors."""
    pipe, kind = common.load_pipeline(edit_dirs["plus"], torch.device("cpu"))
    prompts = []
    for i, size in enumerate([(32, 32), (32, 48)]):
        path = str(tmp_path / f"{i}.png")
        source(*size, seed=i).save(path)
        prompts.append(common.Prompt(PROMPT, {}, images=(path,)))
    pipe.condition_size = 0
    emb = common.encode_prompts(pipe, kind, prompts[1:], max_sequence_length=64, cfg=4.0)
    assert emb["cond_shapes"].tolist() == [[[4, 6]]] and emb["cond"].shape == (1, 24, 16)  # 32x48 / 4 / 2
    message = one_line_error(lambda: common.encode_prompts(pipe, kind, prompts, max_sequence_length=64))
    assert "source images of one batch have different sizes" in message
    message = one_line_error(lambda: common.encode_prompts(pipe, kind, [PROMPT], max_sequence_length=64))
    assert "edits source images" in message and "[0]" in message
    message = one_line_error(lambda: common.encode_prompts(pipe, kind, prompts[:1], max_sequence_length=16))
    assert "more than --max-sequence-length 16; pass --max-sequence-length" in message
    edit, kind = common.load_pipeline(edit_dirs["edit"], torch.device("cpu"))
    two = common.Prompt(PROMPT, {}, images=prompts[0].images + prompts[1].images)
    message = one_line_error(lambda: common.encode_prompts(edit, kind, [two], max_sequence_length=64))
    assert "QwenImageEditPipeline edits one source image per prompt" in message


def test_the_text_cache_keeps_each_prompts_negative(edit_dirs, tmp_path):
    """The negative prompt sees each prompt's sources: the cache keeps it in each prompt's row, not once."""
    import rundir
    path = write_edits(tmp_path, [{"prompt": PROMPT, "image": "a.png"}, {"prompt": PROMPT, "image": "b.png"}])
    prompts = common.load_prompt_set(path)
    pipe, kind = common.load_pipeline(edit_dirs["plus"], torch.device("cpu"))
    pipe.condition_size = 0
    direct = common.encode_prompts(pipe, kind, prompts, max_sequence_length=64, cfg=4.0)
    assert (direct["neg_embeds"][0] - direct["neg_embeds"][1]).abs().max() > 1e-3
    rundir.fill_text_cache(pipe, kind, prompts, directory=str(tmp_path / "cache"), device="cpu",
                           max_sequence_length=64, cfg=4.0)
    assert not os.path.exists(tmp_path / "cache" / "negative.safetensors")
    cached = common.encode_prompts(pipe, kind, prompts[::-1], max_sequence_length=64, cfg=4.0)
    for k in direct:
        assert torch.equal(cached[k], direct[k].flip(0)), k


@pytest.mark.slow
@pytest.mark.parametrize("script", list(__import__("test_families").CASES))
def test_every_file_trains_qwen_image_edit(edit_dirs, tmp_path, script):
    """One iteration of each file with LoRA on Qwen-Image-Edit-2509 and an editing prompt set: the rollout NFE is
    the file's planned_nfe, a gradient, the LoRA saved, and the summary's loading snippet passes the source image."""
    from test_families import CASES
    prompts = write_edits(tmp_path, [{"prompt": PROMPT, "image": "a.png"}, {"prompt": "remove it", "image": "b.png"}])
    flags = dict(CASES[script], num_iterations=1, eval_every=0, log_images_every=0, save_every=1, condition_size=0,
                 max_sequence_length=64)
    proc = run_script(script, tiny_flags(edit_dirs["plus"], prompts, tmp_path / "runs", **flags))
    run, m = read_metrics(tmp_path / "runs")
    assert m[1]["perf/nfe_rollout_per_prompt"] == m[1]["perf/nfe_min_per_prompt"] > 0
    assert os.path.isfile(os.path.join(run, "checkpoints", "iter_1", "lora", "pytorch_lora_weights.safetensors"))
    assert m[1]["train/grad_norm"] > 0
    assert "from diffusers import QwenImageEditPlusPipeline" in proc.stdout and "image=source, " in proc.stdout
