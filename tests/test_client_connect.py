"""The CLI reaches a secured server (TLS, mTLS, bearer token) and says why when it cannot:
refused, TLS handshake failed, closed during set-up, UNAUTHENTICATED. A drained reply is complete."""

import asyncio
import contextlib
import io
import json
import socket
from pathlib import Path

import grpc
import pytest

from inference_engine.client import cli
from inference_engine.client.cli import complete
from inference_engine.client.connection import TOKEN_ENV
from inference_engine.runtime.runtime import Runtime
from inference_engine.security.settings import ServerSecurity
from inference_engine.server.server import start_server
from inference_engine.v1 import runtime_pb2 as pb
from tests.certs import TOKEN_A, TOKEN_B, token_file
from tests.conftest import make_config


@contextlib.asynccontextmanager
async def _server(engine, security: ServerSecurity):
    runtime = Runtime(engine, make_config(security=security))
    server, port = await start_server(runtime, "127.0.0.1", 0)
    try:
        yield f"127.0.0.1:{port}"
    finally:
        await server.stop(0.5)
        await runtime.stop()


async def _generate(target: str, *flags: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    argv = ["generate", "--target", target, "--prompt", "Say hi.", "--max-new-tokens", "3", "--json", *flags]
    rc = await asyncio.to_thread(cli.main, argv, out, err)
    return rc, out.getvalue(), err.getvalue()


@pytest.mark.real_model
async def test_tls_and_token(real_engine, pki, tmp_path, monkeypatch):
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    tokens = token_file(tmp_path, TOKEN_A)
    security = ServerSecurity(tls_cert=pki.server.cert, tls_key=pki.server.key, auth_token_file=tokens)
    async with _server(real_engine, security) as target:
        rc, out, err = await _generate(target, "--tls-ca", str(pki.ca), "--token-file", str(tokens))
        assert rc == 0 and json.loads(out)["usage"]["generated_tokens"] >= 1, err
        rc, out, err = await _generate(target, "--tls-ca", str(pki.ca), "--token", TOKEN_A)
        assert rc == 0, err
        monkeypatch.setenv(TOKEN_ENV, TOKEN_A)
        rc, out, err = await _generate(target, "--tls-ca", str(pki.ca))
        assert rc == 0, err
        rc, out, err = await _generate(target, "--tls-ca", str(pki.ca), "--token", TOKEN_B)  # a flag beats the variable
        assert rc == 1 and err.startswith(f"error: UNAUTHENTICATED: {target} refused the call") and \
            "pass the right token" in err and TOKEN_B not in err, err
        monkeypatch.delenv(TOKEN_ENV)
        rc, out, err = await _generate(target, "--tls-ca", str(pki.ca))
        assert rc == 1 and "UNAUTHENTICATED" in err and "requires a bearer token: pass --token-file" in err, err
        rc, out, err = await _generate(target)  # plaintext to a TLS port
        assert rc == 1 and err == (f"error: {target} closed the connection while it was being set up: the server may "
                                   "require TLS: pass --tls-ca PEM (the CA of its certificate)\n"), err
        rc, out, err = await _generate(target, "--tls-ca", str(pki.other_ca), "--token", TOKEN_A)
        assert rc == 1 and err.startswith(f"error: TLS handshake with {target} failed: the server's certificate is "
                                          "not signed by --tls-ca"), err


@pytest.mark.real_model
async def test_mtls_and_plaintext_errors(real_engine, pki):
    mtls = ServerSecurity(tls_cert=pki.server.cert, tls_key=pki.server.key, tls_client_ca=pki.ca)
    async with _server(real_engine, mtls) as target:
        rc, out, err = await _generate(target, "--tls-ca", str(pki.ca), "--tls-cert", str(pki.client_a.cert),
                                       "--tls-key", str(pki.client_a.key))
        assert rc == 0, err
        rc, out, err = await _generate(target, "--tls-ca", str(pki.ca))
        assert rc == 1 and "may require a client certificate (mTLS): pass --tls-cert and --tls-key" in err, err
    async with _server(real_engine, ServerSecurity()) as target:
        rc, out, err = await _generate(target, "--tls-ca", str(pki.ca))
        assert rc == 1 and err.startswith(f"error: TLS handshake with {target} failed: the server does not speak TLS")


def test_usage_errors_of_the_connection_flags(pki, capsys):
    for flags, message in ((["--tls-cert", "c.pem"], "--tls-cert and --tls-key go together"),
                           (["--tls-cert", str(pki.client_a.cert), "--tls-key", str(pki.client_a.key)],
                            "--tls-cert (mTLS) needs --tls-ca"),
                           (["--tls-ca", "/nonexistent/ca.pem"], "--tls-ca /nonexistent/ca.pem: no such file"),
                           (["--token", TOKEN_A, "--target", "192.0.2.1:50051"],
                            "refusing to send a bearer token in clear to 192.0.2.1:50051")):
        with pytest.raises(SystemExit) as done:
            cli.main(["generate", "--prompt", "hi", *flags])
        assert done.value.code == 2 and message in capsys.readouterr().err


def test_refused_is_named_at_once():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, not listening: refused
        out, err = io.StringIO(), io.StringIO()
        rc = cli.main(["chat", "--target", f"127.0.0.1:{port}", "--connect-timeout", "600"], out, err, input)
    assert rc == 1 and err.getvalue().startswith(f"error: connection refused: no server listens at 127.0.0.1:{port}")


class _Cancelled(grpc.RpcError):
    """Fixture: the status a draining server ends a finished stream with."""

    def code(self):
        return grpc.StatusCode.CANCELLED


def test_a_drain_after_the_last_message_is_not_an_error():
    def drained():  # fixture: a Generate stream whose call is cancelled after its last message
        yield pb.GenerateResponse(tokens=[5], text="Hi")
        yield pb.GenerateResponse(stop_reason=pb.STOP_REASON_EOS, history_length=9)
        raise _Cancelled()

    out = io.StringIO()
    last = cli.stream_reply(drained(), out)
    assert out.getvalue() == "Hi" and last.history_length == 9

    def cut():  # cancelled before any last message: an error, still
        yield pb.GenerateResponse(tokens=[5], text="Hi")
        raise _Cancelled()

    with pytest.raises(_Cancelled):
        list(complete(cut()))


class _Error(grpc.RpcError):
    """Fixture: an RpcError with a given code and details, as grpc raises them."""

    def __init__(self, code: grpc.StatusCode, details: str):
        self._code, self._details = code, details

    def code(self):
        return self._code

    def details(self):
        return self._details


def test_every_kind_of_failure_has_its_words():
    from inference_engine.client.connect_errors import explain
    from inference_engine.security.settings import ClientSecurity

    plain, tls = ClientSecurity(), ClientSecurity(ca_file=Path("ca.pem"))
    unavailable = grpc.StatusCode.UNAVAILABLE
    cases = [
        (_Error(grpc.StatusCode.PERMISSION_DENIED, "not yours"), plain, "PERMISSION_DENIED: not yours"),
        (_Error(grpc.StatusCode.INVALID_ARGUMENT, "top_k too big"), plain, "INVALID_ARGUMENT: top_k too big"),
        (_Error(unavailable, "the server is starting (the model is still loading); retry shortly"), plain,
         "UNAVAILABLE: the server is starting (the model is still loading); retry shortly"),
        (_Error(unavailable, "errors resolving nowhere:1: Domain name not found"), plain,
         "cannot resolve h:1: errors resolving nowhere:1: Domain name not found"),
        (_Error(unavailable, "failed to connect to all addresses; last error: Tls handshake failed (X): SSL_ERROR_SSL: "
                             "NO_SHARED_CIPHER: OK"), tls, "TLS handshake with h:1 failed: check --tls-ca"),
        (_Error(unavailable, "failed to connect to all addresses; last error: UNKNOWN: h:1: Connection reset"), tls,
         "h:1 closed the connection while it was being set up: the server may require a client certificate"),
        (_Error(unavailable, "failed to connect to all addresses; last error: UNKNOWN: h:1: No route to host"), plain,
         "cannot connect to h:1: failed to connect"),
    ]
    for exc, security, words in cases:
        assert explain("h:1", exc, security).startswith(words), (words, explain("h:1", exc, security))


async def test_a_server_still_loading_is_waited_for_then_named():
    from inference_engine.client.client import RuntimeClient, ServerUnavailable
    from inference_engine.server.frontend import open_frontend

    frontend = await open_frontend(make_config(), "127.0.0.1", 0)  # bound, no model attached: UNAVAILABLE
    try:
        client = RuntimeClient(f"127.0.0.1:{frontend.port}", connect_timeout_s=0.5)
        with pytest.raises(ServerUnavailable) as err:
            await asyncio.to_thread(client.connect)
        client.close()
    finally:
        await frontend.server.stop(None)
    assert str(err.value) == ("UNAVAILABLE: the server is starting (the model is still loading); retry shortly "
                              "(still not ready after 0.5 s; --connect-timeout)")


def test_the_banner_names_weights_mode_block_and_kernel():
    from inference_engine.server.model_info import ModelInfo, serving_label

    info = pb.GetModelInfoResponse(model_name="m (q4_1)", exact=True, block_size=64,
                                   kernels="exact-gemm kernel 3 (max rows 64) on MLX's CPU stream")
    assert cli.serving(info) == "m (q4_1), exact at block 64, exact-gemm kernel 3"
    info.kernels, info.exact = "MLX ops, BLAS openblas: /usr/lib/libopenblas.so.0", False
    assert cli.serving(info) == "m (q4_1), plain blocks of 64 (not exact), MLX ops, OpenBLAS"
    info.kernels = "MLX ops (native attention), BLAS reference: MLX bundled"
    assert cli.serving(info).endswith(", MLX ops (native attention), BLAS reference: MLX bundled")
    info.kernels = "MLX ops, BLAS reference: MLX bundled"
    assert cli.serving(info).endswith(", MLX ops, reference BLAS")
    info.kernels = "MLX ops on Metal"
    assert cli.serving(info).endswith(", MLX ops on Metal")
    fields = {f: 0 for f in ModelInfo.__dataclass_fields__}
    label = serving_label(ModelInfo(**{**fields, "model_name": "m (fp32)", "is_exact": True, "block_size": 1,
                                       "kernels": "reference: MLX bundled"}))
    assert label == "m (fp32), exact at block size 1, reference: MLX bundled"
