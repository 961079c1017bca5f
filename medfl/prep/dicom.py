"""Mammograms as DICOM files (:mod:`medfl.prep.cbis_ddsm`): :func:`read_dicom` judges the header
before reading any pixel; :func:`is_mask` tells an ROI mask from a crop."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import numpy as np

from medfl.prep.common import check_file_size, check_pixel_count
from medfl.prep.errors import PrepError, check_file

__all__ = ["DICOM_EXTRA", "MAMMO_PHOTOMETRIC", "read_dicom", "is_mask"]

#: transfer syntaxes pydicom reads natively (uncompressed)
_NATIVE = {"1.2.840.10008.1.2", "1.2.840.10008.1.2.1", "1.2.840.10008.1.2.2", "1.2.840.10008.1.2.1.99"}

#: What installs pydicom's own decoders of the compressed transfer syntaxes (JPEG, JPEG-LS,
#: JPEG 2000; RLE needs none): the ``dicom`` extra, pylibjpeg with pylibjpeg-libjpeg and
#: pylibjpeg-openjpeg.
DICOM_EXTRA = 'pip install "medfl[dicom]" (pylibjpeg, pylibjpeg-libjpeg, pylibjpeg-openjpeg)'
#: pydicom's decoder plugins that decode every variant of the syntaxes they list (``pydicom``:
#: its own RLE decoder); Pillow does not (no 12-bit JPEG), so a file only Pillow failed on may
#: be intact.
_FULL_DECODERS = ("pylibjpeg", "gdcm", "pyjpegls", "pydicom")


#: pydicom's decoder plugins whose requirement names a module, not the package that installs
#: it (pydicom's plugin table, "Plugins for Pixel Data compression and decompression": the
#: ``gdcm`` plugin requires python-gdcm)
_PLUGIN_PACKAGES = {"gdcm": "python-gdcm"}


def _decoder_plugins(ts: str) -> tuple[list[str], list[str]]:
    """pydicom's decoder plugins for transfer syntax ``ts``: (installed, the packages that
    would install the others: pydicom's ``missing_dependencies``); two empty lists for a
    syntax pydicom has no decoder for (or a pydicom before 3.0)."""
    try:
        from pydicom.pixels import get_decoder
        from pydicom.uid import UID

        decoder = get_decoder(UID(ts))
    except Exception:  # noqa: BLE001 - an unknown syntax or an older pydicom
        return [], []
    # "gdcm - requires gdcm>=3.0.10", "pylibjpeg - requires pylibjpeg>=2.0 and pylibjpeg-libjpeg>=2.1"
    needs = [str(m).partition(" - requires ")[2] for m in decoder.missing_dependencies]
    names = [re.split(r"[<>=!~ ;\[]", r.strip())[0] for n in needs for r in re.split(r",| and ", n) if r.strip()]
    return list(decoder.available_plugins), list(dict.fromkeys(_PLUGIN_PACKAGES.get(n, n) for n in names))


def _decoder_available(ts: str) -> bool:
    """Whether a decoder of pydicom's that reads every variant of transfer syntax ``ts``
    (:data:`_FULL_DECODERS`; not Pillow alone) is installed here: a file it cannot decode is
    damaged, or needs another of pydicom's decoders."""
    return any(p in _FULL_DECODERS for p in _decoder_plugins(ts)[0])


def _undecodable(path: Path, ts: str, name: str, exc: Exception) -> PrepError:
    """The one-line error for compressed pixel data that did not decode: the file, the syntax
    (name and UID), what the installed decoders said, and the packages of pydicom's other
    decoders for it (:data:`DICOM_EXTRA` where no full decoder is installed)."""
    installed, packages = _decoder_plugins(ts)
    why = "; ".join(" ".join(line.split()) for line in str(exc).splitlines() if line.strip()).replace(":; ", ": ")
    head = f"{path}: compressed transfer syntax {name} ({ts})"
    if not installed and not packages:
        return PrepError(f"{head}: pydicom has no decoder for it; convert the file to an uncompressed transfer "
                         f"syntax (e.g. `gdcmconv --raw` or `dcmdjpeg`) and prepare again ({why})", path)
    if _decoder_available(ts):
        others = f"pydicom's other decoder for it may: pip install {' '.join(packages)}; if not, " if packages else ""
        return PrepError(f"{head}: the installed decoder could not decode it ({why}); {others}the file is damaged "
                         "or its header (Rows, Columns, bits) disagrees with the compressed data", path)
    tried = f"{' and '.join(installed)} could not decode it ({why})" if installed else "no decoder for it is installed"
    others = [p for p in packages if p not in DICOM_EXTRA]
    return PrepError(f"{head}: {tried}. Install pydicom's decoders: {DICOM_EXTRA}"
                     + (f" or pip install {' '.join(others)}" if others else "")
                     + "; if the file still does not decode, it is damaged", path)


#: what a CBIS-DDSM image (mammogram, ROI crop or mask) must be
MAMMO_PHOTOMETRIC = ("MONOCHROME1", "MONOCHROME2")


