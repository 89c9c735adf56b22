"""Chat templates: the checkpoint's own, rendered the way `transformers`' apply_chat_template does.

The template travels in the artifact as a tokenizer file: `chat_template.jinja` (preferred, as in
transformers) or the `chat_template` key of tokenizer_config.json. It renders in jinja2's
ImmutableSandboxedEnvironment with trim_blocks and lstrip_blocks, the loopcontrols extension, a
`tojson` that does not escape HTML, and the globals `raise_exception`, `strftime_now`, `dict` and
`namespace`; the special tokens of tokenizer_config.json (bos_token, eos_token, ...) are template
variables, and the rendered text is tokenized without adding special tokens (the template writes
them). `transformers` is not needed at run time; tests compare the two renderings.
"""
from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

from kvexport.errors import InputError

TEMPLATE_FILE = "chat_template.jinja"
CONFIG_FILE = "tokenizer_config.json"
# transformers' SPECIAL_TOKENS_ATTRIBUTES: what apply_chat_template passes to the template
SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


def _token_text(v: Any) -> str | None:
    if isinstance(v, str):
        return v
    if isinstance(v, Mapping) and isinstance(v.get("content"), str):  # a serialized AddedToken
        return str(v["content"])
    return None


def _select(template: Any) -> str | None:
    """tokenizer_config's chat_template: a string, or named templates (the one named 'default')."""
    if isinstance(template, str):
        return template
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, Mapping)}
        chosen = named.get("default")
        return chosen if isinstance(chosen, str) else None
    if isinstance(template, Mapping):
        chosen = template.get("default")
        return chosen if isinstance(chosen, str) else None
    return None


class ChatTemplate:
    def __init__(self, source: str, special_tokens: Mapping[str, str] | None = None):
        self.source = source
        self.special_tokens = dict(special_tokens or {})
        self._template = _compile(source)

    @classmethod
    def from_folder(cls, folder: str | Path, files: Sequence[str] | None = None) -> ChatTemplate | None:
        """The template of a checkpoint or artifact folder (None where it has none). `files`, where
        given, limits the search to those names (an artifact's listed tokenizer files)."""
        folder = Path(folder)

        def present(name: str) -> bool:
            return (files is None or name in files) and (folder / name).is_file()

        cfg: dict[str, Any] = {}
        if present(CONFIG_FILE):
            cfg = json.loads((folder / CONFIG_FILE).read_text(encoding="utf-8"))
        special = {k: t for k in SPECIAL_TOKENS if (t := _token_text(cfg.get(k))) is not None}
        if present(TEMPLATE_FILE):
            return cls((folder / TEMPLATE_FILE).read_text(encoding="utf-8"), special)
        source = _select(cfg.get("chat_template"))
        return cls(source, special) if source else None

    def render(self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True,
               **kwargs: Any) -> str:
        """The conversation as the model saw it in training; raises InputError where the template
        refuses the messages (its raise_exception) or the messages are malformed."""
        import jinja2

        if not isinstance(messages, Sequence) or isinstance(messages, str):
            raise InputError("messages must be a list of {role, content} objects")
        for i, m in enumerate(messages):
            if not isinstance(m, Mapping):
                raise InputError(f"messages[{i}] must be an object with role and content")
        data = {**self.special_tokens, **kwargs}
        try:
            return str(self._template.render(messages=[dict(m) for m in messages], tools=None, documents=None,
                                             add_generation_prompt=add_generation_prompt, **data))
        except jinja2.exceptions.TemplateError as e:
            raise InputError(f"the model's chat template refused these messages: {e}") from e


def encode_chat(engine: Any, template: ChatTemplate, messages: Sequence[Mapping[str, Any]], **kwargs: Any) -> list[int]:
    """Rendered conversation -> prompt ids (no special tokens added: the template wrote them)."""
    if engine.tokenizer is None:
        raise InputError("this artifact has no tokenizer.json; chat needs one")
    text = template.render(messages, **kwargs)
    return list(engine.tokenizer.tok.encode(text, add_special_tokens=False).ids)


def engine_template(engine: Any) -> ChatTemplate | None:
    """The chat template an artifact carries (listed in its manifest's tokenizer files)."""
    return ChatTemplate.from_folder(engine.folder, engine.manifest.raw["tokenizer"]["files"])


@lru_cache(maxsize=16)
def _compile(source: str) -> Any:
    try:
        import jinja2
        import jinja2.ext
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError as e:  # pragma: no cover - jinja2 comes with the serve extra
        raise InputError("chat templates need jinja2: pip install 'kvexport[serve]'") from e

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
               sort_keys: bool = False) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt: str) -> str:
        return datetime.now().strftime(fmt)

    class TemplateDict:  # dict() without attribute access to the type itself
        def __call__(self, *args: Any, **kwargs: Any) -> dict:
            return dict(*args, **kwargs)

        def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
            return dict.fromkeys(*args, **kwargs)

    class TemplateNamespace(jinja2.utils.Namespace):  # no underscore-prefixed attributes
        def __init__(*args: Any, **kwargs: Any) -> None:
            self, rest = args[0], args[1:]
            attrs = dict(*rest, **kwargs)
            for name in attrs:
                TemplateNamespace._check(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name: str, value: Any) -> None:
            TemplateNamespace._check(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check(name: Any) -> None:
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(f"chat templates cannot set {name!r} on a namespace")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    env.globals["dict"] = TemplateDict()
    env.globals["namespace"] = TemplateNamespace
    try:
        return env.from_string(source)
    except jinja2.exceptions.TemplateSyntaxError as e:
        raise InputError(f"the chat template does not compile: {e}") from e


def run_chat_ids(engine: Any, prompt: str, history: str | Path | None = None) -> list[int]:
    """`kvexport run --chat`: the earlier turns of `history` (a JSON file holding a list of
    {role, content}, as the OpenAI API takes them) plus `prompt` as the user's next message."""
    template = engine_template(engine)
    if template is None:
        raise InputError(f"{engine.folder} carries no chat template (the checkpoint had no chat_template in "
                         "tokenizer_config.json and no chat_template.jinja): run without --chat and --messages, "
                         "and the prompt goes in as plain text")
    messages: list[dict[str, Any]] = []
    if history is not None:
        try:
            messages = json.loads(Path(history).read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            raise InputError(f"--messages {history}: not a readable JSON file ({e})") from e
        if not isinstance(messages, list) or not all(isinstance(m, dict) and "role" in m for m in messages):
            raise InputError(f"--messages {history} must hold a JSON list of {{role, content}} objects")
    return encode_chat(engine, template, [*messages, {"role": "user", "content": prompt}])
