"""torch.distributed helpers (`gradian.distributed`), in one process and in two gloo processes started by torchrun."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from gradian import distributed as D

# Two gloo processes under torchrun (minutes of the suite): `make test-scale` runs this module, `make test` does not.
pytestmark = pytest.mark.ddp

def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun_cmd(nproc: int = 2) -> list[str]:
    """torchrun on one node with a static rendezvous on a free loopback port (no network beyond 127.0.0.1)."""
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", str(nproc),
            "--master-addr", "127.0.0.1", "--master-port", str(free_port())]


def torchrun(script: str, tmp_path: Path, *args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    """`script` under torchrun; each rank writes its result to RESULTS/rank-R.json (the ranks share one stdout, where
    their lines can interleave)."""
    f = tmp_path / "script.py"
    f.write_text(script)
    (tmp_path / "results").mkdir(exist_ok=True)
    env = {**os.environ, "GRADIAN_THREADS": "1", "OMP_NUM_THREADS": "1", "GRADIAN_PROGRESS": "0",
           "RESULTS": str(tmp_path / "results")}
    return subprocess.run([*torchrun_cmd(), str(f), *args], capture_output=True, text=True, env=env, timeout=timeout)


def results(tmp_path: Path) -> list[dict]:
    return [json.loads(f.read_text()) for f in sorted((tmp_path / "results").glob("rank-*.json"))]


def test_single_process_is_the_plain_case():
    r = D.current()
    assert (r.rank, r.world, r.is_main, r.active) == (0, 1, True, False)
    assert r.mine(5) == [0, 1, 2, 3, 4] and D.shard("abc") == ["a", "b", "c"]
    assert D.gather_by_index({2: "x", 0: "y"}) == {0: "y", 2: "x"}
    assert D.ordered_sum({0: np.ones(2), 1: 2 * np.ones(2)}, 2).tolist() == [3.0, 3.0]
    assert D.run_owned(3, lambda j: j * j) == {0: 0, 1: 1, 2: 4}
    c = D.RowCounter("t")
    assert c.add(3) == 3 and c.add(4) == 7
    assert D.broadcast({"a": 1}) == {"a": 1}


SCRIPT = r"""
import json, sys
import numpy as np
from gradian import distributed as D
r = D.init("cpu")
rng = np.random.default_rng(0)
parts = [rng.standard_normal(1000) * 10.0 ** rng.integers(-8, 8) for _ in range(7)]
local = {j: parts[j] for j in range(7) if r.owns(j)}
got = D.ordered_sum(local, 7, start=np.zeros(1000))
want = np.zeros(1000)
for p in parts:
    want = want + p
res = D.run_owned(5, lambda j: (r.rank, j * 10))
c = D.RowCounter("rows")
c.add(3 + r.rank)
D.barrier()
total = c.add(0)
b = D.broadcast({"from": r.rank})
out = {"rank": r.rank, "world": r.world, "bitwise": bool(np.array_equal(got, want)), "owners": {str(k): v[0] for k, v in res.items()},
       "values": [res[j][1] for j in range(5)], "total": total, "broadcast": b["from"]}
import os, pathlib
pathlib.Path(os.environ["RESULTS"], f"rank-{r.rank}.json").write_text(json.dumps(out))
D.finalize()
"""


def test_two_gloo_processes_gather_in_order_and_sum_bit_for_bit(tmp_path):
    p = torchrun(SCRIPT, tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    res = results(tmp_path)
    assert sorted(r["rank"] for r in res) == [0, 1] and all(r["world"] == 2 for r in res)
    for r in res:
        assert r["bitwise"]  # the chunk-order sum equals one process's loop bit for bit
        assert r["owners"] == {"0": 0, "1": 1, "2": 0, "3": 1, "4": 0}  # unit j is rank j % 2's
        assert r["values"] == [0, 10, 20, 30, 40] and r["total"] == 3 + 4 and r["broadcast"] == 0


ROWS = r"""
import json, sys
import numpy as np
from gradian import distributed as D
import gradian.store.index as ix
from gradian.store.index import GradientIndex
from gradian.store.rows import RowSource
r = D.init("cpu")
root = sys.argv[1]
ix.SCORE_BLOCK_BYTES = 4 * 16 * 37  # score blocks of 37 rows, so 500 rows make 14 of them
if r.is_main:
    X = np.random.default_rng(0).standard_normal((500, 16)).astype(np.float32)
    with GradientIndex.open(root, key="k", dim=16, shard_rows=64) as g:
        g.add([f"r{i}" for i in range(500)], X)
