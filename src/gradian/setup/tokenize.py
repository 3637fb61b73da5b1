"""Rendering records as the model sees them: token ids, which of them are supervised, and character offsets.

`messages` records go through the tokenizer's chat template (assistant turns supervised: by `{% generation %}`
tags when the template has them, else by what each assistant message adds to the rendered prefix); string
`prompt`/`completion` and `text` records are plain text, as TRL treats standard-format datasets. Errors are
`DataError`s with the check id `data.tokenize_failed`.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Optional, Sequence

from ..errors import DataError
from .records import EvalItem, Example

TOKENIZE_FAILED = "data.tokenize_failed"


@dataclass
class Tokenized:
    """Token ids, which of them are supervised targets, and character offsets into `text` for span reports."""

    input_ids: list[int]
    supervised: list[bool]
    text: str
    offsets: Optional[list[tuple[int, int]]] = None
    truncated: bool = False
    flags: set[str] = field(default_factory=set)

    @property
    def n_supervised(self) -> int:
        return sum(self.supervised)

    def row_key(self) -> str:
        """Content hash of what the gradient depends on: the tokens and the mask, not the file position."""
        h = hashlib.sha256()
        h.update(json.dumps(self.input_ids).encode())
        h.update(bytes(int(s) for s in self.supervised))
        return h.hexdigest()[:32]


def has_chat_template(tokenizer) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def _has_generation_tags(tokenizer) -> bool:
    tpl = getattr(tokenizer, "chat_template", None) or ""
    if isinstance(tpl, dict):
        tpl = tpl.get("default", "")
    return "generation" in tpl and "endgeneration" in tpl


def _encode_with_offsets(tokenizer, text: str) -> tuple[list[int], Optional[list[tuple[int, int]]]]:
    try:
        enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        return list(enc["input_ids"]), [tuple(o) for o in enc["offset_mapping"]]
    except (NotImplementedError, ValueError, TypeError):  # slow tokenizers have no offsets
        return list(tokenizer(text, add_special_tokens=False)["input_ids"]), None


def _mask_from_char_ranges(offsets, ranges: Sequence[tuple[int, int]]) -> list[bool]:
    out = []
    for s, e in offsets:
        out.append(any(s < re_ and e > rs for rs, re_ in ranges) and e > s)
    return out


def _plain_messages(msgs: list[dict]) -> tuple[str, list[tuple[int, int]]]:
    """Rendering without a chat template: `role: content` lines; assistant contents are the supervised ranges."""
    text, ranges = "", []
    for m in msgs:
        text += f"{m['role']}: "
        if m["role"] == "assistant":
            ranges.append((len(text), len(text) + len(m["content"]) + 1))
        text += m["content"] + "\n"
    return text, ranges


def render_chat(tokenizer, msgs: list[dict]) -> tuple[list[int], list[bool], str, Optional[list[tuple[int, int]]]]:
    """Token ids, assistant-only supervision, rendered text and offsets for a conversation via the chat template."""
    text = tokenizer.apply_chat_template(msgs, tokenize=False)
    ids, offsets = _encode_with_offsets(tokenizer, text)
    if _has_generation_tags(tokenizer):
        enc = tokenizer.apply_chat_template(msgs, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
        t_ids = list(enc["input_ids"])
        mask = [bool(x) for x in enc["assistant_masks"]]
        if t_ids != ids:
            offsets = None  # the template adds tokens the plain encoding does not see; spans fall back to tokens
            ids = t_ids
        return ids, mask, text, offsets
    # No generation tags: assistant turns are what each assistant message adds to the rendered prefix.
    ranges = []
    for i, m in enumerate(msgs):
        if m["role"] != "assistant":
            continue
        before = tokenizer.apply_chat_template(msgs[:i], tokenize=False, add_generation_prompt=True) if i else ""
        upto = tokenizer.apply_chat_template(msgs[: i + 1], tokenize=False)
        if not text.startswith(upto) or not upto.startswith(before):
            raise DataError("the chat template does not render conversations prefix-stably; add {% generation %} tags",
                            check=TOKENIZE_FAILED)
        ranges.append((len(before), len(upto)))
    if offsets is None:
        raise DataError("the tokenizer gives no character offsets; use a fast tokenizer or a template with generation tags",
                        check=TOKENIZE_FAILED)
    return ids, _mask_from_char_ranges(offsets, ranges), text, offsets


def _template_failure(where: str, e: Exception) -> DataError:
    return DataError(f"{where}: the tokenizer's chat template cannot render this conversation ({type(e).__name__}: {e}); "
                     "drop or rewrite the record (e.g. fold a system turn into the first user turn), or use a template "
                     "that accepts it", check=TOKENIZE_FAILED)


def _render_or_explain(tokenizer, msgs: list[dict], where: str):
    """render_chat with errors that name the record: a template's raise_exception() (jinja2) or a ValueError."""
    import jinja2

    try:
        return render_chat(tokenizer, msgs)
    except DataError as e:
        raise DataError(f"{where}: {e}", check=TOKENIZE_FAILED) from None
    except (jinja2.TemplateError, ValueError, TypeError) as e:
        raise _template_failure(where, e) from None


