"""A batch's rollouts as episodes: one policy turn without an environment; with [env], policy turns on vLLM
and environment steps between them. Training and evaluation both run through here (hpcrl.rl.controller).

    runner = EpisodeRunner(config, ports, chat)                 # chat: the run's ChatTemplate, with [env] only
    groups, stats = await runner.run(prompts, n=group_size, seed=batch_seed)
    samples = samples_for(groups)                               # hpcrl.rl.rollouts: the episodes left unrewarded
    scored, score_stats = score_groups(groups, await ports.score(samples), weight_version=v, batch=b)

Without an environment an episode is one turn: the batch's prompts go to one Ports.generate call, n samples of
each, with the batch's seed (the inference group renders the prompts and cuts the batch into its chunks,
hpcrl.rl.ports); an episode is the prompt's ids as vLLM rendered them (mask 0) and its completion (mask 1, with
vLLM's logprobs), ended with vLLM's finish reason ("stop", "length"), and the run's [reward] scores it.

With [env], one episode, as token ids that only grow (the trainer trains on exactly the ids vLLM saw and
produced):

    reset      per prompt, one Ports.env_reset: the environment's first messages, shared by the prompt's
               group_size episodes; data.system_prompt first as for a prompt; rendered with the chat template
               (ChatTemplate.opening), mask 0
    turn t     the episode's ids so far go to vLLM as they are (Prompt.token_ids; earlier turns are never
               rendered again): turn 0 one request per prompt with n = group_size, later turns one request
               per episode with n = 1, max_tokens = min(inference.max_tokens, env.max_tokens - ids so far);
               the turn's ids are appended with mask 1 and vLLM's logprobs
    step       Ports.env_step with the conversation (the policy's turn last, as text): done (with or without
               a reward), or messages to append: ChatTemplate.continuation's ids (the rest of the policy's turn
               ending, the messages, the generation prompt), mask 0
    end        the environment says done; or env.max_turns policy turns were made ("max_turns": cut); or the
               next turn would have no token left of env.max_tokens ("budget": truncated)

Reward: the environment's when it gives one; otherwise (no environment, done without a reward, cut, truncated)
the run's [reward] scores the episode's last policy turn (Ports.score, completion = that turn's text). An episode
whose environment call failed (an EnvReply error: it raised, hung, its worker died), whose environment's messages
the model's chat template cannot render (a "tool" message on a template without that role: hpcrl.data.chat's
MessagesRefused, counted with the environment errors) or whose reward failed has no
outcome: its whole group is held out of training and counted, never scored zero (hpcrl.rl.rollouts).

Scheduling with [env], the same whatever the timing (a resumed run draws the same tokens): the batch's prompts
are cut into contiguous chunks, CHUNKS_PER_REPLICA per inference replica, and each chunk runs in waves: one
Ports.generate_turn call for its live episodes of turn t (to one replica; the seed fixed by the batch's
seed, the chunk and the turn, so which replica serves it changes nothing), then one env_step call for them,
then turn t + 1. Chunks run concurrently, so while one chunk waits on its environments a replica serves
another. The batch's episodes finish on the weights they started with: the controller releases the
inference group for the weight sync only after the batch's last turn (docs/ARCHITECTURE.md, "A rollout").
With algorithm.partial_rollouts they need not: EpisodeRunner.window generates one window of hpcrl.rl.partial's
PartialEpisodes, and an episode's turns go on across syncs.

Figures (EpisodeStats): turns per episode, episodes truncated at the budget and cut at max_turns, environment
errors, time_env_s (wall time with any environment call outstanding), time_env_wait_s (wall time with an
environment call outstanding and no turn generating: the inference replicas idle, waiting on environments),
time_turn_s (mean wall time of one turn's generate call), the tokens generated and the weight versions.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from hpcrl.algorithms.base import Rollout
from hpcrl.config.schema import Config
from hpcrl.data.chat import MessagesRefused
from hpcrl.data.prompts import Prompt
from hpcrl.env.types import EnvReply, EnvRequest
from hpcrl.errors import HpcrlError
from hpcrl.inference.types import Completion

if TYPE_CHECKING:
    from hpcrl.data.chat import ChatTemplate

#: Chunks of a batch per inference replica: with two, a replica has another chunk's turn to generate while
#: one chunk waits on its environments.
CHUNKS_PER_REPLICA = 2


class EpisodeError(HpcrlError):
    """The environment or vLLM answered something an episode cannot go on from (a schedule invariant broke)."""


class EpisodePorts(Protocol):
    """What episodes need of the groups (a part of hpcrl.rl.controller.Ports): generate without an environment;
    generate_turn, env_reset and env_step with one."""

    async def generate(self, prompts: list[Prompt], *, n: int, seed: int,
                       temperature: float | None = None) -> list[list[Completion]]: ...
    async def generate_turn(self, prompts: list[Prompt], *, n: int, seed: int, max_tokens: list[int],
                            temperature: float | None = None) -> list[list[Completion]]: ...
    async def env_reset(self, requests: list[EnvRequest]) -> list[EnvReply]: ...
    async def env_step(self, requests: list[EnvRequest]) -> list[EnvReply]: ...


class _WindowGroup(Protocol):
    episodes: list[Episode]
    opened: bool


class _WindowRequest(Protocol):
    @property
    def prompt(self) -> Prompt: ...
    @property
    def max_tokens(self) -> int: ...


class EpisodeWindows(Protocol):
    """What EpisodeRunner.window needs of its state: hpcrl.rl.partial.PartialEpisodes, named here by its shape
    (hpcrl.rl.partial imports this module: imports point one way)."""

    @property
    def groups(self) -> Sequence[_WindowGroup]: ...
    def add(self, prompts: list[Prompt], *, group_size: int) -> Sequence[_WindowGroup]: ...
    def plan_window(self, *, segment: int, turn_tokens: int, episode_tokens: int) -> Sequence[_WindowRequest]: ...
    def apply_window(self, requests: Any, completions: list[Completion], *, turn_tokens: int, episode_tokens: int
                     ) -> tuple[list[int], list[tuple[Episode, list[int]]]]: ...
    def take_finished(self) -> Sequence[_WindowGroup]: ...


def turn_seed(seed: int, chunk: int, turn: int) -> int:
    """The sampling seed of turn `turn` of chunk `chunk` of a batch generated with `seed` (63 bits of sha256)."""
    digest = hashlib.sha256(f"hpcrl-episode:{seed}:{chunk}:{turn}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def env_row(prompt: Prompt) -> dict:
    """The prompt's row as an environment sees it (hpcrl.env.types.EnvRequest.row)."""
    row = {**prompt.extra, "id": prompt.id, "prompt": prompt.text, "answer": prompt.answer}
    if prompt.messages:
        row["messages"] = [dict(m) for m in prompt.messages]
    return row


