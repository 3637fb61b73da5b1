"""The gradient index store: round trips, exact scoring, corruption detection, crash resume, locking."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import textwrap
import time
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
import torch

from gradian.errors import IndexError_
from gradian.store.index import SCHEMA
from gradian.store.index import GradientIndex, IndexMismatch
from gradian.store.lock import IndexLocked
from gradian.store.encoding import f32_to_bf16_bits as _f32_to_bf16_bits

torch.set_num_threads(1)

SRC = str(Path(__file__).resolve().parents[1] / "src")
DTYPES = ["float32", "float16", "bfloat16"]


def _keys(n: int, prefix: str = "ex") -> list[str]:
    return [f"{prefix}-{i:05d}" for i in range(n)]


def _grads(n: int, dim: int, seed: int = 0, scale: float = 1e-6) -> np.ndarray:
    # LoRA gradients are tiny and their norms vary by example; both matter for the half types.
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((n, dim)) * scale * rng.uniform(0.2, 3.0, (n, 1))).astype(np.float32)


def _build(root: Path, keys, vecs, *, dtype="float32", shard_rows=16, batch=7, **kw) -> None:
    with GradientIndex.open(root, key="K", dim=vecs.shape[1], storage_dtype=dtype, shard_rows=shard_rows, **kw) as ix:
        for a in range(0, len(keys), batch):
            ix.add(keys[a : a + batch], vecs[a : a + batch])


def _manifest(root: Path) -> dict:
    return json.loads((root / "manifest.json").read_text())


# --------------------------------------------------------------------------------------------- round trip


@pytest.mark.parametrize("dtype", DTYPES)
def test_round_trip(tmp_path, dtype):
    keys, vecs = _keys(50), _grads(50, 24)
    vecs[3] = 0.0  # a row with no supervised tokens must survive the unit/norm split
    _build(tmp_path / "ix", keys, vecs, dtype=dtype, meta={"projection": {"kind": "rademacher", "seed": 3}})

    m = _manifest(tmp_path / "ix")
    assert (m["schema"], m["key"], m["dim"], m["storage_dtype"]) == (SCHEMA, "K", 24, dtype)
    assert m["meta"] == {"projection": {"kind": "rademacher", "seed": 3}}
    assert [s["rows"] for s in m["shards"]] == [16, 16, 16, 2]
    assert [k for s in m["shards"] for k in s["keys"]] == keys
    for s in m["shards"]:
        arr = np.load(tmp_path / "ix" / s["file"], mmap_mode="r", allow_pickle=False)
        assert arr.shape == (s["rows"], 24) and len(s["sha256"]) == 64
        assert (s["norms"] is None) == (dtype == "float32")

    with GradientIndex.open(tmp_path / "ix", key="K", dim=24, storage_dtype=dtype, on_mismatch="refuse") as ix:
        assert ix.n_rows == 50 and ix.dim == 24 and ix.key == "K" and ix.meta["projection"]["seed"] == 3
        assert ix.nbytes == sum(
            (tmp_path / "ix" / f).stat().st_size
            for s in m["shards"]
            for f in [s["file"]] + ([s["norms"]["file"]] if s["norms"] else [])
        )
        got = ix.rows(keys[::-1])[::-1]
        assert got.dtype == np.float32 and got.shape == (50, 24)
        tol = {"float32": 0.0, "float16": 1e-3, "bfloat16": 8e-3}[dtype]
        err = np.linalg.norm(got - vecs, axis=1) / np.maximum(np.linalg.norm(vecs, axis=1), 1e-30)
        assert err.max() <= tol
        assert not got[3].any()
        seen = []
        for shard_keys, block in ix.iter_shards():
            assert block.dtype == np.float32
            assert np.array_equal(block, ix.rows(shard_keys))
            seen += shard_keys
        assert seen == keys
        with pytest.raises(KeyError, match="nope"):
            ix.rows([keys[0], "nope"])


def _order_violation(exact: np.ndarray, top: np.ndarray) -> float:
    """How far ranking `top` contradicts the exact scores: the largest score by which a row ranked lower (or
    left out) beats a row ranked higher. 0 means `top` is exactly the argsort's top."""
    s = exact[top]
    later_best = np.maximum.accumulate(s[::-1])[::-1][1:]
    rest = np.delete(exact, top)
    return float(max(0.0, (later_best - s[:-1]).max(), rest.max() - s.min()))


