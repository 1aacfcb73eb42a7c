"""Errors for bad input: each names the file, the field and what is allowed."""

from __future__ import annotations


class CapoptError(Exception):
    """Bad user input. The CLI prints ``str(err)`` as one line and exits with status 2."""

    def __init__(self, message: str, *, file: str | None = None, field: str | None = None,
                 allowed: str | None = None):
        self.file = file
        self.field = field
        self.allowed = allowed
        self.message = message
        super().__init__(self._render())

    def _render(self) -> str:
        where = ""
        if self.file and self.field:
            where = f"{self.file}: {self.field}: "
        elif self.file:
            where = f"{self.file}: "
        elif self.field:
            where = f"{self.field}: "
        text = f"{where}{self.message}"
        if self.allowed:
            text += f" (allowed: {self.allowed})"
        return " ".join(text.split())

    def in_file(self, file: str) -> "CapoptError":
        """Return a copy of this error that names ``file`` (if it named none)."""
        if self.file:
            return self
        return CapoptError(self.message, file=file, field=self.field, allowed=self.allowed)

