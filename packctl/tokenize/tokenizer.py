"""A Hugging Face tokenizer read from a local directory, and its chat template rendered.

`LocalTokenizer.load(DIR)` reads what `transformers.AutoTokenizer.from_pretrained(DIR)` reads to
tokenize and render chats, and nothing from the network:

    DIR/tokenizer.json            the Rust tokenizer (ids, pre-tokenizer, post-processor)
    DIR/tokenizer_config.json     chat_template, bos/eos/pad tokens, add_bos_token/add_eos_token
    DIR/chat_template.jinja       the chat template, when present (it wins over the config's)
    DIR/special_tokens_map.json   special tokens the config does not name

`render(messages)` gives the text `apply_chat_template(messages, tokenize=False)` gives, and the
character spans of the template's `{% generation %}` blocks:

    >>> tok.render([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}])
    RenderedChat(text='<|im_start|>user\\nHi<|im_end|>\\n<|im_start|>assistant\\nYo<|im_end|>\\n',
                 generation_spans=[(52, 64)])
"""
from __future__ import annotations

import hashlib
import json
import re
from contextvars import ContextVar
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

from packctl.errors import PackctlError

# The files whose bytes decide the ids a text gets, in the order the fingerprint reads them.
FINGERPRINT_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")
# The special tokens a chat template sees as variables, as transformers passes them.
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
_GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")
# A probe text the post-processor is run on, to learn which special tokens it adds.
_PROBE = "packctl"
_RESTORE = "restore the file from the model's repository"


def first_line(exc: BaseException) -> str:
    """An exception's message cut to one line (the name of its type when it has none)."""
    text = str(exc)
    return text.splitlines()[0] if text.strip() else type(exc).__name__


@dataclass
class RenderedChat:
    """A chat rendered by its template.

    `generation_spans`: the [start, end) character ranges of the `{% generation %}` blocks in
    `text`, in order; None when the template has no such block.
    """

    text: str
    generation_spans: list[tuple[int, int]] | None


