"""Training and eval records: loading with errors that name file and line, ids, rendering and supervision masks."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence

from .errors import DataError

ROLES = {"system", "user", "assistant"}
# A single JSON line larger than this is almost certainly not a training record (a dumped blob, a binary file).
MAX_LINE_BYTES = 16 * 1024 * 1024


def content_hash(obj: Any, n: int = 8) -> str:
    blob = json.dumps(obj, sort_keys=True, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
    return hashlib.sha256(blob).hexdigest()[:n]


@dataclass
class Example:
    """One training record. `position` is its 0-based record number in the file; the id embeds it."""

    id: str
    position: int
    shape: str  # "messages" | "prompt_completion" | "text"
    record: dict
    source: str = ""  # "file:line" for messages that point back at the record

    def plain_text(self) -> str:
        """A readable rendering for previews, BM25 and span offsets when no template is involved."""
        r = self.record
        if self.shape == "messages":
            return "\n".join(f"{m['role']}: {m['content']}" for m in r["messages"])
        if self.shape == "prompt_completion":
            return r["prompt"] + r["completion"]
        return r["text"]


@dataclass
class EvalItem:
    id: str
    position: int
    answer: str
    prompt: Optional[str] = None
    messages: Optional[list[dict]] = None
    source: str = ""

    def question_text(self) -> str:
        if self.prompt is not None:
            return self.prompt
        return "\n".join(m["content"] for m in self.messages or [])


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


# ---------------------------------------------------------------- loading


def _read_records(path: Path) -> list[tuple[dict | Any, str]]:
    """(record, "file:line") pairs from .jsonl, .json or a `datasets.save_to_disk` directory."""
    if not path.exists():
        raise DataError(f"{path}: file not found (check data.train / data.eval; relative paths resolve against the config file)")
    if path.is_dir():
        if (path / "dataset_info.json").exists() or (path / "state.json").exists() or (path / "dataset_dict.json").exists():
            return _read_saved_dataset(path)
        raise DataError(f"{path}: is a directory but not a `datasets.save_to_disk` directory; give a .jsonl or .json file")
    suffix = path.suffix.lower()
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise DataError(f"{path}: cannot read ({e.strerror}); check the permissions") from None
    if suffix == ".json":
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            line = raw[: e.start].count(b"\n") + 1
            raise DataError(f"{path}:{line}: not UTF-8 text ({e.reason}); re-encode the file as UTF-8") from None
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise DataError(f"{path}:{e.lineno}: invalid JSON ({e.msg} at column {e.colno})") from None
        if isinstance(data, dict) and isinstance(data.get("data"), list):
            data = data["data"]
        if not isinstance(data, list):
            raise DataError(f"{path}:1: expected a JSON list of records (or {{\"data\": [...]}}), got {type(data).__name__}")
        return [(rec, f"{path}:record {i + 1}") for i, rec in enumerate(data)]
    if suffix not in {".jsonl", ".ndjson"}:
        raise DataError(f"{path}: unsupported file type '{suffix}'; use .jsonl, .json or a save_to_disk directory")
    out = []
    for lineno, line in enumerate(raw.split(b"\n"), start=1):
        if not line.strip():
            continue
        if len(line) > MAX_LINE_BYTES:
            raise DataError(
                f"{path}:{lineno}: line of {len(line) / 2**20:.1f} MiB is over the {MAX_LINE_BYTES // 2**20} MiB limit "
                "for one record; split the record or check that this is a JSON Lines file"
            )
        try:
            text = line.decode("utf-8")
        except UnicodeDecodeError as e:
            raise DataError(f"{path}:{lineno}: not UTF-8 text ({e.reason} at byte {e.start}); re-encode the file as UTF-8") from None
        try:
            rec = json.loads(text)
        except json.JSONDecodeError as e:
            raise DataError(f"{path}:{lineno}: invalid JSON ({e.msg} at column {e.colno})") from None
        out.append((rec, f"{path}:{lineno}"))
    return out


def _read_saved_dataset(path: Path) -> list[tuple[dict, str]]:
    try:
        import datasets
    except ImportError:  # pragma: no cover - datasets is a dependency
        raise DataError(f"{path}: reading a save_to_disk directory needs the `datasets` package") from None
    try:
        ds = datasets.load_from_disk(str(path))
    except Exception as e:  # datasets raises many types for a broken directory
        raise DataError(f"{path}: cannot load the save_to_disk directory ({e})") from None
    if isinstance(ds, datasets.DatasetDict):
        if "train" not in ds:
            raise DataError(f"{path}: a DatasetDict without a 'train' split; save the split you mean with save_to_disk")
        ds = ds["train"]
    return [(dict(rec), f"{path}:row {i + 1}") for i, rec in enumerate(ds)]


def _check_messages(msgs: Any, where: str, *, need_assistant: bool) -> list[dict]:
    if not isinstance(msgs, list) or not msgs:
        raise DataError(f"{where}: 'messages' must be a non-empty list of {{role, content}} objects")
    for j, m in enumerate(msgs):
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise DataError(f"{where}: messages[{j}] must be an object with 'role' and 'content'")
        if m["role"] not in ROLES:
            raise DataError(f"{where}: messages[{j}].role is {m['role']!r}; expected one of system, user, assistant")
        if not isinstance(m["content"], str):
            raise DataError(f"{where}: messages[{j}].content must be a string, got {type(m['content']).__name__}")
    if need_assistant and not any(m["role"] == "assistant" for m in msgs):
        raise DataError(f"{where}: the conversation has no assistant turn, so nothing is supervised; add one or drop the row")
    return [{"role": m["role"], "content": m["content"]} for m in msgs]


def train_shape(rec: Any, where: str) -> tuple[str, dict]:
    if not isinstance(rec, dict):
        raise DataError(f"{where}: expected a JSON object, got {type(rec).__name__}")
    if "messages" in rec:
        return "messages", {"messages": _check_messages(rec["messages"], where, need_assistant=True)}
    if "prompt" in rec or "completion" in rec:
        for k in ("prompt", "completion"):
            if not isinstance(rec.get(k), str):
                raise DataError(f"{where}: '{k}' must be a string (record shape {{prompt, completion}})")
        return "prompt_completion", {"prompt": rec["prompt"], "completion": rec["completion"]}
    if "text" in rec:
        if not isinstance(rec["text"], str):
            raise DataError(f"{where}: 'text' must be a string")
        return "text", {"text": rec["text"]}
    keys = ", ".join(sorted(map(str, rec))) or "none"
    raise DataError(
        f"{where}: unknown record shape (keys: {keys}); expected {{messages: [...]}}, {{prompt, completion}} or {{text}}"
    )


def load_train(path: str | Path) -> list[Example]:
    path = Path(path)
    rows = _read_records(path)
    if not rows:
        raise DataError(f"{path}: no records; the training set is empty")
    out = []
    for pos, (rec, where) in enumerate(rows):
        shape, clean = train_shape(rec, where)
        out.append(Example(id=f"train-{pos:06d}-{content_hash(clean)}", position=pos, shape=shape, record=clean, source=where))
    return out


def load_eval(path: str | Path) -> list[EvalItem]:
    path = Path(path)
    rows = _read_records(path)
    if not rows:
        raise DataError(f"{path}: no records; the eval set is empty")
    out = []
    for pos, (rec, where) in enumerate(rows):
        if not isinstance(rec, dict):
            raise DataError(f"{where}: expected a JSON object, got {type(rec).__name__}")
        if "answer" not in rec or not isinstance(rec["answer"], str):
            raise DataError(f"{where}: eval records need a string 'answer' (shape {{prompt, answer}} or {{messages, answer}})")
        if "messages" in rec:
            msgs = _check_messages(rec["messages"], where, need_assistant=False)
            if msgs[-1]["role"] == "assistant":
                raise DataError(f"{where}: eval 'messages' must end with a user turn; the answer goes in 'answer'")
            item = EvalItem(id="", position=pos, answer=rec["answer"], messages=msgs, source=where)
        elif "prompt" in rec:
            if not isinstance(rec["prompt"], str):
                raise DataError(f"{where}: 'prompt' must be a string")
            item = EvalItem(id="", position=pos, answer=rec["answer"], prompt=rec["prompt"], source=where)
        else:
            raise DataError(f"{where}: eval records need 'prompt' or 'messages' beside 'answer'")
        item.id = f"eval-{pos:06d}-{content_hash({'p': item.prompt, 'm': item.messages, 'a': item.answer})}"
        out.append(item)
    return out


# ---------------------------------------------------------------- rendering and masks


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
            raise DataError("the chat template does not render conversations prefix-stably; add {% generation %} tags")
        ranges.append((len(before), len(upto)))
    if offsets is None:
        raise DataError("the tokenizer gives no character offsets; use a fast tokenizer or a template with generation tags")
    return ids, _mask_from_char_ranges(offsets, ranges), text, offsets


def _template_failure(where: str, e: Exception) -> DataError:
    return DataError(f"{where}: the tokenizer's chat template cannot render this conversation ({type(e).__name__}: {e}); "
                     "drop or rewrite the record (e.g. fold a system turn into the first user turn), or use a template "
                     "that accepts it")


def _render_or_explain(tokenizer, msgs: list[dict], where: str):
    """render_chat with errors that name the record: a template's raise_exception() (jinja2) or a ValueError."""
    import jinja2

    try:
        return render_chat(tokenizer, msgs)
    except DataError as e:
        raise DataError(f"{where}: {e}") from None
    except (jinja2.TemplateError, ValueError, TypeError) as e:
        raise _template_failure(where, e) from None


