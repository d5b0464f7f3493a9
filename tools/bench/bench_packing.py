"""Benchmark (issue 39): padded vs packed micro-batches, and row-count vs token-budget ranks, on the long task.

    .venv/bin/python tools/bench/bench_packing.py [--rows 128] [--steps 5] [--threads 1] [--gloo]

The batch is builtin:repeat_x's (configs/tiny_long_grpo.toml): `--rows` rollouts of its train prompts 0, 1, ...
in that order, each the prompt's ids (<bos> "x 37:") and its answer's with <eos> (37 x's: a policy that has
learned the task), so completion lengths are the task's own, 2 to 257 tokens, median ~17. Advantages random
(seed 0), old logprobs -4.5. The same batch for every figure.

1. Share of the trainer's positions that are real tokens, and the train step's time (TrainerEngine.train_step,
   one rank, float32 on CPU, the config's model and options), for right-padded micro-batches of
   `--micro-batch-size` rows and for packed micro-batches of at most `--tokens` tokens. The steps alternate
   between the two engines, so a change in the machine's load hits both; medians after one warm-up step.
2. Two data-parallel ranks: each rank's tokens for the row-count split (contiguous halves, micro-batches of
   `--micro-batch-size` rows, what trainer.micro_batch_size does) and for the token-budget plan
   (hpcrl.plan.micro_batches), and each rank's step time simulated on this one process: each rank's share of
   the batch trained alone, its own micro-batches as that rank would run them (the ranks' steps alternate; medians of `--steps`). The
   slower rank sets the step's time; the figure is slower / faster. "row count, packed" packs each
   contiguous half on its own: the assignment's share of the imbalance, without the padding's.
3. With --gloo, also two real trainer ranks: two processes on this machine in a gloo group (FSDP2 over
   both, one torch thread each), each calling TrainerEngine.train_share on the whole batch, row-count
   (padded) and token-budget engines alternating; the step's wall time (the slower rank sets it), and each
   rank's own work: the CPU time each spent in the step's forwards and backwards (StepMetrics'
   time_rank_busy_max_s / _min_s; a rank waiting in a collective for the other uses no CPU), slower / faster.
4. With --slurm-ranks, the same two ranks as the tasks of one srun on two nodes of a cluster (the local one's
   namespaced nodes: each rank its own node and network), meeting at MASTER_ADDR:MASTER_PORT over gloo:

       srun -N2 -n2 -w n2,n3 --export=ALL,MASTER_ADDR=198.18.2.2,GLOO_SOCKET_IFNAME=eth0 \
           .venv/bin/python tools/bench/bench_packing.py --slurm-ranks --steps 5
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

CONFIG = REPO / "configs" / "tiny_long_grpo.toml"


def long_task_batch(rows: int, vocab: dict[str, int]):
    """The repeat_x batch described in the module docstring, as the head sends it (TrainBatch)."""
    from hpcrl.data.builtin import repeat_x
    from hpcrl.trainer import TrainBatch

    g = torch.Generator().manual_seed(0)
    ids, masks, logprobs = [], [], []
    for index in range(rows):
        example = repeat_x("train", index)
        prompt = [vocab["<bos>"]] + [vocab[c if c != " " else "Ġ"] for c in example["prompt"]]
        completion = [vocab["x"]] * len(example["answer"]) + [vocab["<eos>"]]
        ids.append(prompt + completion)
        masks.append([0] * len(prompt) + [1] * len(completion))
        logprobs.append([0.0] * len(prompt) + [-4.5] * len(completion))
    return TrainBatch(prompt_ids=[str(i) for i in range(rows)], input_ids=ids, policy_mask=masks, logprobs=logprobs,
                      advantages=torch.randn(rows, generator=g).tolist(), rewards=[0.0] * rows)


def positions_padded(lengths: list[int], micro_batch_size: int) -> int:
    """Positions the padded path computes: each micro-batch's rows x its longest row (RolloutBatch.rows)."""
    return sum(len(chunk) * max(max(chunk), 2) for chunk in
               (lengths[i:i + micro_batch_size] for i in range(0, len(lengths), micro_batch_size)))


