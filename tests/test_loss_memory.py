"""The chunked LM-head loss: its peak memory does not grow with supervised tokens x vocab, and its gradients are
the unchunked ones. Measured in a fresh process with the kernel's high-water mark (VmHWM, reset through
/proc/self/clear_refs before each measurement); bench/index_bench.py measures the same at a 128k vocab."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

SRC = str(Path(__file__).resolve().parents[1] / "src")

CHILD = textwrap.dedent(
    """
    import gc, json, sys
    sys.path.insert(0, SRC)
    import torch
    torch.set_num_threads(1)
    from gradian.grads.lm_head import chunked_head_loss
    from gradian.grads.objectives import naive_per_example_loss, supervised_positions

    def status(field):
        for line in open("/proc/self/status"):
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024.0
        raise SystemExit("no " + field)

    V, H, B = 8000, 16, 8
    torch.manual_seed(0)
    weight = torch.randn(V, H) * 0.1
    out = {}
    for T in (64, 128, 512):  # T=64 is a warm-up: first calls load kernels and allocator pools
        ids = torch.randint(0, V, (B, T + 1))
        sup = torch.ones(B, T + 1, dtype=torch.bool)
        hidden0 = torch.randn(B, T + 1, H)
        grads = {}
        for kind in ("chunked", "naive"):
            hidden = hidden0.clone().requires_grad_(True)
            gc.collect()
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            base = status("VmRSS")
            if kind == "naive":
                loss = naive_per_example_loss(hidden @ weight.T, ids, sup)
            else:
                b, pp, tp = supervised_positions(sup)
                tok = chunked_head_loss(hidden[b, pp], weight, None, ids[b, tp], chunk=128)
                loss = torch.zeros(B).index_add(0, b, tok)
            loss.sum().backward()
            out[f"{kind}_{T}"] = status("VmHWM") - base
            grads[kind] = (loss.detach(), hidden.grad)
            del loss, hidden
        (lc, gc_), (ln, gn) = grads["chunked"], grads["naive"]
        out[f"grad_rel_{T}"] = float((gc_ - gn).norm() / gn.norm())
        out[f"loss_rel_{T}"] = float((lc - ln).norm() / ln.norm())
    print(json.dumps(out))
    """
)


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux /proc/self/clear_refs")
def test_chunked_loss_peak_memory_is_flat_in_tokens_and_grads_match():
    # Large blocks through mmap, so a freed buffer leaves the RSS and the next measurement starts clean.
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, "-c", f"SRC = {SRC!r}\n" + CHILD], capture_output=True, text=True,
                       timeout=120, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    m = json.loads(r.stdout.strip().splitlines()[-1])
    # naive: B x T x V fp32 logits (and their softmax and gradient) -> grows 4x from T=128 to T=512
    assert m["naive_512"] > 2.5 * m["naive_128"] > 2.5 * 8 * 128 * 8000 * 4 / 2**20
    # chunked: one 128-row chunk of logits at a time, whatever the token count
    assert m["chunked_512"] < 0.1 * m["naive_512"]
    assert m["chunked_512"] < 1.5 * m["chunked_128"] + 4.0, m
    for t in (128, 512):
        assert m[f"grad_rel_{t}"] < 1e-6 and m[f"loss_rel_{t}"] < 1e-6, m