class _GenerationTracker(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}`: renders its body and, while a render is tracked,
    records the body's character span in the text rendered so far."""

    tags = {"generation"}

    def __init__(self, environment: jinja2.Environment):
        super().__init__(environment)
        self._tracking: ContextVar[tuple[list[str], list[tuple[int, int]], list[int]] | None] = ContextVar(
            "packctl_generation_tracker", default=None
        )
        environment.extend(generation_tracking=self._tracking)

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_generation", []), [], [], body).set_lineno(lineno)

    def _generation(self, caller) -> str:
        body = caller()
        tracking = self._tracking.get()
        if tracking is not None:
            blocks, spans, counted = tracking
            # counted = [blocks measured so far, their length]: each block is measured once
            counted[1] += sum(len(block) for block in blocks[counted[0]:])
            counted[0] = len(blocks)
            spans.append((counted[1], counted[1] + len(body)))
        return body


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # Jinja's own tojson escapes HTML characters (< > & ') and takes no options; chat templates
    # are written against the transformers filter, which is plain json.dumps.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt):
    return datetime.now().strftime(fmt)


class _TemplateDict:
    """`dict(...)` in a template, without the class itself reachable from the sandbox."""

    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    """`namespace(...)` that refuses underscore names, so a template cannot reach CPython internals."""

    def __init__(*args, **kwargs):
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _TemplateNamespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name):
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"a chat template cannot set {name!r} on a namespace")


def compile_template(text: str) -> jinja2.Template:
    """The chat template compiled in the environment transformers renders it in: a sandbox,
    trim_blocks and lstrip_blocks, loop controls, `{% generation %}`, `raise_exception`,
    `strftime_now`, `dict`, `namespace` and transformers' `tojson`."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTracker, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    return env.from_string(text)


_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def _template_message(message: dict) -> dict:
    """A message as transformers hands it to the template: keys whose value is None dropped (a
    Parquet struct gives None for a field a row lacks, and templates test `'key' in message`), and
    the reasoning under both names templates read (`reasoning_content`, `thinking`)."""
    if all(value is not None for value in message.values()) and not any(key in message for key in _REASONING_FIELDS):
        return message  # as it is: the sandbox keeps the template from changing it
    message = {key: value for key, value in message.items() if value is not None}
    reasoning = next((message[key] for key in _REASONING_FIELDS if key in message), None)
    if reasoning is not None:
        message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
    return message


def _read_json(path: Path) -> dict:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise PackctlError(f"{path}: cannot be read as JSON ({exc}); {_RESTORE}") from None
    if not isinstance(value, dict):
        raise PackctlError(f"{path}: expected a JSON object, found {type(value).__name__}; {_RESTORE}")
    return value


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken dict."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _pick_template(value: Any, template_name: str | None, where: Path) -> str | None:
    """tokenizer_config.json's `chat_template`: a string, or a list of {name, template}."""
    if value is None or isinstance(value, str):
        if template_name is not None and template_name != "default":
            raise PackctlError(
                f"{where}: has one chat template, no template named {template_name!r}; drop the template name"
            )
        return value
    named_items = isinstance(value, list) and all(isinstance(item, dict) and "name" in item for item in value)
    if named_items and all("template" in item for item in value):
        named = {item["name"]: item["template"] for item in value}
        name = template_name or "default"
        if name not in named:
            raise PackctlError(
                f"{where}: no chat template named {name!r} (it has {', '.join(sorted(named))}); name one of them"
            )
        return named[name]
    raise PackctlError(f"{where}: chat_template is neither a string nor a list of {{name, template}}; fix the file")


class LocalTokenizer:
    """A tokenizer directory on disk: its Rust tokenizer, special tokens and chat template.

    Build it with `LocalTokenizer.load(directory)`; the template is compiled once.
    """

    def __init__(
        self,
        *,
        directory: str,
        backend,
        config: dict,
        special_tokens: dict[str, str],
        chat_template: str | None,
        fingerprint: str,
    ):
        self.directory = directory
        self.backend = backend
        self.fingerprint = fingerprint
        self.chat_template = chat_template
        self.template_hash = hashlib.sha256(chat_template.encode()).hexdigest() if chat_template is not None else None
        self.special_tokens = special_tokens
        self.bos_token = special_tokens.get("bos_token")
        self.eos_token = special_tokens.get("eos_token")
        self.pad_token = special_tokens.get("pad_token")
        self.bos_token_id = self._id(self.bos_token)
        self.eos_token_id = self._id(self.eos_token)
        self.pad_token_id = self._id(self.pad_token)
        self.vocab_size = backend.get_vocab_size(with_added_tokens=True)
        self.has_generation_block = chat_template is not None and _GENERATION_TAG.search(chat_template) is not None
        self._template = compile_template(chat_template) if chat_template is not None else None
        self.adds_bos, self.adds_eos = self._adds_specials(config)

    def _id(self, token: str | None) -> int | None:
        return None if token is None else self.backend.token_to_id(token)

    def _adds_specials(self, config: dict) -> tuple[bool, bool]:
        """Whether plain text gets BOS first and EOS last: tokenizer_config.json's `add_bos_token` /
        `add_eos_token` where set (transformers rebuilds the post-processor from them), else what
        the post-processor does to a probe text."""
        plain = self.backend.encode(_PROBE, add_special_tokens=False).ids
        full = self.backend.encode(_PROBE, add_special_tokens=True).ids
        post_bos = self.bos_token_id is not None and len(full) > len(plain) and full[0] == self.bos_token_id
        post_eos = self.eos_token_id is not None and len(full) > len(plain) and full[-1] == self.eos_token_id
        bos = config.get("add_bos_token")
        eos = config.get("add_eos_token")
        return (
            (bool(bos) and self.bos_token_id is not None) if isinstance(bos, bool) else post_bos,
            (bool(eos) and self.eos_token_id is not None) if isinstance(eos, bool) else post_eos,
        )

    @classmethod
    def load(cls, directory: str, *, template_name: str | None = None) -> LocalTokenizer:
        """Read a tokenizer directory; never a network call.

        `template_name`: which of several named chat templates to use ("default" when None).
        """
        root = Path(directory)
        if not root.is_dir():
            if root.exists():
                raise PackctlError(
                    f"tokenizer {directory}: is a file, not a directory; pass the directory that holds tokenizer.json"
                )
            raise PackctlError(
                f"tokenizer {directory}: not a local directory; packctl reads tokenizers from disk and never "
                f"downloads: fetch it first (e.g. `huggingface-cli download {directory} --local-dir DIR`) and pass "
                "--tokenizer DIR"
            )
        config_path = root / "tokenizer_config.json"
        config = _read_json(config_path) if config_path.is_file() else {}
        backend = _load_backend(root)
        special_tokens = {
            name: text for name in SPECIAL_TOKEN_NAMES if (text := _token_text(config.get(name))) is not None
        }
        map_path = root / "special_tokens_map.json"
        if map_path.is_file():
            for name, value in _read_json(map_path).items():
                text = _token_text(value)
                if name in SPECIAL_TOKEN_NAMES and name not in special_tokens and text is not None:
                    special_tokens[name] = text
        jinja_path = root / "chat_template.jinja"
        if jinja_path.is_file():
            try:
                chat_template = jinja_path.read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError) as exc:
                raise PackctlError(f"{jinja_path}: cannot be read ({exc}); {_RESTORE}") from None
        else:
            chat_template = _pick_template(config.get("chat_template"), template_name, config_path)
        digest = hashlib.sha256()
        for name in FINGERPRINT_FILES:
            path = root / name
            if path.is_file():
                digest.update(name.encode() + b"\0" + path.read_bytes() + b"\0")
        try:
            return cls(
                directory=str(root),
                backend=backend,
                config=config,
                special_tokens=special_tokens,
                chat_template=chat_template,
                fingerprint=digest.hexdigest(),
            )
        except jinja2.TemplateSyntaxError as exc:
            where = jinja_path if jinja_path.is_file() else config_path
            raise PackctlError(
                f"{where}: the chat template does not compile (line {exc.lineno}: {exc.message}); fix the template"
            ) from None

    def render(
        self,
        messages: list[dict],
        *,
        tools: list[dict] | None = None,
        add_generation_prompt: bool = False,
        prepared: bool = False,
        **extra,
    ) -> RenderedChat:
        """The chat as `apply_chat_template(messages, tools=tools, tokenize=False,
        add_generation_prompt=..., **extra)` renders it, with the `{% generation %}` spans.

        `prepared`: the messages come from `prepare_messages` (a caller that renders several
        prefixes of one conversation prepares it once).
        """
        if self._template is None:
            raise PackctlError(
                f"tokenizer {self.directory}: has no chat template (no chat_template.jinja, none in "
                "tokenizer_config.json); use a tokenizer with a chat template or a plain-text format"
            )
        variables = {
            **self.special_tokens,
            **extra,
            "messages": messages if prepared else self.prepare_messages(messages),
            "tools": tools,
            "documents": None,
            "add_generation_prompt": add_generation_prompt,
        }
        if not self.has_generation_block:
            return RenderedChat(self._template.render(variables), None)
        blocks: list[str] = []
        spans: list[tuple[int, int]] = []
        tracking = self._template.environment.generation_tracking
        token = tracking.set((blocks, spans, [0, 0]))
        try:
            for block in self._template.generate(variables):
                blocks.append(block)
        finally:
            tracking.reset(token)
        return RenderedChat("".join(blocks), spans)

    @staticmethod
    def prepare_messages(messages: list[dict]) -> list[dict]:
        """The messages as the template sees them (see `_template_message`)."""
        return [_template_message(message) for message in messages]

    def encode_batch(self, texts: list[str], *, add_special_tokens: bool) -> list:
        """`tokenizers.Encoding`s of `texts`, encoded by the Rust batch encoder on its own threads
        (RAYON_NUM_THREADS); the ids do not depend on the number of threads."""
        return self.backend.encode_batch(texts, add_special_tokens=add_special_tokens)

    def describe(self) -> dict:
        """What the output's metadata records of the tokenizer."""
        return {
            "fingerprint": self.fingerprint,
            "template_hash": self.template_hash,
            "has_generation_block": self.has_generation_block,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
        }


def _load_backend(root: Path):
    """The Rust tokenizer of a directory: tokenizer.json, or (sentencepiece-only directories) the
    fast tokenizer transformers converts from the files it finds there."""
    path = root / "tokenizer.json"
    if path.is_file():
        from tokenizers import Tokenizer

        try:
            return Tokenizer.from_file(str(path))
        except Exception as exc:  # the Rust loader raises a bare Exception on a malformed file
            raise PackctlError(f"{path}: not a valid tokenizer.json ({first_line(exc)}); {_RESTORE}") from None
    if not any(root.glob("*.model")) and not (root / "vocab.json").is_file():
        raise PackctlError(
            f"tokenizer {root}: no tokenizer.json (nor a sentencepiece .model or vocab.json); "
            "pass the directory that holds the model's tokenizer files"
        )
    try:
        import transformers
    except ImportError:
        raise PackctlError(
            f"tokenizer {root}: no tokenizer.json, and reading its other files needs transformers, which is not "
            "installed: pip install transformers sentencepiece, or write its tokenizer.json with "
            "AutoTokenizer.from_pretrained(DIR).save_pretrained(DIR)"
        ) from None
    try:
        fast = transformers.AutoTokenizer.from_pretrained(str(root), local_files_only=True)
    except Exception as exc:
        raise PackctlError(
            f"tokenizer {root}: transformers cannot load it from disk ({first_line(exc)}); add its tokenizer.json"
        ) from None
    backend = getattr(fast, "backend_tokenizer", None)
    if backend is None:
        raise PackctlError(f"tokenizer {root}: transformers has no fast tokenizer for it; add its tokenizer.json")
    return backend
