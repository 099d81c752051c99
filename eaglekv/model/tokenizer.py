"""The tokenizer of a GGUF model, built once and cached as `tokenizer.json`.

The first load converts the GGUF vocabulary with transformers
(`PreTrainedTokenizerFast.from_pretrained(dir, gguf_file=...)`, ~1.7 s with its import) and
saves the result under the cache (weight_cache.py). Every later load reads `tokenizer.json`
with the `tokenizers` library (~0.1 s) and never imports transformers (~1-2 s here).

`Tokenizer` is the part of a transformers fast tokenizer eaglekv calls: `encode`, `decode`,
`apply_chat_template` (rendered as transformers renders it: a sandboxed Jinja environment with
trim_blocks, lstrip_blocks, loop controls, `tojson`, `raise_exception`, `strftime_now`, and the
special tokens as variables), the special tokens and `save_pretrained`. tests/model/
test_weight_cache.py checks it against transformers' tokenizer token for token.
"""

from __future__ import annotations

import json
import os
from datetime import datetime
from functools import cached_property
from pathlib import Path

from eaglekv.model import weight_cache

CONFIG_FILE = "tokenizer_config.json"
SPECIAL = ("bos_token", "eos_token", "unk_token", "pad_token")


class Tokenizer:
    def __init__(self, backend, config: dict):
        """backend: a `tokenizers.Tokenizer`; config: the special tokens (strings or None) and
        `chat_template`, as in a transformers tokenizer_config.json."""
        self.backend, self.config = backend, config
        self.chat_template = config.get("chat_template")
        for name in SPECIAL:
            token = config.get(name)
            setattr(self, name, token)
            setattr(self, f"{name}_id", None if token is None else backend.token_to_id(token))

    @property
    def special_tokens_map(self) -> dict[str, str]:
        return {n: getattr(self, n) for n in SPECIAL if getattr(self, n) is not None}

    def __len__(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # encode_batch releases the GIL while it works (encode does not): the server
        # tokenizes a large prompt on a worker thread while the engine thread keeps streaming
        return self.backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str]:
        return [self.backend.id_to_token(i) for i in ids]

    @cached_property
    def _jinja(self):
        import jinja2
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message):
            raise jinja2.exceptions.TemplateError(message)

        def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
            return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent,
                              separators=separators, sort_keys=sort_keys)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=["jinja2.ext.loopcontrols"])
        env.filters["tojson"] = tojson
        env.globals.update(raise_exception=raise_exception,
                           strftime_now=lambda fmt: datetime.now().strftime(fmt))
        return env

    def apply_chat_template(self, conversation: list[dict], chat_template: str | None = None,
                            tokenize: bool = True, add_generation_prompt: bool = False,
                            **kwargs):
        template = chat_template or self.chat_template
        if template is None:
            raise ValueError("this tokenizer has no chat template; pass chat_template")
        text = self._jinja.from_string(template).render(
            messages=conversation, add_generation_prompt=add_generation_prompt,
            **{"tools": None, "documents": None, **self.special_tokens_map, **kwargs})
        return self.encode(text, add_special_tokens=False) if tokenize else text

    def save_pretrained(self, path: str | Path) -> None:
        """tokenizer.json + tokenizer_config.json: what transformers' AutoTokenizer reads."""
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        self.backend.save(str(path / "tokenizer.json"))
        (path / CONFIG_FILE).write_text(json.dumps(
            {**self.config, "tokenizer_class": "PreTrainedTokenizerFast"}, indent=1))

    @classmethod
    def from_dir(cls, path: Path) -> "Tokenizer":
        from tokenizers import Tokenizer as Backend
        config = json.loads((path / CONFIG_FILE).read_text())
        return cls(Backend.from_file(str(path / "tokenizer.json")), config)


def convert_gguf_tokenizer(path: Path) -> Tokenizer:
    """transformers' tokenizer of the GGUF (imports transformers), as a `Tokenizer`: its
    backend as transformers set it up (post-processor for BOS/EOS included). The gguf_file
    path of PreTrainedTokenizerFast exists across releases (5.17 lacks the newer
    `integrations.gguf` converter); AutoTokenizer builds the same object 5 s slower."""
    from transformers import PreTrainedTokenizerFast
    hf = PreTrainedTokenizerFast.from_pretrained(path.parent, gguf_file=path.name,
                                                 local_files_only=True)
    keep = {k: getattr(hf, k, None) for k in (*SPECIAL, "chat_template")}
    return Tokenizer(hf.backend_tokenizer, {k: v for k, v in keep.items() if isinstance(v, str)})


def load_gguf_tokenizer(path: Path) -> Tokenizer:
    """The GGUF's tokenizer from the cache, converted and cached on a miss (a cache that
    cannot be written: converted every time, with a warning)."""
    entry = weight_cache.entry_dir("tokenizer", [path])
    if entry is not None and (entry / CONFIG_FILE).is_file():
        try:
            return Tokenizer.from_dir(entry)
        except Exception as e:   # OSError, JSON errors; tokenizers raises plain Exception
            weight_cache.warn_corrupt(entry, e)
    tok = convert_gguf_tokenizer(path)
    if entry is not None:
        try:
            tmp = entry.with_name(f".{entry.name}.{os.getpid()}.tmp")
            tok.save_pretrained(tmp)
            weight_cache.replace_dir(tmp, entry)
        except OSError as e:
            weight_cache.warn_unwritable(entry, e)
    return tok
