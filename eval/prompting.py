"""Prompt frames for generation-scored tasks: plain text or the tokenizer's chat template.

Every retrieval prompt (passkey, RULER, NIAH) is built in tokens so its length is exact::

    plain:  [BOS]        USER                          ANSWER_PREFIX
    chat:   CHAT_HEAD    USER    CHAT_TAIL             ANSWER_PREFIX

``USER`` is the task text (instructions, haystack with its needles, question); ``ANSWER_PREFIX``
starts the answer (``The pass key is``), as lm-eval's ``gen_prefix`` does. ``CHAT_HEAD`` /
``CHAT_TAIL`` are the chat template rendered around a one-message conversation (system text, user
header; end of the user turn, assistant header): the template's own tokens, found by rendering it
once around a sentinel, so the user text between them can be any token ids.
Instruction-tuned models (SmolLM2-135M-Instruct, Gemma's -it) often answer retrieval questions
only inside their template.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from retrofit.errors import DataError
from retrofit.eval.windows import encode

CHAT_POLICIES = ("auto", "on", "off")
_SENTINEL = "RETROFITPROMPTSENTINEL"


def has_chat_template(tokenizer: Any) -> bool:
    """Whether the tokenizer carries a chat template."""
    return bool(getattr(tokenizer, "chat_template", None))


def use_chat_template(tokenizer: Any, policy: str = "auto") -> bool:
    """``auto``: on when the tokenizer has a chat template; ``on`` (one is required) / ``off``."""
    if policy not in CHAT_POLICIES:
        raise DataError(f"chat template policy {policy!r} is not one of {', '.join(CHAT_POLICIES)}")
    if policy == "off":
        return False
    if policy == "on" and not has_chat_template(tokenizer):
        raise DataError("--chat-template on, but the tokenizer has no chat template")
    return has_chat_template(tokenizer)


@dataclass(frozen=True)
class Frame:
    """Token ids around a prompt's user text: ``head + user + tail + answer_prefix``.

    head: ``[BOS]`` (or nothing) in plain mode, the chat template's opening in chat mode (with BOS
    when the model uses it and the template does not write it). tail: nothing in plain mode, the
    end of the user turn and the assistant header in chat mode.
    """

    head: list[int] = field(default_factory=list)
    tail: list[int] = field(default_factory=list)
    chat: bool = False

    def __len__(self) -> int:
        return len(self.head) + len(self.tail)


def build_frame(tokenizer: Any, *, chat: bool, bos_id: int | None, system: str | None = None) -> Frame:
    """The frame of a plain prompt (``[BOS]``) or of one chat turn (``system`` text, if given, as a
    system message, or in front of the user text where the template refuses a system role)."""
    if not chat:
        return Frame(head=[bos_id] if bos_id is not None else [], tail=[], chat=False)
    text = _render(tokenizer, system)
    if text.count(_SENTINEL) != 1:
        raise DataError("the chat template does not place the user message exactly once; use --chat-template off")
    head_text, tail_text = text.split(_SENTINEL)
    head, tail = encode(tokenizer, head_text), encode(tokenizer, tail_text)
    if bos_id is not None and (not head or head[0] != bos_id):
        head = [bos_id] + head
    return Frame(head=head, tail=tail, chat=True)


def _render(tokenizer: Any, system: str | None) -> str:
    user = {"role": "user", "content": _SENTINEL}
    if system:
        try:
            return tokenizer.apply_chat_template([{"role": "system", "content": system}, user],
                                                 tokenize=False, add_generation_prompt=True)
        except Exception:  # templates that refuse a system role: the system text opens the user turn
            user = {"role": "user", "content": f"{system}\n\n{_SENTINEL}"}
    return tokenizer.apply_chat_template([user], tokenize=False, add_generation_prompt=True)


def answer_prefix_ids(tokenizer: Any, frame: Frame, prefix: str) -> list[int]:
    """Tokens of the answer's opening words: after a space in plain mode (lm-eval's delimiter
    between a question and its ``gen_prefix``), right after the assistant header in chat mode."""
    if not prefix:
        return []
    return encode(tokenizer, prefix.strip() if frame.chat else " " + prefix.strip())
