"""Golden vectors for the ImageReward port: a SMALL, random-initialised ImageReward built from THUDM's
ORIGINAL code (the `image-reward` package: ImageReward/ImageReward.py, models/BLIP/*), scored one
(image, prompt) pair at a time with the original `ImageReward.score(prompt, pil_image)`.

Run it in a side venv that holds the original package, never the project's (~1 min from a pip index):

    python -m venv /work/scratch/irvenv
    /work/scratch/irvenv/bin/pip install image-reward==1.5 transformers==4.44.2 timm==0.6.13 fairscale \\
        torch==2.14.1 torchvision==0.29.1 "huggingface_hub<0.25" clip-anytorch
    /work/scratch/irvenv/bin/pip install "setuptools<70"  # clip needs pkg_resources; torch wants >=77
    /work/scratch/irvenv/bin/python tests/data/imagereward/make_golden.py [OUT_DIR]

(In one pip call "setuptools<70" conflicts with torch 2.14.1's setuptools>=77.0.3, hence two.) OUT_DIR
defaults to this script's folder. It writes ImageReward.pt (exactly `torch.save(model.state_dict())`, the
original key names), med_config.json, vocab.txt (BERT vocabulary; the original adds [DEC] and [ENC] on top),
images/*.png (uint8 RGB), golden.json (prompts, the original tokenizer's ids, scores, versions).
Deterministic: a rerun writes bitwise the same files (measured with 1 and 2 threads); on another CPU the
scores may move by ~1e-6. About 3 MB in all.

What is the original and what is ours:
* all that computes a score is the package's code: VisionTransformer (vit.py), BLIP_Pretrain (with med.py's
  BertModel and blip.py's init_tokenizer), MLP, _transform and ImageReward.score (ImageReward.py);
* only sizes change: ImageReward.__init__ hard-codes BLIP_Pretrain(image_size=224, vit='large') and
  MLP(768), so the same pieces are assembled here at ImageReward's image size 224 with a ViT of width 128
  (heads = width // 64 = 2 of 64 as in ViT-L's 16 x 64, depth 2, patch 16, MLP 256), a BERT of hidden 32 (2
  heads of 16, 2 layers, cross-attention to the 197 image tokens), MLP(32) and embed_dim 16 for BLIP's
  vision_proj / text_proj (256 in the original; the score never reads them); `create_vit` is swapped for one
  building that small VisionTransformer, and BertTokenizer.from_pretrained('bert-base-uncased') (a hub
  download) reads our vocab.txt instead;
* the weights are re-drawn (seeded) so activations are O(1) and scores differ between images and prompts.

Images (H x W): four at the native 224 x 224 (one pure noise); 300x256, 227x320 and 384x512 go through the
original's Resize(224, BICUBIC) of the shorter side (the longer truncated: 262, 315, 298) and CenterCrop(224)
(offsets rounded: 19 rows; round(45.5) = 46 and 37 columns). Prompts: one of 42 word pieces, truncated to the
original's 35 tokens in the middle of a word ("circle" kept, its "##s" cut), unknown words, an empty one.

Two scores per pair: `pil` is the official path (PIL image -> torchvision Resize(224, BICUBIC) on PIL ->
CenterCrop -> ToTensor -> Normalize -> ImageReward.score); `tensor` runs the same torchvision Resize /
CenterCrop / Normalize on the float [0, 1] tensor (torch bicubic with antialias, clamped to [0, 1] after the
resize as PIL's uint8 output is) and then the body of ImageReward.score. Both agree at the native size (the
resize is skipped there); at other sizes `pil` differs from any float pipeline by PIL's fixed-point filter
and uint8 rounding (here up to 1.1e-3 in the score).
"""
import importlib
import json
import os
import sys
from importlib.metadata import version

import numpy as np
import torch
from PIL import Image

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.abspath(sys.argv[1]) if len(sys.argv) > 1 else HERE
# BLIP ViT: ImageReward's own image size 224 and patch 16, 64-wide heads as in ViT-L (1024 = 16 x 64), small
IMAGE_SIZE, PATCH, VISION_WIDTH, VISION_DEPTH, MLP_RATIO = 224, 16, 128, 2, 2
VISION_HEADS = VISION_WIDTH // 64  # 2
MED_CONFIG = {  # BLIP's med_config.json, small (real: hidden 768, 12 heads, 12 layers, 3072, vocab 30524)
    "architectures": ["BertModel"], "attention_probs_dropout_prob": 0.1, "hidden_act": "gelu",
    "hidden_dropout_prob": 0.1, "hidden_size": 32, "initializer_range": 0.02, "intermediate_size": 64,
    "layer_norm_eps": 1e-12, "max_position_embeddings": 64, "model_type": "bert", "num_attention_heads": 2,
    "num_hidden_layers": 2, "pad_token_id": 0, "type_vocab_size": 2, "vocab_size": None,
    "encoder_width": VISION_WIDTH, "add_cross_attention": True,
}
WORDS = ["a", "an", "the", "of", "on", "in", "under", "with", "and", "photo", "cat", "dog", "red", "blue",
         "green", "circle", "square", "table", "garden", "sky", "two", "three", "small", "big", "sitting",
         "running", ",", ".", "##s", "##ing", "##e"]
