"""LocalTokenizer: what it reads from a directory, what it refuses, and the template environment."""
from __future__ import annotations

import json

import pytest

from packctl.errors import PackctlError
from packctl.tokenize.tokenizer import LocalTokenizer
from support.tokenizers import CHATML, LLAMA3, tokenizer_dir

CONV = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]


def test_hub_name_is_refused_without_a_network_call(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(PackctlError) as err:
        LocalTokenizer.load("Qwen/Qwen3-8B")
    assert str(err.value) == (
        "tokenizer Qwen/Qwen3-8B: not a local directory; packctl reads tokenizers from disk and never downloads: "
        "fetch it first (e.g. `huggingface-cli download Qwen/Qwen3-8B --local-dir DIR`) and pass --tokenizer DIR"
    )


def test_directory_without_tokenizer_files_names_what_is_missing(tmp_path):
    with pytest.raises(PackctlError, match=r"no tokenizer\.json \(nor a sentencepiece \.model or vocab\.json\)"):
        LocalTokenizer.load(str(tmp_path))


@pytest.mark.parametrize("name, content", [
    ("tokenizer.json", "{not json"),
    ("tokenizer_config.json", "{not json"),
    ("tokenizer_config.json", "[1, 2]"),
    ("special_tokens_map.json", "{not json"),
])
def test_invalid_file_is_named_in_one_line(tmp_path, name, content):
    directory = tokenizer_dir(tmp_path / "tok")
    (directory / name).write_text(content)
    with pytest.raises(PackctlError) as err:
        LocalTokenizer.load(str(directory))
    message = str(err.value)
    assert message.startswith(str(directory / name) + ":") and "\n" not in message


def test_template_that_does_not_compile_names_its_file(tmp_path):
    directory = tokenizer_dir(tmp_path, template="{% for m in messages %}{{ m.content }}")
    with pytest.raises(PackctlError, match=r"tokenizer_config\.json: the chat template does not compile \(line 1"):
        LocalTokenizer.load(str(directory))


def test_attributes(tmp_path):
    directory = tokenizer_dir(tmp_path, template=CHATML, config={"bos_token": {"content": "<s>", "lstrip": False}})
    tok = LocalTokenizer.load(str(directory))
    backend = tok.backend
    assert tok.directory == str(directory)
    assert (tok.bos_token, tok.eos_token, tok.pad_token) == ("<s>", "</s>", "<pad>")
    ids = tuple(backend.token_to_id(t) for t in ("<s>", "</s>", "<pad>"))
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == ids
    assert tok.vocab_size == backend.get_vocab_size(with_added_tokens=True)
    assert tok.chat_template == CHATML and tok.has_generation_block
    assert len(tok.template_hash) == 64 and len(tok.fingerprint) == 64
    assert tok.describe() == {"fingerprint": tok.fingerprint, "template_hash": tok.template_hash,
                              "has_generation_block": True, "bos_token_id": tok.bos_token_id,
                              "eos_token_id": tok.eos_token_id}


def test_special_tokens_map_fills_what_the_config_lacks(tmp_path):
    directory = tokenizer_dir(tmp_path, config={"pad_token": None})
    special = {"pad_token": {"content": "</s>"}, "eos_token": "<s>"}
    (directory / "special_tokens_map.json").write_text(json.dumps(special))
    tok = LocalTokenizer.load(str(directory))
    assert tok.pad_token == "</s>" and tok.eos_token == "</s>"


def test_fingerprint_follows_the_files_that_decide_ids(tmp_path):
    directory = tokenizer_dir(tmp_path)
    first = LocalTokenizer.load(str(directory)).fingerprint
    assert LocalTokenizer.load(str(directory)).fingerprint == first
    (directory / "README.md").write_text("not a tokenizer file")
    assert LocalTokenizer.load(str(directory)).fingerprint == first
    (directory / "chat_template.jinja").write_text(CHATML)
    assert LocalTokenizer.load(str(directory)).fingerprint != first


def test_chat_template_jinja_wins_over_the_config(tmp_path):
    tok = LocalTokenizer.load(str(tokenizer_dir(tmp_path, template=CHATML, jinja_file=LLAMA3)))
    assert tok.chat_template == LLAMA3
    assert tok.render(CONV).text.startswith("<s><|start_header_id|>user")


def test_named_templates_default_and_by_name(tmp_path):
    named = [{"name": "default", "template": CHATML}, {"name": "llama", "template": LLAMA3}]
    directory = tokenizer_dir(tmp_path, template=named)
    assert LocalTokenizer.load(str(directory)).chat_template == CHATML
    assert LocalTokenizer.load(str(directory), template_name="llama").chat_template == LLAMA3
    with pytest.raises(PackctlError, match=r"no chat template named 'nope' \(it has default, llama\)"):
        LocalTokenizer.load(str(directory), template_name="nope")


def test_no_template_renders_nothing_and_says_so(tmp_path):
    tok = LocalTokenizer.load(str(tokenizer_dir(tmp_path, template=None)))
    assert tok.chat_template is None and tok.template_hash is None and not tok.has_generation_block
    with pytest.raises(PackctlError, match="has no chat template"):
        tok.render(CONV)


def test_render_has_no_spans_without_generation_blocks(tmp_path):
    template = "{{ bos_token }}{% for m in messages %}{{ m.content }}{% endfor %}"
    tok = LocalTokenizer.load(str(tokenizer_dir(tmp_path, template=template)))
    assert tok.render(CONV).generation_spans is None
    assert tok.render(CONV).text == "<s>hiyo"


def test_template_environment_as_transformers_defines_it(tmp_path):
    template = (
        "{% for m in messages %}{% if m.role == 'skip' %}{% continue %}{% endif %}"
        "{{ m | tojson }}\n"
        "{% endfor %}"
        "{{ tools | tojson(indent=1) }}|{{ eos_token }}|{{ pad_token }}|{{ extra_var }}|"
        "{{ strftime_now('%Y') | length }}"
        "{% set ns = namespace(n=0) %}{% set ns.n = 3 %}|{{ ns.n }}|{{ dict(a=1) | tojson }}"
        "{% if add_generation_prompt %}>{% endif %}"
    )
    tok = LocalTokenizer.load(str(tokenizer_dir(tmp_path, template=template)))
    messages = [{"role": "user", "content": "<b>&é"}, {"role": "skip", "content": "x"}]
    text = tok.render(messages, tools=[{"n": 1}], add_generation_prompt=True, extra_var="E").text
    assert text == ('{"role": "user", "content": "<b>&é"}\n[\n {\n  "n": 1\n }\n]|</s>|<pad>|E|4|3|{"a": 1}>')


def test_raise_exception_and_none_fields(tmp_path):
    template = ("{% for m in messages %}{% if 'name' in m %}{{ raise_exception('no names') }}{% endif %}"
                "{{ m.content }}{% endfor %}")
    tok = LocalTokenizer.load(str(tokenizer_dir(tmp_path, template=template)))
    assert tok.render([{"role": "user", "content": "a", "name": None}]).text == "a"  # None fields are dropped
    import jinja2

    with pytest.raises(jinja2.TemplateError, match="no names"):
        tok.render([{"role": "user", "content": "a", "name": "x"}])


def test_reasoning_is_passed_under_both_names(tmp_path):
    template = "{% for m in messages %}{{ m.reasoning_content }}/{{ m.thinking }}{% endfor %}"
    tok = LocalTokenizer.load(str(tokenizer_dir(tmp_path, template=template)))
    assert tok.render([{"role": "assistant", "content": "a", "reasoning": "r"}]).text == "r/r"


def test_sandbox_refuses_python_internals(tmp_path):
    import jinja2

    tok = LocalTokenizer.load(str(tokenizer_dir(tmp_path, template="{{ messages.__class__.__mro__ }}")))
    with pytest.raises(jinja2.exceptions.SecurityError):
        tok.render(CONV)


def test_sentencepiece_directory_falls_back_to_transformers(tmp_path, monkeypatch):
    import tokenizers

    directory = tokenizer_dir(tmp_path)
    (directory / "tokenizer.json").rename(tmp_path / "moved.json")
    (directory / "spiece.model").write_bytes(b"")

    class Fast:
        backend_tokenizer = tokenizers.Tokenizer.from_file(str(tmp_path / "moved.json"))

    calls = []

    class Auto:
        @staticmethod
        def from_pretrained(path, **kwargs):
            calls.append((path, kwargs))
            return Fast()

    transformers = pytest.importorskip("transformers")

    monkeypatch.setattr(transformers, "AutoTokenizer", Auto)
    tok = LocalTokenizer.load(str(directory))
    assert calls == [(str(directory), {"local_files_only": True})]
    assert tok.backend is Fast.backend_tokenizer


def test_sentencepiece_directory_without_transformers_says_what_to_install(tmp_path, monkeypatch):
    import sys

    directory = tokenizer_dir(tmp_path)
    (directory / "tokenizer.json").unlink()
    (directory / "spiece.model").write_bytes(b"")
    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers raises ImportError
    with pytest.raises(PackctlError, match=r"needs transformers, which is not installed: pip install transformers"):
        LocalTokenizer.load(str(directory))
