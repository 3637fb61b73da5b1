"""Optimizer-aware scores (`attribution.optimizer: adamw`): what removing a row does to an AdamW run, to first order.

Removing row z changes the (clipped) batch gradient of each step t that holds it by dg_t = -c_t g_z / n_t (c_t the
clip factor, n_t the step's supervised tokens). To first order, without propagating through later curvature, the
later AdamW updates u_s = -lr_s m^_s / (sqrt(v^_s) + eps) change by

    du_s = -lr_s a_s b1^(s-t) dg_t / (sqrt(v^_s) + eps)          a_s = (1-b1) / (1-b1^s)   (momentum: influence)
           -   u_s b_s b2^(s-t) g_t dg_t / (v^_s + eps^2)         b_s = (1-b2) / (1-b2^s)   (second-moment coupling)

so the query loss changes by q . sum_s du_s = -(q o M_t) . dg_t with M_t = K1_t + g_t o K2_t,
K1_t = sum_{s>=t} lr_s a_s b1^(s-t) / (sqrt(v^_s)+eps) and K2_t = sum_{s>=t} u_s b_s b2^(s-t) / (v^_s+eps^2)
(`bench/optimizer_aware.py` measures this exactly, step by step). The coupling term is what plain influence misses:
dropping a row lowers v where it had large gradients, so every other row's later steps there grow.

What `gradian train` records (`TrajectoryRecorder`, written beside the adapter as `TRAJECTORY_FILE`) is what makes
this scale: nothing per step but a few scalars (the step's rows, tokens, clip factor, learning rate) and nothing per
row; per epoch three adapter-sized tensors: the LoRA weights at the epoch's start, the epoch's mean K1 and its mean
K2 weighted by g_t^2 (per coordinate). Both are sums over later steps, so each epoch keeps a running b^(s-t) weight
and adds every later step's term as it happens. The g_t^2 weights matter: K2_t holds 1 / v_s, and a coordinate
whose gradient starts at zero (every LoRA A while B is still 0) has a tiny v in its first steps, so a plain mean of
K2 is dominated by steps where g_t o K2_t was small and blows up once multiplied by a later g_t (measured on the
demo: a coupling term 10^5 times too large, LDS -0.09); weighted by g_t^2 the mean is what the product sees (LDS
0.27, above the exact per-step predictor's 0.18 and the default's 0.14; bench/README.md). The recording is the size
of three checkpoints per epoch, whatever the number of steps or rows.

At attribution time (`trajectory_scores`) the epochs are replayed without training: at each epoch's start weights,
each recorded step's rows get their exact per-example gradients g_z (as `bench/optimizer_aware.py` takes them),
the step's batch gradient is rebuilt from them (g_t = c_t / n_t sum_z g_z), and each row's score for unit query q
adds -(c_t / n_t) (q o (K1_e + g_t o K2_e)) . g_z. One exact capture pass per epoch, streamed batch by batch; memory
is the queries times the LoRA width. The scores predict the change of the query loss per unit query norm, in the
sign of the other scores (positive: removing the row lowers the failure's loss: it caused it).
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

log = logging.getLogger(__name__)

TRAJECTORY_FILE = "optimizer_trajectory.safetensors"
SCHEMA = "gradian.trajectory/1"
TINY = 1e-12  # a running b^(s-t) weight below this adds nothing measurable: the epoch stops accumulating


# ------------------------------------------------------------------------------------------------ recording


class TrajectoryRecorder:
    """Passed to `training.loop.train_adapter` (`recorder=`): `start` before the first step, `step` after each
    optimizer step, `save` once the adapter is written. Keeps, per epoch, the LoRA weights at its start and the
    running sums of K1 and K2 (module docstring); per step, its rows, tokens, clip factor and learning rate."""

    def __init__(self):
        self.names: list[tuple[str, str]] = []  # (site, "A" | "B") per tracked parameter, in `params` order
        self.params: list = []
        self.starts: dict[int, list] = {}
        self.k1: dict[int, list] = {}
        self.k2: dict[int, list] = {}  # sum_t w_t K2_t over the epoch's steps t, w_t = g_t^2 (per coordinate)
        self.w2: dict[int, list] = {}  # running sum_{t in e, t <= s} w_t b2^(s-t)
        self.wsum: dict[int, list] = {}  # sum_t w_t
        self.r1: dict[int, float] = {}
        self.steps_in: dict[int, int] = {}
        self.meta: dict = {}
        self.steps: list[dict] = []
        self._last: Optional[list] = None
        self._epoch = 0

    def start(self, model, params: Sequence, opt) -> None:
        """Which trainable parameters are LoRA A/B weights (by site), their initial values, AdamW's constants."""
        from ..setup.model import lora_sites

        ids = {id(p): k for k, p in enumerate(params)}
        sites, _ = lora_sites(model, None)
        for s in sites:
            for side, w in (("A", s.A.weight), ("B", s.B.weight)):
                if id(w) in ids:
                    self.names.append((s.name, side))
                    self.params.append(w)
        g = opt.param_groups[0]
        b1, b2 = g["betas"]
        self.meta = {"betas": [float(b1), float(b2)], "eps": float(g["eps"]), "weight_decay": float(g["weight_decay"])}
        self._last = [p.detach().float().clone() for p in self.params]

    def step(self, opt, *, epoch: int, positions: Sequence[int], n_tok: float, grad_norm: Optional[float],
             max_grad_norm: Optional[float]) -> None:
        """After `opt.step()`: this step's K1/K2 terms added to every epoch still accumulating, and its scalars."""
        import torch

        b1, b2 = self.meta["betas"]
        eps = self.meta["eps"]
        if epoch != self._epoch:  # the first step of an epoch: the weights before it are the epoch's start
            self._epoch = epoch
            self.starts[epoch] = [x.clone() for x in self._last]
            for acc in (self.k1, self.k2, self.w2, self.wsum):
                acc[epoch] = [torch.zeros_like(x) for x in self._last]
            self.r1[epoch] = 0.0
            self.steps_in[epoch] = 0
        self.steps_in[epoch] += 1
        for e in self.r1:
            self.r1[e] = b1 * self.r1[e] + (1.0 if e == epoch else 0.0)
        lr = float(opt.param_groups[0]["lr"])
        with torch.no_grad():
            for k, p in enumerate(self.params):
                st = opt.state[p]
                s = float(st["step"])
                m_hat = st["exp_avg"].float() / (1 - b1 ** s)
                v_hat = st["exp_avg_sq"].float() / (1 - b2 ** s)
                x1 = (lr * (1 - b1) / (1 - b1 ** s)) / (v_hat.sqrt() + eps)
                u = -lr * m_hat / (v_hat.sqrt() + eps)  # the Adam part of the update: what v enters
                x2 = ((1 - b2) / (1 - b2 ** s)) * u / (v_hat + eps ** 2)
                w = p.grad.detach().float().square() if p.grad is not None else torch.zeros_like(x2)
                for e in self.k1:
                    if self.r1[e] > TINY:
                        self.k1[e][k].add_(x1, alpha=self.r1[e])
                    self.w2[e][k].mul_(b2)
                    if e == epoch:
                        self.w2[e][k].add_(w)
                        self.wsum[e][k].add_(w)
                    self.k2[e][k].add_(x2 * self.w2[e][k])
                self._last[k].copy_(p.detach().float())
        clip = 1.0
        if max_grad_norm and grad_norm is not None:
            clip = min(1.0, float(max_grad_norm) / (float(grad_norm) + 1e-6))  # torch's clip_grad_norm_ factor
        self.steps.append({"epoch": int(epoch), "rows": [int(i) for i in positions], "tokens": float(n_tok),
                           "clip": clip, "lr": lr})

    def tensors(self) -> dict:
        import torch

        out = {}
        for e in sorted(self.starts):
            n = max(self.steps_in[e], 1)
            for k, (site, side) in enumerate(self.names):
                out[f"start|{e}|{site}|{side}"] = self.starts[e][k].contiguous()
                out[f"k1|{e}|{site}|{side}"] = (self.k1[e][k] / n).contiguous()
                wsum = self.wsum[e][k]
                out[f"k2|{e}|{site}|{side}"] = torch.where(wsum > 0, self.k2[e][k] / wsum.clamp_min(1e-38),
                                                            torch.zeros_like(wsum)).contiguous()
        return out

    def save(self, adapter_dir: Path, *, n_rows: int, dataset_fingerprint: Optional[str]) -> Path:
        """Write `TRAJECTORY_FILE` into the adapter directory (temporary name, then renamed)."""
        from safetensors.torch import save_file

        path = Path(adapter_dir) / TRAJECTORY_FILE
        meta = {"schema": SCHEMA, "optimizer": "adamw", **self.meta, "n_rows": n_rows,
                "dataset_fingerprint": dataset_fingerprint, "epochs": sorted(self.starts),
                "sites": sorted({s for s, _ in self.names}), "steps": self.steps}
        tmp = path.parent / f".{path.name}.{os.getpid()}.tmp"
        try:
            save_file(self.tensors(), str(tmp), metadata={"meta": json.dumps(meta)})
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)
        return path


