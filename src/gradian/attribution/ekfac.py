"""EK-FAC (George et al. 2018; Grosse et al. 2023, kronfluence): `attribution.preconditioner: ekfac`.

Each LoRA site is two Linear modules, A (d_in -> r) and B (r -> d_out); EK-FAC treats each as its own block. For a
module with inputs a_t and output gradients g_t (per token t), K-FAC approximates the Fisher of its weight gradient
dW = sum_t g_t a_t^T by  E[g g^T] (x) E[a a^T]: the output-gradient covariance S and the activation covariance C,
accumulated over every real token (attention mask) of every training row. With S = Q_S diag Q_S^T and
C = Q_C diag Q_C^T (eigendecomposed in float64), EK-FAC keeps the Kronecker eigenbasis and replaces the eigenvalues
by the per-example second moments in it (the correction):

    Lambda_ij = (1/N) sum_n [Q_S^T dW_n Q_C]_ij^2        (dW_n: row n's gradient, the summed supervised-token loss)

and applies, to a query gradient G of the module,

    H^-1 G = Q_S ( (Q_S^T G Q_C) / (Lambda + delta) ) Q_C^T,    delta = damping x mean(Lambda)  (kronfluence's rule,
                                                                  damping 0.1 by default, per module)

Only the few queries are preconditioned; rows are scored against them by the index's inner products. Everything is
in parameter space: with a projected index the exact query is preconditioned, then projected with the index's
projector (`to_index`), and its exact re-rank uses the preconditioned exact query itself.

Statistics are streamed: one model pass over the training rows (`setup.batches`, the index's length order)
accumulates the covariances of a group of sites (float32 sums, at most `memory_bytes` of them at a time: more
groups mean more passes, never more memory), then the correction streams the rows' exact per-example gradients:
read from the index when it is exact and float32, else from a second model pass. Nothing grows with rows.

The fitted factors live beside the index, one safetensors file per site group (written as the group is fitted, so
memory holds one group's factors at a time), their sha256 and what they were fitted for in `MANIFEST_FILE`, written
last; factors fitted for other sites or rows, or whose bytes no longer match the sha256, are refitted.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

from ..grads.layout import SiteShape, exact_widths, site_shapes

log = logging.getLogger(__name__)

KIND = "ekfac"
SCHEMA = "gradian.ekfac/1"
EKFAC_VERSION = 1  # bump when the statistics change for the same settings: cached factors become foreign
FACTORS_PREFIX = "ekfac_factors-"  # one safetensors file per site group: ekfac_factors-0000.safetensors, ...
MANIFEST_FILE = "ekfac_factors.json"
DEFAULT_DAMPING = 0.1  # x the mean corrected eigenvalue of each module: kronfluence's heuristic
DEFAULT_MEMORY_BYTES = 2 << 30  # covariance sums held at a time (float32); more sites than that take more passes
SIDES = ("A", "B")


# ------------------------------------------------------------------------------------------- pure maths


def eigenbasis(cov: np.ndarray) -> np.ndarray:
    """Eigenvectors (columns) of a symmetric covariance, in float64. The eigenvalues are not kept: EK-FAC replaces
    them by the corrected ones, and the count a covariance is divided by does not change its eigenvectors."""
    c = np.asarray(cov, dtype=np.float64)
    _, v = np.linalg.eigh((c + c.T) / 2)
    return v


def rotate(G: np.ndarray, left: np.ndarray, right: np.ndarray) -> np.ndarray:
    """left^T G right for G [..., m, n] (the module gradient in the Kronecker eigenbasis)."""
    return np.swapaxes(left, -1, -2) @ G @ right


def unrotate(R: np.ndarray, left: np.ndarray, right: np.ndarray) -> np.ndarray:
    """left R right^T: back from the eigenbasis."""
    return left @ R @ np.swapaxes(right, -1, -2)


def corrected_eigenvalues(grads: np.ndarray, left: np.ndarray, right: np.ndarray) -> np.ndarray:
    """(1/N) sum_n (left^T G_n right)^2 for per-example module gradients G [N, m, n] (reference, in memory)."""
    R = rotate(np.asarray(grads, dtype=np.float64), left, right)
    return np.square(R).mean(0)


def module_damping(lam: np.ndarray, damping: float) -> float:
    """delta = damping x mean corrected eigenvalue; 1 for a module without any gradient (nothing to divide)."""
    m = float(np.mean(lam)) if lam.size else 0.0
    return damping * m if m > 0 else 1.0


def precondition_module(G: np.ndarray, left: np.ndarray, right: np.ndarray, lam: np.ndarray, delta: float
                        ) -> np.ndarray:
    """Q_S ((Q_S^T G Q_C) / (Lambda + delta)) Q_C^T for query gradients G [Q, m, n]."""
    return unrotate(rotate(G, left, right) / (lam + delta), left, right)


def ekfac_dense(G: np.ndarray, a_cov: np.ndarray, g_cov: np.ndarray, damping: float = DEFAULT_DAMPING) -> np.ndarray:
    """Reference for one module: the dense EK-FAC matrix (Q (x) Q) diag(Lambda + delta) (Q (x) Q)^T over vec(dW)
    (row-major dW [m, n], m outputs, n inputs), from per-example gradients G [N, m, n] and the two covariances.
    Tests invert it with a dense solve and compare with `precondition_module`."""
    qs, qc = eigenbasis(g_cov), eigenbasis(a_cov)
    lam = corrected_eigenvalues(G, qs, qc)
    K = np.kron(qs, qc)  # vec_row(Q_S R Q_C^T) = (Q_S (x) Q_C) vec_row(R)
    return K @ np.diag((lam + module_damping(lam, damping)).ravel()) @ K.T


# ------------------------------------------------------------------------------------------ the factors


@dataclass
class ModuleFactors:
    """One Linear module's EK-FAC factors: gradient-side and activation-side eigenbases and the corrected
    eigenvalues [d_out, d_in] of its weight."""

    left: np.ndarray  # Q_S [m, m] (output-gradient covariance)
    right: np.ndarray  # Q_C [n, n] (activation covariance)
    lam: np.ndarray  # [m, n] float64


def _site_numel2(s: SiteShape) -> int:
    """Floats of a site's four covariances: A: (r x r) gradient side, (d_in x d_in) activations; B: (d_out x d_out)
    and (r x r)."""
    return s.d_in ** 2 + s.d_out ** 2 + 2 * s.r ** 2


def site_groups(sites: Sequence[SiteShape], memory_bytes: int) -> list[list[int]]:
    """Consecutive sites whose float32 covariance sums fit `memory_bytes` together (a site alone always forms a
    group, however large): one statistics pass per group."""
    groups: list[list[int]] = []
    cur: list[int] = []
    used = 0
    for i, s in enumerate(sites):
        b = 4 * _site_numel2(s)
        if cur and used + b > memory_bytes:
            groups.append(cur)
            cur, used = [], 0
        cur.append(i)
        used += b
    if cur:
        groups.append(cur)
    return groups


class FactorStore:
    """The fitted factors of every site, in memory or read site by site from the group files beside the index."""

    def __init__(self, sites: Sequence[SiteShape], memory: Optional[dict] = None,
                 files: Optional[dict[int, Path]] = None):
        self.sites = list(sites)
        self._mem = memory
        self.files = files or {}  # site index -> the safetensors file holding it
        self._lam: dict = {}

    def _read(self, i: int, side: str, what: str) -> np.ndarray:
        from safetensors import safe_open

        with safe_open(str(self.files[i]), framework="numpy") as f:
            return f.get_tensor(f"{i}|{side}|{what}")

    def module(self, i: int, side: str) -> ModuleFactors:
        if self._mem is not None:
            return self._mem[(i, side)]
        return ModuleFactors(self._read(i, side, "left"), self._read(i, side, "right"), self.lam(i, side))

    def lam(self, i: int, side: str) -> np.ndarray:
        if self._mem is not None:
            return self._mem[(i, side)].lam
        if (i, side) not in self._lam:
            self._lam[(i, side)] = self._read(i, side, "lam").astype(np.float64)
        return self._lam[(i, side)]


@dataclass
class EkfacPreconditioner:
    """`attribution.preconditioner: ekfac`, fitted: `apply` preconditions exact (parameter-space) queries."""

    store: FactorStore
    damping: float = DEFAULT_DAMPING
    info: dict = field(default_factory=dict)  # how the factors were obtained (cache, passes, correction source)
    kind: str = KIND

    @property
    def sites(self) -> list[SiteShape]:
        return self.store.sites

    def deltas(self) -> dict:
        return {(i, sd): module_damping(self.store.lam(i, sd), self.damping)
                for i in range(len(self.sites)) for sd in SIDES}

    def apply(self, Q: np.ndarray) -> np.ndarray:
        """H^-1 q for each exact query row of Q [Q, D_exact] (float64 out), site by site, module by module."""
        Q = np.atleast_2d(np.asarray(Q, dtype=np.float64))
        widths = exact_widths(self.sites)
        if Q.shape[1] != sum(widths):
            raise ValueError(f"ekfac: queries are {Q.shape[1]} wide, the sites' exact width is {sum(widths)}")
        out = np.empty_like(Q)
        deltas = self.deltas()
        a = 0
        for i, s in enumerate(self.sites):
            na, nb = s.r * s.d_in, s.d_out * s.r
            for sd, (lo, m, n) in (("A", (a, s.r, s.d_in)), ("B", (a + na, s.d_out, s.r))):
                f = self.store.module(i, sd)
                G = Q[:, lo : lo + m * n].reshape(-1, m, n)
                P = precondition_module(G, f.left.astype(np.float64), f.right.astype(np.float64), f.lam,
                                        deltas[(i, sd)])
                out[:, lo : lo + m * n] = P.reshape(Q.shape[0], -1)
            a += na + nb
        return out

    def to_index(self, X: np.ndarray, projector) -> np.ndarray:
        """Exact directions [K, D_exact] -> the index's space with its projector (the identity when exact)."""
        X = np.atleast_2d(np.asarray(X, dtype=np.float64))
        if projector.exact:
            return X
        import torch

        from ..grads.layout import split_directions

        parts = [projector.project(i, dA, dB) for i, (dA, dB) in enumerate(split_directions(self.sites, X))]
        return torch.cat(parts, dim=1).double().numpy()

    def describe(self) -> dict:
        lams = [d for d in self.deltas().values()]
        return {"kind": KIND, "damping": float(self.damping),
                "damping_rule": "per LoRA module (the A and the B of each site): delta = damping x the mean "
                                "corrected eigenvalue of that module (kronfluence's heuristic)",
                "lambda_range": [float(min(lams)), float(max(lams))] if lams else [0.0, 0.0],
                "factors": dict(self.info)}


