"""The fleet's certificate authority and host credentials (DESIGN.md section 7, Transport).

Theory of operation.  A fleet has one CA, made once by `init_fleet` in a
directory of its own (`ca.key`, mode 0600, and `ca.crt`); it is never
overwritten (AlreadyExists).  `enroll` signs a host certificate for one
host id and writes the host's credentials directory: `host.key` (0600),
`host.crt` and a copy of `ca.crt`, which is everything `load_credentials`
and the QUIC transport (`slates.fleet.quic`) need.  Re-enrolling into a
directory that already holds credentials is refused too: renewal removes
the old files first, on purpose.

Keys are ECDSA P-256.  aioquic's TLS 1.3 (tls.py) signs and verifies with
ECDSA_SECP256R1_SHA256 as both server and client (Ed25519 works too); P-256
is also what every other TLS stack speaks, should a non-aioquic peer appear.

A host certificate carries the host id twice: exactly, as the subject CN
(the transport compares it byte for byte), and as the DNS name
`<host id, lowercased>.fleet.slates` in the SAN, which aioquic's client
checks as the server name.  Its SAN also lists the host's IP addresses.
It is an end entity (BasicConstraints ca=false) for both serverAuth and
clientAuth, valid for a bounded time (1..MAX_VALIDITY_DAYS days).

Host ids are 1..63 letters, digits and '-', not starting or ending with
'-' (a DNS label, since the id becomes one).

The certificate builders (`build_ca_certificate`, `build_host_certificate`)
take keys and the time as inputs; only the functions that read and write
files, make keys and read the clock are I/O.  Callers: the `slates fleet
init|enroll` CLI and `slates.fleet.quic`.
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import ipaddress
import os
import re
import secrets
from pathlib import Path

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from slates.errors import AlreadyExists, InvalidArgument, NotFound, VerificationFailed

__all__ = [
    "CA_CERT_NAME",
    "CA_KEY_NAME",
    "DEFAULT_VALIDITY_DAYS",
    "FleetCA",
    "HOST_CERT_NAME",
    "HOST_KEY_NAME",
    "HostCredentials",
    "MAX_VALIDITY_DAYS",
    "build_ca_certificate",
    "build_host_certificate",
    "enroll",
    "fingerprint",
    "host_dns_name",
    "host_id_of",
    "init_fleet",
    "load_credentials",
    "validate_host_id",
]

CA_KEY_NAME = "ca.key"
CA_CERT_NAME = "ca.crt"
HOST_KEY_NAME = "host.key"
HOST_CERT_NAME = "host.crt"

CA_VALIDITY_DAYS = 3650
DEFAULT_VALIDITY_DAYS = 90
MAX_VALIDITY_DAYS = 397  # the CA/Browser ceiling: long enough to run, short enough to rotate
MAX_ADDRESSES = 32
# Clocks of enrolled hosts differ a little: a certificate is valid from slightly before issue.
BACKDATE = datetime.timedelta(minutes=5)
DNS_SUFFIX = "fleet.slates"

_HOST_ID = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?")


@dataclasses.dataclass(frozen=True, slots=True)
class FleetCA:
    """A fleet's CA as written on disk."""

    directory: Path
    key_path: Path
    cert_path: Path
    name: str
    fingerprint: str


@dataclasses.dataclass(frozen=True, slots=True)
class HostCredentials:
    """One host's credentials directory: what the transport loads."""

    directory: Path
    host_id: str
    ca_cert_path: Path
    host_cert_path: Path
    host_key_path: Path
    fingerprint: str


def validate_host_id(host_id: str) -> str:
    """Return `host_id` if it is a valid host id, else raise InvalidArgument."""
    if not isinstance(host_id, str) or _HOST_ID.fullmatch(host_id) is None:
        raise InvalidArgument(
            "a host id is 1..63 letters, digits and '-', not starting or ending with '-'",
            host_id=repr(host_id),
        )
    return host_id


def host_dns_name(host_id: str) -> str:
    """The DNS name a host's certificate carries in its SAN (the TLS server name)."""
    return f"{validate_host_id(host_id).lower()}.{DNS_SUFFIX}"


def fingerprint(cert_pem: bytes) -> str:
    """SHA-256 of the certificate's DER encoding, lowercase hex."""
    try:
        certificate = x509.load_pem_x509_certificate(cert_pem)
    except ValueError as exc:
        raise InvalidArgument("not a PEM certificate") from exc
    return hashlib.sha256(certificate.public_bytes(serialization.Encoding.DER)).hexdigest()


