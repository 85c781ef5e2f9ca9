"""oasr.defaults.env_switch: the on/off environment switches (OASR_*_GRAPHS, OASR_WFST_FUSED)."""

from __future__ import annotations

import pytest

from oasr.defaults import env_switch


@pytest.mark.parametrize(("value", "default", "expected"), [
    (None, True, True), (None, False, False), ("0", True, False), ("Off", True, False),
    (" false ", True, False), ("no", True, False), ("1", False, True), ("YES", False, True),
    ("on", False, True), ("maybe", True, True), ("maybe", False, False), ("", False, False),
])  # fmt: skip
def test_env_switch(monkeypatch, value, default, expected) -> None:
    if value is None:
        monkeypatch.delenv("OASR_TEST_SWITCH", raising=False)
    else:
        monkeypatch.setenv("OASR_TEST_SWITCH", value)
    assert env_switch("OASR_TEST_SWITCH", default) is expected
