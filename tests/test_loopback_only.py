"""Tests, benchmarks and scripts send traffic nowhere but this machine.

An "unreachable" address in a test is a closed port on loopback (127.0.0.1:9), never a private-range or public
one: a connection attempt to those leaves the host. This check fails on any IPv4 literal in tests/, benchmarks/ or
scripts/ other than loopback (127.0.0.0/8) or 0.0.0.0 (a bind address). Cluster configs under launch/ describe real
clusters and are out of its scope.
"""
from __future__ import annotations

import ipaddress
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCANNED = ("tests", "benchmarks", "scripts")
# A dotted quad standing alone: not inside a version ("==5.1.0.95", "0.2.1.1.post7") or a longer dotted name.
IPV4 = re.compile(r"(?<![\w.=+~<>-])(\d{1,3}(?:\.\d{1,3}){3})(?!\.?\w)")


def outside_addresses(text: str) -> list[str]:
    """The IPv4 literals in ``text`` that are neither loopback nor the unspecified bind address 0.0.0.0."""
    found = []
    for match in IPV4.finditer(text):
        try:
            addr = ipaddress.IPv4Address(match.group(1))
        except ValueError:  # an octet above 255: not an address
            continue
        if not (addr.is_loopback or addr.is_unspecified):
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
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:  # binary fixtures carry no addresses a test connects to
            continue
        for lineno, line in enumerate(text.splitlines(), 1):
            offenders += [f"{path.relative_to(ROOT)}:{lineno}: {addr}" for addr in outside_addresses(line)]
    assert not offenders, ("addresses off this machine (use a closed loopback port such as 127.0.0.1:9):\n"
                           + "\n".join(offenders))


def _quad(*octets: int) -> str:
    """A dotted quad built at run time, so this file's own examples are not literals the check would flag."""
    return ".".join(map(str, octets))


PRIVATE, LAN, PUBLIC, RANGE_172 = _quad(10, 255, 255, 1), _quad(192, 168, 1, 20), _quad(8, 8, 8, 8), _quad(172, 16, 0, 1)


@pytest.mark.parametrize("text,expected", [
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
])
def test_the_check_finds_outside_addresses_and_passes_loopback_and_versions(text, expected):
    assert outside_addresses(text) == expected
