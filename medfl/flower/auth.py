"""Who may join a Flower federation of medfl: TLS certificates, SuperNode keys and their
registration at the SuperLink.

Flower authenticates a SuperNode by an elliptic-curve key pair: the SuperLink, started with
``--enable-supernode-auth`` (which Flower allows over TLS only), accepts only SuperNodes
whose public key was registered through its Control API, and each request a SuperNode
sends is signed with its private key. A node's id is bound to its key, so a restarted site
keeps its node id and a machine without a registered key cannot pose as a site. The steps
(``docs/flower.md``)::

    medfl flower certs --out certs --host link.example.org     # or the hospital's own PKI
    medfl flower keys --out keys site0 site1                    # at each site: a key pair
    medfl flower superlink --enable-supernode-auth --ssl-certfile certs/server.pem \\
        --ssl-keyfile certs/server.key --ssl-ca-certfile certs/ca.pem
    medfl flower register-site keys/site0.pub --superlink HOST:9092 --root-certificates certs/ca.pem
    medfl flower site --client-id 0 ... --root-certificates certs/ca.pem --auth-key keys/site0.key

:func:`make_certificates` writes a certificate authority and a server certificate for
trying this on one machine or a test network; :func:`make_site_key` a site's key pair
(P-384, OpenSSH encoding, as Flower reads them); :func:`register_site` runs
``flwr supernode register`` against a SuperLink and returns the node id it assigned;
:func:`pin_site` records which client id that node serves (a ``sites.json`` given to
``medfl flower run --site-nodes``), so that a registered site cannot claim another site's
client id either.
"""

from __future__ import annotations

import datetime
import ipaddress
import json
import os
import re
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from medfl.integrity import write_text

__all__ = ["AuthError", "make_certificates", "certificate_paths", "make_site_key", "register_site",
           "check_private_key", "parse_site_nodes", "read_site_nodes", "pin_site"]

#: what a key file name may be: a plain name (it becomes ``<name>.key`` and ``<name>.pub``)
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")


class AuthError(RuntimeError):
    """A key, certificate or registration step failed; the message says which file or
    address and why."""


def _write_new(path: Path, data: bytes, private: bool) -> None:
    """Write ``data`` to ``path``, which must not exist (nothing the user had is overwritten);
    a private file is created readable by its owner only."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL
    try:
        fd = os.open(path, flags, 0o600 if private else 0o644)
    except FileExistsError:
        raise AuthError(f"{path}: exists; remove it or choose another --out (nothing was overwritten)") from None
    with os.fdopen(fd, "wb") as fh:
        fh.write(data)


def _out_files(out: str | Path, names: list[str]) -> list[Path]:
    """The files ``names`` in the folder ``out`` (made), none of which may exist yet."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise AuthError(f"--out {out}: is a file, expected a folder")
    out.mkdir(parents=True, exist_ok=True)
    for path in (out / name for name in names):
        if path.exists():
            raise AuthError(f"{path}: exists; remove it or choose another --out (nothing was overwritten)")
    return [out / name for name in names]


def make_site_key(out: str | Path, name: str) -> tuple[Path, Path]:
    """Write a site's key pair, ``<out>/<name>.key`` (private: keep it at the site, mode
    0600) and ``<out>/<name>.pub`` (public: give it to the SuperLink's operator to
    register); return both paths. Neither file may exist.

    Raises:
        AuthError: a bad name, an existing file, or an ``out`` that is not a folder.
    """
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    if not _NAME.fullmatch(name):
        raise AuthError(f"key name {name!r}: expected letters, digits, '_', '-' or '.' (e.g. site0)")
    private, public = _out_files(out, [f"{name}.key", f"{name}.pub"])
    key = ec.generate_private_key(ec.SECP384R1())
    _write_new(private, key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH,
                                          serialization.NoEncryption()), private=True)
    _write_new(public, key.public_key().public_bytes(serialization.Encoding.OpenSSH,
                                                     serialization.PublicFormat.OpenSSH) + b" medfl-" +
               name.encode() + b"\n", private=False)
    return private, public