def host_id_of(certificate: x509.Certificate) -> str:
    """The host id a host certificate names (its single subject CN), validated."""
    names = certificate.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    if len(names) != 1 or not isinstance(names[0].value, str):
        raise VerificationFailed("a host certificate names exactly one host id (subject CN)")
    try:
        return validate_host_id(names[0].value)
    except InvalidArgument as exc:
        raise VerificationFailed("the certificate's CN is not a host id") from exc


def build_ca_certificate(
    key: ec.EllipticCurvePrivateKey, name: str, now: datetime.datetime
) -> x509.Certificate:
    """A self-signed CA certificate that may sign host certificates only (path length 0)."""
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    public_key = key.public_key()
    return (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - BACKDATE)
        .not_valid_after(now + datetime.timedelta(days=CA_VALIDITY_DAYS))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=False,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(public_key), critical=False)
        .sign(key, hashes.SHA256())
    )


def build_host_certificate(
    *,
    ca_key: ec.EllipticCurvePrivateKey,
    ca_certificate: x509.Certificate,
    host_public_key: ec.EllipticCurvePublicKey,
    host_id: str,
    addresses: list[str],
    now: datetime.datetime,
    validity_days: int,
) -> x509.Certificate:
    """A host certificate for `host_id`, signed by the CA; inputs are validated."""
    validate_host_id(host_id)
    if not 1 <= validity_days <= MAX_VALIDITY_DAYS:
        raise InvalidArgument(
            f"validity is 1..{MAX_VALIDITY_DAYS} days", validity_days=validity_days
        )
    ips = _parse_addresses(addresses)
    san: list[x509.GeneralName] = [x509.DNSName(host_dns_name(host_id))]
    san.extend(x509.IPAddress(ip) for ip in ips)
    not_after = min(
        now + datetime.timedelta(days=validity_days), ca_certificate.not_valid_after_utc
    )
    return (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, host_id)]))
        .issuer_name(ca_certificate.subject)
        .public_key(host_public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - BACKDATE)
        .not_valid_after(not_after)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=False,
                crl_sign=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(
            x509.ExtendedKeyUsage(
                [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
            ),
            critical=False,
        )
        .add_extension(x509.SubjectAlternativeName(san), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()),
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())
    )


def _parse_addresses(addresses: list[str]) -> list[ipaddress.IPv4Address | ipaddress.IPv6Address]:
    if len(addresses) > MAX_ADDRESSES:
        raise InvalidArgument(f"at most {MAX_ADDRESSES} addresses", count=len(addresses))
    parsed: list[ipaddress.IPv4Address | ipaddress.IPv6Address] = []
    for address in addresses:
        try:
            ip = ipaddress.ip_address(address)
        except ValueError as exc:
            raise InvalidArgument("not an IP address", address=repr(address)) from exc
        if ip not in parsed:
            parsed.append(ip)
    return parsed


# ---- files ---------------------------------------------------------------------------------


def _utcnow() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def _pem_cert(certificate: x509.Certificate) -> bytes:
    return certificate.public_bytes(serialization.Encoding.PEM)


def _write_new(path: Path, data: bytes, mode: int) -> None:
    """Create `path` exclusively with exactly `mode` (the umask cannot widen or narrow it)."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, mode)
    except FileExistsError as exc:
        raise AlreadyExists("refusing to overwrite", path=str(path)) from exc
    try:
        os.fchmod(fd, mode)
        view = memoryview(data)
        while view:
            written = os.write(fd, view)
            view = view[written:]
        os.fsync(fd)
    finally:
        os.close(fd)


def _refuse_existing(*paths: Path) -> None:
    for path in paths:
        if path.exists():
            raise AlreadyExists("refusing to overwrite", path=str(path))


def _read(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except FileNotFoundError as exc:
        raise NotFound("missing credential file", path=str(path)) from exc


def _load_key(path: Path) -> ec.EllipticCurvePrivateKey:
    mode = path.stat().st_mode & 0o777 if path.exists() else 0
    if mode & 0o077:
        raise InvalidArgument(
            f"private key is readable by others (mode {mode:o}); chmod 600", path=str(path)
        )
    try:
        key = serialization.load_pem_private_key(_read(path), password=None)
    except ValueError as exc:
        raise InvalidArgument("not a PEM private key", path=str(path)) from exc
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise InvalidArgument("the fleet's keys are ECDSA P-256", path=str(path))
    return key


def _load_cert(path: Path) -> x509.Certificate:
    try:
        return x509.load_pem_x509_certificate(_read(path))
    except ValueError as exc:
        raise InvalidArgument("not a PEM certificate", path=str(path)) from exc


def init_fleet(directory: str | os.PathLike[str]) -> FleetCA:
    """Make the fleet's CA in `directory` (created 0700 if absent); never overwrites one."""
    root = Path(directory)
    key_path, cert_path = root / CA_KEY_NAME, root / CA_CERT_NAME
    root.mkdir(mode=0o700, parents=True, exist_ok=True)
    _refuse_existing(key_path, cert_path)
    name = f"slates fleet CA {secrets.token_hex(8)}"
    key = ec.generate_private_key(ec.SECP256R1())
    certificate = build_ca_certificate(key, name, _utcnow())
    _write_new(key_path, _pem_key(key), 0o600)
    cert_pem = _pem_cert(certificate)
    _write_new(cert_path, cert_pem, 0o644)
    return FleetCA(root, key_path, cert_path, name, fingerprint(cert_pem))


