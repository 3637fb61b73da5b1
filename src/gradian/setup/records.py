"""Training and eval records: reading the files, the record shapes, ids, with errors that name file and line.

Every error here is a `DataError` carrying the id of the setup check it belongs to (`data.unreadable_record`,
`data.unknown_record_shape`, `data.invalid_record`, `data.empty`, `config.paths`), so `gradian diagnose` reports the
same failure these loaders raise for every other verb."""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence, Union

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
    shape: str  # "messages" | "prompt_completion" | "conversation_completion" (TRL's chat prompt/completion) | "text"
    record: dict
    source: str = ""  # "file:line" for messages that point back at the record

    def plain_text(self) -> str:
        """A readable rendering for previews, BM25 and span offsets when no template is involved."""
        r = self.record
        if self.shape == "messages":
            return "\n".join(f"{m['role']}: {m['content']}" for m in r["messages"])
        if self.shape == "prompt_completion":
            return r["prompt"] + r["completion"]
        if self.shape == "conversation_completion":
            return "\n".join(f"{m['role']}: {m['content']}" for m in r["prompt"] + r["completion"])
        return r["text"]

    def messages(self) -> Optional[list[dict]]:
        """The conversation of a chat record (a conversational prompt-completion is its prompt then its
        completion turns), None for plain-text records."""
        if self.shape == "messages":
            return self.record["messages"]
        if self.shape == "conversation_completion":
            return self.record["prompt"] + self.record["completion"]
        return None


@dataclass
class EvalItem:
    id: str
    position: int
    answer: str
    prompt: Optional[str] = None
    messages: Optional[list[dict]] = None
    source: str = ""
    record: Optional[dict] = None  # the eval record as read (what a Python metric receives as `item`)

    def question_text(self) -> str:
        if self.prompt is not None:
            return self.prompt
        return "\n".join(m["content"] for m in self.messages or [])


UNREADABLE = "data.unreadable_record"
UNKNOWN_SHAPE = "data.unknown_record_shape"
INVALID = "data.invalid_record"


# ---------------------------------------------------------------- reading


HUB_ID = re.compile(r"^(?P<repo>[A-Za-z0-9][\w.-]*/[\w.-]+)(?::(?P<split>[\w.-]+))?(?:@(?P<revision>[\w./-]+))?$")
TABLE_SUFFIXES = {".parquet": "parquet", ".csv": "csv"}


@dataclass(frozen=True)
class HubDataset:
    """A dataset id on the hub: `org/name`, optionally `:split` (default train) and `@revision` (branch, tag or
    commit). Read through `huggingface_hub.snapshot_download` (the local hub cache when offline) and
    `datasets.load_dataset` on that snapshot."""

    repo: str
    split: Optional[str] = None
    revision: Optional[str] = None

    @property
    def text(self) -> str:
        return self.repo + (f":{self.split}" if self.split else "") + (f"@{self.revision}" if self.revision else "")

    @property
    def name(self) -> str:
        return self.text

    def __str__(self) -> str:
        return self.text


DataLocation = Union[Path, HubDataset]


def data_location(cfg, value: Optional[str]) -> Optional[DataLocation]:
    """data.train / data.eval resolved: a local file or directory relative to the config when one exists, else a
    hub dataset id when the value has that shape (`org/name[:split][@revision]`), else the (missing) local path."""
    if value is None:
        return None
    p = cfg.path(value)
    if p.exists():
        return p
    m = HUB_ID.match(value)
    first = Path(value).parts[0] if Path(value).parts else value
    local_dir = cfg.root is not None and (Path(cfg.root) / first).exists()
    if m and not value.startswith((".", "/", "~")) and not local_dir and Path(m.group("repo")).suffix.lower() not in (
            ".jsonl", ".json", ".ndjson", ".parquet", ".csv"):
        return HubDataset(m.group("repo"), m.group("split"), m.group("revision"))
    return p


def location_fingerprint(loc: Optional[DataLocation]) -> Optional[str]:
    """What identifies a hub dataset's content for caches: its repo, split and the snapshot's commit (resolved
    through the hub cache); None for a local file (its rows are keyed by content already)."""
    if not isinstance(loc, HubDataset):
        return None
    return f"{loc.repo}:{loc.split or 'train'}@{_snapshot(loc)[1]}"


