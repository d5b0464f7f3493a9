"""What every algorithm is made of, in plain Python (no torch): the rollout, settings, the interface.

    Rollout     one sample: a token sequence, which tokens the policy generated, their logprobs, a reward
    Options     the [algorithm] keys, each declared once (`option`): the shared ones here, an algorithm's
                own in its module's subclass; the config's table, the head's and the trainer's settings
    LossShare   what a loss returns: a micro-batch's share of the step loss and its metrics
    Selection   what an algorithm makes of a batch's scored groups: the groups kept, their advantages
    Algorithm   the three things an algorithm module says (see hpcrl.algorithms)

A rollout is a sequence with a per-token policy mask rather than "prompt + completion", so a
multi-turn environment (model turn, tool output, model turn) only fills it differently: tool tokens
are in the sequence with mask 0 and are neither trained on nor compared with the sampler.
"""

from __future__ import annotations

import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields, replace
from typing import TYPE_CHECKING, Any, Literal

from hpcrl.algorithms import DEFAULT_ALGORITHM
from hpcrl.errors import ConfigError, HpcrlError

if TYPE_CHECKING:
    from torch import Tensor

Aggregation = Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm"]
KLEstimator = Literal["k1", "k2", "k3"]
AdvantageNorm = Literal["mean_std", "mean"]
"""How rewards are normalised within a group (config key algorithm.advantage_norm)."""
AGGREGATIONS: tuple[Aggregation, ...] = typing.get_args(Aggregation)
KL_ESTIMATORS: tuple[KLEstimator, ...] = typing.get_args(KLEstimator)


# ------------------------------------------------------------------------------------ rollout

@dataclass(frozen=True, kw_only=True)
class Rollout:
    """One sample of a group: its tokens, which of them the policy generated, and its reward.

    `policy_mask[t]` is 1 where the policy sampled `tokens[t]` (those tokens are trained on and
    their `logprobs[t]` is the sampler's logprob), 0 on prompt, tool output and any other token
    the policy did not choose (logprob 0.0 there). All three lists have one entry per token.
    """

    tokens: list[int]
    policy_mask: list[int]
    logprobs: list[float]
    reward: float
    finish_reason: str = ""
    versions: list[int] | None = None
    """The weight version that sampled each token (-1 where the policy did not); with partial rollouts
    (algorithm.partial_rollouts) one sequence's tokens may carry several. None: every token the rollout's group's."""

    def __post_init__(self) -> None:
        if not len(self.tokens) == len(self.policy_mask) == len(self.logprobs):
            raise HpcrlError(f"a rollout of {len(self.tokens)} tokens has {len(self.policy_mask)} mask entries "
                             f"and {len(self.logprobs)} logprobs; give one of each per token")
        if self.versions is not None and len(self.versions) != len(self.tokens):
            raise HpcrlError(f"a rollout of {len(self.tokens)} tokens has {len(self.versions)} weight versions; "
                             "give one per token")
        if self.policy_mask[:1] == [1]:
            raise HpcrlError("a rollout's first token is marked as generated, which no logits predict; "
                             "it starts with at least one prompt token (e.g. <bos>)")

    @classmethod
    def single_turn(cls, prompt: list[int], completion: list[int], logprobs: list[float], *, reward: float,
                    finish_reason: str = "") -> Rollout:
        """One prompt and the policy's completion: mask 0 on the prompt, 1 on the completion."""
        if len(logprobs) != len(completion):
            raise HpcrlError(f"{len(logprobs)} logprobs for a completion of {len(completion)} tokens; "
                             "give one per completion token")
        return cls(tokens=prompt + completion, policy_mask=[0] * len(prompt) + [1] * len(completion),
                   logprobs=[0.0] * len(prompt) + list(logprobs), reward=reward, finish_reason=finish_reason)

    @property
    def generated(self) -> int:
        """Tokens the policy generated (the length the token budget and the overlong shaping count)."""
        return sum(self.policy_mask)

    def to_dict(self) -> dict:
        # versions only where a rollout has them: a checkpoint without partial rollouts is as before.
        return {k: getattr(self, k) for k in self.__dataclass_fields__ if k != "versions" or self.versions is not None}

    @classmethod
    def from_dict(cls, data: dict) -> Rollout:
        return cls(**data)


# ------------------------------------------------------------------------------------ options

