"""``GET /v1/responses/{id}/input_items`` pages as OpenAI's does: newest first by default,
``after`` an item id, ``limit`` a page, ids the same at every read."""

from __future__ import annotations

import pytest

from langchain_agent_memory.server.responses_replies import input_items_page

ITEMS = [
    {"type": "message", "role": "user", "content": "one"},
    {"type": "function_call_output", "call_id": "c1", "output": "two"},
    {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "three"}], "id": "msg_x"},
]


def test_pages_walk_every_item_once_in_either_order() -> None:
    for order, expected in (("asc", ["one", "two", "three"]), ("desc", ["three", "two", "one"])):
        seen, after = [], None
        while True:
            page = input_items_page("resp_abc", ITEMS, order, after, 2)
            seen += [i.get("output") or i["content"][0]["text"] for i in page["data"]]
            if not page["has_more"]:
                break
            after = page["last_id"]
        assert seen == expected
    first = input_items_page("resp_abc", ITEMS, "asc", None, 5)["data"]
    assert first[0] == {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "one"}],
                        "status": "completed", "id": "msg_abc_0"}  # fmt: skip
    assert [i["id"] for i in first][1:] == ["item_abc_1", "msg_x"]  # the client's own id kept


def test_an_unknown_after_is_a_key_error() -> None:
    with pytest.raises(KeyError):
        input_items_page("resp_abc", ITEMS, "desc", "msg_nope", 2)
