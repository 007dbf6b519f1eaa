"""Base of every configuration section (kept apart so stage packages can define their own sections
without importing the whole run configuration)."""

from pydantic import BaseModel, ConfigDict


class Section(BaseModel):
    """Unknown fields are errors; assignments are validated too."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)