def _encode_special(tokenizer, text: str) -> tuple[list[int], Optional[list[tuple[int, int]]]]:
    """`tokenizer(text)` as TRL calls it for plain-text records: with the tokenizer's own special tokens (the BOS a
    Gemma, Llama or Mistral base needs), and character offsets where the tokenizer gives them (special tokens get
    an empty (0, 0) span)."""
    try:
        enc = tokenizer(text, return_offsets_mapping=True)
        return list(enc["input_ids"]), [tuple(o) for o in enc["offset_mapping"]]
    except (NotImplementedError, ValueError, TypeError):  # slow tokenizers have no offsets
        return list(tokenizer(text)["input_ids"]), None


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _with_eos(text: str, eos: str) -> str:
    """TRL appends the EOS token's text to a plain record unless it already ends with it."""
    return text if (not eos or text.endswith(eos)) else text + eos


def _template_ids(tokenizer, msgs: list[dict], **kw) -> list[int]:
    """The chat template's token ids, as TRL tokenizes a conversation (`apply_chat_template(tokenize=True)`)."""
    enc = tokenizer.apply_chat_template(msgs, tokenize=True, return_dict=True, **kw)
    return list(enc["input_ids"])


def _chat_prompt_completion(tokenizer, prompt: list[dict], completion: list[dict], where: str):
    """TRL's conversational prompt-completion: the completion is what follows the common prefix of the prompt
    rendered with the generation prompt and the whole conversation rendered."""
    import jinja2

    try:
        head = _template_ids(tokenizer, prompt, add_generation_prompt=True)
        ids = _template_ids(tokenizer, prompt + completion)
        text = tokenizer.apply_chat_template(prompt + completion, tokenize=False)
    except (jinja2.TemplateError, ValueError, TypeError) as e:
        raise _template_failure(where, e) from None
    n = _common_prefix(head, ids)
    enc_ids, offsets = _encode_with_offsets(tokenizer, text)
    if enc_ids != ids:
        offsets = None
    return ids, [i >= n for i in range(len(ids))], text, offsets


