"""Rollouts that continue across weight syncs (algorithm.partial_rollouts): the bookkeeping, pure.

Without partial rollouts a batch waits for its longest generation. With them, batch b's generation is a
*window*: every sequence of the window generates at most `algorithm.partial_tokens` tokens, and a sequence
that has not finished by then is not thrown away or waited for: it is carried to window b + 1, which runs
on the newer weights, and goes on from the tokens it has (the inference side re-reads them as its prompt:
docs/ARCHITECTURE.md, "Partial rollouts"). A window holds the carried sequences, oldest group first, then
the `group_size` members of each of the batch's new prompts; a group enters the batch of the window in
which its last member finishes.

    state = PartialState()
    requests = state.plan_window(prompts, group_size=16, segment=32, budget=264)     # what to generate
    ... completions = one vLLM call: requests' prompts, one completion each, requests' max_tokens ...
    lengths = state.apply_window(requests, completions)     # tokens carry their completion's weight_version
    groups = state.take_finished()                                                  # whole groups, in start order
    dropped = state.drop_stale(step=5, max_policy_lag=4)                            # groups that may never train

Each token keeps the logprob vLLM reported under the weights that sampled it and the version of those
weights (`Sequence.versions`); the trainer's importance ratio is per token against that logprob (every
algorithm's loss takes the rollouts' per-token logprobs as `old_logprobs`). `max_policy_lag` bounds the
oldest token a step trains on: a group whose oldest token was sampled with version o is trained at step s
only while s - o <= max_policy_lag (hpcrl.rl.buffer checks it on the scored group, whose weight_version is
its oldest token's); `drop_stale` drops, before a window, the groups that could no longer meet it.

Multi-turn episodes ([env]) get the same (`PartialEpisodes`): in a window every live episode generates at most
`partial_tokens` more tokens of its policy turn in progress, from its ids so far. A turn that vLLM ended, or that
reached its own limit (inference.max_tokens for a turn, env.max_tokens for the episode), is complete: it joins
the conversation, and the environment's step (hpcrl.rl.episodes, EpisodeRunner.window) answers it within the same
window; one cut at the window goes on in the next, on the newer weights. So a long turn or a long episode does
not hold the batch. An episode is plain data (its ids, mask, logprobs, per-token versions, the conversation, the
turn in progress): environments are stateless between calls (hpcrl.env.types), so a checkpoint holds every
half-made episode and a resumed run goes on exactly where an uninterrupted one would.

Nothing here does I/O or reads a clock: the controller (hpcrl.rl.controller) calls the inference group and
the reward group around it, and checkpoints `to_dict()` with the loop's state, so a resumed run carries
the same sequences into the same window (with the same seed) as an uninterrupted one.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Generic, Protocol, TypeVar

from hpcrl.data.types import Prompt
from hpcrl.errors import HpcrlError
from hpcrl.inference.types import Completion
from hpcrl.rl.episodes import Episode


class PartialError(HpcrlError):
    """A window's answer does not fit its requests."""


@dataclass
class Sequence:
    """One member of a group as it is generated over windows."""

    index: int
    """Its place in the group."""
    budget: int
    """Most tokens it may generate in all (inference.max_tokens)."""
    prompt_ids: list[int] | None = None
    """The prompt's ids as vLLM read them (after its first window)."""
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    """vLLM's logprob of each token, under the weights that sampled it."""
    versions: list[int] = field(default_factory=list)
    """The weight version that sampled each token."""
    text: str = ""
    finish_reason: str = ""
    """vLLM's ("stop", "length" at the budget) once finished; "" while it goes on."""

    @property
    def finished(self) -> bool:
        return bool(self.finish_reason)

    @property
    def left(self) -> int:
        return self.budget - len(self.tokens)


