"""Distributed checks on tiny models, run by tests/test_memory.py under `torchrun --nproc_per_node 2`:

    python -m torch.distributed.run --standalone --nproc_per_node 2 tests/dist_checks.py OUT.json CHECKPOINT_ROOT

- "dtypes": the dtypes a sharded (FSDP2, bf16) Flux transformer's blocks receive, next to an unsharded bf16
  one's (LoRA path): RoPE must stay float32.
- "bookkeeping": the length of a sharded reference model's FSDP2 forward record after each of 5 "iterations"
  of no-grad forwards inside common.as_reference.
- "resume": the checkpoint rundir.resume_checkpoint picks on each rank when rank 1's own listing would pick
  another one (a stale network file system).
Rank 0 writes the results to OUT.json.
"""
import json
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "toy")]
import rundir  # noqa: E402
from common import as_reference, close_distributed, make_trainable, setup_distributed, velocity  # noqa: E402
from tiny import build_flux  # noqa: E402


def block_dtypes(transformer, x, emb):
    seen = {}

    def hook(module, args, kwargs):
        rope = kwargs["image_rotary_emb"]
        seen[type(module).__name__.removeprefix("FSDP")] = {"hidden": str(kwargs["hidden_states"].dtype),
                                                            "temb": str(kwargs["temb"].dtype),
                                                            "rope": [str(r.dtype) for r in rope]}

    handles = [transformer.transformer_blocks[0].register_forward_pre_hook(hook, with_kwargs=True),
               transformer.single_transformer_blocks[0].register_forward_pre_hook(hook, with_kwargs=True)]
    with torch.no_grad():
        velocity(transformer, "flux", x, torch.tensor(0.7), emb, guidance=3.5)
    for h in handles:
        h.remove()
    return seen


if __name__ == "__main__":
    torch.set_num_threads(1)
    rank, world, device = setup_distributed()
    out_path, checkpoints = sys.argv[1], sys.argv[2]
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 4, 16, 16, generator=g)
    emb = {"embeds": torch.randn(2, 16, 32, generator=g), "pooled": torch.randn(2, 32, generator=g)}
    result = {}

    unsharded = build_flux(seed=0).transformer.to(torch.bfloat16)
    make_trainable(unsharded, "flux", lora=(4, 8), reference=False)
    result["dtypes"] = {"unsharded": block_dtypes(unsharded, x, emb)}
    transformer = build_flux(seed=0).transformer
    _, ref = make_trainable(transformer, "flux", lora=None, reference=True, sharded=True, compute_dtype=torch.bfloat16)
    result["dtypes"]["sharded"] = block_dtypes(transformer, x, emb)

    record = []
    for _ in range(5):  # an iteration's reference forwards, as the files run them
        with torch.no_grad(), as_reference(transformer, ref) as reference:
            for _ in range(3):
                velocity(reference, "flux", x, torch.tensor(0.5), emb, guidance=3.5)
        record.append(len(ref._get_fsdp_state()._comm_ctx.post_forward_order))
    result["bookkeeping"] = record

    import dataclasses

    import flow_grpo

    args = flow_grpo.Args()
    real = rundir.latest_checkpoint
    if rank == 1:  # this rank's listing is stale: it would pick another checkpoint
        rundir.latest_checkpoint = lambda path: os.path.join(checkpoints, "checkpoints", "iter_1")
    try:
        ckpt, iteration = rundir.resume_checkpoint(checkpoints, args=args, world=world, script="flow_grpo.py")
    finally:
        rundir.latest_checkpoint = real
    picked = [None] * world
    torch.distributed.all_gather_object(picked, [ckpt, iteration])
    result["resume"] = picked
    result["args"] = dataclasses.asdict(args)
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(result, f)
    close_distributed()
