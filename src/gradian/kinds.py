"""One class per kind behind a base class that still builds them: the metaclass `BuildsItsKind`.

A family of strategies (`capability.metrics.Metric`, `attribution.precondition.Preconditioner`) registers one class
per kind by subclassing its base. Calling a kind's class constructs it as usual; calling the base class itself,
``Metric("contains")``, builds the class the kind registered, through the base's `_build_kind` (its `make_*`
factory): the constructor callers have always used keeps working while the variants live in their own classes.
"""

from __future__ import annotations

from abc import ABCMeta


class BuildsItsKind(ABCMeta):
    """Metaclass of a family's base class: the class that defines `_build_kind` (the family's base) is called
    through it; every other class in the family (a kind's class, which inherits but does not define it) constructs
    itself."""

    def __call__(cls, *args, **kwargs):
        if "_build_kind" in vars(cls):
            return cls._build_kind(*args, **kwargs)
        return super().__call__(*args, **kwargs)
