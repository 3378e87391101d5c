"""The fleet's CA and host credentials: files, modes, chains, host ids.

Each test makes real files under pytest's tmp_path.  Chains are checked two
ways: by our own `verify_host_certificate` and by aioquic's OpenSSL-based
`verify_certificate` (what a QUIC client runs), with the host's DNS name.
Host-id validation is a property against a small model of the rule.
"""

from __future__ import annotations

import datetime
import hashlib
import ipaddress
import os
import stat
import string
from pathlib import Path

import pytest
from aioquic.tls import verify_certificate
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec
from hypothesis import given
from hypothesis import strategies as st

from slates.errors import AlreadyExists, InvalidArgument, NotFound, VerificationFailed
from slates.fleet import pki

HOST_ID_ALPHABET = string.ascii_letters + string.digits + "-"


def model_is_host_id(text: str) -> bool:
    return (
        1 <= len(text) <= 63
        and all(ch in HOST_ID_ALPHABET for ch in text)
        and not text.startswith("-")
        and not text.endswith("-")
    )


def mode_of(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def load_cert(path: Path) -> x509.Certificate:
    return x509.load_pem_x509_certificate(path.read_bytes())


@given(st.text(alphabet=HOST_ID_ALPHABET + "_. /é\x00", max_size=70))
def test_host_id_validation_matches_the_rule(text: str) -> None:
    if model_is_host_id(text):
        assert pki.validate_host_id(text) == text
        assert pki.host_dns_name(text) == text.lower() + ".fleet.slates"
    else:
        with pytest.raises(InvalidArgument):
            pki.validate_host_id(text)


def test_init_writes_a_private_key_and_refuses_a_second_time(tmp_path: Path) -> None:
    ca = pki.init_fleet(tmp_path / "ca")
    assert mode_of(ca.key_path) == 0o600
    assert mode_of(ca.cert_path) == 0o644
    before = (ca.key_path.read_bytes(), ca.cert_path.read_bytes())
    with pytest.raises(AlreadyExists):
        pki.init_fleet(tmp_path / "ca")
    assert (ca.key_path.read_bytes(), ca.cert_path.read_bytes()) == before
    # Either file alone is enough to refuse.
    ca.key_path.unlink()
    with pytest.raises(AlreadyExists):
        pki.init_fleet(tmp_path / "ca")
    certificate = load_cert(ca.cert_path)
    constraints = certificate.extensions.get_extension_for_class(x509.BasicConstraints).value
    assert constraints.ca and constraints.path_length == 0
    assert ca.fingerprint == pki.fingerprint(ca.cert_path.read_bytes())


def test_init_ignores_a_permissive_umask(tmp_path: Path) -> None:
    previous = os.umask(0)
    try:
        ca = pki.init_fleet(tmp_path / "ca")
    finally:
        os.umask(previous)
    assert mode_of(ca.key_path) == 0o600


def test_enroll_makes_a_chain_that_verifies(tmp_path: Path) -> None:
    ca = pki.init_fleet(tmp_path / "ca")
    creds = pki.enroll(ca.directory, "Host-7", tmp_path / "h7", ["127.0.0.1", "::1"])
    assert creds.host_id == "Host-7"
    assert mode_of(creds.host_key_path) == 0o600
    assert creds.ca_cert_path.read_bytes() == ca.cert_path.read_bytes()
    certificate = load_cert(creds.host_cert_path)
    ca_certificate = load_cert(ca.cert_path)

    now = datetime.datetime.now(datetime.UTC)
    assert pki.verify_host_certificate(certificate, ca_certificate, now) == "Host-7"
    verify_certificate(
        certificate=certificate,
        cadata=ca.cert_path.read_bytes(),
        server_name=pki.host_dns_name("Host-7"),
    )
    verify_certificate(certificate=certificate, cadata=ca.cert_path.read_bytes(), server_name="::1")

    san = certificate.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.DNSName) == ["host-7.fleet.slates"]
    assert set(san.get_values_for_type(x509.IPAddress)) == {
        ipaddress.ip_address("127.0.0.1"),
        ipaddress.ip_address("::1"),
    }
    lifetime = certificate.not_valid_after_utc - certificate.not_valid_before_utc
    assert lifetime <= datetime.timedelta(days=pki.DEFAULT_VALIDITY_DAYS) + pki.BACKDATE
    der = certificate.public_bytes(serialization.Encoding.DER)
    assert creds.fingerprint == hashlib.sha256(der).hexdigest()
    assert pki.fingerprint(creds.host_cert_path.read_bytes()) == creds.fingerprint

    loaded = pki.load_credentials(creds.directory)
    assert loaded == creds


