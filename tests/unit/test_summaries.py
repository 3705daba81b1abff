"""The words and numbers of the command line's summaries (:mod:`weightsync.service.progress`)."""

from __future__ import annotations

from weightsync.service.progress import counted, human_bytes, ratio_text


def test_counts_are_singular_for_one_only():
    assert [counted(n, "file") for n in (0, 1, 2)] == ["0 files", "1 file", "2 files"]
    assert counted(1, "abandoned publish", "abandoned publishes") == "1 abandoned publish"
    assert counted(3, "abandoned publish", "abandoned publishes") == "3 abandoned publishes"


def test_a_ratio_of_nothing_stored_is_a_dash():
    assert ratio_text(1000, 8) == "125.0x" and ratio_text(1000, 0) == "-"
    assert human_bytes(512) == "512 B" and human_bytes(1536) == "1.5 KiB"