def tokenize_example(tokenizer, ex: Example, max_len: int) -> Tokenized:
    flags: set[str] = set()
    eos = tokenizer.eos_token or ""
    if ex.shape == "messages":
        msgs = ex.record["messages"]
        if has_chat_template(tokenizer):
            ids, mask, text, offsets = _render_or_explain(tokenizer, msgs, ex.source or ex.id)
        else:
            flags.add("data.no_chat_template")
            text, ranges = _plain_messages(msgs)
            ids, offsets = _encode_with_offsets(tokenizer, text)
            # Without a template there is no reliable turn structure to mask: supervise the whole sequence.
            mask = [True] * len(ids)
    elif ex.shape == "prompt_completion":
        p, c = ex.record["prompt"], ex.record["completion"] + eos
        text = p + c
        ids, offsets = _encode_with_offsets(tokenizer, text)
        if offsets is None:
            pids = tokenizer(p, add_special_tokens=False)["input_ids"]
            mask = [i >= len(pids) for i in range(len(ids))]
        else:
            mask = _mask_from_char_ranges(offsets, [(len(p), len(text))])
        if not has_chat_template(tokenizer):
            flags.add("data.no_chat_template")
    else:
        text = ex.record["text"] + eos
        ids, offsets = _encode_with_offsets(tokenizer, text)
        mask = [True] * len(ids)
        if not has_chat_template(tokenizer):
            flags.add("data.no_chat_template")
    bos = getattr(tokenizer, "bos_token_id", None)
    if ex.shape != "messages" and bos is not None and (not ids or ids[0] != bos) and getattr(tokenizer, "add_bos_token", True):
        ids = [bos] + ids
        mask = [False] + mask
        offsets = [(0, 0)] + offsets if offsets is not None else None
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
    return any(e.shape == "messages" for e in examples)


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