def test_another_fleets_certificate_does_not_verify(tmp_path: Path) -> None:
    ours = pki.init_fleet(tmp_path / "ours")
    theirs = pki.init_fleet(tmp_path / "theirs")
    assert ours.name != theirs.name
    stranger = pki.enroll(theirs.directory, "h1", tmp_path / "stranger", [])
    now = datetime.datetime.now(datetime.UTC)
    with pytest.raises(VerificationFailed):
        pki.verify_host_certificate(
            load_cert(stranger.host_cert_path), load_cert(ours.cert_path), now
        )
    # A credentials directory whose host.crt another CA signed does not load.
    (tmp_path / "stranger" / "ca.crt").unlink()
    (tmp_path / "stranger" / "ca.crt").write_bytes(ours.cert_path.read_bytes())
    with pytest.raises(VerificationFailed):
        pki.load_credentials(tmp_path / "stranger")


def test_an_expired_certificate_does_not_verify(tmp_path: Path) -> None:
    ca = pki.init_fleet(tmp_path / "ca")
    creds = pki.enroll(ca.directory, "h1", tmp_path / "h1", [], validity_days=1)
    later = datetime.datetime.now(datetime.UTC) + datetime.timedelta(days=2)
    with pytest.raises(VerificationFailed):
        pki.verify_host_certificate(load_cert(creds.host_cert_path), load_cert(ca.cert_path), later)


@pytest.mark.parametrize("host_id", ["", "-h1", "h1-", "h_1", "h.1", "a" * 64, "h 1", "hé"])
def test_enroll_refuses_bad_host_ids_and_writes_nothing(tmp_path: Path, host_id: str) -> None:
    ca = pki.init_fleet(tmp_path / "ca")
    with pytest.raises(InvalidArgument):
        pki.enroll(ca.directory, host_id, tmp_path / "out", [])
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("addresses", [["not-an-ip"], ["127.0.0.1", "999.1.1.1"], ["h1"]])
def test_enroll_refuses_bad_addresses(tmp_path: Path, addresses: list[str]) -> None:
    ca = pki.init_fleet(tmp_path / "ca")
    with pytest.raises(InvalidArgument):
        pki.enroll(ca.directory, "h1", tmp_path / "out", addresses)
    assert not (tmp_path / "out" / "host.key").exists()


@pytest.mark.parametrize("days", [0, -1, pki.MAX_VALIDITY_DAYS + 1])
def test_enroll_refuses_unbounded_validity(tmp_path: Path, days: int) -> None:
    ca = pki.init_fleet(tmp_path / "ca")
    with pytest.raises(InvalidArgument):
        pki.enroll(ca.directory, "h1", tmp_path / "out", [], validity_days=days)


def test_enroll_refuses_to_overwrite_credentials(tmp_path: Path) -> None:
    ca = pki.init_fleet(tmp_path / "ca")
    first = pki.enroll(ca.directory, "h1", tmp_path / "h1", [])
    key_before = first.host_key_path.read_bytes()
    with pytest.raises(AlreadyExists):
        pki.enroll(ca.directory, "h1", tmp_path / "h1", [])
    assert first.host_key_path.read_bytes() == key_before


def test_enroll_needs_the_ca(tmp_path: Path) -> None:
    with pytest.raises(NotFound):
        pki.enroll(tmp_path / "nowhere", "h1", tmp_path / "h1", [])


def test_load_refuses_a_key_others_can_read(tmp_path: Path) -> None:
    ca = pki.init_fleet(tmp_path / "ca")
    creds = pki.enroll(ca.directory, "h1", tmp_path / "h1", [])
    creds.host_key_path.chmod(0o644)
    with pytest.raises(InvalidArgument):
        pki.load_credentials(creds.directory)


def test_load_refuses_a_key_that_is_not_the_certificates(tmp_path: Path) -> None:
    ca = pki.init_fleet(tmp_path / "ca")
    one = pki.enroll(ca.directory, "h1", tmp_path / "h1", [])
    two = pki.enroll(ca.directory, "h2", tmp_path / "h2", [])
    one.host_key_path.unlink()
    one.host_key_path.write_bytes(two.host_key_path.read_bytes())
    one.host_key_path.chmod(0o600)
    with pytest.raises(VerificationFailed):
        pki.load_credentials(one.directory)


def test_load_reports_missing_files(tmp_path: Path) -> None:
    with pytest.raises(NotFound):
        pki.load_credentials(tmp_path)


def test_a_forged_issuer_name_does_not_verify(tmp_path: Path) -> None:
    # Same issuer name as our CA, signed by another key: only the signature tells.
    ca = pki.init_fleet(tmp_path / "ca")
    ca_certificate = load_cert(ca.cert_path)
    rogue_key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    forged = pki.build_host_certificate(
        ca_key=rogue_key,
        ca_certificate=ca_certificate,
        host_public_key=ec.generate_private_key(ec.SECP256R1()).public_key(),
        host_id="h1",
        addresses=[],
        now=now,
        validity_days=1,
    )
    assert forged.issuer == ca_certificate.subject
    with pytest.raises(VerificationFailed):
        pki.verify_host_certificate(forged, ca_certificate, now)
