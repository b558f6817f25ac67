"""Where streamed text must stop being released: the part that may still turn into a tag."""
from __future__ import annotations


def tag_prefix_start(text: str, tags: tuple[str, ...]) -> int:
    """The start of the longest suffix of `text` that is a proper prefix of one of `tags` (len(text) if none):
    text from there on can only be judged when more arrives."""
    longest = 0
    for tag in tags:
        for size in range(min(len(tag) - 1, len(text)), longest, -1):
            if text.endswith(tag[:size]):
                longest = size
                break
    return len(text) - longest


def first_tag(text: str, tags: tuple[str, ...]) -> tuple[int, str] | None:
    """(position, tag) of the earliest of `tags` in `text` (the longer tag on a tie), or None."""
    found = [(pos, -len(tag), tag) for tag in tags if (pos := text.find(tag)) >= 0]
    return (min(found)[0], min(found)[2]) if found else None