@dataclass
class Episode:
    """One episode as it grows: the conversation (for the environment) and its ids (for vLLM and the trainer)."""

    prompt: Prompt
    index: int
    """Which of the prompt's episodes (its place in the group)."""
    messages: list[dict] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    turns: int = 0
    text: str = ""
    """The last policy turn's text: what the run's [reward] scores when the environment gives no reward."""
    reward: float | None = None
    finish_reason: str = ""
    """"done" (the environment ended it), "max_turns" (cut), "budget" (truncated at env.max_tokens); without an
    environment vLLM's ("stop", "length")."""
    error: str | None = None
    """Why the episode has no outcome (an environment call failed): its group is held out."""
    versions: set[int] = field(default_factory=set)
    """The weight versions its turns were generated with."""
    token_versions: list[int] | None = None
    """With partial rollouts (hpcrl.rl.partial): the version that sampled each token, -1 on the prompt."""

    @property
    def id(self) -> str:
        return f"{self.prompt.id}/{self.index}"

    @property
    def ended(self) -> bool:
        return bool(self.finish_reason) or self.error is not None

    def append(self, ids: list[int], *, logprobs: list[float] | None = None, version: int = -1) -> None:
        """Ids of the policy (with their logprobs: mask 1) or of anything else (mask 0). With per-token versions
        (partial rollouts) each id keeps `version`, the weights that sampled it (-1: not the policy's)."""
        if logprobs is not None and len(logprobs) != len(ids):
            raise EpisodeError(f"{len(logprobs)} logprobs for a turn of {len(ids)} tokens in episode {self.id}: "
                               "the inference group must give one per generated token")
        self.tokens += ids
        self.mask += [1 if logprobs is not None else 0] * len(ids)
        self.logprobs += list(logprobs) if logprobs is not None else [0.0] * len(ids)
        if self.token_versions is not None:
            self.token_versions += [version if logprobs is not None else -1] * len(ids)

    def rollout(self, reward: float) -> Rollout:
        return Rollout(tokens=list(self.tokens), policy_mask=list(self.mask), logprobs=list(self.logprobs),
                       reward=reward, finish_reason=self.finish_reason,
                       versions=None if self.token_versions is None else list(self.token_versions))


