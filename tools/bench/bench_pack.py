"""Pack and unpack GB/s of a real transfer plan, every packing path side by side, against a device copy.

    PYTHONPATH=. python tools/bench/bench_pack.py --device cuda --json     # on a GPU (tools/gpu/gpu_check.py calls bench())
    PYTHONPATH=. python tools/bench/bench_pack.py --device cpu --plans 8x8 # on CPU (2x2 needs ~10 GB of RAM)

Plans: Llama-3 1B shapes (hpcrl.config.model_shapes.preset("llama3-1b")), trainer FSDP F -> one
inference replica at TP T ("FxT": 2x2 and 8x8 by default), bf16 wire, random float32 master shards
of trainer rank 0. What is timed, as in issue 30's first GPU measurement: the messages of trainer
rank 0 -> TP rank 0, grouped by the plan's rounds (hpcrl.plan.transfer.rounds):

  pack    float32 shards -> bf16 staging, one call per round (hpcrl.transfer.packing.Packer.run)
  unpack  bf16 staging -> the bf16 destination tensors of TP rank 0
  copy    a device-to-device copy of the same number of wire bytes (dst.copy_(src), uint8)

for each path: "loop" (the block-by-block copy: the reference), "gather" (torch index ops), and
"triton" (one kernel per round; CUDA with Triton only); the gather path without its index budget. Every path's staging bytes and destination
bytes are compared with the loop's, bit for bit, before anything is timed ("exact" in the output).
GB/s are wire bytes per second (pack also reads the float32 shards: 3x the bytes a copy moves per
wire byte, 6 bytes against 4). Times are the best of 3 means over --repeats runs. `setup_s` is the first call, which makes the index tensors (once per
plan in a run); `index_mib` the device memory they hold.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

DEFAULT_PLANS = ("2x2", "8x8")


def _sync(device) -> None:
    import torch
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(run, device, repeats: int, trials: int = 3) -> float:
    """Seconds per run: the best of `trials` means over `repeats` runs, after a warm-up."""
    run()
    _sync(device)
    best = float("inf")
    for _ in range(trials):
        t0 = time.perf_counter()
        for _ in range(repeats):
            run()
        _sync(device)
        best = min(best, (time.perf_counter() - t0) / repeats)
    return best


def bench_plan(fsdp: int, tp: int, *, device: str = "cuda", repeats: int = 10, model: str = "llama3-1b",
               paths: tuple[str, ...] | None = None, seed: int = 0) -> dict:
    """One plan's figures (see the module docstring); raises nothing for a path that fails, records it."""
    import torch

    from hpcrl.config.model_shapes import preset
    from hpcrl.plan.transfer.layout import InferenceLayout, TrainerLayout, chunk_rows
    from hpcrl.plan.transfer.planner import plan as make_plan
    from hpcrl.transfer import execute, packing

    dev = torch.device(device, 0) if device == "cuda" else torch.device(device)
    p = make_plan(TrainerLayout(dp_shard=fsdp), InferenceLayout(replicas=1, tensor_parallel=tp), preset(model),
                  wire_dtype="bfloat16")
    wire = execute.TORCH_DTYPES[p.wire_dtype]
    gen = torch.Generator(device=dev).manual_seed(seed)
    shards = {}
    for s in p.sources:
        a, e = chunk_rows(s.shape[0], fsdp)[0]
        shards[s.name] = torch.randn((e - a, s.shape[1]), generator=gen, device=dev, dtype=torch.float32)
    sources = execute.check_sources(p, 0, shards)
    batches = [b for b in ([m for m in batch if m.src_rank == 0 and m.replica == 0 and m.tp_rank == 0]
                           for batch in execute.schedule(p)) if b]
    numel = [sum(m.numel for m in b) for b in batches]
    nbytes = sum(numel) * p.itemsize
    staging = [torch.empty(n, dtype=wire, device=dev) for n in numel]
    if paths is None:
        paths = ("loop", "gather") + (("triton",) if dev.type == "cuda" and packing.triton_available() else ())
    paths = tuple(sorted(paths, key=lambda x: x != "loop"))  # the loop first: the others are checked against it
    out: dict = {"plan": f"{model}, FSDP {fsdp} -> TP {tp}", "device": str(dev), "bytes": nbytes,
                 "messages": sum(len(b) for b in batches), "blocks": sum(m.stop - m.start for b in batches for m in b),
                 "rounds": len(batches), "tensors": len({int(i) for b in batches for m in b
                                                         for i in p.blocks["source"][m.start:m.stop]}),
                 "repeats": repeats, "paths": {}}
    src, dst = (torch.empty(nbytes, dtype=torch.uint8, device=dev) for _ in range(2))
    out["copy_gb_per_s"] = round(nbytes / _timed(lambda: dst.copy_(src), dev, repeats) / 1e9, 2)
    reference: dict = {}
    for path in paths:
        row: dict = {}
        try:
            dests = {d.name: torch.zeros(d.local_shape, dtype=wire, device=dev) for d in p.dests}
            flat = execute.check_dests(p, 0, 0, dests)
            packer = packing.Packer(p, batches, "pack", dev, path=path, index_budget_bytes=1 << 40)
            unpacker = packing.Packer(p, batches, "unpack", dev, path=path, index_budget_bytes=1 << 40)
            packer.bind(sources)
            unpacker.bind(flat)

            def pack(packer=packer) -> None:
                for k, buf in enumerate(staging):
                    packer.run(k, buf)

            def unpack(unpacker=unpacker) -> None:
                for k, buf in enumerate(staging):
                    unpacker.run(k, buf)

            t0 = time.perf_counter()
            for buf in staging:
                buf.fill_(-7.0)
            pack()
            unpack()
            _sync(dev)
            row["setup_s"] = round(time.perf_counter() - t0, 3)
            if path == paths[0]:
                reference = {"staging": [b.clone() for b in staging], "dests": {n: t.clone() for n, t in dests.items()}}
            row["exact"] = (all(torch.equal(a.view(torch.int16), b.view(torch.int16))
                                for a, b in zip(reference["staging"], staging)) and
                            all(torch.equal(reference["dests"][n].view(torch.int16), t.view(torch.int16))
                                for n, t in dests.items()))
            row["index_mib"] = round((packer.index_bytes + unpacker.index_bytes) / 2**20, 1)
            pack_s, unpack_s = _timed(pack, dev, repeats), _timed(unpack, dev, repeats)
            row.update(pack_gb_per_s=round(nbytes / pack_s / 1e9, 2), unpack_gb_per_s=round(nbytes / unpack_s / 1e9, 2),
                       pack_vs_copy=round(nbytes / pack_s / 1e9 / out["copy_gb_per_s"], 3),
                       unpack_vs_copy=round(nbytes / unpack_s / 1e9 / out["copy_gb_per_s"], 3))
            del dests, flat, packer, unpacker
        except Exception as err:  # noqa: BLE001 - recorded: the other paths still run
            row["error"] = f"{type(err).__name__}: {err}"
        out["paths"][path] = row
    return out


