"""Building blocks shared by the PDCluster and PDInstance models.

Owns the base model (camelCase on the wire, snake_case in Python, unknown fields
rejected), the Kubernetes value types the specs embed (resource quantities,
resource requirements, tolerations, object metadata) and ``parse_quantity``.

Invariants: every model here serialises to what the generated CRD accepts
(``to_manifest`` drops ``None`` so optional fields are omitted, never null), and
a quantity that passes validation is one ``parse_quantity`` can read.
"""

from __future__ import annotations

import re
from decimal import Decimal
from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field
from pydantic.alias_generators import to_camel

GROUP = "pdserve.io"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"

# The apiserver's resource.Quantity syntax (k8s.io/apimachinery), also emitted
# by controller-gen for Quantity fields.
QUANTITY_PATTERN = (
    r"^(\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))(([KMGTPE]i)|[numkMGTPE]"
    r"|([eE](\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$"
)
_SUFFIXES: dict[str, Decimal] = {
    "Ki": Decimal(2**10), "Mi": Decimal(2**20), "Gi": Decimal(2**30),
    "Ti": Decimal(2**40), "Pi": Decimal(2**50), "Ei": Decimal(2**60),
    "n": Decimal("1e-9"), "u": Decimal("1e-6"), "m": Decimal("1e-3"), "": Decimal(1),
    "k": Decimal("1e3"), "M": Decimal("1e6"), "G": Decimal("1e9"),
    "T": Decimal("1e12"), "P": Decimal("1e15"), "E": Decimal("1e18"),
}



def _check_quantity(value: int | str) -> int | str:
    if isinstance(value, str) and not re.match(QUANTITY_PATTERN, value):
        raise ValueError(f"not a Kubernetes quantity such as 500m, 8Gi or 4: {value!r}")
    return value


# int or a quantity string ("500m", "8Gi"); the converter turns this into
# `x-kubernetes-int-or-string` with the quantity pattern, as controller-gen does.
Quantity = Annotated[
    int | str,
    AfterValidator(_check_quantity),
    Field(json_schema_extra={"x-kubernetes-int-or-string": True, "pattern": QUANTITY_PATTERN}),
]


def parse_quantity(value: int | str) -> Decimal:
    """Value of a Kubernetes quantity: ``parse_quantity("8Gi") == 8 * 2**30``."""
    if isinstance(value, int):
        return Decimal(value)
    if not re.match(QUANTITY_PATTERN, value):
        raise ValueError(f"not a Kubernetes quantity: {value!r}")
    match = re.match(r"^([+-]?[0-9.]+(?:[eE][+-]?[0-9.]+)?)([A-Za-z]*)$", value)
    assert match is not None  # the pattern above guarantees it
    number, suffix = match.groups()
    return Decimal(number) * _SUFFIXES[suffix]


class ApiModel(BaseModel):
    """Base of every spec model: camelCase aliases, snake_case names accepted too."""

    model_config = ConfigDict(
        alias_generator=to_camel,
        populate_by_name=True,
        extra="forbid",
        use_attribute_docstrings=True,
    )

    def to_manifest(self) -> dict:
        """The Kubernetes form: camelCase keys, JSON values, no ``None`` fields."""
        return self.model_dump(mode="json", by_alias=True, exclude_none=True)


class StatusModel(ApiModel):
    """Base of status models: tolerant of fields written by newer versions."""

    model_config = ConfigDict(extra="ignore")


class ResourceRequirements(ApiModel):
    """Container resources, as in a Pod spec (``requests`` / ``limits``)."""

    requests: dict[str, Quantity] = Field(default_factory=dict)
    """Minimum resources, e.g. ``{cpu: "4", memory: 16Gi}``."""
    limits: dict[str, Quantity] = Field(default_factory=dict)
    """Maximum resources; GPUs go here (or use the pool's ``gpus``)."""


class Toleration(ApiModel):
    """A Pod toleration, as in a Pod spec."""

    key: str | None = None
    operator: Literal["Exists", "Equal"] = "Equal"
    value: str | None = None
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = None
    toleration_seconds: int | None = None


class ObjectMeta(BaseModel):
    """The part of Kubernetes object metadata pdserve reads; the rest is kept."""

    model_config = ConfigDict(extra="allow")

    name: str = Field(min_length=1, max_length=63, pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
    namespace: str | None = None
    labels: dict[str, str] = Field(default_factory=dict)
    annotations: dict[str, str] = Field(default_factory=dict)
    generation: int | None = None
    uid: str | None = None