def read_records(path: DataLocation) -> list[tuple[dict | Any, str]]:
    """(record, "file:line") pairs from .jsonl, .json, .parquet, .csv, a `datasets.save_to_disk` directory or a
    hub dataset id."""
    if isinstance(path, HubDataset):
        return _read_hub_dataset(path)
    path = Path(path)
    if not path.exists():
        raise DataError(f"{path}: file not found (check data.train / data.eval; relative paths resolve against the config file)",
                        check="config.paths")
    if path.is_dir():
        if (path / "dataset_info.json").exists() or (path / "state.json").exists() or (path / "dataset_dict.json").exists():
            return _read_saved_dataset(path)
        raise DataError(f"{path}: is a directory but not a `datasets.save_to_disk` directory; give a .jsonl or .json file",
                        check=UNREADABLE)
    suffix = path.suffix.lower()
    if suffix in TABLE_SUFFIXES:
        return _read_table(path, TABLE_SUFFIXES[suffix])
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
    if suffix == PROMPT_LIST:
        return _read_prompt_list(path, raw)
    if suffix not in {".jsonl", ".ndjson"}:
        raise DataError(f"{path}: unsupported file type '{suffix}'; use .jsonl, .json, .parquet, .csv, .txt (eval "
                        "prompts, one per line), a save_to_disk directory or a hub dataset id (org/name)",
                        check=UNREADABLE)
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


# An eval set as a few prompts, one per line, with what passes said once for all of them by the metric (regex with
# evaluation.pattern, or a Python metric): each non-blank line, stripped, is the record {"prompt": line}.
PROMPT_LIST = ".txt"


def _read_prompt_list(path: Path, raw: bytes) -> list[tuple[dict, str]]:
    out = []
    for lineno, line in enumerate(raw.split(b"\n"), start=1):
        try:
            text = line.decode("utf-8").strip()
        except UnicodeDecodeError as e:
            raise DataError(f"{path}:{lineno}: not UTF-8 text ({e.reason} at byte {e.start}); re-encode the file as "
                            "UTF-8", check=UNREADABLE) from None
        if text:
            out.append(({"prompt": text}, f"{path}:{lineno}"))
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
    return _rows_of(ds, str(path))


def _rows_of(ds, where: str) -> list[tuple[dict, str]]:
    return [(_plain(dict(rec)), f"{where}:row {i + 1}") for i, rec in enumerate(ds)]


def _plain(rec: dict) -> dict:
    """A datasets row as JSON-like values: Arrow fills a missing struct field with None (e.g. the `tool_calls` of a
    message that has none), which is dropped here so the record reads as it was written."""
    def clean(v):
        if isinstance(v, dict):
            return {k: clean(x) for k, x in v.items() if x is not None}
        if isinstance(v, list):
            return [clean(x) for x in v]
        return v
    return {k: clean(v) for k, v in rec.items()}


def _read_table(path: Path, builder: str) -> list[tuple[dict, str]]:
    """A .parquet or .csv file through `datasets.load_dataset` (the same reader TRL users load it with)."""
    import datasets

    try:
        ds = _quiet_load(lambda: datasets.load_dataset(builder, data_files=str(path), split="train"))
    except Exception as e:  # pyarrow and datasets raise many types for a broken file
        raise DataError(f"{path}: cannot be read as {builder} ({type(e).__name__}: {_short(e)})", check=UNREADABLE) from None
    return _rows_of(ds, str(path))


def _short(e: BaseException, limit: int = 300) -> str:
    t = " ".join(str(e).split())
    return t if len(t) <= limit else t[: limit - 1] + "…"


def _quiet_load(fn):
    import datasets

    bars = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()
    try:
        return fn()
    finally:
        if bars:
            datasets.enable_progress_bars()


_SNAPSHOTS: dict[tuple[str, Optional[str]], tuple[str, str]] = {}


def _snapshot(loc: HubDataset) -> tuple[str, str]:
    """(local snapshot folder, commit) of a hub dataset: downloaded into the hub cache, or found there offline
    (resolved once per process)."""
    key = (loc.repo, loc.revision)
    if key not in _SNAPSHOTS:
        _SNAPSHOTS[key] = _fetch_snapshot(loc)
    return _SNAPSHOTS[key]


def _fetch_snapshot(loc: HubDataset) -> tuple[str, str]:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError, RepositoryNotFoundError, RevisionNotFoundError

    rev = f" at revision '{loc.revision}'" if loc.revision else ""
    try:
        folder = snapshot_download(loc.repo, repo_type="dataset", revision=loc.revision)
    except RevisionNotFoundError:
        raise DataError(f"dataset '{loc.text}': the hub repository '{loc.repo}' has no revision '{loc.revision}'; "
                        "give an existing branch, tag or commit after '@'", check="config.paths") from None
    except RepositoryNotFoundError:
        raise DataError(f"dataset '{loc.text}': no dataset '{loc.repo}' on the hub (or it is private: log in with "
                        "`hf auth login`); check the id, or give a local file", check="config.paths") from None
    except LocalEntryNotFoundError:
        raise DataError(f"dataset '{loc.text}': '{loc.repo}'{rev} is not in the local hub cache and the hub cannot "
                        "be reached (offline); download it once online, or give a local file", check="config.paths") from None
    except (HfHubHTTPError, OSError, ValueError) as e:
        raise DataError(f"dataset '{loc.text}': cannot be fetched from the hub ({_short(e)})", check="config.paths") from None
    return folder, Path(folder).name


