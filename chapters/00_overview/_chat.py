"""Validation of one chat JSONL record, for chapter 00's SFT page (not a page)."""

from __future__ import annotations

import json


def parse_chat_record(record) -> list[dict]:
    """The messages list of one JSONL record (a str line or a dict), validated."""
    if isinstance(record, str):
        try:
            record = json.loads(record)
        except json.JSONDecodeError as err:
            raise ValueError(f"JSONL line is not valid JSON: {record[:80]!r} ({err})") from None
    if not isinstance(record, dict) or "messages" not in record:
        keys = sorted(record) if isinstance(record, dict) else type(record).__name__
        raise ValueError(f"chat record has no 'messages' key (got {keys})")
    messages = record["messages"]
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"chat record has an empty or non-list 'messages': {messages!r}")
    for m in messages:
        if not isinstance(m, dict) or not isinstance(m.get("content"), str) or "role" not in m:
            raise ValueError(f"message must be {{'role': str, 'content': str}}, got {m!r}")
    return messages
