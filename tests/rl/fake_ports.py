"""The groups of a run in memory: the controller's `Ports` without processes, for tests that take milliseconds.

    ports = FakePorts()
    controller = await run_loop(config, ports)     # hpcrl.rl.loop, unchanged
    ports.trainer.version, ports.trainer.weights, ports.inference.version, ports.events

Nothing is canned. The "model" is a policy over the ten digits with three weights (see `logits`):

    trainer     FakeTrainer: its weights move at every train_step by a clipped, importance-weighted
                policy gradient of the batch (advantages x ratio against the batch's old logprobs),
                so the numbers depend on which weights generated each batch; a version counter
                (steps made); save/load of both through the checkpoint directory
    inference   FakeEngine: serves the weights it last received, samples every completion from them
                seeded by (seed, the prompt's place in the batch, sample) (the controller's seed already
                holds the batch index), and tags it with the weight version it holds. So its tokens do
                not depend on how a batch is cut into chunks, and runs over 1 and 2 replicas compare
                equal; hpcrl.inference.engine seeds vLLM per chunk instead, so real runs compare equal
                only with the same number of replicas
    reward      FakeReward: the builtin exact match, except for the sample ids it is told are broken
                (those come back as errors, as from a verifier that raised)

A resume that loses state, a sync that delivers the wrong weights or a batch generated with other
weights shows in the weights, the logprobs and the metrics, the same places a real run shows it.
Faults are set on the parts: `inference.ignored_versions` (a replica that misses a push),
`inference.claimed_version` (one that reports a version it was not given), `trainer.during_step`
(called in the middle of a train step: raise there to crash the run, or ask it to stop).
Episodes ([env], hpcrl.rl.episodes): FakeEngine.generate_turn generates a turn from an episode's ids,
FakeEnvironment is the "feedback" environment in memory (hpcrl.env's runs in worker processes).
The same parts serve as the workers behind the fake bus of fake_head.py.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
from collections.abc import Callable
from pathlib import Path

from hpcrl.data.prompts import Prompt
from hpcrl.env.types import EnvReply, EnvRequest
from hpcrl.fsio import write_atomic
from hpcrl.inference.types import Completion
from hpcrl.reward.builtin import exact_match
from hpcrl.reward.types import RewardResult, Sample

INITIAL_WEIGHTS = (0.0, 0.0, 0.0)
STATE_FILE = "fake_trainer.json"


class FakeGroupError(RuntimeError):
    """A fake group was used in a way the real one would refuse."""


# -- the model: logits(d) = w0 [d is the context's last digit] + w1 d / 9 + w2 [d is even] ----------
#: The token id of digit 0 (digits are 10 consecutive ids): bytes, as the prompts' ids here are; an episode's
#: ids come from the tiny tokenizer's chat template, where "0" is id 19 (EPISODE_DIGIT0).
DIGIT0 = 48
EPISODE_DIGIT0 = 19


def _target(context: list[int], digit0: int = DIGIT0) -> int | None:
    return next((t - digit0 for t in reversed(context) if digit0 <= t < digit0 + 10), None)


def _features(target: int | None, digit: int) -> tuple[float, float, float]:
    return float(digit == target), digit / 9, float(digit % 2 == 0)


def _logits(weights, target: int | None) -> list[float]:
    w0, w1, w2 = weights
    return [w0 * (d == target) + w1 * d / 9 + w2 * (d % 2 == 0) for d in range(10)]


def _probabilities(weights, target: int | None, temperature: float = 1.0) -> list[float]:
    logits = _logits(weights, target)
    if temperature != 1.0:  # an evaluation's; rollouts sample at 1.0, computed exactly as ever
        logits = [x / temperature for x in logits]
    exps = [math.exp(x) for x in logits]
    total = sum(exps)
    return [e / total for e in exps]


def token_logprob(weights, context: list[int], token: int, digit0: int = DIGIT0) -> float:
    """Log-probability of `token` after `context`; the model is certain of non-digit text (prompts)."""
    if not digit0 <= token < digit0 + 10:
        return 0.0
    return math.log(_probabilities(weights, _target(context, digit0))[token - digit0])


def sequence_logprobs(weights, sequence: list[int], digit0: int = DIGIT0) -> list[float]:
    """The logprob of every token after the first, as trainer and vLLM both report them."""
    return [token_logprob(weights, sequence[:j], sequence[j], digit0) for j in range(1, len(sequence))]


# -- the groups ------------------------------------------------------------------------------------
class FakeTrainer:
    """The trainer group: weights, a version counter, and GRPO-like updates (see the module docstring)."""

    def __init__(self, *, lr: float = 2.0, clip: tuple[float, float] = (0.2, 0.28), digit0: int = DIGIT0) -> None:
        self.lr, self.clip, self.digit0 = lr, clip, digit0
        self.weights = list(INITIAL_WEIGHTS)
        self.version = 0
        """Weight version = optimizer steps made."""
        self.trained: dict[int, list[str]] = {}
        """step -> prompt ids of its batch (per sequence), for the tests."""
        self.during_step: Callable[[int], None] | None = None
        self.batches: dict[int, dict] = {}
        """step -> the batch it trained on (TrainBatch.to_dict()), for the tests."""

    def train(self, batch: dict, step: int) -> dict[str, float]:
        if step < self.version:
            raise FakeGroupError(f"train step {step} asked of a trainer that already made weight version "
                                 f"{self.version}")
        grad, loss, tokens, ratio_max, diff = [0.0, 0.0, 0.0], 0.0, 0, 0.0, 0.0
        low, high = 1 - self.clip[0], 1 + self.clip[1]
        for ids, flags, old, adv in zip(batch["input_ids"], batch["policy_mask"], batch["logprobs"],
                                        batch["advantages"]):
            for j in range(1, len(ids)):
                if not flags[j]:
                    continue  # only the tokens the policy generated are trained on
                context, token = ids[:j], ids[j]
                logprob = token_logprob(self.weights, context, token, self.digit0)
                diff += abs(logprob - old[j])
                ratio = math.exp(logprob - old[j])
                ratio_max = max(ratio_max, ratio)
                loss -= min(ratio * adv, min(max(ratio, low), high) * adv)
                tokens += 1
                if (adv > 0 and ratio > high) or (adv < 0 and ratio < low):
                    continue  # clipped: no gradient
                target = _target(context, self.digit0)
                expected = [0.0, 0.0, 0.0]  # E_p[features], for the gradient of log p(token)
                for d, p in enumerate(_probabilities(self.weights, target)):
                    for k, f in enumerate(_features(target, d)):
                        expected[k] += p * f
                for k, f in enumerate(_features(target, token - self.digit0)):
                    grad[k] += adv * ratio * (f - expected[k])
        if tokens:
            self.weights = [w + self.lr * g / tokens for w, g in zip(self.weights, grad)]
        self.version = step + 1
        self.trained[step] = list(batch["prompt_ids"])
        self.batches[step] = batch
        return {"loss": loss / max(tokens, 1), "grad_norm": math.sqrt(sum(g * g for g in grad)) / max(tokens, 1),
                "ratio_max": ratio_max, "sampling_logprob_diff": diff / max(tokens, 1)}

    def logprobs(self, sequences: list[list[int]]) -> list[list[float]]:
        return [sequence_logprobs(self.weights, s, self.digit0) for s in sequences]

    def save(self, directory: Path) -> None:
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        write_atomic(directory / STATE_FILE, json.dumps({"version": self.version, "weights": self.weights}))

    def load(self, directory: Path) -> None:
        state = json.loads((Path(directory) / STATE_FILE).read_text())
        self.version, self.weights = int(state["version"]), [float(w) for w in state["weights"]]


class FakeEngine:
    """One inference replica: serves the weights it last received, tagged with their version."""

    def __init__(self, *, digit0: int = DIGIT0, turn_end: int | None = None) -> None:
        self.digit0, self.turn_end = digit0, turn_end
        """Episodes: the ids of the digits and of the template's end-of-turn token (generate_turn)."""
        self.weights = list(INITIAL_WEIGHTS)  # what a replica loads from the model files at start
        self.version = 0
        self.ignored_versions: set[int] = set()
        """Pushes this replica loses (it goes on serving what it had)."""
        self.claimed_version: int | None = None
        """A version this replica reports instead of the one it holds."""
        self.generated: list[tuple[int, str, int]] = []
        """(seed, prompt id, weight version) of every prompt it generated for."""
        self.turns: list[tuple[list[int], list[int], list[float]]] = []
        """Episodes: (prompt ids, generated ids, their logprobs) of every completion of generate_turn."""

    def receive(self, version: int, weights) -> None:
        if version in self.ignored_versions:
            return
        self.version, self.weights = version, list(weights)

    def generate(self, prompts: list[Prompt], *, n: int, seed: int, offset: int = 0,
                 temperature: float | None = None) -> list[list[Completion]]:
        """temperature: None samples at 1.0 (the rollouts' inference.temperature), 0.0 is greedy (the likeliest
        digit), anything else scales the logits, as vLLM does for an evaluation."""
        version = self.version if self.claimed_version is None else self.claimed_version
        groups = []
        for k, prompt in enumerate(prompts):
            context = list(prompt.text.encode())
            target = _target(context)
            probs = _probabilities(self.weights, target)
            drawn = probs if not temperature else _probabilities(self.weights, target, temperature)
            group = []
            for s in range(n):
                if temperature == 0.0:  # greedy: the likeliest digit, the smallest of a tie
                    digit = max(range(10), key=lambda d: (probs[d], -d))
                else:
                    rng = random.Random((seed * 1_000_003 + offset + k) * 1009 + s)  # chunk-invariant (docstring)
                    u, digit = rng.random(), 0
                    while digit < 9 and u >= drawn[digit]:
                        u -= drawn[digit]
                        digit += 1
                token = 48 + digit
                group.append(Completion(prompt_id=prompt.id, index=s, prompt_token_ids=context, token_ids=[token],
                                        logprobs=[math.log(probs[digit])], text=str(digit),
                                        finish_reason="length", weight_version=version))
            groups.append(group)
            self.generated.append((seed, prompt.id, version))
        return groups

    def generate_turn(self, prompts: list[Prompt], *, n: int, seed: int, max_tokens: list[int],
                      temperature: float | None = None) -> list[list[Completion]]:
        """One turn of episodes, from their ids so far (vLLM's TokensPrompt; a partial rollout's: its prefix): a digit
        drawn as generate draws it
        (seeded by (seed, the prompt's place in the call, sample)), then the end-of-turn token (the model is
        certain of it, logprob 0) where max_tokens leaves room for it ("stop"), else the digit alone ("length").
        From ids that end in a digit (an episode's turn cut there by a partial rollouts' window): the end-of-turn
        token alone."""
        version = self.version if self.claimed_version is None else self.claimed_version
        if len(max_tokens) != len(prompts) or min(max_tokens, default=1) < 1:
            raise FakeGroupError(f"max_tokens {max_tokens} for {len(prompts)} prompts: vLLM needs one >= 1 each")
        groups = []
        for k, (prompt, limit) in enumerate(zip(prompts, max_tokens)):
            # a partial rollout goes on from its prefix; a text prompt (a partial rollout's first window) from its
            # bytes, as generate reads it
            context = list(prompt.prefix) if prompt.prefix is not None else list(prompt.token_ids) \
                if prompt.token_ids is not None else list(prompt.text.encode())
            probs = _probabilities(self.weights, _target(context, self.digit0))
            group = []
            if self.turn_end is not None and context and self.digit0 <= context[-1] < self.digit0 + 10:
                # an episode's turn cut after its digit at a partial rollout's window: the model ends it (certain)
                for s in range(n):
                    self.turns.append((context, [self.turn_end], [0.0]))
                    group.append(Completion(prompt_id=prompt.id, index=s, prompt_token_ids=context,
                                            token_ids=[self.turn_end], logprobs=[0.0], text="", finish_reason="stop",
                                            weight_version=version))
                groups.append(group)
                self.generated.append((seed, prompt.id, version))
                continue
            for s in range(n):
                if temperature == 0.0:
                    digit = max(range(10), key=lambda d: (probs[d], -d))
                else:
                    u, digit = random.Random((seed * 1_000_003 + k) * 1009 + s).random(), 0
                    while digit < 9 and u >= probs[digit]:
                        u -= probs[digit]
                        digit += 1
                ids, logprobs = [self.digit0 + digit], [math.log(probs[digit])]
                if limit > 1 and self.turn_end is not None:
                    ids, logprobs = ids + [self.turn_end], logprobs + [0.0]
                self.turns.append((context, ids, logprobs))
                group.append(Completion(prompt_id=prompt.id, index=s, prompt_token_ids=context, token_ids=ids,
                                        logprobs=logprobs, text=str(digit),
                                        finish_reason="stop" if len(ids) > 1 else "length", weight_version=version))
            groups.append(group)
            self.generated.append((seed, prompt.id, version))
        return groups

    def logprobs(self, sequences: list[list[int]]) -> list[list[float]]:
        return [sequence_logprobs(self.weights, s, self.digit0) for s in sequences]