def _gloo_rank(rank: int, store_path: str, args: argparse.Namespace, out: str, init_method: str | None = None) -> None:
    import json

    import torch.distributed as dist

    from hpcrl.config import load_config
    from hpcrl.trainer import TrainerEngine

    torch.set_num_threads(1)
    if init_method is None:
        dist.init_process_group("gloo", store=dist.FileStore(store_path, 2), rank=rank, world_size=2)
    else:
        dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=2)
    try:
        config = load_config(CONFIG)
        vocab = json.loads((REPO / config.model.path / "tokenizer.json").read_text())["model"]["vocab"]
        train = long_task_batch(args.rows, vocab)
        engines = {"row count": TrainerEngine.from_config(config, micro_batch_tokens=0,
                                                          micro_batch_size=args.micro_batch_size),
                   "token budget": TrainerEngine.from_config(config, micro_batch_tokens=args.tokens)}
        times: dict[str, list[float]] = {name: [] for name in engines}
        busy: dict[str, list[tuple[float, float]]] = {name: [] for name in engines}
        for step in range(args.steps + 1):
            for name, engine in engines.items():
                dist.barrier()
                start = time.perf_counter()
                metrics = engine.train_share(train)
                if step:
                    times[name].append(time.perf_counter() - start)
                    busy[name].append((metrics.time_rank_busy_max_s, metrics.time_rank_busy_min_s))
        if rank == 0:
            Path(out).write_text(json.dumps({name: {
                "step_s": statistics.median(times[name]),
                "busy_max_s": statistics.median(b[0] for b in busy[name]),
                "busy_min_s": statistics.median(b[1] for b in busy[name]),
                "busy_ratio": statistics.median(b[0] / b[1] for b in busy[name])} for name in engines}))
    finally:
        dist.destroy_process_group()


def gloo_step_times(args: argparse.Namespace) -> dict[str, dict[str, float]]:
    """Median step time and rank CPU times of each assignment on two real gloo ranks (section 3 of the module
    docstring)."""
    import json
    import tempfile

    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "times.json")
        mp.start_processes(_gloo_rank, args=(str(Path(tmp) / "store"), args, out), nprocs=2, start_method="spawn")
        return json.loads(Path(out).read_text())


def print_ranks(title: str, real: dict[str, dict[str, float]]) -> None:
    print(f"\n{title}: step wall time, and each rank's CPU time in the step (slower / faster)")
    for name, row in real.items():
        print(f"  {name:14} step {row['step_s']:.3f} s   busy {row['busy_max_s']:.3f} / {row['busy_min_s']:.3f} s"
              f" = {row['busy_ratio']:.2f}")
    print(f"  token budget / row count step time: {real['token budget']['step_s'] / real['row count']['step_s']:.2f}x")


