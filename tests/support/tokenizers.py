"""Small Hugging Face tokenizer directories built offline, and chat templates written for tests.

`tokenizer_dir(path, template=CHATML)` trains a byte-level BPE on a few hundred generated lines
(milliseconds), adds the special tokens of the templates below, and saves tokenizer.json and
tokenizer_config.json as transformers saves them, so `LocalTokenizer.load` and
`transformers.AutoTokenizer.from_pretrained(path)` both read it.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

SPECIAL_TOKENS = [
    "<s>", "</s>", "<pad>", "<|im_start|>", "<|im_end|>", "<|begin_of_text|>", "<|start_header_id|>",
    "<|end_header_id|>", "<|eot_id|>", "<tool_call>", "</tool_call>",
]

# ChatML as Qwen writes it, the assistant turn (content and <|im_end|>) in a generation block.
CHATML = (
    "{%- for message in messages %}"
    "{%- if message['role'] == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{% generation %}{{- message['content'] + '<|im_end|>' }}{% endgeneration %}{{- '\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# Llama-3: BOS from the template, headers, contents trimmed, <|eot_id|> ends a turn.
LLAMA3 = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}"
    "{%- if message['role'] == 'assistant' %}"
    "{% generation %}{{- message['content'] | trim + '<|eot_id|>' }}{% endgeneration %}"
    "{%- else %}"
    "{{- message['content'] | trim + '<|eot_id|>' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)

# ChatML with tools: a system turn listing the tools as JSON, assistant tool calls, tool results.
TOOLS = (
    "{%- if tools %}{{- '<|im_start|>system\\n# Tools\\n' }}"
    "{%- for tool in tools %}{{- tool | tojson }}{{- '\\n' }}{%- endfor %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' }}{% generation %}"
    "{%- if message.content %}{{- message.content }}{%- endif %}"
    "{%- if message.tool_calls %}{%- for call in message.tool_calls %}"
    "{{- '<tool_call>' + call.function | tojson + '</tool_call>' }}"
    "{%- endfor %}{%- endif %}"
    "{{- '<|im_end|>' }}{% endgeneration %}{{- '\\n' }}"
    "{%- elif message.role == 'tool' %}{{- '<|im_start|>tool\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# Qwen3's habit: the reasoning of an assistant turn is shown only on the last turn, so rendering
# a longer conversation rewrites the earlier turns.
REASONING = (
    "{%- for message in messages %}"
    "{%- if message['role'] == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' }}{% generation %}"
    "{%- if loop.last and message.reasoning_content %}"
    "{{- '<think>\\n' + message.reasoning_content + '\\n</think>\\n\\n' }}{%- endif %}"
    "{{- message['content'] + '<|im_end|>' }}{% endgeneration %}{{- '\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

_GENERATION_TAGS = re.compile(r"\{%-?\s*(end)?generation\s*-?%\}")


def without_generation(template: str) -> str:
    """The template with its `{% generation %}` / `{% endgeneration %}` tags removed: the same text."""
    return _GENERATION_TAGS.sub("", template)


def _corpus() -> list[str]:
    words = (
        "the sky is blue and the sea is green a model reads tokens writes answers user assistant system "
        "hello world what color tool call weather city paris london today sunny rain function name "
        "arguments result think reason because so then first second third number one two three"
    ).split()
    lines = []
    for i in range(400):
        picked = [words[(i * 7 + j * 13) % len(words)] for j in range(3 + i % 9)]
        lines.append(" ".join(picked) + ("\n" if i % 3 else " ") + "{\"name\": \"x\"} 0123456789 ?!.,:;'()[]")
    return lines


def train_tokenizer(*, whitespace: bool = False, bos_post_processor: bool = False, vocab_size: int = 400):
    """A byte-level BPE (or, with `whitespace`, a BPE whose pre-tokenizer drops whitespace, so a
    space or newline maps to no token) with SPECIAL_TOKENS added."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    if whitespace:
        tok = Tokenizer(models.BPE(unk_token="<unk>"))
        tok.pre_tokenizer = pre_tokenizers.Whitespace()
        trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<unk>"], show_progress=False)
    else:
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
        )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    tok.add_special_tokens(SPECIAL_TOKENS + ["<think>", "</think>"])
    if bos_post_processor:
        bos = tok.token_to_id("<s>")
        tok.post_processor = processors.TemplateProcessing(
            single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos)]
        )
    elif not whitespace:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return tok


def tokenizer_dir(
    path: Path,
    *,
    template: str | list | None = CHATML,
    whitespace: bool = False,
    bos_post_processor: bool = False,
    bos_token: str = "<s>",
    eos_token: str = "</s>",
    config: dict | None = None,
    jinja_file: str | None = None,
) -> Path:
    """A tokenizer directory at `path`: tokenizer.json and tokenizer_config.json (the template in
    the config, or in chat_template.jinja with `jinja_file`); `config` entries override."""
    path.mkdir(parents=True, exist_ok=True)
    train_tokenizer(whitespace=whitespace, bos_post_processor=bos_post_processor).save(str(path / "tokenizer.json"))
    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": bos_token,
        "eos_token": eos_token,
        "pad_token": "<pad>",
        "model_max_length": 1 << 20,
    }
    if template is not None:
        cfg["chat_template"] = template
    cfg.update(config or {})
    (path / "tokenizer_config.json").write_text(json.dumps(cfg), encoding="utf-8")
    if jinja_file is not None:
        (path / "chat_template.jinja").write_text(jinja_file, encoding="utf-8")
    return path
