"""SuperNode authentication, the parts that need no running SuperLink (issue 19): site key
pairs and certificates as Flower reads them, no file of the user's overwritten, and one clear
message for each bad option; the SuperLink, registration and the refusal of an unregistered
site run for real in test_deploy_auth.py."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

pytest.importorskip("flwr", reason="Flower is a test dependency of medfl (pip install -e '.[test]')")

from cryptography import x509  # noqa: E402
from cryptography.hazmat.primitives import serialization  # noqa: E402
from cryptography.hazmat.primitives.asymmetric import ec, rsa  # noqa: E402

from medfl.flower.auth import (AuthError, check_private_key, make_certificates, make_site_key,  # noqa: E402
                               parse_site_nodes, pin_site, read_site_nodes)


def test_site_key_pair_is_what_flower_reads(tmp_path: Path) -> None:
    private, public = make_site_key(tmp_path / "keys", "site0")
    assert stat.S_IMODE(private.stat().st_mode) == 0o600           # the private key: its owner only
    key = serialization.load_ssh_private_key(private.read_bytes(), None)   # as flower-supernode loads it
    assert isinstance(key, ec.EllipticCurvePrivateKey) and key.curve.name == "secp384r1"
    pub = serialization.load_ssh_public_key(public.read_bytes())           # as `flwr supernode register`
    assert pub.public_numbers() == key.public_key().public_numbers()
    assert check_private_key(private) == private
    # a second pair of the same name overwrites nothing
    before = private.read_bytes()
    with pytest.raises(AuthError, match="site0.key: exists"):
        make_site_key(tmp_path / "keys", "site0")
    assert private.read_bytes() == before
    for bad in ("../x", "", "a b", "-x"):
        with pytest.raises(AuthError, match="key name"):
            make_site_key(tmp_path / "keys", bad)


def test_private_keys_flower_cannot_use_are_refused(tmp_path: Path) -> None:
    with pytest.raises(AuthError, match="cannot be read"):
        check_private_key(tmp_path / "missing.key")
    junk = tmp_path / "junk.key"
    junk.write_text("not a key")
    with pytest.raises(AuthError, match="not an OpenSSH private key"):
        check_private_key(junk)
    rsa_key = tmp_path / "rsa.key"
    rsa_key.write_bytes(rsa.generate_private_key(public_exponent=65537, key_size=1024).private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH, serialization.NoEncryption()))
    with pytest.raises(AuthError, match="RSAPrivateKey, expected an elliptic-curve key"):
        check_private_key(rsa_key)
    _, public = make_site_key(tmp_path, "pub")
    with pytest.raises(AuthError, match="not an OpenSSH private key"):
        check_private_key(public)                     # the public half given by mistake


def test_certificates_name_the_hosts_and_chain_to_the_ca(tmp_path: Path) -> None:
    paths = make_certificates(tmp_path / "certs", ["127.0.0.1", "link.example.org"], days=2)
    ca = x509.load_pem_x509_certificate(paths["ca"].read_bytes())
    server = x509.load_pem_x509_certificate(paths["server"].read_bytes())
    server.verify_directly_issued_by(ca)
    names = server.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert [str(ip) for ip in names.get_values_for_type(x509.IPAddress)] == ["127.0.0.1"]
    assert names.get_values_for_type(x509.DNSName) == ["link.example.org"]
    assert stat.S_IMODE(paths["server_key"].stat().st_mode) == 0o600
    with pytest.raises(AuthError, match="exists; remove it or choose another --out"):
        make_certificates(tmp_path / "certs", ["127.0.0.1"])
    (tmp_path / "file").write_text("x")
    with pytest.raises(AuthError, match="is a file, expected a folder"):
        make_certificates(tmp_path / "file", ["127.0.0.1"])
    with pytest.raises(AuthError, match="--host"):
        make_certificates(tmp_path / "none", [])


def _cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int | str, str, str]:
    """``medfl flower ARGS`` in this process: (exit code or SystemExit message, stdout, stderr)."""
    from medfl.cli import main

    try:
        code: int | str = main(["flower", *args])
    except SystemExit as exc:
        code = exc.code if exc.code is not None else 0
    out = capsys.readouterr()
    return code, out.out, out.err + (code if isinstance(code, str) else "")


def test_cli_keys_and_certs_and_their_refusals(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _cli(capsys, "keys", "--out", str(tmp_path / "k"), "site0", "site1")
    assert code == 0 and "site1: private" in out and (tmp_path / "k" / "site1.pub").is_file()
    code, _, err = _cli(capsys, "keys", "--out", str(tmp_path / "k"), "site1")
    assert code != 0 and "site1.key: exists" in err
    code, out, _ = _cli(capsys, "certs", "--out", str(tmp_path / "c"), "--host", "127.0.0.1")
    assert code == 0 and "--ssl-certfile" in out and "--root-certificates" in out
    ca = str(tmp_path / "c" / "ca.pem")
    # authentication without TLS: Flower would refuse it later, medfl says why at once
    code, _, err = _cli(capsys, "superlink", "--insecure", "--enable-supernode-auth")
    assert code != 0 and "--enable-supernode-auth needs TLS" in err
    cfg = tmp_path / "train.json"
    cfg.write_text('{"fl": {}}')
    site = ["site", "--client-id", "0", "--config", str(cfg), "--state-dir", str(tmp_path / "s")]
    code, _, err = _cli(capsys, *site, "--insecure", "--auth-key", str(tmp_path / "k" / "site0.key"))
    assert code != 0 and "--auth-key needs TLS" in err
    code, _, err = _cli(capsys, *site, "--root-certificates", ca, "--auth-key", str(tmp_path / "k" / "site0.pub"))
    assert code != 0 and "not an OpenSSH private key" in err
    code, _, err = _cli(capsys, "register-site", str(tmp_path / "k" / "nope.pub"), "--root-certificates", ca)
    assert code != 0 and "public key file not found" in err
    code, _, err = _cli(capsys, "register-site", str(tmp_path / "k" / "site0.pub"), "--root-certificates", ca,
                        "--client-id", "0")
    assert code != 0 and "--client-id takes one public key and --nodes-file" in err
    (tmp_path / "sites.json").write_text('{"0": "x"}')
    code, _, err = _cli(capsys, "run", str(cfg), "--insecure", "--site-nodes", str(tmp_path / "sites.json"))
    assert code != 0 and "node id 'x' is not a positive integer" in err


def test_site_nodes_file_pins_one_node_per_client(tmp_path: Path) -> None:
    sites = tmp_path / "sites.json"
    assert pin_site(sites, "0", 11) == {"0": 11}
    assert pin_site(sites, "1", 12) == {"0": 11, "1": 12}
    assert pin_site(sites, "1", 12) == {"0": 11, "1": 12}          # registering again is harmless
    before = sites.read_text()
    with pytest.raises(AuthError, match="client '1' is already served by node 12"):
        pin_site(sites, "1", 13)
    with pytest.raises(AuthError, match="node 11 already serves client '0'"):
        pin_site(sites, "2", 11)
    assert sites.read_text() == before and read_site_nodes(sites) == {"0": 11, "1": 12}
    for text, message in [("[1, 2]", "expected a JSON object"), ("{", "not JSON"),
                          ('{"0": "11"}', "node id '11' is not a positive integer"),
                          ('{"0": true}', "is not a positive integer"), ('{"0": 5, "1": 5}', "a node serves one client")]:
        with pytest.raises(AuthError, match=message):
            parse_site_nodes(text, "sites.json")
    with pytest.raises(AuthError, match="cannot be read"):
        read_site_nodes(tmp_path / "absent.json")

