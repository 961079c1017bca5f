"""What identifies the installed code of a plugin a site runs (:func:`code_identity`): its
distribution and version, and the SHA-256 of every source file that runs with it (the
listing :mod:`medfl.approval`'s docstring describes). A site's approvals
(:mod:`medfl.approval`) pin these identities.

Bytecode: Python runs a ``__pycache__/*.pyc`` whose header matches its source's mtime and
size without reading the source. :func:`code_identity` therefore refuses a pinned file
whose bytecode (the ``.pyc`` Python would read, or the one a loaded module came from) does
not hold the code the source compiles to, and a deployed site (``medfl flower site``) reads
and writes bytecode only in its own folder (:func:`private_bytecode`,
``<state-dir>/pycache``), so that a planted ``.pyc`` is never read. A module imported from
bytecode without source, or from a compiled extension, cannot be pinned and is refused.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import importlib.metadata as md
import importlib.util
import inspect
import marshal
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

__all__ = ["ApprovalError", "CodeIdentity", "code_identity", "private_bytecode"]

_HASHES: dict[tuple[str, int, int], str] = {}   # (file, mtime_ns, size) -> sha256 of its bytes
_IMPORTS: dict[tuple[str, int, int], tuple[str, ...]] = {}   # (file, mtime_ns, size) -> what it imports
_BYTECODE: dict[tuple[Any, ...], str] = {}   # (pyc, mtime_ns, size, source mtime_ns, size) -> why it is refused
_STDLIB = frozenset(sys.stdlib_module_names) | frozenset(sys.builtin_module_names)


class ApprovalError(RuntimeError):
    """A plugin is not approved, its code changed, or the approvals file is unusable."""


@dataclass(frozen=True)
class CodeIdentity:
    """What identifies one registered plugin's code.

    Attributes:
        kind: the plugin kind (``method``, ``filter``...).
        name: the registered name.
        distribution: the installed distribution that provides it.
        version: that distribution's version.
        sha256: hash of the listing of its source files and their hashes (see
            :mod:`medfl.approval`).
        files: the SHA-256 of each of those files, by its name relative to the directory
            holding its top-level module (``medfl/hub.py``), so that a refusal names
            the file that changed.
    """

    kind: str
    name: str
    distribution: str
    version: str
    sha256: str
    files: dict[str, str]

    def describe(self) -> str:
        """``method 'fedavg' (medfl 0.1.0, sha256 1a2b3c4d5e6f...)``."""
        return f"{self.kind} {self.name!r} ({self.distribution} {self.version}, sha256 {self.sha256[:12]}...)"


def _norm(dist: str) -> str:
    return re.sub(r"[-_.]+", "-", dist).lower()


@functools.lru_cache(maxsize=1)
def _environment() -> tuple[dict[str, list[str]], dict[str, list[str]], frozenset[str]]:
    """``(top-level name -> distributions, distribution -> its top-level names, the
    distributions medfl requires, transitively)``: the last are the site's environment
    (torch, MONAI, Flower...), pinned by the operator's install, not by an approval.

    medfl's own extras count (``.[tracking]``: MLflow, TensorBoard; ``.[simulation]``: Ray
    through Flower's extra), with the extras each of them requests (``flwr[simulation]``):
    they are environment too, installed by the operator the same way. Otherwise the built-in
    tracker plugin, which imports MLflow, would pin all of MLflow and what it imports (some
    3,000 files) into every built-in method's approval, and an MLflow upgrade would refuse
    FedAvg."""
    by_top = md.packages_distributions()
    tops: dict[str, list[str]] = {}
    for top, dists in by_top.items():
        for d in dists:
            tops.setdefault(_norm(d), []).append(top)
    base: set[str] = set()
    done: set[tuple[str, frozenset[str] | None]] = set()
    todo: list[tuple[str, frozenset[str] | None]] = [("medfl", None)]   # None: every extra
    while todo:
        dist, extras = todo.pop()
        if (dist, extras) in done:
            continue
        done.add((dist, extras))
        try:
            reqs = md.requires(dist) or []
        except md.PackageNotFoundError:
            continue
        for req in reqs:
            extra = re.search(r"""extra\s*==\s*["']([^"']+)["']""", req)
            if extra is not None and extras is not None and _norm(extra.group(1)) not in extras:
                continue
            name = _norm(re.split(r"[ ;<>=!~\[(]", req.strip(), maxsplit=1)[0])
            wanted = re.match(r"\s*[\w.-]+\s*\[([^\]]*)\]", req)
            asked = frozenset(_norm(e) for e in wanted.group(1).split(",") if e.strip()) if wanted else frozenset()
            if name and name != "medfl":
                base.add(name)
                todo.append((name, asked))
    return by_top, tops, frozenset(base)


def _stat_key(path: Path) -> tuple[str, int, int]:
    st = path.stat()
    return str(path), st.st_mtime_ns, st.st_size


def _imports(path: Path) -> tuple[str, ...]:
    """The top-level module names ``path`` imports: ``import x.y``, ``from x import y`` and
    ``importlib.import_module("x")`` / ``__import__("x")`` with a literal name (relative
    imports stay in the file's own package)."""
    key = _stat_key(path)
    names = _IMPORTS.get(key)
    if names is None:
        found: set[str] = set()
        for node in ast.walk(ast.parse(path.read_bytes(), str(path))):
            if isinstance(node, ast.Import):
                found |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                found.add(node.module.split(".")[0])
            elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant) \
                    and isinstance(node.args[0].value, str) and (
                    getattr(node.func, "attr", None) == "import_module" or getattr(node.func, "id", None) in (
                        "__import__", "import_module")):
                found.add(node.args[0].value.split(".")[0])
        names = _IMPORTS[key] = tuple(sorted(n for n in found if n))
    return names


