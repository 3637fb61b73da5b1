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

TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]


def torchrun(script: str, tmp_path: Path, *args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    f = tmp_path / "script.py"
    f.write_text(script)
    env = {**os.environ, "GRADIAN_THREADS": "1", "OMP_NUM_THREADS": "1", "GRADIAN_PROGRESS": "0"}
    return subprocess.run([*TORCHRUN, str(f), *args], capture_output=True, text=True, env=env, timeout=timeout)


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
print("RESULT " + json.dumps(out), flush=True)
D.finalize()
"""


def test_two_gloo_processes_gather_in_order_and_sum_bit_for_bit(tmp_path):
    p = torchrun(SCRIPT, tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    res = [json.loads(l.split("RESULT ", 1)[1]) for l in p.stdout.splitlines() if "RESULT " in l]
    assert sorted(r["rank"] for r in res) == [0, 1] and all(r["world"] == 2 for r in res)
    for r in res:
        assert r["bitwise"]  # the chunk-order sum equals one process's loop bit for bit
        assert r["owners"] == {"0": 0, "1": 1, "2": 0, "3": 1, "4": 0}  # unit j is rank j % 2's
        assert r["values"] == [0, 10, 20, 30, 40] and r["total"] == 3 + 4 and r["broadcast"] == 0