def _dcmread(path: Path, stop_before_pixels: bool = False) -> tuple[Any, int]:
    """``pydicom.dcmread`` of ``path``, its failures as :class:`PrepError`; returns the
    dataset and where the file was left (with ``stop_before_pixels``: where the pixel data
    element starts, the header's length)."""
    import pydicom
    from pydicom.errors import InvalidDicomError

    try:
        with open(path, "rb") as f:
            # the header read leaves any large value (over 1 MiB) unread: only small fields are judged
            ds = pydicom.dcmread(f, stop_before_pixels=stop_before_pixels,
                                 defer_size="1 MB" if stop_before_pixels else None)
            return ds, f.tell()
    except InvalidDicomError as exc:
        found = _headerless(path, stop_before_pixels)
        if found is not None:
            return found
        why = re.sub(r"\s*(Use|or set) .?force.*$", "", str(exc)).rstrip(".")   # no option of ours forces a read
        raise PrepError(f"{path}: not a DICOM file ({why}; nor a DICOM data set without that header: no image "
                        "of Rows, Columns and BitsAllocated)", path) from exc
    except (OSError, EOFError, ValueError, KeyError) as exc:
        raise PrepError(f"{path}: not a readable DICOM file ({type(exc).__name__}: {exc})", path) from exc


#: (implicit VR, little endian) -> the transfer syntax of a data set written without file meta
_RAW_SYNTAX = {(True, True): "1.2.840.10008.1.2", (False, True): "1.2.840.10008.1.2.1",
               (False, False): "1.2.840.10008.1.2.2"}


def _headerless(path: Path, stop_before_pixels: bool) -> tuple[Any, int] | None:
    """A DICOM data set written without the Part-10 header (no 128-byte preamble, no
    ``DICM``, no file meta; older archives and some exports): pydicom reads it with
    ``force=True`` and the encoding it finds (implicit or explicit VR, byte order) becomes the
    file meta's TransferSyntaxUID. ``None`` unless it starts with a group 0008 element and
    parses as an image (Rows, Columns, BitsAllocated): forced reads of other bytes give
    nonsense elements, not an error.
    """
    import pydicom
    from pydicom.dataset import FileMetaDataset

    try:
        with open(path, "rb") as f:
            # an image data set opens with group 0008 (SpecificCharacterSet, SOPClassUID...):
            # anything else (zeros, text) is not forced through, which could take minutes
            if f.read(2) not in (b"\x08\x00", b"\x00\x08"):
                return None
            f.seek(0)
            ds = pydicom.dcmread(f, force=True, stop_before_pixels=stop_before_pixels,
                                 defer_size="1 MB" if stop_before_pixels else None)
            where = f.tell()
        if not all(k in ds for k in ("Rows", "Columns", "BitsAllocated")):
            return None
        encoding = getattr(ds, "original_encoding", None) or (ds.is_implicit_VR, ds.is_little_endian)
        syntax = _RAW_SYNTAX.get((bool(encoding[0]), bool(encoding[1])))
    except Exception:  # noqa: BLE001 - whatever the forced read trips on, the file is not one
        return None
    if syntax is None:
        return None
    meta = FileMetaDataset()
    meta.TransferSyntaxUID = syntax
    ds.file_meta = meta
    ds.headerless = True     # read_dicom's facts say so (the report counts such files)
    return ds, where


def _check_header(ds: Any, path: Path, size: int, header: int) -> None:
    """Judge a DICOM header read without its pixel data: what a mammogram must be, and the
    size it announces: Rows x Columns (x frames) within
    :data:`~medfl.prep.common.MAX_IMAGE_PIXELS`, and a ``size``-byte file not far larger
    than a ``header``-byte header and that many BitsAllocated pixels
    (:func:`~medfl.prep.common.check_file_size`), so that a huge file is refused unread.

    Raises:
        PrepError: naming the file and the field.
    """
    modality = str(getattr(ds, "Modality", "") or "")
    if modality and modality.upper() != "MG":
        raise PrepError(f"{path}: modality {modality}; expected MG (a mammogram)", path)
    photometric = str(getattr(ds, "PhotometricInterpretation", "MONOCHROME2") or "MONOCHROME2").upper()
    if photometric not in MAMMO_PHOTOMETRIC:
        raise PrepError(f"{path}: photometric interpretation {photometric}; expected MONOCHROME1 or MONOCHROME2 "
                        "(a grayscale mammogram: palette or colour values are not intensities)", path)
    if "BitsAllocated" not in ds:
        raise PrepError(f"{path}: the header lacks BitsAllocated (0028,0100); the pixel data cannot be decoded", path)
    allocated = int(ds.BitsAllocated)
    if allocated not in (8, 16):
        what = "a 1-bit image (a segmentation?)" if allocated == 1 else f"{allocated}-bit pixels (a dose or float map?)"
        raise PrepError(f"{path}: {what}; expected 8- or 16-bit mammogram pixels", path)
    rows, cols = int(getattr(ds, "Rows", 0) or 0), int(getattr(ds, "Columns", 0) or 0)
    frames = int(getattr(ds, "NumberOfFrames", 1) or 1)
    check_pixel_count(path, (rows, cols) if frames == 1 else (frames, rows, cols))
    check_file_size(path, size, header, rows * cols * frames * allocated // 8,
                    f"{rows} x {cols}" + (f" x {frames} frames" if frames > 1 else "") + f", {allocated}-bit")