# --------------------------------------------------------------------------------------- the statistics


def _masked(x, attn):
    """Tokens of [B, T, d] where the attention mask is 1, as [n, d] float32."""
    return x.float()[attn.bool()]


def covariance_pass(model, sites, toks, positions, batch_size: int, pad_id: int, chunk: int, bar=None) -> dict:
    """One pass over the rows: per site, the float32 sums of the A input (activation) covariance, the A output
    gradient covariance, the B input and B output gradient covariances, over every real token; and the token count.
    The gradients are those of each row's summed supervised-token loss (the index's loss)."""
    import torch

    from ..grads.capture import _Recorder
    from ..grads.objectives import per_example_loss
    from ..setup.batches import batches

    device = next(model.parameters()).device
    z = lambda d: torch.zeros(d, d, dtype=torch.float32, device=device)  # noqa: E731
    sums = {i: {"A_act": z(s.d_in), "A_grad": z(s.r), "B_act": z(s.r), "B_grad": z(s.d_out)}
            for i, s in enumerate(sites)}
    tokens = 0
    for part, ids, attn, sup in batches(toks, positions, batch_size, pad_id, device):
        with _Recorder(sites) as rec:
            losses = per_example_loss(model, ids, attn, sup, chunk=chunk)
        tokens += int(attn.sum())
        targets, spans = [], []
        for i in range(len(sites)):
            spans.append((len(targets), len(rec.a_out[i]), len(rec.b_out[i])))
            targets.extend(rec.a_out[i])
            targets.extend(rec.b_out[i])
        total = losses.sum()
        grads = (torch.autograd.grad(total, targets, allow_unused=True) if total.requires_grad
                 else [None] * len(targets))
        with torch.no_grad():
            for i in range(len(sites)):
                st, na, nb = spans[i]
                acc = sums[i]
                for x in rec.a_in[i]:
                    x = _masked(x, attn)
                    acc["A_act"].addmm_(x.T, x)
                for h in rec.b_in[i]:
                    h = _masked(h, attn)
                    acc["B_act"].addmm_(h.T, h)
                for g in grads[st : st + na]:
                    if g is not None:
                        g = _masked(g, attn)
                        acc["A_grad"].addmm_(g.T, g)
                for g in grads[st + na : st + na + nb]:
                    if g is not None:
                        g = _masked(g, attn)
                        acc["B_grad"].addmm_(g.T, g)
        del rec, grads, targets, losses
        if bar is not None:
            bar.advance(len(part))
    return {"sums": sums, "tokens": tokens}