@dataclass
class Group:
    """The group_size sequences of one prompt."""

    prompt: Prompt
    members: list[Sequence]

    @property
    def finished(self) -> bool:
        return all(m.finished for m in self.members)

    @property
    def oldest(self) -> int | None:
        """The version of the group's oldest token; None before any token."""
        return min((m.versions[0] for m in self.members if m.versions), default=None)

    def episodes(self) -> list[Episode]:
        """The finished group as one-turn episodes (hpcrl.rl.rollouts scores them): mask 0 and version -1 on the
        prompt, each generated token with its logprob and version."""
        made = []
        for m in self.members:
            prompt = m.prompt_ids or []
            made.append(Episode(prompt=self.prompt, index=m.index, tokens=prompt + m.tokens,
                                mask=[0] * len(prompt) + [1] * len(m.tokens),
                                logprobs=[0.0] * len(prompt) + m.logprobs, turns=1, text=m.text,
                                finish_reason=m.finish_reason, versions=set(m.versions),
                                token_versions=[-1] * len(prompt) + m.versions))
        return made

    def to_dict(self) -> dict:
        return {"prompt": asdict(self.prompt), "members": [asdict(m) for m in self.members]}

    @classmethod
    def from_dict(cls, data: dict) -> Group:
        return cls(prompt=Prompt(**data["prompt"]), members=[Sequence(**m) for m in data["members"]])


@dataclass(frozen=True)
class Request:
    """One sequence of a window: the prompt to send (with `prefix` for a carried one), its token limit."""

    group: int
    member: int
    prompt: Prompt
    max_tokens: int


def idle_share(lengths: list[int]) -> float:
    """The share of a window's sequence slots left empty waiting for its longest sequence: 1 - sum / (n x max) of
    the tokens each sequence generated in it (0 for an empty window). Every sequence of a window starts in
    its first engine step, so this is the share of (sequence, step) pairs in which a sequence was done while
    the window's last one was still generating."""
    if not lengths or max(lengths) == 0:
        return 0.0
    return 1.0 - sum(lengths) / (len(lengths) * max(lengths))


def time_idle_share(spans: list[tuple[float, float]]) -> float:
    """The same share in wall time, from each request's (scheduled, last token) times: 1 - (the time integral of
    the requests running) / (their peak count x the call's span, first scheduled to last token). A request queued
    for a free slot counts from when it is scheduled, so an engine that refills its slots from its queue is not
    idle. 0 for no requests or a span of 0."""
    if not spans:
        return 0.0
    start, end = min(a for a, _ in spans), max(b for _, b in spans)
    events = sorted([(a, 1) for a, _ in spans] + [(b, -1) for _, b in spans])
    running = peak = 0
    area, last = 0.0, start
    for when, change in events:
        area += running * (when - last)
        running += change
        peak = max(peak, running)
        last = when
    return 1.0 - area / (peak * (end - start)) if end > start and peak else 0.0


class _Stale(Protocol):
    @property
    def finished(self) -> bool: ...
    @property
    def oldest(self) -> int | None: ...


G = TypeVar("G", bound=_Stale)


class _InFlight(Generic[G]):
    """Groups being generated over windows, in the order they started: what the two kinds below share."""

    def __init__(self) -> None:
        self.groups: list[G] = []

    def __len__(self) -> int:
        return len(self.groups)

    def take_finished(self) -> list[G]:
        """The groups whose every member finished, removed, in the order they started."""
        done = [g for g in self.groups if g.finished]
        self.groups = [g for g in self.groups if all(g is not d for d in done)]
        return done

    def drop_stale(self, *, step: int, max_policy_lag: int) -> list[G]:
        """Remove the groups that step `step` (or any later one) may not train on: their oldest token is more than
        `max_policy_lag` versions behind `step`. Returns them."""
        stale = [g for g in self.groups if g.oldest is not None and step - g.oldest > max_policy_lag]
        self.groups = [g for g in self.groups if all(g is not s for s in stale)]
        return stale