def test_half_types_keep_small_gradients_ranked(tmp_path):
    keys, vecs = _keys(2000), _grads(2000, 512, seed=1)
    queries = _grads(4, 512, seed=2)
    exact = queries @ vecs.T
    want = np.argsort(-exact, axis=1, kind="stable")[:, :50]
    top = {}
    for dtype in DTYPES:
        _build(tmp_path / dtype, keys, vecs, dtype=dtype, shard_rows=256, batch=500)
        with GradientIndex.open(tmp_path / dtype, key="K", dim=512, storage_dtype=dtype) as ix:
            top[dtype] = np.argsort(-ix.score(queries, keys), axis=1, kind="stable")[:, :50]
    assert np.array_equal(top["float32"], want)
    naive16 = queries @ vecs.astype(np.float16).astype(np.float32).T  # ~1e-6 entries are float16 subnormals
    top["naive16"] = np.argsort(-naive16, axis=1, kind="stable")[:, :50]

    # A score's error from rounding a row to m mantissa bits is at most 2^-m * |q| * |x|. Within that the f32
    # order is a coin toss (random data has such near-ties), so "equal ranking" means: every disagreement
    # with f32 is a near-tie far inside the storage type's resolution, and nearly every position agrees.
    resolution = np.linalg.norm(queries, axis=1) * np.linalg.norm(vecs, axis=1).max()
    def worst(name: str, bits: int) -> float:
        return max(_order_violation(exact[i], top[name][i]) / (resolution[i] * 2.0**-bits) for i in range(4))

    assert worst("float16", 11) < 0.1
    assert (top["float16"] == want).mean() >= 0.97
    assert worst("bfloat16", 8) < 0.1
    assert min(len(set(a) & set(b)) for a, b in zip(top["bfloat16"], want)) >= 48
    # The data is hard enough to matter: the plain float16 cast misorders beyond its own resolution.
    assert worst("naive16", 11) > 1.0 and (top["naive16"] == want).mean() < 0.8


def test_bfloat16_bits_match_torch_rounding():
    rng = np.random.default_rng(0)
    x = rng.standard_normal(20000).astype(np.float32) * np.float32(10.0) ** rng.integers(-30, 3, 20000)
    halfway = (np.arange(1, 2001, dtype=np.uint32) << 16 | 0x8000).view(np.float32)  # exact ties: round to even
    x = np.concatenate([x, halfway, -halfway, np.float32([0.0, -0.0, 1.0, -1.0])])
    want = torch.from_numpy(x).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    assert np.array_equal(_f32_to_bf16_bits(x), want)


def test_add_accepts_torch_dedupes_and_rejects_bad_rows(tmp_path):
    with GradientIndex.open(tmp_path / "ix", key="K", dim=4, shard_rows=3) as ix:
        ix.add(["a", "b", "a"], torch.tensor([[1.0, 0, 0, 0], [0, 1.0, 0, 0], [9.0, 9, 9, 9]]))
        ix.add(["b", "c"], np.array([[5.0, 5, 5, 5], [0, 0, 1.0, 0]], dtype=np.float32))
        assert ix.n_rows == 3 and ix.has("a") and not ix.has("d")
        with pytest.raises(ValueError, match="'d'"):
            ix.add(["d"], np.array([[np.nan, 0, 0, 0]]))
        with pytest.raises(ValueError, match="shape"):
            ix.add(["e"], np.zeros((1, 5)))
        assert not ix.has("d") and not ix.has("e")
        # First write wins: a content hash names one row.
        assert np.array_equal(ix.rows(["a", "b", "c"]), np.eye(4, dtype=np.float32)[:3])
        ix.add(["f"], np.full((1, 4), 2.0, np.float32))  # buffered, not yet in a shard, but readable
        assert np.array_equal(ix.rows(["f"]), np.full((1, 4), 2.0, np.float32))


