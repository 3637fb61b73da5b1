"""EK-FAC (`attribution.preconditioner: ekfac`) under its historical import path: everything lives in
`attribution.precondition.ekfac` (maths, factors, statistics, cache, the preconditioner)."""

from .precondition.ekfac import (DEFAULT_DAMPING, DEFAULT_MEMORY_BYTES, EKFAC_VERSION, FACTORS_PREFIX, KIND,
                                 MANIFEST_FILE, SCHEMA, SIDES, EkfacPreconditioner, FactorStore, ModuleFactors,
                                 _site_numel2, clear_factors, corrected_eigenvalues, correction_from_model,
                                 correction_from_rows, covariance_pass, eigenbasis, ekfac_dense, factor_spec,
                                 fit_factors, fit_or_load, group_file, load_factors, load_or_fit_factors,
                                 module_damping, precondition_module, rotate, site_groups, site_shapes, unrotate,
                                 write_group, write_manifest)

__all__ = ["DEFAULT_DAMPING", "DEFAULT_MEMORY_BYTES", "EKFAC_VERSION", "FACTORS_PREFIX", "KIND", "MANIFEST_FILE", "SCHEMA",
           "SIDES", "EkfacPreconditioner", "FactorStore", "ModuleFactors", "_site_numel2", "clear_factors",
           "corrected_eigenvalues", "correction_from_model", "correction_from_rows", "covariance_pass", "eigenbasis",
           "ekfac_dense", "factor_spec", "fit_factors", "fit_or_load", "group_file", "load_factors",
           "load_or_fit_factors", "module_damping", "precondition_module", "rotate", "site_groups", "site_shapes",
           "unrotate", "write_group", "write_manifest"]
