"""`hpcrl export RUN_DIR`: a LoRA run's adapter as a PEFT directory, or merged into a full HF checkpoint.

    hpcrl export runs/tiny-lora-grpo                     # newest checkpoint -> RUN_DIR/export/step_N/adapter
    hpcrl export runs/tiny-lora-grpo --step 50 --merged  # -> RUN_DIR/export/step_50/merged
    hpcrl export runs/tiny-lora-grpo --out /tmp/adapter

The adapter directory (adapter_config.json + adapter_model.safetensors) loads with peft's
PeftModel.from_pretrained on the base model and in vLLM's LoRA; the merged one with transformers'
AutoModelForCausalLM.from_pretrained. hpcrl.trainer.export does the work.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from hpcrl.errors import HpcrlError


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("export", help="write a LoRA run's adapter (PEFT) or merged model (HF)",
                                   description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", metavar="RUN_DIR")
    parser.add_argument("--step", type=int, metavar="N", default=None, help="the checkpoint of step N (default newest)")
    parser.add_argument("--out", metavar="DIR", default=None, help="where to write (default RUN_DIR/export/step_N/...)")
    parser.add_argument("--merged", action="store_true",
                        help="a full Hugging Face checkpoint, W + (alpha/r) B A, instead of the adapter")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from hpcrl.cli import load_run_config
    from hpcrl.config.model_shapes import shape_of
    from hpcrl.rl.checkpointing import TRAINER_DIR, newest_checkpoint, store_for

    config = load_run_config(args.run_dir)
    run_dir = config.run_dir
    if config.lora is None:
        raise HpcrlError(f"{run_dir} is a run without LoRA (its config has no [lora] table): its checkpoints hold "
                         "every weight, there is no adapter to export")
    store = store_for(config)
    if args.step is None:
        found = newest_checkpoint(config, store)
        if found is None:
            raise HpcrlError(f"{run_dir} has no complete checkpoint to export; let the run reach "
                             f"trainer.checkpoint_interval ({config.trainer.checkpoint_interval} steps)")
        step, path = found.step, found.path
    else:
        step, path = args.step, store.path(args.step)
        problems = store.verify(args.step, checksums=False)
        if problems:
            raise HpcrlError(f"{path}: no complete checkpoint of step {args.step} ({problems[0]}); "
                             f"the run has: {', '.join(p.name for p in sorted(store.root.glob('step_*'))) or 'none'}")
    return export(config, shape_of(config.model), path / TRAINER_DIR, step=step, out=args.out, merged=args.merged)


def export(config, shape, trainer_dir: Path, *, step: int, out: str | None, merged: bool) -> int:
    import torch

    from hpcrl.trainer import export as exporting
    from hpcrl.trainer.checkpoint import base_identity

    assert config.lora is not None
    adapters = exporting.read_adapters(trainer_dir, shape, config.lora)
    base = exporting.base_of(trainer_dir)
    target = Path(out) if out else Path(config.run_dir) / "export" / f"step_{step}" / ("merged" if merged else "adapter")
    if merged:
        if base_identity(base["path"])["sha256"] != base["sha256"]:
            raise HpcrlError(f"the base model at {base['path']} is not the one step {step} was trained on (its "
                             "safetensors' sha256 differs); restore it, or export the adapter alone")
        exporting.write_merged(target, adapters, config.lora, base=base["path"])
    else:
        dtype = getattr(torch, config.model.dtype)
        exporting.write_peft(target, adapters, config.lora, base=base["path"], dtype=dtype)
    print(f"wrote {'the merged model' if merged else 'the adapter'} of step {step} to {target}")
    return 0
