"""What every registry shares: a named entry goes in once (a second one under the same name is a bug)."""

from __future__ import annotations


def add_entry(table: dict, name: str, entry, what: str) -> None:
    """Put entry under name in table; a name that is there already raises ValueError (`what` names the kind)."""
    if name in table:
        raise ValueError(f"{what} {name!r} is already registered")
    table[name] = entry
