"""Preconditioners for the query side: q <- H^-1 q, with H built from the training gradients in index space.

Every method is *per block*: the index vector is the concatenation of one block per LoRA site (widths in the index
meta's ``block_dims``), and H is block-diagonal, one damped matrix per site, as in EK-FAC/LoGra/DataInf. With the
N training gradients g_i of a block (rows of G, N x D_b):

* ``identity``  H = I.
* ``diagonal``  H = diag(m) + lambda I, m_j = (1/N) sum_i g_ij^2 (per-coordinate second moment; Adam's view).
* ``fisher``    H = F + lambda I, F = (1/N) G^T G (damped empirical Fisher). Exact: a D_b x D_b Cholesky solve when
  D_b <= N, else Woodbury in the N-dimensional row space,
  H^-1 q = (q - G^T (N lambda I + G G^T)^-1 G q) / lambda, which needs only the N x N kernel G G^T.
* ``datainf``   DataInf's closed form (Kwon et al. 2024): the inverse of each rank-one term, averaged,
  H^-1 q ~ (1/N) sum_i (q - <q, g_i> / (lambda + ||g_i||^2) g_i) / lambda, one streaming pass.

Damping ``lambda`` is relative to the mean eigenvalue of the second-moment matrix, tr(F) / D = the mean of m:
``diagonal`` takes it over the whole index (lambda = damping x mean(m); a per-block mean over-damps the blocks with
large gradients), ``fisher`` and ``datainf`` per block (lambda_b = damping x mean of m over block b; DataInf's own
rule is 0.1 x this). The defaults (`DEFAULT_DAMPING`) were chosen on the built-in scenarios (figures in
tests/test_precondition.py, which pins them): a small lambda lets the inverse "explain" the query with the span of
the well-fit training rows, which divides away exactly the direction the planted rows share with the failure
(with N << D_b, F has N non-zero eigenvalues, each about D_b / N times the mean, so 0.1 x mean is a nearly
unregularised pseudo-inverse on that span: recall@10 on the demo falls to 0.74 and AUPRC to 0.83, against 1.0 at the
default 100).

`attribution.preconditioner: ekfac` (`ekfac`) works in parameter space instead: its Kronecker-factored curvature is
fitted from the model, and it preconditions exact query gradients.

One class per kind, registered by its `config.PreconditionerKind` (`base`): `IdentityPreconditioner`,
`DiagonalPreconditioner`, `FisherPreconditioner`, `DataInfPreconditioner` (fitted on the index rows, `rows`) and
`EkfacPreconditioner`. ``Preconditioner(kind, damping, block_dims)`` builds the kind's class (`make_preconditioner`);
what callers need (is it the identity, does it work in parameter space, its metric for unit rows) are properties of
the class, never a comparison of its kind.

Statistics are streamed from the index in row chunks (`RowSource`); what is held is the per-block second moments
(D floats), the Fisher Gram matrices (min(N, D_b)^2 per block, processed in block groups that fit
`memory_bytes`), and the queries. Every method is linear in q, so scores against a preconditioned query stay
inner products, and ``identity_scale`` (1 / lambda_b per block) lets an exact re-rank correct the projection error of
the identity part (H^-1 = (I - M) / lambda with M the low-rank or diagonal part; see `attribution.rerank`).
"""

from .base import Preconditioner, make_preconditioner, preconditioner_class
from .datainf import DataInfPreconditioner
from .diagonal import DiagonalPreconditioner
from .ekfac import EkfacPreconditioner
from .fisher import FisherPreconditioner
from .identity import IdentityPreconditioner
from .maths import datainf_inverse, diagonal_inverse, fisher_inverse_dense, fisher_inverse_woodbury, mean_eigenvalue
from .rows import DEFAULT_MEMORY_BYTES, RowPreconditioner, precondition, restore

_ROW_KINDS = (IdentityPreconditioner, DiagonalPreconditioner, FisherPreconditioner, DataInfPreconditioner)
KINDS = tuple(c.kind.value for c in _ROW_KINDS)  # fitted on the index rows; EK-FAC (`ekfac`) on the model
DEFAULT_KIND = DiagonalPreconditioner.kind.value  # the benchmark's choice for attribution.preconditioner
# Relative damping (x the mean eigenvalue, over the whole index for `diagonal`, per block for `fisher`/`datainf`)
# per method, chosen by the benchmark on the built-in scenarios (module docstring, tests/test_precondition.py).
DEFAULT_DAMPING = {c.kind.value: c.default_damping for c in _ROW_KINDS}
DEFAULT_SCOPE = {c.kind.value: c.default_scope for c in _ROW_KINDS}

__all__ = ["DEFAULT_DAMPING", "DEFAULT_KIND", "DEFAULT_MEMORY_BYTES", "DEFAULT_SCOPE", "DataInfPreconditioner",
           "DiagonalPreconditioner", "EkfacPreconditioner", "FisherPreconditioner", "IdentityPreconditioner", "KINDS",
           "Preconditioner", "RowPreconditioner", "datainf_inverse", "diagonal_inverse", "fisher_inverse_dense",
           "fisher_inverse_woodbury", "make_preconditioner", "mean_eigenvalue", "precondition", "preconditioner_class",
           "restore"]
