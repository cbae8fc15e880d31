"""Arch strings as the ecosystem writes them (kvgen.arch): accepted spellings, lists, clear errors."""

from __future__ import annotations

import pytest

from kvgen.arch import ARCHS, ArchError, canonical_arch, parse_arch, parse_arch_list


@pytest.mark.parametrize("text, arch", [
    ("sm_90a", "sm_90a"), ("90a", "sm_90a"), ("9.0a", "sm_90a"), (" sm_100a ", "sm_100a"), ("10.0f", "sm_100f"),
    ("100f", "sm_100f"), ("10.3a", "sm_103a"), ("107a", "sm_107a"), ("10.7a", "sm_107a"),
])
def test_accepted_spellings(text, arch):
    assert canonical_arch(text) == arch


@pytest.mark.parametrize("text, hint", [
    ("sm_89", "does not build for that GPU"), ("sm_120", "does not build for that GPU"),
    ("sm90a", "did you mean sm_90a?"), ("9.0", "did you mean sm_90a?"), ("sm_90", "did you mean sm_90a?"),
    ("9.0+PTX", "did you mean sm_90a?"), ("10.0", "did you mean sm_100a or sm_100f?"), ("hopper", ""),
    ("", ""),
])
def test_refused_spellings_name_the_accepted_ones(text, hint):
    with pytest.raises(ArchError) as err:
        canonical_arch(text)
    message = str(err.value)
    assert repr(text) in message and "accepted: " + ", ".join(ARCHS) in message
    assert hint in message


@pytest.mark.parametrize("text", ["sm_90a;sm_100a", "sm_90a,sm_100a", "sm_90a sm_100a", "9.0a; 10.0a", "90a,,100a,90a"])
def test_lists_take_torch_separators(text):
    assert parse_arch_list(text) == ["sm_90a", "sm_100a"]


def test_list_refuses_a_bad_entry():
    with pytest.raises(ArchError, match="'9.0'"):
        parse_arch_list("9.0a;9.0")
    assert parse_arch_list("  ") == []


def test_every_target_parses():
    assert [parse_arch(a)[:2] for a in ARCHS] == [(9, 0), (10, 0), (10, 0), (10, 3), (10, 7)]
