"""Prompts: chat templates (default and a checkpoint's), and the detokenizer's stops."""

from __future__ import annotations

import json

import pytest

from pdserve.coordinator.errors import ServeError
from pdserve.coordinator.prompts import PromptBuilder


def test_default_template_and_byte_tokenizer():
    pb = PromptBuilder("tiny")
    text = pb.render_chat([{"role": "system", "content": "be brief"},
                           {"role": "user", "content": "hi"}])
    assert text == "<|system|>\nbe brief\n<|user|>\nhi\n<|assistant|>\n"
    assert pb.encode_text("hi") == [104, 105]
    with pytest.raises(ServeError) as info:
        pb.check_ids([1, 320])
    assert info.value.status == 400


def test_checkpoint_chat_template_is_rendered_in_a_sandbox(tmp_path):
    template = ("{{ bos_token }}{% for m in messages %}[{{ m.role | upper }}] {{ m.content }}"
                "{% endfor %}{% if add_generation_prompt %}[ASSISTANT]{% endif %}")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": template, "bos_token": "<s>", "eos_token": {"content": "</s>"}}))
    pb = PromptBuilder(str(tmp_path))
    assert pb.render_chat([{"role": "user", "content": "yo"}]) == "<s>[USER] yo[ASSISTANT]"
    with pytest.raises(ServeError):  # no tokenizer.json: token ids only
        pb.encode_text("x")
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": "{{ raise_exception('no system role') }}"}))
    with pytest.raises(ServeError) as info:
        PromptBuilder(str(bad)).render_chat([{"role": "system", "content": ""}])
    assert "no system role" in info.value.message


def test_detokenizer_holds_back_partial_utf8_and_stop_prefixes():
    detok = PromptBuilder("tiny").detokenizer(["END"])
    out = []
    for tok in "héllo E".encode():
        text, hit = detok.append([tok])
        assert not hit
        out.append(text)
    assert "".join(out) == "héllo "  # "E" could begin "END"
    text, hit = detok.append(list(b"ND and more"))
    assert hit and text == ""
    assert detok.flush() == ""


JINJA = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}<assistant>"


def test_chat_template_jinja_is_read_first(tmp_path):
    # transformers writes the template next to the weights; tokenizer_config.json may
    # then hold none, or (older files) another one, which the file beside it overrides.
    (tmp_path / "chat_template.jinja").write_text(JINJA)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": "old {{ messages }}"}))
    pb = PromptBuilder(str(tmp_path))
    assert pb.render_chat([{"role": "user", "content": "hi"}]) == "<user>hi<assistant>"
    assert pb.template_source == "chat_template.jinja"


def test_named_templates_use_default(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": [
        {"name": "tool_use", "template": "tools"}, {"name": "default", "template": JINJA}]}))
    assert PromptBuilder(str(tmp_path)).render_chat([{"role": "user", "content": "a"}]) == "<user>a<assistant>"


@pytest.mark.parametrize("config", [None, {"bos_token": "<s>"},
                                    {"chat_template": [{"name": "tool_use", "template": "x"}]}])
def test_a_checkpoint_without_a_chat_template_refuses_chat_saying_how_to_add_one(tmp_path, config):
    if config is not None:
        (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    pb = PromptBuilder(str(tmp_path))
    with pytest.raises(ServeError) as info:
        pb.render_chat([{"role": "user", "content": "hi"}])
    assert info.value.status == 400 and info.value.param == "messages"
    assert "no chat template" in info.value.message and "chat_template.jinja" in info.value.message


def test_a_template_that_does_not_compile_refuses_chat_with_the_reason(tmp_path):
    (tmp_path / "chat_template.jinja").write_text("{% for m in messages %}")
    pb = PromptBuilder(str(tmp_path))
    assert pb.template_source.startswith("does not compile")
    with pytest.raises(ServeError) as info:
        pb.render_chat([{"role": "user", "content": "hi"}])
    assert "does not compile" in info.value.message
