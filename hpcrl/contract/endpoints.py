"""Every endpoint of the control bus: its group, name, request and reply types, and whether it may be retried.

    TRAINER_ENDPOINTS.train_step            # Endpoint[TrainStepCall, dict[str, float] | None]
    args = INFERENCE_ENDPOINTS.generate.encode_request(GenerateCall(prompts=..., n=4, seed=7))
    call = INFERENCE_ENDPOINTS.generate.decode_request(args)          # BadRequest naming the field
    endpoint("reward", "score")                                       # by name; UnknownEndpoint otherwise

  group      endpoint          request              reply                            retried elsewhere
  trainer    connect_transfer  ConnectTransferCall  RankReply                        no
             train_step        TrainStepCall        dict[str, float] | None (rank>0)  no
             send_weights      WeightsCall          WeightsSent                      no
             logprobs          SequencesCall        list[list[float]] | None (rank>0) no
             save / load       CheckpointCall       RankReply / Loaded               no
  inference  generate          GenerateCall         list[list[Completion]]           yes
             logprobs          SequencesCall        list[list[float]]                yes
             connect_transfer  ConnectTransferCall  ReplicaReply                     no
             receive_weights   WeightsCall          ReplicaWeights                   no
             status            StatusCall           ReplicaWeights                   yes
  reward     score             ScoreCall            list[RewardResult]               yes
             env_reset/step    EnvCall              list[EnvReply]                   yes

What each endpoint does is told by the role that serves it (hpcrl.roles.trainer, inference, reward)
and the head's side that calls it (hpcrl.rl.ports).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from hpcrl.bus.errors import BusError, PeerError
from hpcrl.config.groups import INFERENCE, REWARD, TRAINER
from hpcrl.contract.fields import MalformedError, decode, encode
from hpcrl.data.types import Prompt
from hpcrl.env.types import EnvReply, EnvRequest
from hpcrl.inference.types import Completion
from hpcrl.reward.types import RewardResult, Sample
from hpcrl.trainer.types import TrainBatch

Req = TypeVar("Req")
Rep = TypeVar("Rep")


class UnknownEndpoint(BusError):
    """No endpoint of that name is declared for the group."""


class BadRequest(BusError):
    """A request does not match its endpoint's request type: the serving task answers with this error."""

    def __init__(self, endpoint: Endpoint, error: MalformedError) -> None:
        self.endpoint = endpoint
        self.field = error.field
        super().__init__(f"{error}. Fix: the caller must send what hpcrl.contract.endpoints declares for "
                         f"{endpoint}")


class BadReply(PeerError):
    """A reply does not match its endpoint's reply type: raised on the calling side, naming the peer."""

    def __init__(self, peer: str, endpoint: Endpoint, error: MalformedError) -> None:
        self.endpoint = endpoint
        self.field = error.field
        super().__init__(peer, f"{error}. The peer's role must answer what hpcrl.contract.endpoints declares "
                               f"for {endpoint}")


@dataclass(frozen=True, kw_only=True)
class Endpoint(Generic[Req, Rep]):
    """One endpoint of one group: what it takes, what it answers, whether a lost call may run elsewhere."""

    group: str
    name: str
    request: type[Req]
    reply: Any
    """The reply's type hint (hpcrl.contract.fields reads it)."""
    idempotent: bool
    """A call whose replica died may be made again on another (same request, same answer)."""

    def __str__(self) -> str:
        return f"{self.group}.{self.name}"

    def encode_request(self, request: Req) -> dict:
        if type(request) is not self.request:
            raise TypeError(f"{self} takes a {self.request.__name__}, not a {type(request).__name__}")
        return encode(request, self.request)

    def decode_request(self, args: Any) -> Req:
        """The typed request of `args` as it came off the wire; BadRequest naming the field otherwise."""
        try:
            return decode(args, self.request, f"{self} request")
        except MalformedError as err:
            raise BadRequest(self, err) from None

    def encode_reply(self, reply: Rep) -> Any:
        return encode(reply, self.reply)

    def decode_reply(self, value: Any, *, peer: str) -> Rep:
        """The typed reply of `value` from `peer`; BadReply naming the peer, endpoint and field otherwise."""
        try:
            return decode(value, self.reply, f"{self} reply")
        except MalformedError as err:
            raise BadReply(peer, self, err) from None


# -- requests --------------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class ConnectTransferCall:
    """Join the weight-transfer group of `generation`, planned as `digest`, through the rendezvous `store`."""

    store: str
    timeout_s: float
    digest: str
    generation: int


@dataclass(frozen=True, kw_only=True)
class TrainStepCall:
    batch: TrainBatch
    step: int


@dataclass(frozen=True, kw_only=True)
class WeightsCall:
    """Send (a trainer rank) or receive (a replica) weight version `version`."""

    version: int


@dataclass(frozen=True, kw_only=True)
class SequencesCall:
    """The logprob of every token after the first of each sequence."""

    sequences: list[list[int]]


@dataclass(frozen=True, kw_only=True)
class CheckpointCall:
    directory: str


