"""Chat-formatted prompts: the model's own chat template, applied once on the head, as token ids.

    fmt = prompt_format(config.data, config.model.path)      # "chat" or "text" (data.format "auto" decides)
    chat = chat_template_for(config.data, config.model.path)   # data.system_prompt, data.chat_template_kwargs
    chat.render(prompts)     # [[1, 99, ...], ...]: the ids vLLM generates from and the trainer trains on
    chat(prompts)            # their lengths: the Measure of data.max_prompt_tokens in the chat format
    chat.with_ids(prompts)   # the prompts with Prompt.token_ids set

A row of messages is rendered as it is; a prompt string becomes one user message. data.system_prompt
is put first as a system message, unless the row's messages begin with a system message of their own
(the row's wins). data.chat_template_kwargs go to every rendering, prompts and an episode's turns
alike (Qwen3's `enable_thinking = false`). The conversation must end with a user's turn: the template's generation prompt
(`add_generation_prompt=True`) opens the assistant turn the model writes.

Rendering is transformers' `apply_chat_template` (its Jinja template over every conversation of a
batch, `tokenize=False`), then one batched encode with the fast tokenizer's Rust backend without
special tokens, since the template writes its own (a BOS): the same ids as
`apply_chat_template(..., tokenize=True)`, which renders and encodes the same way one conversation at
a time (docs/FACTS.md). The ids travel in the Prompt (token_ids) to vLLM, which generates from them
as they are (a TokensPrompt: it does not tokenize again) and returns them with the completion, and the
trainer's rollout is those ids + the completion's, so both see the same tokens.

Generation must stop where the assistant's turn ends: `turn_stop_ids` finds the template's
end-of-turn token by rendering a finished assistant turn and reading the token that follows its
content (<|im_end|> for Qwen's ChatML, <|eot_id|> for Llama 3, <|end|> for the tiny model), and gives
it to vLLM as a stop token unless vLLM already stops there (the tokenizer's eos token and the ids of
generation_config.json's eos_token_id, which vLLM adds itself).

An episode (hpcrl.rl.episodes, [env]) grows its ids turn by turn and never renders earlier turns again:
`ChatTemplate.opening` renders the environment's first messages like a prompt, and after each policy
turn `ChatTemplate.continuation` gives the ids to append: the rest of the template's end of the
assistant's turn (all of it when vLLM stopped without generating its end-of-turn token, e.g. at
max_tokens), the environment's new messages and the generation prompt. It renders the conversation
with and without the new messages, with the policy's turn written as a probe string since its tokens
are already in the episode, and takes what follows the probe in each: the turn's ending, then the new
messages. What comes before the probe is never read again: a template may render earlier turns
differently once messages follow them (Qwen3 writes the empty `<think>\n\n</think>` of the last
assistant turn only while it is last, and drops the reasoning of turns before the last user query),
but the episode keeps the ids the model generated and saw. So an episode on Qwen3 is not the whole
conversation rendered at once: it is what the model was given at each turn.

The reward's `prompt` stays Prompt.text (the prompt string, or a messages row's contents one per
line), never the rendered template: a reward written for the text format reads the same in the chat
format, and does not depend on the model's template.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any, Literal

from hpcrl.config.schema import DataConfig
from hpcrl.data.types import DataError, Prompt

__all__ = ["ChatTemplate", "MessagesRefused", "chat_template_for", "has_chat_template", "prompt_format",
           "turn_stop_ids"]

#: Conversations rendered and encoded per call: as tokens.BATCH.
BATCH = 1024
#: The assistant content end_of_turn renders to find what the template writes after a turn.
_SENTINEL = "hpcrl-end-of-turn-probe"


class MessagesRefused(DataError):
    """The template cannot render these messages (a role it does not know, its own raise_exception, an assistant
    turn last): a fault of the conversation, so an episode's environment error (hpcrl.rl.episodes), not the run's."""


def has_chat_template(model_path: str) -> bool:
    """Whether the tokenizer in `model_path` has a chat template, read from its files as transformers
    does (chat_template.jinja, chat_template.json, or tokenizer_config.json's "chat_template"), so
    that deciding data.format = "auto" never imports transformers."""
    path = Path(model_path)
    if (path / "chat_template.jinja").is_file() or (path / "chat_template.json").is_file():
        return True
    config = path / "tokenizer_config.json"
    try:
        return bool(json.loads(config.read_text()).get("chat_template")) if config.is_file() else False
    except (OSError, ValueError):
        return False


def prompt_format(data: DataConfig, model_path: str) -> Literal["chat", "text"]:
    """The format prompts are given to the model in: data.format, where "auto" is "chat" when the
    model's tokenizer has a chat template, else "text". DataError for "chat" without a template."""
    if data.format == "text" or not model_path:
        return "text"
    if has_chat_template(model_path):
        return "chat"
    if data.format == "chat" or data.system_prompt or data.chat_template_kwargs:
        why = ('data.format = "chat"' if data.format == "chat" else "data.system_prompt is set" if data.system_prompt
               else "data.chat_template_kwargs is set")
        raise DataError(f"{why} but the tokenizer in {model_path} has no chat template (no chat_template.jinja, "
                        'and none in tokenizer_config.json). Fix: set data.format = "text" (without a system prompt), '
                        "or point model.path at an instruct model whose tokenizer has one")
    return "text"


def conversation(prompt: Prompt, system_prompt: str = "") -> list[dict[str, str]]:
    """The messages the template renders for `prompt` (module docstring)."""
    messages = list(prompt.messages) if prompt.messages else [{"role": "user", "content": prompt.text}]
    if system_prompt and messages[0].get("role") != "system":
        messages.insert(0, {"role": "system", "content": system_prompt})
    if messages[-1].get("role") == "assistant":
        raise MessagesRefused(f"prompt {prompt.id!r}: its messages end with an assistant message, but the chat format "
                        "generates the assistant's next turn after a user's. Fix: leave the reference answer out "
                        "of the messages (data.columns.answer names its column)")
    return messages


def _load_tokenizer(model_path: str) -> Any:
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(model_path)
    except (OSError, ValueError) as err:
        raise DataError(f"cannot load the tokenizer of {model_path} to render chat prompts ({err}). Fix: point "
                        "model.path at a Hugging Face checkpoint with its tokenizer files") from err


class ChatTemplate:
    """The chat template of the model in `model_path` over prompts; a `Measure` of their rendered length."""

    def __init__(self, model_path: str, *, system_prompt: str = "", tokenizer: Any = None,
                 template_kwargs: dict[str, Any] | None = None) -> None:
        self.model_path = model_path
        self.system_prompt = system_prompt
        self._tokenizer = tokenizer
        self.template_kwargs = dict(template_kwargs or {})
        """Variables the template reads beside the messages (data.chat_template_kwargs), e.g. Qwen3's
        enable_thinking = false, which writes an empty <think></think> into the generation prompt."""

    def tokenizer(self) -> Any:
        if self._tokenizer is None:
            self._tokenizer = _load_tokenizer(self.model_path)
        return self._tokenizer

    def render(self, prompts: Sequence[Prompt]) -> list[list[int]]:
        """The token ids of every prompt rendered with the template and its generation prompt, in order."""
        tokenizer = self.tokenizer()
        backend = tokenizer.backend_tokenizer if getattr(tokenizer, "is_fast", False) else None
        ids: list[list[int]] = []
        for start in range(0, len(prompts), BATCH):
            chunk = prompts[start:start + BATCH]
            texts = self._texts(tokenizer, chunk)
            if backend is not None:
                ids += [e.ids for e in backend.encode_batch_fast(texts, add_special_tokens=False)]
            else:
                ids += tokenizer(texts, add_special_tokens=False, return_attention_mask=False)["input_ids"]
        return ids

    def _texts(self, tokenizer: Any, prompts: Sequence[Prompt]) -> list[str]:
        conversations = [conversation(p, self.system_prompt) for p in prompts]
        try:
            texts = tokenizer.apply_chat_template(conversations, add_generation_prompt=True, tokenize=False,
                                                  **self.template_kwargs)
        except Exception as err:  # the template's own raise_exception, or a Jinja error
            first = prompts[0].id if len(prompts) == 1 else f"{prompts[0].id!r} .. {prompts[-1].id!r}"
            raise MessagesRefused(f"the chat template of {self.model_path} failed on prompts {first}: {err}. Fix: check "
                            "the rows' roles and contents, or set data.format = \"text\"") from err
        return [texts] if isinstance(texts, str) else list(texts)

    def opening(self, prompt: Prompt, messages: list[dict]) -> tuple[list[dict], list[int]]:
        """An episode's first messages (an environment's reset) with data.system_prompt put first as for a
        prompt, and their ids with the generation prompt: what the policy's first turn is generated from."""
        first = replace(prompt, messages=list(messages), token_ids=None)
        return conversation(first, self.system_prompt), self.render([first])[0]

    def continuation(self, messages: list[dict], new: list[dict], generated: list[int]) -> list[int]:
        """The ids that follow a policy turn in an episode (module docstring). `messages`: the conversation
        with the policy's turn last (role "assistant"), `new`: the messages that follow it (a tool's output,
        feedback), `generated`: the turn's ids as vLLM returned them."""
        if not messages or messages[-1].get("role") != "assistant":
            raise DataError("continuation needs the conversation with the policy's turn (role \"assistant\") last")
        tokenizer = self.tokenizer()
        probe = [*messages[:-1], {**messages[-1], "content": _SENTINEL}]
        try:
            before = tokenizer.apply_chat_template(probe, tokenize=False, **self.template_kwargs)
            after = tokenizer.apply_chat_template([*probe, *new], add_generation_prompt=True, tokenize=False,
                                                  **self.template_kwargs)
        except Exception as err:  # the template's own raise_exception, or a Jinja error
            roles = sorted({m.get("role", "?") for m in new})
            raise MessagesRefused(f"the chat template of {self.model_path} failed on an environment's messages (roles "
                                  f"{roles}): {err}. Fix: have the environment answer in roles the template knows "
                                  "(\"user\" where it has no \"tool\" role)") from err
        # Only what follows the policy's turn is read: the text before it may change once messages follow
        # (Qwen3 renders the last turn's empty <think></think> only while it is last), but those ids are
        # the episode's already, as the model saw them.
        at_before, at_after = before.rfind(_SENTINEL), after.find(_SENTINEL)
        ending = before[at_before + len(_SENTINEL):]
        rest = after[at_after + len(_SENTINEL):]
        if at_before < 0 or at_after < 0 or not rest.startswith(ending):
            raise DataError(f"the chat template of {self.model_path} ends a policy's turn differently once messages "
                            "follow it, so an episode's ids cannot grow turn by turn. Fix: use a model whose template "
                            "ends each turn the same way whatever follows")
        close = self._encode(tokenizer, ending)
        if close and generated[-1:] == close[:1]:  # vLLM stopped at the end-of-turn token and returned it
            close = close[1:]
        return close + self._encode(tokenizer, rest[len(ending):])

    @staticmethod
    def _encode(tokenizer: Any, text: str) -> list[int]:
        return list(tokenizer(text, add_special_tokens=False)["input_ids"]) if text else []

    def __call__(self, prompts: Sequence[Prompt]) -> list[int]:
        return [len(ids) for ids in self.render(prompts)]

    def with_ids(self, prompts: Sequence[Prompt]) -> list[Prompt]:
        """`prompts` with token_ids set to their rendering."""
        return [replace(p, token_ids=ids) for p, ids in zip(prompts, self.render(prompts), strict=True)]


def chat_template_for(data: DataConfig, model_path: str) -> ChatTemplate | None:
    """The run's ChatTemplate when its prompts are in the chat format (prompt_format), else None."""
    if prompt_format(data, model_path) != "chat":
        return None
    return ChatTemplate(model_path, system_prompt=data.system_prompt, template_kwargs=data.chat_template_kwargs)


def end_of_turn_ids(tokenizer: Any) -> list[int]:
    """The template's end-of-turn token: the special token it writes right after an assistant's content
    ([] when what follows is no special token, or nothing: then the eos token ends a turn)."""
    turn = [{"role": "user", "content": "x"}, {"role": "assistant", "content": _SENTINEL}]
    text = tokenizer.apply_chat_template(turn, tokenize=False)
    at = text.rfind(_SENTINEL)
    if at < 0:
        return []
    after = tokenizer(text[at + len(_SENTINEL):], add_special_tokens=False)["input_ids"]
    special = set(tokenizer.all_special_ids) | {
        i for i, token in getattr(tokenizer, "added_tokens_decoder", {}).items() if token.special}
    return after[:1] if after and after[0] in special else []


def turn_stop_ids(tokenizer: Any, generation_eos: int | list[int] | None) -> list[int]:
    """Stop tokens to give vLLM for chat prompts: the end-of-turn token unless it is the tokenizer's eos
    or in generation_config.json's eos_token_id (`generation_eos`), where vLLM stops already."""
    covered = {tokenizer.eos_token_id}
    covered |= {generation_eos} if isinstance(generation_eos, int) else set(generation_eos or [])
    return [i for i in end_of_turn_ids(tokenizer) if i not in covered]


def generation_eos(model_path: str) -> int | list[int] | None:
    """generation_config.json's eos_token_id in `model_path` (None without one), which vLLM stops at."""
    path = Path(model_path) / "generation_config.json"
    try:
        return json.loads(path.read_text()).get("eos_token_id") if path.is_file() else None
    except (OSError, ValueError):
        return None
