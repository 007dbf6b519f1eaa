"""Typed hand-offs between processes: one way to write and read each record that crosses a process boundary
(the worker spec, the training job, the probe report that describes the target).

A hand-off is a dataclass that subclasses `Handoff`. `to_json` writes `{"kind", "version", "fields"}`;
`from_json` parses it back into the same types (nested dataclasses, pydantic config sections, lists, dicts)
and rejects, naming the field, a record of another kind or version, an unknown field or a missing one. So a
field added on one side and not the other fails loudly where it crosses, not later in the child.
"""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from typing import Any, ClassVar, Self

from pydantic import BaseModel

from dflash_pipeline.errors import PipelineError


class HandoffError(PipelineError):
    """A hand-off record does not match the code that reads it (another version of dflash-pipeline?)."""


class Handoff:
    """Mixin for dataclasses that cross a process boundary. Subclasses set KIND and bump VERSION whenever
    a field changes meaning."""

    KIND: ClassVar[str]
    VERSION: ClassVar[int] = 1

    def to_dict(self) -> dict[str, Any]:
        return _encode(self)

    def to_json(self) -> str:
        return json.dumps({"kind": self.KIND, "version": self.VERSION, "fields": self.to_dict()})

    @classmethod
    def from_dict(cls, fields: dict[str, Any], where: str = "") -> Self:
        return _decode(cls, fields, where or cls.KIND)

    @classmethod
    def from_json(cls, text: str, where: str = "") -> Self:
        where = where or cls.KIND
        try:
            doc = json.loads(text)
        except json.JSONDecodeError as e:
            raise HandoffError(f"{where}: not a JSON {cls.KIND} record ({e})") from None
        if not isinstance(doc, dict) or doc.get("kind") != cls.KIND:
            got = doc.get("kind") if isinstance(doc, dict) else type(doc).__name__
            raise HandoffError(f"{where}: expected a {cls.KIND} record, got {got!r}")
        if doc.get("version") != cls.VERSION:
            raise HandoffError(
                f"{where}: {cls.KIND} record version {doc.get('version')!r}, this code reads version "
                f"{cls.VERSION}: parent and child run different versions of dflash-pipeline; reinstall one"
            )
        return cls.from_dict(doc.get("fields"), where)


def _encode(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _encode(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, BaseModel):
        return value.model_dump(mode="json", by_alias=True)
    if isinstance(value, list | tuple):
        return [_encode(v) for v in value]
    if isinstance(value, dict):
        return {k: _encode(v) for k, v in value.items()}
    return value


def _decode(tp: Any, value: Any, where: str) -> Any:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        kinds = [a for a in args if a is not type(None)]
        return _decode(kinds[0], value, where) if len(kinds) == 1 else value
    if isinstance(tp, type) and issubclass(tp, BaseModel):
        return tp.model_validate(value)
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise HandoffError(f"{where}: expected an object for {tp.__name__}, got {type(value).__name__}")
        hints = typing.get_type_hints(tp)
        fields = {f.name: f for f in dataclasses.fields(tp) if f.init}
        unknown = sorted(set(value) - set(fields))
        missing = sorted(
            n
            for n, f in fields.items()
            if n not in value and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        )
        if unknown or missing:
            raise HandoffError(
                f"{where}: {tp.__name__} record does not match this code: "
                + "; ".join(p for p in (_named("unknown", unknown), _named("missing", missing)) if p)
                + ". Parent and child run different versions of dflash-pipeline; reinstall one"
            )
        return tp(**{k: _decode(hints[k], v, f"{where}.{k}") for k, v in value.items()})
    if origin is list:
        return [_decode(args[0], v, f"{where}[{i}]") for i, v in enumerate(value)] if args else list(value)
    if origin is dict:
        return {k: _decode(args[1], v, f"{where}.{k}") for k, v in value.items()} if args else dict(value)
    return value


def _named(what: str, names: list[str]) -> str:
    return f"{what} field{'s' if len(names) > 1 else ''} {', '.join(names)}" if names else ""
