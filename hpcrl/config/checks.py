"""Rules that span tables: layouts against the model's shape, batches, groups, files.

Run by `load_config` after every table has been type-checked on its own. Each rule raises a
ConfigError naming the key to change and how; the loader adds file and line.
"""

from __future__ import annotations

import ast
import difflib
import importlib.util
import json
import os
from pathlib import Path

from hpcrl.config.builtin_names import (
    BUILTIN_ENVIRONMENTS,
    BUILTIN_REWARD_FUNCTIONS,
    BUILTIN_REWARD_MODULE,
    BUILTIN_TASK_NAMES,
)
from hpcrl.config.components import make_components
from hpcrl.config.groups import GROUP_NAMES, HEAD, INFERENCE, REWARD, TRAINER
from hpcrl.config.model_shapes import ModelShape, shape_of
from hpcrl.config.schema import Config
from hpcrl.errors import ConfigError
from hpcrl.models.blocks import has_router_bias
from hpcrl.models.lora import PEFT_PREFIX, adapter_parameters, present_targets


def _fail(key: str, problem: str, fix: str) -> None:
    raise ConfigError(key=key, problem=problem, fix=fix)


def check_config(config: Config) -> ModelShape:
    """Check every cross-table rule; return the model's shape (which the rules needed)."""
    _check_group_names(config)
    _check_run_dir(config)
    shape = shape_of(config.model)
    _check_trainer_layout(config)
    _check_inference_layout(config, shape)
    _check_batches(config)
    _check_sequence_lengths(config, shape)
    _check_moe_keys(config, shape)
    _check_groups_against_roles(config)
    _check_cluster(config)
    make_components(config)  # what each task gets of its node: raises when a node cannot hold it
    _check_weight_transport(config)
    _check_reward(config)
    _check_data(config)
    _check_eval(config)
    _check_env(config, shape)
    _check_lora(config, shape)
    return shape


def _check_group_names(config: Config) -> None:
    for name in config.groups:
        if name not in GROUP_NAMES:
            close = difflib.get_close_matches(name, GROUP_NAMES, n=1)
            guess = f"did you mean [groups.{close[0]}]? " if close else ""
            _fail(f"groups.{name}", f"unknown component {name!r}",
                  f"{guess}components are: {', '.join(GROUP_NAMES)}")


#: Kernel filesystems: nothing of a run can be written there, whatever the permissions say.
_KERNEL_FILESYSTEMS = ("/proc", "/sys", "/dev")


_RUN_DIR_FIX = "set run.run_dir to a directory you can write (default: runs/<run.name> under the current directory)"


def _check_run_dir(config: Config) -> None:
    """The run directory can be a directory at all: not a file, nor under one, nor in a kernel filesystem.
    Checked at load, so every command says it on one line before anything is written (else: a traceback
    from mkdir). Whether this user may write it depends on the machine: check_run_dir_writable."""
    run_dir = Path(config.run_dir).absolute()
    for root in _KERNEL_FILESYSTEMS:
        if run_dir == Path(root) or Path(root) in run_dir.parents:
            _fail("run.run_dir", f"{run_dir} is in {root}, a kernel filesystem", _RUN_DIR_FIX)
    existing = _nearest_existing(run_dir)
    if not existing.is_dir():
        where = "is a file" if existing == run_dir else f"is under {existing}, which is a file"
        _fail("run.run_dir", f"{run_dir} {where}, not a directory", _RUN_DIR_FIX)


def _nearest_existing(path: Path) -> Path:
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def check_run_dir_writable(config: Config) -> None:
    """Refuse a run directory this user cannot create or write (its nearest existing directory is not writable),
    naming the key: what `hpcrl submit` checks before it writes anything. Not at load: a config is read on
    machines that do not write its run directory (tests render job scripts for /runs/x)."""
    run_dir = Path(config.run_dir).absolute()
    existing = _nearest_existing(run_dir)
    if existing.is_dir() and not os.access(existing, os.W_OK | os.X_OK):
        what = "" if existing == run_dir else f" (its nearest existing directory, {existing}, is not)"
        _fail("run.run_dir", f"{run_dir} cannot be written by this user{what}", _RUN_DIR_FIX)


