"""Building blocks shared by the PDCluster and PDInstance models.

Owns the base model (camelCase on the wire, snake_case in Python, unknown fields
rejected), the Kubernetes value types the specs embed (resource quantities,
resource requirements, tolerations, object metadata), ``parse_quantity`` and
``parse_bytes`` / ``bytes_arg`` (sizes such as ``20Gi`` in specs and on every CLI flag
that takes bytes).

Invariants: every model here serialises to what the generated CRD accepts
(``to_manifest`` drops ``None`` so optional fields are omitted, never null), and
a quantity that passes validation is one ``parse_quantity`` can read.
"""

from __future__ import annotations

import argparse
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


def parse_bytes(value: int | str) -> int:
    """A byte count written as a quantity: ``parse_bytes("20Gi") == 20 * 2**30``;
    ``512Mi``, ``1.5G`` and plain ``4096`` too. Raises ``ValueError`` saying what is
    allowed. Called through ``bytes_arg`` for every CLI flag that takes bytes (the
    spec's ``kvCacheBytes`` uses the same syntax: ``parse_quantity``)."""
    text = value.strip() if isinstance(value, str) else value
    try:
        size = parse_quantity(text)
    except ValueError:
        raise ValueError(f"{value!r} is not a size: write bytes as a number with an optional "
                         "suffix Ki, Mi, Gi, Ti (powers of 1024) or k, M, G, T, e.g. 20Gi or 512Mi") from None
    if size < 0 or size != size.to_integral_value():
        raise ValueError(f"{value!r} is not a whole, non-negative number of bytes")
    return int(size)


def bytes_arg(text: str) -> int:
    """``argparse`` type of a flag that takes bytes: ``--kv-cache-bytes 20Gi``."""
    try:
        return parse_bytes(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def positive_float_arg(text: str) -> float:
    """``argparse`` type of a flag that takes a positive number (seconds, a rate): 0,
    a negative number or ``nan`` is an error at the command line, not a division by
    zero later in a loop."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r}: a positive, finite number is wanted")
    return value


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