def _top_files(top: str) -> tuple[Path, list[Path]] | None:
    """The directory holding top-level module ``top`` and its source files (every ``.py``
    file of a package); ``None`` when it is not installed here.

    Raises:
        ApprovalError: ``top`` is loaded from something other than Python source (bytecode
            without source, a compiled extension), which cannot be reviewed or pinned.
    """
    loaded = sys.modules.get(top)
    try:
        spec = loaded.__spec__ if loaded is not None and loaded.__spec__ is not None else importlib.util.find_spec(top)
    except (ImportError, ValueError):
        return None
    if spec is None:
        return None
    locations = list(spec.submodule_search_locations or [])
    if locations:
        files: set[Path] = set()
        for loc in locations:
            for folder, dirs, names in os.walk(os.path.realpath(loc)):
                dirs[:] = [d for d in dirs if d != "__pycache__"]
                # every file of the package: its source and the data files its code may read
                # (a settings file changed after approval must not steer approved code)
                files |= {Path(folder, n) for n in names if not n.endswith((".pyc", ".pyo"))
                          and os.path.isfile(os.path.join(folder, n))}
        return Path(os.path.realpath(locations[0])).parent, sorted(files)
    origin = spec.origin or ""
    if not origin.endswith(".py"):
        raise ApprovalError(f"module {top!r} is loaded from {origin or 'no file'}, not from Python source: its code "
                            "cannot be reviewed or pinned")
    file = Path(origin).resolve()
    return file.parent, [file]


