"""JSON forms of values that the control plane's models and the read plans share.

`RouteSpecModel` (the route spec), `Hex` (bytes as hex), `Range` (a `ByteRange` as
`[start, end)`), `Spec` (a `RouteSpec` as a `RouteSpecModel`), `SpanModel`, and
`SpansJson`: a segment's `RouteSpans` as the flat fields of `RouteSpans.to_json`. Used as
`Annotated` field types, they let pydantic read and write the plain dataclasses of
`plans.py` directly, so the plans are defined once. `ValueModel`: such a dataclass as a
whole body, its JSON its fields. No I/O.
"""

from __future__ import annotations

from typing import Annotated, Generic, Self, TypeVar, cast

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PlainSerializer,
    PlainValidator,
    RootModel,
    TypeAdapter,
)

from r3store.spans import ByteRange, Span
from r3store.spec import MAX_EXPERTS, MAX_LAYERS, MAX_TOP_K, RouteSpec


class RouteSpecModel(BaseModel):
    """The route spec, fixed when a namespace is made."""

    model_config = ConfigDict(extra="forbid", strict=True)

    num_layers: int = Field(ge=1, le=MAX_LAYERS, description="MoE layers L")
    num_experts: int = Field(ge=1, le=MAX_EXPERTS, description="experts per layer E")
    top_k: int = Field(ge=1, le=MAX_TOP_K, description="experts chosen per token K")
    ordered: bool = Field(False, description="keep the top-k order the engine emitted")
    allow_fewer: bool = Field(False, description="accept token-layers with fewer than K")
    model: str = Field("", max_length=200, description="model name, for people")

    def to_spec(self) -> RouteSpec:
        return RouteSpec(**self.model_dump())

    @classmethod
    def of(cls, spec: RouteSpec) -> RouteSpecModel:
        return cls(**spec.__dict__)


def _hex(value: object) -> bytes:
    if not isinstance(value, str):
        raise ValueError("a hex string is needed")
    return bytes.fromhex(value)


def _spec(value: object) -> RouteSpec:
    return RouteSpecModel.model_validate(value).to_spec()


_PAIR: TypeAdapter[tuple[int, int]] = TypeAdapter(tuple[int, int])


def _range(value: object) -> ByteRange:
    return ByteRange(*_PAIR.validate_python(value))


def _pair(value: ByteRange) -> tuple[int, int]:
    return (value.start, value.end)


Hex = Annotated[
    bytes,
    PlainValidator(_hex, json_schema_input_type=str),
    PlainSerializer(bytes.hex, return_type=str),
]
Range = Annotated[
    ByteRange,
    PlainValidator(_range, json_schema_input_type=tuple[int, int]),
    PlainSerializer(_pair, return_type=tuple[int, int]),
]
Spec = Annotated[
    RouteSpec,
    PlainValidator(_spec, json_schema_input_type=RouteSpecModel),
    PlainSerializer(RouteSpecModel.of, return_type=RouteSpecModel),
]


V = TypeVar("V")


class ValueModel(RootModel[V], Generic[V]):
    """A value on the wire as itself: a dataclass whose fields are its JSON (a read
    plan, a lease); `root` is the value."""

    @classmethod
    def of(cls, value: V) -> Self:
        # pydantic's mypy plugin types model_construct as this class, not its subclass
        return cast(Self, cls.model_construct(value))


class SpanModel(BaseModel):
    offset: int = Field(ge=0)
    length: int = Field(ge=0)

    def to_span(self) -> Span:
        return Span(self.offset, self.length)


class PlannedPrefixModel(BaseModel):
    tokens: int = Field(gt=0)
    route_transform: int
    route_ids: SpanModel
    route_counts: SpanModel | None
    route_order: SpanModel | None


class SpansJson(BaseModel):
    """The JSON fields of a segment's `RouteSpans` (`RouteSpans.to_json`)."""

    route_transform: int
    route_ids: SpanModel
    route_counts: SpanModel | None
    route_order: SpanModel | None
    token_ids: SpanModel | None
    route_dictionary: str | None = Field(
        None, description="hex digest of the dictionary the ids streams need (dictionaries)"
    )
    prefix: PlannedPrefixModel | None = Field(
        None, description="the streams of the first `tokens` tokens, shared with other rows"
    )
