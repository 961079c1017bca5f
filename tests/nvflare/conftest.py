"""The NVFlare tests' sites opt out of approvals by name (``MEDFL_APPROVALS=none``; an NVFlare
site answers nothing without an approvals file or that), unless a test sets its own file."""

from __future__ import annotations

import pytest

from medfl.approval import APPROVALS_ENV, OPT_OUT


@pytest.fixture(autouse=True)
def sites_opt_out_of_approvals(monkeypatch: pytest.MonkeyPatch) -> None:
    """``MEDFL_APPROVALS=none`` in this process (and the simulator's processes, which inherit it)."""
    monkeypatch.setenv(APPROVALS_ENV, OPT_OUT)