# ------------------------------------------------------------------------------------------------ scoring


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_score_equals_the_plain_matmul_blockwise(tmp_path, dtype):
    n, dim = 300, 40
    keys, vecs = _keys(n), _grads(n, dim, seed=3)
    vecs[10:20] = 0.0
    vecs[50] = vecs[60]
    _build(tmp_path / "ix", keys, vecs, dtype=dtype, shard_rows=32, batch=64)
    rng = np.random.default_rng(4)
    order = list(rng.permutation(n)[:250]) + [7, 7, 50]  # a subset, shuffled, with repeats
    ask = [keys[i] for i in order]
    queries = _grads(5, dim, seed=5)
    queries[4] = 0.0  # every score tied
    with GradientIndex.open(tmp_path / "ix", key="K", dim=dim, storage_dtype=dtype) as ix:
        rows = ix.rows(ask)
        plain = queries @ rows.T
        assert np.array_equal(ix.score(queries, ask), plain)  # one block: the very same matmul
        assert np.array_equal(ix.score(queries[1], ask), (queries[1:2] @ rows.T)[0])
        blocked = ix.score(queries, ask, block_rows=37)
        per_block = [queries @ rows[a : a + 37].T for a in range(0, len(ask), 37)]
        assert np.array_equal(blocked, np.concatenate(per_block, axis=1))
        np.testing.assert_allclose(blocked, plain, rtol=1e-5, atol=1e-6 * np.abs(plain).max())
        # A single query is its own (1, dim) matmul: compared with score() of the same shape, not with row 0 of the
        # 5-query product (another BLAS kernel, other last bits on other CPUs).
        s0 = ix.score(queries[0], ask)
        assert np.array_equal(s0, (queries[0:1] @ rows.T)[0])
        np.testing.assert_allclose(s0, plain[0], rtol=1e-5, atol=1e-6 * np.abs(plain).max())
        assert np.array_equal(ix.score(queries[4], ask), np.zeros(len(ask), dtype=np.float32))


def test_scores_do_not_depend_on_sharding(tmp_path):
    keys, vecs = _keys(200), _grads(200, 64, seed=6)
    _build(tmp_path / "a", keys, vecs, shard_rows=64)
    _build(tmp_path / "b", keys[::-1], vecs[::-1], shard_rows=7, batch=3)
    queries = _grads(3, 64, seed=7)
    with GradientIndex.open(tmp_path / "a", key="K", dim=64) as a, \
            GradientIndex.open(tmp_path / "b", key="K", dim=64) as b:
        for br in (4096, 50):
            assert np.array_equal(a.score(queries, keys, block_rows=br), b.score(queries, keys, block_rows=br))


def test_score_streams_instead_of_loading_the_index(tmp_path):
    n, dim = 4096, 256  # 4 MiB of float32 rows in 16 shards
    keys = _keys(n)
    _build(tmp_path / "ix", keys, _grads(n, dim, seed=8), shard_rows=256, batch=1024)
    queries = _grads(2, dim, seed=9)
    with GradientIndex.open(tmp_path / "ix", key="K", dim=dim) as ix:
        tracemalloc.start()
        try:
            ix.score(queries, keys, block_rows=256)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
    assert peak < 4 * 256 * dim * 4, peak  # a few blocks of 256 rows, far below the 4 MiB index


# ----------------------------------------------------------------------------------------- reuse by key


def test_reorder_and_extension_reuse_rows(tmp_path):
    keys, vecs = _keys(40), _grads(40, 8)
    _build(tmp_path / "ix", keys, vecs)
    with GradientIndex.open(tmp_path / "ix", key="K", dim=8) as ix:
        shuffled = list(np.random.default_rng(0).permutation(keys))
        assert ix.missing(shuffled) == []
        extended = shuffled[:20] + ["new-1"] + shuffled[20:] + ["new-2", "new-1", keys[0]]
        assert ix.missing(extended) == [20, 41]  # a repeated new key is computed once
        ix.add(["new-1", "new-2"], np.ones((2, 8), np.float32))
        assert ix.missing(extended) == []
        assert np.array_equal(ix.rows(shuffled), vecs[[keys.index(k) for k in shuffled]])


# ------------------------------------------------------------------------------------------- corruption


def _shard(root: Path, i: int = 1) -> Path:
    return root / _manifest(root)["shards"][i]["file"]