class PartialState(_InFlight[Group]):
    """The groups being generated, in the order they started."""

    def carried(self) -> int:
        """Sequences started and not finished: what the next window goes on with."""
        return sum(1 for g in self.groups for m in g.members if not m.finished and m.tokens)

    def plan_window(self, prompts: list[Prompt], *, group_size: int, segment: int, budget: int | list[int]
                    ) -> list[Request]:
        """Add `prompts` as new groups (`budget` tokens each member, or one budget per prompt) and return the
        window's requests: every unfinished sequence, carried ones first (oldest group first), each with at
        most `segment` tokens. A carried sequence's prompt has `prefix` = its prompt's ids and its tokens."""
        if segment < 1:
            raise PartialError(f"a window of {segment} tokens per sequence; give at least 1")
        budgets = budget if isinstance(budget, list) else [budget] * len(prompts)
        if len(budgets) != len(prompts) or min(budgets, default=1) < 1:
            raise PartialError(f"budgets {budgets} for {len(prompts)} prompts: give one of at least 1 per prompt")
        for prompt, tokens in zip(prompts, budgets):
            self.groups.append(Group(prompt=prompt, members=[Sequence(index=k, budget=tokens)
                                                             for k in range(group_size)]))
        requests = []
        for g, group in enumerate(self.groups):
            for k, member in enumerate(group.members):
                if member.finished:
                    continue
                prompt = group.prompt
                if member.tokens:
                    assert member.prompt_ids is not None
                    prompt = Prompt(**{**asdict(prompt), "prefix": member.prompt_ids + member.tokens})
                requests.append(Request(group=g, member=k, prompt=prompt, max_tokens=min(segment, member.left)))
        # Carried sequences first: they were started before any of the window's new ones.
        return sorted(requests, key=lambda r: 0 if r.prompt.prefix is not None else 1)

    def apply_window(self, requests: list[Request], completions: list[Completion]) -> list[int]:
        """Append each request's completion to its sequence, every token tagged with the completion's weight
        version (the weights that sampled it); a sequence is finished when vLLM stopped it, or when it reached its
        budget. Returns the tokens each request generated."""
        if len(completions) != len(requests):
            raise PartialError(f"{len(completions)} completions for a window of {len(requests)} sequences")
        lengths: list[int] = []
        for request, completion in zip(requests, completions):
            group = self.groups[request.group]
            member = group.members[request.member]
            if completion.prompt_id != group.prompt.id:
                raise PartialError(f"the window's completion {len(lengths)} is of prompt {completion.prompt_id!r}, "
                                   f"its request of {group.prompt.id!r}")
            made = list(completion.token_ids)
            if len(made) > request.max_tokens or len(completion.logprobs) != len(made):
                raise PartialError(f"{len(made)} tokens and {len(completion.logprobs)} logprobs for a request of at "
                                   f"most {request.max_tokens} tokens ({group.prompt.id}/{member.index})")
            if member.prompt_ids is None:
                member.prompt_ids = list(completion.prompt_token_ids)
            elif list(completion.prompt_token_ids) != member.prompt_ids + member.tokens:
                raise PartialError(f"{group.prompt.id}/{member.index} went on from other tokens than it had")
            member.tokens += made
            member.logprobs += list(completion.logprobs)
            member.versions += [completion.weight_version] * len(made)
            member.text += completion.text
            if completion.finish_reason != "length":
                member.finish_reason = completion.finish_reason
            elif member.left <= 0:
                member.finish_reason = "length"
            lengths.append(len(made))
        return lengths

    def to_dict(self) -> dict:
        return {"groups": [g.to_dict() for g in self.groups]}

    def load_dict(self, data: dict) -> None:
        self.groups = [Group.from_dict(g) for g in data.get("groups", [])]


# -- multi-turn episodes ([env]) ----------------------------------------------------------------------------------
@dataclass
class EpisodeGroup:
    """The group_size episodes of one prompt, as they are generated over windows."""

    prompt: Prompt
    episodes: list[Episode]
    opened: bool = False
    """The environment's reset is done and the episodes hold their first messages."""
    turn_ids: list[list[int]] = field(default_factory=list)
    """Per episode: the ids of its policy turn in progress (cut at a window), [] between turns."""
    turn_text: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.turn_ids = self.turn_ids or [[] for _ in self.episodes]
        self.turn_text = self.turn_text or ["" for _ in self.episodes]

    @property
    def finished(self) -> bool:
        return self.opened and all(e.ended for e in self.episodes)

    @property
    def oldest(self) -> int | None:
        """The version of the group's oldest policy token; None before any."""
        return min((v for e in self.episodes for v in (e.token_versions or []) if v >= 0), default=None)

    def to_dict(self) -> dict:
        episodes = [{**asdict(e), "versions": sorted(e.versions)} for e in self.episodes]
        return {"prompt": asdict(self.prompt), "episodes": episodes, "opened": self.opened,
                "turn_ids": self.turn_ids, "turn_text": self.turn_text}

    @classmethod
    def from_dict(cls, data: dict) -> EpisodeGroup:
        prompt = Prompt(**data["prompt"])
        episodes = [Episode(**{**e, "prompt": prompt, "versions": set(e["versions"])}) for e in data["episodes"]]
        return cls(prompt=prompt, episodes=episodes, opened=data["opened"], turn_ids=data["turn_ids"],
                   turn_text=data["turn_text"])


