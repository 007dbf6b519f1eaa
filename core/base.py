"""Base of every configuration section (kept apart so stage packages can define their own sections
without importing the whole run configuration)."""

from typing import Literal, get_args, get_origin

from pydantic import BaseModel, ConfigDict, ValidationInfo, field_validator


def _literal_values(annotation) -> tuple:
    """The values of a Literal annotation, also inside Optional/Union; () for any other type."""
    if get_origin(annotation) is Literal:
        return get_args(annotation)
    return tuple(v for arg in get_args(annotation) for v in _literal_values(arg))


class Section(BaseModel):
    """Unknown fields are errors; assignments are validated too."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    @field_validator("*", mode="before")
    @classmethod
    def _yaml_off(cls, value, info: ValidationInfo):
        """YAML (a config file, `--set`, `prefect deployment run -p`) reads a bare off/on/no/yes as a boolean:
        a choice field that offers 'off' (or 'on') takes it back as that word, so `--set extract.compile=off` works."""
        if isinstance(value, bool) and info.field_name in cls.model_fields:
            word = "on" if value else "off"
            if word in _literal_values(cls.model_fields[info.field_name].annotation):
                return word
        return value