@pytest.mark.parametrize("mode", ["refuse", "rebuild"])
@pytest.mark.parametrize("damage", ["flip", "truncate", "delete", "flip_norms"])
def test_damaged_shard_is_detected(tmp_path, caplog, mode, damage):
    root = tmp_path / "ix"
    keys, vecs = _keys(48), _grads(48, 16)
    _build(root, keys, vecs, dtype="float16")
    target = _shard(root)
    if damage == "flip_norms":
        target = root / _manifest(root)["shards"][1]["norms"]["file"]
    raw = bytearray(target.read_bytes())
    if damage in ("flip", "flip_norms"):
        raw[-5] ^= 0x01  # one bit, in the data rather than the header
        target.write_bytes(raw)
        reason = "corrupt"
    elif damage == "truncate":
        target.write_bytes(raw[:-40])
        reason = "truncated"
    else:
        target.unlink()
        reason = "missing"

    if mode == "refuse":
        with pytest.raises(IndexMismatch) as err:
            GradientIndex.open(root, key="K", dim=16, storage_dtype="float16", on_mismatch="refuse")
        assert err.value.reason == reason and err.value.path == target
        assert target.name in str(err.value) and reason in str(err.value)
        assert isinstance(err.value, IndexError_)
        return

    with caplog.at_level(logging.WARNING, logger="gradian.store.index"):
        ix = GradientIndex.open(root, key="K", dim=16, storage_dtype="float16")
    assert any(target.name in r.getMessage() and reason in r.getMessage() for r in caplog.records)
    with ix:
        assert ix.missing(keys) == list(range(16, 32))  # only the bad shard's rows are lost
        ix.add(keys[16:32], vecs[16:32])
    _build(tmp_path / "clean", keys, vecs, dtype="float16")
    opts = dict(key="K", dim=16, storage_dtype="float16", on_mismatch="refuse")
    with GradientIndex.open(root, **opts) as ix, GradientIndex.open(tmp_path / "clean", **opts) as clean:
        assert np.array_equal(ix.rows(keys), clean.rows(keys))


@pytest.mark.parametrize("change", [{"key": "OTHER"}, {"dim": 12}, {"storage_dtype": "bfloat16"}])
def test_foreign_index_is_detected(tmp_path, caplog, change):
    root = tmp_path / "ix"
    _build(root, _keys(20), _grads(20, 16))
    want = {"key": "K", "dim": 16, "storage_dtype": "float32", **change}
    with pytest.raises(IndexMismatch) as err:
        GradientIndex.open(root, on_mismatch="refuse", **want)
    assert err.value.reason == "foreign" and err.value.path == root / "manifest.json"
    assert "manifest.json" in str(err.value) and next(iter(change)) in str(err.value)

    with caplog.at_level(logging.WARNING, logger="gradian.store.index"):
        with GradientIndex.open(root, **want) as ix:
            assert ix.n_rows == 0
    aside = [p for p in tmp_path.iterdir() if p.name.startswith("ix.foreign-")]
    assert len(aside) == 1 and (aside[0] / "manifest.json").exists()
    assert any("foreign" in r.getMessage() and str(aside[0]) in r.getMessage() for r in caplog.records)
    assert _manifest(root)["key"] == want["key"] and not list(root.glob("shard-*"))


@pytest.mark.parametrize("content", [b"{not json", b'{"schema": "gradian.index/99"}', b'{"schema": "gradian.index/1"}'])
def test_unreadable_or_wrong_schema_manifest_is_detected(tmp_path, content):
    root = tmp_path / "ix"
    _build(root, _keys(20), _grads(20, 16))
    (root / "manifest.json").write_bytes(content)
    with pytest.raises(IndexMismatch, match="manifest.json") as err:
        GradientIndex.open(root, key="K", dim=16, on_mismatch="refuse")
    assert err.value.reason in ("unreadable", "foreign")
    with GradientIndex.open(root, key="K", dim=16) as ix:
        assert ix.n_rows == 0 and not list(root.glob("shard-*"))


def test_leftover_temp_and_orphan_files_removed(tmp_path):
    root = tmp_path / "ix"
    _build(root, _keys(20), _grads(20, 16), shard_rows=8)
    (root / ".tmp-shard-00009.npy.123").write_bytes(b"half a shard")
    (root / ".tmp-manifest.json.123").write_bytes(b"{")
    (root / "shard-00007.npy").write_bytes((root / "shard-00000.npy").read_bytes())  # replaced, never in a manifest
    with GradientIndex.open(root, key="K", dim=16, on_mismatch="refuse") as ix:
        assert ix.n_rows == 20
    names = sorted(p.name for p in root.iterdir())
    assert names == [".lock", "manifest.json", "shard-00000.npy", "shard-00001.npy", "shard-00002.npy"]


# ------------------------------------------------------------------------------- crash resume and locking

