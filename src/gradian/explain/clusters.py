"""Clusters of training rows that act alike, scored as a group and tested against size-matched random sets.

Many weak examples that share one problem (20 paraphrases of one wrong fact, every answer of one kind in a wrong
format) can each score too low to stand out while together they moved the model. Rows are grouped on something
that does not look at the failing items, so that a cluster is never significant by construction:

* ``gradient`` (default): cosine similarity of the rows' own training gradients (the index vectors; no query
  involved). An edge joins two rows whose cosine is at least `threshold` (0.4); clusters are the connected
  components (size >= `min_size`). Rows that teach the same thing point the same way even when their wording
  differs. Measured on the built-in scenarios: paraphrased poisons of one fact have a median pairwise cosine of
  0.56-0.86 while no poison reaches 0.21 with any other row, and the components at 0.4 recover all 20 poisons
  (and nothing else) in every seed, and the 24 wrongly formatted rows in the format scenario; TF-IDF over the same
  texts gives poison pairs a median cosine of 0.34 against 0.77 for unrelated rows that share a question template,
  so no text threshold separates them.

  Linear in rows: with more than `CLUSTER_SEEDS` rows the graph is built over a pool, the `CLUSTER_SEEDS`
  top-scored rows and every row whose cosine with one of them reaches the threshold (one streaming pass over the
  index against the seeds; at most `POOL_MAX` rows, the highest-scored neighbours first), all pairs within the
  pool. All pairs over every row was quadratic (19 s at 20k rows, hours at 1M), and what the clusters are for is
  the harm the ranking explains: a group none of whose rows is among the top-scored rows or near one is not looked
  for. An approximate-neighbour index (FAISS) would keep every row's cluster but holds every row's vector and is
  one more dependency; the pool holds at most `POOL_MAX` vectors. Above `EXACT_MAX_FLOATS` index floats (rows x
  width) the unit rows are sketched to `sketch_dim` dimensions by a seeded sparse sign sketch (`CountSketch`,
  E[S S^T] = I) whose hashes are regenerated per column block: never a dense (width x k) matrix.
* ``text``: TF-IDF (sklearn, word 1-2-grams, sublinear tf) of `Example.plain_text()`, the same graph at a
  text-cosine threshold (0.5): literal near-duplicates, for when there is no index.

Connected components (single linkage) rather than average-linkage agglomeration: paraphrases form chains (A ~ B ~ C
while A and C agree less), and it needs only the thresholded similarity graph, built in row blocks.

`text` clusters are all pairs over the rows (sparse TF-IDF products in row blocks): the fallback without an index.

A cluster's score is the sum of its rows' scores. Its one-sided permutation p-value is
(1 + #{random sets S of the same size: sum(S) >= cluster score}) / (1 + R), with R >= `permutations` size-matched
random sets of rows drawn without replacement (seeded; R grows with the number of clusters tested so that the
smallest attainable p-value can pass Benjamini-Hochberg). The BH step-up procedure across the tested clusters gives
q-values; clusters with q < `alpha` are reported.
"""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np

DEFAULT_THRESHOLD = 0.5  # text (TF-IDF) cosine
GRADIENT_THRESHOLD = 0.4  # gradient cosine
DEFAULT_PERMUTATIONS = 2000
EXACT_MAX_FLOATS = 50_000_000  # held rows x dim above which gradients are sketched before the similarity graph
SKETCH_DIM = 1024
SKETCH_BLOCK = 1 << 20  # columns hashed at a time by the sketch
CLUSTER_SEEDS = 1024  # top-scored rows clusters grow from (all rows up to this many)
POOL_MAX = 4096  # rows the similarity graph is built over, at most


def _components(n: int, rows: list, cols: list, min_size: int) -> list[list[int]]:
    from scipy.sparse import coo_matrix
    from scipy.sparse.csgraph import connected_components

    r = np.concatenate(rows) if rows else np.zeros(0, dtype=np.int64)
    c = np.concatenate(cols) if cols else np.zeros(0, dtype=np.int64)
    g = coo_matrix((np.ones(r.size), (r, c)), shape=(n, n)).tocsr()
    _, labels = connected_components(g, directed=False)
    groups: dict[int, list[int]] = {}
    for i, lab in enumerate(labels):
        groups.setdefault(int(lab), []).append(i)
    out = [sorted(v) for v in groups.values() if len(v) >= min_size]
    out.sort(key=lambda v: v[0])
    return out