def _bases(sums: dict) -> dict:
    """Per site and module: (left, right) eigenbases (float32, decomposed in float64). A: left from its output
    gradients (r x r), right from its inputs (d_in x d_in); B: left from its output gradients (d_out x d_out),
    right from its inputs (r x r). Each covariance is dropped once decomposed, so a group never holds both."""
    out = {}
    for i in list(sums):
        acc = sums.pop(i)
        for sd in SIDES:
            g, a = acc.pop(f"{sd}_grad"), acc.pop(f"{sd}_act")
            out[(i, sd)] = (eigenbasis(g.double().cpu().numpy()).astype(np.float32),
                            eigenbasis(a.double().cpu().numpy()).astype(np.float32))
            del g, a
    return out


def _correct_batch(lam: dict, bases: dict, local: int, dA, dB) -> None:
    """Add one batch's rotated squared gradients (dA [B, r, d_in], dB [B, d_out, r], numpy float64) to `lam`."""
    for sd, G in (("A", dA), ("B", dB)):
        left, right = bases[(local, sd)]
        lam[(local, sd)] += np.square(rotate(G, left, right)).sum(0)


def correction_from_model(model, sites, toks, positions, batch_size: int, pad_id: int, chunk: int, bases: dict,
                          bar=None) -> dict:
    """Corrected eigenvalue sums from exact per-example gradients of one more model pass."""
    from ..grads.capture import GradientCapture
    from ..projection import Projector
    from ..setup.batches import batches

    cap = GradientCapture(model, sites, Projector(site_shapes(sites)), chunk=chunk)
    device = next(model.parameters()).device
    lam = {(i, sd): np.zeros((s.r, s.d_in) if sd == "A" else (s.d_out, s.r)) for i, s in enumerate(sites) for sd in SIDES}
    for part, ids, attn, sup in batches(toks, positions, batch_size, pad_id, device):
        per_site, _ = cap.site_grads(ids, attn, sup)
        for i, (dA, dB) in enumerate(per_site):
            _correct_batch(lam, bases, i, dA.detach().double().cpu().numpy(), dB.detach().double().cpu().numpy())
        if bar is not None:
            bar.advance(len(part))
    return lam


