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
