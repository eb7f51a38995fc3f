"""A Temporal codec server: POST /encode and /decode, so the UI and `--codec-endpoint` decrypt.

Standard library only (http.server). CORS allows the Temporal UI's origin. Every request must
carry the server's token: as `Authorization: Bearer <token>` (the Temporal CLI's `--codec-auth`),
or in the path, `<url>/t/<token>/decode` (`CodecServer.endpoint`, for the Temporal UI, which sends
no header of its own). With no token given, the server makes one: it never decodes for anyone
who asks. Tokens come in two kinds: the operator's (`token`: every principal's payloads) and
principals' (`principal_tokens`, token -> principal: that principal's streams only; any other
payload comes back undecryptable, as it would to that principal's own client).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import secrets
import threading
from collections.abc import Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

from google.protobuf import json_format
from temporalio.api.common.v1 import Payload, Payloads

from mamba_stream.state_codec._sealing import SEALER_KEY
from mamba_stream.state_codec.codec import Keyring
from mamba_stream.state_codec.payload import EncryptionCodec

__all__ = ["CodecServer", "principal_tokens_from_env", "ui_origins"]

log = logging.getLogger(__name__)


def _presented(path: str, header: str) -> tuple[str | None, str]:
    """(the token the request carries, in its path or its Authorization header; the path without it)."""
    if path.startswith("/t/"):
        given, _, rest = path[3:].partition("/")
        return given, "/" + rest
    return (header[7:] if header.startswith("Bearer ") else None), path


def _match(given: str | None, tokens: Mapping[str, str | None]) -> tuple[bool, str | None]:
    """(whether `given` is one of `tokens`, the principal it is for: None for the operator's).
    Every token is compared, in constant time."""
    found, who = False, None
    for tok, principal in tokens.items():
        if given is not None and hmac.compare_digest(given.encode(), tok.encode()):
            found, who = True, principal
    return found, who


def _without_sealer(payload: Payload) -> Payload:
    """What a UI or CLI is handed: the payload as its sender wrote it (who sealed it is the
    workers' converter's business, not a display's)."""
    if SEALER_KEY in payload.metadata:
        del payload.metadata[SEALER_KEY]
    return payload


def ui_origins(ui_port: int) -> tuple[str, ...]:
    """The origins a Temporal UI on `ui_port` of this machine calls the codec server from."""
    return (f"http://localhost:{ui_port}", f"http://127.0.0.1:{ui_port}")


def principal_tokens_from_env(var: str = "MAMBA_STREAM_CODEC_PRINCIPAL_TOKENS") -> dict[str, str]:
    """Principals' codec tokens from `$var`: JSON `{"<token>": "<principal>", ...}`, or the path of
    a file holding it (readable by its owner only). Unset: none."""
    import os
    from pathlib import Path

    spec = (os.environ.get(var) or "").strip()
    if not spec:
        return {}
    if not spec.startswith("{"):
        p = Path(spec).expanduser()
        if p.stat().st_mode & 0o077:
            raise ValueError(f"{p} is readable by others; chmod 600 it")
        spec = p.read_text()
    tokens = json.loads(spec)
    if not isinstance(tokens, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in tokens.items()):
        raise ValueError(f"${var} must map tokens to principals")
    return tokens


class CodecServer:
    """Serve the payload codec over HTTP on a background thread (or in the foreground).

    Args:
        token: the token every request must carry; None: a random one (`token`, `endpoint`).
    """

    def __init__(self, keyring: Keyring, *, host: str = "127.0.0.1", port: int = 8081,
                 origins: tuple[str, ...] = ui_origins(8233),
                 token: str | None = None, principal_tokens: Mapping[str, str] | None = None) -> None:
        allowed = set(origins)
        self.token = token = token or secrets.token_urlsafe(24)
        tokens: dict[str, str | None] = {**(principal_tokens or {}), token: None}
        codecs = {p: EncryptionCodec(keyring if p is None else keyring.for_principal(p)) for p in tokens.values()}

        class Handler(BaseHTTPRequestHandler):
            def _cors(self) -> None:
                origin = self.headers.get("Origin")
                if origin and (origin in allowed or "*" in allowed):
                    self.send_header("Access-Control-Allow-Origin", origin)
                    self.send_header("Access-Control-Allow-Credentials", "true")
                    self.send_header("Access-Control-Allow-Methods", "POST, OPTIONS")
                    self.send_header("Access-Control-Allow-Headers",
                                     "Content-Type, X-Namespace, Authorization")

            def do_OPTIONS(self) -> None:  # http.server's naming
                self.send_response(200)
                self._cors()
                self.end_headers()

            def do_POST(self) -> None:
                # the UI asks for /decode?preserveStorageRefs=true: route on the path alone
                given, path = _presented(urlsplit(self.path).path.rstrip("/"), self.headers.get("Authorization", ""))
                ok, who = _match(given, tokens)
                if not ok:
                    self.send_response(401)
                    self._cors()
                    self.end_headers()
                    return
                if path not in ("/encode", "/decode"):
                    self.send_response(404)
                    self._cors()
                    self.end_headers()
                    return
                try:
                    body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                    payloads = json_format.Parse(body, Payloads())
                    codec = codecs[who]
                    fn = codec.encode if path == "/encode" else codec.decode
                    out = Payloads(payloads=[_without_sealer(p) for p in asyncio.run(fn(list(payloads.payloads)))])
                    data = json_format.MessageToJson(out).encode()
                except Exception as exc:  # noqa: BLE001 - report, never crash the server
                    self.send_response(400)
                    self._cors()
                    self.end_headers()
                    self.wfile.write(json.dumps({"error": str(exc)}).encode())
                    return
                self.send_response(200)
                self._cors()
                self.send_header("Content-Type", "application/json")
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, fmt: str, *args: object) -> None:
                log.debug("codec server: " + fmt, *args)

        self._httpd = ThreadingHTTPServer((host, port), Handler)
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        """The server's address; requests to it need `Authorization: Bearer <token>`."""
        host, port = self._httpd.server_address[:2]
        return f"http://{host}:{port}"

    @property
    def endpoint(self) -> str:
        """The codec endpoint with the token in its path: for `--ui-codec-endpoint` and
        `--codec-endpoint`, which then need no header. Whoever can read it can decode."""
        return f"{self.url}/t/{self.token}"

    def start(self) -> CodecServer:
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="codec-server", daemon=True)
        self._thread.start()
        return self

    def serve_forever(self) -> None:
        self._httpd.serve_forever()

    def stop(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
