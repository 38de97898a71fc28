"""The English texts shipped for ``kvcache eval`` (public domain; see ``data/README.md``).

* ``"alice"`` (the default): Lewis Carroll, *Alice's Adventures in Wonderland* (1865), chapters I-V, prose
  (about 14,600 SmolLM2 tokens).
* ``"as-you-like-it"``: William Shakespeare, *As You Like It* (1623), Act I, dialogue in verse and prose
  (about 8,200 SmolLM2 tokens). Kept out of any tuning of the stored formats: a held-out check.
"""

from __future__ import annotations

import os
from importlib import resources

__all__ = ["TEXTS", "DEFAULT_TEXT", "load_text"]

TEXTS: dict[str, str] = {"alice": "alice.txt", "as-you-like-it": "as_you_like_it.txt"}
DEFAULT_TEXT = "alice"


def load_text(name_or_path: str | os.PathLike = DEFAULT_TEXT) -> str:
    """Read a shipped text by name, or any UTF-8 text file by path.

    Parameters
    ----------
    name_or_path : str or os.PathLike
        A key of :data:`TEXTS` (``"alice"``, ``"as-you-like-it"``), or the path of a text file.

    Returns
    -------
    str
        The text.

    Raises
    ------
    TypeError
        ``name_or_path`` is not a str or path.
    FileNotFoundError
        Neither a shipped text's name nor an existing file (the message lists the names).
    ValueError
        The file is empty.

    Example
    -------
    >>> load_text("alice").startswith("Alice's Adventures in Wonderland")
    True
    """
    if not isinstance(name_or_path, (str, os.PathLike)):
        raise TypeError(f"text: expected a name in {sorted(TEXTS)} or a file path, got {type(name_or_path).__name__}")
    key = os.fspath(name_or_path)
    if key in TEXTS:
        return resources.files(__package__).joinpath("data", TEXTS[key]).read_text(encoding="utf-8")
    if not os.path.isfile(key):
        raise FileNotFoundError(f"text: expected one of {sorted(TEXTS)} or a text file, got {key!r} (no such file)")
    with open(key, encoding="utf-8") as f:
        text = f.read()
    if not text.strip():
        raise ValueError(f"text: expected a file with some text, got the empty file {key!r}")
    return text
