"""Tool-call formats (service/tool_formats.py): which format a chat template writes, the per-model setting that
overrides it, a marker the tokenizer has as a special token, and call ids as the format's templates accept them."""
from __future__ import annotations

import re
from dataclasses import replace

import pytest

from kvserve.config import TOOL_CALL_PARSERS, ConfigError, ServedModel, ServerConfig
from kvserve.service.tool_formats import (FORMATS, HERMES, LLAMA3_JSON, MISTRAL, ToolFormat, detect_format,
                                          special_token, tool_format)
from tests import tool_templates

# Short templates with each family's markers, as their real templates write them
MISTRAL_SNIPPET = ("{% for m in messages %}{% if m.role == 'user' %}{% if tools and loop.last %}[AVAILABLE_TOOLS] "
                   "{{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}[INST] {{ m.content }}[/INST]"
                   "{% elif m.tool_calls %}[TOOL_CALLS] [...]{{ eos_token }}{% endif %}{% endfor %}")
QWEN_SNIPPET = ("{% if tools %}<|im_start|>system\n# Tools\n<tools>{{ tools | tojson }}</tools>\nFor each function "
                "call, return a json object within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": "
                "<function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>{% endif %}")
LLAMA_SNIPPETS = [
    "{% if builtin_tools is defined %}{{- \"<|python_tag|>\" + tool_call.name + \".call(\" }}{% endif %}",
    "{{- \"Environment: ipython\\n\" }}{% for t in tools %}{{ t | tojson }}{% endfor %}",
    "{{- '{\"name\": \"' + tool_call.name + '\", ' }}{{- '\"parameters\": ' }}{{- tool_call.arguments | tojson }}",
    "{{- \"Respond in the format {\\\"name\\\": function name, \\\"parameters\\\": dictionary of argument name}\" }}",
]
CHATML = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"


@pytest.mark.parametrize("template,expected", [
    (MISTRAL_SNIPPET, MISTRAL), (QWEN_SNIPPET, HERMES), *[(s, LLAMA3_JSON) for s in LLAMA_SNIPPETS],
    (CHATML, HERMES), (None, HERMES),
    # a Hermes fine-tune of Llama keeps Hermes's calls whatever else its template says
    (QWEN_SNIPPET + LLAMA_SNIPPETS[2], HERMES),
])
def test_the_format_is_the_one_the_template_writes(template, expected):
    assert detect_format(template) is expected


def test_templates_that_render_tools_are_recognised():
    for name, template in tool_templates.TEMPLATES.items():
        assert detect_format(template) is FORMATS[name]
    # Mistral-Small's template (a tekken tokenizer) writes the list right after the marker
    tekken = detect_format('{{- "[TOOL_CALLS][" }}{% for tool in message.tool_calls %}...{% endfor %}')
    assert tekken.name == "mistral" and tekken.example().startswith('[TOOL_CALLS][{"name": ')


class _Tokenizer:
    """Just enough of a tokenizer: one special token, "<|python_tag|>" or "[TOOL_CALLS]"; everything else is one
    id per character."""

    def __init__(self, special: str, template: str | None = None):
        self.special, self.chat_template, self.all_special_ids = special, template, [7]

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [7] if text == self.special else [100 + ord(c) for c in text]


def test_the_setting_wins_and_a_special_marker_is_named_by_its_token():
    mistral_tok = _Tokenizer("[TOOL_CALLS]", MISTRAL_SNIPPET)
    auto = tool_format(mistral_tok, "auto")
    assert auto.name == "mistral" and auto.marker_token == 7 and auto.keeps_special_tokens
    assert tool_format(mistral_tok, "hermes") == HERMES  # no marker: nothing to resolve
    # a tokenizer that spells the marker as text: the grammar writes it as text, the output needs no special tokens
    spelled = tool_format(_Tokenizer("<|python_tag|>", MISTRAL_SNIPPET), "auto")
    assert spelled.marker_token is None and not spelled.keeps_special_tokens
    llama = tool_format(_Tokenizer("<|python_tag|>", LLAMA_SNIPPETS[0]), "auto")
    # Llama's marker is optional: the text does not need it, whether or not the tokenizer has it
    assert llama.name == "llama3_json" and llama.marker_token == 7 and not llama.keeps_special_tokens
    assert special_token(mistral_tok, "") is None
    assert set(FORMATS) | {"auto"} == set(TOOL_CALL_PARSERS)


def test_a_real_tokenizers_special_token_is_found(smollm2_tokenizer):
    assert special_token(smollm2_tokenizer, "<|im_start|>") == 1
    assert special_token(smollm2_tokenizer, "[TOOL_CALLS]") is None  # SmolLM2 spells it in pieces
    assert tool_format(smollm2_tokenizer, "mistral").marker_token is None


def test_call_ids_are_what_the_format_expects():
    assert re.fullmatch(r"call_[0-9a-f]{24}", HERMES.new_call_id())
    ids = {MISTRAL.new_call_id() for _ in range(50)}
    assert len(ids) == 50 and all(re.fullmatch(r"[A-Za-z0-9]{9}", i) for i in ids)
    # a client's ids (OpenAI's, another model's) as Mistral's templates accept them: stable, 9 letters and digits
    for given in ("call_8f2a01bc39de44e0a1b2c3d4", "abc", "a-b-c-d-e-f-g-h-i-j", "Xy12Zw34Q"):
        mapped = MISTRAL.template_id(given)
        assert re.fullmatch(r"[A-Za-z0-9]{9}", mapped) and mapped == MISTRAL.template_id(given)
    assert MISTRAL.template_id("Xy12Zw34Q") == "Xy12Zw34Q" and HERMES.template_id("anything") == "anything"
    assert MISTRAL.template_id("call_1") != MISTRAL.template_id("call_2")


def test_a_format_is_validated():
    with pytest.raises(ValueError, match="optional marker"):
        ToolFormat("x", instruction="", marker_optional=True)
    assert replace(LLAMA3_JSON, marker_token=3).marker_token == 3


def test_the_setting_is_read_from_the_models_file(tmp_path):
    path = tmp_path / "m.toml"
    path.write_text('[[models]]\nid = "a"\nsource = "x"\ntool_call_parser = "mistral"\n')
    (m,) = ServerConfig.from_toml(str(path)).models
    assert m.tool_call_parser == "mistral" and "tool_call_parser" not in m.engine_args
    assert ServedModel(id="b", source="x").tool_call_parser == "auto"
    path.write_text('[[models]]\nid = "a"\nsource = "x"\ntool_call_parser = "xml"\n')
    with pytest.raises(ConfigError, match=r"tool_call_parser = 'xml' is not allowed: auto, hermes, mistral, "):
        ServerConfig.from_toml(str(path))
