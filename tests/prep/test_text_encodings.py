"""Metadata saved as UTF-16 (Excel's "Unicode Text", an editor's "Unicode") or UTF-32: every
data_prep reader names the encoding it found and the command that converts the file, instead
of failing on the first byte (issue 51, item 8)."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import pytest

from medfl.prep import abide, cbis_ddsm, derm7pt, ham10000
from medfl.prep.common import check_text_encoding
from medfl.prep.errors import PrepError
from medfl.prep.mias import info as mias_info


def _cbis(path: Path) -> object:
    return cbis_ddsm.read_case_csvs(path.parent, abnormality="mass")


def _derm7pt_splits(path: Path) -> object:
    return derm7pt.read_splits(path.parent, 10)


#: (file name, first lines as they would read in UTF-8, the reader given the file's path)
READERS: list[tuple[str, str, Callable[[Path], object]]] = [
    ("HAM10000_metadata.csv", "lesion_id,image_id,dx,dx_type,age,sex,localization,dataset\n",
     ham10000.read_metadata),
    ("meta.csv", "case_num,diagnosis,derm,clinic\n", derm7pt.read_meta),
    ("train_indexes.csv", "indexes\n0\n", _derm7pt_splits),
    ("mass_case_description_train_set.csv", "patient_id,pathology\n", _cbis),
    (abide.PHENOTYPIC_FILE, ",Unnamed: 0,SUB_ID,SITE_ID,FILE_ID,DX_GROUP\n", abide.read_phenotypic),
    ("power_2011.csv", "ROI,x,y,z\n1,-25,-98,-12\n", abide.read_coordinates),
    ("Info.txt", "REFNUM BG CLASS SEVERITY X Y RADIUS \nmdb001 G CIRC B 535 425 197\n",
     mias_info.read_info_lines),
]


@pytest.mark.parametrize("name, text, read", READERS, ids=[r[0] for r in READERS])
def test_utf16_metadata_is_named_with_the_command_that_converts_it(tmp_path: Path, name: str, text: str,
                                                                  read: Callable[[Path], object]):
    path = tmp_path / name
    path.write_bytes(text.encode("utf-16"))                       # with its byte-order mark, little-endian
    with pytest.raises(PrepError) as e:
        read(path)
    msg = str(e.value)
    assert msg.startswith(f"{path}: UTF-16 (little-endian) text (byte-order mark FF FE); expected UTF-8"), msg
    assert f"iconv -f UTF-16 -t UTF-8 {name} > utf8.tmp && mv utf8.tmp {name}" in msg


@pytest.mark.parametrize("encoding, named, codec", [
    ("utf-16-be", "UTF-16 (big-endian, no byte-order mark)", "UTF-16BE"),
    ("utf-16-le", "UTF-16 (little-endian, no byte-order mark)", "UTF-16LE"),
    ("utf-32", "UTF-32 (little-endian) text (byte-order mark FF FE 00 00)", "UTF-32"),
])
def test_other_unicode_forms_are_named_too(tmp_path: Path, encoding: str, named: str, codec: str):
    path = tmp_path / "HAM10000_metadata.csv"
    path.write_bytes("lesion_id\timage_id\tdx\n".encode(encoding))
    with pytest.raises(PrepError) as e:
        ham10000.read_metadata(path)
    assert str(e.value).startswith(f"{path}: {named}") and f"iconv -f {codec} -t UTF-8" in str(e.value)


def test_utf8_and_binary_files_pass_the_check(tmp_path: Path):
    """UTF-8 (with or without its BOM) and bytes that merely contain NULs are not called UTF-16."""
    for i, data in enumerate(["a,b\n1,é\n".encode("utf-8-sig"), b"a,b\n1,2\n", bytes(range(256)) * 8]):
        path = tmp_path / f"f{i}.csv"
        path.write_bytes(data)
        check_text_encoding(path, "a table")
