"""Write (or check) the files every medfl bundle shares with the MONAI model zoo's layout.

Each bundle under ``bundles/`` gets, from the one template kept here:

- ``configs/logging.conf``: the logging setup MONAI's ``ConfigWorkflow`` applies (with
  ``logging.config.fileConfig(..., disable_existing_loggers=False)``) before it reads the
  bundle's configs; without one MONAI warns ``Default logging file ... does not exist`` on
  every run. Identical in every bundle.
- ``LICENSE``: the code's licence, a copy of the repository's ``LICENSE`` (Apache-2.0).
- ``docs/data_license.txt``: the licence and terms of the data the bundle trains on (see
  :data:`DATASETS`, :data:`BUNDLE_DATA`), with where it comes from and what could not be
  verified from this repository.
- ``models/README.md``: where ``models/model.pt`` comes from (``medfl export``); the folder
  is kept in git by this file.
- ``configs/evaluate.json``: the evaluation workflow MONAI FL's ``MonaiAlgo`` reads by default
  (``configs/train.json`` and ``configs/evaluate.json``): ``train.json``'s
  ``validate#evaluator`` (one site's validation split, ``medfl.monai_fl``) run on
  ``models/model.pt`` (``MonaiAlgo`` disables that checkpoint loader and sends its own
  weights). Identical in every bundle (docs/bundles.md, "Run with MONAI FL").

Usage::

    python bundles/bundle_files.py           # write every bundle's files
    python bundles/bundle_files.py --check   # exit 1, naming each file, if any differs

``tests/test_bundle_files.py`` runs the check, so a hand edit of one bundle's copy fails the
tests instead of drifting.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

__all__ = ["BUNDLES_DIR", "LOGGING_CONF", "MODELS_README", "EVALUATE_JSON", "DATASETS", "BUNDLE_DATA", "bundle_dirs",
           "expected_files", "check", "write", "main"]

#: The folder holding every bundle (this script's folder).
BUNDLES_DIR = Path(__file__).resolve().parent
_REPO = BUNDLES_DIR.parent

#: ``configs/logging.conf`` of every bundle (``logging.config.fileConfig`` format). MONAI
#: refuses a handler ``args`` other than literals and ``sys.stdout``/``sys.stderr``.
LOGGING_CONF = """\
# Logging for this bundle. MONAI's bundle runner (python -m monai.bundle run ...) applies this
# file with logging.config.fileConfig(..., disable_existing_loggers=False) before it reads the
# configs; medfl's own messages come from loggers named after its modules ("medfl.engine...",
# "medfl.plugins..."), all under the "medfl" logger configured below. They are printed as they
# are ("medfl [fedavg]: ...", "medfl: error: ..."), as the medfl command prints them; each run
# directory's log.txt has them with their times.
#
# Make medfl verbose:   in [logger_medfl] set  level=DEBUG
# Make medfl quiet:     in [logger_medfl] set  level=WARNING  (errors and warnings only)
# Quiet other libraries (MONAI, Ray, Flower...): in [logger_root] set  level=WARNING
# Also log to a file:   add "file" to [handlers] keys and to the logger's handlers, and add
#   [handler_file]
#   class=FileHandler
#   level=NOTSET
#   formatter=readable
#   args=('medfl.log', 'a')
#
# This file is written by bundles/bundle_files.py from one template for every bundle; edit the
# template there, not one bundle's copy (tests/test_bundle_files.py checks they match).

[loggers]
keys=root,medfl

[handlers]
keys=console,medfl_console

[formatters]
keys=readable,plain

[logger_root]
level=INFO
handlers=console

[logger_medfl]
level=INFO
handlers=medfl_console
qualname=medfl
# medfl's records are printed by the handler above, not again by the root logger's
propagate=0

[handler_console]
class=StreamHandler
level=NOTSET
formatter=readable
args=(sys.stderr,)

[handler_medfl_console]
class=StreamHandler
level=NOTSET
formatter=plain
args=(sys.stderr,)

[formatter_plain]
format=%(message)s

[formatter_readable]
format=%(asctime)s %(levelname)s %(name)s: %(message)s
datefmt=%Y-%m-%d %H:%M:%S
"""

#: ``models/README.md`` of every bundle.
MODELS_README = """\
# models/

