"""One gloo rank of tests/models/test_qwen3_moe.py's FSDP2 check (a module, so spawn can import it)."""

from __future__ import annotations

import os
import warnings

import torch


def fsdp_rank(rank: int, world_size: int, store_path: str, out_dir: str, shape, state: dict, tokens) -> None:
    """Load `state` into the torchtitan MoE, shard every block with FSDP2, run forward and backward,
    and save this rank's logits, expert shards and the gathered gradient of one expert stack."""
    import torch.distributed as dist

    from hpcrl.trainer import parallel, titan, weights

    warnings.filterwarnings("ignore", message="In CPU autocast")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world_size), rank=rank, world_size=world_size)
    try:
        model = titan.build_model(shape, max_seq_len=64, device="meta")
        model.to_empty(device="cpu")
        titan.init_states(model, device=torch.device("cpu"))
        model.load_state_dict(state, strict=False)
        mesh = parallel.make_dp_mesh(dp_replicate=1, dp_shard=world_size, device_type="cpu")
        parallel.shard_decoder(model, titan.transformer_blocks(model), mesh, param_dtype=None)
        logits = model(tokens)
        logits.float().square().mean().backward()
        params = {titan.clean_name(n): p for n, p in model.named_parameters()}
        w1 = params["layers.0.moe.routed_experts.inner_experts.w1_EFD"]
        parallel.reshard(model)
        down = weights.local_shards(model, titan.hf_to_titan_names(shape), rank=rank, sharded=True)[
            "model.layers.0.mlp.experts.down_proj.weight"]
        torch.save({"logits": logits.detach(), "w1_local": w1.to_local().detach().clone(),
                    "w1_grad": w1.grad.full_tensor(),
                    "down": (down.tensor.clone(), down.global_shape, down.dim0_offset)},
                   os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()