def _check_trainer_layout(config: Config) -> None:
    t = config.trainer
    world = t.world_size
    if t.dp_shard == -1:
        if world % t.dp_replicate:
            _fail("trainer.dp_replicate", f"{world} trainer ranks cannot form {t.dp_replicate} equal replicas",
                  f"choose a dp_replicate that divides {world} (nodes x ranks per node)")
    elif t.dp_replicate * t.dp_shard != world:
        _fail("trainer.dp_shard", f"dp_replicate x dp_shard = {t.dp_replicate} x {t.dp_shard} "
              f"= {t.dp_replicate * t.dp_shard}, but the trainer has {world} ranks",
              f"set dp_shard = {world // t.dp_replicate if world % t.dp_replicate == 0 else -1} "
              "(or -1 to use every rank)")


def _check_inference_layout(config: Config, shape: ModelShape) -> None:
    inf = config.inference
    tp = inf.tensor_parallel
    if shape.num_heads % tp:
        _fail("inference.tensor_parallel",
              f"{shape.num_heads} attention heads cannot be split evenly over tensor_parallel = {tp}",
              f"choose a tensor_parallel that divides {shape.num_heads}")
    kv = shape.num_kv_heads
    if (tp > kv and tp % kv) or (tp <= kv and kv % tp):
        _fail("inference.tensor_parallel",
              f"{kv} KV heads cannot be split or replicated evenly over tensor_parallel = {tp}",
              f"choose a tensor_parallel that divides {kv} or is a multiple of it")
    if shape.intermediate_size % tp:
        _fail("inference.tensor_parallel",
              f"intermediate size {shape.intermediate_size} is not divisible by tensor_parallel = {tp}",
              "choose a tensor_parallel that divides the MLP width")
    if inf.gpus_per_node and tp > inf.gpus_per_node:
        _fail("inference.tensor_parallel",
              f"tensor_parallel = {tp} is more than the {inf.gpus_per_node} GPUs of an inference node "
              "(an engine's tensor-parallel ranks stay on one node)",
              f"set tensor_parallel to at most {inf.gpus_per_node}, or raise inference.gpus_per_node")


def _check_batches(config: Config) -> None:
    t, alg = config.trainer, config.algorithm
    if t.global_batch_size % alg.group_size:
        _fail("trainer.global_batch_size",
              f"global_batch_size = {t.global_batch_size} is not a whole number of groups of "
              f"group_size = {alg.group_size}",
              f"use a multiple of {alg.group_size}, e.g. {alg.group_size * max(1, t.global_batch_size // alg.group_size)}")
    dp = t.world_size  # every trainer rank (either HSDP axis) takes its own slice of the batch
    if t.micro_batch_tokens:
        longest = longest_sequence(config)
        if t.micro_batch_tokens < longest:
            _fail("trainer.micro_batch_tokens",
                  f"micro_batch_tokens = {t.micro_batch_tokens} is below the longest sequence a rollout can be, "
                  f"{longest} tokens ({_longest_what(config)}): a micro-batch must hold any one sequence",
                  f"set micro_batch_tokens to at least {longest} (a few times it packs better), or 0 for "
                  "micro-batches of micro_batch_size sequences")
        return _check_warmup(config)
    per_rank_unit = t.micro_batch_size * dp
    if t.global_batch_size % per_rank_unit:
        _fail("trainer.global_batch_size",
              f"global_batch_size = {t.global_batch_size} cannot be split into micro-batches of "
              f"{t.micro_batch_size} on each of {dp} trainer ranks",
              f"use a multiple of micro_batch_size x trainer ranks = {per_rank_unit}")
    _check_warmup(config)


def _check_warmup(config: Config) -> None:
    t = config.trainer
    if t.warmup_steps > t.steps:
        _fail("trainer.warmup_steps", f"warmup_steps = {t.warmup_steps} is longer than the run ({t.steps} steps)",
              f"set warmup_steps below {t.steps}")


def longest_sequence(config: Config) -> int:
    """The most tokens one rollout can hold: an episode's budget (env.max_tokens) with [env], else the longest
    prompt and completion."""
    if config.env.environment:
        return config.env.max_tokens
    return config.data.max_prompt_tokens + config.inference.max_tokens


def _longest_what(config: Config) -> str:
    if config.env.environment:
        return "env.max_tokens"
    return (f"data.max_prompt_tokens {config.data.max_prompt_tokens} + inference.max_tokens "
            f"{config.inference.max_tokens}")


