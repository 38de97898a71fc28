"""The shipped texts, the windows the text is cut into, and the first-divergence rule."""

from __future__ import annotations

import pytest

from kvcache.eval import TEXTS, load_text
from kvcache.eval.greedy import first_divergence
from kvcache.eval.tokens import windows


@pytest.mark.parametrize("name, start", [("alice", "Alice's Adventures in Wonderland\nby Lewis Carroll"),
                                         ("as-you-like-it", "As You Like It\nby William Shakespeare")])
def test_shipped_texts(name: str, start: str) -> None:
    text = load_text(name)
    assert name in TEXTS and text.startswith(start)
    assert 20_000 < len(text) < 64_000  # a few tens of KB
    assert text.isascii() and "`" not in text and "\r" not in text


def test_text_file(tmp_path) -> None:
    f = tmp_path / "t.txt"
    f.write_text("Call me Ishmael.", encoding="utf-8")
    assert load_text(f) == "Call me Ishmael."
    (tmp_path / "empty.txt").write_text("\n")
    with pytest.raises(ValueError, match="^text: expected a file with some text"):
        load_text(tmp_path / "empty.txt")
    with pytest.raises(FileNotFoundError, match="^text: expected one of .*'alice'"):
        load_text("no-such-text")
    with pytest.raises(TypeError, match="^text: "):
        load_text(3)  # type: ignore[arg-type]


@pytest.mark.parametrize("n, window, cap, lengths", [
    (10, 4, None, [4, 4, 2]), (10, 4, 4, [4, 2]), (10, 4, 3, [4]), (9, 4, None, [4, 4]), (1, 4, None, []),
    (10, 20, None, [10]), (10, 4, 100, [4, 4, 2]),
])
def test_windows(n: int, window: int, cap: int | None, lengths: list[int]) -> None:
    ws = windows(list(range(n)), window, cap)
    assert [len(w) for w in ws] == lengths
    assert sum(ws, []) == list(range(sum(lengths)))  # consecutive, no overlap
    if cap is not None:
        assert sum(len(w) - 1 for w in ws) <= cap


def test_first_divergence() -> None:
    assert first_divergence([4, 5, 6], [4, 5, 6]) is None
    assert first_divergence([4, 5, 6], [4, 9, 6]) == 1
    assert first_divergence([4, 5], [4, 5, 6]) == 2  # one answer ended first
    assert first_divergence([], [1]) == 0
