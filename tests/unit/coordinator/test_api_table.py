"""docs/openai-api.md's parameter table is the schema's: every request field has one
row with the endpoints that declare it, and a row says "refused" exactly when the
schema refuses the parameter (``NOT_SUPPORTED``)."""

from __future__ import annotations

import re
from pathlib import Path

from pdserve.coordinator.schemas import NOT_SUPPORTED, ChatCompletionRequest, CompletionRequest

DOC = Path(__file__).resolve().parents[3] / "docs" / "openai-api.md"
ROW = re.compile(r"^\| `(\w+)` \| (\w+) \| (\w+) \|")
STATUSES = {"supported", "extension", "limited", "refused"}


def _table() -> dict[str, tuple[str, str]]:
    rows = {}
    for line in DOC.read_text().splitlines():
        m = ROW.match(line)
        if m:
            assert m[1] not in rows, f"{m[1]} has two rows"
            rows[m[1]] = (m[2], m[3])
    return rows


def test_every_request_field_has_one_row_with_its_endpoints_and_status():
    completion, chat = set(CompletionRequest.model_fields), set(ChatCompletionRequest.model_fields)
    expected = {name: "both" if name in completion and name in chat else
                "completions" if name in completion else "chat" for name in completion | chat}
    rows = _table()
    assert {name: where for name, (where, _) in rows.items()} == expected
    assert {status for _, status in rows.values()} <= STATUSES


def test_refused_rows_are_exactly_the_parameters_the_schema_refuses():
    refused = {name for name, (_, status) in _table().items() if status == "refused"}
    assert refused == set(NOT_SUPPORTED)