# ------------------------------------------------------------------------------------------------ reading


class Trajectory:
    """A recorded trajectory, read lazily epoch by epoch."""

    def __init__(self, path: Path, meta: dict):
        self.path, self.meta = Path(path), meta

    @property
    def epochs(self) -> list[int]:
        return list(self.meta["epochs"])

    @property
    def steps(self) -> list[dict]:
        return self.meta["steps"]

    def tensors(self, kind: str, epoch: int, sites) -> list:
        """[(A, B)] of `kind` (start, k1, k2) at `epoch` for each site (float32 tensors)."""
        from safetensors import safe_open

        with safe_open(str(self.path), framework="pt") as f:
            return [(f.get_tensor(f"{kind}|{epoch}|{s.name}|A"), f.get_tensor(f"{kind}|{epoch}|{s.name}|B"))
                    for s in sites]


def read_trajectory(adapter_dir: str | Path, *, n_rows: int, dataset_fingerprint: Optional[str], sites
                    ) -> tuple[Optional[Trajectory], str]:
    """The adapter's recorded trajectory when it fits this training set and these sites, else (None, why)."""
    from safetensors import safe_open

    path = Path(adapter_dir) / TRAJECTORY_FILE
    if not path.exists():
        return None, (f"{Path(adapter_dir)} has no {TRAJECTORY_FILE}: the adapter was not trained by `gradian train` "
                      "(or was trained before it recorded the optimizer's trajectory)")
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = json.loads((f.metadata() or {}).get("meta", "null"))
            keys = set(f.keys())
    except Exception as e:  # safetensors raises its own error types for a malformed file
        return None, f"{path}: not a readable safetensors file ({e})"
    if not isinstance(meta, dict) or meta.get("schema") != SCHEMA:
        return None, f"{path}: not a {SCHEMA} file"
    if meta.get("n_rows") != n_rows or (dataset_fingerprint and meta.get("dataset_fingerprint")
                                        not in (None, dataset_fingerprint)):
        return None, f"{path}: recorded on another training set ({meta.get('n_rows')} rows)"
    need = {f"{k}|{e}|{s.name}|{sd}" for k in ("start", "k1", "k2") for e in meta["epochs"] for s in sites
            for sd in ("A", "B")}
    if not need <= keys:
        return None, f"{path}: {len(need - keys)} tensors missing for the attributed LoRA sites"
    return Trajectory(path, meta), ""


