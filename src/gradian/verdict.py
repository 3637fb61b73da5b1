"""The verdict of an attribution run (report.json `verdict`): what the capability stage concluded, and what every
reader of a report branches on.

A `StrEnum`: a member equals (and hashes as) its string, formats as it and `json.dumps` writes it as the bare
string, so report.json and every message read as they always did; code compares members (`is Verdict.attributed`),
never strings. Only the standard library is imported: `report.schema` (torch-free) types report.json's `verdict`
with it."""

from __future__ import annotations

from enum import StrEnum


class Verdict(StrEnum):
    """The verdict of an attribution run: attributed, declined or smoke_test."""

    attributed = "attributed"  # the capability moved measurably: the rows that pushed it are ranked, outliers accused
    declined = "declined"  # it did not move measurably, or the scores cannot name a cause: nobody is accused
    smoke_test = "smoke_test"  # no eval set: the ranking shows the rows with the largest gradients, not causes
