"""Prompt formats for repos without a chat template: detection, exact token ids, prefix reuse
across turns, stops, --chat-format / --chat-template, and snapshots made with another format.

The models are scripted (tests/chat_folders.py): real Llama 2 tokenizer, a model that answers
"the cat sat" and the format's end-of-turn token, as a chat model does.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from chatapp.cli import main
from chatapp.config import ConfigError, load_config
from chatapp.engine.events import TokenEvent
from chatapp.engine.generate import GenerationSettings, run_turn
from chatapp.engine.session import Session
from chatapp.engine.setup import load_engine, session_from_config
from chatapp.errors import SetupError
from chatapp.model.loader import load_model
from chatapp.prompt.choice import FormatRequest, RepoFacts, choose_format, detect_format
from chatapp.prompt.conversation import Conversation
from chatapp.prompt.formats import make_format
from tests.chat_folders import (
    EOS,
    IM_END,
    IM_START,
    chatml_folder,
    legacy_chat_folder,
    llama2_tokenizer_model,
    script,
    script_after,
    scripted_llama,
    sp_ids,
)
from tests.test_session import regenerate_and_edit

REPO = Path(__file__).resolve().parent.parent
SYSTEM = "Always answer with  care."
DIALOG = [("user", " What is the capital of France? "), ("assistant", " Paris.  "), ("user", "And of  Italy?"),
          ("assistant", "Rome."), ("user", "Thanks!")]
QUESTIONS = ["Hello there", "Tell me more", "And then?"]
REPLY = "the cat sat"
CHATML_JINJA = ("{{ bos_token }}{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + "
                "message['content'] + '<|im_end|>' + '\n' }}{% endfor %}"
                "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def inst_end() -> int:
    return sp_ids("[/INST]")[-1]  # "]": the last token of every llama-2 / mistral prompt


@pytest.fixture(scope="module")
def llama2_chat(tmp_path_factory):
    """A legacy-layout folder named like mlx-community/Llama-2-7b-chat-4-bit, and the model loaded."""
    llama2_tokenizer_model()
    folder = legacy_chat_folder(tmp_path_factory.mktemp("l2") / "Llama-2-7b-chat-4-bit",
                                script_after(inst_end(), REPLY, EOS))
    return folder, load_model(str(folder))


@pytest.fixture(scope="module")
def chatml_chat(tmp_path_factory):
    """An mlx-lm folder whose tokenizer has <|im_start|>/<|im_end|> and no template; its name tells nothing."""
    llama2_tokenizer_model()
    newline = sp_ids("\n")[-1]  # "<|im_start|>assistant\n" ends the prompt
    folder = chatml_folder(tmp_path_factory.mktemp("cm") / "tiny-model", script_after(newline, REPLY, IM_END))
    return folder, load_model(str(folder))


@pytest.fixture(scope="module")
def llama2_base(tmp_path_factory):
    """Named like the mission's base model, mlx-community/Llama-2-7b-4bit."""
    llama2_tokenizer_model()
    folder = legacy_chat_folder(tmp_path_factory.mktemp("base") / "Llama-2-7b-4bit",
                                script_after(sp_ids("Assistant:")[-1], REPLY, EOS))
    return folder, load_model(str(folder))


def config_for(folder, **overrides):
    values = {"model.id": str(folder), "sampling.temp": 0.0, "sampling.max_tokens": 40, "chat.system": SYSTEM}
    values.update(overrides)
    return load_config(overrides=values)


def dialog_conversation() -> Conversation:
    conv = Conversation.start(SYSTEM)
    for role, text in DIALOG:
        conv.add(role, text)
    return conv


def as_dicts(conv: Conversation) -> list[dict]:
    return [{"role": m.role, "content": m.content} for m in conv.messages]


def meta_chat_completion(dialog: list[dict]) -> list[int]:
    """Meta's reference formatting (llama/generation.py, ``chat_completion``), on SentencePiece itself."""
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=str(llama2_tokenizer_model()))
    b_inst, e_inst = "[INST]", "[/INST]"
    b_sys, e_sys = "<<SYS>>\n", "\n<</SYS>>\n\n"
    if dialog[0]["role"] == "system":
        dialog = [{"role": dialog[1]["role"], "content": b_sys + dialog[0]["content"] + e_sys + dialog[1]["content"]}
                  ] + dialog[2:]
    tokens: list[int] = []
    for prompt, answer in zip(dialog[::2], dialog[1::2]):
        tokens += [sp.bos_id()] + sp.encode(
            f"{b_inst} {(prompt['content']).strip()} {e_inst} {(answer['content']).strip()} ") + [sp.eos_id()]
    return tokens + [sp.bos_id()] + sp.encode(f"{b_inst} {(dialog[-1]['content']).strip()} {e_inst}")