@dataclass(frozen=True)
class Bounds:
    """The values an option takes: at_least <= v (or above < v) and v < below (or v <= at_most)."""

    at_least: float | None = None
    above: float | None = None
    below: float | None = None
    at_most: float | None = None
    why: str = ""
    """Said after the bounds in the error, e.g. "(advantages compare completions)"."""

    def holds(self, value: float) -> bool:
        return ((self.at_least is None or value >= self.at_least) and (self.above is None or value > self.above)
                and (self.below is None or value < self.below) and (self.at_most is None or value <= self.at_most))

    def text(self) -> str:
        low = (f"[{self.at_least:g}" if self.at_least is not None else f"({self.above:g}" if self.above is not None
               else "")
        high = f"{self.below:g})" if self.below is not None else f"{self.at_most:g}]" if self.at_most is not None else ""
        if low and high:
            return f"in {low}, {high}"
        if self.at_least == 0:
            return "zero or more"
        words = {"at_least": "at least", "above": "above", "below": "below", "at_most": "at most"}
        return " and ".join(f"{words[k]} {getattr(self, k):g}" for k in words if getattr(self, k) is not None)


#: Most completions per prompt (group_size), as hpcrl.config.schema bounds eval.n.
MAX_GROUP_SIZE = 1024


def option(default: Any, doc: str, *, at_least: float | None = None, above: float | None = None,
           below: float | None = None, at_most: float | None = None, why: str = "", example: Any = None) -> Any:
    """One key of the [algorithm] table, declared once as a field of an Options class: the field's name
    and annotation are the key and its type; `default`, the one-line `doc` and the bounds are here.
    hpcrl.config builds the table from these fields (type checks, "did you mean"), and Options checks
    the bounds, naming the fix (`example`, else the default)."""
    bounds = Bounds(at_least=at_least, above=above, below=below, at_most=at_most, why=why)
    return field(default=default, metadata={"doc": doc, "bounds": bounds,
                                            "example": default if example is None else example})


def derived(default: Any, doc: str, source: str) -> Any:
    """A field of an Options class that is not a key of [algorithm]: `options_of` fills it from `source`."""
    return field(default=default, metadata={"doc": doc, "derived": source})


_HINTS: dict[type, dict[str, Any]] = {}


def _type_hints(cls: type) -> dict[str, Any]:
    """typing.get_type_hints(cls), once per class."""
    if cls not in _HINTS:
        _HINTS[cls] = typing.get_type_hints(cls)
    return _HINTS[cls]


