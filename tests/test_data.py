import json

import pytest

from gradian.setup.records import load_eval, load_train
from gradian.errors import DataError


def _jsonl(tmp_path, lines, name="train.jsonl"):
    p = tmp_path / name
    p.write_text("\n".join(lines) + "\n")
    return p


def test_three_train_shapes_and_ids_embed_position(tmp_path):
    p = _jsonl(tmp_path, [
        json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}),
        json.dumps({"prompt": "a", "completion": "b"}),
        json.dumps({"text": "plain"}),
    ])
    ex = load_train(p)
    assert [e.shape for e in ex] == ["messages", "prompt_completion", "text"]
    assert ex[1].id.startswith("train-000001-") and ex[1].position == 1
    # a reordered file is a different dataset: the same record gets another id
    p2 = _jsonl(tmp_path, [json.dumps({"text": "plain"})], "b.jsonl")
    assert load_train(p2)[0].id != ex[2].id
    assert load_train(p2)[0].id.split("-")[2] == ex[2].id.split("-")[2]


def test_malformed_json_names_file_and_line(tmp_path):
    p = _jsonl(tmp_path, [json.dumps({"text": "ok"}), "{not json", json.dumps({"text": "ok"})])
    with pytest.raises(DataError, match=r"train.jsonl:2: invalid JSON"):
        load_train(p)


def test_unknown_shape_and_wrong_types_name_line(tmp_path):
    p = _jsonl(tmp_path, [json.dumps({"text": "ok"}), json.dumps({"question": "q"})])
    with pytest.raises(DataError, match=r"train.jsonl:2: unknown record shape"):
        load_train(p)
    p = _jsonl(tmp_path, [json.dumps({"messages": [{"role": "bot", "content": "x"}]})])
    with pytest.raises(DataError, match=r"train.jsonl:1: messages\[0\].role"):
        load_train(p)
    p = _jsonl(tmp_path, [json.dumps({"prompt": "q", "completion": 3})])
    with pytest.raises(DataError, match=r"train.jsonl:1: 'completion' must be a string"):
        load_train(p)


def test_eval_records(tmp_path):
    p = _jsonl(tmp_path, [json.dumps({"prompt": "q?", "answer": "a"}),
                          json.dumps({"messages": [{"role": "user", "content": "q"}], "answer": "b"})], "eval.jsonl")
    items = load_eval(p)
    assert items[0].prompt == "q?" and items[1].messages[0]["content"] == "q"
    bad = _jsonl(tmp_path, [json.dumps({"prompt": "q?"})], "bad.jsonl")
    with pytest.raises(DataError, match=r"bad.jsonl:1: eval records need a string 'answer'"):
        load_eval(bad)


def test_json_list_and_save_to_disk(tmp_path):
    p = tmp_path / "t.json"
    p.write_text(json.dumps([{"text": "a"}, {"text": "b"}]))
    assert len(load_train(p)) == 2
    datasets = pytest.importorskip("datasets")
    d = tmp_path / "ds"
    datasets.Dataset.from_list([{"prompt": "p", "completion": "c"}]).save_to_disk(str(d))
    assert load_train(d)[0].shape == "prompt_completion"


def test_empty_and_missing_and_non_utf8(tmp_path):
    p = _jsonl(tmp_path, [""], "empty.jsonl")
    with pytest.raises(DataError, match="empty"):
        load_train(p)
    with pytest.raises(DataError, match="not found"):
        load_train(tmp_path / "nope.jsonl")
    b = tmp_path / "bin.jsonl"
    b.write_bytes(b'{"text": "ok"}\n{"text": "\xff\xfe"}\n')
    with pytest.raises(DataError, match=r"bin.jsonl:2: not UTF-8"):
        load_train(b)