class FakeEnvironment:
    """The "feedback" environment of hpcrl.env (a digit to guess in two tries) in memory: reset asks "guess:";
    a right digit ends the episode with reward 1; the first wrong one gets "no, it is D"; the second try ends it
    with 1 or 0. `broken(episode id)`: the call fails as a crashed or hung worker's does (an EnvReply error);
    `unrewarded`: the episodes end without a reward (the run's [reward] scores them)."""

    def __init__(self, broken: Callable[[str], bool] = lambda episode: False, *, unrewarded: bool = False) -> None:
        self.broken, self.unrewarded = broken, unrewarded
        self.calls: list[tuple[str, list[str]]] = []
        """("reset" | "step", the episode ids of the call), in order."""

    def reset(self, requests: list[EnvRequest]) -> list[EnvReply]:
        self.calls.append(("reset", [r.episode for r in requests]))
        return [EnvReply(episode=r.episode, error="worker died") if self.broken(r.episode) else
                EnvReply(episode=r.episode, messages=[{"role": "user", "content": r.row["prompt"]}])
                for r in requests]

    def step(self, requests: list[EnvRequest]) -> list[EnvReply]:
        self.calls.append(("step", [r.episode for r in requests]))
        return [self._step(r) for r in requests]

    def _step(self, request: EnvRequest) -> EnvReply:
        if self.broken(request.episode):
            return EnvReply(episode=request.episode, error="timed out after 10 s")
        tries = [m["content"].strip() for m in request.messages if m["role"] == "assistant"]
        answer = request.row["answer"]
        if tries[-1] == answer or len(tries) >= 2:
            reward = None if self.unrewarded else float(tries[-1] == answer)
            return EnvReply(episode=request.episode, messages=[], reward=reward, done=True)
        return EnvReply(episode=request.episode, messages=[{"role": "user", "content": f"no, it is {answer}"}])