def _check_sequence_lengths(config: Config, shape: ModelShape) -> None:
    inf = config.inference
    needed = config.data.max_prompt_tokens + inf.max_tokens
    if inf.max_model_len and inf.max_model_len < needed:
        _fail("inference.max_model_len",
              f"max_model_len = {inf.max_model_len} is shorter than max_prompt_tokens + max_tokens = {needed}",
              f"set max_model_len = {needed} or 0 (derived)")
    if max(needed, inf.max_model_len) > shape.max_position:
        _fail("inference.max_tokens",
              f"prompt + completion = {max(needed, inf.max_model_len)} tokens exceeds the model's "
              f"{shape.max_position} positions",
              "lower data.max_prompt_tokens or inference.max_tokens")


def _check_groups_against_roles(config: Config) -> None:
    t, inf = config.trainer, config.inference
    trainer = config.group(TRAINER)
    if trainer.nodes and trainer.nodes != t.nodes:
        _fail("groups.trainer.nodes", f"groups.trainer.nodes = {trainer.nodes} but trainer.nodes = {t.nodes}",
              "remove groups.trainer.nodes (it follows trainer.nodes)")
    if trainer.gpus_per_node != -1 and trainer.gpus_per_node != t.gpus_per_node:
        _fail("groups.trainer.gpus_per_node",
              f"groups.trainer.gpus_per_node = {trainer.gpus_per_node} but trainer.gpus_per_node = {t.gpus_per_node}",
              "remove groups.trainer.gpus_per_node (it follows trainer.gpus_per_node)")
    group = config.group(INFERENCE)
    if group.nodes:
        gpus = group.nodes * inf.gpus_per_node
        needed = inf.replicas * inf.tensor_parallel
        if inf.gpus_per_node and needed > gpus:
            _fail("inference.replicas",
                  f"replicas x tensor_parallel = {inf.replicas} x {inf.tensor_parallel} = {needed} GPUs, "
                  f"but the inference group has {group.nodes} nodes x {inf.gpus_per_node} GPUs = {gpus}",
                  f"lower replicas, or set groups.inference.nodes to at least "
                  f"{-(-needed // inf.gpus_per_node)} (or 0 to derive it)")
        if not inf.gpus_per_node and inf.replicas > group.nodes:
            _fail("inference.replicas",
                  f"{inf.replicas} CPU replicas need a node each, but groups.inference.nodes = {group.nodes}",
                  f"set groups.inference.nodes = {inf.replicas} (or 0 to derive it)")
    if config.reward.tasks == 0 and REWARD in config.groups:
        _fail("groups.reward", "reward.tasks = 0 scores inside the head, so there is no reward component",
              "remove [groups.reward], or set reward.tasks to 1 or more")
    if config.group(HEAD).gpus_per_node > 0:
        _fail("groups.head.gpus_per_node", "the head controller uses no GPU",
              "remove groups.head.gpus_per_node")


def _check_cluster(config: Config) -> None:
    cluster = config.cluster
    if cluster.gpus_per_node < 0:
        return
    wanted = {"trainer.gpus_per_node": config.trainer.gpus_per_node,
              "inference.gpus_per_node": config.inference.gpus_per_node}
    wanted.update({f"groups.{name}.gpus_per_node": group.gpus_per_node
                   for name, group in config.groups.items() if group.gpus_per_node > 0})
    for key, gpus in wanted.items():
        if cluster.gpus_per_node == 0 and gpus > 0:
            _fail(key, f"asks for {gpus} GPUs per node, but cluster profile {cluster.name!r} has no GPUs",
                  f"set {key} = 0 to run on CPU, or use a cluster profile with GPUs (--cluster)")
        if gpus > cluster.gpus_per_node:
            _fail(key, f"asks for {gpus} GPUs per node, but {cluster.name!r} nodes have {cluster.gpus_per_node}",
                  f"set {key} to at most {cluster.gpus_per_node}")


def _check_weight_transport(config: Config) -> None:
    """NCCL moves GPU tensors between GPUs: both ends need them. (Gloo or UCX on GPUs is allowed when written;
    `hpcrl plan` warns of the host round trip, hpcrl.plan.transfer.speed.host_round_trip_warning.)"""
    if config.inference.weight_transport != "nccl":
        return
    on_cpu = [f"{key} = 0" for key, gpus in (("trainer.gpus_per_node", config.trainer.gpus_per_node),
                                             ("inference.gpus_per_node", config.inference.gpus_per_node)) if gpus == 0]
    if on_cpu:
        _fail("inference.weight_transport",
              f'weight_transport = "nccl" sends from GPU to GPU, but {" and ".join(on_cpu)} (on CPU)',
              'set weight_transport = "gloo" for CPU groups, or remove it ("auto": nccl when both groups have GPUs, '
              "else gloo)")


