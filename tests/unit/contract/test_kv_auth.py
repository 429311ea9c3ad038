"""The cluster secret and what it authenticates (``contract.auth``): sealed side-channel messages and
MAC'd transfer parameters. Property-based where the claim is "any change is refused"."""

from __future__ import annotations

import os
import stat

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from contract import wire
from contract.auth import (
    MACED_FIELDS,
    MAX_MESSAGE_TTL_S,
    SECRET_ENV,
    SECRET_FILE_ENV,
    ClusterSecret,
    ConsumedParams,
    KVAuth,
    MissingSecret,
    Unauthenticated,
    engine_key,
    load_secret,
    new_secret,
    read_secret_file,
    write_secret,
)

NOW = 1_800_000_000.0
SECRET = ClusterSecret("a-test-secret-of-the-cluster-0123456789")
AUTH = KVAuth(SECRET)
OTHER = KVAuth(ClusterSecret("another-cluster-secret-9876543210-xyz"))


def issued(**overrides) -> dict:
    params = {
        wire.DO_REMOTE_PREFILL: True,
        wire.DO_REMOTE_DECODE: False,
        wire.REMOTE_ENGINE_ID: "prefill-0",
        wire.REMOTE_REQUEST_ID: "cmpl-1-0",
        wire.REMOTE_HOST: "198.18.0.11",
        wire.REMOTE_PORT: 17100,
        wire.REMOTE_BLOCK_IDS: [3, 4, 5],
        wire.REMOTE_NUM_TOKENS: 40,
        wire.TP_SIZE: 1,
        wire.BLOCK_SIZE: 16,
        wire.PDSERVE_READER: "decode-0",
    } | overrides
    return AUTH.sign_params(params, ttl_s=120, now=NOW)


# --------------------------------------------------------------------------- the secret


def test_the_secret_never_shows_in_repr_str_or_format() -> None:
    secret = new_secret()
    for shown in (repr(secret), str(secret), f"{secret}", repr([secret]), repr(AUTH)):
        assert secret.reveal() not in shown and "****" in shown


def test_a_secret_file_is_private_and_round_trips(tmp_path) -> None:
    path = tmp_path / "state" / "cluster-secret"
    secret = new_secret()
    write_secret(path, secret)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert read_secret_file(path) == secret


def test_the_secret_comes_from_the_environment_or_a_file_it_names(tmp_path) -> None:
    path = tmp_path / "secret"
    write_secret(path, SECRET)
    assert load_secret({SECRET_ENV: SECRET.reveal()}) == SECRET
    assert load_secret({SECRET_FILE_ENV: str(path)}) == SECRET
    with pytest.raises(MissingSecret, match=f"{SECRET_ENV}.*{SECRET_FILE_ENV}"):
        load_secret({})
    with pytest.raises(MissingSecret, match="cannot read the cluster secret file"):
        load_secret({SECRET_FILE_ENV: str(tmp_path / "missing")})
    with pytest.raises(MissingSecret, match="too short"):
        load_secret({SECRET_ENV: "short"})


def test_the_engine_key_and_the_kv_key_are_different_derivations() -> None:
    key = engine_key(SECRET)
    assert key == engine_key(ClusterSecret(SECRET.reveal())) and key != engine_key(new_secret())
    assert SECRET.reveal() not in key
    sealed = AUTH.seal(b"release", b"r1", now=NOW)
    assert key.encode() not in sealed  # the KV key is not the engine key


# --------------------------------------------------------------------------- sealed messages


@given(kind=st.sampled_from([b"handshake", b"handshake-reply", b"release", b"report"]), body=st.binary(max_size=200))
def test_a_sealed_message_opens_to_what_was_sealed(kind: bytes, body: bytes) -> None:
    assert AUTH.open(AUTH.seal(kind, body, now=NOW), now=NOW + 1) == (kind, body)


@settings(max_examples=300)
@given(data=st.data())
def test_any_change_to_a_sealed_message_is_refused(data) -> None:
    sealed = AUTH.seal(b"release", b"cmpl-123-0", ttl_s=120, now=NOW)
    position = data.draw(st.integers(0, len(sealed) - 1))
    new_byte = data.draw(st.integers(0, 255).filter(lambda b: b != sealed[position]))
    changed = sealed[:position] + bytes([new_byte]) + sealed[position + 1 :]
    with pytest.raises(Unauthenticated):
        AUTH.open(changed, now=NOW)