class FakeReward:
    """Exact match; the samples named in `broken` ("prompt_id/k") fail as a raising verifier does."""

    def __init__(self, broken: set[str] | Callable[[str], bool] = frozenset()) -> None:
        self.broken = broken if callable(broken) else broken.__contains__

    def score(self, samples: list[Sample]) -> list[RewardResult]:
        return [RewardResult(id=s.id, prompt_id=s.prompt_id, reward=None,
                             error="ValueError: the verifier could not parse the completion")
                if self.broken(s.id) else
                RewardResult(id=s.id, prompt_id=s.prompt_id, reward=exact_match(s.prompt, s.completion, s.answer))
                for s in samples]


class FakePorts:
    """`hpcrl.rl.controller.Ports` (+ save/load_trainer) over one FakeTrainer, FakeEngine and FakeReward.

    Every call yields to the event loop once, so a generation the controller started as a task runs
    while the train step is in progress, as over the bus. `events` records, in order:
    ("generate", seed) (an evaluation's: ("generate", seed, temperature)), ("turn", seed[, temperature]) (an
    episode's turn, generate_turn), ("train", step, "begin" | "end"), ("sync", version). With `env` (a
    FakeEnvironment) the ids are the tiny tokenizer's and env_reset / env_step serve its episodes.
    """

    def __init__(self, *, reward: FakeReward | None = None, env: FakeEnvironment | None = None) -> None:
        """With `env`, episodes' ids are the tiny tokenizer's (EPISODE_DIGIT0; its <|end|> is 102)."""
        digit0 = EPISODE_DIGIT0 if env is not None else DIGIT0
        self.trainer = FakeTrainer(digit0=digit0)
        self.inference = FakeEngine(digit0=digit0, turn_end=102 if env is not None else None)
        self.reward = reward or FakeReward()
        self.env = env or FakeEnvironment()
        self.events: list[tuple] = []

    async def generate(self, prompts: list[Prompt], *, n: int, seed: int,
                       temperature: float | None = None) -> list[list[Completion]]:
        self.events.append(("generate", seed) if temperature is None else ("generate", seed, temperature))
        await asyncio.sleep(0)
        return self.inference.generate(prompts, n=n, seed=seed, temperature=temperature)

    async def generate_turn(self, prompts: list[Prompt], *, n: int, seed: int, max_tokens: list[int],
                            temperature: float | None = None) -> list[list[Completion]]:
        self.events.append(("turn", seed) if temperature is None else ("turn", seed, temperature))
        await asyncio.sleep(0)
        return self.inference.generate_turn(prompts, n=n, seed=seed, max_tokens=max_tokens, temperature=temperature)

    async def env_reset(self, requests: list[EnvRequest]) -> list[EnvReply]:
        await asyncio.sleep(0)
        return self.env.reset(requests)

    async def env_step(self, requests: list[EnvRequest]) -> list[EnvReply]:
        await asyncio.sleep(0)
        return self.env.step(requests)

    async def score(self, samples: list[Sample]) -> list[RewardResult]:
        await asyncio.sleep(0)
        return self.reward.score(samples)

    async def train_step(self, batch, *, step: int) -> dict[str, float]:
        self.events.append(("train", step, "begin"))
        await asyncio.sleep(0)
        if self.trainer.during_step is not None:
            self.trainer.during_step(step)
        metrics = self.trainer.train(batch.to_dict(), step)
        self.events.append(("train", step, "end"))
        return metrics

    async def sync_weights(self, version: int) -> None:
        await asyncio.sleep(0)
        if version < self.trainer.version:
            raise FakeGroupError(f"weights pushed as version {version}, but the trainer made version "
                                 f"{self.trainer.version}")
        self.events.append(("sync", version))
        self.inference.receive(version, self.trainer.weights)

    async def trainer_logprobs(self, sequences: list[list[int]]) -> list[list[float]]:
        await asyncio.sleep(0)
        return self.trainer.logprobs(sequences)

    async def inference_logprobs(self, sequences: list[list[int]]) -> list[list[float]]:
        await asyncio.sleep(0)
        return self.inference.logprobs(sequences)

    async def save_trainer(self, directory: Path) -> None:
        await asyncio.sleep(0)
        self.trainer.save(directory)

    async def load_trainer(self, directory: Path) -> None:
        await asyncio.sleep(0)
        self.trainer.load(directory)