@dataclass
class EpisodeStats:
    """A batch's episodes in figures (module docstring)."""

    turns: list[int] = field(default_factory=list)
    truncated: int = 0
    cut: int = 0
    env_errors: list[str] = field(default_factory=list)
    """"episode: why", for the log and the metrics' example."""
    time_env_s: float = 0.0
    time_env_wait_s: float = 0.0
    turn_times: list[float] = field(default_factory=list)
    generate_tokens: int = 0
    versions: set[int] = field(default_factory=set)

    def merge(self, other: EpisodeStats) -> None:
        """Add another round's figures (dynamic sampling)."""
        self.turns += other.turns
        self.truncated += other.truncated
        self.cut += other.cut
        self.env_errors += other.env_errors
        self.time_env_s += other.time_env_s
        self.time_env_wait_s += other.time_env_wait_s
        self.turn_times += other.turn_times
        self.generate_tokens += other.generate_tokens
        self.versions |= other.versions

    def metrics(self) -> dict:
        count = len(self.turns)
        return {"turns_mean": sum(self.turns) / count if count else None, "episodes": count,
                "episodes_truncated": self.truncated, "episodes_cut_max_turns": self.cut,
                "env_errors": len(self.env_errors), "env_error_example": self.env_errors[0] if self.env_errors else None,
                "time_env_s": self.time_env_s, "time_env_wait_s": self.time_env_wait_s,
                "time_turn_s": sum(self.turn_times) / len(self.turn_times) if self.turn_times else None}


class _Clock:
    """Wall time with an environment call outstanding, and of that, with no generate call outstanding."""

    def __init__(self) -> None:
        self.generating = self.stepping = 0
        self.env_s = self.wait_s = 0.0
        self._since = time.monotonic()

    def _tick(self) -> None:
        now = time.monotonic()
        if self.stepping:
            self.env_s += now - self._since
            if not self.generating:
                self.wait_s += now - self._since
        self._since = now

    @asynccontextmanager
    async def generate(self) -> AsyncIterator[None]:
        self._tick()
        self.generating += 1
        try:
            yield
        finally:
            self._tick()
            self.generating -= 1

    @asynccontextmanager
    async def env(self) -> AsyncIterator[None]:
        self._tick()
        self.stepping += 1
        try:
            yield
        finally:
            self._tick()
            self.stepping -= 1


def _replies(replies: list[EnvReply], requests: list[EnvRequest], call: str) -> list[EnvReply]:
    """The replies in request order, each for its request's episode."""
    if len(replies) != len(requests) or any(r.episode != q.episode for r, q in zip(replies, requests)):
        raise EpisodeError(f"{call} answered episodes {[r.episode for r in replies]} to "
                           f"{[q.episode for q in requests]}: the environment group broke the request order")
    return replies