D.barrier()
g = GradientIndex.open(root, key="k", dim=16, read_only=True)
keys = [f"r{i}" for i in range(500)][::-1] + ["r3"]
src = RowSource(index=g, row_keys=keys, memory_bytes=8 * 16 * 29)  # chunks of 29 rows
q = np.random.default_rng(1).standard_normal((3, 16)).astype(np.float32)
got = src.inner(q)
src.reads = 0
m = src.sum_chunks(lambda rows: np.square(rows).sum(0), np.zeros(16))
reads = src.reads
with D.alone():  # one process's computation, on this rank alone
    want = src.inner(q)
    wm = src.sum_chunks(lambda rows: np.square(rows).sum(0), np.zeros(16))
import os, pathlib
pathlib.Path(os.environ["RESULTS"], f"rank-{r.rank}.json").write_text(json.dumps({"rank": r.rank, "inner": bool(np.array_equal(got, want)), "shape": list(got.shape),
      "sum": bool(np.array_equal(m, wm)), "reads": reads, "chunks": len(src.bounds())}))
g.close()
D.finalize()
"""


def test_scores_and_row_statistics_split_over_ranks_equal_one_process(tmp_path):
    """RowSource under torchrun: score blocks and statistic chunks dealt out and put back in order, one process's
    bits on every rank, each rank reading its share of the index."""
    p = torchrun(ROWS, tmp_path, str(tmp_path / "ix"))
    assert p.returncode == 0, p.stderr[-3000:]
    res = results(tmp_path)
    assert sorted(r["rank"] for r in res) == [0, 1]
    for r in res:
        assert r["inner"] and r["shape"] == [3, 501] and r["sum"]
        assert r["chunks"] == 18 and r["reads"] == 9  # 18 chunks of 29 rows: 9 read by each rank


# ------------------------------------------------------------------------------- the verbs under torchrun

ENV = {"GRADIAN_THREADS": "1", "OMP_NUM_THREADS": "1", "GRADIAN_PROGRESS": "0"}


def gradian(*args: str, nproc: int = 1, timeout: int = 600) -> subprocess.CompletedProcess:
    """`gradian ARGS` in a fresh process, or under torchrun with `nproc` gloo processes."""
    head = [*torchrun_cmd(nproc), "-m", "gradian"] if nproc > 1 else [sys.executable, "-m", "gradian"]
    return subprocess.run([*head, *args], capture_output=True, text=True, env={**os.environ, **ENV}, timeout=timeout)


@pytest.fixture(scope="module")
def demo_cfg(tmp_path_factory) -> Path:
    from gradian.config import load_config
    from gradian.demo.run import prepare_demo
    from gradian.training.loop import train_adapter

    run = tmp_path_factory.mktemp("ddp-demo")
    cfg_path = prepare_demo(run, progress=False)
    train_adapter(load_config(cfg_path), progress=False)
    return cfg_path


def _manifests(cache: Path) -> list[dict]:
    return [json.loads(m.read_text()) for m in sorted(cache.glob("*/manifest.json"))]


def _vectors(index_dir: Path) -> dict[str, np.ndarray]:
    m = json.loads((index_dir / "manifest.json").read_text())
    out = {}
    for s in m["shards"]:
        block = np.load(index_dir / s["file"])
        out.update({k: block[i] for i, k in enumerate(s["keys"])})
    return out


@pytest.fixture(scope="module")
def one_and_two(demo_cfg):
    """The demo attributed by one process and by two (torchrun, gloo), each with its own output and index."""
    run = demo_cfg.parent
    runs = {}
    for n in (1, 2):
        p = gradian("attribute", str(demo_cfg), "--set", f"output=out{n}", "--set", f"grads.cache_dir=ix{n}", nproc=n)
        assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
        runs[n] = (run / f"out{n}", run / f"ix{n}", p)
    return runs


def test_two_processes_give_the_scores_of_one(one_and_two):
    (out1, _, _), (out2, _, p2) = one_and_two[1], one_and_two[2]
    assert np.array_equal(np.load(out1 / "scores.npy"), np.load(out2 / "scores.npy"))  # bit for bit
    a, b = (json.loads((o / "report.json").read_text()) for o in (out1, out2))
    assert a["verdict"] == b["verdict"] == "attributed"
    assert [r["position"] for r in a["ranking"]] == [r["position"] for r in b["ranking"]]
    assert a["capability"] == b["capability"] and a["accused"] == b["accused"]
    assert p2.stdout.count("report: ") == 1  # rank 0 alone prints


def test_a_smoke_test_over_two_processes_equals_one(demo_cfg):
    """No eval set: each rank streams its batches' gradient norms (`row_pass.gradient_norms`), gathered; the scores
    and the agreement flag are one process's, and no index is built."""
    run = demo_cfg.parent
    got = {}
    for n in (1, 2):
        p = gradian("attribute", str(demo_cfg), "--set", "data.eval=null", "--set", f"output=smoke{n}",
                    "--set", f"grads.cache_dir=smoke-ix{n}", nproc=n)
        assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
        got[n] = json.loads((run / f"smoke{n}" / "report.json").read_text())
        assert not (run / f"smoke-ix{n}").exists()
    assert np.array_equal(np.load(run / "smoke1" / "scores.npy"), np.load(run / "smoke2" / "scores.npy"))
    assert got[1]["verdict"] == got[2]["verdict"] == "smoke_test"
    assert [f["id"] for f in got[1]["flags"]] == [f["id"] for f in got[2]["flags"]]