def _read_hub_dataset(loc: HubDataset) -> list[tuple[dict, str]]:
    import datasets

    folder, commit = _snapshot(loc)
    split = loc.split or "train"
    try:
        ds = _quiet_load(lambda: datasets.load_dataset(folder, split=split))
    except ValueError as e:
        if "split" in str(e).lower():
            raise DataError(f"dataset '{loc.text}': no split '{split}' ({_short(e)}); name one of its splits after "
                            "':'", check="config.paths") from None
        raise DataError(f"dataset '{loc.text}': cannot be loaded ({_short(e)})", check=UNREADABLE) from None
    except Exception as e:
        raise DataError(f"dataset '{loc.text}': cannot be loaded ({type(e).__name__}: {_short(e)})", check=UNREADABLE) from None
    return _rows_of(ds, f"{loc.repo}:{split}@{commit[:12]}")


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
    if isinstance(rec.get("prompt"), list) or isinstance(rec.get("completion"), list):
        # TRL's conversational prompt-completion: the completion turns are supervised, rendered by the template.
        for k in ("prompt", "completion"):
            if not isinstance(rec.get(k), list):
                raise DataError(f"{where}: '{k}' must be a list of {{role, content}} messages like the other field "
                                "(TRL's conversational prompt-completion shape)", check=INVALID)
        prompt = _check_messages(rec["prompt"], f"{where}: prompt", need_assistant=False)
        completion = _check_messages(rec["completion"], f"{where}: completion", need_assistant=True)
        if any(m["role"] != "assistant" for m in completion):
            raise DataError(f"{where}: completion turns must be assistant messages (got roles "
                            f"{[m['role'] for m in completion]})", check=INVALID)
        return "conversation_completion", {"prompt": prompt, "completion": completion}
    if "prompt" in rec or "completion" in rec:
        if "completion" not in rec:
            raise DataError(f"{where}: a 'prompt' without a 'completion': training records hold what the model was "
                            "trained to answer ({prompt, completion}); prompts alone (a .txt list) are an eval set "
                            "(data.eval, --eval)", check=INVALID)
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
        f"{where}: unknown record shape (keys: {keys}); expected {{messages: [...]}}, {{prompt, completion}} (strings, "
        "or TRL's lists of messages) or {{text}}",
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


def load_train(path: str | DataLocation) -> list[Example]:
    path = path if isinstance(path, HubDataset) else Path(path)
    rows = read_records(path)
    if not rows:
        raise DataError(f"{path}: no records; the training set is empty", check="data.empty")
    examples, errors = parse_train(rows)
    if errors:
        raise errors[0]
    return examples


def load_eval(path: str | DataLocation, *, need_answer: bool = True) -> list[EvalItem]:
    """The eval records as `EvalItem`s. `need_answer`: every record needs a string `answer` (the reference the
    metric compares with); a regex metric with `evaluation.pattern` or a Python metric does without it."""
    path = path if isinstance(path, HubDataset) else Path(path)
    rows = read_records(path)
    if not rows:
        raise DataError(f"{path}: no records; the eval set is empty", check="data.empty")
    out = []
    for pos, (rec, where) in enumerate(rows):
        if not isinstance(rec, dict):
            raise DataError(f"{where}: expected a JSON object, got {type(rec).__name__}", check=UNKNOWN_SHAPE)
        if need_answer and "answer" not in rec and Path(str(path)).suffix.lower() == PROMPT_LIST:
            raise DataError(f"{path}: a list of prompts has no answers, and evaluation.metric compares each answer "
                            "with one; say once what passes for every prompt (metric: regex with evaluation.pattern, "
                            "negate: true for what must not appear; --metric regex --pattern ... [--negate]) or give "
                            "a JSONL of {prompt, answer} records", check=UNKNOWN_SHAPE)
        if need_answer and ("answer" not in rec or not isinstance(rec["answer"], str)):
            raise DataError(f"{where}: eval records need a string 'answer' (shape {{prompt, answer}} or {{messages, answer}})",
                            check=UNKNOWN_SHAPE)
        if "answer" in rec and not isinstance(rec["answer"], str):
            raise DataError(f"{where}: 'answer' must be a string", check=INVALID)
        if "messages" in rec:
            msgs = _check_messages(rec["messages"], where, need_assistant=False)
            if msgs[-1]["role"] == "assistant":
                raise DataError(f"{where}: eval 'messages' must end with a user turn; the answer goes in 'answer'", check=INVALID)
            item = EvalItem(id="", position=pos, answer=rec.get("answer", ""), messages=msgs, source=where, record=rec)
        elif "prompt" in rec:
            if not isinstance(rec["prompt"], str):
                raise DataError(f"{where}: 'prompt' must be a string", check=INVALID)
            item = EvalItem(id="", position=pos, answer=rec.get("answer", ""), prompt=rec["prompt"], source=where,
                            record=rec)
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