def eval_answer_example(item: EvalItem, answer: str, chat: bool) -> Example:
    """An eval prompt with a given answer as a training-shaped example: the query loss is computed on it."""
    if chat:
        msgs = item.messages if item.messages is not None else [{"role": "user", "content": item.prompt or ""}]
        rec = {"messages": list(msgs) + [{"role": "assistant", "content": answer}]}
        return Example(id=item.id, position=item.position, shape="messages", record=rec)
    prompt = item.prompt if item.prompt is not None else _plain_messages(item.messages or [])[0] + "assistant: "
    return Example(id=item.id, position=item.position, shape="prompt_completion", record={"prompt": prompt, "completion": answer})


def collate(batch: Sequence[Tokenized], pad_id: int, *, left: bool = False):
    """Pad to the longest row. Right padding for loss/gradients; left padding for generation."""
    import torch

    T = max(len(t.input_ids) for t in batch)
    ids = torch.full((len(batch), T), pad_id, dtype=torch.long)
    attn = torch.zeros((len(batch), T), dtype=torch.long)
    sup = torch.zeros((len(batch), T), dtype=torch.bool)
    for i, t in enumerate(batch):
        n = len(t.input_ids)
        sl = slice(T - n, T) if left else slice(0, n)
        ids[i, sl] = torch.tensor(t.input_ids, dtype=torch.long)
        attn[i, sl] = 1
        sup[i, sl] = torch.tensor(t.supervised, dtype=torch.bool)
    return ids, attn, sup


def dataset_fingerprint(examples: Sequence[Example]) -> str:
    h = hashlib.sha256()
    for e in examples:
        h.update(e.id.encode())
    return h.hexdigest()[:16]
