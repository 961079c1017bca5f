"""Region atlases on the PCP grid: PCP's CC200/CC400 (cropped), Dosenbach's ``rois_3mm``,
Power-264 spheres, any label NIfTI (resampled); written beside the prepared arrays and read
back as label arrays (:func:`load_atlas`, :func:`atlas_for_manifest`).

Imports :mod:`medfl.prep.abide.volumes` (the grid, reading, resampling, resizing) only.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import pandas as pd

from medfl.prep.abide.volumes import (
    GRID_AFFINE, GRID_SHAPE, _fmt_affine, load_volume, resample_to_grid, resize_volume, same_grid,
)
from medfl.prep.common import check_text_encoding
from medfl.prep.errors import PrepError

__all__ = ["ATLASES", "check_label_volume", "crop_cc_atlas", "rois_3mm_atlas", "read_coordinates",
           "sphere_atlas", "label_atlas", "atlas_table", "prepare_atlas", "write_atlas", "load_atlas",
           "atlas_for_manifest"]

ATLASES = ("auto", "cc200", "cc400", "rois_3mm", "power264", "file", "none")

#: Atlas files as PCP names them (abide/preprocessing/resources/abide_rois/).
_ATLAS_FILES = {"cc200": "CC200.nii.gz", "cc400": "CC400.nii.gz", "rois_3mm": "rois_3mm.nii.gz"}
#: PCP's CC200/CC400 grid and the crop that lands it on :data:`GRID_SHAPE`.
_CC_SHAPE = (63, 75, 61)
_CC_CROP = (slice(1, 62), slice(1, 74), slice(0, 61))
_ROIS_3MM_LABELS = 160


def check_label_volume(data: np.ndarray, path: str | Path) -> np.ndarray:
    """``data`` as int32 labels, after checking it is an atlas: finite, integer-valued, and
    piecewise constant (most voxels of a labelled region share their neighbour's label). A
    grey-matter probability map stored as 0..255 integers passes the first two tests and
    fails the third: its values change between most neighbouring voxels.

    Raises:
        PrepError: naming the file and which test failed.
    """
    values = np.asarray(data)
    if not np.all(np.isfinite(values)) or not np.allclose(values, np.round(values)):
        raise PrepError(f"{path}: not a label volume (non-integer values: a probability or intensity map?); "
                        "expected integer labels with 0 as background", path)
    ints = np.round(values).astype(np.int32)
    a, b = ints[:-1], ints[1:]
    inside = (a != 0) & (b != 0)
    if inside.sum() >= 100:
        same = float((a[inside] == b[inside]).mean())
        if same < 0.5:
            distinct = len(np.unique(ints)) - 1
            raise PrepError(f"{path}: not a label volume: neighbouring voxels share a value only {100 * same:.0f} % "
                            f"of the time ({distinct} distinct values); an atlas's regions are piecewise constant "
                            "(a probability or intensity map stored as integers?)", path)
    return ints


def crop_cc_atlas(data: np.ndarray, affine: np.ndarray, path: str | Path = "CC200.nii.gz"
                  ) -> tuple[np.ndarray, list[str]]:
    """Put PCP's CC200/CC400 label volume on the grid: crop ``[1:62, 1:74, :]``.

    A volume already on the grid is taken as is; any other grid is resampled by nearest
    neighbour (with a note).

    Returns:
        The int32 labels on :data:`GRID_SHAPE`, and notes (labels lost, resampling).
    """
    notes: list[str] = []
    data = check_label_volume(data, path)
    cropped_affine = affine.copy()
    cropped_affine[:3, 3] = affine[:3, :3] @ np.array([1, 1, 0]) + affine[:3, 3]
    if tuple(data.shape) == _CC_SHAPE and same_grid(GRID_SHAPE, cropped_affine):
        labels = np.asarray(data[_CC_CROP]).astype(np.int32)
    elif same_grid(data.shape, affine):
        labels = np.asarray(data).astype(np.int32)
    else:
        labels = resample_to_grid(np.asarray(data).astype(np.int32), affine, order=0)
        notes.append(f"{path}: grid {'x'.join(map(str, data.shape))} is neither PCP's 63x75x61 "
                     "CC atlas grid nor the data grid; resampled by nearest neighbour")
    lost = sorted(set(np.unique(data).tolist()) - set(np.unique(labels).tolist()))
    if lost:
        notes.append(f"{path}: labels {lost} fall outside the grid and were lost")
    return labels, notes


def rois_3mm_atlas(data: np.ndarray, affine: np.ndarray, path: str | Path = "rois_3mm.nii.gz"
                   ) -> tuple[np.ndarray, list[str]]:
    """The Dosenbach-160 ``rois_3mm`` volume on the grid, without labels above 160 (223)."""
    notes: list[str] = []
    labels = check_label_volume(data, path)
    if not same_grid(labels.shape, affine):
        labels = resample_to_grid(labels, affine, order=0)
        notes.append(f"{path}: not on the data grid; resampled by nearest neighbour")
    stray = sorted(int(v) for v in np.unique(labels) if v < 0 or v > _ROIS_3MM_LABELS)
    if stray:
        labels[np.isin(labels, stray)] = 0
        notes.append(f"{path}: dropped stray label(s) {stray} (Dosenbach has 1..{_ROIS_3MM_LABELS})")
    return labels, notes


def read_coordinates(path: str | Path) -> pd.DataFrame:
    """Read ROI centre coordinates (MNI mm): columns ``x, y, z`` (any case), optional
    ``ROI``/``number`` label and ``name``/``network`` (nilearn's ``power_2011.csv`` and
    ``dosenbach_2010.csv`` both work).

    Returns:
        Columns ``label``, ``name``, ``x``, ``y``, ``z`` (+ ``network`` when present).

    Raises:
        PrepError: the file is missing/unreadable or lacks x/y/z, or a coordinate is not a number.
    """
    path = Path(path)
    if not path.is_file():
        raise PrepError(f"{path}: coordinate file not found; expected a CSV with x, y, z columns "
                        "(e.g. nilearn's power_2011.csv)", path)
    check_text_encoding(path, "coordinate CSV")
    try:
        table = pd.read_csv(path)
    except (pd.errors.ParserError, pd.errors.EmptyDataError, UnicodeDecodeError) as exc:
        raise PrepError(f"{path}: cannot parse the coordinates ({exc})", path) from exc
    cols = {c.lower().strip(): c for c in table.columns}
    missing = [c for c in ("x", "y", "z") if c not in cols]
    if missing or table.empty:
        raise PrepError(f"{path}: missing column(s) {missing or 'rows'}; expected x, y, z (MNI mm); "
                        f"found {', '.join(map(str, table.columns))}", path)
    out = pd.DataFrame({k: pd.to_numeric(table[cols[k]], errors="coerce") for k in ("x", "y", "z")})
    if out.isna().any().any():
        row = int(out.isna().any(axis=1).to_numpy().argmax())
        raise PrepError(f"{path}: line {row + 2}: a coordinate is not a number", path)
    label_col = cols.get("roi") or cols.get("number") or cols.get("label")
    out.insert(0, "label", table[label_col].astype(int) if label_col else np.arange(1, len(table) + 1))
    out.insert(1, "name", table[cols["name"]].astype(str) if "name" in cols
               else [f"{path.stem}_{int(v):03d}" for v in out["label"]])
    if "network" in cols:
        out["network"] = table[cols["network"]].astype(str)
    if out["label"].duplicated().any() or (out["label"] < 1).any():
        raise PrepError(f"{path}: ROI labels must be unique positive integers", path)
    return out


def sphere_atlas(coords: pd.DataFrame, radius: float = 5.0, shape: Sequence[int] = GRID_SHAPE,
                 affine: np.ndarray = GRID_AFFINE) -> tuple[np.ndarray, pd.DataFrame]:
    """Label every voxel whose centre lies within ``radius`` mm of an ROI centre.

    A voxel within reach of two centres goes to the nearer one (``overlap_voxels`` counts
    them per ROI). Power-264 at 5 mm on the PCP grid: 16-24 voxels each, no overlap.

    Returns:
        int32 labels of ``shape``, and ``coords`` with ``voxels`` and ``overlap_voxels``.

    Raises:
        PrepError: a centre outside the grid, or a sphere with no voxel.
    """
    shape = tuple(int(s) for s in shape)
    labels = np.zeros(shape, dtype=np.int32)
    best = np.full(shape, np.inf)
    inv = np.linalg.inv(affine)
    reach = int(np.ceil(radius / np.min(np.abs(np.diag(affine)[:3])))) + 1
    overlap = np.zeros(len(coords), dtype=int)
    owner_row = {int(v): i for i, v in enumerate(coords["label"])}
    for i, r in enumerate(coords.itertuples(index=False)):
        centre = np.array([r.x, r.y, r.z], dtype=float)
        ijk = inv[:3, :3] @ centre + inv[:3, 3]
        if np.any(ijk < -0.5) or np.any(ijk > np.array(shape) - 0.5):
            raise PrepError(f"ROI {r.label} ({r.x}, {r.y}, {r.z}) lies outside the "
                            f"{'x'.join(map(str, shape))} grid")
        lo = np.maximum(np.floor(ijk).astype(int) - reach, 0)
        hi = np.minimum(np.ceil(ijk).astype(int) + reach + 1, shape)
        box = np.stack(np.meshgrid(*[np.arange(a, b) for a, b in zip(lo, hi)], indexing="ij"), -1)
        world = box @ affine[:3, :3].T + affine[:3, 3]
        dist = np.linalg.norm(world - centre, axis=-1)
        inside = dist <= radius + 1e-6
        sub = tuple(slice(a, b) for a, b in zip(lo, hi))
        taken = inside & (labels[sub] > 0)
        for other in np.unique(labels[sub][taken]):
            overlap[owner_row[int(other)]] += int(((labels[sub] == other) & taken).sum())
        overlap[i] += int(taken.sum())
        win = inside & (dist < best[sub])
        labels[sub][win] = int(r.label)
        best[sub][win] = dist[win]
    table = coords.copy()
    table["voxels"] = [int((labels == v).sum()) for v in table["label"]]
    table["overlap_voxels"] = overlap
    empty = table.loc[table["voxels"] == 0, "label"].tolist()
    if empty:
        raise PrepError(f"ROI(s) {empty}: no voxel centre within {radius} mm; use a larger --sphere-radius")
    return labels, table


def label_atlas(path: str | Path) -> tuple[np.ndarray, list[str]]:
    """Any label NIfTI (3D, integer-valued) resampled onto the grid by nearest neighbour.

    Raises:
        PrepError: unreadable, not 3D, not integer-valued, or no label left on the grid.
    """
    data, affine = load_volume(path, "atlas label volume")
    ints = check_label_volume(data, path)
    notes: list[str] = []
    if same_grid(ints.shape, affine):
        labels = ints
    else:
        labels = resample_to_grid(ints, affine, order=0)
        notes.append(f"{path}: grid {'x'.join(map(str, ints.shape))} with affine {_fmt_affine(affine)} "
                     "resampled onto the data grid by nearest neighbour")
    lost = sorted(set(np.unique(ints).tolist()) - set(np.unique(labels).tolist()) - {0})
    if lost:
        notes.append(f"{path}: label(s) {lost} did not survive resampling onto the grid")
    if not np.any(labels > 0):
        raise PrepError(f"{path}: no positive label on the data grid after resampling", path)
    return labels, notes


def atlas_table(labels: np.ndarray, affine: np.ndarray = GRID_AFFINE, names: dict[int, str] | None = None,
                prefix: str = "region") -> pd.DataFrame:
    """One row per positive label: ``label, name, voxels, x, y, z`` (centroid, mm)."""
    values = [int(v) for v in np.unique(labels) if v > 0]
    rows = []
    for v in values:
        ijk = np.argwhere(labels == v).mean(axis=0)
        xyz = affine[:3, :3] @ ijk + affine[:3, 3]
        rows.append({"label": v, "name": (names or {}).get(v, f"{prefix}_{v:03d}"),
                     "voxels": int((labels == v).sum()), "x": round(float(xyz[0]), 2),
                     "y": round(float(xyz[1]), 2), "z": round(float(xyz[2]), 2)})
    return pd.DataFrame(rows, columns=["label", "name", "voxels", "x", "y", "z"])


def _find_named(raw: Path, name: str) -> Path | None:
    for base in (raw / "rois", raw, raw / "abide_rois", raw / "ABIDE_pcp",
                 raw / "resources" / "abide_rois"):
        if (base / name).is_file():
            return base / name
    return next((p for p in sorted(raw.rglob(name)) if p.is_file()), None)


def _bundled_power() -> Path | None:
    spec = importlib.util.find_spec("nilearn")
    if spec is None or not spec.submodule_search_locations:
        return None
    p = Path(list(spec.submodule_search_locations)[0]) / "datasets" / "data" / "power_2011.csv"
    return p if p.is_file() else None


def prepare_atlas(kind: str, raw: Path, atlas_file: str | Path | None = None,
                  coords: str | Path | None = None, radius: float = 5.0
                  ) -> tuple[str, np.ndarray, pd.DataFrame, str, list[str]] | None:
    """Build the atlas label volume on the grid.

    Args:
        kind: one of :data:`ATLASES`.
        raw: the download, searched for ``CC200.nii.gz``... when no ``atlas_file`` is given.
        atlas_file: the atlas NIfTI (``cc200``, ``cc400``, ``rois_3mm``, ``file``, ``auto``).
        coords: ROI centre CSV for ``power264`` (default: nilearn's bundled ``power_2011.csv``).
        radius: sphere radius in mm for ``power264``.

    Returns:
        ``(name, labels, table, source, notes)`` or ``None`` for ``none`` (or ``auto`` with
        nothing available).

    Raises:
        PrepError: the chosen atlas's file is missing or invalid.
    """
    if kind not in ATLASES:
        raise PrepError(f"--atlas: unknown {kind!r}; valid: {', '.join(ATLASES)}")
    if kind == "none":
        return None
    notes: list[str] = []
    if kind == "auto":
        if atlas_file is not None:
            stem = Path(atlas_file).name.lower()
            kind = next((k for k, f in _ATLAS_FILES.items() if stem == f.lower()), "file")
        elif _find_named(raw, _ATLAS_FILES["cc200"]) is not None:
            kind = "cc200"
        elif coords is not None or _bundled_power() is not None:
            kind = "power264"
            notes.append("atlas auto: no atlas file given and no CC200.nii.gz under --raw; "
                         f"using {radius:g} mm spheres around the Power-264 coordinates")
        else:
            notes.append("atlas auto: no atlas file, no CC200.nii.gz under --raw and no Power-264 "
                         "coordinates (install nilearn or pass --atlas-coords); no atlas written")
            return None
    if kind == "power264":
        src = Path(coords) if coords is not None else _bundled_power()
        if src is None:
            raise PrepError("--atlas power264: no coordinates; pass --atlas-coords power_2011.csv "
                            "(nilearn/datasets/data/power_2011.csv) or install nilearn")
        labels, spheres = sphere_atlas(read_coordinates(src), radius)
        cen = atlas_table(labels, names=dict(zip(spheres["label"].astype(int), spheres["name"])))
        spheres = spheres.rename(columns={"x": "coord_x", "y": "coord_y", "z": "coord_z"})
        table = cen.merge(spheres.drop(columns=["name", "voxels"]), on="label")
        overlaps = int(spheres["overlap_voxels"].sum())
        if overlaps:
            notes.append(f"power264: {overlaps} voxel(s) within reach of two spheres went to the "
                         "nearer centre")
        return "power264", labels, table, str(src), notes
    if kind in _ATLAS_FILES:
        src = Path(atlas_file) if atlas_file is not None else _find_named(raw, _ATLAS_FILES[kind])
        if src is None:
            raise PrepError(f"--atlas {kind}: {_ATLAS_FILES[kind]} not found under {raw}; pass "
                            f"--atlas-file PATH (PCP's abide/preprocessing/resources/abide_rois/"
                            f"{_ATLAS_FILES[kind]})", raw)
        data, affine = load_volume(src, f"{kind} atlas")
        if kind == "rois_3mm":
            labels, more = rois_3mm_atlas(data, affine, src)
        else:
            labels, more = crop_cc_atlas(data, affine, src)
        return kind, labels, atlas_table(labels, prefix=kind), str(src), notes + more
    if atlas_file is None:
        raise PrepError("--atlas file: pass --atlas-file PATH (a label NIfTI)")
    labels, more = label_atlas(atlas_file)
    return "file", labels, atlas_table(labels), str(atlas_file), notes + more


def write_atlas(out: Path, labels: np.ndarray, table: pd.DataFrame, size: Sequence[int] | None = None,
                aspect: str = "stretch") -> dict[str, str]:
    """Write ``atlas/atlas.nii.gz`` (+ the resized copy) and ``atlas/atlas_labels.csv``.

    Returns:
        Relative paths: ``grid``, ``labels_csv`` and, with ``size``, ``resized`` (the one
        matching the cached arrays is ``data``).
    """
    import nibabel as nib

    folder = out / "atlas"
    folder.mkdir(parents=True, exist_ok=True)
    lab = labels.astype(np.int32)
    nib.save(nib.Nifti1Image(lab, GRID_AFFINE), str(folder / "atlas.nii.gz"))
    paths = {"grid": "atlas/atlas.nii.gz", "labels_csv": "atlas/atlas_labels.csv",
             "data": "atlas/atlas.nii.gz"}
    table = table.copy()
    if size is not None:
        small, matrix = resize_volume(lab, size, aspect, order=0)
        name = "atlas_" + "x".join(str(int(s)) for s in size) + ".nii.gz"
        nib.save(nib.Nifti1Image(small.astype(np.int32), GRID_AFFINE @ matrix), str(folder / name))
        paths["resized"] = paths["data"] = f"atlas/{name}"
        table["voxels_resized"] = [int((small == v).sum()) for v in table["label"]]
    table.to_csv(folder / "atlas_labels.csv", index=False)
    return paths


def load_atlas(path: str | Path, with_table: bool = False) -> Any:
    """Read an atlas written by this script as an int32 label array ``(X, Y, Z)`` (0 =
    background; same voxel order as the cached arrays' spatial axes).

    With ``with_table``, returns ``(labels, table)`` where ``table`` is the
    ``atlas_labels.csv`` beside it (``label, name, voxels, x, y, z``...).

    Raises:
        PrepError: missing or unreadable file, or non-integer labels.
    """
    data, _ = load_volume(path, "atlas label volume")
    if not np.allclose(data, np.round(data)):
        raise PrepError(f"{path}: not a label volume (non-integer values)", path)
    labels = np.round(data).astype(np.int32)
    if not with_table:
        return labels
    csv = Path(path).with_name("atlas_labels.csv")
    if not csv.is_file():
        raise PrepError(f"{csv}: labels table not found beside {Path(path).name}", csv)
    return labels, pd.read_csv(csv)


def atlas_for_manifest(manifest: str | Path) -> tuple[np.ndarray, pd.DataFrame]:
    """The atlas matching a prepared manifest's arrays (its ``atlas`` column): ``(labels, table)``.

    Raises:
        PrepError: the manifest has no atlas (prepared with ``--atlas none``) or it is missing.
    """
    manifest = Path(manifest)
    table = pd.read_csv(manifest, dtype={"atlas": str}, keep_default_na=False)
    if "atlas" not in table.columns or not table["atlas"].astype(bool).any():
        raise PrepError(f"{manifest}: no atlas column; prepare with --atlas", manifest)
    return load_atlas(manifest.parent / table["atlas"].iloc[0], with_table=True)