@dataclass(frozen=True, kw_only=True)
class GenerateCall:
    prompts: list[Prompt]
    n: int
    seed: int
    offset: int = 0
    """The chunk's place in the batch: its sampling seeds follow from it (hpcrl.inference.engine)."""
    temperature: float | None = None
    """An evaluation's (0.0: greedy); None: inference.temperature."""
    max_tokens: list[int] | None = None
    """One limit per prompt (an episode's turn, hpcrl.rl.episodes); None: inference.max_tokens."""


@dataclass(frozen=True, kw_only=True)
class StatusCall:
    pass


@dataclass(frozen=True, kw_only=True)
class ScoreCall:
    samples: list[Sample]


@dataclass(frozen=True, kw_only=True)
class EnvCall:
    requests: list[EnvRequest]


# -- replies ---------------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class RankReply:
    rank: int


@dataclass(frozen=True, kw_only=True)
class ReplicaReply:
    replica: int


@dataclass(frozen=True, kw_only=True)
class ReplicaWeights:
    replica: int
    weight_version: int


@dataclass(frozen=True, kw_only=True)
class WeightsSent:
    bytes: int
    seconds: float


@dataclass(frozen=True, kw_only=True)
class Loaded:
    step: int
    """The trainer's step after loading: the weight version it now holds."""


Metrics = dict[str, float]


# -- the endpoints, by group -----------------------------------------------------------------------
class TrainerEndpoints:
    """Every rank of the trainer takes each call (Service.call_all); rank 0 answers for the group."""

    connect_transfer = Endpoint[ConnectTransferCall, RankReply](
        group=TRAINER, name="connect_transfer", request=ConnectTransferCall, reply=RankReply, idempotent=False)
    train_step = Endpoint[TrainStepCall, Metrics | None](
        group=TRAINER, name="train_step", request=TrainStepCall, reply=Metrics | None, idempotent=False)
    send_weights = Endpoint[WeightsCall, WeightsSent](
        group=TRAINER, name="send_weights", request=WeightsCall, reply=WeightsSent, idempotent=False)
    logprobs = Endpoint[SequencesCall, list[list[float]] | None](
        group=TRAINER, name="logprobs", request=SequencesCall, reply=list[list[float]] | None, idempotent=False)
    save = Endpoint[CheckpointCall, RankReply](
        group=TRAINER, name="save", request=CheckpointCall, reply=RankReply, idempotent=False)
    load = Endpoint[CheckpointCall, Loaded](
        group=TRAINER, name="load", request=CheckpointCall, reply=Loaded, idempotent=False)


class InferenceEndpoints:
    """Each replica (its rank 0) answers alone; generate, logprobs and status may be retried on another."""

    generate = Endpoint[GenerateCall, list[list[Completion]]](
        group=INFERENCE, name="generate", request=GenerateCall, reply=list[list[Completion]], idempotent=True)
    logprobs = Endpoint[SequencesCall, list[list[float]]](
        group=INFERENCE, name="logprobs", request=SequencesCall, reply=list[list[float]], idempotent=True)
    connect_transfer = Endpoint[ConnectTransferCall, ReplicaReply](
        group=INFERENCE, name="connect_transfer", request=ConnectTransferCall, reply=ReplicaReply, idempotent=False)
    receive_weights = Endpoint[WeightsCall, ReplicaWeights](
        group=INFERENCE, name="receive_weights", request=WeightsCall, reply=ReplicaWeights, idempotent=False)
    status = Endpoint[StatusCall, ReplicaWeights](
        group=INFERENCE, name="status", request=StatusCall, reply=ReplicaWeights, idempotent=True)


class RewardEndpoints:
    """Each reward task answers alone; every call may be retried on another (a request holds all it needs).
    env_reset and env_step are served only with [env] environment set."""

    score = Endpoint[ScoreCall, list[RewardResult]](
        group=REWARD, name="score", request=ScoreCall, reply=list[RewardResult], idempotent=True)
    env_reset = Endpoint[EnvCall, list[EnvReply]](
        group=REWARD, name="env_reset", request=EnvCall, reply=list[EnvReply], idempotent=True)
    env_step = Endpoint[EnvCall, list[EnvReply]](
        group=REWARD, name="env_step", request=EnvCall, reply=list[EnvReply], idempotent=True)


def _table(*declarations: type) -> dict[str, dict[str, Endpoint]]:
    table: dict[str, dict[str, Endpoint]] = {}
    for declared in declarations:
        for value in vars(declared).values():
            if isinstance(value, Endpoint):
                table.setdefault(value.group, {})[value.name] = value
    return table


ENDPOINTS: dict[str, dict[str, Endpoint]] = _table(TrainerEndpoints, InferenceEndpoints, RewardEndpoints)
"""group -> endpoint name -> Endpoint."""


def endpoint(group: str, name: str) -> Endpoint:
    """The endpoint `name` of `group`; UnknownEndpoint naming both and what the group has otherwise."""
    if group not in ENDPOINTS:
        raise UnknownEndpoint(f"group {group!r} has no endpoints on the bus (groups that serve: "
                              f"{', '.join(ENDPOINTS)})")
    known = ENDPOINTS[group]
    if name not in known:
        raise UnknownEndpoint(f"group {group} has no endpoint {name!r} (its endpoints: {', '.join(known)})")
    return known[name]
