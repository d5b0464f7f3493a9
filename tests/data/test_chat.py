"""The chat format: rows rendered with the tokenizer's chat template into the ids vLLM and the trainer
see, a system prompt, the rendered length against max_prompt_tokens, and the end-of-turn stop token."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from hpcrl.config.schema import DataConfig
from hpcrl.data.chat import ChatTemplate, chat_template_for, conversation, prompt_format, turn_stop_ids
from hpcrl.data.prompts import PromptStream
from hpcrl.data.tokens import token_counter
from hpcrl.data.types import DataError, Prompt
from hpcrl.errors import ConfigError

SYSTEM = "Answer with one digit."
#: The tiny tokenizer's turn markers (tools/make_tiny_model.py): <|system|> <|user|> <|assistant|> <|end|>.
SYS, USER, ASSISTANT, END = 99, 100, 101, 102


@pytest.fixture(scope="module")
def tokenizer(tiny_model: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model)


def jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_a_prompt_string_is_one_user_message_after_the_system_prompt_rendered_as_apply_chat_template_does(
        tiny_model: Path, tokenizer):
    chat = ChatTemplate(str(tiny_model), system_prompt=SYSTEM)
    prompt = Prompt(id="p", text="say 7:", answer="7")
    ids = chat.render([prompt])[0]
    expected = tokenizer.apply_chat_template([{"role": "system", "content": SYSTEM},
                                              {"role": "user", "content": "say 7:"}],
                                             add_generation_prompt=True, tokenize=True)["input_ids"]
    assert ids == expected
    assert ids[:2] == [1, SYS] and ids[-4:] == [26, 29, END, ASSISTANT]  # <bos> ... "7:" <|end|> <|assistant|>
    assert ids.count(USER) == 1


def test_a_messages_row_is_rendered_as_it_is_and_its_own_system_message_wins(tiny_model: Path, tokenizer):
    messages = [{"role": "system", "content": "row's own"}, {"role": "user", "content": "1+2="},
                {"role": "assistant", "content": "3"}, {"role": "user", "content": "2+2="}]
    prompt = Prompt(id="m", text="unused", answer="4", messages=messages)
    assert conversation(prompt, SYSTEM) == messages
    ids = ChatTemplate(str(tiny_model), system_prompt=SYSTEM).render([prompt])[0]
    assert ids == tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)["input_ids"]
    assert conversation(Prompt(id="n", text="", answer="", messages=messages[1:]), SYSTEM)[0] == \
        {"role": "system", "content": SYSTEM}


def test_messages_that_end_with_the_assistants_turn_are_refused_with_the_fix():
    prompt = Prompt(id="row-3", text="", answer="", messages=[{"role": "user", "content": "1+2="},
                                                                {"role": "assistant", "content": "3"}])
    with pytest.raises(DataError, match=r"prompt 'row-3': its messages end with an assistant message.*"
                                        r"data.columns.answer"):
        conversation(prompt)


def test_a_prompt_over_max_prompt_tokens_once_rendered_is_dropped_and_the_others_carry_their_ids(
        tiny_model: Path, tmp_path: Path):
    # "say 1:" is 7 tokens as text; with the template and the system prompt it is 10 + 24 = 34.
    path = jsonl(tmp_path / "p.jsonl", [{"prompt": "say 1:", "answer": "1"},
                                        {"prompt": "say 22222222222222:", "answer": "2"}])
    data = DataConfig(source=str(path), format="chat", system_prompt=SYSTEM, max_prompt_tokens=40)
    assert token_counter(str(tiny_model))([Prompt(id="x", text="say 22222222222222:", answer="")]) == [20]
    chat = chat_template_for(data, str(tiny_model))
    stream = PromptStream.from_config(data, measure=token_counter(str(tiny_model)), chat=chat)
    assert stream.dropped == 1 and stream.size == 1
    batch = stream.next_batch(3)
    assert [p.answer for p in batch] == ["1"] * 3
    assert batch[0].token_ids == chat.render([batch[0]])[0] and len(batch[0].token_ids) == 34


def test_a_builtin_prompt_over_max_prompt_tokens_once_rendered_is_an_error_naming_it(tiny_model: Path):
    data = DataConfig(source="builtin:echo", format="chat", system_prompt=SYSTEM, max_prompt_tokens=16)
    stream = PromptStream.from_config(data, chat=chat_template_for(data, str(tiny_model)))
    with pytest.raises(DataError, match=r"prompt 'echo-train-0' is 34 tokens in the chat format, over "
                                        r"data.max_prompt_tokens = 16"):
        stream.next_batch(2)
    short = DataConfig(source="builtin:echo", format="chat", max_prompt_tokens=16)
    batch = PromptStream.from_config(short, chat=chat_template_for(short, str(tiny_model))).next_batch(2)
    assert [len(p.token_ids or []) for p in batch] == [10, 10]


def test_auto_is_chat_for_a_tokenizer_with_a_template_and_text_without_and_chat_without_one_is_refused(
        tiny_model: Path, tmp_path: Path):
    bare = tmp_path / "bare"
    shutil.copytree(tiny_model, bare)
    (bare / "chat_template.jinja").unlink()
    assert prompt_format(DataConfig(source="builtin:echo"), str(tiny_model)) == "chat"
    assert prompt_format(DataConfig(source="builtin:echo"), str(bare)) == "text"
    assert prompt_format(DataConfig(source="builtin:echo", format="text"), str(tiny_model)) == "text"
    assert chat_template_for(DataConfig(source="builtin:echo", format="text"), str(tiny_model)) is None
    with pytest.raises(DataError, match=r'data.format = "chat" but the tokenizer in .*bare has no chat template'):
        prompt_format(DataConfig(source="builtin:echo", format="chat"), str(bare))
    with pytest.raises(DataError, match=r"data.system_prompt is set but the tokenizer in .*bare has no chat template"):
        prompt_format(DataConfig(source="builtin:echo", system_prompt=SYSTEM), str(bare))


def test_the_format_and_a_system_prompt_without_a_chat_turn_are_config_errors():
    with pytest.raises(ConfigError, match="must be auto, chat or text, got 'jinja'"):
        DataConfig(source="builtin:echo", format="jinja")
    with pytest.raises(ConfigError, match='data.format = "text" has no system turn'):
        DataConfig(source="builtin:echo", format="text", system_prompt=SYSTEM)


def test_vllm_is_told_to_stop_at_the_end_of_turn_token_only_where_it_would_not_already(tokenizer):
    assert tokenizer.eos_token_id == 2
    assert turn_stop_ids(tokenizer, 2) == [END]  # <|end|> is not the eos token: a stop token
    assert turn_stop_ids(tokenizer, [2, END]) == []  # generation_config.json's eos ids: vLLM stops there itself
    assert turn_stop_ids(tokenizer, END) == []


def test_the_chat_tokens_leave_a_text_prompts_ids_as_they_were(tokenizer):
    """The ids of the tiny tokenizer before it had a chat template: the text format is unchanged."""
    before = {"say 7:": [1, 86, 68, 92, 98, 26, 29], "1+2=": [1, 20, 14, 21, 32],
              "Hello, World! ~{}": [1, 43, 72, 79, 79, 82, 15, 98, 58, 82, 85, 79, 71, 4, 98, 97, 94, 96]}
    assert {text: tokenizer(text)["input_ids"] for text in before} == before
    assert tokenizer.decode([1, SYS, 86, END, ASSISTANT], skip_special_tokens=True) == "s"


def test_a_checkpoint_of_the_text_format_does_not_resume_in_the_chat_format(tiny_model: Path):
    text = PromptStream.from_config(DataConfig(source="builtin:echo", format="text"))
    text.next_batch(4)
    state = json.loads(json.dumps(text.state_dict()))
    data = DataConfig(source="builtin:echo", format="chat")
    chat = PromptStream.from_config(data, chat=chat_template_for(data, str(tiny_model)))
    with pytest.raises(DataError, match=r'in the text format, the config gives the chat format \(data.format\).*'
                                        r'set data.format = "text"'):
        chat.load_state_dict(state)
    del state["format"]  # a checkpoint from before the chat format
    with pytest.raises(DataError, match="in the text format"):
        chat.load_state_dict(state)
    text.load_state_dict(state)
    assert text.cursor == 4


# -- an episode's ids, turn by turn (hpcrl.rl.episodes) -----------------------------------------------
#: A Qwen-style ChatML template: a newline after each turn's end token, and no end token at the generation prompt.
CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
          "'<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


@pytest.fixture(scope="module")
def chatml_model(tiny_model: Path, tmp_path_factory) -> Path:
    """The tiny tokenizer with <|im_start|> / <|im_end|> as special tokens and the ChatML template."""
    from transformers import AutoTokenizer

    path = tmp_path_factory.mktemp("chatml")
    tok = AutoTokenizer.from_pretrained(tiny_model)
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.chat_template = CHATML
    tok.save_pretrained(path)
    return path


@pytest.mark.parametrize("template", ["tiny", "chatml"])
@pytest.mark.parametrize("stopped", [True, False], ids=["stopped-at-end-of-turn", "cut-at-max-tokens"])
def test_an_episode_grown_turn_by_turn_has_the_ids_of_its_whole_conversation_rendered_at_once(
        tiny_model: Path, chatml_model: Path, template: str, stopped: bool):
    """The policy's turns are its own ids (never rendered again); the ids between them close its turn (all of the
    template's ending when vLLM stopped without its end-of-turn token) and open the next, so the episode is what
    the template makes of the whole conversation."""
    from transformers import AutoTokenizer

    path = str(tiny_model if template == "tiny" else chatml_model)
    tokenizer = AutoTokenizer.from_pretrained(path)
    end = tokenizer.convert_tokens_to_ids("<|end|>" if template == "tiny" else "<|im_end|>")
    chat = ChatTemplate(path, system_prompt=SYSTEM)
    messages, ids = chat.opening(Prompt(id="g", text="guess:", answer="7"), [{"role": "user", "content": "guess:"}])
    for answer, feedback in [("3", "no, it is 7"), ("7", "yes")]:
        turn = tokenizer(answer, add_special_tokens=False)["input_ids"] + ([end] if stopped else [])
        ids = ids + turn
        messages = [*messages, {"role": "assistant", "content": answer}]
        new = [{"role": "user", "content": feedback}]
        ids = ids + chat.continuation(messages, new, turn)
        messages = [*messages, *new]
    whole = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)["input_ids"]
    assert messages[0] == {"role": "system", "content": SYSTEM}
    assert ids == list(whole)
    assert ids.count(end) == 6  # system, user, assistant, user, assistant, user: each turn ended once


def test_an_environment_message_in_a_role_the_template_refuses_is_a_data_error_naming_the_fix(tiny_model: Path):
    chat = ChatTemplate(str(tiny_model))
    with pytest.raises(DataError, match=r"roles \['tool'\].*Fix: have the environment answer in roles the template"):
        chat.continuation([{"role": "user", "content": "x"}, {"role": "assistant", "content": "1"}],
                          [{"role": "tool", "content": "2"}], [20])