def _check_reward(config: Config) -> None:
    reward = config.reward
    if reward.kind == "function":
        for i, entry in enumerate(reward.weighted_functions()):
            _check_reward_function(entry.function, f"reward.functions[{i}].function" if reward.functions
                                   else "reward.function")
    elif not (Path(reward.model_path) / "config.json").is_file():
        _fail("reward.model_path", f"{reward.model_path} has no config.json",
              "point model_path at a Hugging Face reward-model directory")


def _check_reward_function(function: str, key: str) -> None:
    module, _, name = function.partition(":")
    if module == BUILTIN_REWARD_MODULE:  # ours: its names are known here, so check the name too
        if name not in BUILTIN_REWARD_FUNCTIONS:
            close = difflib.get_close_matches(name, BUILTIN_REWARD_FUNCTIONS, n=1)
            guess = f"did you mean {close[0]!r}? " if close else ""
            _fail(key, f"{BUILTIN_REWARD_MODULE} has no function {name!r}",
                  f"{guess}built-ins: {', '.join(BUILTIN_REWARD_FUNCTIONS)}")
        return
    _check_target(key, function, "function",
                  "check the module name, or add its directory to PYTHONPATH "
                  f'(built-ins: "{BUILTIN_REWARD_MODULE}:NAME" with NAME one of {", ".join(BUILTIN_REWARD_FUNCTIONS)})')


def _check_target(key: str, target: str, kind: str, fix: str) -> None:
    """A user's "module:name" (`kind` "function" or "class"): its module is on the Python path, parses, and
    defines `name` at its top level, read from its source without importing it (plan runs none of the user's
    code); a module that makes names up at import (`from x import *`, a module `__getattr__`) is taken on trust."""
    module, _, name = target.partition(":")
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        spec = None
    if spec is None:
        _fail(key, f"module {module!r} cannot be found on the Python path", fix)
    origin = spec.origin if spec is not None else None
    if not origin or not origin.endswith(".py"):  # compiled, frozen or a namespace package: no source to read
        return
    try:
        tree = ast.parse(Path(origin).read_bytes(), filename=origin)
    except SyntaxError as err:
        _fail(key, f"module {module!r} ({origin}) does not parse: {err.msg} at line {err.lineno}",
              "fix the syntax error; the reward or environment workers import this module")
    except (OSError, ValueError) as err:
        _fail(key, f"module {module!r} ({origin}) cannot be read: {err}", "check the file")
    defined = _top_level_names(tree)
    if defined is not None and name not in defined:
        public = sorted(n for n in defined if not n.startswith("_"))
        close = difflib.get_close_matches(name, public, n=1)
        guess = f"did you mean {close[0]!r}? " if close else ""
        _fail(key, f"module {module!r} ({origin}) defines no {kind} {name!r}",
              f"{guess}name one it defines{': ' + ', '.join(public[:20]) if public else ''}")


def _top_level_names(tree: ast.Module) -> set[str] | None:
    """The names a module binds outside its functions and classes (in if/try/with/for blocks too); None when it
    may bind any name (`from x import *`, a module-level `__getattr__`)."""
    names: set[str] = set()
    statements: list[ast.stmt] = list(tree.body)
    while statements:
        node = statements.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            if any(alias.name == "*" for alias in node.names):
                return None
            names |= {alias.asname or alias.name.partition(".")[0] for alias in node.names}
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AnnAssign, ast.AugAssign, ast.For, ast.AsyncFor)):
            targets = [node.target]
        elif isinstance(node, (ast.With, ast.AsyncWith)):
            targets = [item.optional_vars for item in node.items if item.optional_vars is not None]
        names |= {n.id for target in targets for n in ast.walk(target) if isinstance(n, ast.Name)}
        for block in ("body", "orelse", "finalbody"):  # the statements of if/for/while/try/with blocks
            statements += getattr(node, block, [])
        if isinstance(node, ast.Try):
            statements += [child for handler in node.handlers for child in handler.body]
    return None if "__getattr__" in names else names


def _check_data(config: Config) -> None:
    _check_prompt_source("data.source", config.data.source, "prompt file",
                         'give the path of a JSONL or Parquet file, a `datasets` save_to_disk directory, '
                         'or a builtin task such as "builtin:arithmetic"')
    if config.data.eval_source:
        _check_prompt_source("data.eval_source", config.data.eval_source, "evaluation prompt file",
                             "give the path of a JSONL or Parquet file or a `datasets` directory, or set "
                             "data.eval_fraction to hold out part of data.source instead")


