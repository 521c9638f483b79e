"""Sizes are read the same way everywhere (docs/configuration.md)."""

import pytest

from shared.sizes import GiB, MiB, SizeError, format_size, parse_size


@pytest.mark.parametrize(
    "text, expected",
    [
        ("1536MiB", 1536 * MiB),
        ("1.5GiB", int(1.5 * GiB)),
        ("2GB", 2 * 10**9),
        ("4096", 4096),
        (4096, 4096),
        ("  3 gib ", 3 * GiB),
        ("0", 0),
        ("1KB", 1000),
        ("1kib", 1024),
        ("10B", 10),
        (".5GiB", GiB // 2),
    ],
)
def test_parse_size_accepts_contract_forms(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize(
    "text, fragment",
    [
        ("", "not a size"),
        ("GiB", "not a size"),
        ("-1GiB", "not a size"),
        ("1.5", "whole"),
        ("3 parsecs", "unknown unit"),
        ("1e9", "not a size"),
        (-5, "negative"),
        (True, "not a size"),
        (float("nan"), "whole"),
        (None, "not a size"),
        ("99999999999TiB", "too large"),
        (2**63, "too large"),
        (float(2**64), "too large"),
    ],
)
def test_parse_size_rejects_bad_input_with_reason(text, fragment):
    with pytest.raises(SizeError, match=fragment):
        parse_size(text)


@pytest.mark.parametrize(
    "nbytes, text",
    [(0, "0 B"), (900, "900 B"), (512 * MiB, "512 MiB"), (int(1.5 * GiB), "1.5 GiB"), (-GiB, "-1 GiB")],
)
def test_format_size(nbytes, text):
    assert format_size(nbytes) == text


def test_the_largest_size_is_what_the_ledger_and_the_wire_carry():
    """A custom ceiling past int64 was taken, then crashed the supervisor's loop at
    the first tick that published it (msgpack) or wrote it into the ledger."""
    import msgspec

    from shared.sizes import MAX_SIZE

    assert parse_size(MAX_SIZE) == MAX_SIZE
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(MAX_SIZE)) == MAX_SIZE


def test_parse_size_keeps_whole_byte_counts_exact():
    assert parse_size("9007199254740993") == 2**53 + 1  # a float would round this
    assert parse_size("3GiB") == 3 * GiB
