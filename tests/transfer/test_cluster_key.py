"""The cluster key as an operator provides it (issue 19 item 1): one hex format for the variable
and the file, a key with too little entropy refused, a key file that is a regular file readable
by its owner only, read without blocking and with a bound. Each case failed open (or blocked)
before: any readable file of 16+ bytes became the key verbatim."""

from __future__ import annotations

import os
import re
import secrets
import threading

import pytest

from hybridkv.transfer import ClusterKey, TransferError, load_cluster_key
from hybridkv.transfer.auth import KEY_ENV, KEY_FILE_ENV


@pytest.fixture(autouse=True)
def _no_key_in_env(monkeypatch):
    monkeypatch.delenv(KEY_ENV, raising=False)
    monkeypatch.delenv(KEY_FILE_ENV, raising=False)


def key_file(tmp_path, text: str | bytes, mode: int = 0o600, name: str = "cluster.key"):
    path = tmp_path / name
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    path.chmod(mode)
    return path


def test_a_good_key_file_and_variable_give_the_same_key(tmp_path, monkeypatch):
    good = secrets.token_hex(32)
    path = key_file(tmp_path, good + "\n")
    assert load_cluster_key(str(path)).hex == good
    monkeypatch.setenv(KEY_ENV, good)
    assert load_cluster_key().hex == good
    monkeypatch.setenv(KEY_FILE_ENV, str(path))
    assert load_cluster_key().hex == good


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("root:x:0:0:root:/root:/bin/bash\n", "must be hex digits"),  # /etc/passwd was a public key
        ("0123456789abcdef0123", "at least 16 bytes"),  # 10 bytes: refused from the variable, was taken as ASCII
        ("00" * 32, "too little entropy"),  # all zero
        ("ab" * 32, "too little entropy"),  # one repeated byte
        ("0102" * 16, "too little entropy"),  # two distinct bytes
        ("000102030405060708090a0b0c0d0e0f" * 2, "too little entropy"),  # a 16-byte block repeated
        (b"\xff\xfe" + bytes(range(30)), "must be hex digits"),  # binary
    ],
    ids=["passwd", "short", "zeros", "repeated", "two-bytes", "periodic", "binary"],
)
def test_a_bad_key_is_refused_from_the_file_and_the_variable_alike(tmp_path, monkeypatch, text, says):
    path = key_file(tmp_path, text)
    with pytest.raises(TransferError, match=says):
        load_cluster_key(str(path))
    if isinstance(text, str):
        monkeypatch.setenv(KEY_ENV, text)
        with pytest.raises(TransferError, match=says):
            load_cluster_key()


def test_a_weak_key_is_refused_even_from_code():
    with pytest.raises(TransferError, match="too little entropy"):
        ClusterKey(bytes(32))
    ClusterKey(bytes(range(16)))  # 16 distinct bytes: accepted


def test_dev_zero_is_not_a_key():
    with pytest.raises(TransferError, match="not a regular file"):
        load_cluster_key("/dev/zero")


def test_a_fifo_is_refused_without_blocking(tmp_path):
    fifo = tmp_path / "key.fifo"
    os.mkfifo(fifo, 0o600)
    result: list[BaseException | None] = []

    def load() -> None:
        try:
            load_cluster_key(str(fifo))
            result.append(None)
        except BaseException as exc:  # handed to the test thread
            result.append(exc)

    thread = threading.Thread(target=load, daemon=True)
    thread.start()
    thread.join(10)
    if thread.is_alive():  # unblock the reader so that nothing is left behind, then fail
        fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
        os.close(fd)
        thread.join(5)
        pytest.fail("loading a FIFO as the key file blocked")
    assert isinstance(result[0], TransferError) and "not a regular file" in str(result[0])


@pytest.mark.parametrize("mode", [0o640, 0o604, 0o644, 0o660], ids=oct)
def test_a_key_file_others_can_read_is_refused_with_the_chmod_to_run(tmp_path, mode):
    path = key_file(tmp_path, secrets.token_hex(32), mode)
    with pytest.raises(TransferError, match=rf"readable by others.*run `chmod 600 {re.escape(str(path))}`"):
        load_cluster_key(str(path))


def test_a_symlink_is_refused(tmp_path):
    path = key_file(tmp_path, secrets.token_hex(32))
    link = tmp_path / "link.key"
    link.symlink_to(path)
    with pytest.raises(TransferError, match="symbolic link"):
        load_cluster_key(str(link))


def test_a_huge_key_file_is_refused_by_size(tmp_path):
    path = key_file(tmp_path, secrets.token_hex(32) * 1000)
    with pytest.raises(TransferError, match="larger than 4 KiB"):
        load_cluster_key(str(path))


def test_a_missing_file_is_named(tmp_path):
    with pytest.raises(TransferError, match=r"cannot read the cluster key file .*missing"):
        load_cluster_key(str(tmp_path / "missing"))
