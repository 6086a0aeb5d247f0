"""path_trust: a path is trusted only when it and every directory above it are this user's (or root's) and no
one else may write them; sticky directories (/tmp) and symlinks' own modes are no objection."""

from __future__ import annotations

import os

import pytest

from leanlm.path_trust import is_trusted, untrusted_reason


@pytest.fixture
def private(tmp_path):
    tmp_path.chmod(0o700)
    (tmp_path / "a" / "b").mkdir(parents=True)
    (tmp_path / "a" / "b" / "f").write_text("x")
    return tmp_path


def test_a_private_chain_is_trusted(private):
    assert is_trusted(private / "a" / "b" / "f")


def test_a_directory_others_may_write_anywhere_above_is_not(private):
    (private / "a").chmod(0o777)
    assert "writable by other users" in untrusted_reason(private / "a" / "b" / "f")
    (private / "a").chmod(0o1777)  # sticky: others cannot rename b
    assert is_trusted(private / "a" / "b" / "f")


def test_a_file_others_may_write_is_not(private):
    (private / "a" / "b" / "f").chmod(0o666)
    assert "chmod go-w" in untrusted_reason(private / "a" / "b" / "f")


@pytest.mark.skipif(os.getuid() != 0, reason="giving a directory to another user needs root")
def test_another_owner_anywhere_above_is_not(private):
    os.chown(private / "a", 4242, 4242)
    assert "owned by uid 4242" in untrusted_reason(private / "a" / "b" / "f")


def test_a_symlink_is_judged_by_where_it_leads(private, tmp_path_factory):
    elsewhere = tmp_path_factory.mktemp("elsewhere")
    elsewhere.chmod(0o777)
    (elsewhere / "f").write_text("x")
    (private / "link").symlink_to(elsewhere / "f")
    assert "writable by other users" in untrusted_reason(private / "link")