def three_turns_reuse(session: Session, end_of_turn: int) -> None:
    """Each turn after the first reuses everything the cache holds: the previous prompt, the
    reply and (``end_of_turn``) the reply's end-of-turn token; only the new message is prefilled."""
    prev = None
    for q in QUESTIONS:
        done = run_turn(session.send(q))
        st = done.stats
        assert (done.text, st.finish, st.generated_tokens) == (REPLY, "eos", 3)
        if prev is not None:
            assert st.reused_tokens == prev.prompt_tokens + prev.generated_tokens + end_of_turn
            assert st.prefill_tokens == st.prompt_tokens - st.reused_tokens
        prev = st


# ---- the three kinds of template-less repo ------------------------------------------------------------
def test_llama2_chat_repo_renders_meta_ids_and_reuses_every_reply(llama2_chat):
    folder, lm = llama2_chat
    s = session_from_config(config_for(folder), lm)
    assert (s.format.name, s.format.key) == ("llama-2", "llama-2")
    assert s.format_choice.reason == "no chat template; the model id Llama-2-7b-chat-4-bit matches *llama-2*chat*"
    conv = dialog_conversation()
    assert s.format.tokens(conv) == meta_chat_completion(as_dicts(conv))
    assert s.format.text(conv).startswith("<s>[INST] <<SYS>>\nAlways answer with  care.\n<</SYS>>\n\n")
    three_turns_reuse(s, end_of_turn=1)
    # what the model saw of its replies is what it wrote, </s> included, and nothing more
    assert s.format.tokens(s.conversation, generation_prompt=False) == s.cached


def test_chatml_tokenizer_renders_chatml_and_reuses_every_reply(chatml_chat):
    folder, lm = chatml_chat
    s = session_from_config(config_for(folder), lm)
    assert s.format.name == "chatml" and "<|im_start|>/<|im_end|>" in s.format_choice.reason
    conv = dialog_conversation()
    reference = lm.tokenizer.apply_chat_template(as_dicts(conv), chat_template=CHATML_JINJA, tokenize=True,
                                                 add_generation_prompt=True)
    assert s.format.tokens(conv) == list(reference)
    assert {IM_START, IM_END} <= s.eos_ids  # the end of turn ends a reply, the start of another too
    three_turns_reuse(s, end_of_turn=1)
    assert s.format.tokens(s.conversation, generation_prompt=False)[:len(s.cached)] == s.cached


def test_base_model_naming_gets_plain_text(llama2_base):
    folder, lm = llama2_base
    s = session_from_config(config_for(folder), lm)
    assert s.format.name == "plain" and "base model" in s.format_choice.reason
    text = ("Always answer with  care.\n\nUser:  What is the capital of France? \nAssistant:  Paris.  \n\n"
            "User: And of  Italy?\nAssistant: Rome.\n\nUser: Thanks!\nAssistant:")
    assert s.format.tokens(dialog_conversation()) == [1] + sp_ids(text)
    three_turns_reuse(s, end_of_turn=0)  # plain text has no end-of-turn token: "\n\n" follows the reply


def test_mistral_format_on_ids_and_reuses_every_reply(llama2_chat):
    folder, lm = llama2_chat
    s = session_from_config(config_for(folder, **{"chat.format": "mistral"}), lm)
    assert s.format_choice.describe() == "mistral (chat.format, command line)"
    # mistral_common's v1 tokenizer: one BOS, each [INST] turn and each reply encoded on its own,
    # EOS after a reply; the system prompt opens the first user message.
    turns = [f"[INST] {SYSTEM}\n\n{DIALOG[0][1]} [/INST]", DIALOG[1][1], f"[INST] {DIALOG[2][1]} [/INST]", DIALOG[3][1],
             f"[INST] {DIALOG[4][1]} [/INST]"]
    expected = [1] + sp_ids(turns[0]) + sp_ids(turns[1]) + [EOS] + sp_ids(turns[2]) + sp_ids(turns[3]) + [EOS] + \
        sp_ids(turns[4])
    assert s.format.tokens(dialog_conversation()) == expected
    three_turns_reuse(s, end_of_turn=1)