# -------------------------------------------------------------------------------------------- the scores


def step_directions(q, k1, k2, g_hat):
    """(q o (K1 + g o K2)) per query for one site side: q [Q, ...], k1/k2/g_hat [...] -> [Q, ...]."""
    return q * (k1 + g_hat * k2)


def trajectory_scores(grads, traj: Trajectory, q_exact: np.ndarray, direction: str) -> np.ndarray:
    """Per-item optimizer-aware scores [Q, N] (module docstring) for the exact query gradients [Q, D_exact] of
    `grads` (an `engine.ModelGradients`), replaying `traj`'s epochs at their start weights. The model's LoRA
    weights are restored afterwards."""
    import torch

    from ..grads.capture import GradientCapture
    from ..grads.layout import site_shapes, split_directions
    from ..progress import progress_bar
    from ..projection import Projector
    from ..setup.batches import collate
    from .scoring import direction_sign

    sites = grads.sites
    q = np.asarray(q_exact, dtype=np.float64)
    qh = torch.as_tensor(q / np.maximum(np.linalg.norm(q, axis=1, keepdims=True), 1e-30), dtype=torch.float32)
    q_sites = split_directions(sites, qh)  # per site ([Q, r, d_in], [Q, d_out, r])
    n = len(grads.toks)
    out = np.zeros((q.shape[0], n))
    cap = GradientCapture(grads.model, sites, Projector(site_shapes(sites)), chunk=grads.chunk)
    device = next(grads.model.parameters()).device
    saved = [(s.A.weight.detach().clone(), s.B.weight.detach().clone()) for s in sites]
    steps_of = {e: [st for st in traj.steps if st["epoch"] == e] for e in traj.epochs}
    try:
        with progress_bar("optimizer-aware scores", total=sum(len(st["rows"]) for st in traj.steps)) as bar:
            for e in traj.epochs:
                with torch.no_grad():
                    for s, (a, b) in zip(sites, traj.tensors("start", e, sites)):
                        s.A.weight.copy_(a.to(s.A.weight))
                        s.B.weight.copy_(b.to(s.B.weight))
                k1 = traj.tensors("k1", e, sites)
                k2 = traj.tensors("k2", e, sites)
                for st in steps_of[e]:
                    rows = st["rows"]
                    if not rows:
                        continue
                    ids, attn, sup = collate([grads.toks[i] for i in rows], grads.pad_id)
                    per_site, _ = cap.site_grads(ids.to(device), attn.to(device), sup.to(device))
                    c = st["clip"] / max(st["tokens"], 1.0)
                    acc = torch.zeros(q.shape[0], len(rows))
                    for (dA, dB), (qa, qb), (k1a, k1b), (k2a, k2b) in zip(per_site, q_sites, k1, k2):
                        dA, dB = dA.detach().float().cpu(), dB.detach().float().cpu()
                        for G, qq, ka, kb in ((dA, qa, k1a, k2a), (dB, qb, k1b, k2b)):
                            g_hat = c * G.sum(0)
                            d = step_directions(qq, ka, kb, g_hat)  # [Q, ...]
                            acc -= c * torch.einsum("q...,b...->qb", d, G)
                    out[:, rows] += acc.double().numpy()
                    bar.advance(len(rows))
    finally:
        with torch.no_grad():
            for s, (a, b) in zip(sites, saved):
                s.A.weight.copy_(a)
                s.B.weight.copy_(b)
    return direction_sign(direction) * out


def trajectory_entry(traj: Trajectory) -> dict:
    """The report's `query.optimizer` entry of scores from `traj`."""
    return {"optimizer": "adamw", "epochs": len(traj.epochs), "steps": len(traj.steps), "file": str(traj.path),
            "rule": "first-order effect of removing each row on the recorded AdamW run (momentum and second-moment "
                    "coupling), per unit query norm; re-ranking, windows, spans and blame use the final adapter"}
