"""Training and eval records: reading the files, the record shapes, ids, with errors that name file and line.

Every error here is a `DataError` carrying the id of the setup check it belongs to (`data.unreadable_record`,
`data.unknown_record_shape`, `data.invalid_record`, `data.empty`, `config.paths`), so `gradian diagnose` reports the
same failure these loaders raise for every other verb."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

from ..errors import DataError
from ..io import content_hash

ROLES = {"system", "user", "assistant"}
# A single JSON line larger than this is almost certainly not a training record (a dumped blob, a binary file).
MAX_LINE_BYTES = 16 * 1024 * 1024


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


UNREADABLE = "data.unreadable_record"
UNKNOWN_SHAPE = "data.unknown_record_shape"
INVALID = "data.invalid_record"


# ---------------------------------------------------------------- reading


def read_records(path: Path) -> list[tuple[dict | Any, str]]:
    """(record, "file:line") pairs from .jsonl, .json or a `datasets.save_to_disk` directory."""
    if not path.exists():
        raise DataError(f"{path}: file not found (check data.train / data.eval; relative paths resolve against the config file)",
                        check="config.paths")
    if path.is_dir():
        if (path / "dataset_info.json").exists() or (path / "state.json").exists() or (path / "dataset_dict.json").exists():
            return _read_saved_dataset(path)
        raise DataError(f"{path}: is a directory but not a `datasets.save_to_disk` directory; give a .jsonl or .json file",
                        check=UNREADABLE)
    suffix = path.suffix.lower()
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise DataError(f"{path}: cannot read ({e.strerror}); check the permissions", check=UNREADABLE) from None
    if suffix == ".json":
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            line = raw[: e.start].count(b"\n") + 1
            raise DataError(f"{path}:{line}: not UTF-8 text ({e.reason}); re-encode the file as UTF-8", check=UNREADABLE) from None
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise DataError(f"{path}:{e.lineno}: invalid JSON ({e.msg} at column {e.colno})", check=UNREADABLE) from None
        if isinstance(data, dict) and isinstance(data.get("data"), list):
            data = data["data"]
        if not isinstance(data, list):
            raise DataError(f"{path}:1: expected a JSON list of records (or {{\"data\": [...]}}), got {type(data).__name__}", check=UNREADABLE)
        return [(rec, f"{path}:record {i + 1}") for i, rec in enumerate(data)]
    if suffix not in {".jsonl", ".ndjson"}:
        raise DataError(f"{path}: unsupported file type '{suffix}'; use .jsonl, .json or a save_to_disk directory", check=UNREADABLE)
    out = []
    for lineno, line in enumerate(raw.split(b"\n"), start=1):
        if not line.strip():
            continue
        if len(line) > MAX_LINE_BYTES:
            raise DataError(
                f"{path}:{lineno}: line of {len(line) / 2**20:.1f} MiB is over the {MAX_LINE_BYTES // 2**20} MiB limit "
                "for one record; split the record or check that this is a JSON Lines file"
            , check=UNREADABLE)
        try:
            text = line.decode("utf-8")
        except UnicodeDecodeError as e:
            raise DataError(f"{path}:{lineno}: not UTF-8 text ({e.reason} at byte {e.start}); re-encode the file as UTF-8", check=UNREADABLE) from None
        try:
            rec = json.loads(text)
        except json.JSONDecodeError as e:
            raise DataError(f"{path}:{lineno}: invalid JSON ({e.msg} at column {e.colno})", check=UNREADABLE) from None
        out.append((rec, f"{path}:{lineno}"))
    return out


def _read_saved_dataset(path: Path) -> list[tuple[dict, str]]:
    try:
        import datasets
    except ImportError:  # pragma: no cover - datasets is a dependency
        raise DataError(f"{path}: reading a save_to_disk directory needs the `datasets` package", check=UNREADABLE) from None
    try:
        ds = datasets.load_from_disk(str(path))
    except Exception as e:  # datasets raises many types for a broken directory
        raise DataError(f"{path}: cannot load the save_to_disk directory ({e})", check=UNREADABLE) from None
    if isinstance(ds, datasets.DatasetDict):
        if "train" not in ds:
            raise DataError(f"{path}: a DatasetDict without a 'train' split; save the split you mean with save_to_disk", check=UNREADABLE)
        ds = ds["train"]
    return [(dict(rec), f"{path}:row {i + 1}") for i, rec in enumerate(ds)]


def _check_messages(msgs: Any, where: str, *, need_assistant: bool) -> list[dict]:
    if not isinstance(msgs, list) or not msgs:
        raise DataError(f"{where}: 'messages' must be a non-empty list of {{role, content}} objects", check=INVALID)
    for j, m in enumerate(msgs):
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise DataError(f"{where}: messages[{j}] must be an object with 'role' and 'content'", check=INVALID)
        if m["role"] not in ROLES:
            raise DataError(f"{where}: messages[{j}].role is {m['role']!r}; expected one of system, user, assistant", check=INVALID)
        if not isinstance(m["content"], str):
            raise DataError(f"{where}: messages[{j}].content must be a string, got {type(m['content']).__name__}", check=INVALID)
    if need_assistant and not any(m["role"] == "assistant" for m in msgs):
        raise DataError(f"{where}: the conversation has no assistant turn, so nothing is supervised; add one or drop the row", check=INVALID)
    return [{"role": m["role"], "content": m["content"]} for m in msgs]


def train_shape(rec: Any, where: str) -> tuple[str, dict]:
    if not isinstance(rec, dict):
        raise DataError(f"{where}: expected a JSON object, got {type(rec).__name__}", check=UNKNOWN_SHAPE)
    if "messages" in rec:
        return "messages", {"messages": _check_messages(rec["messages"], where, need_assistant=True)}
    if "prompt" in rec or "completion" in rec:
        for k in ("prompt", "completion"):
            if not isinstance(rec.get(k), str):
                raise DataError(f"{where}: '{k}' must be a string (record shape {{prompt, completion}})", check=INVALID)
        return "prompt_completion", {"prompt": rec["prompt"], "completion": rec["completion"]}
    if "text" in rec:
        if not isinstance(rec["text"], str):
            raise DataError(f"{where}: 'text' must be a string", check=INVALID)
        return "text", {"text": rec["text"]}
    keys = ", ".join(sorted(map(str, rec))) or "none"
    raise DataError(
        f"{where}: unknown record shape (keys: {keys}); expected {{messages: [...]}}, {{prompt, completion}} or {{text}}",
        check=UNKNOWN_SHAPE,
    )


def parse_train(rows: Sequence[tuple[Any, str]]) -> tuple[list[Example], list[DataError]]:
    """Every record of `rows` ((record, "file:line") pairs) as an `Example`, and the error of each one that is not
    a training record (checked records keep their position: ids embed it). `load_train` stops at the first error;
    `gradian diagnose` reports them all."""
    out, errors = [], []
    for pos, (rec, where) in enumerate(rows):
        try:
            shape, clean = train_shape(rec, where)
        except DataError as e:
            errors.append(e)
            continue
        out.append(Example(id=f"train-{pos:06d}-{content_hash(clean)}", position=pos, shape=shape, record=clean, source=where))
    return out, errors


def load_train(path: str | Path) -> list[Example]:
    path = Path(path)
    rows = read_records(path)
    if not rows:
        raise DataError(f"{path}: no records; the training set is empty", check="data.empty")
    examples, errors = parse_train(rows)
    if errors:
        raise errors[0]
    return examples


def load_eval(path: str | Path) -> list[EvalItem]:
    path = Path(path)
    rows = read_records(path)
    if not rows:
        raise DataError(f"{path}: no records; the eval set is empty", check="data.empty")
    out = []
    for pos, (rec, where) in enumerate(rows):
        if not isinstance(rec, dict):
            raise DataError(f"{where}: expected a JSON object, got {type(rec).__name__}", check=UNKNOWN_SHAPE)
        if "answer" not in rec or not isinstance(rec["answer"], str):
            raise DataError(f"{where}: eval records need a string 'answer' (shape {{prompt, answer}} or {{messages, answer}})",
                            check=UNKNOWN_SHAPE)
        if "messages" in rec:
            msgs = _check_messages(rec["messages"], where, need_assistant=False)
            if msgs[-1]["role"] == "assistant":
                raise DataError(f"{where}: eval 'messages' must end with a user turn; the answer goes in 'answer'", check=INVALID)
            item = EvalItem(id="", position=pos, answer=rec["answer"], messages=msgs, source=where)
        elif "prompt" in rec:
            if not isinstance(rec["prompt"], str):
                raise DataError(f"{where}: 'prompt' must be a string", check=INVALID)
            item = EvalItem(id="", position=pos, answer=rec["answer"], prompt=rec["prompt"], source=where)
        else:
            raise DataError(f"{where}: eval records need 'prompt' or 'messages' beside 'answer'", check=UNKNOWN_SHAPE)
        item.id = f"eval-{pos:06d}-{content_hash({'p': item.prompt, 'm': item.messages, 'a': item.answer})}"
        out.append(item)
    return out


def dataset_fingerprint(examples: Sequence[Example]) -> str:
    h = hashlib.sha256()
    for e in examples:
        h.update(e.id.encode())
    return h.hexdigest()[:16]