@pytest.mark.parametrize("which", ["llama2_chat", "chatml_chat"])
def test_regenerate_and_edit_last_keep_prefix_reuse(which, request):
    folder, lm = request.getfixturevalue(which)
    edited = regenerate_and_edit(session_from_config(config_for(folder), lm))
    assert edited.text == REPLY


# ---- stops ---------------------------------------------------------------------------------------------
def shown_and_done(session: Session, text: str):
    events = list(session.send(text))
    return "".join(e.text for e in events if isinstance(e, TokenEvent)), events[-1]


def test_llama2_reply_stops_before_a_next_inst(llama2_chat):
    _, lm = llama2_chat
    model, _ = scripted_llama(32000, script([inst_end()] + sp_ids("Sure. [INST]")))  # loops: ... [INST] Sure. [INST]
    s = Session(model, lm.tokenizer, generation=GenerationSettings(temp=0.0, max_tokens=30),
                prompt_format=make_format("llama-2", lm.tokenizer))
    shown, done = shown_and_done(s, "Hi")
    assert (done.text, done.stats.finish) == ("Sure.", "stop")
    assert "[" not in shown and "INST" not in shown


def test_chatml_reply_ends_at_its_end_of_turn_tokens(chatml_chat):
    _, lm = chatml_chat
    newline = sp_ids("\n")[-1]
    for end in (IM_END, IM_START):
        model, _ = scripted_llama(32002, script([newline] + sp_ids("Hi there") + [end]))
        s = Session(model, lm.tokenizer, generation=GenerationSettings(temp=0.0, max_tokens=30),
                    prompt_format=make_format("chatml", lm.tokenizer))
        shown, done = shown_and_done(s, "Hello")
        assert (done.text, done.stats.finish) == ("Hi there", "eos") and "<|" not in shown


# ---- the choice and its settings ----------------------------------------------------------------------
def facts(model_id: str, config: dict | None = None, template: bool = False, chatml: bool = False) -> RepoFacts:
    return RepoFacts(model_id, config or {}, template, chatml)


@pytest.mark.parametrize("model_id, config, expected", [
    ("mlx-community/Llama-2-7b-chat-4-bit", {}, "llama-2"),
    ("mlx-community/Llama-2-13b-chat-mlx", {"model_type": "llama"}, "llama-2"),
    ("mlx-community/CodeLlama-7b-Instruct-hf-4bit-MLX", {}, "llama-2"),
    ("mlx-community/Mistral-7B-Instruct-v0.1-4bit", {"model_type": "mistral"}, "mistral"),
    ("mlx-community/OpenHermes-2.5-Mistral-7B-4bit", {"model_type": "mistral"}, "chatml"),
    ("someone/tiny-llama-instruct", {"model_type": "llama"}, "llama-2"),
    ("someone/phi-2-chat", {"model_type": "phi"}, "chatml"),
    ("someone/legacy-instruct", {"dim": 64, "n_layers": 2}, "llama-2"),  # legacy layout: a Llama
    ("mlx-community/Llama-2-7b-4bit", {}, "plain"),
    ("mlx-community/Mistral-7B-v0.1", {"model_type": "mistral"}, "plain"),
    ("my-finetune", {"_name_or_path": "meta-llama/Llama-2-7b-chat-hf"}, "llama-2"),
])
def test_detection_from_what_the_repo_tells(model_id, config, expected):
    choice = detect_format(facts(model_id, config))
    assert choice.name == expected
    assert "no chat template" in choice.reason


def test_a_template_or_chatml_tokens_come_before_the_name():
    assert detect_format(facts("mlx-community/Llama-2-7b-chat-4-bit", template=True)).name == "template"
    assert detect_format(facts("mlx-community/Llama-2-7b-4bit", chatml=True)).name == "chatml"