def bench(*, device: str = "cuda", plans: tuple[str, ...] = DEFAULT_PLANS, repeats: int = 10,
          paths: tuple[str, ...] | None = None) -> dict:
    """Every plan "FxT" of `plans` on `device`: {"torch", "device_name", "plans": [bench_plan(...)]}."""
    import torch

    name = torch.cuda.get_device_name(0) if device == "cuda" else "cpu"
    results = []
    for spec in plans:
        fsdp, tp = (int(x) for x in spec.split("x"))
        results.append(bench_plan(fsdp, tp, device=device, repeats=repeats, paths=paths))
        if device == "cuda":
            torch.cuda.empty_cache()
    return {"torch": torch.__version__, "device_name": name, "plans": results}


def markdown(result: dict) -> str:
    lines = ["| plan | path | pack GB/s | unpack GB/s | copy GB/s | pack / copy | unpack / copy | exact | index MiB |"
             " setup s |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in result["plans"]:
        what = f"{r['plan']} ({r['messages']} messages, {r['blocks']} blocks, {r['rounds']} rounds)"
        for path, row in r["paths"].items():
            if "error" in row:
                lines.append(f"| {what} | {path} | {row['error']} | | | | | | | |")
                continue
            lines.append(f"| {what} | {path} | {row['pack_gb_per_s']} | {row['unpack_gb_per_s']} | "
                         f"{r['copy_gb_per_s']} | {row['pack_vs_copy']:.1%} | {row['unpack_vs_copy']:.1%} | "
                         f"{row['exact']} | {row['index_mib']} | {row['setup_s']} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--plans", default=",".join(DEFAULT_PLANS), help="FSDPxTP, comma-separated (default 2x2,8x8)")
    ap.add_argument("--paths", default=None, help="comma-separated subset of loop,gather,triton (default: all that run)")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--json", action="store_true", help="print JSON instead of a markdown table")
    args = ap.parse_args()
    result = bench(device=args.device, plans=tuple(args.plans.split(",")), repeats=args.repeats,
                   paths=tuple(args.paths.split(",")) if args.paths else None)
    print(json.dumps(result, indent=1) if args.json else markdown(result))


if __name__ == "__main__":
    main()