def _check_prompt_source(key: str, source: str, what: str, fix: str) -> None:
    """`source` names a builtin task (did-you-mean on a typo) or a path that exists."""
    if source.startswith("builtin:"):
        name = source.removeprefix("builtin:")
        if name not in BUILTIN_TASK_NAMES:
            close = difflib.get_close_matches(name, BUILTIN_TASK_NAMES, n=1)
            guess = f"did you mean 'builtin:{close[0]}'? " if close else ""
            _fail(key, f"no builtin task {name!r}",
                  f"{guess}builtin tasks: {', '.join('builtin:' + n for n in BUILTIN_TASK_NAMES)}")
    elif not Path(source).exists():
        _fail(key, f"{what} {source} does not exist", fix)


def _check_eval(config: Config) -> None:
    """eval.interval > 0 needs held-out prompts to evaluate on."""
    data = config.data
    if config.eval.interval and not (data.eval_source or data.eval_fraction):
        builtin = data.source.startswith("builtin:")
        _fail("eval.interval", f"is {config.eval.interval} but the run has no evaluation prompts",
              f'set data.eval_source = "{data.source}" (its test split)' if builtin else
              "set data.eval_fraction = 0.05 (5% of data.source held out) or data.eval_source = a file of "
              "prompts; or eval.interval = 0")


def _check_moe_keys(config: Config, shape: ModelShape) -> None:
    if config.algorithm.moe_aux_loss_coef > 0 and shape.experts() is None:
        _fail("algorithm.moe_aux_loss_coef",
              f"is {config.algorithm.moe_aux_loss_coef} but {shape.architecture} has no Mixture-of-Experts block "
              "(no router to balance)", "set algorithm.moe_aux_loss_coef = 0, or train a MoE model")
    if config.algorithm.moe_bias_update_rate > 0 and not has_router_bias(shape):
        _fail("algorithm.moe_bias_update_rate",
              f"is {config.algorithm.moe_bias_update_rate} but {shape.architecture}'s routers have no bias to update "
              "(only DeepSeek-V3's do)", "set algorithm.moe_bias_update_rate = 0")
    if config.inference.expert_parallel and config.inference.gpus_per_node == 0:
        _fail("inference.expert_parallel",
              "is true on CPU inference (gpus_per_node = 0): vLLM 0.32's CPU MoE kernel crashes on the first forward "
              "under expert parallel (docs/FACTS.md)", "set inference.expert_parallel = false (tensor parallel) on CPU")
    if config.inference.expert_parallel and shape.experts() is None:
        _fail("inference.expert_parallel", f"is true but {shape.architecture} has no experts",
              "set inference.expert_parallel = false")


def _check_env(config: Config, shape: ModelShape) -> None:
    """[env] (multi-turn episodes, hpcrl.rl.episodes): chat prompts, environment workers in the reward group, an
    episode's token budget that vLLM and the model can hold, and no single-completion length shaping."""
    env = config.env
    if not env.environment:
        return
    if ":" in env.environment:
        _check_target("env.environment", env.environment, "class",
                      f"check the module name, or add its directory to PYTHONPATH (built-ins: {', '.join(BUILTIN_ENVIRONMENTS)})")
    elif env.environment not in BUILTIN_ENVIRONMENTS:
        close = difflib.get_close_matches(env.environment, BUILTIN_ENVIRONMENTS, n=1)
        guess = f"did you mean {close[0]!r}? " if close else ""
        _fail("env.environment", f"no built-in environment {env.environment!r}",
              f'{guess}built-ins: {", ".join(BUILTIN_ENVIRONMENTS)}; or "module:Class" for one of your own')
    if config.data.format == "text" or not config.model.path:
        _fail("data.format", "[env] renders an environment's messages with the model's chat template, but the run's "
                             f"prompts are text (data.format = {config.data.format!r}"
                             f"{', no model.path' if not config.model.path else ''})",
              'set data.format = "chat" (or "auto") and model.path to a model whose tokenizer has a chat template')
    if config.reward.tasks == 0:
        _fail("reward.tasks", "[env] runs its environments in the reward group's worker processes, never in the "
                              "head's, but reward.tasks = 0 has no reward group",
              "set reward.tasks = 1 or more")
    if config.inference.max_model_len and config.inference.max_model_len < env.max_tokens:
        _fail("inference.max_model_len", f"max_model_len = {config.inference.max_model_len} is shorter than an "
                                         f"episode's budget, env.max_tokens = {env.max_tokens}",
              f"set max_model_len = {env.max_tokens} or 0 (derived), or lower env.max_tokens")
    if env.max_tokens > shape.max_position:
        _fail("env.max_tokens", f"an episode of {env.max_tokens} tokens exceeds the model's {shape.max_position} "
                                "positions", f"set env.max_tokens to at most {shape.max_position}")
    try:
        config.algorithm.check_episodes()
    except ConfigError as err:
        _fail(f"algorithm.{err.key}", err.problem, err.fix)


