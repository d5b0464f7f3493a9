"""Benchmark (issue 39): the replicas' idle share of a step, waiting for the batch's last sequence, with partial
rollouts (algorithm.partial_rollouts) on and off, on the long task.

    .venv/bin/python tools/bench/bench_partial.py [--segments 8 16 32] [--steps 4] [--windows 40] [--warm-up 24]

A real vLLM engine (VllmEngine, configs/tiny_long_grpo.toml: the tiny model on CPU, float32) generates the
config's batches: 8 prompts of builtin:repeat_x's train split a step, 16 completions each. The tiny model is
random and would not stop where the task wants, so each completion's budget is its prompt's answer length + 1
(the tokens a policy that has learned the task writes: 2 to 257, median ~17); it seldom samples <eos> before.

off   one generate call a step (n = 16 per prompt, as the controller makes it): every sequence starts in the first
      engine step and the call ends with its longest one.
on    one window a step (hpcrl.rl.partial, as the controller makes it): the carried sequences and the step's new
      ones, each at most `segment` tokens; the first `--warm-up` windows fill the pipeline and are not counted.

idle share, slots = 1 - sum of the tokens each sequence made / (sequences x the longest's tokens): the share of
the call's (sequence, engine step) slots in which a sequence was done while the call waited for its last one
(hpcrl.rl.partial.idle_share), as if every sequence started in the call's first step. idle share, wall time:
the same from vLLM's own times of each request (scheduled, last token; hpcrl.rl.partial.time_idle_share): the
share of (peak running requests x the call's span) not running a request, which also counts the prefill of
carried sequences and a request queued until a slot frees (vLLM's max_num_seqs, 256 on CPU, or its KV cache).
Off, the batch's completions go as 16 requests of n = 1 a prompt (vLLM times requests, not a request's n
children). Also each call's wall time and its tokens a second. No trainer runs and the
weights do not change: a sync costs the same on and off, and re-reading a carried sequence is in the window's time
(its tokens prefilled again: "reread"; their count per window grows as the windows get shorter).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

CONFIG = REPO / "configs" / "tiny_long_grpo.toml"
GROUP = 16
PROMPTS = 8


def prompts_of(step: int):
    from hpcrl.data.builtin import repeat_x
    from hpcrl.data.types import Prompt

    made = []
    for k in range(PROMPTS):
        example = repeat_x("train", step * PROMPTS + k)
        made.append(Prompt(id=example["id"], text=example["prompt"], answer=example["answer"]))
    return made


def budget(prompt) -> int:
    return len(prompt.answer) + 1


def off(engine, steps: int) -> list[dict]:
    from hpcrl.rl.partial import idle_share, time_idle_share

    rows = []
    for step in range(steps):
        prompts = prompts_of(step)
        started = time.perf_counter()
        # one request a completion (n = 1 x 16, not n = 16): vLLM times each request, not each of a request's n
        members = [p for p in prompts for _ in range(GROUP)]
        groups = engine.generate(members, n=1, seed=1000 + step, max_tokens=[budget(p) for p in members])
        seconds = time.perf_counter() - started
        lengths = [len(c.token_ids) for g in groups for c in g]
        rows.append({"idle": idle_share(lengths), "time_idle": time_idle_share(engine.last_times), "s": seconds,
                     "tokens": sum(lengths), "sequences": len(lengths),
                     "early_eos": sum(c.finish_reason == "stop" for g in groups for c in g)})
    return rows


def on(engine, segment: int, windows: int, warm_up: int) -> tuple[list[dict], list[int]]:
    from hpcrl.rl.partial import PartialState, idle_share, time_idle_share

    state, rows, spans, started_in = PartialState(), [], [], {}
    for step in range(windows):
        prompts = prompts_of(step)
        for p in prompts:
            started_in[p.id] = step
        requests = state.plan_window(prompts, group_size=GROUP, segment=segment, budget=[budget(p) for p in prompts])
        started = time.perf_counter()
        made = engine.generate([r.prompt for r in requests], n=1, seed=1000 + step,
                               max_tokens=[r.max_tokens for r in requests])
        seconds = time.perf_counter() - started
        lengths = state.apply_window(requests, [g[0] for g in made])
        finished = state.take_finished()
        spans += [step - started_in[g.prompt.id] + 1 for g in finished] if step >= warm_up else []
        if step >= warm_up:
            rows.append({"idle": idle_share(lengths), "time_idle": time_idle_share(engine.last_times), "s": seconds, "tokens": sum(lengths), "sequences": len(requests),
                         "carried": sum(1 for r in requests if r.prompt.prefix is not None),
                         "reread": sum(len(r.prompt.prefix) for r in requests if r.prompt.prefix is not None),
                         "groups": len(finished)})
    return rows, spans


def summary(rows: list[dict]) -> str:
    idle = statistics.mean(r["idle"] for r in rows)
    time_idle = statistics.mean(r["time_idle"] for r in rows)
    seconds = statistics.median(r["s"] for r in rows)
    tokens = statistics.mean(r["tokens"] for r in rows)
    rate = sum(r["tokens"] for r in rows) / sum(r["s"] for r in rows)
    return (f"idle share: slots {idle:.1%} (min {min(r['idle'] for r in rows):.1%}, max {max(r['idle'] for r in rows):.1%}), "
            f"wall time {time_idle:.1%} (min {min(r['time_idle'] for r in rows):.1%}, "
            f"max {max(r['time_idle'] for r in rows):.1%}); "
            f"call {seconds:.2f} s median; {tokens:,.0f} tokens a call; {rate:,.0f} tokens/s; "
            f"{statistics.mean(r['sequences'] for r in rows):.0f} sequences a call")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--segments", type=int, nargs="+", default=[8, 16, 32])
    parser.add_argument("--steps", type=int, default=4, help="steps with partial rollouts off")
    parser.add_argument("--windows", type=int, default=40, help="windows a segment size, warm-up included")
    parser.add_argument("--warm-up", type=int, default=24, help="windows that fill the pipeline, not counted")
    parser.add_argument("--kv-cache-gib", type=float, default=0.0, help="0: the config's")
    args = parser.parse_args()

    from hpcrl.config import load_config
    from hpcrl.inference.engine import VllmEngine

    config = load_config(CONFIG)
    inf = config.inference
    engine = VllmEngine(model_path=config.model.path, tensor_parallel=1, on_cpu=True, dtype="float32", seed=0,
                        max_model_len=config.max_model_len, gpu_memory_utilization=inf.gpu_memory_utilization,
                        enforce_eager=True, temperature=inf.temperature, top_p=inf.top_p, top_k=inf.top_k,
                        max_tokens=inf.max_tokens, kv_cache_gib=args.kv_cache_gib or inf.kv_cache_gib,
                        request_times=True)
    try:
        engine.generate(prompts_of(0), n=1, seed=1, max_tokens=[4] * PROMPTS)  # warm-up
        rows = off(engine, args.steps)
        print(f"off: {summary(rows)}; {sum(r['early_eos'] for r in rows)} of {sum(r['sequences'] for r in rows)} "
              "sequences sampled <eos> before their budget", flush=True)
        for segment in args.segments:
            rows, spans = on(engine, segment, args.windows, args.warm_up)
            print(f"on, partial_tokens = {segment}: {summary(rows)}; "
                  f"{statistics.mean(r['carried'] for r in rows):.0f} carried, whose "
                  f"{statistics.mean(r['reread'] for r in rows):,.0f} tokens are prefilled again, "
                  f"{statistics.mean(r['groups'] for r in rows):.1f} groups finished a window; "
                  f"a finished group spans {statistics.median(spans):.0f} windows median, {max(spans)} at most "
                  "(its oldest token is that many versions behind the step that trains it: max_policy_lag >= it "
                  "keeps every group)", flush=True)
        rows = off(engine, args.steps)  # again: the machine's load moves between the first figures and the last
        print(f"off, again after: {summary(rows)}", flush=True)
    finally:
        engine.close()


if __name__ == "__main__":
    main()
