"""The base of every settings section, apart from `logdx.config`, so that a registry entry (an actuator,
an alert destination) can declare its own settings model without importing the configuration that is
built from the registries (which would be an import cycle).

A section refuses keys it does not have (a typo is an error, never a silent default). A sub-section may
say which keys of its parent section it replaces (`moved_here`), so that an old configuration fails with
the new place named (`kube_taint moved to kubernetes.taint`; `logdx.config` says it with full paths).
"""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, model_validator


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid")

    # Keys of the parent section that now live in this sub-section: old key -> this section's field.
    moved_here: ClassVar[dict[str, str]] = {}

    @classmethod
    def moved_keys(cls) -> dict[str, str]:
        """Old keys of this section that moved into one of its sub-sections: old key -> `sub.field`."""
        out: dict[str, str] = {}
        for name, field in cls.model_fields.items():
            sub = field.annotation
            if isinstance(sub, type) and issubclass(sub, Section):
                out.update({old: f"{name}.{new}" for old, new in sub.moved_here.items()})
        return out

    @model_validator(mode="before")
    @classmethod
    def _no_moved_keys(cls, data: Any) -> Any:
        if isinstance(data, dict):
            moved = cls.moved_keys()
            for key in data:
                if key in moved:
                    raise ValueError(f"{key} moved to {moved[key]}")
        return data