def correction_from_rows(rows, all_sites: Sequence[SiteShape], group: Sequence[int], bases: dict, bar=None) -> dict:
    """Corrected eigenvalue sums of the sites in `group` from an exact index's rows (streamed in chunks)."""
    offs = np.concatenate([[0], np.cumsum(exact_widths(all_sites))])
    lam = {(j, sd): np.zeros((all_sites[i].r, all_sites[i].d_in) if sd == "A" else (all_sites[i].d_out, all_sites[i].r))
           for j, i in enumerate(group) for sd in SIDES}
    for a, b, R in rows.chunks():
        for j, i in enumerate(group):
            s, o = all_sites[i], int(offs[i])
            na = s.r * s.d_in
            dA = R[:, o : o + na].reshape(-1, s.r, s.d_in)
            dB = R[:, o + na : o + na + s.d_out * s.r].reshape(-1, s.d_out, s.r)
            _correct_batch(lam, bases, j, dA, dB)
        if bar is not None:
            bar.advance(b - a)
    return lam


def fit_factors(model, sites, toks, *, batch_size: int, pad_id: int, chunk: int, rows=None,
                memory_bytes: int = DEFAULT_MEMORY_BYTES, progress: bool = True, sink=None) -> tuple[dict, dict]:
    """Every site's factors {(site, side): ModuleFactors} and how they were computed. `rows`, an exact float32
    `RowSource` over the same training rows, serves the correction (no second model pass); None: a model pass.
    `sink(group, site indices, factors)`, when given, receives each group's factors as they are fitted (and
    nothing is kept here): what holds memory to one group."""
    from ..progress import progress_bar
    from ..setup.batches import length_order

    t0 = time.time()
    shapes = site_shapes(sites)
    groups = site_groups(shapes, memory_bytes)
    positions = length_order(toks)  # the index's batches: the same bits on every run
    n = len(toks)
    out: dict = {}
    tokens = 0
    with progress_bar("ekfac factors", total=2 * n * len(groups)) as bar:
        for gi, grp in enumerate(groups):
            gsites = [sites[i] for i in grp]
            stats = covariance_pass(model, gsites, toks, positions, batch_size, pad_id, chunk, bar)
            tokens = stats["tokens"]
            bases = _bases(stats.pop("sums"))
            if rows is not None:
                lam = correction_from_rows(rows, shapes, grp, bases, bar)
            else:
                lam = correction_from_model(model, gsites, toks, positions, batch_size, pad_id, chunk, bases, bar)
            got = {(i, sd): ModuleFactors(*bases.pop((j, sd)), lam.pop((j, sd)) / max(n, 1))
                   for j, i in enumerate(grp) for sd in SIDES}
            if sink is None:
                out.update(got)
            else:
                sink(gi, grp, got)
            del got, bases, lam
    info = {"rows": n, "tokens": tokens, "groups": len(groups),
            "model_passes": len(groups) * (1 if rows is not None else 2),
            "correction": "index rows" if rows is not None else "model pass", "fit_seconds": round(time.time() - t0, 3)}
    return out, info