def test_the_manifest_lists_both_ranks_shards_and_one_process_reuses_them(one_and_two, demo_cfg):
    _, ix2, _ = one_and_two[2]
    mans = _manifests(ix2)
    assert mans  # the final adapter's index and one per checkpoint
    for m in mans:
        assert {s.get("origin") for s in m["shards"]} == {"rank 0 of 2", "rank 1 of 2"}
        assert sum(s["rows"] for s in m["shards"]) == 300
    assert not list(ix2.glob("*/parts"))  # adopted, nothing left beside the index
    p = gradian("attribute", str(demo_cfg), "--set", "output=out-reuse", "--set", "grads.cache_dir=ix2")
    assert p.returncode == 0, p.stderr[-3000:]
    rep = json.loads((demo_cfg.parent / "out-reuse" / "report.json").read_text())
    assert rep["index"]["built_rows"] == 0 and rep["index"]["reused_rows"] == 300  # no capture at all
    assert np.array_equal(np.load(demo_cfg.parent / "out-reuse" / "scores.npy"),
                          np.load(one_and_two[1][0] / "scores.npy"))


KILL = r"""
import os, signal, sys
# rank 1 dies (SIGKILL, as an OOM kill would) while writing its third shard
if os.environ.get("RANK") == "1":
    import gradian.store.index as ix
    real, seen = ix._atomic_write, [0]
    def dying(directory, name, write):
        if name.endswith(".npy") and "parts" in str(directory):
            seen[0] += 1
            if seen[0] == 3:
                os.kill(os.getpid(), signal.SIGKILL)
        return real(directory, name, write)
    ix._atomic_write = dying
from gradian.cli import app
app(sys.argv[1:], prog_name="gradian")
"""


def test_a_killed_rank_loses_only_its_unfinished_shard(demo_cfg, tmp_path):
    sets = ["--set", "attribution.checkpoints=1", "--set", "grads.shard_rows=16"]
    cache = demo_cfg.parent / "ix-kill"
    script = tmp_path / "kill.py"
    script.write_text(KILL)
    p = subprocess.run([*torchrun_cmd(2), str(script), "index", str(demo_cfg), *sets, "--set",
                        f"grads.cache_dir={cache}"], capture_output=True, text=True, env={**os.environ, **ENV},
                       timeout=600)
    assert p.returncode != 0  # torchrun stops the group when a rank dies
    (root,) = [d for d in cache.iterdir() if d.is_dir()]
    # A shard is sealed when its rank's manifest names it. Counting files would race: torchrun's SIGTERM can reach
    # rank 0 between renaming a shard into place and writing the manifest that names it; that file is debris the
    # rerun must not adopt (CI once saw 6 files, 5 sealed).
    sealed = {r.name: json.loads((r / "manifest.json").read_text())["shards"] if (r / "manifest.json").exists() else []
              for r in sorted((root / "parts").glob("rank-*"))}
    left = [s for shards in sealed.values() for s in shards]
    assert len(sealed["rank-1"]) == 2  # its two sealed shards survive
    assert left
    # the rerun (one process: the parts are any later run's, whatever its world size) adopts them and resumes
    q = gradian("index", str(demo_cfg), *sets, "--set", f"grads.cache_dir={cache}")
    assert q.returncode == 0, q.stderr[-3000:]
    m = json.loads((root / "manifest.json").read_text())
    adopted = [s for s in m["shards"] if s.get("origin", "").endswith("earlier run")]
    assert len(adopted) == len(left) and not (root / "parts").exists()
    assert f"built {300 - sum(s['rows'] for s in left)}" in " ".join(q.stdout.split())
    # equal to an uninterrupted build, row for row and bit for bit
    ref = demo_cfg.parent / "ix-ref"
    r = gradian("index", str(demo_cfg), *sets, "--set", f"grads.cache_dir={ref}")
    assert r.returncode == 0, r.stderr[-3000:]
    (ref_root,) = [d for d in ref.iterdir() if d.is_dir()]
    got, want = _vectors(root), _vectors(ref_root)
    assert got.keys() == want.keys() and len(got) == 300
    assert all(np.array_equal(got[k], want[k]) for k in want)


