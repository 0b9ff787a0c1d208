"""Fix policy: which incident classes may be fixed without a person, on which hosts, and how many
fixes per hour the whole fleet may take (blast radius). YAML, validated by pydantic::

    unattended:                 # incident id -> host tags ("*" = any host)
      shm-too-small: [lab, dev]
      memlock-limit: ["*"]
    max_fixes_per_hour: 5       # fix attempts across the fleet (rolled-back ones count too)

Pure decisions (`allows_unattended`); `load_policy` reads the file.
"""

from __future__ import annotations

from pathlib import Path

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from runbooks.core.errors import InputError
from runbooks.core.taxonomy import SAFE_FIX, Incident


class Policy(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    unattended: dict[Incident, tuple[str, ...]] = {}
    max_fixes_per_hour: int = Field(default=5, ge=0)

    @field_validator("unattended")
    @classmethod
    def _only_safe(cls, v: dict[Incident, tuple[str, ...]]) -> dict[Incident, tuple[str, ...]]:
        unsafe = [i.value for i in v if i not in SAFE_FIX]
        if unsafe:
            raise ValueError(f"these classes have no safe automatic fix: {', '.join(unsafe)}")
        return v

    def allows_unattended(self, incident: str, tags: tuple[str, ...]) -> bool:
        try:
            allowed = self.unattended.get(Incident(incident), ())
        except ValueError:
            return False
        return "*" in allowed or any(t in allowed for t in tags)


def load_policy(path: Path | None) -> Policy:
    if path is None:
        return Policy()
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
        return Policy.model_validate(data)
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
        raise InputError(f"invalid policy {path}: {problems}") from None
    except (OSError, yaml.YAMLError, ValueError) as exc:  # ValueError: bad UTF-8, 5000 digits
        raise InputError(f"cannot read policy {path}: {exc}") from exc
    except RecursionError:  # nested too deeply for PyYAML, or a value that contains itself
        raise InputError(f"cannot read policy {path}: nested too deeply") from None