VOCAB = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + WORDS
PROMPTS = [
    "a photo of a cat",
    "two red circles on the table",
    "A Blue Dog, running in the garden.",  # case and punctuation
    "zebra xylophone under a green sky",  # words outside the vocabulary -> [UNK]
    ("a photo of a small cat and a big dog sitting on the red table in the green garden under the blue sky, "
     "with three green squares and two red circles on the table, running in the sky"),  # 42 word pieces ->
    "",  # [CLS] + the first 33 + [SEP]; the 33rd is "circle" of "circle ##s": the cut splits a word
]
EXTRA = ["[ENC] a cat [DEC]", "a photo of a cat " * 12]  # tokenised only: the added tokens, 60 words
SEED = 2  # weights, then images; of seeds 0-3 the draw whose scores spread most over images and prompts
# (H, W, grain): smooth ramps + a disk + noise constant over grain x grain blocks (PNG stays small), 0: pure
# noise. Four at the native 224 x 224 (no resize; tests/test_rewards.py stacks images[:4]); three resized by
# the shorter side to 224 (torchvision truncates the longer one) and centre-cropped (offset rounded): 300x256
# -> 262x224 (top 19), 227x320 -> 224x315 (left round(45.5) = 46), 384x512 -> 224x298 (left 37, 1.7x down)
IMAGES = [(224, 224, 2), (224, 224, 4), (224, 224, 8), (224, 224, 0), (300, 256, 2), (227, 320, 2),
          (384, 512, 4)]


def make_images(g):
    """Smooth colour ramps with a disk and mild noise (resizing pure noise is a pathological case), and one
    pure-noise image at the native size."""
    out = []
    for h, w, grain in IMAGES:
        if grain == 0:
            out.append(torch.randint(0, 256, (3, h, w), generator=g, dtype=torch.uint8))
            continue
        yy, xx = torch.meshgrid(torch.linspace(0, 1, h), torch.linspace(0, 1, w), indexing="ij")
        c = torch.rand(3, 3, generator=g)
        img = c[:, 0, None, None] * yy + c[:, 1, None, None] * xx + 0.3 * c[:, 2, None, None]
        cy, cx, r = (torch.rand(3, generator=g) * torch.tensor([h, w, min(h, w) / 2])).tolist()
        disk = ((yy * h - cy) ** 2 + (xx * w - cx) ** 2 < (r + 3) ** 2).float()
        img = img * (1 - disk) + torch.rand(3, 1, 1, generator=g) * disk
        noise = torch.randn(3, -(-h // grain), -(-w // grain), generator=g)
        img = img + 0.05 * noise.repeat_interleave(grain, 1).repeat_interleave(grain, 2)[:, :h, :w]
        out.append((img.clamp(0, 1) * 255).round().to(torch.uint8))
    return out


def build_model(med_config_path, vocab_dir):
    """The original classes at small sizes (see the module docstring)."""
    from ImageReward.models.BLIP import blip, blip_pretrain
    from ImageReward.models.BLIP.vit import VisionTransformer
    from torch import nn
    from transformers import BertTokenizer

    IR = importlib.import_module("ImageReward.ImageReward")  # the module (its name is also the class)

    offline = BertTokenizer.from_pretrained
    blip.BertTokenizer.from_pretrained = lambda name, *a, **k: offline(vocab_dir)  # instead of the hub's

    def small_vit(vit, image_size, use_grad_checkpointing=False, ckpt_layer=0, drop_path_rate=0):
        vit = VisionTransformer(img_size=image_size, patch_size=PATCH, embed_dim=VISION_WIDTH,
                                depth=VISION_DEPTH, num_heads=VISION_HEADS, mlp_ratio=MLP_RATIO,
                                drop_path_rate=0.1)  # as create_vit's 'large'
        return vit, VISION_WIDTH

    blip_pretrain.create_vit = small_vit
    model = IR.ImageReward.__new__(IR.ImageReward)  # ImageReward.__init__ with the sizes changed
    nn.Module.__init__(model)
    model.device = "cpu"
    model.blip = blip_pretrain.BLIP_Pretrain(image_size=IMAGE_SIZE, vit="large", med_config=med_config_path,
                                             embed_dim=16)  # 256 originally: the unused vision/text_proj
    model.preprocess = IR._transform(IMAGE_SIZE)
    model.mlp = IR.MLP(model.blip.text_encoder.config.hidden_size)
    model.mean, model.std = 0.16717362830052426, 1.0333394966054072
    return model.eval()


@torch.no_grad()
def randomise(model, g):
    """Seeded O(1) weights: N(0, 1/fan_in) matrices, N(0, 0.1) biases, 1 + N(0, 0.2) LayerNorm scales,
    N(0, 0.5) embeddings (the default init makes every score nearly equal)."""
    for name, p in model.named_parameters():
        if name.endswith("bias"):
            p.copy_(0.1 * torch.randn(p.shape, generator=g))
        elif "norm" in name.lower():
            p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g))
        elif name.endswith(("word_embeddings.weight", "position_embeddings.weight", "pos_embed",
                            "cls_token")):
            p.copy_(0.5 * torch.randn(p.shape, generator=g))
        else:  # Linear and the patch Conv2d
            p.copy_(torch.randn(p.shape, generator=g) / p[0].numel() ** 0.5)