@dataclass(frozen=True, kw_only=True)
class Options:
    """The [algorithm] keys every algorithm reads: the head's and the trainer's sides in one object.

    An algorithm with options of its own declares a subclass in its module and names it as its
    Algorithm.options (e.g. hpcrl.algorithms.dapo.DapoOptions); hpcrl.config builds the [algorithm] table as the configured
    algorithm's class, so a key is declared once, with its doc and bounds (`option`). The head's
    `select` and `more_prompts` and the trainer's `loss` all receive it as `settings`, with max_tokens
    filled in (`options_of`).
    """

    name: str = option(DEFAULT_ALGORITHM, "RL algorithm: a name of hpcrl.algorithms.ALGORITHMS (grpo, dapo, gspo, "
                                          "dr_grpo, reinforce_pp) or \"module:NAME\" (an Algorithm outside hpcrl)")
    group_size: int = option(8, "Completions sampled per prompt; advantages compare the completions of a group.",
                             at_least=2, why="advantages compare completions")
    clip_eps_low: float = option(0.2, "Lower clip of the importance ratio: 1 - clip_eps_low.", above=0, below=1)
    clip_eps_high: float = option(0.2, "Upper clip of the importance ratio: 1 + clip_eps_high (DAPO clip-higher: "
                                       "0.28).", above=0, below=1)
    kl_coef: float = option(0.0, "Weight of the KL penalty to the frozen reference policy; 0 = no reference model.",
                            at_least=0)
    kl_estimator: KLEstimator = option("k3", "Per-token KL estimator (Schulman's k1, k2, k3).")
    loss_aggregation: Aggregation = option(
        "token_mean", "How per-token losses become one number (seq_mean_token_sum_norm: the sum over tokens "
                      "divided by inference.max_tokens x sequences, Dr. GRPO's constant).")
    filter_zero_variance: bool = option(False, "Train only on groups whose rewards differ (they carry no gradient "
                                               "otherwise).")
    max_policy_lag: int = option(1, "Most optimizer steps a rollout's weights may lag the trainer; 0 = fully "
                                    "on-policy.", at_least=0)
    moe_aux_loss_coef: float = option(
        0.0, "Mixture-of-Experts models: weight of the routers' load-balancing loss (hpcrl/trainer/routing.py) "
             "added to the step loss; 0 = not added (still reported as moe_aux_loss). Qwen3-MoE: 0.001.", at_least=0)
    moe_bias_update_rate: float = option(
        0.0, "Mixture-of-Experts routers with a bias (DeepSeek-V3's e_score_correction_bias): the auxiliary-loss-free "
             "balancing's speed; after each step a block's bias moves by this x sign(mean load - the expert's load) "
             "over the step's completion tokens, centred (torchtitan's rule); 0 = the bias stays as loaded. "
             "DeepSeek-V3 was pretrained with 0.001.", at_least=0)
    partial_rollouts: bool = option(
        False, "Rollouts continue across weight syncs: in each batch's generation a sequence generates at most "
               "partial_tokens tokens; one not finished goes on in the next batch's, on the newer weights, from the "
               "tokens it has. Each token keeps the logprob and the weight version that sampled it, and "
               "max_policy_lag bounds the oldest token a step trains on (docs/ARCHITECTURE.md, \"Partial rollouts\").")
    behavior_weight_cap: float = option(
        0.0, "0: the importance ratio of each token is clipped against the logprob of the weights that sampled it "
             "(PPO as written). > 0: decoupled (AReaL): the ratio is taken against the weights the step starts from "
             "(so with one update per batch it is never clipped), and each token's gradient is weighted by its "
             "behaviour ratio exp(logprob now - logprob sampled), truncated at this cap. For stale tokens (partial "
             "rollouts, a large max_policy_lag), whose ratios the clip would otherwise zero out.", at_least=0)
    partial_tokens: int = option(
        16, "With partial_rollouts: most tokens a sequence generates in one batch's generation before it is carried "
            "to the next (smaller: less waiting for the batch's longest sequence, more versions per sequence).",
        at_least=1)
    mismatch_every: int = option(
        1, "With max_policy_lag > 0: measure logprob_mismatch (a trainer forward and a vLLM scoring call of one "
           "group after the weight sync) every this many steps; at lag 0 the step's own forward measures it.",
        at_least=1)
    max_tokens: int = derived(0, "Most tokens the policy generates per rollout (overlong shaping, the "
                                 "seq_mean_token_sum_norm constant); 0 = not filled in.", "inference.max_tokens")

    def __post_init__(self) -> None:
        from hpcrl.algorithms import check_name

        check_name(self.name, key="name")
        hints = _type_hints(type(self))
        for f in fields(self):
            value = getattr(self, f.name)
            choices = typing.get_args(hints[f.name]) if typing.get_origin(hints[f.name]) is Literal else ()
            if choices and value not in choices:
                raise ConfigError(key=f.name, problem=f"must be one of {', '.join(map(repr, choices))}; got {value!r}",
                                  fix=f'write e.g. {f.name} = "{f.metadata.get("example", choices[0])}"')
            bounds = f.metadata.get("bounds")
            if bounds is not None and isinstance(value, int | float) and not bounds.holds(value):
                why = f" ({bounds.why})" if bounds.why else ""
                raise ConfigError(key=f.name, problem=f"must be {bounds.text()}{why}, got {value}",
                                  fix=f"set {f.name} = {f.metadata['example']!r}")
        if self.group_size > MAX_GROUP_SIZE:
            raise ConfigError(key="group_size", problem=f"must be at most {MAX_GROUP_SIZE:,} (completions of one prompt "
                              f"in one batch), got {self.group_size}", fix=f"keep group_size within 2 to {MAX_GROUP_SIZE:,}")
        if self.partial_rollouts and self.max_policy_lag < 1:
            raise ConfigError(key="partial_rollouts", problem="needs max_policy_lag >= 1: a sequence carried to the next "
                              "batch's generation has tokens of an older version than the trainer's",
                              fix="set max_policy_lag to at least 1 (a sequence may span max_policy_lag batches)")
        if self.clip_eps_high < self.clip_eps_low:
            raise ConfigError(key="clip_eps_high", problem=f"is {self.clip_eps_high:g}, below clip_eps_low = "
                              f"{self.clip_eps_low:g}: the ratio's clip range [1 - low, 1 + high] may be wider above "
                              "(DAPO's clip-higher), never narrower",
                              fix=f"set clip_eps_high to at least {self.clip_eps_low:g} (DAPO: low 0.2, high 0.28)")

    def check_episodes(self) -> None:
        """A ConfigError (key relative to [algorithm]) for an option that multi-turn episodes ([env]) cannot
        honour; none of the common ones (an algorithm that overrides this calls it too)."""

    @classmethod
    def owner_of(cls, key: str) -> str:
        """For a key that is not one of this class's: which registered algorithms declare it, as a hint."""
        from hpcrl.algorithms import ALGORITHMS, load_algorithm

        owners = [n for n in ALGORITHMS if key in {f.name for f in fields(load_algorithm(n).options)}]
        return f"an option of {' and '.join(owners)}: set name = \"{owners[0]}\" to use it" if owners else ""

    @classmethod
    def table_class(cls, table: Mapping[str, Any]) -> type[Options]:
        """The class of an [algorithm] table (hpcrl.config.build): the options of its algorithm."""
        from hpcrl.algorithms import load_algorithm

        return load_algorithm(table.get("name", DEFAULT_ALGORITHM)).options