def check_private_key(path: str | Path) -> Path:
    """``path`` if it holds a SuperNode private key Flower can use (an OpenSSH-encoded
    elliptic-curve key without a passphrase).

    Raises:
        AuthError: the file is missing, unreadable or not such a key.
    """
    from cryptography.exceptions import UnsupportedAlgorithm
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.hazmat.primitives.serialization import load_ssh_private_key

    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise AuthError(f"--auth-key {path}: cannot be read ({exc.strerror or exc})") from None
    try:
        key = load_ssh_private_key(data, None)
    except (ValueError, TypeError, UnsupportedAlgorithm) as exc:
        raise AuthError(f"--auth-key {path}: not an OpenSSH private key without a passphrase ({exc}); "
                        "make one with `medfl flower keys`") from None
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise AuthError(f"--auth-key {path}: a {type(key).__name__.lstrip('_')}, expected an elliptic-curve "
                        "key (Flower's SuperNode authentication); make one with `medfl flower keys`")
    return path


def certificate_paths(out: str | Path) -> dict[str, Path]:
    """Where :func:`make_certificates` writes in ``out``: ``ca`` (ca.pem), ``ca_key``,
    ``server`` (server.pem) and ``server_key``."""
    out = Path(out)
    return {"ca": out / "ca.pem", "ca_key": out / "ca.key", "server": out / "server.pem",
            "server_key": out / "server.key"}


