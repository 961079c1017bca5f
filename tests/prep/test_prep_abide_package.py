"""medfl.prep.abide as a package: its modules import each other one way, every public name is
importable from the package, and ``python -m medfl.prep.abide`` is the command line of
``data_prep/abide.py``."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import medfl.prep.abide as abide

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "medfl" / "prep" / "abide"
#: Each module may import only the modules listed for it (``__init__`` and ``__main__`` are above all).
MAY_IMPORT = {
    "volumes": set(),
    "phenotypic": set(),
    "layout": {"phenotypic"},
    "atlas": {"volumes"},
    "cli": {"volumes", "phenotypic", "layout", "atlas"},
}


def _package_imports(path: Path) -> set[str]:
    """The modules of medfl.prep.abide that ``path`` imports."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("medfl.prep.abide"):
            found.add(node.module.removeprefix("medfl.prep.abide").lstrip(".") or "__init__")
        elif isinstance(node, ast.Import):
            found |= {a.name.removeprefix("medfl.prep.abide.") for a in node.names
                      if a.name.startswith("medfl.prep.abide.")}
    return found


def test_modules_import_one_way() -> None:
    modules = {p.stem for p in PACKAGE.glob("*.py")} - {"__init__", "__main__"}
    assert modules == set(MAY_IMPORT)
    for name, allowed in MAY_IMPORT.items():
        imported = _package_imports(PACKAGE / f"{name}.py")
        assert imported <= allowed, f"{name}.py imports {sorted(imported - allowed)}"
        assert len((PACKAGE / f"{name}.py").read_text().splitlines()) <= 500, name


def test_public_names_come_from_the_package() -> None:
    for name in abide.__all__:
        obj = getattr(abide, name)
        module = getattr(obj, "__module__", None)
        if module is not None and callable(obj):
            assert module.startswith("medfl.prep.abide."), (name, module)


def test_python_m_is_the_data_prep_script() -> None:
    def help_text(*cmd: str) -> str:
        proc = subprocess.run([sys.executable, *cmd, "--help"], capture_output=True, text=True,
                              cwd=REPO, timeout=300)
        assert proc.returncode == 0, proc.stderr
        return proc.stdout

    text = help_text("-m", "medfl.prep.abide")
    assert text == help_text(str(REPO / "data_prep" / "abide.py"))
    assert text.startswith("usage: python data_prep/abide.py")
    assert "ABIDE-I Preprocessed (PCP) as downloaded -> a medfl manifest" in text