# --------------------------------------------------------------------------------------------- the cache


def factor_spec(sites: Sequence[SiteShape], row_keys: Sequence[str], *, batch_size: int, correction: str) -> dict:
    """What stored factors must have been fitted for: the sites, the training rows in order, the batching and the
    correction source (both change the float sums' bits, not their meaning)."""
    h = hashlib.sha256("\n".join(row_keys).encode()).hexdigest()
    return {"schema": SCHEMA, "version": EKFAC_VERSION, "sites": [[s.name, s.r, s.d_in, s.d_out] for s in sites],
            "rows": len(row_keys), "rows_sha256": h, "batch_size": int(batch_size), "correction": correction}


def group_file(g: int) -> str:
    return f"{FACTORS_PREFIX}{g:04d}.safetensors"


def write_group(root: Path, g: int, group: Sequence[int], factors: dict, spec: dict) -> tuple[str, str]:
    """One group's factors as safetensors (temporary name, then renamed); (file name, sha256)."""
    from safetensors.numpy import save_file

    from ..io import sha256_file

    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for (i, sd), f in factors.items():
        tensors[f"{i}|{sd}|left"] = np.ascontiguousarray(f.left, dtype=np.float32)
        tensors[f"{i}|{sd}|right"] = np.ascontiguousarray(f.right, dtype=np.float32)
        tensors[f"{i}|{sd}|lam"] = np.ascontiguousarray(f.lam, dtype=np.float64)
    name = group_file(g)
    # Not the index's ".tmp-" prefix: `GradientIndex.open` deletes those as a killed writer's debris.
    tmp = root / f".ekfac-tmp-{name}.{os.getpid()}"
    try:
        save_file(tensors, str(tmp), metadata={"schema": SCHEMA, "spec": json.dumps(spec, sort_keys=True),
                                               "group": str(g), "sites": json.dumps(list(map(int, group)))})
        sha = sha256_file(tmp)
        os.replace(tmp, root / name)
    finally:
        tmp.unlink(missing_ok=True)
    return name, sha


def write_manifest(root: Path, spec: dict, files: list[dict], info: dict) -> None:
    """The manifest last, so a killed fit leaves no manifest naming half-written groups; stale group files of an
    earlier fit go."""
    from ..io import atomic_write_text

    root = Path(root)
    atomic_write_text(root / MANIFEST_FILE, json.dumps({"schema": SCHEMA, "files": files, "spec": spec, "fit": info},
                                                       indent=1, sort_keys=True))
    keep = {f["file"] for f in files}
    for p in root.glob(f"{FACTORS_PREFIX}*.safetensors"):
        if p.name not in keep:
            p.unlink(missing_ok=True)


def clear_factors(root: Path) -> None:
    """Remove the stored factors (a fresh fit follows)."""
    root = Path(root)
    (root / MANIFEST_FILE).unlink(missing_ok=True)
    for p in root.glob(f"{FACTORS_PREFIX}*.safetensors"):
        p.unlink(missing_ok=True)


