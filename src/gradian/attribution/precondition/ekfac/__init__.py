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

Modules: `maths` (pure, per module), `factors` (the fitted factors and the groups of sites), `statistics` (the
passes that fit them), `cache` (the files beside the index), `preconditioner` (`EkfacPreconditioner`, `fit_or_load`).

Statistics are streamed: one model pass over the training rows (`setup.batches`, the index's length order)
accumulates the covariances of a group of sites (float32 sums, at most `memory_bytes` of them at a time: more
groups mean more passes, never more memory), then the correction streams the rows' exact per-example gradients:
read from the index when it is exact and float32, else from a second model pass. Nothing grows with rows.

The fitted factors live beside the index, one safetensors file per site group (written as the group is fitted, so
memory holds one group's factors at a time), their sha256 and what they were fitted for in `MANIFEST_FILE`, written
last; factors fitted for other sites or rows, or whose bytes no longer match the sha256, are refitted.
"""

from ....config import PreconditionerKind
from ....grads.layout import site_shapes
from .cache import (EKFAC_VERSION, FACTORS_PREFIX, MANIFEST_FILE, SCHEMA, clear_factors, factor_spec, group_file,
                    load_factors, load_or_fit_factors, write_group, write_manifest)
from .factors import DEFAULT_MEMORY_BYTES, SIDES, FactorStore, ModuleFactors, _site_numel2, site_groups  # noqa: F401
from .maths import (DEFAULT_DAMPING, corrected_eigenvalues, eigenbasis, ekfac_dense, module_damping,
                    precondition_module, rotate, unrotate)
from .preconditioner import EkfacPreconditioner, fit_or_load
from .statistics import correction_from_model, correction_from_rows, covariance_pass, fit_factors

KIND = PreconditionerKind.ekfac

__all__ = ["DEFAULT_DAMPING", "DEFAULT_MEMORY_BYTES", "EKFAC_VERSION", "EkfacPreconditioner", "FACTORS_PREFIX", "FactorStore",
           "KIND", "MANIFEST_FILE", "ModuleFactors", "SCHEMA", "SIDES", "clear_factors", "corrected_eigenvalues",
           "correction_from_model", "correction_from_rows", "covariance_pass", "eigenbasis", "ekfac_dense",
           "factor_spec", "fit_factors", "fit_or_load", "group_file", "load_factors", "load_or_fit_factors",
           "module_damping", "precondition_module", "rotate", "site_groups", "site_shapes", "unrotate",
           "write_group", "write_manifest"]