def options_of(config) -> Options:
    """The algorithm's settings of a run (an hpcrl.config.schema.Config): its [algorithm] table, with
    max_tokens = inference.max_tokens. What the head's `select` and the trainer's `loss` receive."""
    return replace(config.algorithm, max_tokens=config.inference.max_tokens)


# ---------------------------------------------------------------------------------- interface

@dataclass(frozen=True, kw_only=True)
class LossShare:
    """One micro-batch's share of the step loss and of its metrics (sums over its tokens)."""

    loss: Tensor
    """Scalar to backward: policy share + kl_coef * KL share."""
    policy_loss: Tensor
    """Detached share of the policy (surrogate) term, aggregated like the loss."""
    kl: Tensor
    """Detached share of the token-mean KL to the reference (0 without one)."""
    clipped_low: Tensor
    """Detached count of tokens clipped below (A < 0)."""
    clipped_high: Tensor
    """Detached count of tokens clipped above (A > 0)."""



@dataclass(frozen=True, kw_only=True)
class Selection:
    """An algorithm's reading of one batch of scored groups."""

    kept: list[int]
    """Indices of the groups to train on, in batch order."""
    advantages: list[list[Any]]
    """For each kept group, one entry per rollout: a float (per sequence) or a list with one float
    per token of the rollout (per token)."""
    dropped_zero_variance: int = 0
    """Groups left out because their rewards were all equal."""


Groups = list[list[Rollout]]


def one_round(groups: Groups, settings: Options, *, wanted: int, rounds_done: int) -> int:
    """No dynamic sampling: a batch is the prompts of one generate round."""
    return 0


def at_most_one_round(settings: Options) -> int:
    return 1


@dataclass(frozen=True, kw_only=True)
class Algorithm:
    """What an algorithm module defines as ALGORITHM."""

    name: str
    options: type[Options] = Options
    """The [algorithm] table of this algorithm: Options, or a subclass declaring its own keys."""
    defaults: Mapping[str, Any] = field(default_factory=dict)
    """[algorithm] keys this algorithm sets unless the user set them (config/load.py merges them)."""
    select: Callable[..., Selection]
    """Head: the groups of a batch to train on and their advantages, called as
    select(groups, settings, wanted=prompts per step)."""
    loss: Callable[..., LossShare]
    """Trainer: this micro-batch's share of the step loss, called as
    loss(logprobs=, old_logprobs=, advantages=, mask=, settings=, norm=, ref_logprobs=)."""
    more_prompts: Callable[..., int] = one_round
    """Head, after each generate round of a batch: how many more prompts to generate (0 = the batch
    is complete), called as more_prompts(groups_so_far, settings, wanted=, rounds_done=)."""
    max_rounds: Callable[..., int] = at_most_one_round
    """Head, before a batch: the most generate rounds it may take, called as max_rounds(settings)
    (more_prompts asks for the rounds after the first). Above 1, the inference group stays with the
    batch until its last round is scored."""

    def __post_init__(self) -> None:
        unknown = sorted(set(self.defaults) - {f.name for f in fields(self.options) if "derived" not in f.metadata})
        if unknown:
            raise HpcrlError(f"algorithm {self.name!r} has defaults for {', '.join(unknown)}, which are not keys of "
                             f"its options {self.options.__name__}; declare them there (hpcrl.algorithms.base.option)")