def slurm_ranks(args: argparse.Namespace) -> int:
    """Section 4 of the module docstring: this process is task SLURM_PROCID of a two-task srun."""
    import json
    import os
    import tempfile

    rank = int(os.environ["SLURM_PROCID"])
    address = f"tcp://{os.environ['MASTER_ADDR']}:{os.environ.get('MASTER_PORT', '29517')}"
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "ranks.json"
        _gloo_rank(rank, "", args, str(out), init_method=address)
        if rank == 0:
            print(f"batch: {args.rows} rollouts of builtin:repeat_x; ranks on nodes of one srun "
                  f"({os.environ.get('SLURM_JOB_NODELIST', '?')}), torch threads 1")
            print_ranks("2 ranks on 2 nodes (FSDP2 over gloo)", json.loads(out.read_text()))
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=128)
    parser.add_argument("--steps", type=int, default=5, help="timed steps per engine (after one warm-up)")
    parser.add_argument("--micro-batch-size", type=int, default=8, help="rows per padded micro-batch")
    parser.add_argument("--tokens", type=int, default=2048, help="tokens per packed micro-batch")
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    parser.add_argument("--gloo", action="store_true", help="also time two real gloo ranks")
    parser.add_argument("--slurm-ranks", action="store_true",
                        help="only the two real ranks, as the two tasks of an srun (module docstring, 4.)")
    args = parser.parse_args()
    if args.slurm_ranks:
        return slurm_ranks(args)
    torch.set_num_threads(args.threads)

    import json

    from hpcrl.config import load_config
    from hpcrl.plan.micro_batches import plan_by_rows, plan_micro_batches
    from hpcrl.trainer import TrainerEngine

    config = load_config(CONFIG)
    vocab = json.loads((REPO / config.model.path / "tokenizer.json").read_text())["model"]["vocab"]
    train = long_task_batch(args.rows, vocab)
    batch = train.rows()
    lengths = train.lengths()
    real = sum(lengths)
    padded = TrainerEngine.from_config(config, micro_batch_tokens=0, micro_batch_size=args.micro_batch_size)
    packed = TrainerEngine.from_config(config, micro_batch_tokens=args.tokens)
    packed_plan = plan_micro_batches(lengths, ranks=1, budget=args.tokens)
    packed_positions = sum(sum(lengths[r] for r in micro) or 2 for micro in packed_plan.ranks[0])
    completion = sorted(sum(m) for m in train.policy_mask)
    print(f"batch: {args.rows} rollouts of builtin:repeat_x, {real} tokens; completion tokens {completion[0]} to "
          f"{completion[-1]}, median {statistics.median(completion):g}; torch threads {args.threads}")

    times: dict[str, list[float]] = {"padded": [], "packed": []}
    for step in range(args.steps + 1):
        for name, engine in (("padded", padded), ("packed", packed)):
            start = time.perf_counter()
            engine.train_step(batch)
            if step:
                times[name].append(time.perf_counter() - start)
    pad_s, pack_s = statistics.median(times["padded"]), statistics.median(times["packed"])
    print(f"\n{'':28}{'positions':>10}{'real share':>12}{'step s':>9}")
    print(f"{f'padded, {args.micro_batch_size} rows a micro-batch':28}{positions_padded(lengths, args.micro_batch_size):>10}"
          f"{100 * real / positions_padded(lengths, args.micro_batch_size):>11.1f}%{pad_s:>9.3f}")
    print(f"{f'packed, <= {args.tokens} tokens':28}{packed_positions:>10}{100 * real / packed_positions:>11.1f}%"
          f"{pack_s:>9.3f}")
    print(f"packed / padded step time: {pack_s / pad_s:.2f}x")

    print("\n2 ranks              rank 0 tokens  rank 1 tokens  micro-batches  rank 0 s  rank 1 s  slower/faster")
    by_rows = plan_by_rows(lengths, ranks=2, micro_batch_size=args.micro_batch_size)
    by_tokens = plan_micro_batches(lengths, ranks=2, budget=args.tokens)
    cases = (("row count", by_rows, padded), ("row count, packed", by_rows, packed), ("token budget", by_tokens, packed))
    for name, plan, engine in cases:
        shares = []
        for rank in range(2):
            mine = train.take(list(plan.rows(rank))).rows()
            micro = None
            if plan is by_tokens:  # the planned micro-batches, as indices into the rank's rows
                micro, start = [], 0
                for chunk in plan.ranks[rank]:
                    micro.append(list(range(start, start + len(chunk))))
                    start += len(chunk)
            shares.append((mine, micro))
        rank_times: list[list[float]] = [[], []]
        for step in range(args.steps + 1):  # the ranks alternate, as the engines above
            for rank, (mine, micro) in enumerate(shares):
                start = time.perf_counter()
                engine.train_step(mine, micro_batches=micro)
                if step:
                    rank_times[rank].append(time.perf_counter() - start)
        seconds = [statistics.median(t) for t in rank_times]
        tokens = plan.tokens()
        count = len(plan.ranks[0]) if engine is padded or plan is by_tokens else "-"
        print(f"{name:20}{tokens[0]:>14}{tokens[1]:>15}{count:>15}{seconds[0]:>10.3f}{seconds[1]:>10.3f}"
              f"{max(seconds) / min(seconds):>14.2f}")
    if args.gloo:
        print_ranks("2 gloo ranks on this machine (FSDP2)", gloo_step_times(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
