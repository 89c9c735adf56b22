"""Chat templates (kvexport/chat.py) render exactly as transformers' apply_chat_template, and travel
in the artifact as a listed, hashed tokenizer file."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from kvexport.chat import ChatTemplate
from kvexport.errors import InputError
from kvexport.zoo import TINY_CONFIGS, write_checkpoint

CHATML = (
    "{%- if messages[0]['role'] == 'system' %}{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{%- endif %}\n"
    "{%- for message in messages %}{%- if message.role == 'user' or (message.role == 'system' and not loop.first) "
    "or message.role == 'assistant' %}{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}"
    "{%- endif %}{%- endfor %}\n"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}\n"
)

LLAMA3 = """{{- bos_token }}
{%- if not date_string is defined %}
    {%- set date_string = strftime_now("%d %b %Y") %}
{%- endif %}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}
{{- "Cutting Knowledge Date: December 2023\\n" }}
{{- "Today Date: " + date_string + "\\n\\n" }}
{{- system_message }}
{{- "<|eot_id|>" }}
{%- for message in messages %}
    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim + '<|eot_id|>' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""

MISTRAL = """{{- bos_token }}
{%- for message in messages %}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}
        {{- raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}
    {%- endif %}
    {%- if message['role'] == 'user' %}
        {{- '[INST] ' + message['content'] + ' [/INST]' }}
    {%- elif message['role'] == 'assistant' %}
        {{- ' ' + message['content'] + eos_token}}
    {%- else %}
        {{- raise_exception('Only user and assistant roles are supported!') }}
    {%- endif %}
{%- endfor %}
"""

# no whitespace control dashes: trim_blocks/lstrip_blocks decide the output; namespace, tojson, break
BLOCKS = """{% set ns = namespace(n=0, last='') %}
{% for m in messages %}
    {% if m.role == 'system' %}
<<SYS>>{{ m.content | tojson }}<</SYS>>
    {% else %}
{% set ns.n = ns.n + 1 %}
{{ ns.n }}. {{ m.role }}: {{ m.content }} {{ dict(a=1) | tojson }}
    {% endif %}
    {% if loop.index >= 6 %}{% break %}{% endif %}
{% endfor %}
{% if add_generation_prompt %}
assistant ({{ ns.n }} turns, "quoted" <tag> & more):
{% endif %}
"""

TEMPLATES = {"chatml": CHATML, "llama3": LLAMA3, "mistral": MISTRAL, "blocks": BLOCKS}

CONVERSATIONS = [
    [{"role": "user", "content": "Hello!"}],
    [{"role": "system", "content": "  Be brief.  "}, {"role": "user", "content": "What is 2+2?"},
     {"role": "assistant", "content": "4"}, {"role": "user", "content": "And <3*3>?  "}],
    [{"role": "user", "content": "héllo 🌍 \"quotes\" & <b>"}, {"role": "assistant", "content": "hi\n\nthere"},
     {"role": "user", "content": "again"}],
]


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("chat")
    write_checkpoint(TINY_CONFIGS["llama"], d / "ck", seed=1)
    return d / "ck"


def _with_template(src: Path, dest: Path, template: str, as_file: bool) -> Path:
    shutil.copytree(src, dest)
    cfg = json.loads((dest / "tokenizer_config.json").read_text())
    if as_file:
        (dest / "chat_template.jinja").write_text(template)
    else:
        cfg["chat_template"] = template
    (dest / "tokenizer_config.json").write_text(json.dumps(cfg))
    return dest


@pytest.mark.parametrize("name", sorted(TEMPLATES))
@pytest.mark.parametrize("as_file", [False, True])
def test_render_equals_transformers(tok_dir: Path, tmp_path: Path, name: str, as_file: bool) -> None:
    transformers = pytest.importorskip("transformers")
    folder = _with_template(tok_dir, tmp_path / name, TEMPLATES[name], as_file)
    ref = transformers.AutoTokenizer.from_pretrained(str(folder))
    ours = ChatTemplate.from_folder(folder)
    assert ours is not None
    checked = 0
    for conv in CONVERSATIONS:
        for gen in (True, False):
            try:
                want = ref.apply_chat_template(conv, tokenize=False, add_generation_prompt=gen)
            except Exception as e:  # the template refuses (Mistral: a system turn); so must ours
                with pytest.raises(InputError, match="alternate|Only user"):
                    ours.render(conv, add_generation_prompt=gen)
                assert "alternate" in str(e) or "Only user" in str(e)
                continue
            got = ours.render(conv, add_generation_prompt=gen)
            assert got == want, f"{name}: {got!r} != {want!r}"
            assert ref(got, add_special_tokens=False)["input_ids"] == list(
                ref.backend_tokenizer.encode(got, add_special_tokens=False).ids)
            checked += 1
    assert checked >= 4


def test_sandbox_refuses_escapes() -> None:
    """The environment is sandboxed like transformers': no attribute access to Python internals."""
    t = ChatTemplate("{{ messages.__class__.__mro__ }}")
    with pytest.raises(Exception, match="unsafe|not safely|access"):
        t.render([{"role": "user", "content": "x"}])
    t = ChatTemplate("{% set ns = namespace() %}{% set ns._x = 1 %}{{ 1 }}")
    with pytest.raises(Exception, match="underscore|cannot set"):
        t.render([{"role": "user", "content": "x"}])


def test_template_travels_in_artifact(tok_dir: Path, tmp_path: Path) -> None:
    """chat_template.jinja is copied into the artifact, listed with its sha256, and load accepts it."""
    import kvexport
    from kvexport.build import build
    from kvexport.chat import engine_template

    folder = _with_template(tok_dir, tmp_path / "ck", CHATML, as_file=True)
    out = build(folder, tmp_path / "m.kvx", target="cpu", max_seq=64, verify=False)
    m = json.loads((out / "manifest.json").read_text())
    assert "chat_template.jinja" in m["tokenizer"]["files"]
    assert "chat_template.jinja" in m["files"]
    engine = kvexport.load(out)  # the integrity check refuses unlisted files
    t = engine_template(engine)
    assert t is not None and t.source == CHATML
