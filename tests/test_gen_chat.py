"""Multi-turn chat (issue 18): every turn feeds the model exactly the whole conversation rendered
at once by the chat template, while the caches keep what they already hold.

Four template styles on a tiny model: ChatML with a default system prompt (SmolLM2's), Llama 3
(BOS in the template, trimmed content), Gemma (BOS, "model" role) and a Qwen3-like template
that is not prefix-stable (its generation prompt opens a <think> block the history drops).
"""

import json
import os
import shutil
from pathlib import Path

import pytest

from kvcore.chat_session import ChatSession
from kvcore.engine import GenerateConfig, Request, generate_one
from kvcore.engine.chat import conversation_path, render, turn_delta
from kvcore.errors import MlxkvError
from kvcore.models import load_model
from kvcore.policy import KVOptions, build_caches, resolve_policy
from kvcore.store import open_cache_file

TEMPLATES = {
    "chatml": ("{% for m in messages %}{% if loop.first and m['role'] != 'system' %}<|im_start|>system\nYou are a "
               "helpful assistant<|im_end|>\n{% endif %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
               "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"),
    "llama3": ("{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
               "{{ m['content'] | trim }}<|eot_id|>{% endfor %}{% if add_generation_prompt %}"
               "<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"),
    "gemma": ("{{ bos_token }}{% for m in messages %}{% set role = 'model' if m['role'] == 'assistant' else m['role'] %}"
              "<start_of_turn>{{ role }}\n{{ m['content'] | trim }}<end_of_turn>\n{% endfor %}"
              "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"),
    "qwen3-think": ("{% for m in messages %}{% set c = m['content'] %}{% if m['role'] == 'assistant' %}"
                    "{% set c = c.split('</think>')[-1] | trim %}{% endif %}<|im_start|>{{ m['role'] }}\n{{ c }}"
                    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n{% endif %}"),
}
QUESTIONS = ["Once upon a time", "The dog ran to the park.", "She said"]
N = 6
MLXKV_HOME = Path(os.environ.get("MLXKV_HOME", Path.home() / ".cache/mlxkv"))
SMOL = MLXKV_HOME / "models/SmolLM2-135M-Instruct-f32"


@pytest.fixture(scope="module")
def lm(tiny_models):
    return load_model(str(tiny_models("llama")))


def with_template(lm, style):
    lm.tokenizer._tokenizer.chat_template = TEMPLATES[style]
    return lm


def at_once(lm, ids, n=N, opts=KVOptions()):
    caches, _ = build_caches(lm.model, resolve_policy(opts))
    return generate_one(lm.model, lm.tokenizer, Request(tuple(ids), n), caches, GenerateConfig(prefill_chunk=8)).token_ids


@pytest.mark.parametrize("style", list(TEMPLATES))
@pytest.mark.parametrize("kv", [KVOptions(), KVOptions(kv_bits=8, kv_group_size=32, quantized_kv_start=0)],
                         ids=["full", "affine8"])
def test_each_turn_feeds_the_whole_conversation(lm, style, kv):
    lm = with_template(lm, style)
    session = ChatSession(lm, resolve_policy(kv), max_tokens=N, prefill_chunk=8)
    before = []  # the context of the previous turn
    for i, q in enumerate(QUESTIONS):
        turn = session.ask(q)
        whole = render(lm.tokenizer, session.messages[:-1])  # the conversation up to this question, at once
        assert session.ids[: len(whole)] == whole  # what the model was fed
        assert turn.completion.token_ids == at_once(lm, whole, opts=kv)  # greedy: the same answer
        assert turn.reused + turn.prefilled == len(whole)
        if i and style == "qwen3-think":  # the history drops the <think> opening: rolled back before it
            assert turn.reused < len(before)
        elif i:  # the previous context stayed in the caches: only its answer's tail and the new turn went in
            assert turn.reused >= len(before)
        before = whole


def test_turn_delta_closes_the_answer_without_a_second_system_prompt(lm):
    lm = with_template(lm, "chatml")
    tok = lm.tokenizer
    first = render(tok, [{"role": "user", "content": "Hi"}])
    answer = tok.encode("Hello", add_special_tokens=False)
    # ended by length: the template's end of turn and its newline come first
    text = tok.decode(turn_delta(tok, first + answer, "Who?"))
    assert text.replace(" ", "") == "<|im_end|>\n<|im_start|>user\nWho?<|im_end|>\n<|im_start|>assistant\n".replace(" ", "")
    assert "system" not in text


def test_save_and_load_keep_the_conversation(lm, tmp_path):
    lm = with_template(lm, "chatml")
    policy = resolve_policy(KVOptions(kv_bits=4, kv_group_size=32, quantized_kv_start=0))
    a = ChatSession(lm, policy, max_tokens=N, prefill_chunk=8)
    a.ask(QUESTIONS[0])
    path = tmp_path / "chat.kv"
    a.save(path)
    saved = list(a.ids)
    assert json.loads(conversation_path(path).read_text())["messages"] == a.messages
    b = ChatSession(lm, resolve_policy(KVOptions()), max_tokens=N, prefill_chunk=8)
    b.load(path)
    assert b.ids == a.ids and b.stats()["kv_bytes"] == a.stats()["kv_bytes"]
    ta, tb = a.ask(QUESTIONS[1]), b.ask(QUESTIONS[1])
    assert ta.completion.token_ids == tb.completion.token_ids and ta.reused == tb.reused
    b.reset()
    assert b.ids == [] and b.stats()["tokens"] == 0
    # a cache without its conversation file: new turns follow its tokens, closing the answer first
    conversation_path(path).unlink()
    notes = []
    c = ChatSession(lm, resolve_policy(KVOptions()), max_tokens=N, prefill_chunk=8, on_notice=notes.append)
    c.load(path)
    assert c.messages is None and "no conversation beside it" in notes[0]
    turn = c.ask("Who?")
    assert turn.reused == len(saved)  # all the cached tokens kept
    fed = lm.tokenizer.decode(c.ids)
    assert fed.count("system") == 1 and fed.count("<|im_start|>user") == 2
    with pytest.raises(MlxkvError, match="nothing to save"):
        b.save(tmp_path / "empty.kv")


def test_no_chat_template_is_one_line(tiny_models):
    bare = load_model(str(tiny_models("llama")))
    bare.tokenizer._tokenizer.chat_template = None
    with pytest.raises(MlxkvError, match="no chat template"):
        ChatSession(bare, resolve_policy(KVOptions()))


@pytest.mark.parametrize("message", ["", "\nsecond line only", "tool turns need tools\nmore"])
def test_a_template_that_refuses_is_one_line(tiny_models, message):
    """A template raising with an empty message (or one whose first line is empty) still gives one line that
    names what failed, never an IndexError from the message's first line."""
    lm = load_model(str(tiny_models("llama")))
    lm.tokenizer._tokenizer.chat_template = "{{ raise_exception(%r) }}" % message
    with pytest.raises(MlxkvError, match="cannot render this conversation: ") as e:
        render(lm.tokenizer, [{"role": "user", "content": "hi"}])
    first = message.splitlines()[0] if message.splitlines() and message.splitlines()[0] else "TemplateError"
    assert str(e.value).endswith(": " + first) and "\n" not in str(e.value)


@pytest.fixture(scope="module")
def chat_model(tiny_models, tmp_path_factory):
    """The tiny llama folder with a ChatML template in its tokenizer config."""
    out = tmp_path_factory.mktemp("chat") / "llama-chatml"
    shutil.copytree(tiny_models("llama"), out)
    cfg_path = out / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["chat_template"] = TEMPLATES["chatml"]
    cfg_path.write_text(json.dumps(cfg))
    return out


def _json_tokens(r):
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout.splitlines()[0])