def enroll(
    ca_directory: str | os.PathLike[str],
    host_id: str,
    out_directory: str | os.PathLike[str],
    addresses: list[str],
    *,
    validity_days: int = DEFAULT_VALIDITY_DAYS,
) -> HostCredentials:
    """Issue `host_id` a key and certificate from the CA into `out_directory`."""
    validate_host_id(host_id)
    ca_root, out = Path(ca_directory), Path(out_directory)
    ca_key = _load_key(ca_root / CA_KEY_NAME)
    ca_certificate = _load_cert(ca_root / CA_CERT_NAME)
    if ca_key.public_key() != ca_certificate.public_key():
        raise VerificationFailed("ca.key does not belong to ca.crt", directory=str(ca_root))
    host_key = ec.generate_private_key(ec.SECP256R1())
    certificate = build_host_certificate(
        ca_key=ca_key,
        ca_certificate=ca_certificate,
        host_public_key=host_key.public_key(),
        host_id=host_id,
        addresses=addresses,
        now=_utcnow(),
        validity_days=validity_days,
    )
    out.mkdir(mode=0o700, parents=True, exist_ok=True)
    key_path, cert_path, ca_copy = out / HOST_KEY_NAME, out / HOST_CERT_NAME, out / CA_CERT_NAME
    _refuse_existing(key_path, cert_path, ca_copy)
    _write_new(key_path, _pem_key(host_key), 0o600)
    cert_pem = _pem_cert(certificate)
    _write_new(cert_path, cert_pem, 0o644)
    _write_new(ca_copy, _pem_cert(ca_certificate), 0o644)
    return HostCredentials(out, host_id, ca_copy, cert_path, key_path, fingerprint(cert_pem))


def verify_host_certificate(
    certificate: x509.Certificate, ca_certificate: x509.Certificate, now: datetime.datetime
) -> str:
    """Check that the CA signed `certificate` and that it is valid at `now`; its host id."""
    if certificate.issuer != ca_certificate.subject:
        raise VerificationFailed("the certificate was not issued by this fleet's CA")
    try:
        certificate.verify_directly_issued_by(ca_certificate)
    except (ValueError, TypeError, InvalidSignature) as exc:
        raise VerificationFailed("the certificate was not issued by this fleet's CA") from exc
    if not certificate.not_valid_before_utc <= now <= certificate.not_valid_after_utc:
        raise VerificationFailed(
            "the certificate is not valid now",
            not_before=certificate.not_valid_before_utc.isoformat(),
            not_after=certificate.not_valid_after_utc.isoformat(),
        )
    return host_id_of(certificate)


def load_credentials(directory: str | os.PathLike[str]) -> HostCredentials:
    """Load and check a credentials directory made by `enroll`."""
    root = Path(directory)
    key_path, cert_path, ca_path = root / HOST_KEY_NAME, root / HOST_CERT_NAME, root / CA_CERT_NAME
    key = _load_key(key_path)
    certificate = _load_cert(cert_path)
    ca_certificate = _load_cert(ca_path)
    if key.public_key() != certificate.public_key():
        raise VerificationFailed("host.key does not belong to host.crt", directory=str(root))
    host_id = verify_host_certificate(certificate, ca_certificate, _utcnow())
    return HostCredentials(
        root, host_id, ca_path, cert_path, key_path, fingerprint(_pem_cert(certificate))
    )