def test_a_rank_error_names_the_rank_and_stops_the_group(demo_cfg):
    """`--nproc 2` (torchrun underneath): each failing rank prints its own one-paragraph error, exit 2, and no
    traceback from torchrun's agent."""
    p = gradian("attribute", str(demo_cfg), "--set", "model.adapter=nope", "--set", "output=out-bad", "--nproc", "2")
    assert p.returncode == 2
    text = " ".join(p.stderr.split())
    assert "rank 0 of 2: model.adapter: 'nope' does not exist" in text
    assert "torchrun stopped the other ranks" in text and "Traceback" not in p.stderr
    assert not (demo_cfg.parent / "out-bad" / "report.json").exists()


def test_a_projected_index_fitted_once_and_re_ranked_over_two_ranks_equals_one_process(demo_cfg):
    """The data-aware basis fitted by rank 0 and read by rank 1, the exact re-rank's batches split: the same
    scores, re-ranked order, projection self-check and spans as one process."""
    sets = ["--set", "attribution.checkpoints=1", "--set", "grads.projection_dim=64"]
    runs = {}
    for n in (1, 2):
        p = gradian("attribute", str(demo_cfg), *sets, "--set", f"output=proj{n}", "--set",
                    f"grads.cache_dir=pix{n}", nproc=n)
        assert p.returncode == 0, p.stderr[-3000:]
        runs[n] = demo_cfg.parent / f"proj{n}"
    assert np.array_equal(np.load(runs[1] / "scores.npy"), np.load(runs[2] / "scores.npy"))
    a, b = (json.loads((runs[n] / "report.json").read_text()) for n in (1, 2))
    assert a["index"]["projection"]["kind"] == "data-aware" and a["index"]["fidelity"]["reranked"]
    assert a["index"]["projection"]["basis_sha256"] == b["index"]["projection"]["basis_sha256"]
    assert a["index"]["fidelity"] == b["index"]["fidelity"] and a["spans"] == b["spans"]
    assert a["ranking"] == b["ranking"]


def test_verify_spreads_its_retrains_over_ranks_and_gets_one_process_result(one_and_two, demo_cfg):
    """verify's retrains, one per rank at a time (gathered in job order): verify.json as one process writes it."""
    got = {}
    for n in (1, 2):
        p = gradian("verify", str(demo_cfg), "--set", f"output=out{n}", "--set", f"grads.cache_dir=ix{n}",
                    "--controls", "2", nproc=n)
        assert p.returncode == 0, p.stderr[-3000:]
        got[n] = json.loads((demo_cfg.parent / f"out{n}" / "verify.json").read_text())
    for key in ("accused", "controls", "reference", "confirmed", "top_k", "base", "tuned"):
        a, b = got[1][key], got[2][key]
        if isinstance(a, dict):
            a = {k: v for k, v in a.items() if not k.endswith("_seconds")}
            b = {k: v for k, v in b.items() if not k.endswith("_seconds")}
        if isinstance(a, list):
            a = [{k: v for k, v in c.items() if not k.endswith("_seconds")} for c in a]
            b = [{k: v for k, v in c.items() if not k.endswith("_seconds")} for c in b]
        assert a == b, key
    assert got[2]["confirmed"] is True and got[2]["reference"]["reproduced_bit_for_bit"]
    assert not (demo_cfg.parent / "out2" / "verify").exists()  # the retrained adapters removed, by rank 0


def test_conversations_ranked_by_exchange_over_two_processes_equal_one(tmp_path):
    """The one pass with per-exchange parts (tiny conversation4) under torchrun: held rows' exchanges and streamed
    batches' exchanges gathered in order, the same scores bit for bit and the same `turn` of every ranking row."""
    from test_precondition import trained_scenario

    cfg_path = trained_scenario(tmp_path / "conv4", "conversation4", 0)
    outs = {}
    for n in (1, 2):
        p = gradian("attribute", str(cfg_path), "--set", f"output=out{n}", nproc=n)
        assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
        outs[n] = cfg_path.parent / f"out{n}"
    assert np.array_equal(np.load(outs[1] / "scores.npy"), np.load(outs[2] / "scores.npy"))
    a, b = (json.loads((o / "report.json").read_text()) for o in outs.values())
    assert [r.get("turn") for r in a["ranking"]] == [r.get("turn") for r in b["ranking"]]
    assert all("turn" in r for r in a["ranking"])
