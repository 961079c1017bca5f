"""The per-round CSVs are written from text formatted once per row (``GrowingCsv``): every
file must be exactly what ``DataFrame.to_csv`` of the whole frame gives, whatever the frame
did between writes (grew, had a row changed in place, gained a column, had a dtype widened),
and keep its checksum sidecar."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from medfl.rundir import GrowingCsv, check_sum


def _rows(rng: np.random.Generator, start: int, k: int) -> pd.DataFrame:
    return pd.DataFrame({
        "round": np.arange(start, start + k), "client_id": [str(x) for x in rng.integers(0, 99, k)],
        "loss": rng.choice([0.1, 1e-7, 3.0, np.nan, 1 / 3, -0.0, 1e300], k), "n": rng.integers(-5, 5, k),
        "ok": rng.random(k) > 0.5, "note": [rng.choice(["a", "b,c", 'say "x"', "é"]) for _ in range(k)]})


def test_every_write_is_the_whole_frame_as_pandas_writes_it(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    csv, path = GrowingCsv(), tmp_path / "metrics.csv"
    df = pd.DataFrame()
    for step in range(12):
        df = pd.concat([df, _rows(rng, len(df), int(rng.integers(0, 6)))], ignore_index=True)
        if step == 4:
            df.loc[1, "loss"] = 42.0                 # an earlier row changed in place
        if step == 6:
            df["auc"] = rng.random(len(df))           # a column added
        if step == 8:
            df.loc[len(df) - 1, "n"] = np.nan         # an integer column widened to float
        if step == 10:
            df = df.iloc[::-1]                        # rows reordered (index no longer 0..n-1)
        csv.write(path, df)
        assert path.read_bytes() == df.to_csv(index=False).encode("utf-8"), step
        assert check_sum(path) == ""
    assert not list(tmp_path.glob("*.tmp"))


def test_a_frame_changed_after_its_write_is_written_in_full_next_time(tmp_path: Path) -> None:
    """What was written is remembered as a copy: changing the caller's frame in place after a
    write is seen at the next write."""
    rng = np.random.default_rng(1)
    csv, path = GrowingCsv(), tmp_path / "train_metrics.csv"
    df = _rows(rng, 0, 5)
    csv.write(path, df)
    df.loc[0, "client_id"] = "changed"
    df = pd.concat([df, _rows(rng, 5, 3)], ignore_index=True)
    csv.write(path, df)
    assert path.read_text(encoding="utf-8") == df.to_csv(index=False)
    assert "changed" in path.read_text(encoding="utf-8")
