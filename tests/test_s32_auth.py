"""API key files (auth.py): what an operator's file means, what its errors show, and who else may read it."""

from __future__ import annotations

import logging
import os

import pytest

from petals_chain.orchestrator import auth
from petals_chain.orchestrator.auth import KeyFileError, KeyRing
from petals_chain.orchestrator.limits import client_of

KEY = "k-0123456789abcdef"


def _keys(path, text: str | bytes, mode: int = 0o600):
    (path.write_bytes if isinstance(text, bytes) else path.write_text)(text)
    os.chmod(path, mode)  # explicit: the test does not depend on the umask
    return path


def _client(ring: KeyRing, *headers: tuple[bytes, bytes]):
    return client_of({"headers": list(headers)}, ring)


def test_a_key_file_with_a_byte_order_mark_loads(tmp_path):
    """A file saved with a UTF-8 byte order mark (Windows Notepad) was refused: "invalid key name '\\ufeffalice'"."""
    ring = KeyRing.from_file(_keys(tmp_path / "keys", "\ufeffalice " + KEY + "\r\nbob " + KEY + "X\r\n"))
    assert [k.name for k in ring.keys] == ["alice", "bob"]
    assert _client(ring, (b"authorization", b"Bearer " + KEY.encode())) == "alice"


def test_a_hash_inside_a_key_is_part_of_the_key(tmp_path):
    """'#' anywhere started a comment: ``alice abcdefghijklmnopq#rstuvwxyz`` loaded the key ``abcdefghijklmnopq``,
    silently: the client presenting the whole key got 401 and a shorter key than configured was accepted."""
    full = "abcdefghijklmnopq#rstuvwxyz"
    ring = KeyRing.from_file(_keys(tmp_path / "keys", f"# the team\nalice {full}  # a comment\nbob {KEY} #x\n"))
    assert _client(ring, (b"authorization", f"Bearer {full}".encode())) == "alice"
    assert _client(ring, (b"authorization", b"Bearer abcdefghijklmnopq")) is None
    assert _client(ring, (b"x-api-key", KEY.encode())) == "bob"
    with pytest.raises(KeyFileError, match="invalid limit"):  # glued to a limit, a comment is a bad limit, not lost
        KeyRing.from_file(_keys(tmp_path / "keys", f"alice {KEY} max_concurrent=2#two\n"))


@pytest.mark.parametrize("key", ["пароль-очень-длинный-ключ", "0123456789abc\x01defXYZ", "0123456789abcdef\x7f"])
def test_a_key_no_http_header_can_carry_is_refused(tmp_path, key):
    """A non-ASCII key (or one with a control character) loaded, and then matched no request: header bytes are read
    as latin-1, the file as UTF-8 (and httpx refuses to send it). Now the file's error, without the key in it."""
    with pytest.raises(KeyFileError, match=r"keys:1: the key of 'alice' has a character other than printable") as e:
        KeyRing.from_file(_keys(tmp_path / "keys", f"alice {key}\n"))
    assert key not in str(e.value)


def test_errors_name_the_line_and_never_show_a_key(tmp_path):
    """A duplicate name said only "duplicate key names"; a field out of place (a second key) was echoed."""
    with pytest.raises(KeyFileError, match=r"keys:3: duplicate key name 'alice' \(also on line 1\)"):
        KeyRing.from_file(_keys(tmp_path / "keys", f"alice {KEY}\nbob {KEY}B\nalice {KEY}C\n"))
    secret = "k-secret-0123456789xyz"
    with pytest.raises(KeyFileError, match=r"keys:1: invalid limit field 3") as e:
        KeyRing.from_file(_keys(tmp_path / "keys", f"alice {KEY} {secret}\n"))
    assert secret not in str(e.value)
    with pytest.raises(KeyFileError, match="invalid limit 'max_sessions=x'"):  # a NAME=N field is still shown
        KeyRing.from_file(_keys(tmp_path / "keys", f"alice {KEY} max_sessions=x\n"))


def test_a_key_file_other_users_can_read_is_warned_about(tmp_path, monkeypatch, caplog):
    """Like ssh for a private key (though not refused): a key file others may read (or write: a key of their own
    added) loaded without a word."""
    monkeypatch.setattr(auth, "_warned", set(), raising=False)  # said once per process: fresh here
    path = _keys(tmp_path / "keys", f"alice {KEY}\n", mode=0o644)
    with caplog.at_level(logging.WARNING, logger=auth.__name__):
        KeyRing.from_file(path)
        KeyRing.from_file(path)  # read again by each model's API: said once
    warned = [r.getMessage() for r in caplog.records if r.name == auth.__name__]
    assert len(warned) == 1 and "mode 0644" in warned[0] and "read it" in warned[0] and "chmod 600" in warned[0]
    assert KEY not in warned[0]
    caplog.clear()
    os.chmod(path, 0o666)
    with caplog.at_level(logging.WARNING, logger=auth.__name__):
        KeyRing.from_file(path)
    assert "read and write it" in caplog.text
    caplog.clear()
    for mode in (0o600, 0o640, 0o400):
        os.chmod(path, mode)
        with caplog.at_level(logging.WARNING, logger=auth.__name__):
            KeyRing.from_file(path)
    assert caplog.text == ""


def test_a_key_file_given_as_a_pipe_serves_every_reader():
    """``--api-keys <(...)`` (or ``/dev/stdin`` from a pipe): the CLI's check read the pipe ("API keys: 1 from
    /dev/fd/63"), then the model's API read it again, found it empty and the orchestrator exited 1 ("no keys"). The
    command line now reads it once (auth.KeyFile, not watched) and hands that to every model's API."""
    from types import SimpleNamespace

    from petals_chain.orchestrator.limits import LimitsConfig

    r, w = os.pipe()
    try:
        os.write(w, f"alice {KEY} max_sessions=2\n".encode())
        os.close(w)
        w = -1
        path = f"/dev/fd/{r}"
        keys = auth.KeyFile(path)  # the command line's read
        apis = [LimitsConfig.from_config(SimpleNamespace(api_keys=path, api_key_ring=keys)) for _ in range(2)]
    finally:
        os.close(r)
        if w >= 0:
            os.close(w)
    assert not keys.watching and all(api.keys is keys for api in apis)
    assert _client(keys, (b"x-api-key", KEY.encode())) == "alice" and keys.get("alice").max_sessions == 2