def tokenize_example(tokenizer, ex: Example, max_len: int, loss: str = "supervised") -> Tokenized:
    """Token ids and loss mask of one record exactly as TRL's SFTTrainer builds them (`loss: supervised`:
    completion_only_loss for prompt-completion records, assistant_only_loss for conversations; `all`: every token):

    * ``text``: `tokenizer(text + eos)` with the tokenizer's special tokens (BOS where it adds one), every token;
    * string ``prompt``/``completion``: `tokenizer(prompt + completion + eos)`; the completion is what follows the
      common prefix with `tokenizer(prompt)`;
    * conversational prompt-completion: the chat template's ids; the completion follows the common prefix with the
      prompt rendered with its generation prompt;
    * ``messages``: the chat template's ids; assistant turns by `{% generation %}` tags, else by what each assistant
      message adds to the rendered prefix (the template's own system prompt, BOS and end-of-turn tokens included).
    """
    flags: set[str] = set()
    eos = tokenizer.eos_token or ""
    where = ex.source or ex.id
    if ex.shape in ("messages", "conversation_completion"):
        msgs = ex.messages()
        if has_chat_template(tokenizer):
            if ex.shape == "conversation_completion":
                ids, mask, text, offsets = _chat_prompt_completion(tokenizer, ex.record["prompt"],
                                                                   ex.record["completion"], where)
            else:
                ids, mask, text, offsets = _render_or_explain(tokenizer, msgs, where)
        else:
            flags.add("data.no_chat_template")
            text, ranges = _plain_messages(msgs)
            ids, offsets = _encode_with_offsets(tokenizer, text)
            # Without a template there is no reliable turn structure to mask: supervise the whole sequence.
            mask = [True] * len(ids)
    elif ex.shape == "prompt_completion":
        p = ex.record["prompt"]
        text = _with_eos(p + ex.record["completion"], eos)
        ids, offsets = _encode_special(tokenizer, text)
        n = _common_prefix(_encode_special(tokenizer, p)[0], ids)
        mask = [i >= n for i in range(len(ids))]
        if not has_chat_template(tokenizer):
            flags.add("data.no_chat_template")
    else:
        text = _with_eos(ex.record["text"], eos)
        ids, offsets = _encode_special(tokenizer, text)
        mask = [True] * len(ids)
        if not has_chat_template(tokenizer):
            flags.add("data.no_chat_template")
    if loss == "all":
        mask = [True] * len(ids)
    # The first token is never a target: nothing predicts it.
    if mask:
        mask[0] = False
    truncated = len(ids) > max_len
    if truncated:
        ids, mask = ids[:max_len], mask[:max_len]
        offsets = offsets[:max_len] if offsets is not None else None
    tok = Tokenized(ids, mask, text, offsets, truncated, flags)
    if tok.n_supervised == 0:
        tok.flags.add("data.no_supervised_tokens")
    return tok


def uses_chat(examples: Sequence[Example]) -> bool:
    return any(e.messages() is not None for e in examples)


def eval_prompt_text(tokenizer, item: EvalItem, chat: bool) -> str:
    """The generation prompt, rendered the way the training records were."""
    msgs = item.messages if item.messages is not None else [{"role": "user", "content": item.prompt or ""}]
    if chat and has_chat_template(tokenizer):
        import jinja2

        try:
            return tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        except (jinja2.TemplateError, ValueError, TypeError) as e:
            raise _template_failure(item.source or item.id, e) from None
    if item.messages is not None:
        return _plain_messages(msgs)[0] + "assistant: "
    return item.prompt or ""


def eval_prompt_ids(tokenizer, item: EvalItem, chat: bool) -> list[int]:
    """The generation prompt's token ids, as the training records were tokenized: the chat template's ids with its
    generation prompt, or `tokenizer(prompt)` with the tokenizer's special tokens (the BOS a base model needs)."""
    if chat and has_chat_template(tokenizer):
        import jinja2

        msgs = item.messages if item.messages is not None else [{"role": "user", "content": item.prompt or ""}]
        try:
            return _template_ids(tokenizer, msgs, add_generation_prompt=True)
        except (jinja2.TemplateError, ValueError, TypeError) as e:
            raise _template_failure(item.source or item.id, e) from None
    return _encode_special(tokenizer, eval_prompt_text(tokenizer, item, chat))[0]


def eval_answer_example(item: EvalItem, answer: str, chat: bool) -> Example:
    """An eval prompt with a given answer as a training-shaped example: the query loss is computed on it."""
    if chat:
        msgs = item.messages if item.messages is not None else [{"role": "user", "content": item.prompt or ""}]
        rec = {"messages": list(msgs) + [{"role": "assistant", "content": answer}]}
        return Example(id=item.id, position=item.position, shape="messages", record=rec)
    prompt = item.prompt if item.prompt is not None else _plain_messages(item.messages or [])[0] + "assistant: "
    return Example(id=item.id, position=item.position, shape="prompt_completion", record={"prompt": prompt, "completion": answer})