def test_settings_override_detection_raw_first():
    chat = facts("mlx-community/Llama-2-7b-chat-4-bit")
    assert choose_format(FormatRequest(format="mistral", format_source="command line"), chat).line() == \
        "prompt format mistral (chat.format, command line)"
    by_file = choose_format(FormatRequest(format="chatml", template="t.jinja", template_source="command line"), chat)
    assert (by_file.name, by_file.template_file) == ("template", "t.jinja") and "t.jinja" in by_file.reason
    raw = choose_format(FormatRequest(format="chatml", template="t.jinja", raw=True, raw_source="command line"), chat)
    assert raw.name == "raw" and "chat.raw" in raw.reason


def test_facts_from_the_files_agree_with_the_loaded_tokenizer(llama2_chat, chatml_chat):
    """--show-config reads the files; a session reads the loaded tokenizer: same choice."""
    for folder, lm in (llama2_chat, chatml_chat):
        files = RepoFacts.from_folder(lm.model_id, folder)
        loaded = RepoFacts.from_tokenizer(lm.model_id, lm.config, lm.tokenizer)
        assert (files.has_chat_template, files.chatml_tokens) == (loaded.has_chat_template, loaded.chatml_tokens)
        assert detect_format(files) == detect_format(loaded)


def test_format_keys_name_the_exact_rendering(llama2_chat):
    _, lm = llama2_chat
    assert [make_format(n, lm.tokenizer).key for n in ("llama-2", "mistral", "plain", "raw")] == \
        ["llama-2", "mistral", "plain", "raw"]
    a = make_format("template", lm.tokenizer, "{{ messages[0].content }}", source="a.jinja")
    b = make_format("template", lm.tokenizer, "{{ messages[-1].content }}", source="a.jinja")
    assert a.key.startswith("template:") and a.key != b.key
    assert a.key == make_format("template", lm.tokenizer, "{{ messages[0].content }}", source="b.jinja").key


# ---- snapshots -------------------------------------------------------------------------------------------
def test_snapshot_records_the_format_and_another_format_reprefills(llama2_chat, tmp_path):
    from chatapp.store.chat import ModelIdentity, open_chat
    from chatapp.store.paths import snapshot_path
    from chatapp.store.snapshot import read_snapshot

    folder, lm = llama2_chat
    ident = ModelIdentity.from_loaded(lm, str(folder))
    with open_chat(session_from_config(config_for(folder), lm), ident, tmp_path) as chat:
        run_turn(chat.send(QUESTIONS[0]))
        cid = chat.conversation_id
    assert read_snapshot(snapshot_path(tmp_path, cid)).prompt_format == "llama-2"

    with open_chat(session_from_config(config_for(folder), lm), ident, tmp_path, resume=cid) as same:
        assert same.resume_info.source == "snapshot"
        held = same.resume_info.snapshot_tokens
        done = run_turn(same.send(QUESTIONS[1]))
        assert done.stats.reused_tokens == held  # the previous prompt, reply and </s>

    other = open_chat(session_from_config(config_for(folder, **{"chat.format": "mistral"}), lm), ident, tmp_path,
                      resume=cid)
    info = other.resume_info
    assert info.source == "transcript"
    assert info.reason == "it was made with the llama-2 prompt format, this chat uses mistral"
    [note] = other.take_notes()
    assert "\n" not in note.text and info.reason in note.text
    done = run_turn(other.send(QUESTIONS[2]))
    assert done.stats.reused_tokens == 0 and done.text == REPLY  # re-prefilled in the mistral format
    other.close()


# ---- --chat-template FILE ------------------------------------------------------------------------------
def test_chat_template_file_renders_through_the_tokenizer(llama2_chat, tmp_path):
    folder, lm = llama2_chat
    text = ("{{ bos_token }}{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")
    tpl = tmp_path / "chat.jinja"
    tpl.write_text(text)
    s = session_from_config(config_for(folder, **{"chat.template": str(tpl)}), lm)
    assert s.format.name == "template" and str(tpl) in s.format_choice.reason
    conv = dialog_conversation()
    assert s.format.text(conv).startswith("<s><system>Always answer with  care.\n<user>")
    assert s.format.tokens(conv) == list(lm.tokenizer.apply_chat_template(
        as_dicts(conv), chat_template=text, tokenize=True, add_generation_prompt=True))