def test_generate_chat_continue_is_the_whole_conversation(chat_model, tmp_path):
    from typer.testing import CliRunner

    from mlxkv_cli.main import build_app

    app, runner, m = build_app(), CliRunner(), str(chat_model)
    cache = tmp_path / "c.kv"
    first = _json_tokens(runner.invoke(app, ["generate", "-m", m, "-p", "Hi", "-n", "5", "--json", "--save-cache", str(cache)]))
    again = tmp_path / "c2.kv"
    args = ["generate", "-m", m, "--load-cache", str(cache), "-p", "Who?", "--chat-continue", "-n", "5", "--json",
            "--save-cache", str(again)]
    second = _json_tokens(runner.invoke(app, args))
    lm = load_model(m)
    whole = render(lm.tokenizer, [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": first["text"]},
                                  {"role": "user", "content": "Who?"}])
    assert open_cache_file(again).prefix_ids[: len(whole)] == whole  # fed: the whole conversation
    assert second["token_ids"] == at_once(lm, whole, 5)
    # a cache saved without its conversation file: the answer is closed, one user turn follows, no second system
    conversation_path(cache).unlink()
    r = runner.invoke(app, args)
    assert r.exit_code == 0, r.output
    fed = lm.tokenizer.decode(open_cache_file(again).prefix_ids)
    assert fed.count("<|im_start|>system") == 1 and fed.count("<|im_start|>user") == 2
    assert "<|im_end|>\n<|im_start|>user\nWho?<|im_end|>\n<|im_start|>assistant\n" in fed.replace(" <", "<")


@pytest.mark.skipif(not SMOL.is_dir(), reason=f"{SMOL} absent (run scripts/get-eval-model)")
def test_smollm2_answers_the_second_question():
    lm = load_model(str(SMOL))
    session = ChatSession(lm, resolve_policy(KVOptions(kv_bits=8, kv_group_size=32, quantized_kv_start=0)),
                          max_tokens=24)
    first = session.ask("What is the capital of France? Answer in one word.")
    second = session.ask("And the capital of Germany? Answer in one word.")
    whole = render(lm.tokenizer, session.messages[:-1])
    assert session.ids[: len(whole)] == whole and second.prefilled < 30
    assert "Paris" in first.completion.text and "Berlin" in second.completion.text, (first.completion.text,
                                                                                    second.completion.text)
