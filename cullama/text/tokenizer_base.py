"""What every tokenizer shares: the interface (TokenizerBase: the fit to a model, chat prompts, id checks),
tokenizer_config.json's special tokens, and LLaMA-2's chat format for a checkpoint without a chat template.
The tokenizers themselves: tokenizer.py (SentencePiece, and which file a checkpoint's tokenizer is) and
tokenizer_json.py (HuggingFace's tokenizer.json)."""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

from ..common.errors import OptionError, PromptError, TokenizerError, option
from ..common.untrusted import shown
from .chat_template import ChatTemplate

# Meta's LLaMA-2 chat markers (llama/generation.py); they are plain text, BOS/EOS are ids.
B_INST, E_INST = "[INST]", "[/INST]"
B_SYS, E_SYS = "<<SYS>>\n", "\n<</SYS>>\n\n"
# tokenizer_config.json's special tokens, which a chat template sees as variables of these names
SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
ROLES = ("system", "user", "assistant")


def special_tokens(config: Mapping, config_file: Path | str) -> dict[str, str]:
    """tokenizer_config.json's special tokens ({"bos_token": "<s>", ...}); a token may be written as a string
    or as transformers' AddedToken object ({"content": "<s>", ...}); null or absent is none."""
    out = {}
    for key in SPECIAL_TOKEN_KEYS:
        value = config.get(key)
        if isinstance(value, dict):
            value = value.get("content")
        if value is None:
            continue
        if not isinstance(value, str):
            raise TokenizerError(f"{config_file}: {key} must be a string, got {shown(value, quote=True)}")
        if not _is_unicode(value):  # JSON's "\ud800": a chat template would print it, no tokenizer reads it
            raise TokenizerError(f"{config_file}: {key} {shown(value, quote=True)} is not valid Unicode (it holds a "
                                 "lone surrogate)")
        out[key] = value
    return out


class TokenizerBase:
    """What every tokenizer has beside encoding and decoding: the fit to a model, chat prompts, id checks.
    A tokenizer sets path, vocab_size, template and special_tokens, and has encode, encode_rendered, decode,
    piece, stream_decoder and eos_ids."""

    path: Path
    vocab_size: int  # ids 0 .. vocab_size - 1
    template: ChatTemplate | None = None  # the checkpoint's chat template; None: LLaMA-2's format
    special_tokens: dict[str, str]  # what the template sees as bos_token, eos_token, ...

    def check_fits(self, model_vocab_size: int, model: str = "the model") -> None:
        """TokenizerError unless every piece has a row in the model's embedding and lm_head: a larger
        tokenizer would hand the model ids past its vocabulary. (A model with more rows than pieces is
        fine: some checkpoints pad their vocabulary, and the ids past the pieces are never sampled.)"""
        if self.vocab_size > model_vocab_size:
            raise TokenizerError(f"{self.path} has {self.vocab_size} pieces but {model} has a vocabulary of "
                                 f"{model_vocab_size}: they do not belong together (name the model's own "
                                 f"tokenizer with {option('tokenizer')})")

    def chat_ids(self, messages: Sequence[dict], system: str | None = None, tools: list | None = None) -> list[int]:
        """Prompt ids for a chat, ready for the assistant's reply: the checkpoint's chat template rendered as
        transformers' apply_chat_template(messages, tools=tools, add_generation_prompt=True) renders it, and its
        text tokenized with the special tokens it spells; without a template, LLaMA-2's format, built exactly as
        Meta's `chat_completion` builds it: each finished (user, assistant) exchange is
        `<s>[INST] u [/INST] a </s>`, the last user turn `<s>[INST] u [/INST]`, a system prompt folded into
        the first user turn. With a template that reads them, an assistant message may carry `tool_calls`
        (OpenAI's: each {"function": {"name", "arguments"}}, the arguments a dict or its JSON text) and a `tool`
        message a call's result (`tool_call_id`, `name`); `tools` (OpenAI's tool definitions) go to the template
        as they are."""
        if self.template is not None:
            chat = _checked_chat(messages, system, self.template)
            if not any(m["role"] == "user" for m in chat):
                raise PromptError("chat has no user message")
            return self.encode_rendered(self.template.render(chat, self.special_tokens, tools))
        if tools:
            raise PromptError("tools need the model's chat template, and this model has none (LLaMA-2's format has "
                              "no tool calls)")
        turns = _chat_turns(messages, system)
        ids: list[int] = []
        for user, answer in zip(turns[:-1:2], turns[1::2]):
            ids += self.encode(f"{B_INST} {user.strip()} {E_INST} {answer.strip()} ", eos=True)
        ids += self.encode(f"{B_INST} {turns[-1].strip()} {E_INST}")
        return ids

    def _checked(self, ids: Iterable[int]) -> list[int]:
        # A model whose vocabulary is larger than the tokenizer's (some fine-tunes add pieces, some pad)
        # can hand it an id it has no text for: say so in one line.
        out = [int(i) for i in ids]
        for i in out:
            if not 0 <= i < self.vocab_size:
                size = self.vocab_size
                raise TokenizerError(f"token id {i} is outside {self.path} ({size} pieces)")
        return out