@pytest.mark.parametrize("text, line, words", [
    ("{% for m in messages %}\n{{ m.content }\n{% endfor %}", 2, "unexpected '}'"),
    ("{% for m in messages %}\n\n{% if m.role == 'system' %}{{ raise_exception('no system prompt here') }}"
     "{% endif %}{% endfor %}", 3, "no system prompt here"),
], ids=["syntax", "raise_exception"])
def test_a_template_that_fails_is_one_line_naming_file_and_line(llama2_chat, tmp_path, text, line, words):
    folder, lm = llama2_chat
    tpl = tmp_path / "broken.jinja"
    tpl.write_text(text)
    with pytest.raises(SetupError) as err:
        session_from_config(config_for(folder, **{"chat.template": str(tpl)}), lm)
    message = str(err.value)
    assert "\n" not in message and f"{tpl}, line {line}: " in message and words in message


def test_a_missing_template_file_is_said_before_the_model_loads(tmp_path):
    config = load_config(overrides={"model.id": str(tmp_path / "no-model"), "chat.template": str(tmp_path / "t.j")})
    with pytest.raises(SetupError, match=f"^chat template {tmp_path / 't.j'}: no such file$"):
        load_engine(config)


def test_a_format_the_tokenizer_cannot_serve_is_one_line(llama2_chat):
    folder, lm = llama2_chat
    for name, words in (("chatml", "needs the tokens <|im_start|> and <|im_end|>"), ("template", "has none")):
        with pytest.raises(SetupError) as err:
            session_from_config(config_for(folder, **{"chat.format": name}), lm)
        assert words in str(err.value) and "\n" not in str(err.value)


def test_an_unknown_format_name_is_a_one_line_config_error(capsys):
    with pytest.raises(ConfigError) as err:
        load_config(overrides={"chat.format": "llama2"})
    assert "chat.format" in str(err.value) and '"llama-2"' in str(err.value)
    assert main(["--chat-format", "llama2", "--show-config"]) == 2
    err_lines = capsys.readouterr().err.splitlines()
    assert len(err_lines) == 1 and err_lines[0].startswith("chatapp: config error: command line: chat.format")


# ---- where the choice shows -----------------------------------------------------------------------------
def test_show_config_says_the_format_and_why(llama2_chat, tmp_path, monkeypatch, capsys):
    folder, _ = llama2_chat
    assert main(["--show-config", "--model", str(folder)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert any(ln.startswith("chat.format") and '"auto"' in ln for ln in out)
    assert out[-1] == ("# prompt format llama-2 (no chat template; the model id Llama-2-7b-chat-4-bit matches "
                       "*llama-2*chat*)")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    assert main(["--show-config", "--model", "mlx-community/Llama-2-7b-chat-4-bit"]) == 0
    assert capsys.readouterr().out.splitlines()[-1].startswith(
        "# prompt format: chosen when mlx-community/Llama-2-7b-chat-4-bit is downloaded")
    assert main(["--show-config", "--model", "mlx-community/x", "--chat-format", "chatml"]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == "# prompt format chatml (chat.format, command line)"


def run_chatapp(args: list[str], tmp_path: Path) -> subprocess.CompletedProcess:
    import os

    env = dict(os.environ, PYTHONPATH=str(REPO), HF_HUB_OFFLINE="1", CHATAPP_DATA_DIR=str(tmp_path / "data"))
    return subprocess.run([sys.executable, "-m", "chatapp", *args], capture_output=True, text=True, env=env,
                          cwd=tmp_path, timeout=300)


def test_cli_verbose_names_the_format_and_a_broken_template_is_one_line(llama2_chat, tmp_path):
    folder, _ = llama2_chat
    ok = run_chatapp(["--no-tui", "-m", str(folder), "-p", "Hello there", "--temp", "0", "--verbose"], tmp_path)
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.strip() == REPLY
    assert "chatapp: prompt format llama-2 (no chat template; the model id Llama-2-7b-chat-4-bit matches " in ok.stderr
    tpl = tmp_path / "broken.jinja"
    tpl.write_text("{% for m in messages %}\n{{ m.content | nosuchfilter }}{% endfor %}")
    bad = run_chatapp(["--no-tui", "-m", str(folder), "-p", "Hello", "--chat-template", str(tpl)], tmp_path)
    assert bad.returncode == 2 and bad.stdout == ""
    lines = bad.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in bad.stderr, bad.stderr
    assert lines[0].startswith("chatapp: error: the chat template does not render: ") and f"{tpl}, line 2" in lines[0]
