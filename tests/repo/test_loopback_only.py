"""Tests, benchmarks and scripts send traffic nowhere but this machine.

An "unreachable" address in a test is a closed port on loopback (127.0.0.1:9), never a private-range or public
one: a connection attempt to those leaves the host. This check fails on any IP literal in tests/, benchmarks/ or
scripts/ other than loopback (127.0.0.0/8, ::1) or the unspecified bind addresses (0.0.0.0, ::). Cluster configs
under launch/ describe real clusters and are out of its scope. The libraries' own reporting (Ray usage stats, vLLM
usage stats, MLflow telemetry, the model hub) is switched off for the whole suite in tests/conftest.py; the last
tests here hold it so.
"""

from __future__ import annotations

import ipaddress
import re
import socket
from pathlib import Path
from urllib.parse import urlparse

import pytest
from paths import REPO as ROOT

SCANNED = ("tests", "benchmarks", "scripts")
# A dotted quad standing alone: not inside a version ("==5.1.0.95", ">=1.2.3.4", "0.2.1.1.post7", a wheel's
# "-4.10.0.84-") or a longer dotted name, but found after a plain "=" (cluster.address=..., --node-ip-address=...).
IPV4 = re.compile(r"(?<![\w.+~<>-])(?<![=<>!~]=)(\d{1,3}(?:\.\d{1,3}){3})(?!\.?\w)")
# Colon-separated hex groups standing alone (URLs write them in brackets); a slice such as x[0::2] is no address.
IPV6 = re.compile(r"(?<![\w:.])([0-9A-Fa-f]{0,4}(?::[0-9A-Fa-f]{0,4}){2,7})(?![\w:.])")


def _ipv4(quad: str) -> ipaddress.IPv4Address | None:
    """The address a connect would reach: the C resolver reads a leading-zero octet as octal (010 is 8)."""
    try:
        return ipaddress.IPv4Address(socket.inet_aton(quad))
    except OSError:  # an octet above 255 (or a bad octal one): not an address
        return None


def _ipv6(text: str) -> ipaddress.IPv6Address | None:
    # a group of three or more hex digits, as every routable IPv6 address has, tells it from a slice like a[i::j]
    if not any(len(group) >= 3 for group in text.split(":")):
        return None
    try:
        return ipaddress.IPv6Address(text)
    except ValueError:
        return None


def outside_addresses(text: str) -> list[str]:
    """The IP literals in ``text`` that are neither loopback nor an unspecified bind address (0.0.0.0, ::)."""
    found = []
    for pattern, parse in ((IPV4, _ipv4), (IPV6, _ipv6)):
        for match in pattern.finditer(text):
            addr = parse(match.group(1))
            if addr is not None and not (addr.is_loopback or addr.is_unspecified):
                found.append(str(addr))
    return found


def scanned_files() -> list[Path]:
    files = []
    for top in SCANNED:
        files += [p for p in (ROOT / top).rglob("*") if p.is_file() and "__pycache__" not in p.parts]
    return sorted(files)


def test_no_file_under_tests_benchmarks_or_scripts_names_an_outside_address():
    offenders = []
    for path in scanned_files():
        text = path.read_bytes().decode("latin-1")  # every file, whatever its encoding: an address is ASCII
        for lineno, line in enumerate(text.splitlines(), 1):
            offenders += [f"{path.relative_to(ROOT)}:{lineno}: {addr}" for addr in outside_addresses(line)]
    assert not offenders, "addresses off this machine (use a closed loopback port such as 127.0.0.1:9):\n" + "\n".join(
        offenders
    )


def _quad(*octets: int) -> str:
    """A dotted quad built at run time, so this file's own examples are not literals the check would flag."""
    return ".".join(map(str, octets))


PRIVATE, LAN = _quad(10, 255, 255, 1), _quad(192, 168, 1, 20)
PUBLIC, RANGE_172 = _quad(8, 8, 8, 8), _quad(172, 16, 0, 1)
OCTAL = _quad("010", "001", "002", "003")  # leading zeros: octal to inet_aton
ULA, LINK = ":".join(["fd00", "", "1"]), ":".join(["fe80", "", "1"])
GOOGLE_DNS6 = ":".join(["2001", "4860", "", "8888"])


@pytest.mark.parametrize(
    "text,expected",
    [
        (f'cluster.address="{PRIVATE}:6379"', [PRIVATE]),
        (f"http://{LAN}:8265", [LAN]),
        (f"ray://{PUBLIC}:10001", [PUBLIC]),
        (f"--address {RANGE_172}", [RANGE_172]),
        (f"see {PRIVATE}.", [PRIVATE]),
        ("127.0.0.1:9 and 127.3.2.1 and 0.0.0.0:8265", []),
        ("opencv-python-headless==5.1.0.95", []),
        ("partial-json-parser==0.2.1.1.post7", []),
        ("torch 2.13.0+cpu, vllm 0.32.0", []),
        ("999.1.1.1", []),
        (f"cluster.address={PRIVATE}:6379", [PRIVATE]),
        (f"--node-ip-address={LAN}", [LAN]),
        (f"host {OCTAL}", [_quad(8, 1, 2, 3)]),
        ("pkg>=1.2.3.4, pkg~=1.2.3.4, pkg!=1.2.3.4, opencv_python-4.10.0.84-cp37", []),
        (f"http://[{ULA}]:8265", [ULA]),
        (f"host {LINK}%eth0 or {GOOGLE_DNS6}", [LINK, GOOGLE_DNS6]),
        (f"::ffff:{PRIVATE}", [PRIVATE]),
        ("[::1]:8265, bind ::, x[0::2], a[i::j], std::vector, 12:30:45, aa:bb:cc:dd:ee:ff", []),
    ],
)
def test_the_check_finds_outside_addresses_and_passes_loopback_and_versions(text, expected):
    assert outside_addresses(text) == expected


# -- the libraries' own reporting, off for the whole suite (tests/conftest.py) ----------------------------------------


def _loopback_url(url: str) -> bool:
    host = urlparse(url).hostname
    return host is not None and ipaddress.ip_address(host).is_loopback


def test_ray_reports_no_usage_and_its_report_url_is_loopback():
    """A head that `ray start` or ray.cluster_utils.Cluster starts POSTs a "usage disabled" report even with usage
    stats off; only a loopback report URL keeps that one on this machine."""
    from ray._common.usage import usage_lib

    assert not usage_lib.usage_stats_enabled()
    assert _loopback_url(usage_lib._usage_stats_report_url()), usage_lib._usage_stats_report_url()


def test_vllm_reports_no_usage():
    usage_lib = pytest.importorskip("vllm.usage.usage_lib")

    assert not usage_lib.is_usage_stats_enabled()
    assert _loopback_url(usage_lib._USAGE_STATS_SERVER), usage_lib._USAGE_STATS_SERVER


def test_mlflow_telemetry_and_the_model_hub_are_off():
    from huggingface_hub import constants
    from mlflow.environment_variables import MLFLOW_DISABLE_TELEMETRY

    # the flag, not MLflow's verdict: MLflow is also quiet whenever PYTEST_CURRENT_TEST is set, so its verdict here
    # would pass whatever tests/conftest.py sets
    assert MLFLOW_DISABLE_TELEMETRY.get() is True
    assert constants.HF_HUB_OFFLINE and constants.HF_HUB_DISABLE_TELEMETRY