def read_dicom(path: Path) -> tuple[np.ndarray, dict[str, Any]]:
    """Pixel data of an MG DICOM as float32 in [0, 1] (MONOCHROME1 inverted, signed pixel
    data shifted to start at 0) and header facts.

    What a mammogram must be is checked before any pixel is read: modality MG (when the
    header names one), one grayscale frame (MONOCHROME1/2: palette or RGB images are not
    intensities), 8 or 16 bits allocated (a 1-bit segmentation or a 32-bit dose map is not a
    mammogram), and the size the header announces: at most
    :data:`~medfl.prep.common.MAX_IMAGE_PIXELS` pixels, in a file not far larger than they
    need (a 2 GiB sparse file named ``.dcm`` is refused having read its first bytes only).

    Raises:
        PrepError: not a DICOM file (a zero-byte file or another format named .dcm), no
            pixel data, a header that says it is not a mammogram or announces too many
            pixels, a file far larger than its pixels need, a compressed transfer syntax
            without an installed decoder (naming what to install), pixel data shorter than the
            header promises (truncated), or another decoding failure (its message).
    """
    with open(check_file(path, "a DICOM image"), "rb") as f:   # the first bytes only: the file may be huge
        head, size = f.read(132), os.fstat(f.fileno()).st_size
    # a DICOM file's 128-byte preamble is free: a legal dual-personality file holds a TIFF
    # header there, so another format is sniffed only where "DICM" is not at offset 128
    for magic, kind in ((b"\x89PNG", "a PNG image"), (b"\xff\xd8\xff", "a JPEG image"), (b"II*\x00", "a TIFF image"),
                        (b"MM\x00*", "a TIFF image")):
        if head.startswith(magic) and head[128:132] != b"DICM":
            raise PrepError(f"{path}: {kind} named .dcm, not a DICOM file; expected the DICOM from the download",
                            path)
    header, header_bytes = _dcmread(path, stop_before_pixels=True)
    _check_header(header, path, size, header_bytes)
    ds, _ = _dcmread(path)
    if "PixelData" not in ds:
        raise PrepError(f"{path}: DICOM without pixel data; expected an MG image", path)
    photometric = str(getattr(ds, "PhotometricInterpretation", "MONOCHROME2") or "MONOCHROME2").upper()
    allocated = int(ds.BitsAllocated)
    ts_elem = getattr(ds.file_meta, "TransferSyntaxUID", None)
    ts = str(ts_elem or "1.2.840.10008.1.2")
    try:
        arr = ds.pixel_array
    except Exception as exc:  # noqa: BLE001 - decoders raise many types
        if ts not in _NATIVE:
            raise _undecodable(path, ts, getattr(ts_elem, "name", ts), exc) from exc
        expected = int(getattr(ds, "Rows", 0)) * int(getattr(ds, "Columns", 0)) * allocated // 8
        got = len(ds.PixelData) if isinstance(ds.PixelData, (bytes, bytearray)) else -1
        if 0 <= got < expected:
            raise PrepError(f"{path}: pixel data unreadable, probably truncated ({got} bytes, the header's "
                            f"{ds.Rows} x {ds.Columns} x {allocated} bits needs {expected})", path) from exc
        if ts_elem is None:
            raise PrepError(f"{path}: pixel data unreadable ({exc}); the file meta has no TransferSyntaxUID, so how "
                            "the pixels are encoded is unknown", path) from exc
        raise PrepError(f"{path}: pixel data unreadable ({type(exc).__name__}: {exc})", path) from exc
    bits = int(getattr(ds, "BitsStored", allocated) or allocated)
    x = arr.astype(np.float32)
    if x.ndim != 2:
        raise PrepError(f"{path}: expected one grayscale frame, got pixel array of shape {arr.shape}", path)
    if int(getattr(ds, "PixelRepresentation", 0) or 0) == 1:
        x = x + float(2 ** (bits - 1))      # signed: [-2^(b-1), 2^(b-1) - 1] -> [0, 2^b - 1]
    top = float(2 ** bits - 1)
    if photometric == "MONOCHROME1":
        x = top - x
    facts = {"bits": bits, "rows": int(arr.shape[0]), "cols": int(arr.shape[1]),
             "photometric": photometric, "transfer_syntax": ts, "part10": not getattr(ds, "headerless", False),
             "signed": int(getattr(ds, "PixelRepresentation", 0) or 0) == 1,
             "laterality": str(getattr(ds, "Laterality", "")), "patient_id": str(getattr(ds, "PatientID", ""))}
    return np.clip(x / top, 0.0, 1.0), facts


def is_mask(path: Path) -> bool:
    """Whether a DICOM of an ROI series is the binary mask (8-bit or only 0/max values)
    rather than the 16-bit crop."""
    x, facts = read_dicom(path)
    return facts["bits"] <= 8 or bool(np.isin(np.unique(x), (0.0, 1.0)).all())
