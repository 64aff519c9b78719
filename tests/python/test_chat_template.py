"""Our chat template renderer against Hugging Face's Jinja rendering.

HF (transformers' `apply_chat_template`) renders a model's chat template with
`jinja2` (`trim_blocks`, `lstrip_blocks`, loop controls, `raise_exception`,
`strftime_now`, a `tojson` that is `json.dumps(ensure_ascii=False)`), passing
`messages`, `add_generation_prompt`, `tools=None`, `documents=None` and the
special tokens. The reference here renders the same template text, read from
the same GGUF with the PyPI `gguf` package, that way; ours comes from
`rngd-pd-bench chat-render` (the engine's renderer, the one the worker, the
gateway and the picker use). They must be equal byte for byte, for:

- SmolLM2-135M-Instruct's own template (the real model file);
- a Llama 3 template, in the small Llama-3.1 GGUF that `llama3_gguf.py` builds
  (BOS printed by the template while the tokenizer adds BOS: our prompt then
  encodes with exactly one BOS, as vLLM's chat path does);
- a Llama-3.1-style template given with `--chat-template FILE`, which also
  uses `tojson`, `namespace`, loop controls, slicing and Python string methods,
  and refuses chats with `raise_exception`.
"""

import datetime
import json
import os
import subprocess

import gguf
import jinja2
import jinja2.ext
import pytest

from conftest import model_path


def bench_bin():
    b = os.environ.get("RNGD_PD_BENCH_BIN")
    if not b:
        target = os.environ.get("CARGO_TARGET_DIR") or os.path.expanduser("~/.cache/rngd-pd/target")
        b = os.path.join(target, "release", "rngd-pd-bench")
    if not os.path.isfile(b):
        pytest.fail(f"rngd-pd-bench binary not found at {b}: build it with `cargo build --release`")
    return b


class TemplateError(Exception):
    """What the reference's `raise_exception` raises."""


def hf_render(template, messages, bos_token, eos_token):
    """The template rendered as transformers renders chat templates."""

    def raise_exception(message):
        raise TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt):
        # Ours formats the current UTC time.
        return datetime.datetime.now(datetime.timezone.utc).strftime(fmt)

    env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    kwargs = {}
    if bos_token is not None:
        kwargs["bos_token"] = bos_token
    if eos_token is not None:
        kwargs["eos_token"] = eos_token
    return env.from_string(template).render(
        messages=messages, tools=None, documents=None, add_generation_prompt=True, **kwargs
    )


def gguf_chat_setup(path):
    """(template, bos text, eos text, bos id, add_bos) of a GGUF file."""
    r = gguf.GGUFReader(path)

    def field(key):
        f = r.fields.get(key)
        return None if f is None else f.contents()

    tokens = field("tokenizer.ggml.tokens")
    bos_id, eos_id = field("tokenizer.ggml.bos_token_id"), field("tokenizer.ggml.eos_token_id")
    bos = None if bos_id is None else tokens[bos_id]
    eos = None if eos_id is None else tokens[eos_id]
    return field("tokenizer.chat_template"), bos, eos, bos_id, bool(field("tokenizer.ggml.add_bos_token"))