def load_factors(root: Path, spec: dict, sites: Sequence[SiteShape]) -> tuple[FactorStore, dict]:
    """The stored factors when they were fitted for `spec` and every group file's bytes match the manifest's
    sha256; else ValueError saying why (the caller refits)."""
    from safetensors import safe_open

    from ..io import sha256_file

    root = Path(root)
    mf = root / MANIFEST_FILE
    try:
        manifest = json.loads(mf.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{mf}: unreadable ({e})") from None
    if not isinstance(manifest, dict) or manifest.get("schema") != SCHEMA or not isinstance(manifest.get("files"), list):
        raise ValueError(f"{mf}: not a {SCHEMA} manifest")
    if manifest.get("spec") != spec:
        raise ValueError(f"{mf}: the factors were fitted for other sites, rows or settings")
    files: dict[int, Path] = {}
    for entry in manifest["files"]:
        path = root / str(entry.get("file"))
        try:
            sha = sha256_file(path)
        except OSError as e:
            raise ValueError(f"{path}: unreadable ({e})") from None
        if sha != entry.get("sha256"):
            raise ValueError(f"{path}: sha256 {sha[:16]}... does not match the manifest's "
                             f"{str(entry.get('sha256'))[:16]}...")
        try:
            with safe_open(str(path), framework="numpy") as f:
                meta = f.metadata() or {}
                names = set(f.keys())
        except Exception as e:  # safetensors raises its own error types for a malformed file
            raise ValueError(f"{path}: not a readable safetensors file ({e})") from None
        if json.loads(meta.get("spec", "null")) != spec:
            raise ValueError(f"{path}: its header names other settings than the manifest")
        for i in entry.get("sites") or []:
            need = {f"{i}|{sd}|{k}" for sd in SIDES for k in ("left", "right", "lam")}
            if not need <= names:
                raise ValueError(f"{path}: the factors of site {i} are missing")
            files[int(i)] = path
    if sorted(files) != list(range(len(sites))):
        raise ValueError(f"{mf}: names the factors of {len(files)} of {len(sites)} sites")
    return FactorStore(sites, files=files), {**(manifest.get("fit") or {}), "files": len(manifest["files"])}


def fit_or_load(grads, rows, *, damping: Optional[float], root: Optional[Path] = None,
                memory_bytes: int = DEFAULT_MEMORY_BYTES) -> EkfacPreconditioner:
    """The EK-FAC preconditioner of `grads`' adapter (an `engine.ModelGradients`) over its training rows: loaded
    from `root` (the index directory) when the stored factors were fitted for these sites and rows, else fitted
    and stored there, group by group. `rows` (a `RowSource`) serves the correction when it holds exact float32
    gradients."""
    shapes = site_shapes(grads.sites)
    exact_rows = rows is not None and rows.dim == sum(exact_widths(shapes)) and _float32(rows)
    correction = "index rows" if exact_rows else "model pass"
    row_keys = [t.row_key() for t in grads.toks]
    spec = factor_spec(shapes, row_keys, batch_size=grads.batch_size, correction=correction)
    d = DEFAULT_DAMPING if damping is None else float(damping)
    why = None
    if root is not None and (Path(root) / MANIFEST_FILE).exists():
        try:
            store, info = load_factors(root, spec, shapes)
            return EkfacPreconditioner(store, d, {**info, "cache": "reused", "dir": str(root)})
        except ValueError as e:
            why = str(e)
            log.warning("EK-FAC factors cannot be used (%s); fitting them again", e)
    kw = dict(batch_size=grads.batch_size, pad_id=grads.pad_id, chunk=grads.chunk, rows=rows if exact_rows else None,
              memory_bytes=memory_bytes)
    if root is None:
        factors, info = fit_factors(grads.model, grads.sites, grads.toks, **kw)
        return EkfacPreconditioner(FactorStore(shapes, memory=factors), d,
                                   {**info, "cache": "fitted" if why is None else f"refitted: {why}"})
    (Path(root) / MANIFEST_FILE).unlink(missing_ok=True)  # what follows replaces it
    files: list[dict] = []
    paths: dict[int, Path] = {}

    def sink(g, group, got):
        name, sha = write_group(root, g, group, got, spec)
        files.append({"file": name, "sha256": sha, "sites": list(map(int, group))})
        paths.update({int(i): Path(root) / name for i in group})

    _, info = fit_factors(grads.model, grads.sites, grads.toks, sink=sink, **kw)
    write_manifest(root, spec, files, info)
    info = {**info, "cache": "fitted" if why is None else f"refitted: {why}", "files": len(files), "dir": str(root)}
    return EkfacPreconditioner(FactorStore(shapes, files=paths), d, info)


def _float32(rows) -> bool:
    if rows.index is not None:
        return getattr(rows.index, "storage_dtype", "float32") == "float32"
    return rows.array is not None and rows.array.dtype in (np.float32, np.float64)