def _count(groups: list[list[Episode]], stats: EpisodeStats, clock: _Clock) -> None:
    """The ended episodes' turns, truncations and cuts, and the clock's environment times, into `stats`."""
    clock._tick()
    stats.time_env_s, stats.time_env_wait_s = clock.env_s, clock.wait_s
    for group in groups:
        for episode in group:
            if episode.error is None:
                stats.turns.append(episode.turns)
                stats.truncated += episode.finish_reason == "budget"
                stats.cut += episode.finish_reason == "max_turns"


def _hold_out(groups: list[list[Episode]]) -> None:
    """A group with an episode without outcome is held out: its other episodes stop here."""
    for group in groups:
        if any(e.error is not None for e in group):
            for episode in group:
                if not episode.ended:
                    episode.error = "held out with its group"


def _add_turn(episode: Episode, completion: Completion) -> None:
    """Append a policy turn vLLM generated to the episode: its ids (mask 1) with their logprobs."""
    episode.append(list(completion.token_ids), logprobs=list(completion.logprobs))
    episode.turns += 1
    episode.text = completion.text
    episode.versions.add(completion.weight_version)


class EpisodeRunner:
    """Runs a batch's episodes over `ports` (module docstring)."""

    def __init__(self, config: Config, ports: EpisodePorts, chat: ChatTemplate | None = None) -> None:
        self.config = config
        self.ports = ports
        self.chat = chat
        self.env = config.env

    async def run(self, prompts: list[Prompt], *, n: int, seed: int,
                  temperature: float | None = None) -> tuple[list[list[Episode]], EpisodeStats]:
        """`n` episodes of every prompt, as one list per prompt in prompt order, and the batch's figures."""
        groups = [[Episode(prompt=p, index=k) for k in range(n)] for p in prompts]
        if not prompts:
            return groups, EpisodeStats()
        stats, clock = EpisodeStats(), _Clock()
        if self.env.environment:
            chunks = min(len(prompts), CHUNKS_PER_REPLICA * self.config.inference.replicas) or 1
            size = -(-len(prompts) // chunks)
            await asyncio.gather(*(self._chunk(c, groups[at:at + size], n=n, seed=seed, temperature=temperature,
                                               stats=stats, clock=clock)
                                   for c, at in enumerate(range(0, len(prompts), size))))
        else:
            await self._one_turn(groups, n=n, seed=seed, temperature=temperature, stats=stats, clock=clock)
        _count(groups, stats, clock)
        for group in groups:
            for episode in group:
                stats.versions |= episode.versions
        return groups, stats

    async def window(self, state: EpisodeWindows, prompts: list[Prompt], *, n: int, seed: int, segment: int
                     ) -> tuple[list[list[Episode]], EpisodeStats, list[int]]:
        """With partial rollouts (`state`: hpcrl.rl.partial.PartialEpisodes): one window. The groups of `prompts` (n
        episodes each) are opened by the environment's reset; every live episode, oldest group first, generates
        at most `segment` more tokens of its turn from its ids so far (one generate_turn call per inference
        replica, a contiguous chunk each, seeded turn_seed(seed, chunk, 0)); the turns completed in the window go
        to the environment's step. Returns the groups whose every episode ended (removed from `state`, in the
        order they started), the window's figures (turns counted over those groups; `versions` the window's) and
        the tokens each sequence generated."""
        stats, clock = EpisodeStats(), _Clock()
        added = state.add(prompts, group_size=n)
        await self._open([group.episodes for group in added], stats=stats, clock=clock)
        for group in added:
            group.opened = True
        limits = {"turn_tokens": self.config.inference.max_tokens, "episode_tokens": self.env.max_tokens}
        requests = state.plan_window(segment=segment, **limits)
        size = -(-len(requests) // max(1, self.config.inference.replicas)) or 1
        chunks = [requests[at:at + size] for at in range(0, len(requests), size)]
        parts = await asyncio.gather(*(
            self._generate([r.prompt for r in chunk], n=1, seed=turn_seed(seed, c, 0),
                           limits=[r.max_tokens for r in chunk], temperature=None, stats=stats, clock=clock)
            for c, chunk in enumerate(chunks)))
        completions = [made[0] for part in parts for made in part]
        stats.versions = {c.weight_version for c in completions}
        lengths, done = state.apply_window(requests, completions, **limits)
        await self._step([episode for episode, _ in done], [turn for _, turn in done], stats=stats, clock=clock)
        _hold_out([group.episodes for group in state.groups])
        finished = [group.episodes for group in state.take_finished()]
        _count(finished, stats, clock)
        return finished, stats, lengths

    async def _one_turn(self, groups: list[list[Episode]], *, n: int, seed: int, temperature: float | None,
                        stats: EpisodeStats, clock: _Clock) -> None:
        """Without an environment: the prompts as they are to one generate call (module docstring)."""
        completions = await self._generate([group[0].prompt for group in groups], n=n, seed=seed, limits=None,
                                           temperature=temperature, stats=stats, clock=clock)
        for group, made in zip(groups, completions):
            for episode, completion in zip(group, made, strict=True):
                episode.append(list(completion.prompt_token_ids))
                _add_turn(episode, completion)
                episode.finish_reason = completion.finish_reason

    async def _open(self, groups: list[list[Episode]], *, stats: EpisodeStats, clock: _Clock) -> None:
        """The environment's reset of each group (one call for them all): its first messages, rendered with the
        chat template, open each of the group's episodes (mask 0); a failed reset holds the group out."""
        if not groups:
            return
        # Reset under the id of the group's first episode: the worker that holds it goes on with that instance.
        requests = [EnvRequest(episode=group[0].id, row=env_row(group[0].prompt)) for group in groups]
        async with clock.env():
            replies = _replies(await self.ports.env_reset(requests), requests, "env_reset")
        for group, reply in zip(groups, replies):
            if reply.error is not None or reply.messages is None:
                stats.env_errors.append(f"{reply.episode} (reset): {reply.error or 'no messages'}")
                for episode in group:
                    episode.error = f"reset: {reply.error}"
                continue
            assert self.chat is not None, "episodes with an environment need the run's chat template"
            try:
                messages, ids = self.chat.opening(group[0].prompt, reply.messages)
            except MessagesRefused as err:  # messages the pool took but the model's template cannot render
                stats.env_errors.append(f"{reply.episode} (reset): {err}")
                for episode in group:
                    episode.error = f"reset: {err}"
                continue
            for episode in group:
                episode.messages = list(messages)
                episode.append(ids)
                self._check_budget(episode)

    async def _chunk(self, chunk: int, groups: list[list[Episode]], *, n: int, seed: int,
                     temperature: float | None, stats: EpisodeStats, clock: _Clock) -> None:
        if not groups:
            return
        await self._open(groups, stats=stats, clock=clock)
        for turn in range(self.env.max_turns):
            live = [e for group in groups for e in group if not e.ended]
            if not live:
                return
            if turn == 0:  # every episode of a prompt starts from the same ids: one request, n samples
                firsts = [group for group in groups if not group[0].ended]
                asked = [Prompt(id=g[0].prompt.id, text="", answer="", token_ids=list(g[0].tokens)) for g in firsts]
                limits = [self._limit(g[0]) for g in firsts]
                completions = await self._generate(asked, n=n, seed=turn_seed(seed, chunk, turn), limits=limits,
                                                   temperature=temperature, stats=stats, clock=clock)
                pairs = [(e, c) for g, cs in zip(firsts, completions) for e, c in zip(g, cs, strict=True)]
            else:
                asked = [Prompt(id=e.id, text="", answer="", token_ids=list(e.tokens)) for e in live]
                completions = await self._generate(asked, n=1, seed=turn_seed(seed, chunk, turn),
                                                   limits=[self._limit(e) for e in live], temperature=temperature,
                                                   stats=stats, clock=clock)
                pairs = [(e, cs[0]) for e, cs in zip(live, completions)]
            for episode, completion in pairs:
                if completion.prompt_token_ids != episode.tokens:
                    raise EpisodeError(f"vLLM generated turn {turn} of episode {episode.id} from other ids than the "
                                       "episode's")
                _add_turn(episode, completion)
                episode.messages.append({"role": "assistant", "content": completion.text})
            await self._step([e for e, _ in pairs], [list(c.token_ids) for _, c in pairs], stats=stats, clock=clock)
            _hold_out(groups)

    def _limit(self, episode: Episode) -> int:
        return min(self.config.inference.max_tokens, self.env.max_tokens - len(episode.tokens))

    def _check_budget(self, episode: Episode) -> None:
        """Truncate the episode when not one more policy token fits in env.max_tokens."""
        if not episode.ended and len(episode.tokens) >= self.env.max_tokens:
            episode.finish_reason = "budget"

    async def _generate(self, prompts: list[Prompt], *, n: int, seed: int, limits: list[int] | None,
                        temperature: float | None, stats: EpisodeStats, clock: _Clock) -> list[list[Completion]]:
        """A turn of `prompts`: without `limits` (no environment) the plain generate call, else generate_turn."""
        started = time.monotonic()
        async with clock.generate():
            if limits is None:
                completions = await self.ports.generate(prompts, n=n, seed=seed, temperature=temperature)
            else:
                completions = await self.ports.generate_turn(prompts, n=n, seed=seed, max_tokens=limits,
                                                             temperature=temperature)
        stats.turn_times.append(time.monotonic() - started)
        if len(completions) != len(prompts) or any(len(c) != n for c in completions):
            raise EpisodeError(f"generate_turn answered {[len(c) for c in completions]} completions to "
                               f"{len(prompts)} prompts x {n}")
        stats.generate_tokens += sum(len(c.token_ids) for group in completions for c in group)
        return completions

    async def _step(self, episodes: list[Episode], turns: list[list[int]], *, stats: EpisodeStats,
                    clock: _Clock) -> None:
        """The environment's step on each episode's conversation, its policy turn (`turns`: the turn's ids) last:
        done, or its messages appended (ChatTemplate.continuation, mask 0); an episode that made env.max_turns
        turns is cut there."""
        if not episodes:
            return
        requests = [EnvRequest(episode=e.id, row=env_row(e.prompt), messages=list(e.messages)) for e in episodes]
        async with clock.env():
            replies = _replies(await self.ports.env_step(requests), requests, "env_step")
        for episode, turn, reply in zip(episodes, turns, replies):
            if reply.error is not None or (reply.messages is None and not reply.done):
                episode.error = reply.error or "the environment answered no messages"
                stats.env_errors.append(f"{episode.id} (turn {episode.turns}): {episode.error}")
            elif reply.done:
                episode.finish_reason, episode.reward = "done", reply.reward
            elif episode.turns >= self.env.max_turns:
                episode.finish_reason = "max_turns"
            else:
                new = list(reply.messages or [])
                assert self.chat is not None
                try:
                    ids = self.chat.continuation(episode.messages, new, turn)
                except MessagesRefused as err:  # messages the pool took but the template cannot render (a "tool" role)
                    episode.error = str(err)
                    stats.env_errors.append(f"{episode.id} (turn {episode.turns}): {episode.error}")
                    continue
                if len(episode.tokens) + len(ids) >= self.env.max_tokens:
                    episode.finish_reason = "budget"  # the environment's answer and a next turn do not fit
                else:
                    episode.append(ids)
                    episode.messages += new
