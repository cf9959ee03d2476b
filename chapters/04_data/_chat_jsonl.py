"""Reading a chat JSONL file for chapter 04's SFT page (not a page)."""

from __future__ import annotations

from tinytron.overview.sft import parse_chat_record


def read_chat_jsonl(path: str) -> list[dict]:
    """The records of a chat JSONL file (blank lines skipped), each validated."""
    records = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                records.append({"messages": parse_chat_record(line)})
            except ValueError as err:
                raise ValueError(f"{path}:{n}: {err}") from None
    if not records:
        raise ValueError(f"{path}: no chat records")
    return records