CHILD = textwrap.dedent(
    """
    import hashlib, json, os, signal, sys, time
    import numpy as np
    from gradian.store.index import GradientIndex

    root, n, dtype, kill_after, kill_point, first, sleep = sys.argv[1:8]
    n, kill_after, first, sleep = int(n), int(kill_after), int(first), float(sleep)
    DIM = 24
    keys = [hashlib.sha256(f"example-{i}".encode()).hexdigest() for i in range(first, first + n)]

    def grad(key):
        rng = np.random.default_rng(int(key[:15], 16))
        return (rng.standard_normal(DIM) * 1e-6).astype(np.float32)

    if kill_after >= 0:
        # Die at a chosen point of the write protocol, the way a SIGKILL or an OOM kill would.
        real_replace, shards = os.replace, [0]
        def replace(src, dst):
            name = os.path.basename(dst)
            if name.startswith("shard-") and not name.endswith(".norms.npy"):
                if kill_point == "mid_shard" and shards[0] == kill_after:
                    os.kill(os.getpid(), signal.SIGKILL)
                shards[0] += 1
            if name == "manifest.json" and kill_point == "before_manifest" and shards[0] == kill_after + 1:
                os.kill(os.getpid(), signal.SIGKILL)
            return real_replace(src, dst)
        os.replace = replace

    with GradientIndex.open(root, key="K", dim=DIM, storage_dtype=dtype, shard_rows=8) as ix:
        t_open = time.time()
        todo = ix.missing(keys)
        for a in range(0, len(todo), 5):
            batch = [keys[i] for i in todo[a : a + 5]]
            ix.add(batch, np.stack([grad(k) for k in batch]))
            time.sleep(sleep)
        t_close = time.time()
    print(json.dumps({"computed": len(todo), "open": t_open, "close": t_close}))
    """
)


def _child(tmp_path: Path, root: Path, n: int, *, dtype="float16", kill_after=-1, kill_point="none", first=0,
           sleep=0.0) -> subprocess.Popen:
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    env = {**os.environ, "PYTHONPATH": SRC, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}
    args = [sys.executable, str(script), str(root), str(n), dtype, str(kill_after), kill_point, str(first), str(sleep)]
    return subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _finish(proc) -> dict:
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    return json.loads(out)


@pytest.mark.parametrize("kill_point", ["mid_shard", "before_manifest"])
def test_killed_build_resumes_bit_identical(tmp_path, kill_point):
    root, clean = tmp_path / "ix", tmp_path / "clean"
    proc = _child(tmp_path, root, 60, kill_after=3, kill_point=kill_point)
    proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    assert len(_manifest(root)["shards"]) == 3  # the shards finished before the kill, and only those
    debris = {".tmp-", "shard-00003"}
    assert any(any(p.name.startswith(d) for d in debris) for p in root.iterdir())

    assert _finish(_child(tmp_path, root, 60))["computed"] == 60 - 3 * 8
    assert _finish(_child(tmp_path, clean, 60))["computed"] == 60
    assert not [p for p in root.iterdir() if p.name.startswith(".tmp-")]
    opts = dict(key="K", dim=24, storage_dtype="float16", on_mismatch="refuse")
    with GradientIndex.open(root, **opts) as ix, GradientIndex.open(clean, **opts) as ref:
        keys = ref.keys
        assert ix.n_rows == 60 and sorted(ix.keys) == sorted(keys)
        assert np.array_equal(ix.rows(keys).view(np.uint32), ref.rows(keys).view(np.uint32))


def test_concurrent_builders_leave_a_valid_index(tmp_path):
    root = tmp_path / "ix"
    # Overlapping key ranges, each builder slow enough that unlocked runs would interleave their writes.
    procs = [_child(tmp_path, root, 40, dtype="float32", first=f, sleep=0.03) for f in (0, 20)]
    runs = sorted((_finish(p) for p in procs), key=lambda r: r["open"])
    assert runs[0]["close"] <= runs[1]["open"]  # the lock serialized them
    assert sorted(r["computed"] for r in runs) == [20, 40]  # the second reused the first's rows
    _finish(_child(tmp_path, tmp_path / "ref", 60, dtype="float32"))
    with GradientIndex.open(root, key="K", dim=24, on_mismatch="refuse") as ix, GradientIndex.open(
        tmp_path / "ref", key="K", dim=24
    ) as ref:
        assert ix.n_rows == 60
        assert np.array_equal(ix.rows(ref.keys), ref.rows(ref.keys))


def test_lock_timeout_names_lock_and_holder(tmp_path):
    root = tmp_path / "ix"
    with GradientIndex.open(root, key="K", dim=4):
        t0 = time.monotonic()
        with pytest.raises(IndexLocked) as err:
            GradientIndex.open(root, key="K", dim=4, lock_timeout=0.3)
        assert 0.25 <= time.monotonic() - t0 < 5
        assert err.value.holder_pid == os.getpid()
        assert str(root / ".lock") in str(err.value) and f"pid {os.getpid()}" in str(err.value)
    with GradientIndex.open(root, key="K", dim=4, lock_timeout=0):  # released on close
        pass
