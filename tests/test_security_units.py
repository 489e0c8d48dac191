"""Security units: token files, the exposure rule, client credentials, the authenticator (no server)."""

import grpc
import pytest

from inference_engine.errors import Unauthenticated
from inference_engine.security import flags
from inference_engine.security.authenticator import Authenticator
from inference_engine.security.credentials import bind, channel_credentials, is_loopback, open_sync_channel, split_host
from inference_engine.security.settings import ClientSecurity, ServerSecurity
from inference_engine.security.tokens import TokenTable, parse_bearer, read_token_file, token_identity
from tests.certs import TOKEN_A, TOKEN_B, token_file


def test_token_table(tmp_path):
    table = TokenTable.load(token_file(tmp_path, TOKEN_A, TOKEN_B))
    assert len(table) == 2
    assert table.identity_of(TOKEN_A) == token_identity(TOKEN_A) != table.identity_of(TOKEN_B)
    assert table.identity_of("x" * 20) is None and TOKEN_A[:10] not in token_identity(TOKEN_A)
    assert parse_bearer("Bearer  abc ") == "abc" and parse_bearer("bearer abc") == "abc" and parse_bearer("Basic x") == ""
    for tokens, fragment in (([], "no tokens"), (["short"], "token 1 is shorter"), ([TOKEN_A, "a b" * 9], "token 2"),
                             ([TOKEN_A, TOKEN_A], "appears twice")):
        with pytest.raises(ValueError, match=fragment) as err:
            TokenTable(tokens)
        assert TOKEN_A not in str(err.value)
    assert read_token_file(token_file(tmp_path, TOKEN_B)) == TOKEN_B
    (tmp_path / "empty").write_text("# nothing\n")
    with pytest.raises(ValueError, match="holds no token"):
        read_token_file(tmp_path / "empty")


def test_loopback_and_exposure_rule(tmp_path):
    assert all(is_loopback(h) for h in ("127.0.0.1", "127.3.2.1", "localhost", "::1", "[::1]"))
    assert not any(is_loopback(h) for h in ("0.0.0.0", "::", "10.0.0.1", "example.com", ""))
    assert split_host("[::1]:50051") == "::1" and split_host("localhost:1") == "localhost"
    tls = dict(tls_cert=tmp_path / "c", tls_key=tmp_path / "k")
    assert flags.exposure_problem("127.0.0.1", ServerSecurity()) == ""
    assert flags.exposure_problem("0.0.0.0", ServerSecurity(**tls, auth_token_file=tmp_path / "t")) == ""
    assert flags.exposure_problem("0.0.0.0", ServerSecurity(**tls, tls_client_ca=tmp_path / "ca")) == ""
    assert "no authentication" in flags.exposure_problem("0.0.0.0", ServerSecurity(**tls))
    assert "no TLS" in flags.exposure_problem("0.0.0.0", ServerSecurity(auth_token_file=tmp_path / "t"))
    with pytest.raises(ValueError, match="--insecure-public"):
        flags.check_exposure("0.0.0.0", ServerSecurity())
    flags.check_exposure("0.0.0.0", ServerSecurity(insecure_public=True))  # allowed, with a WARNING


def test_client_helper_never_sends_a_token_in_clear(pki):
    with pytest.raises(ValueError, match="in clear to 10.1.2.3:50051"):
        channel_credentials("10.1.2.3:50051", ClientSecurity(token=TOKEN_A))
    assert channel_credentials("10.1.2.3:50051", ClientSecurity()) is None
    open_sync_channel("127.0.0.1:1").close()
    open_sync_channel("127.0.0.1:1", ClientSecurity(ca_file=pki.ca, server_name="localhost")).close()


async def test_client_credentials_carry_the_token_over_the_transport_they_claim(pki):
    """Loopback with a token: plaintext (grpc local credentials), the token as a bearer header; a CA with a token: TLS verified
    against that CA, the same header. A real grpc.aio server on 127.0.0.1 echoes what it received."""
    seen: list[tuple[str | None, list[bytes]]] = []

    async def echo(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        seen.append((dict(context.invocation_metadata()).get("authorization"),
                     context.auth_context().get("transport_security_type", [])))
        return request

    server = grpc.aio.server()
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
        "t.Echo", {"Call": grpc.unary_unary_rpc_method_handler(echo)}),))
    plain = server.add_insecure_port("127.0.0.1:0")
    tls = server.add_secure_port("127.0.0.1:0", grpc.ssl_server_credentials(
        [(pki.server.key.read_bytes(), pki.server.cert.read_bytes())]))
    await server.start()
    try:
        for port, security in ((plain, ClientSecurity(token=TOKEN_A)), (tls, ClientSecurity(ca_file=pki.ca, token=TOKEN_A)),
                               (tls, ClientSecurity(ca_file=pki.ca))):
            target = f"127.0.0.1:{port}"
            async with grpc.aio.secure_channel(target, channel_credentials(target, security)) as channel:
                assert await channel.unary_unary("/t.Echo/Call")(b"ping", timeout=60) == b"ping"
        untrusted = channel_credentials(f"127.0.0.1:{tls}", ClientSecurity(ca_file=pki.other_ca, token=TOKEN_A))
        async with grpc.aio.secure_channel(f"127.0.0.1:{tls}", untrusted) as channel:
            with pytest.raises(grpc.aio.AioRpcError) as err:  # TLS is verified: another CA's client never connects
                await channel.unary_unary("/t.Echo/Call")(b"ping", timeout=60)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        await server.stop(0)
    assert seen == [("Bearer " + TOKEN_A, [b"insecure"]), ("Bearer " + TOKEN_A, [b"ssl"]), (None, [b"ssl"])]


def test_authenticator_without_interceptor():
    class Ctx:
        def __init__(self, md, auth=None):
            self.md, self.auth = md, auth or {}

        def invocation_metadata(self):
            return self.md

        def auth_context(self):
            return self.auth

    tokens = Authenticator(TokenTable([TOKEN_A]))
    assert tokens.identity_of(Ctx((("authorization", "Bearer " + TOKEN_A),))) == token_identity(TOKEN_A)
    with pytest.raises(Unauthenticated):
        tokens.identity_of(Ctx((("authorization", "Bearer nope"), ("x-bin", b"\x00"))))
    assert Authenticator(None, is_mtls=True).identity_of(Ctx((), {"x509_common_name": [b"c"]})) == "cert:c"
    with pytest.raises(Unauthenticated, match="no subject"):
        Authenticator(None, is_mtls=True).identity_of(Ctx((), {}))
    assert Authenticator().identity_of(Ctx(())) == "anonymous"
    assert Authenticator().identity_of_metadata((("authorization", "Bearer " + TOKEN_A),)) is None


def test_bind_failures():
    class Refusing:
        def add_insecure_port(self, address):
            raise RuntimeError("Failed to bind")

    class Zero:
        def add_insecure_port(self, address):
            return 0

    with pytest.raises(OSError, match=r"could not bind h:1 \(in use by another process\?\): Failed to bind"):
        bind(Refusing(), "h:1", ServerSecurity())
    with pytest.raises(OSError, match="could not bind h:1"):
        bind(Zero(), "h:1", ServerSecurity())
