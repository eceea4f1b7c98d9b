import pytest

from asyncwt import AuthenticationError, PlanMismatchError, ProtocolError
from asyncwt._transports.wire import (
    FRAME_SIZE,
    PROTOCOL_VERSION,
    Frame,
    FrameKind,
    HandshakeStatus,
    check_result,
    pack_challenge,
    pack_hello,
    pack_proof,
    pack_result,
    proof_is_valid,
    unpack_hello,
    verify_challenge,
)

DIGEST = bytes(range(32))
TOKEN = "s3cret-token-0123456789"


def test_frame_round_trips_with_fixed_size() -> None:
    frame = Frame(FrameKind.BUCKET, 7, 3, DIGEST[:16], 1 << 40)
    data = frame.pack()
    assert len(data) == FRAME_SIZE == 48
    assert Frame.unpack(data) == frame


def test_frame_rejects_bad_magic_and_unknown_kind() -> None:
    data = bytearray(Frame(FrameKind.END, 1, 0, DIGEST[:16], 0).pack())
    with pytest.raises(ProtocolError, match=r"^frame magic should be b'AWTF', got b'XXXX'$"):
        Frame.unpack(b"XXXX" + bytes(data[4:]))
    data[4] = 99
    with pytest.raises(
        ProtocolError, match=r"^frame kind 99 is not one of \[1, 2, 3, 4, 5, 6, 7, 8, 9, 10\]$"
    ):
        Frame.unpack(bytes(data))


def test_handshake_succeeds_with_the_same_token() -> None:
    worker_nonce, trainer_nonce = b"w" * 32, b"t" * 32
    nonce, digest = unpack_hello(pack_hello(worker_nonce, DIGEST))
    assert (nonce, digest) == (worker_nonce, DIGEST)
    challenge = pack_challenge(TOKEN, worker_nonce, trainer_nonce, DIGEST)
    assert verify_challenge(TOKEN, worker_nonce, DIGEST, challenge) == trainer_nonce
    proof = pack_proof(TOKEN, worker_nonce, trainer_nonce, DIGEST)
    assert proof_is_valid(TOKEN, worker_nonce, trainer_nonce, DIGEST, proof)
    assert TOKEN.encode() not in challenge + proof


def test_handshake_refuses_a_different_token_on_both_sides() -> None:
    worker_nonce, trainer_nonce = b"w" * 32, b"t" * 32
    challenge = pack_challenge("other-token-abcdefghij", worker_nonce, trainer_nonce, DIGEST)
    with pytest.raises(AuthenticationError, match=r"^the trainer failed the token challenge"):
        verify_challenge(TOKEN, worker_nonce, DIGEST, challenge)
    proof = pack_proof("other-token-abcdefghij", worker_nonce, trainer_nonce, DIGEST)
    assert not proof_is_valid(TOKEN, worker_nonce, trainer_nonce, DIGEST, proof)


def test_handshake_proof_is_bound_to_the_plan_digest() -> None:
    worker_nonce, trainer_nonce = b"w" * 32, b"t" * 32
    proof = pack_proof(TOKEN, worker_nonce, trainer_nonce, DIGEST)
    assert not proof_is_valid(TOKEN, worker_nonce, trainer_nonce, bytes(32), proof)


def test_handshake_result_maps_to_errors() -> None:
    check_result(pack_result(HandshakeStatus.OK))
    with pytest.raises(
        AuthenticationError, match=r"^the trainer refused this worker's token proof$"
    ):
        check_result(pack_result(HandshakeStatus.BAD_PROOF))
    with pytest.raises(PlanMismatchError, match=r"^the trainer's transfer plan differs"):
        check_result(pack_result(HandshakeStatus.PLAN_MISMATCH))


@pytest.mark.parametrize("version", [1, 9])  # 1: before ROUTE carried the edges' keys
def test_hello_rejects_another_protocol(version: int) -> None:
    assert PROTOCOL_VERSION == 2
    data = bytearray(pack_hello(b"w" * 32, DIGEST))
    data[4] = version
    with pytest.raises(
        ProtocolError, match=rf"^peer speaks protocol version {version}, this side speaks 2$"
    ):
        unpack_hello(bytes(data))
