import pytest

from eaglepipe.units import human_bytes


@pytest.mark.parametrize("n, text", [(0, "0 B"), (1023, "1023 B"), (1024, "1.0 KiB"), (1536, "1.5 KiB"),
                                     (3.5 * 2**30, "3.5 GiB"), (2**50, "1024.0 TiB")])
def test_human_bytes(n, text):
    assert human_bytes(n) == text
