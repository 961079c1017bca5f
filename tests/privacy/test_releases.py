"""The release records of medfl.privacy.releases on their own: digests of payloads, the
JSON-lines files written before a release leaves, a site ledger's replay and refusals, and
the coordinator journal's count of releases seen beyond those addressed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from medfl.privacy.releases import (ReleaseJournal, ReleaseRefused, SiteReleaseLedger, append_record,
                                    payload_digest, read_records)

GAUSS = [{"mechanism": "dp_gaussian", "noise_multiplier": 1.0, "clip": 0.5}]


def test_the_digest_sees_values_dtypes_shapes_and_keys_but_not_key_order() -> None:
    a = {"model": {"w": torch.arange(6.0).reshape(2, 3), "b": torch.zeros(())}, "n": 3}
    reordered = {"n": 3, "model": {"b": torch.zeros(()), "w": torch.arange(6.0).reshape(2, 3)}}
    assert payload_digest(a) == payload_digest(reordered)
    for other in ({**a, "n": 4}, {**a, "model": {**a["model"], "w": torch.arange(6.0).reshape(3, 2)}},
                  {**a, "model": {**a["model"], "w": torch.arange(6.0, dtype=torch.float64).reshape(2, 3)}},
                  {**a, "model": {**a["model"], "b": torch.full((), 1e-30)}}):
        assert payload_digest(other) != payload_digest(a)


def test_a_record_cut_short_by_a_crash_is_ignored_but_a_changed_file_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "r.jsonl"
    append_record(path, {"round": 1})
    append_record(path, {"round": 2})
    path.write_text(path.read_text() + '{"round": 3, "cli')
    assert read_records(path) == [{"round": 1}, {"round": 2}]
    path.write_text('{"round": 1}\nnot json\n{"round": 2}\n')
    with pytest.raises(ValueError, match=r"r.jsonl: line 2 is not a JSON record; the file was changed"):
        read_records(path)


def test_a_site_ledger_replays_its_bytes_refuses_another_instruction_and_a_reply_it_no_longer_has(
        tmp_path: Path) -> None:
    ledger = SiteReleaseLedger(tmp_path, "medfl site 0")
    payload = {"model": {"w": torch.randn(4)}}
    assert ledger.replay("run1", 1, "0", 0, GAUSS, "ins-a") is None
    ledger.record("run1", 1, "0", 0, GAUSS, "ins-a", payload, 12, {"loss": 0.5})
    got, n, metrics = ledger.replay("run1", 1, "0", 0, GAUSS, "ins-a")
    assert torch.equal(got["model"]["w"], payload["model"]["w"]) and n == 12 and metrics == {"loss": 0.5}
    assert ledger.replay("run1", 1, "0", 1, GAUSS, "ins-b") is None        # another step: a release of its own
    assert ledger.replay("run2", 1, "0", 0, GAUSS, "ins-b") is None        # another run
    twice = [{**GAUSS[0], "noise_multiplier": 2.0}]
    with pytest.raises(ReleaseRefused, match=r"medfl site 0: refused to release round 1 step 0 of run run1 again: it "
                                             r"was released under another instruction \(dp_gaussian at noise "
                                             r"multiplier 1, clip 0.5; now dp_gaussian at noise multiplier 2, "
                                             r"clip 0.5\)\. Rule: a site releases each"):
        ledger.replay("run1", 1, "0", 0, twice, "ins-c")
    ledger.prune(1)
    with pytest.raises(ReleaseRefused, match=r"the released reply .* is gone, so it cannot be sent again as it was"):
        ledger.replay("run1", 1, "0", 0, GAUSS, "ins-a")
    rec = json.loads((tmp_path / "releases.jsonl").read_text())
    assert rec == {"run": "run1", "round": 1, "client": "0", "step": 0, "mechanisms": GAUSS,
                   "released": payload_digest(payload), "instruction": "ins-a"}


def test_the_journal_counts_releases_seen_beyond_those_addressed(tmp_path: Path) -> None:
    journal = ReleaseJournal(tmp_path)
    specs = [{"name": "dp_gaussian", "noise_multiplier": 1.0}]
    same, other = {"model": {"w": torch.ones(3)}}, {"model": {"w": torch.zeros(3)}}
    journal.note(1, 0, "0", specs, None, same)
    journal.note(2, 0, "0", specs, None, same)
    journal.note(2, 0, "1", specs, None, same)
    journal.note(2, 0, "0", specs, None, same)      # the same bytes again: one release
    journal.note(2, 0, "1", specs, None, other)     # other bytes: a second release
    assert journal.extra(2, {"0": 1, "1": 1}) == {"1": 1}
    assert journal.extra(2, {"0": 1}) == {"1": 2}   # a client seen but not addressed this time
    assert sorted(journal.after(1)) == [2] and len(journal.after(1)[2]) == 4
    assert ReleaseJournal(tmp_path).records() == journal.records()    # what a resumed run reads back