def ours(model, chats, chat_template=None):
    """One dict per chat from `rngd-pd-bench chat-render`."""
    args = [bench_bin(), "chat-render", "--model", str(model)]
    if chat_template:
        args += ["--chat-template", str(chat_template)]
    p = subprocess.run(args, input=json.dumps(chats), capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    lines = [json.loads(line) for line in p.stdout.splitlines()]
    assert len(lines) == len(chats), p.stdout
    return lines


def msg(role, content):
    return {"role": role, "content": content}


CHATS = [
    [msg("user", "Hi")],
    [msg("system", "You are terse."), msg("user", "What is 2+2?")],
    [
        msg("system", "  Padded system prompt.\n"),
        msg("user", "Write a haiku about Rust."),
        msg("assistant", "Borrow checker hums\nlifetimes fold like paper cranes\nno data races"),
        msg("user", "Now one about Python."),
    ],
    [
        msg("user", "Ünïcödé café — 日本語のテキスト, emoji 🚀🔥👍🏽 and a zero-width joiner 👩‍💻"),
        msg("assistant", "Noted: «quotes», \"double\", 'single', back\\slash, tab\tand\r\nCRLF."),
        msg("user", "Template-looking text stays text: {{ messages }} {% if %} {# x #}"),
    ],
    [msg("user", "   leading and trailing whitespace   \n\n")],
    [msg("user", "")],
]


def check_equal(model, chats, template, bos, eos, chat_template=None):
    got = ours(model, chats, chat_template)
    for chat, g in zip(chats, got):
        want = hf_render(template, chat, bos, eos)
        assert "error" not in g, (chat, g)
        assert g["rendered"] == want, (chat, g["rendered"], want)
    return got


def test_smollm2_template_renders_as_hf_renders_it():
    m = model_path()
    if not os.path.isfile(m):
        pytest.fail(f"model {m} not found: run `rngd-pd model fetch` or set RNGD_PD_MODEL")
    template, bos, eos, _, add_bos = gguf_chat_setup(m)
    assert template and "<|im_start|>" in template
    assert not add_bos
    got = check_equal(m, CHATS, template, bos, eos)
    for g in got:
        # No BOS is added for SmolLM2: the prompt is the template's output.
        assert g["prompt"] == g["rendered"]
        assert g["ids"][0] == 1, "starts with the <|im_start|> control token"
    # The default system prompt appears only when the chat has none.
    assert "named SmolLM" in got[0]["rendered"]
    assert "named SmolLM" not in got[1]["rendered"]


@pytest.fixture(scope="module")
def llama3_model(tmp_path_factory):
    import llama3_gguf

    return llama3_gguf.build(tmp_path_factory.mktemp("llama3") / "llama3-tiny.gguf")


def test_llama3_template_renders_as_hf_and_encodes_with_one_bos(llama3_model):
    template, bos, eos, bos_id, add_bos = gguf_chat_setup(llama3_model)
    assert template and template.lstrip().startswith("{{- bos_token }}")
    assert bos == "<|begin_of_text|>" and add_bos
    got = check_equal(llama3_model, CHATS, template, bos, eos)
    for g in got:
        assert g["rendered"].startswith(bos)
        # The tokenizer adds BOS itself, so the prompt leaves the template's out.
        assert g["prompt"] == g["rendered"][len(bos):]
        assert g["ids"][0] == bos_id
        assert g["ids"].count(bos_id) == 1, g["ids"][:8]
    # A role the template does not know is refused with its message.
    [bad] = ours(llama3_model, [[msg("critic", "x")]])
    assert "unsupported role critic" in bad["error"]
    with pytest.raises(TemplateError, match="unsupported role critic"):
        hf_render(template, [msg("critic", "x")], bos, eos)


# A Llama-3.1-style template using more of what HF templates use.
LLAMA31_STYLE = """{{- bos_token }}
{%- if not date_string is defined %}
    {%- set date_string = strftime_now("%d %b %Y") %}
{%- endif %}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content'].strip() %}
    {%- set loop_messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
    {%- set loop_messages = messages %}
{%- endif %}
{%- set ns = namespace(turns=0, last_role=none) %}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}
{{- "Cutting Knowledge Date: December 2023\\n" }}
{{- "Today Date: " + date_string + "\\n\\n" }}
{%- if tools is not none %}
    {{- tools | tojson(indent=4) }}
{%- endif %}
{{- system_message }}
{{- "<|eot_id|>" }}
{%- for message in loop_messages %}
    {%- if message.role == ns.last_role %}
        {{- raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif %}
    {%- set ns.last_role = message.role %}
    {%- if message.content.startswith("#skip") %}
        {%- continue %}
    {%- endif %}
    {%- set ns.turns = ns.turns + 1 %}
    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}
    {%- if loop.index > 6 %}
        {%- break %}
    {%- endif %}
{%- endfor %}
{%- if loop_messages | length > 1 %}
    {{- "<!-- last: " + (loop_messages | last | tojson) + ", words: " + (loop_messages[-1].content.split() | length) | string + ", turns: " + ns.turns | string + " -->" }}
{%- endif %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""


def test_chat_template_file_overrides_the_models(tmp_path, llama3_model):
    f = tmp_path / "llama31-style.jinja"
    f.write_text(LLAMA31_STYLE)
    _, bos, eos, bos_id, _ = gguf_chat_setup(llama3_model)
    chats = CHATS + [
        [msg("user", "#skip this one"), msg("assistant", "ok"), msg("user", "and this is counted")],
        [msg("user" if i % 2 == 0 else "assistant", f"turn {i}") for i in range(10)],
    ]
    got = check_equal(llama3_model, chats, LLAMA31_STYLE, bos, eos, chat_template=f)
    assert all(g["ids"].count(bos_id) == 1 for g in got)
    assert "turns: 2 -->" in got[-2]["rendered"], "the #skip message is not counted"
    assert "turn 7" not in got[-1]["rendered"], "the loop stops after 7 turns"
    # The same file on SmolLM2 (no BOS added there: the template's stays).
    m = model_path()
    if not os.path.isfile(m):
        pytest.fail(f"model {m} not found: run `rngd-pd model fetch` or set RNGD_PD_MODEL")
    _, sbos, seos, _, _ = gguf_chat_setup(m)
    for g in check_equal(m, chats[:3], LLAMA31_STYLE, sbos, seos, chat_template=f):
        assert g["prompt"] == g["rendered"]
    # Roles that do not alternate: refused by both, with the template's message.
    bad = [msg("user", "a"), msg("user", "b")]
    [b] = ours(llama3_model, [bad], chat_template=f)
    assert "Conversation roles must alternate" in b["error"]
    with pytest.raises(TemplateError, match="Conversation roles must alternate"):
        hf_render(LLAMA31_STYLE, bad, bos, eos)


def test_a_template_that_does_not_compile_is_refused_at_load(tmp_path):
    m = model_path()
    for text, needle in [("{% for m in messages %}", "does not compile"), ("{{ messages | shout }}", "shout")]:
        f = tmp_path / "bad.jinja"
        f.write_text(text)
        p = subprocess.run(
            [bench_bin(), "chat-render", "--model", m, "--chat-template", str(f)],
            input="[]",
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert p.returncode != 0
        assert needle in p.stderr and "bad.jinja" in p.stderr, p.stderr


def test_a_worker_serves_the_override_template_and_name(tmp_path):
    """`rngd-pd worker --chat-template F --served-model-name N`: the chat's
    prompt tokens are those of F's rendering, N is the name served, and a chat
    the template refuses is a 400 carrying the template's message."""
    import requests

    from conftest import start_worker

    f = tmp_path / "llama31-style.jinja"
    f.write_text(LLAMA31_STYLE)
    chat = CHATS[2]
    [want] = ours(model_path(), [chat], chat_template=f)
    proc, addr = start_worker("solo", "--chat-template", str(f), "--served-model-name", "my-smol")
    try:
        models = requests.get(f"http://{addr}/v1/models", timeout=30).json()
        assert [m["id"] for m in models["data"]] == ["my-smol"]
        r = requests.post(
            f"http://{addr}/v1/chat/completions",
            json={"model": "my-smol", "messages": chat, "max_tokens": 1, "temperature": 0},
            timeout=120,
        )
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["model"] == "my-smol"
        assert body["usage"]["prompt_tokens"] == len(want["ids"])
        r = requests.post(
            f"http://{addr}/v1/chat/completions",
            json={"model": "my-smol", "messages": [msg("user", "a"), msg("user", "b")], "max_tokens": 1},
            timeout=120,
        )
        assert r.status_code == 400, r.text
        assert "Conversation roles must alternate" in r.json()["error"]["message"]
    finally:
        proc.stop()


def test_model_directory_and_bad_template_at_worker_check(tmp_path):
    """`--model DIR` takes the one .gguf in it (several: an error naming them);
    a template that does not compile fails `--check`, naming the file."""
    from conftest import rngd_bin

    m = model_path()
    d = tmp_path / "models"
    d.mkdir()
    os.symlink(m, d / "only.gguf")

    def check(*args):
        return subprocess.run([rngd_bin(), "worker", "--check", *args], capture_output=True, text=True, timeout=120)

    ok = check("--model", str(d))
    assert ok.returncode == 0 and ok.stdout.strip() == "ok", ok.stderr
    os.symlink(m, d / "other.gguf")
    two = check("--model", str(d))
    assert two.returncode != 0 and "only.gguf" in two.stderr and "other.gguf" in two.stderr, two.stderr
    bad = tmp_path / "broken.jinja"
    bad.write_text("{% if messages %}")
    p = check("--model", m, "--chat-template", str(bad))
    assert p.returncode != 0 and "broken.jinja" in p.stderr and "does not compile" in p.stderr, p.stderr