MONAI bundles keep their trained weights here, as `models/model.pt` (and TorchScript as
`models/model.ts`). A medfl bundle ships no weights: its model is trained by federated
training, and training never writes into this folder (runs go to `runs/` under the bundle
root, see `configs/train.json`'s `output_dir`).

To get a `models/model.pt` that MONAI's tools load, train, then export the run:

```bash
python -m monai.bundle run --config_file configs/train.json      # writes runs/<name>/...
medfl export runs/<name>/<method> --out exported/<name>           # a complete MONAI bundle
```

`medfl export RUN_DIR --out DIR` writes a bundle that runs with MONAI alone, without medfl:
`models/model.pt` and `models/model.ts`, `configs/inference.json` (MONAI transforms, a MONAI or
TorchScript network), `configs/metadata.json`, `LICENSE` and `docs/README.md` (see the
repository's README, "Exported models", and `docs/bundles.md`). Copy its `models/model.pt`
here if you want this bundle folder to carry the weights; the model was trained on the data
described in `docs/data_license.txt`, whose terms apply to the weights as well.

This file is written by `bundles/bundle_files.py` for every bundle.
"""

_VERIFY_NOTE = ("Checked against: {checked}.\n"
                "Not checked: the data provider's current page could not be read from this repository (no\n"
                "network); read the terms at the source above before you download or share the data or\n"
                "models trained on it.\n")

#: ``configs/evaluate.json`` of every bundle: laid over ``configs/train.json`` (whose
#: ``validate`` section it completes), it evaluates ``models/model.pt`` on the validation split
#: of the site ``client_id`` (``python -m monai.bundle run --config_file
#: "['configs/train.json','configs/evaluate.json']" --client_id 1``); MONAI FL's ``MonaiAlgo``
#: reads the same pair as its evaluation workflow, with the checkpoint loader disabled.
EVALUATE_JSON = """\
{
    "validate#handlers": [
        {"_target_": "CheckpointLoader", "load_path": "$@bundle_root + '/models/model.pt'",
         "load_dict": {"model": "@network"}, "map_location": "@device"},
        {"_target_": "StatsHandler", "iteration_log": false}
    ],
    "run": "$@validate#evaluator.run()"
}
"""

#: The data sets, by key: the licence text each ``docs/data_license.txt`` states, and what it
#: was checked against here (``reference_data/PROVENANCE.txt``, kept beside the repository in
#: ``../shared``, lists the sources and licences of the copies of the data sets' metadata the
#: tests read).
DATASETS: dict[str, dict[str, str]] = {
    "synthetic": {
        "title": "Generated data (medfl's synthetic2d data set)",
        "body": (
            "Licence: none needed. The images are generated by medfl itself on first use\n"
            "(medfl.data.synthetic: oriented bars and blobs under Gaussian noise) into data/ under the\n"
            "bundle root; no patient, image or person is involved and nothing is downloaded.\n"
            "They are covered, like the code that makes them, by the bundle's LICENSE (Apache-2.0).\n"
        ),
        "checked": None,
    },
    "ham10000": {
        "title": "HAM10000 (Human Against Machine with 10000 training images)",
        "body": (
            "Licence: Creative Commons Attribution-NonCommercial 4.0 International (CC BY-NC 4.0),\n"
            "https://creativecommons.org/licenses/by-nc/4.0/ . Non-commercial use only; credit the\n"
            "authors.\n"
            "Source: Harvard Dataverse, https://doi.org/10.7910/DVN/DBW86T (also the ISIC archive).\n"
            "Cite: Tschandl P, Rosendahl C, Kittler H. The HAM10000 dataset, a large collection of\n"
            "multi-source dermatoscopic images of common pigmented skin lesions. Sci Data 5, 180161\n"
            "(2018).\n"
        ),
        "checked": ("the licence named in issue 41 and in the project's reference-data notes; the\n"
                    "Dataverse record itself was not reachable"),
    },
    "cbis_ddsm": {
        "title": "CBIS-DDSM (Curated Breast Imaging Subset of DDSM), The Cancer Imaging Archive",
        "body": (
            "Licence: Creative Commons Attribution 3.0 Unported (CC BY 3.0),\n"
            "https://creativecommons.org/licenses/by/3.0/ , as stated by TCIA for this collection,\n"
            "together with TCIA's data usage policy.\n"
            "Source: TCIA, https://doi.org/10.7937/K9/TCIA.2016.7O02S9CY\n"
            "Cite: Lee RS, Gimenez F, Hoogi A, Rubin D. Curated Breast Imaging Subset of DDSM\n"
            "[Data set]. The Cancer Imaging Archive (2016); and Clark K et al., The Cancer Imaging\n"
            "Archive (TCIA), J Digit Imaging 26(6), 1045-1057 (2013).\n"
        ),
        "checked": ("reference_data/PROVENANCE.txt (\"TCIA CBIS-DDSM, CC BY 3.0 per\n"
                    "TCIA\")"),
    },
    "mias": {
        "title": "mini-MIAS (Mammographic Image Analysis Society digital mammogram database)",
        "body": (
            "Licence: the mini-MIAS licence, for research use, as stated by the Mammographic Image\n"
            "Analysis Society / PEIPA with the download at http://peipa.essex.ac.uk/info/mias.html .\n"
            "Its wording is not reproduced here because no copy of it is kept in this repository:\n"
            "read it at the source.\n"
            "Cite: Suckling J et al. The Mammographic Image Analysis Society digital mammogram\n"
            "database. Exerpta Medica, International Congress Series 1069, 375-378 (1994).\n"
        ),
        "checked": ("reference_data/PROVENANCE.txt (\"MIAS research-only licence\"); the\n"
                    "licence's own wording was not available"),
    },
    "abide": {
        "title": "ABIDE I, Preprocessed Connectomes Project (PCP) derivatives",
        "body": (
            "Licence: Creative Commons Attribution-NonCommercial-ShareAlike 3.0 Unported\n"
            "(CC BY-NC-SA 3.0), https://creativecommons.org/licenses/by-nc-sa/3.0/ , as stated by the\n"
            "ABIDE data usage agreement (http://fcon_1000.projects.nitrc.org/indi/abide/). Non-commercial\n"
            "use; credit ABIDE and PCP; share derivatives under the same terms.\n"
            "Source: the PCP's ABIDE derivatives (https://github.com/preprocessed-connectomes-project/abide,\n"
            "http://preprocessed-connectomes-project.org/abide/), including the CC200 atlas.\n"
            "Cite: Di Martino A et al. The autism brain imaging data exchange. Mol Psychiatry 19,\n"
            "659-667 (2014); Craddock C et al. The Neuro Bureau Preprocessing Initiative. Front\n"
            "Neuroinform (2013).\n"
        ),
        "checked": ("reference_data/PROVENANCE.txt (\"ABIDE, CC BY-NC-SA 3.0 per the ABIDE\n"
                    "usage agreement\"; the PCP repository's atlas files come with no LICENSE file of their own)"),
    },
    "derm7pt": {
        "title": "Derm7pt (seven-point checklist dermoscopy data set, release_v0)",
        "body": (
            "Licence: the data set's own terms, accepted when registering for the download at\n"
            "http://derm.cs.sfu.ca (research use). Their wording is not reproduced here because no copy\n"
            "of it is kept in this repository and the page needs registration: read it there.\n"
            "Cite: Kawahara J, Daneshvar S, Argenziano G, Hamarneh G. Seven-Point Checklist and Skin\n"
            "Lesion Classification using Multi-Task Multi-Modal Neural Nets. IEEE J Biomed Health\n"
            "Inform 23(2), 538-546 (2019).\n"
        ),
        "checked": ("nothing: no licence text of Derm7pt is available here (the metadata copy in\n"
                    "reference_data comes from an MIT-licensed repository of derived tables,\n"
                    "which says nothing of the images' terms)"),
    },
    "pathmnist": {
        "title": "PathMNIST (MedMNIST v2), derived from NCT-CRC-HE-100K",
        "body": (
            "Licence: Creative Commons Attribution 4.0 International (CC BY 4.0),\n"
            "https://creativecommons.org/licenses/by/4.0/ , for MedMNIST v2's PathMNIST; its source,\n"
            "NCT-CRC-HE-100K (Kather et al., Zenodo https://doi.org/10.5281/zenodo.1214456), is CC BY 4.0\n"
            "as well.\n"
            "Source: https://medmnist.com (Zenodo https://doi.org/10.5281/zenodo.10519652).\n"
            "Cite: Yang J et al. MedMNIST v2 - A large-scale lightweight benchmark for 2D and 3D\n"
            "biomedical image classification. Sci Data 10, 41 (2023); Kather JN et al. Predicting\n"
            "survival from colorectal cancer histology slides using deep learning. PLOS Med 16(1),\n"
            "e1002730 (2019).\n"
        ),
        "checked": "the licences named in issue 41; the MedMNIST and Zenodo pages were not reachable",
    },
}

#: The data sets each bundle trains on (keys of :data:`DATASETS`).
BUNDLE_DATA: dict[str, tuple[str, ...]] = {
    "demo": ("synthetic",),
    "ham10000": ("ham10000",),
    "ham10000_fedsdc": ("ham10000",),
    "cbis_ddsm": ("cbis_ddsm",),
    "cbis_ddsm_pfedcdp": ("cbis_ddsm", "mias"),
    "mias": ("mias",),
    "abide": ("abide",),
    "abide_fedskd": ("abide",),
    "derm7pt": ("derm7pt",),
    "derm7pt_fedkper": ("derm7pt",),
    "derm7pt_fedskd": ("derm7pt",),
    "pathmnist_fedtpf": ("pathmnist",),
}


def bundle_dirs() -> list[Path]:
    """Every bundle folder under :data:`BUNDLES_DIR` (a folder with ``configs/train.json``), sorted."""
    return sorted(p.parent.parent for p in BUNDLES_DIR.glob("*/configs/train.json"))


def _data_license(bundle: str) -> str:
    """The text of ``docs/data_license.txt`` for the bundle named ``bundle``."""
    if bundle not in BUNDLE_DATA:
        raise KeyError(f"bundles/bundle_files.py: bundle {bundle!r} has no entry in BUNDLE_DATA; "
                       f"add the data sets it trains on (one of {sorted(DATASETS)})")
    parts = [f"Data licence of the bundle '{bundle}'\n",
             "The bundle's code and configs are under Apache-2.0 (LICENSE). The data it trains on are\n"
             "not part of the bundle: you download them yourself, under their own terms, which also\n"
             "bind models trained on them.\n"]
    for key in BUNDLE_DATA[bundle]:
        info = DATASETS[key]
        section = f"\n== {info['title']} ==\n{info['body']}"
        if info["checked"] is not None:
            section += _VERIFY_NOTE.format(checked=info["checked"])
        parts.append(section)
    parts.append("\nWritten by bundles/bundle_files.py.\n")
    return "".join(parts)


def expected_files(bundle_dir: Path) -> dict[Path, str]:
    """The shared files of one bundle folder and the text each must hold."""
    return {
        bundle_dir / "configs" / "logging.conf": LOGGING_CONF,
        bundle_dir / "LICENSE": (_REPO / "LICENSE").read_text(encoding="utf-8"),
        bundle_dir / "docs" / "data_license.txt": _data_license(bundle_dir.name),
        bundle_dir / "models" / "README.md": MODELS_README,
        bundle_dir / "configs" / "evaluate.json": EVALUATE_JSON,
    }


def check() -> list[str]:
    """The problems found: one line per missing or differing file (empty when all match)."""
    problems = []
    for bundle_dir in bundle_dirs():
        for path, text in expected_files(bundle_dir).items():
            rel = path.relative_to(_REPO)
            if not path.is_file():
                problems.append(f"{rel}: missing")
            elif path.read_text(encoding="utf-8") != text:
                problems.append(f"{rel}: differs from the template in bundles/bundle_files.py")
    return problems


def write() -> list[Path]:
    """Write every bundle's shared files; return those that changed."""
    changed = []
    for bundle_dir in bundle_dirs():
        for path, text in expected_files(bundle_dir).items():
            if path.is_file() and path.read_text(encoding="utf-8") == text:
                continue
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text, encoding="utf-8")
            changed.append(path)
    return changed


def main(argv: list[str] | None = None) -> int:
    """Command line: write the files, or with ``--check`` report the ones that differ."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 if any file is missing or differs")
    args = parser.parse_args(argv)
    if args.check:
        problems = check()
        for line in problems:
            print(line, file=sys.stderr)
        return 1 if problems else 0
    for path in write():
        print(f"wrote {path.relative_to(_REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