def main():
    import torchvision.transforms as T

    os.makedirs(os.path.join(OUT, "images"), exist_ok=True)
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(SEED)
    with open(os.path.join(OUT, "vocab.txt"), "w") as f:
        f.write("\n".join(VOCAB) + "\n")
    med = dict(MED_CONFIG, vocab_size=len(VOCAB) + 2)  # + [DEC] and [ENC], as init_tokenizer adds them
    with open(os.path.join(OUT, "med_config.json"), "w") as f:
        json.dump(med, f, indent=2)
    model = build_model(os.path.join(OUT, "med_config.json"), OUT)
    randomise(model, g)
    torch.save(model.state_dict(), os.path.join(OUT, "ImageReward.pt"))
    state = torch.load(os.path.join(OUT, "ImageReward.pt"), map_location="cpu", weights_only=True)
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())
    tok = model.blip.tokenizer

    images, names = make_images(g), []
    for k, img in enumerate(images):
        names.append(f"images/{k}_{img.shape[1]}x{img.shape[2]}.png")
        Image.fromarray(img.permute(1, 2, 0).numpy()).save(os.path.join(OUT, names[-1]))
    # the same transforms on the float tensor; PIL clips to uint8 after resizing, so clamp there too
    resize, crop, _, _, norm = model.preprocess.transforms  # the ones between: convert('RGB'), ToTensor()
    tensor_path = T.Compose([resize, lambda x: x.clamp(0, 1), crop, norm])

    def tensor_score(prompt, x):  # ImageReward.score's body after its own preprocessing line
        text = tok(prompt, padding="max_length", truncation=True, max_length=35, return_tensors="pt")
        emb = model.blip.visual_encoder(tensor_path(x)[None])
        out = model.blip.text_encoder(text.input_ids, attention_mask=text.attention_mask,
                                      encoder_hidden_states=emb, return_dict=True,
                                      encoder_attention_mask=torch.ones(emb.shape[:-1], dtype=torch.long))
        return ((model.mlp(out.last_hidden_state[:, 0, :].float()) - model.mean) / model.std).item()

    pil, tensor = [], []
    with torch.no_grad():
        for name, img in zip(names, images):
            pil_image = Image.open(os.path.join(OUT, name))
            pil.append([model.score(p, pil_image) for p in PROMPTS])  # the original, one pair at a time
            tensor.append([tensor_score(p, img.float() / 255) for p in PROMPTS])
    ids = [tok(p, padding="max_length", truncation=True, max_length=35).input_ids for p in PROMPTS + EXTRA]
    golden = {
        "about": "ImageReward scores of a small random-initialised model, original code; see make_golden.py",
        "versions": {p: version(p) for p in ["image-reward", "transformers", "timm", "torch", "torchvision",
                                             "pillow", "fairscale"]},
        "image_size": IMAGE_SIZE, "vision": {"width": VISION_WIDTH, "depth": VISION_DEPTH,
                                             "heads": VISION_HEADS, "mlp": MLP_RATIO * VISION_WIDTH,
                                             "patch": PATCH, "layer_norm_eps": 1e-6},
        "images": names, "prompts": PROMPTS, "tokenized_only": EXTRA,
        "special_tokens": {"[DEC]": tok.convert_tokens_to_ids("[DEC]"), "[ENC]": tok.enc_token_id,
                           "[CLS]": tok.cls_token_id, "[SEP]": tok.sep_token_id, "[PAD]": tok.pad_token_id},
        "input_ids": ids, "input_ids_note": "original tokenizer, max_length 35, for prompts + tokenized_only",
        "scores_pil": pil, "scores_tensor": tensor,
        "score_note": "scores_*[i][j]: image i with prompts[j], one pair per call; pil: the original "
                      "ImageReward.score on the PIL image; tensor: the same torchvision transforms on the "
                      "float tensor (torch bicubic antialias, clamped to [0, 1] after resizing), same model",
        "unused_keys": sorted(k for k in state if k.startswith(("blip.vision_proj", "blip.text_proj"))
                              or k.endswith("position_ids")),
    }
    with open(os.path.join(OUT, "golden.json"), "w") as f:
        json.dump(golden, f, indent=1)
    print(np.array(pil).round(4), "\n", (np.array(pil) - np.array(tensor)).round(6))
    print([sum(m != 0 for m in i) for i in ids], ids[-2])


if __name__ == "__main__":
    main()