def _check_lora(config: Config, shape: ModelShape) -> None:
    """[lora]: a family that takes adapters, targets the model has, a rank no larger than the layers it adapts."""
    lora = config.lora
    if lora is None:
        return
    if not shape.family.lora_targets:
        _fail("lora", f"model family {shape.architecture} takes no LoRA adapters in hpcrl yet",
              "remove the [lora] table (train every weight), or choose a model of a Llama-style family")
    have = present_targets(shape)
    missing = [t for t in lora.targets if t not in have]
    if missing:
        close = difflib.get_close_matches(missing[0], have, n=1)
        guess = f"did you mean {close[0]!r}? " if close else ""
        experts = " (a routed expert takes no adapter)" if shape.experts() else ""
        _fail("lora.targets", f"{', '.join(map(repr, missing))}: no such linear layer in {shape.architecture}{experts}",
              f"{guess}this model's layers that take one: {', '.join(have)}")
    smallest = min(max(dims) for _, dims in adapter_parameters(shape, 1, lora.targets))  # each layer's in and out
    if lora.rank > smallest:
        _fail("lora.rank", f"is {lora.rank}, above the smallest dimension of an adapted layer ({smallest}): the "
              "adapter would hold more than the layer", f"set lora.rank to at most {smallest}, e.g. 16")
    if lora.init_from:
        _check_lora_init_from(config, shape)


def _check_lora_init_from(config: Config, shape: ModelShape) -> None:
    """lora.init_from: a PEFT directory whose rank, targets, base model and tensors are this run's (read from
    adapter_config.json and the safetensors header: no tensor is loaded here)."""
    lora = config.lora
    assert lora is not None
    root = Path(lora.init_from)
    files = root / "adapter_config.json", root / "adapter_model.safetensors"
    if not all(f.is_file() for f in files):
        _fail("lora.init_from", f"{root} is not a PEFT adapter directory (it needs {files[0].name} and {files[1].name})",
              "point it at a directory `hpcrl export RUN_DIR` wrote, or remove the key to start new adapters")
    try:
        peft = json.loads(files[0].read_text())
        with open(files[1], "rb") as handle:
            header = json.loads(handle.read(int.from_bytes(handle.read(8), "little")))
    except (OSError, ValueError) as err:
        _fail("lora.init_from", f"{root}: unreadable adapter ({err})", "export the adapter again")
    if peft.get("r") != lora.rank:
        _fail("lora.rank", f"is {lora.rank}, but the adapter of lora.init_from ({root}) has r = {peft.get('r')}",
              f"set lora.rank = {peft.get('r')}, or start new adapters (remove lora.init_from)")
    theirs = sorted(peft.get("target_modules") or [])
    if theirs != sorted(lora.targets):
        _fail("lora.targets", f"are {sorted(lora.targets)}, but the adapter of lora.init_from ({root}) adapts {theirs}",
              f"set lora.targets = {theirs}")
    base, ours = peft.get("base_model_name_or_path") or "", Path(config.model.path)
    if base and Path(base).is_dir() and ours.is_dir() and Path(base).resolve() != ours.resolve():
        _fail("lora.init_from", f"{root} is an adapter of the base model {base}, but model.path is {ours.resolve()}",
              "set model.path to the adapter's base, or choose an adapter of this model")
    shapes = {name: tuple(entry["shape"]) for name, entry in header.items() if name != "__metadata__"}
    for name, dims in adapter_parameters(shape, lora.rank, lora.targets):
        if shapes.get(PEFT_PREFIX + name) != dims:
            _fail("lora.init_from", f"{root}: {PEFT_PREFIX + name} is {shapes.get(PEFT_PREFIX + name)}, this model's "
                  f"adapter is {dims}: the adapter is of another base model", "choose an adapter of this model")