def _checked_chat(messages: Sequence[dict], system: str | None, template: ChatTemplate | None = None) -> list[dict]:
    """The messages as fresh {"role", "content"} dicts, checked: a list of dicts with a known role and a string
    content, a system prompt first and once (the `system` argument becomes message 0). With a `template` that reads
    them, an assistant turn's tool calls (its content may then be None) and `tool` messages too."""
    if not isinstance(messages, Sequence) or isinstance(messages, (str, bytes)):
        raise PromptError(f"chat messages must be a list of dicts, got {type(messages).__name__}")
    if system is not None and not isinstance(system, str):
        raise OptionError("system", f"must be a string (the system prompt) or None, got {type(system).__name__}")
    if system is not None and not _is_unicode(system):
        raise PromptError("the system prompt is not valid Unicode (it holds a lone surrogate)")
    chat = [] if system is None else [{"role": "system", "content": system}]
    for i, message in enumerate(messages):
        role = message.get("role") if isinstance(message, dict) else None
        content = message.get("content") if isinstance(message, dict) else None
        calls = message.get("tool_calls") if isinstance(message, dict) else None
        if isinstance(content, str) and not _is_unicode(content):  # a lone surrogate: no tokenizer encodes it
            raise PromptError(f"message {i} is not valid Unicode (it holds a lone surrogate)")
        if role == "tool" or calls:
            chat.append(_tool_message(i, message, template))
            continue
        if role not in ROLES or not isinstance(content, str):
            raise PromptError(
                f"message {i} must be {{'role': 'system'|'user'|'assistant', 'content': str}}, "
                f"got role {role!r} and content of type {type(content).__name__}"
            )
        if role == "system" and i != 0:
            raise PromptError(f"message {i} has role 'system'; only the first message may")
        if role == "system" and system is not None:
            raise PromptError("system prompt given twice: as system= and as message 0")
        chat.append({"role": role, "content": content})
    return chat


def _is_unicode(text: str) -> bool:
    """Whether `text` is valid Unicode: no lone UTF-16 surrogate, which Python's strings may hold and JSON may
    spell ("\\ud800"), but which no tokenizer takes."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _tool_message(i: int, message: dict, template: ChatTemplate | None) -> dict:
    """An assistant turn that called tools, or a tool's result, as the template reads it (the calls' arguments as
    dicts, as transformers' templates take them); PromptError where the template cannot hold it."""
    role, content = message.get("role"), message.get("content")
    where = template.source if template is not None else "LLaMA-2's chat format"
    if role == "tool":
        if template is None or not template.supports("tool"):
            raise PromptError(f"message {i} has role 'tool' (a tool call's result), which {where} does not hold")
        if not isinstance(content, str):
            raise PromptError(f"message {i}: a tool message's content must be a string, got {type(content).__name__}")
        out = {"role": "tool", "content": content}
        for key in ("tool_call_id", "name"):
            if isinstance(message.get(key), str):
                out[key] = message[key]
        return out
    if role != "assistant":
        raise PromptError(f"message {i} has tool_calls: only an assistant message may")
    if template is None or not template.supports("tool_calls"):
        raise PromptError(f"message {i} holds tool calls, which {where} does not hold")
    if content is not None and not isinstance(content, str):
        raise PromptError(f"message {i}: content must be a string or None, got {type(content).__name__}")
    calls = message["tool_calls"]
    if not isinstance(calls, (list, tuple)):
        raise PromptError(f"message {i}: tool_calls must be a list, got {type(calls).__name__}")
    checked = []
    for j, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        name = function.get("name") if isinstance(function, dict) else None
        arguments = function.get("arguments") if isinstance(function, dict) else None
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except ValueError:
                arguments = None
        if not isinstance(name, str) or not isinstance(arguments, dict):
            raise PromptError(f"message {i}: tool call {j} must be {{'function': {{'name': str, 'arguments': a JSON "
                              "object (or its text)}}}}")
        checked.append({"id": call.get("id") if isinstance(call.get("id"), str) else f"call_{j}", "type": "function",
                        "function": {"name": name, "arguments": arguments}})
    return {"role": "assistant", "content": content, "tool_calls": checked}


def _chat_turns(messages: Sequence[dict], system: str | None) -> list[str]:
    """LLaMA-2's contents: user, assistant, ..., user, with the system prompt merged into the first."""
    chat = _checked_chat(messages, system)
    if chat and chat[0]["role"] == "system":
        system, chat = chat[0]["content"], chat[1:]
    first = len(messages) - len(chat)  # the index in `messages` of chat[0]
    contents: list[str] = []
    for i, message in enumerate(chat, start=first):
        expected = "user" if len(contents) % 2 == 0 else "assistant"
        if message["role"] != expected:
            raise PromptError(
                f"message {i} has role {message['role']!r} where {expected!r} was expected "
                "(turns alternate user, assistant, ..., starting with user)"
            )
        contents.append(message["content"])
    if not contents:
        raise PromptError("chat has no user message")
    if len(contents) % 2 == 0:
        raise PromptError("the last chat message must have role 'user', not 'assistant'")
    if system is not None:
        contents[0] = B_SYS + system + E_SYS + contents[0]
    return contents