class CountSketch:
    """A seeded sparse sign sketch dim -> k (each coordinate hashed to one of k buckets with a random sign, E[S S^T]
    = I), applied in column blocks whose hashes come from (seed, block): never a dense (dim x k) matrix (37 GB in
    float64 at 4.9M dims). The sparse hashes (one entry per coordinate, ~12 bytes each: 60 MB at 4.9M dims) are
    made once and kept, since the one pass applies the sketch to every batch."""

    def __init__(self, dim: int, k: int, seed: int = 0, block: int = SKETCH_BLOCK):
        self.dim, self.k, self.seed, self.block = int(dim), int(k), int(seed), int(block)
        self._hashes: dict = {}

    def _hash(self, b: int, width: int):
        if (b, width) not in self._hashes:
            self._hashes[(b, width)] = self._make_hash(b, width)
        return self._hashes[(b, width)]

    def _make_hash(self, b: int, width: int):
        from scipy.sparse import csr_matrix

        rng = np.random.default_rng([self.seed, 0x636C75, b])
        bucket = rng.integers(0, self.k, size=width)
        sign = rng.integers(0, 2, size=width).astype(np.float32) * 2 - 1
        return csr_matrix((sign, (np.arange(width), bucket)), shape=(width, self.k)).T.tocsr()

    def hashes(self) -> tuple[np.ndarray, np.ndarray]:
        """(bucket, sign) of every coordinate, exactly as `apply` hashes them (one fused sparse product can then
        apply several sketches at once: `attribution.row_pass.Reducer`)."""
        buckets, signs = [], []
        for b, a in enumerate(range(0, self.dim, self.block)):
            rng = np.random.default_rng([self.seed, 0x636C75, b])
            width = min(self.block, self.dim - a)
            buckets.append(rng.integers(0, self.k, size=width))
            signs.append(rng.integers(0, 2, size=width).astype(np.float32) * 2 - 1)
        return np.concatenate(buckets), np.concatenate(signs)

    def apply(self, rows: np.ndarray) -> np.ndarray:
        out = np.zeros((rows.shape[0], self.k), dtype=np.float64)
        for b, a in enumerate(range(0, self.dim, self.block)):
            part = np.asarray(rows[:, a : a + self.block])
            out += np.asarray(self._hash(b, part.shape[1]) @ part.T).T
        return out.astype(np.float32)


def _unit(x: np.ndarray) -> np.ndarray:
    n = np.linalg.norm(x, axis=1, keepdims=True)
    return (x / np.where(n > 0, n, 1.0)).astype(np.float32)


def unit_rows(source, *, sketch: Optional[CountSketch] = None) -> np.ndarray:
    """Unit-norm training gradients [n, dim or k] (float32) of a `RowSource` (or an array), sketched to k dims by
    `sketch` (then renormalised); zero rows stay 0. Holds the n output rows and one row chunk."""
    from ..store.rows import RowSource

    src = source if isinstance(source, RowSource) else RowSource(np.asarray(source))
    out = np.zeros((src.n, sketch.k if sketch is not None else src.dim), dtype=np.float32)
    for a, b, rows in src.chunks():
        x = _unit(rows)
        out[a:b] = _unit(sketch.apply(x)) if sketch is not None else x
    return out


def _pairs(X: np.ndarray, threshold: float, block_rows: int = 2048) -> tuple[list, list]:
    rows, cols = [], []
    for a in range(0, X.shape[0], block_rows):
        sim = X[a : a + block_rows] @ X.T
        r, c = np.nonzero(sim >= threshold)
        keep = (r + a) != c
        rows.append(r[keep] + a)
        cols.append(c[keep])
    return rows, cols


def cluster_pool(source, scores: Optional[np.ndarray], *, threshold: float = GRADIENT_THRESHOLD,
                 seeds: int = CLUSTER_SEEDS, pool_max: int = POOL_MAX, sketch: Optional[CountSketch] = None
                 ) -> np.ndarray:
    """The rows clusters are looked for among (sorted positions): every row when there are at most `seeds` rows
    (or no scores), else the `seeds` top-scored rows and the rows whose gradient cosine with one of them reaches
    `threshold` (the highest-scored `pool_max - seeds` of those). One streaming pass over the rows against the
    seeds: linear in rows, and a cluster that reaches no top-scored row, which could not be the harm the ranking
    explains, is not looked for."""
    from ..attribution.scoring import rank
    from ..store.rows import RowSource

    src = source if isinstance(source, RowSource) else RowSource(np.asarray(source))
    n = src.n
    if scores is None or n <= seeds:
        return np.arange(n)
    scores = np.asarray(scores, dtype=np.float64)
    top = np.sort(rank(scores, seeds))
    S = unit_rows(src.subset(top.tolist()), sketch=sketch)
    is_seed = np.zeros(n, dtype=bool)
    is_seed[top] = True
    near = np.zeros(n, dtype=bool)
    for a, b, rows in src.chunks():
        x = _unit(rows)
        x = _unit(sketch.apply(x)) if sketch is not None else x
        near[a:b] |= ((x @ S.T) >= threshold).any(axis=1)
    extra = np.flatnonzero(near & ~is_seed)
    if extra.size > pool_max - seeds:
        extra = extra[np.lexsort((extra, -scores[extra]))[: max(pool_max - seeds, 0)]]
    return np.union1d(top, extra)