@dataclass(frozen=True)
class TurnRequest:
    """One episode's segment in a window: its ids so far (Prompt.token_ids) and its token limit."""

    group: int
    episode: int
    prompt: Prompt
    max_tokens: int


class PartialEpisodes(_InFlight[EpisodeGroup]):
    """The episode groups being generated, in the order they started (module docstring); a group is finished once
    opened and every episode ended."""

    def add(self, prompts: list[Prompt], *, group_size: int) -> list[EpisodeGroup]:
        """New groups for `prompts`, not opened yet (the environment's reset opens them); returns them."""
        made = [EpisodeGroup(prompt=p, episodes=[Episode(prompt=p, index=k, token_versions=[])
                                                 for k in range(group_size)]) for p in prompts]
        self.groups += made
        return made

    def carried(self) -> int:
        """Episodes started and not ended: what the next window goes on with."""
        return sum(1 for g in self.groups if g.opened for e in g.episodes if not e.ended)

    def plan_window(self, *, segment: int, turn_tokens: int, episode_tokens: int) -> list[TurnRequest]:
        """Every live episode of an opened group, oldest group first, with its ids so far and at most `segment`
        tokens: no more than what is left of its turn (`turn_tokens`, inference.max_tokens) and of the episode
        (`episode_tokens`, env.max_tokens)."""
        if segment < 1:
            raise PartialError(f"a window of {segment} tokens per sequence; give at least 1")
        requests = []
        for g, group in enumerate(self.groups):
            if not group.opened:
                continue
            for k, episode in enumerate(group.episodes):
                if episode.ended:
                    continue
                left = min(segment, turn_tokens - len(group.turn_ids[k]), episode_tokens - len(episode.tokens))
                if left < 1:
                    raise PartialError(f"episode {episode.id} is live with no token left of its turn or budget")
                requests.append(TurnRequest(group=g, episode=k, max_tokens=left, prompt=Prompt(
                    id=episode.id, text="", answer="", token_ids=list(episode.tokens))))
        return requests

    def apply_window(self, requests: list[TurnRequest], completions: list[Completion], *, turn_tokens: int,
                     episode_tokens: int) -> tuple[list[int], list[tuple[Episode, list[int]]]]:
        """Append each request's completion to its episode, each token with its logprob and the completion's weight
        version. Returns the tokens each request generated, and the turns completed in this window: (episode, the
        turn's ids), each turn joined to the episode's conversation, for the environment's step. A turn is complete
        when vLLM ended it, or when it reached `turn_tokens` or the episode `episode_tokens`."""
        if len(completions) != len(requests):
            raise PartialError(f"{len(completions)} completions for a window of {len(requests)} sequences")
        lengths: list[int] = []
        done: list[tuple[Episode, list[int]]] = []
        for request, completion in zip(requests, completions):
            group = self.groups[request.group]
            episode = group.episodes[request.episode]
            made = list(completion.token_ids)
            if len(made) > request.max_tokens or len(completion.logprobs) != len(made):
                raise PartialError(f"{len(made)} tokens and {len(completion.logprobs)} logprobs for a request of at "
                                   f"most {request.max_tokens} tokens (episode {episode.id})")
            if list(completion.prompt_token_ids) != episode.tokens:
                raise PartialError(f"episode {episode.id} went on from other ids than it had")
            episode.append(made, logprobs=list(completion.logprobs), version=completion.weight_version)
            episode.versions.add(completion.weight_version)
            group.turn_ids[request.episode] += made
            group.turn_text[request.episode] += completion.text
            lengths.append(len(made))
            turn = group.turn_ids[request.episode]
            if completion.finish_reason != "length" or len(turn) >= turn_tokens or \
                    len(episode.tokens) >= episode_tokens:
                episode.turns += 1
                episode.text = group.turn_text[request.episode]
                episode.messages.append({"role": "assistant", "content": episode.text})
                done.append((episode, turn))
                group.turn_ids[request.episode], group.turn_text[request.episode] = [], ""
        return lengths, done

    def to_dict(self) -> dict:
        return {"episode_groups": [g.to_dict() for g in self.groups]}

    def load_dict(self, data: dict) -> None:
        self.groups = [EpisodeGroup.from_dict(g) for g in data.get("episode_groups", [])]