def _pinned_files(tops: Iterable[str]) -> tuple[dict[str, Path], set[str]]:
    """Every source file that runs with the top-level modules ``tops``, by its name relative
    to the directory holding its top-level module: all the files of their distributions
    (every top-level package of each), and of every module they import that is neither in
    the standard library nor in the environment medfl requires (:func:`_environment`),
    followed transitively. Also returns the top-level names they are under."""
    by_top, dist_tops, base = _environment()
    out: dict[str, Path] = {}
    seen: set[str] = set()
    todo = list(tops)
    while todo:
        top = todo.pop()
        if top in seen or top in _STDLIB or top == "__future__":
            continue
        dists = [_norm(d) for d in by_top.get(top, [])]
        if dists and all(d in base for d in dists):
            continue
        group = {top, *(t for d in dists for t in dist_tops.get(d, []))}
        seen |= group
        for name in sorted(group):
            found = _top_files(name)
            if found is None:
                continue
            root, files = found
            for f in files:
                out.setdefault(f.relative_to(root).as_posix(), f)
                if f.suffix == ".py":
                    todo.extend(_imports(f))
    return out, seen


def _stale_bytecode(rel: str, source: Path, loaded: dict[Path, list[Any]]) -> str | None:
    """Why the bytecode Python would run for ``source`` (or ran, for a module already
    loaded from it) is not the source's own code, or ``None``. A ``.pyc`` that Python would
    not use (another magic number; a timestamp or checked hash that does not match) is no
    threat and is ignored; one it would use must hold exactly the code the source compiles to."""
    caches = {Path(importlib.util.cache_from_source(str(source)))}
    caches |= {Path(m.__cached__) for m in loaded.get(source, []) if getattr(m, "__cached__", None)}
    for pyc in sorted(caches):
        if not pyc.is_file():
            continue
        key = (*_stat_key(pyc), *_stat_key(source)[1:])
        verdict = _BYTECODE.get(key)
        if verdict is None:
            verdict = _BYTECODE[key] = _check_pyc(pyc, source)
        if verdict:
            return f"{rel}: {verdict}"
    return None


def _check_pyc(pyc: Path, source: Path) -> str:
    data = pyc.read_bytes()
    if len(data) < 16 or data[:4] != importlib.util.MAGIC_NUMBER:
        return ""
    src = source.read_bytes()
    flags = int.from_bytes(data[4:8], "little")
    if flags == 0:   # timestamp-based: used when the source's mtime and size match
        st = source.stat()
        if int.from_bytes(data[8:12], "little") != int(st.st_mtime) & 0xFFFFFFFF or \
                int.from_bytes(data[12:16], "little") != st.st_size & 0xFFFFFFFF:
            return ""
    elif flags & 0b10 and data[8:16] != importlib.util.source_hash(src):   # checked hash: must match
        return ""
    try:
        same = marshal.loads(data[16:]) == compile(src, str(source), "exec", dont_inherit=True)
    except (ValueError, EOFError, TypeError, SyntaxError):
        same = False
    return "" if same else f"its bytecode {pyc} is not compiled from its source (stale or planted bytecode)"


def _file_hash(path: Path) -> str:
    key = _stat_key(path)
    digest = _HASHES.get(key)
    if digest is None:
        digest = _HASHES[key] = hashlib.sha256(path.read_bytes()).hexdigest()
    return digest


def _distribution(obj: Any, registered_dist: str, registered_version: str) -> tuple[str, str]:
    if registered_dist and not registered_dist.startswith("("):
        return registered_dist, registered_version
    top = (getattr(obj, "__module__", "") or "").split(".")[0]
    dists = md.packages_distributions().get(top, [])
    if dists:
        try:
            return dists[0], md.version(dists[0])
        except md.PackageNotFoundError:
            pass
    return "(none: registered at runtime)", ""