def gradient_clusters(source, *, scores: Optional[np.ndarray] = None, threshold: float = GRADIENT_THRESHOLD,
                      min_size: int = 2, block_rows: int = 2048, sketch_dim: int = SKETCH_DIM,
                      exact_max_floats: int = EXACT_MAX_FLOATS, seeds: int = CLUSTER_SEEDS, pool_max: int = POOL_MAX,
                      seed: int = 0) -> list[list[int]]:
    """Connected components of the gradient-cosine >= threshold graph over `cluster_pool` (see the module
    docstring): all pairs within the pool, which is at most `pool_max` rows whatever the number of rows. Vectors
    are sketched (`CountSketch`, `sketch_dim`) when the pool's or the seeds' exact vectors would exceed
    `exact_max_floats` floats."""
    from ..store.rows import RowSource

    src = source if isinstance(source, RowSource) else RowSource(np.asarray(source))
    n = src.n
    sketch = None
    # Every row is read once either way; sketched, the pass against the seeds costs n x seeds x sketch_dim instead of
    # n x seeds x dim (at 100k rows of a 8192-wide index: 0.2 against 1.7 TFLOP).
    if n * src.dim > exact_max_floats and src.dim > sketch_dim:
        sketch = CountSketch(src.dim, sketch_dim, seed)
    pool = cluster_pool(src, scores, threshold=threshold, seeds=seeds, pool_max=pool_max, sketch=sketch)
    X = unit_rows(src if pool.size == n else src.subset(pool.tolist()), sketch=sketch)
    rows, cols = _pairs(X, threshold, block_rows)
    return [[int(pool[i]) for i in c] for c in _components(pool.size, rows, cols, min_size)]


def tfidf_vectors(texts: Sequence[str]):
    from sklearn.feature_extraction.text import TfidfVectorizer

    vec = TfidfVectorizer(ngram_range=(1, 2), sublinear_tf=True, min_df=1, token_pattern=r"(?u)\b\w+\b",
                          lowercase=True, norm="l2")
    try:
        return vec.fit_transform(list(texts))
    except ValueError:  # empty vocabulary (every text empty)
        from scipy.sparse import csr_matrix

        return csr_matrix((len(texts), 1))


def text_clusters(texts: Sequence[str], *, threshold: float = DEFAULT_THRESHOLD, min_size: int = 2,
                  block_rows: int = 2048) -> list[list[int]]:
    """Connected components of the TF-IDF cosine >= threshold graph; each a sorted list of row indices, clusters in
    order of their first row. Singletons (and clusters under min_size) are left out."""
    n = len(texts)
    if n == 0:
        return []
    X = tfidf_vectors(texts).tocsr()
    rows, cols = [], []
    for a in range(0, n, block_rows):
        sim = (X[a : a + block_rows] @ X.T).tocoo()
        keep = (sim.data >= threshold) & (sim.row + a != sim.col)
        rows.append(sim.row[keep] + a)
        cols.append(sim.col[keep])
    return _components(n, rows, cols, min_size)