def make_certificates(out: str | Path, hosts: list[str], days: int = 365) -> dict[str, Path]:
    """Write a certificate authority (``ca.pem``, ``ca.key``) and a server certificate for
    the SuperLink signed by it (``server.pem``, ``server.key``) valid for ``hosts`` (names
    or IP addresses); return the paths. For one machine or a test network: in a hospital,
    use certificates from its own PKI. No file may exist.

    Raises:
        AuthError: no hosts, an existing file, or an ``out`` that is not a folder.
    """
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    if not hosts:
        raise AuthError("--host: give the name or address the sites use to reach the SuperLink")
    paths = certificate_paths(out)
    _out_files(out, [path.name for path in paths.values()])
    names: list[x509.GeneralName] = []
    for h in hosts:
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(h)))
        except ValueError:
            names.append(x509.DNSName(h))
    now = datetime.datetime.now(datetime.timezone.utc)
    ca_key = ec.generate_private_key(ec.SECP384R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "medfl federation CA")])
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name).public_key(ca_key.public_key())
          .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
          .not_valid_after(now + datetime.timedelta(days=days))
          .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
          .add_extension(x509.KeyUsage(digital_signature=True, content_commitment=False, key_encipherment=False,
                                       data_encipherment=False, key_agreement=False, key_cert_sign=True,
                                       crl_sign=True, encipher_only=False, decipher_only=False), critical=True)
          .sign(ca_key, hashes.SHA384()))
    key = ec.generate_private_key(ec.SECP384R1())
    cert = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, hosts[0])]))
            .issuer_name(ca_name).public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=days))
            .add_extension(x509.SubjectAlternativeName(names), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([x509.oid.ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
            .sign(ca_key, hashes.SHA384()))
    pem = serialization.Encoding.PEM
    bare = serialization.NoEncryption()
    _write_new(paths["ca_key"], ca_key.private_bytes(pem, serialization.PrivateFormat.PKCS8, bare), private=True)
    _write_new(paths["ca"], ca.public_bytes(pem), private=False)
    _write_new(paths["server_key"], key.private_bytes(pem, serialization.PrivateFormat.PKCS8, bare), private=True)
    _write_new(paths["server"], cert.public_bytes(pem), private=False)
    return paths


def register_site(public_key: str | Path, superlink: str, *, root_certificates: str | Path | None = None,
                  insecure: bool = False, name: str | None = None, env: dict[str, str] | None = None,
                  timeout: float = 60.0) -> int:
    """Register a site's public key at the SuperLink ``superlink`` (``host:port``, its
    Control API) with ``flwr supernode register``; return the node id the SuperLink bound
    to the key (the site's node id from then on, also after restarts).

    Raises:
        AuthError: the key file is missing or not an EC public key, or the SuperLink refused
            (already registered, unreachable, authentication not enabled...): Flower's
            message is quoted.
    """
    from medfl.flower.deploy import _bin, flower_env, write_connection

    key = Path(public_key)
    if not key.is_file():
        raise AuthError(f"{key}: public key file not found; make one with `medfl flower keys`")
    with tempfile.TemporaryDirectory(prefix="medfl-flwr-home-") as home:
        write_connection(home, superlink, insecure=insecure,
                         root_certificates=None if root_certificates is None else str(root_certificates))
        cmd = [_bin("flwr"), "supernode", "register", str(key.resolve()), "medfl", "--format", "json"]
        if name:
            cmd += ["--name", name]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                                  env={**flower_env(), **(env or {}), "FLWR_HOME": home})
        except subprocess.TimeoutExpired:
            raise AuthError(f"registering {key} at {superlink}: no answer within {timeout:g} s") from None
    answer = _last_json(proc.stdout)
    if proc.returncode == 0 and answer.get("success") and "node-id" in answer:
        return int(answer["node-id"])
    said = [ln for ln in (proc.stderr + "\n" + proc.stdout).splitlines()
            if ln.strip() and not ln.startswith("Using SuperLink")]
    why = answer.get("error-message") or " ".join(said)[-800:] or f"exit code {proc.returncode}"
    raise AuthError(f"registering {key} at {superlink} failed: {why}")


def _last_json(text: str) -> dict:
    """The JSON object Flower's ``--format json`` prints (the last one in ``text``), or ``{}``."""
    start = text.find("{")
    while start != -1:
        try:
            value = json.loads(text[start:])
            return value if isinstance(value, dict) else {}
        except json.JSONDecodeError:
            start = text.find("{", start + 1)
    return {}


def parse_site_nodes(text: str | dict[str, Any], where: str) -> dict[str, int]:
    """``{client id: node id}`` from JSON ``text``, or from a mapping already decoded (a
    run's flower.json): :func:`medfl.engine.remote_sites.parse_pins`.

    Raises:
        AuthError: not a JSON object of client ids to positive integer node ids, or one
            node registered for two clients.
    """
    from medfl.engine.remote_sites import parse_pins
    from medfl.engine.runner import RunError

    try:
        return parse_pins(text, where)
    except RunError as exc:
        raise AuthError(str(exc)) from None


def read_site_nodes(path: str | Path) -> dict[str, int]:
    """Read a ``sites.json`` (:func:`parse_site_nodes`); a missing file is an error."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise AuthError(f"{path}: cannot be read ({exc.strerror or exc})") from None
    return parse_site_nodes(text, str(path))


def pin_site(path: str | Path, client_id: str, node: int) -> dict[str, int]:
    """Record in ``path`` (created if absent, replaced atomically) that client ``client_id``
    is served by ``node``; return the whole mapping.

    Raises:
        AuthError: the file is not a valid mapping, or the client is already pinned to
            another node or the node to another client (nothing is changed then: edit the
            file by hand if a site's key was replaced).
    """
    path = Path(path)
    nodes = read_site_nodes(path) if path.exists() else {}
    cid = str(client_id)
    if nodes.get(cid, node) != node:
        raise AuthError(f"{path}: client {cid!r} is already served by node {nodes[cid]}; remove that entry first "
                        "if the site's key was replaced")
    for other, n in nodes.items():
        if n == node and other != cid:
            raise AuthError(f"{path}: node {node} already serves client {other!r}")
    nodes[cid] = node
    write_text(path, json.dumps(nodes, indent=1, sort_keys=True) + "\n",
               path.with_name(f".{path.name}.{os.getpid()}.tmp"))
    return nodes
