"""The head controller: the RL loop over the run's groups, on a fixed, replayable schedule.

    prompts --> episodes: Ports.generate (an inference replica) --> Ports.score (the reward group)
                (hpcrl.rl.episodes; with [env]: generate_turn             |
                 and the environments' steps between turns)               |
                     ^ more rounds (dynamic sampling)                     |
                        ReplayBuffer  <-- scored groups <-----------------+
                             |
                   algorithm.select: advantages, the groups kept      (hpcrl.algorithms, algorithm.name)
                             |
    batch b --> Ports.train_step (every trainer rank, its share) --> Ports.sync_weights(b + 1)
                                                                      (trainer -> inference, point to point)

Schedule (lag = algorithm.max_policy_lag), the same whatever the timing, so that a resumed run
equals an uninterrupted one:

    batch b is generated with weight version max(0, b - lag)
    step  s trains on batch s and makes weight version s + 1
    while step s trains, batch s + lag is generated (with version s): generation overlaps training
    version s + 1 goes to the inference group once both are done; the batch's scoring goes on
    meanwhile (the reward group is not the inference group) and ends before step s does

A batch is one round of trainer.global_batch_size / group_size prompts, group_size episodes each; an
algorithm may ask for more rounds (algorithm.more_prompts, e.g. until enough groups carry a signal). Round r
of batch b draws the next prompts of the stream and samples with a seed fixed by (run.seed, b, r), and
every round ends before the batch enters the buffer, so a resumed run generates the same rounds.

Every rollout is an episode (hpcrl.rl.episodes), and training and evaluation take one path through
EpisodeRunner.run -> Ports.score -> hpcrl.rl.rollouts (or hpcrl.rl.evaluation). Without an environment an
episode is one turn: the round's prompts go to one Ports.generate call with the round's seed. With [env]
it is multi-turn: Ports.generate_turn per chunk and turn, the environment's steps between turns, and the
inference group is released for the weight sync only once the batch's last turn is generated, so a batch's
episodes finish on the weights they started with.

A checkpoint after step s holds the trainer state (version s + 1), the prompt cursor and the
scored batches s + 1 .. s + lag already in the buffer; resuming re-pushes version s + 1 and goes on.
The last step's checkpoint holds no batch past trainer.steps: a finished run resumed with trainer.steps
raised generates those batches at start with its newest weights (fresher than the schedule's version).

With algorithm.partial_rollouts (hpcrl.rl.partial) the schedule's lag is 1 whatever max_policy_lag is: batch b
is one window, generated with version b - 1, of the sequences carried from window b - 1 and the batch's new
prompts, each sequence at most algorithm.partial_tokens tokens; batch b is the groups whose last member finished
in it, and max_policy_lag bounds their oldest token (the buffer's check on a group's weight_version, its oldest
token's). With [env] the window's sequences are the live episodes' turns in progress, and the environment's steps
answer the turns completed in it (EpisodeRunner.window). The sequences and episodes still being made are part of
the checkpoint (LoopState.partial).

Evaluation ([eval], hpcrl.rl.evaluation): after step s's weight sync, when s + 1 is a multiple of
eval.interval (or the last step), and before batch s + 1 + lag is generated, the held-out prompts are
generated with version s + 1 (the one just synced; the inference group is otherwise idle: batch
s + lag was generated and is scored) and scored, and the figures join step s + 1's metrics. With
eval.at_start, version 0 is evaluated too, before step 0 (batches 0 .. lag - 1 generated), into a row
of its own (step 0); a resumed run does not repeat it. It takes no
prompt from the stream, its seed is eval_seed(run.seed, s + 1), not a batch's, and it touches neither
the buffer nor the trainer, so every training figure is the same with it on or off; its cost,
eval/time_s, is not part of time_step_s.

`logprob_mismatch` = mean |logprob_vllm - logprob_trainer| over the tokens the policy generated (the
rollouts' policy masks), under the same
weights: the check that the syncs deliver exactly the trainer's weights. At lag 0 the step's batch
was sampled with the weights the trainer holds when the step starts, so the train step's own forward
measures it over the whole batch (`sampling_logprob_diff`), at no cost. At lag > 0 (or on a step
with nothing to train) a probe does, every `algorithm.mismatch_every` steps: the first group of the
step's batch, scored by both sides after the weight sync (one more trainer forward, one vLLM call), which
also gives `logprob_mismatch_max`, the largest difference over those tokens (every turn of an episode's).
A run whose trainer and vLLM both compute in float32 (every CPU run) warns when `logprob_mismatch` exceeds
`FLOAT32_MISMATCH_ALARM`, 10x the float32 floor measured on a real model (`mismatch_alarm`); in bfloat16 no
floor has been measured here, and nothing warns.

The controller talks to the groups only through `Ports`; `hpcrl.rl.ports` binds them to the bus.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Protocol

from hpcrl.algorithms import load_algorithm
from hpcrl.algorithms.base import options_of
from hpcrl.config.schema import Config
from hpcrl.data.chat import chat_template_for
from hpcrl.data.prompts import Prompt, PromptStream
from hpcrl.data.tokens import token_counter
from hpcrl.env.types import EnvReply, EnvRequest
from hpcrl.errors import HpcrlError
from hpcrl.inference.types import Completion
from hpcrl.reward.types import RewardResult, Sample
from hpcrl.rl.buffer import ReplayBuffer, ScoredGroup
from hpcrl.rl.episodes import EpisodeRunner, EpisodeStats, turn_seed
from hpcrl.rl.evaluation import PromptOutcome, eval_metrics, eval_seed, prompt_outcomes
from hpcrl.rl.partial import PartialEpisodes, PartialState, idle_share
from hpcrl.rl.rollouts import batch_from_groups, samples_for, score_groups
from hpcrl.rl.startup import StartupClock
from hpcrl.trainer.types import TrainBatch

#: `logprob_mismatch` of trainer and vLLM when both are right, both in float32: 1.5e-5 (max 6.6e-5), measured
#: on SmolLM2-135M-Instruct (vocab 49,152) on an AVX2 CPU (tools/bench/bench_mismatch.py, BENCHMARKS.md
#: "Logprob mismatch on a real model"); real runs of that model read 1.0-1.1e-5, the tiny model 1e-7. Two
#: thirds of it was the trainer and vLLM's sampler rounding the log-softmax apart; the trainer now takes the
#: sampler's kernel (hpcrl.trainer.loss: 8.6e-6 -> 5.0e-6 on an AVX-512 CPU), the rest is mostly vLLM's
#: oneDNN matmuls (docs/FACTS.md "Logprob precision on CPU"). The floor keeps the larger figure.
FLOAT32_MISMATCH_FLOOR = 1.5e-5
#: Above this `logprob_mismatch` a float32 run warns: 10x the floor. The log_softmax part grows with the
#: vocabulary (151k, Qwen3's: 2.7x that of 49k on peaked logits), still below. Weights that did not arrive
#: whole read far above: one of SmolLM2's 272 tensors rounded through bfloat16 7.4e-4, all of them 9.7e-3.
FLOAT32_MISMATCH_ALARM = 10 * FLOAT32_MISMATCH_FLOOR

#: Round r > 0 of a batch samples with the batch's seed + r times this (a prime far above any batch index).
ROUND_SEED_STRIDE = 1_000_000_007

log = logging.getLogger(__name__)


def mismatch_alarm(config: Config) -> float | None:
    """The `logprob_mismatch` above which the run warns: FLOAT32_MISMATCH_ALARM when trainer and vLLM both
    compute in float32 (on CPU both always do); None (no alarm) in another dtype, where no floor is measured."""
    float32 = config.model.dtype == "float32" or (config.trainer.gpus_per_node == 0
                                                  and config.inference.gpus_per_node == 0)
    return FLOAT32_MISMATCH_ALARM if float32 else None


class ControllerError(HpcrlError):
    """The loop cannot go on (a group failed, a schedule invariant broke)."""


class Ports(Protocol):
    """What the controller needs from the groups; the first four through hpcrl.rl.episodes. generate's
    temperature: None = inference.temperature (rollouts); the evaluation passes its own (0.0 = greedy). With
    [env]: generate_turn generates one turn of a chunk's episodes on one replica (prompts carry the episodes'
    ids so far, one max_tokens each), env_reset / env_step call the environment workers (the reward group's)."""

    async def generate(self, prompts: list[Prompt], *, n: int, seed: int,
                       temperature: float | None = None) -> list[list[Completion]]: ...
    async def generate_turn(self, prompts: list[Prompt], *, n: int, seed: int, max_tokens: list[int],
                            temperature: float | None = None) -> list[list[Completion]]: ...
    async def env_reset(self, requests: list[EnvRequest]) -> list[EnvReply]: ...
    async def env_step(self, requests: list[EnvRequest]) -> list[EnvReply]: ...
    async def score(self, samples: list[Sample]) -> list[RewardResult]: ...
    async def train_step(self, batch: TrainBatch, *, step: int) -> dict[str, float]: ...
    async def sync_weights(self, version: int) -> None: ...
    async def trainer_logprobs(self, sequences: list[list[int]]) -> list[list[float]]: ...
    async def inference_logprobs(self, sequences: list[list[int]]) -> list[list[float]]: ...


@dataclass
class LoopState:
    """Everything besides the trainer's own state that a checkpoint must hold."""

    step: int = 0
    """Steps done = the trainer's weight version."""
    generated: int = 0
    """Batches generated so far (batch indices 0 .. generated - 1)."""
    prompts: dict = field(default_factory=dict)
    buffer: dict = field(default_factory=dict)
    held_out_groups: int = 0
    rollout_metrics: dict[str, dict] = field(default_factory=dict)
    """Metrics of generated batches not trained on yet, by batch index (str, for JSON)."""
    partial: dict = field(default_factory=dict)
    """algorithm.partial_rollouts: the groups still being generated (hpcrl.rl.partial.PartialState.to_dict)."""

    def to_dict(self) -> dict:
        state = {"step": self.step, "generated": self.generated, "prompts": self.prompts, "buffer": self.buffer,
                 "held_out_groups": self.held_out_groups, "rollout_metrics": self.rollout_metrics}
        return {**state, "partial": self.partial} if self.partial else state


class Controller:
    def __init__(self, config: Config, ports: Ports, *, on_step=None, startup: StartupClock | None = None) -> None:
        self.config = config
        self.ports = ports
        self.partial: PartialState | PartialEpisodes | None = None
        if config.algorithm.partial_rollouts:
            self.partial = PartialEpisodes() if config.env.environment else PartialState()
        """algorithm.partial_rollouts: the sequences carried from one batch's generation to the next (module
        docstring); None without."""
        # The schedule's lag: with partial rollouts batch b is generated with version b - 1 (one batch ahead), and
        # max_policy_lag bounds the oldest token a step trains on instead (the buffer's bound).
        self.lag = min(1, config.algorithm.max_policy_lag) if self.partial is not None \
            else config.algorithm.max_policy_lag
        self.prompts_per_step = config.trainer.global_batch_size // config.algorithm.group_size
        self.algorithm = load_algorithm(config.algorithm.name)
        self.settings = options_of(config)
        self.stream: PromptStream | None = None
        """The prompts, read when `run` starts (see _load_stream); None until then."""
        self.buffer = ReplayBuffer(max_policy_lag=config.algorithm.max_policy_lag)
        if self.partial is not None and self.algorithm.max_rounds(self.settings) > 1:
            raise ControllerError(f"algorithm {config.algorithm.name!r} asks for more than one generate round a batch, "
                                  "which partial rollouts do not do (a batch is the groups that finish in its "
                                  "generation). Fix: set algorithm.partial_rollouts = false, or turn its extra "
                                  "rounds off")
        self.state = LoopState()
        self.on_step = on_step  # called with (state, metrics) after each step: checkpoints, metrics
        self.on_eval: Callable[[Controller, dict], Awaitable[None]] | None = None
        """Called with (controller, metrics) after the evaluation of the initial weights (eval.at_start): row 0."""
        self._runner: EpisodeRunner | None = None
        """[env]: the episodes' runner (_episodes); None until the first batch needs it."""
        self.startup = startup
        """The ports' start-up clock: the first sync is timed into it, and its figures join the first step's metrics."""

    # -- state ---------------------------------------------------------------------------------
    def snapshot(self) -> dict:
        if self.stream is not None:
            self.state.prompts = self.stream.state_dict()
        self.state.buffer = self.buffer.state_dict()
        if self.partial is not None:
            self.state.partial = self.partial.to_dict()
        return self.state.to_dict()

    def restore(self, state: dict) -> None:
        self.state = LoopState(**state)
        if self.stream is not None:
            self.stream.load_state_dict(state["prompts"])
        # else _load_stream resumes the stream from self.state.prompts
        self.buffer.load_state_dict(state["buffer"])
        if self.partial is not None:
            self.partial.load_dict(self.state.partial)

    async def _load_stream(self) -> PromptStream:
        """Read the data source in a thread: a large file, the tokenizer's import and the measuring of every
        prompt take seconds, longer than the bus may go without the head's heartbeats (bus.heartbeat_timeout,
        5 s) on this event loop. Prompts over data.max_prompt_tokens (the model's tokens) are left out here,
        once, and counted in stream.dropped; a builtin task's are not measured."""
        if self.stream is None:
            stream = await asyncio.to_thread(PromptStream.from_config, self.config.data,
                                             measure=token_counter(self.config.model.path),
                                             chat=chat_template_for(self.config.data, self.config.model.path))
            if self.state.prompts:  # restored from a checkpoint
                stream.load_state_dict(self.state.prompts)
            self.stream = stream
        return self.stream

    # -- one batch of rollouts -----------------------------------------------------------------
    async def _generate_batch(self, index: int, version: int, inference_done: asyncio.Event | None = None) -> None:
        """Generate and score batch `index` with weight version `version` into the buffer, in as many
        rounds as the algorithm asks for (module docstring); `inference_done` is set once the inference
        group is done with it (or failed), while the scoring of a one-round batch may go on."""
        if index != self.state.generated:
            raise ControllerError(f"schedule broken: asked for batch {index}, next is {self.state.generated}")
        if self.partial is not None:
            return await self._generate_window(index, version, inference_done)
        # With more rounds possible the inference group stays busy until the last round is scored.
        rounds_later = self.algorithm.max_rounds(self.settings) > 1
        groups: list[ScoredGroup] = []
        generate_s = reward_s = 0.0
        rounds = held_out = 0
        errors: list[str] = []
        parts: dict[str, list[float]] = {}
        episodes = EpisodeStats()
        idle: list[float] = []  # without [env]: each round's generate call, its slots' idle share
        count = self.prompts_per_step
        try:
            runner = await self._episodes()
            while count:
                prompts = (await self._load_stream()).next_batch(count)
                started = time.monotonic()
                seed = self.config.run.seed * 1_000_003 + index + rounds * ROUND_SEED_STRIDE
                try:
                    made, round_stats = await runner.run(prompts, n=self.config.algorithm.group_size, seed=seed)
                finally:
                    if inference_done is not None and not rounds_later:
                        inference_done.set()
                rounds += 1
                episodes.merge(round_stats)
                if not self.config.env.environment:
                    idle.append(idle_share([sum(e.mask) for group in made for e in group]))
                self._check_versions(index, version, round_stats.versions)
                generated = time.monotonic()
                results = await self.ports.score(samples_for(made))
                scored, stats = score_groups(made, results, weight_version=version, batch=index)
                groups += scored
                generate_s += generated - started
                reward_s += time.monotonic() - generated
                held_out += stats.groups_with_errors
                errors += stats.errors
                for name, values in stats.parts.items():
                    parts.setdefault(name, []).extend(values)
                count = self.algorithm.more_prompts([g.rollouts for g in groups], self.settings,
                                                    wanted=self.prompts_per_step, rounds_done=rounds)
        finally:
            if inference_done is not None:
                inference_done.set()
        for group in groups:
            self.buffer.put(group)
        self.state.generated += 1
        self.state.held_out_groups += held_out
        metrics = {"time_generate_s": generate_s, "time_reward_s": reward_s, "generate_tokens": episodes.generate_tokens,
                   "reward_errors": len(errors), "reward_error_example": errors[0] if errors else None}
        if idle:
            # The share of the call's sequence slots empty while its longest sequence generated (the batch waiting
            # for its last sequence; partial rollouts' windows log it as partial_idle_share).
            metrics["generate_idle_share"] = sum(idle) / len(idle)
        if rounds_later:
            metrics["sampling_rounds"] = rounds
        if self.config.env.environment:
            # The share of the batch's rollout time in which every replica waited on environments.
            metrics.update(episodes.metrics(), env_wait_share=episodes.time_env_wait_s / max(generate_s, 1e-9))
        # reward.functions: each function's unweighted mean over the batch's scored samples.
        metrics.update({f"reward_mean/{name}": sum(values) / len(values) for name, values in parts.items()})
        self.state.rollout_metrics[str(index)] = metrics

    def _check_versions(self, index: int, version: int, versions: set[int]) -> None:
        """Batch `index` was asked of weight version `version`: every completion must be of it or fresher, up to
        the trainer's newest (a replica started again after a loss is caught up to the trainer's newest weights,
        so a batch it finishes may be fresher: a smaller lag)."""
        if versions and (min(versions) < version or max(versions) > self.state.step + 1):
            raise ControllerError(f"batch {index} was generated with weight versions {sorted(versions)}, expected "
                                  f"{version} (at most {self.state.step + 1}): the inference group missed a weight sync")

    async def _generate_window(self, index: int, version: int, inference_done: asyncio.Event | None) -> None:
        """algorithm.partial_rollouts: batch `index`'s generation as one window (hpcrl.rl.partial) with weight
        version `version`: the sequences carried from the last window go on, the batch's new prompts start, each
        sequence generates at most algorithm.partial_tokens; the groups whose last member finished are scored into
        the buffer as batch `index`, the others are carried (and checkpointed with the loop's state)."""
        partial = self.partial
        assert partial is not None
        algorithm, inference = self.config.algorithm, self.config.inference
        # Groups that step `index` (the first to train this window's groups) may not train on are not generated on.
        stale = partial.drop_stale(step=index, max_policy_lag=algorithm.max_policy_lag)
        seed = self.config.run.seed * 1_000_003 + index
        started = time.monotonic()
        episodes: EpisodeStats | None = None
        try:
            prompts = (await self._load_stream()).next_batch(self.prompts_per_step)
            if isinstance(partial, PartialEpisodes):  # [env]: the window's turns, and the environment's steps
                runner = await self._episodes()
                made, episodes, lengths = await runner.window(partial, prompts, n=algorithm.group_size, seed=seed,
                                                              segment=algorithm.partial_tokens)
                versions = episodes.versions
            else:
                requests = partial.plan_window(prompts, group_size=algorithm.group_size,
                                               segment=algorithm.partial_tokens, budget=inference.max_tokens)
                # In contiguous chunks, one per replica, each with its own seed (as one turn of episodes' chunks).
                size = -(-len(requests) // max(1, inference.replicas)) or 1
                chunks = [requests[at:at + size] for at in range(0, len(requests), size)]
                parts = await asyncio.gather(*(
                    self.ports.generate_turn([r.prompt for r in chunk], n=1, seed=turn_seed(seed, c, 0),
                                             max_tokens=[r.max_tokens for r in chunk])
                    for c, chunk in enumerate(chunks)))
                completions = [group[0] for part in parts for group in part]
                versions = {c.weight_version for c in completions}
                lengths = partial.apply_window(requests, completions)
                made = [g.episodes() for g in partial.take_finished()]
        finally:
            if inference_done is not None:
                inference_done.set()
        self._check_versions(index, version, versions)
        generated = time.monotonic()
        results = await self.ports.score(samples_for(made))
        scored, stats = score_groups(made, results, weight_version=version, batch=index)
        for group in scored:
            self.buffer.put(group)
        self.state.generated += 1
        self.state.held_out_groups += stats.groups_with_errors
        metrics = {"time_generate_s": generated - started, "time_reward_s": time.monotonic() - generated,
                   "generate_tokens": sum(lengths), "reward_errors": len(stats.errors),
                   "reward_error_example": stats.errors[0] if stats.errors else None,
                   # The share of the window's sequence slots empty while its longest sequence generated.
                   "partial_idle_share": idle_share(lengths), "partial_sequences": len(lengths),
                   "partial_carried": partial.carried(), "partial_groups_finished": len(made),
                   "partial_groups_dropped_stale": len(stale)}
        if episodes is not None:
            metrics.update(episodes.metrics(), env_wait_share=episodes.time_env_wait_s / max(generated - started, 1e-9))
        metrics.update({f"reward_mean/{name}": sum(values) / len(values) for name, values in stats.parts.items()})
        self.state.rollout_metrics[str(index)] = metrics

    async def _episodes(self) -> EpisodeRunner:
        """The runner of the rollouts' and the evaluation's episodes; with [env], with the run's chat template
        (hpcrl.config.checks: [env] needs the chat format), its tokenizer loaded in a thread, as the stream's
        (see _load_stream)."""
        if self._runner is None:
            chat = None
            if self.config.env.environment:
                chat = chat_template_for(self.config.data, self.config.model.path)
                if chat is None:
                    raise ControllerError("[env] needs the chat format, but the run's prompts are text. Fix: set "
                                          'data.format = "chat" and model.path to a model whose tokenizer has a chat '
                                          "template")
                await asyncio.to_thread(chat.tokenizer)
            self._runner = EpisodeRunner(self.config, self.ports, chat)
        return self._runner

    # -- the loop ------------------------------------------------------------------------------
    async def run(self) -> None:
        """Train from the current state to trainer.steps."""
        steps = self.config.trainer.steps
        await self._load_stream()
        # Every replica starts from the trainer's weights: the initial ones, or a resumed step's.
        synced = time.monotonic()
        await self.ports.sync_weights(self.state.step)
        clock = self.startup or StartupClock()
        clock.record("first_sync", time.monotonic() - synced)
        # Batches generated with version 0 before step 0: 0 .. lag - 1.
        generating, before = time.monotonic(), self.state.generated
        while self.state.generated < min(self.lag, steps):
            await self._generate_batch(self.state.generated, 0)
        if self.state.generated > before:  # not on a resume, whose checkpoint holds those batches
            clock.record("first_generate", time.monotonic() - generating)
        if self.state.generated < min(self.state.step + self.lag, steps):
            # A run resumed with trainer.steps raised past the step it ended at: it generated no batch beyond its
            # old last step, so the batches of the steps ahead are generated now, with the newest weights (fresher
            # than the schedule's version step - lag, which the trainer no longer holds; the buffer takes them).
            log.info(f"trainer.steps raised from {self.state.generated} to {steps}: generating batches "
                     f"{self.state.generated} .. {min(self.state.step + self.lag, steps) - 1} with weight version "
                     f"{self.state.step}")
            while self.state.generated < min(self.state.step + self.lag, steps):
                await self._generate_batch(self.state.generated, self.state.step)
        # The start-up's figures go with the first step this process runs (startup_total_s: launch -> here).
        startup: dict[str, float] = clock.metrics() if self.startup is not None else {}
        # The prompts left out for length go with the run's first step (the stream logs them at every start;
        # a resumed run's rows stay equal to an uninterrupted run's).
        stream = self.stream
        if stream is not None and self.state.step == 0:
            startup = {**startup, "prompts_dropped_too_long": float(stream.dropped),
                       "eval_prompts_dropped_too_long": float(stream.eval_dropped)}
        if self.state.step == 0 and self.config.eval.interval and self.config.eval.at_start:
            # Version 0, synced above; batches 0 .. lag - 1 are scored and in the buffer (a resume skips this:
            # its metrics.jsonl kept row 0).
            initial = {"step": 0, "weight_version": 0, **await self._evaluate(0)}
            if self.on_eval is not None:
                await self.on_eval(self, initial)
        while self.state.step < steps:
            step = self.state.step
            started = time.monotonic()
            ahead = step + self.lag
            generation, inference_done = None, asyncio.Event()
            if ahead < steps and self.state.generated == ahead:
                generation = asyncio.create_task(self._generate_batch(ahead, step, inference_done))
            if self.lag == 0 and generation is not None:
                await generation  # on-policy: the batch first
                generation = None
            groups = self.buffer.take_batch(step, trainer_version=step)
            selection = self.algorithm.select([g.rollouts for g in groups], self.settings,
                                              wanted=self.prompts_per_step)
            batch, dropped = batch_from_groups(groups, selection), selection.dropped_zero_variance
            train_started = time.monotonic()
            try:
                train_metrics = await self.ports.train_step(batch, step=step) if len(batch) else {}
                train_done = time.monotonic()
                if generation is not None:
                    await inference_done.wait()  # the inference group is free for the weights; scoring goes on
                    if generation.done():
                        await generation  # raises what generating raised
            except BaseException:
                if generation is not None:  # the step failed or the loop was stopped (the trainer group lost):
                    generation.cancel()  # nothing of it may call the ports afterwards
                raise
            sync_started = time.monotonic()
            try:
                await self.ports.sync_weights(step + 1)
                sync_done = time.monotonic()
                mismatch, mismatch_max = await self._mismatch(step, groups, train_metrics)
                self._check_mismatch(step + 1, mismatch)
            except BaseException:
                if generation is not None:
                    generation.cancel()  # the step failed: its scoring is not waited for
                raise
            if generation is not None:
                await generation  # batch step + lag scored and in the buffer: what a checkpoint of this step holds
            elapsed = time.monotonic() - started
            # The inference group holds version step + 1 and has nothing else to do until the next step.
            evaluation = await self._evaluate(step + 1) if self._eval_due(step + 1) else {}
            self.state.step = step + 1
            rollout = self.state.rollout_metrics.pop(str(step), {})
            busy = (train_done - train_started) + (sync_done - sync_started)
            # The reward of every scored rollout, also of groups that zero-variance filtering drops (and,
            # with dynamic sampling, of every round).
            rewards = [r for g in groups for r in g.rewards]

            metrics = {
                "step": step + 1, "weight_version": step + 1, "policy_lag": self.lag,
                "reward_mean": sum(rewards) / len(rewards) if rewards else None,
                "reward_std": _std(rewards), "groups": len(groups), "groups_dropped_zero_variance": dropped,
                "groups_held_out_total": self.state.held_out_groups, "logprob_mismatch": mismatch,
                **({"logprob_mismatch_max": mismatch_max} if mismatch_max is not None else {}),
                "time_train_s": train_done - train_started, "time_weight_sync_s": sync_done - sync_started,
                "time_step_s": elapsed, "train_tokens": sum(len(s) for s in batch.input_ids),
                **train_metrics, **rollout, **startup, **evaluation,
            }
            startup = {}
            if self.partial is not None:
                # The oldest token the step's groups hold, in versions behind the trainer (<= max_policy_lag).
                metrics["token_lag_max"] = max((step - g.weight_version for g in groups), default=None)
            generate_time = metrics.get("time_generate_s", 0.0) + metrics.get("time_reward_s", 0.0)
            # Idle: wall time on the step's critical path not spent training, syncing or (serially) generating.
            metrics["time_idle_s"] = max(0.0, elapsed - busy - (generate_time if self.lag == 0 else 0.0))
            metrics["generate_tokens_per_s"] = metrics.get("generate_tokens", 0) / max(
                metrics.get("time_generate_s", 0.0), 1e-9)
            metrics["train_tokens_per_s"] = metrics["train_tokens"] / max(metrics["time_train_s"], 1e-9)
            if self.on_step is not None:
                await self.on_step(self, metrics)

    # -- evaluation ----------------------------------------------------------------------------
    def _eval_due(self, step: int) -> bool:
        """Whether the weights after `step` are evaluated: every eval.interval steps, and the last step."""
        interval = self.config.eval.interval
        return bool(interval) and (step % interval == 0 or step == self.config.trainer.steps)

    def _eval_prompts(self) -> list[Prompt]:
        assert self.stream is not None  # read when run() starts
        prompts = self.stream.eval_prompts()
        if self.config.eval.max_prompts:
            prompts = prompts[:self.config.eval.max_prompts]
        if not prompts:
            dropped = f" (all {self.stream.eval_dropped} are longer than data.max_prompt_tokens)" \
                if self.stream.eval_dropped else ""
            raise ControllerError(f"eval.interval = {self.config.eval.interval} but no evaluation prompt is "
                                  f"left{dropped}. Fix: raise data.max_prompt_tokens, give other prompts in "
                                  "data.eval_source, or set eval.interval = 0")
        return prompts

    async def _evaluate(self, version: int) -> dict:
        """Generate for the held-out prompts with weight version `version` (greedy and/or eval.n samples),
        score them with the run's reward, and return the eval/ metrics (module docstring)."""
        settings = self.config.eval
        prompts = self._eval_prompts()
        started = time.monotonic()
        seed = eval_seed(self.config.run.seed, version)
        greedy = sampled = None
        if settings.greedy:
            greedy = await self._eval_round(prompts, version, n=1, seed=seed, temperature=0.0)
        if settings.n:
            sampled = await self._eval_round(prompts, version, n=settings.n, seed=seed,
                                             temperature=settings.temperature)
        metrics = eval_metrics(greedy=greedy, sampled=sampled, k=settings.pass_k, threshold=settings.pass_threshold)
        return {**metrics, "eval/time_s": time.monotonic() - started}

    async def _eval_round(self, prompts: list[Prompt], version: int, *, n: int, seed: int,
                          temperature: float) -> list[PromptOutcome]:
        # The held-out prompts as episodes, as a batch's (greedy ones at temperature 0); with [env] every reset
        # may fail, and then no turn is generated.
        made, stats = await (await self._episodes()).run(prompts, n=n, seed=seed, temperature=temperature)
        if stats.versions and stats.versions != {version}:
            raise ControllerError(f"the evaluation after step {version} was generated with weight versions "
                                  f"{sorted(stats.versions)}, expected {version}: the inference group missed "
                                  "a weight sync")
        return prompt_outcomes(made, await self.ports.score(samples_for(made)))

    async def _mismatch(self, step: int, groups: list, train_metrics: dict) -> tuple[float | None, float | None]:
        """`logprob_mismatch` of step `step` and, from a probe, its largest difference (module docstring); None on
        a step that measures none."""
        if self.lag == 0 and "sampling_logprob_diff" in train_metrics:
            return train_metrics["sampling_logprob_diff"], None
        if (step + 1) % self.config.algorithm.mismatch_every:
            return None, None
        return await self._probe_mismatch(groups)

    def _check_mismatch(self, step: int, mismatch: float | None) -> None:
        """Warn when `mismatch` is above the run's alarm (`mismatch_alarm`): vLLM is not computing with the
        trainer's weights, or one of the two changed kernels."""
        alarm = mismatch_alarm(self.config)
        if mismatch is not None and alarm is not None and mismatch > alarm:
            log.warning(f"step {step}: logprob_mismatch {mismatch:.2e} is above {alarm:.1e}, 10x the float32 "
                        f"floor of trainer vs vLLM ({FLOAT32_MISMATCH_FLOOR:.1e}): vLLM may not hold the "
                        "trainer's weights (a weight sync that did not arrive whole, a wrong wire dtype), or a "
                        "kernel of either side changed. tools/bench/bench_mismatch.py measures both sides "
                        "against float64")

    async def _probe_mismatch(self, groups: list) -> tuple[float | None, float | None]:
        """Mean and largest |logprob_vllm - logprob_trainer| over the tokens the policy generated in the step's
        first group (scored under the freshly synced weights, whether or not the group was trained on)."""
        if not groups:
            return None, None
        rollouts = groups[0].rollouts
        sequences = [r.tokens for r in rollouts]
        trainer_lp, inference_lp = await asyncio.gather(self.ports.trainer_logprobs(sequences),
                                                        self.ports.inference_logprobs(sequences))
        diffs = []
        for rollout, t_lp, i_lp in zip(rollouts, trainer_lp, inference_lp):
            # Both sides give the logprob of every token after the first.
            diffs += [abs(a - b) for flag, a, b in zip(rollout.policy_mask[1:], t_lp, i_lp, strict=True) if flag]
        return (sum(diffs) / len(diffs), max(diffs)) if diffs else (None, None)


def _std(values: list[float]) -> float | None:
    if len(values) < 2:
        return None
    mean = sum(values) / len(values)
    return (sum((v - mean) ** 2 for v in values) / (len(values) - 1)) ** 0.5