def _random_set_sums(scores: np.ndarray, size: int, R: int, rng: np.random.Generator) -> np.ndarray:
    """Sums of R random size-`size` subsets of scores, each drawn without replacement."""
    n = scores.size
    out = np.empty(R, dtype=np.float64)
    step = max(1, 4_000_000 // max(n, 1))
    if size * 20 < n:
        # Draw with replacement and redraw the (rare) sets with a repeat.
        idx = rng.integers(0, n, size=(R, size))
        srt = np.sort(idx, axis=1)
        bad = np.flatnonzero((np.diff(srt, axis=1) == 0).any(axis=1)) if size > 1 else np.zeros(0, dtype=int)
        for i in bad:
            idx[i] = rng.choice(n, size=size, replace=False)
        return scores[idx].sum(axis=1)
    for a in range(0, R, step):
        m = min(step, R - a)
        keys = rng.random((m, n))
        pick = np.argpartition(keys, size - 1, axis=1)[:, :size] if size < n else np.tile(np.arange(n), (m, 1))
        out[a : a + m] = scores[pick].sum(axis=1)
    return out


def permutation_pvalues(scores: np.ndarray, clusters: Sequence[Sequence[int]], *, permutations: int = DEFAULT_PERMUTATIONS,
                        seed: int = 0) -> np.ndarray:
    """One-sided p-value per cluster: how often a random set of rows of the same size scores at least as high.
    The null of each size is drawn once (seeded by the size) and shared by the clusters of that size."""
    scores = np.asarray(scores, dtype=np.float64)
    p = np.ones(len(clusters))
    nulls: dict[int, np.ndarray] = {}
    for j, c in enumerate(clusters):
        m = len(c)
        if m == 0 or m >= scores.size:
            continue
        if m not in nulls:
            nulls[m] = _random_set_sums(scores, m, permutations, np.random.default_rng([seed, m]))
        obs = float(scores[list(c)].sum())
        # a tiny tolerance so that float summation order never turns a tie into a win
        p[j] = (1 + int((nulls[m] >= obs - 1e-12 * max(1.0, abs(obs))).sum())) / (1 + permutations)
    return p


def benjamini_hochberg(p: Sequence[float]) -> np.ndarray:
    """BH-adjusted q-values (step-up, monotone, capped at 1), in the input order."""
    p = np.asarray(p, dtype=np.float64)
    n = p.size
    if n == 0:
        return p.copy()
    order = np.argsort(p, kind="stable")
    ranked = p[order] * n / np.arange(1, n + 1)
    q = np.minimum.accumulate(ranked[::-1])[::-1]
    out = np.empty(n)
    out[order] = np.minimum(q, 1.0)
    return out


def score_clusters(scores: np.ndarray, texts: Sequence[str], *, gradients=None, threshold: Optional[float] = None,
                   min_size: int = 2, permutations: int = DEFAULT_PERMUTATIONS, alpha: float = 0.05, seed: int = 0,
                   previews: Optional[Sequence[str]] = None, clusters: Optional[Sequence[Sequence[int]]] = None) -> dict:
    """Group the rows (on their gradients when `gradients` is given: a RowSource or an [N, dim] array; else on
    text; or the given `clusters`), test each cluster's summed score, BH across clusters.

    Returns {"clusters": [passing clusters, by score], "tested": n, "permutations": R, "method": {...}}; each
    cluster is {id, positions, size, score, mean_score, p_value, q_value, preview}."""
    scores = np.asarray(scores, dtype=np.float64)
    if clusters is not None:
        grouping, threshold = "given", None
        groups = [list(c) for c in clusters]
    elif gradients is not None:
        grouping = "gradient-cosine-connected-components"
        threshold = GRADIENT_THRESHOLD if threshold is None else threshold
        groups = gradient_clusters(gradients, scores=scores, threshold=threshold, min_size=min_size, seed=seed)
    else:
        grouping = "tfidf-cosine-connected-components"
        threshold = DEFAULT_THRESHOLD if threshold is None else threshold
        groups = text_clusters(texts, threshold=threshold, min_size=min_size)
    # With many clusters the smallest p-value 1/(R+1) must still be able to pass BH.
    R = max(int(permutations), int(np.ceil(20 * max(len(groups), 1) / alpha)))
    R = min(R, 200_000)
    p = permutation_pvalues(scores, groups, permutations=R, seed=seed)
    q = benjamini_hochberg(p)
    out = []
    for j, c in enumerate(groups):
        if q[j] < alpha:
            sc = float(scores[c].sum())
            prev = (previews[c[0]] if previews is not None else texts[c[0]])[:160]
            out.append({"positions": [int(x) for x in c], "size": len(c), "score": sc, "mean_score": sc / len(c),
                        "p_value": float(p[j]), "q_value": float(q[j]), "preview": prev})
    out.sort(key=lambda d: (-d["score"], d["positions"][0]))
    for i, d in enumerate(out, start=1):
        d["id"] = i
    return {"clusters": [{"id": d.pop("id"), **d} for d in out], "tested": len(groups), "permutations": R,
            "method": {"grouping": grouping, "threshold": threshold, "min_size": min_size,
                       "test": "size-matched random sets, one-sided", "correction": "benjamini-hochberg",
                       "alpha": alpha, "seed": seed}}