@given(message=st.binary(max_size=300))
def test_arbitrary_bytes_never_open(message: bytes) -> None:
    with pytest.raises(Unauthenticated):
        AUTH.open(message, now=NOW)


def test_what_a_message_is_refused_for() -> None:
    sealed = AUTH.seal(b"report", b"prefill-0 r1", ttl_s=60, now=NOW)
    with pytest.raises(Unauthenticated, match="wrong MAC") as refused:
        OTHER.open(sealed, now=NOW)
    assert refused.value.kind == "report"
    with pytest.raises(Unauthenticated, match="expired"):
        AUTH.open(sealed, now=NOW + 61)
    with pytest.raises(Unauthenticated, match="not a sealed") as refused:
        AUTH.open(b"PDRL cmpl-1", now=NOW)  # the unauthenticated release of before
    assert refused.value.kind == "message"
    with pytest.raises(Unauthenticated, match="longer than any"):
        AUTH.open(AUTH.seal(b"release", b"r", ttl_s=MAX_MESSAGE_TTL_S + 10, now=NOW), now=NOW)
    with pytest.raises(ValueError, match="unknown side-channel message kind"):
        AUTH.seal(b"anything", b"")


# --------------------------------------------------------------------------- transfer parameters


def test_issued_parameters_pass_for_their_reader_until_they_expire() -> None:
    params = issued()
    AUTH.check_params(params, "decode-0", now=NOW + 119)
    with pytest.raises(Unauthenticated, match="expired"):
        AUTH.check_params(params, "decode-0", now=NOW + 121)
    with pytest.raises(Unauthenticated, match="issued for decode engine decode-0, not decode-1"):
        AUTH.check_params(params, "decode-1", now=NOW)
    unbound = issued(**{wire.PDSERVE_READER: None})
    AUTH.check_params(unbound, "decode-7", now=NOW)  # a proxy that named no reader: any decode engine


VALUES = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**40), 2**40),
    st.text(max_size=20),
    st.lists(st.integers(0, 10_000), max_size=6),
    st.floats(allow_nan=False, allow_infinity=False),
)


@settings(max_examples=400)
@given(field=st.sampled_from(MACED_FIELDS), value=VALUES)
def test_any_change_to_a_field_a_decode_engine_acts_on_is_refused(field: str, value) -> None:
    params = issued()
    if params.get(field) == value and type(params.get(field)) is type(value):
        return  # not a change
    params[field] = value
    with pytest.raises(Unauthenticated):
        AUTH.check_params(params, "decode-0", now=NOW)


@given(mac=st.text(max_size=80))
def test_a_forged_or_missing_mac_is_refused(mac: str) -> None:
    params = issued()
    params[wire.PDSERVE_MAC] = mac
    with pytest.raises(Unauthenticated):
        AUTH.check_params(params, "decode-0", now=NOW)
    del params[wire.PDSERVE_MAC]
    with pytest.raises(Unauthenticated, match="no MAC"):
        AUTH.check_params(params, "decode-0", now=NOW)


def test_parameters_of_another_cluster_are_refused() -> None:
    theirs = OTHER.sign_params(dict(issued()), ttl_s=120, now=NOW)
    with pytest.raises(Unauthenticated, match="wrong MAC"):
        AUTH.check_params(theirs, "decode-0", now=NOW)


def test_parameters_are_claimed_once() -> None:
    consumed = ConsumedParams()
    first, second = issued(), issued(**{wire.REMOTE_REQUEST_ID: "cmpl-2-0"})
    assert consumed.claim(first, now=NOW) and consumed.claim(second, now=NOW)
    assert not consumed.claim(first, now=NOW + 1)  # a replay
    assert consumed.claim(first, now=NOW + 200)  # forgotten once expired (and the MAC check refuses it then)


def test_claims_are_bounded() -> None:
    consumed = ConsumedParams(limit=3)
    all_params = [issued(**{wire.REMOTE_REQUEST_ID: f"r{i}"}) for i in range(5)]
    assert all(consumed.claim(p, now=NOW) for p in all_params)
    assert len(consumed._seen) <= 3