def code_identity(kind: str, name: str, cache: dict[frozenset[str], Any] | None = None) -> CodeIdentity:
    """The identity of the installed plugin registered as ``name`` of ``kind``: its
    distribution and version, and the hash of every source file that runs with it
    (:func:`_pinned_files`: its own distribution, the helpers it imports, medfl itself).
    ``cache`` (a dict, empty at first) shares the files' hashes between the plugins one
    check looks at.

    Raises:
        ApprovalError: no such plugin is installed here, it has no source file, it imports
            a module that is not Python source, or the bytecode of one of its files is not
            compiled from that file (stale or planted ``.pyc``).
    """
    from medfl.plugins import PluginError, registry

    table = registry().get(kind)
    if table is None:
        raise ApprovalError(f"unknown plugin kind {kind!r}; kinds: {', '.join(sorted(registry()))}")
    try:
        reg = registry().resolve(kind, name)   # bare or qualified (dist:name); an ambiguous bare name is refused
    except PluginError as exc:
        raise ApprovalError(f"no {kind} {name!r} is installed here ({exc})" if str(exc).startswith("unknown")
                            else str(exc)) from exc
    module = inspect.getmodule(reg.obj)
    try:
        source = inspect.getsourcefile(reg.obj)
    except (TypeError, OSError):   # OSError: __main__ without a file (an interpreter, a test worker)
        source = None
    if module is not None and module.__name__.split(".")[0] == "__main__":
        raise ApprovalError(f"{kind} {name!r} is defined in {source or 'a script without a file'}, which is not a "
                            f"module importable by its name ({module.__name__}): it cannot be pinned; install it as "
                            "a module or package")
    if module is None or source is None:
        raise ApprovalError(f"{kind} {name!r} has no source file (defined interactively or in compiled code); "
                            "only plugins installed from source files can be approved")
    by_top, dist_tops, _ = _environment()
    top = module.__name__.split(".")[0]
    spec = getattr(sys.modules.get(top), "__spec__", None)
    src = os.path.realpath(source)
    if top == "__main__" or spec is None or not (
            any(src.startswith(os.path.realpath(r) + os.sep) for r in spec.submodule_search_locations or [])
            or (spec.origin and os.path.realpath(spec.origin) == src)):
        raise ApprovalError(f"{kind} {name!r} is defined in {source}, which is not a module importable by its name "
                            f"({module.__name__}): it cannot be pinned; install it as a module or package")
    key = frozenset(t for name in (top, "medfl") for t in
                    [name, *(t for d in by_top.get(name, []) for t in dist_tops.get(_norm(d), []))])
    cache = {} if cache is None else cache
    if key not in cache:
        cache[key] = _code_digest(key, f"{kind} {name!r}")
    hashes, sha = cache[key]
    dist, version = _distribution(reg.obj, reg.distribution, reg.version)
    return CodeIdentity(kind=kind, name=name, distribution=dist, version=version, sha256=sha, files=dict(hashes))


def _code_digest(tops: Iterable[str], who: str) -> tuple[dict[str, str], str]:
    """``({file: sha256}, digest of that listing)`` of :func:`_pinned_files` of ``tops``,
    after checking each file's bytecode (:func:`_stale_bytecode`)."""
    files, under = _pinned_files(sorted(tops))
    paths = {str(f): f for f in files.values()}
    loaded: dict[Path, list[Any]] = {}
    for modname, mod in list(sys.modules.items()):
        if modname.split(".")[0] not in under:
            continue
        f = getattr(mod, "__file__", None)
        if isinstance(f, str) and f in paths:
            loaded.setdefault(paths[f], []).append(mod)
    for rel in sorted(r for r in files if r.endswith(".py")):
        stale = _stale_bytecode(rel, files[rel], loaded)
        if stale:
            raise ApprovalError(f"{who}: {stale}; delete it (Python recompiles from the source)")
    hashes = {rel: _file_hash(files[rel]) for rel in sorted(files)}
    h = hashlib.sha256()
    for rel, digest in hashes.items():
        h.update(rel.encode() + b"\0" + digest.encode() + b"\n")
    return hashes, h.hexdigest()


def private_bytecode(directory: str | Path) -> Path:
    """Make this process read and write bytecode only under ``directory`` (the site's own,
    ``<state-dir>/pycache``): :data:`sys.pycache_prefix`, so a ``__pycache__/*.pyc``
    planted beside a plugin's source is never read by a later import. Modules imported
    before are checked against their source by :func:`code_identity`. Returns the directory."""
    path = Path(directory).resolve()
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    sys.pycache_prefix = str(path)
    return path
