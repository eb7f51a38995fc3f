"""The Temporal UI shows a stream's history decrypted, for the operator only: the embedded dev
server (its UI on a port that is not the default one) is told the codec server's address, not its
token; a browser that has not been given the operator's endpoint sees ciphertext (the codec server
refuses it), and the operator's browser, whose Codec Server setting holds the endpoint with the
token (what the UI's settings dialog stores, in the browser alone), sees the receipts as text. A
screenshot is saved to docs/."""

from __future__ import annotations

import concurrent.futures
import json
import shutil
import socket
import uuid
from pathlib import Path

import pytest
from temporalio.client import Client
from temporalio.worker import Worker

from mamba_stream.activities import StreamActivities, open_store
from mamba_stream.activities._registry import ModelRegistry
from mamba_stream.plugin import MambaStreamPlugin
from mamba_stream.state_codec.codec import Keyring
from mamba_stream.state_codec.codec_server import CodecServer, ui_origins
from mamba_stream.worker import EmbeddedTemporal
from mamba_stream.workflows import StreamClient

pytestmark = pytest.mark.asyncio(loop_scope="session")

ROOT = Path(__file__).resolve().parents[2]
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
SCREENSHOT = ROOT / "docs" / "ui-decrypted-history.png"

try:
    import playwright.async_api as pw
except ImportError:  # pragma: no cover - a test dependency
    pw = None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.skipif(CHROMIUM is None or pw is None,
                    reason="needs a chromium binary: `apt-get install chromium` (what .ci/run does); and playwright, "
                           "a test dependency (`pip install -e '.[test]'`)")
async def test_the_ui_shows_the_decrypted_receipts_of_a_stream(tmp_path):
    ring = Keyring.generate()
    port, ui_port = free_port(), free_port()
    ui = f"http://127.0.0.1:{ui_port}"
    codec = CodecServer(ring, port=0, origins=ui_origins(ui_port)).start()
    server = EmbeddedTemporal(tmp_path / "home", port=port, ui_port=ui_port, codec_endpoint=codec.url).start()
    acts = StreamActivities(models=ModelRegistry(["tiny-mamba2"], backend="reference"),
                            store=open_store(f"file://{tmp_path / 'states'}"), keyring=ring)
    queue = f"ui-{uuid.uuid4().hex[:8]}"
    try:
        client = await Client.connect(server.address, plugins=[MambaStreamPlugin(keyring=ring, activities=acts)])
        pool = concurrent.futures.ThreadPoolExecutor(4)
        async with Worker(client, task_queue=queue, activity_executor=pool):
            streams = StreamClient(client, queue)
            sid = await streams.open("alice", "tiny-mamba2")
            for text in ("the key is k7 ", "and the colour is teal ", "what was the key?"):
                last = await streams.advance(sid, "alice", text=text)
            run_id = (await streams.handle(sid).describe()).run_id
            # what an operator without the codec sees: ciphertext only
            raw = [e async for e in client.get_workflow_handle(sid).fetch_history_events()]
            blob = b"".join(e.SerializeToString() for e in raw)
            assert last.receipt.checksum.encode() not in blob and b"colour is teal" not in blob

            history = f"{ui}/namespaces/default/workflows/{sid}/{run_id}/history"
            async with pw.async_playwright() as p:
                browser = await p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
                # a browser that only reached the UI: the UI's settings name the codec server, which
                # refuses it (no token), so the page shows no request in clear
                stranger = await browser.new_page(viewport={"width": 1400, "height": 1800})
                await stranger.goto(history, wait_until="load")
                await stranger.get_by_text("Workflow Execution Update Completed").first.wait_for(timeout=30_000)
                await stranger.wait_for_timeout(3000)
                assert "what was the key?" not in await stranger.inner_text("body")
                await stranger.close()
                # the operator's browser: its Codec Server setting holds the endpoint with the token
                # (the keys the UI's dialog writes; "override" makes the browser's endpoint win)
                operator = await browser.new_context(viewport={"width": 1400, "height": 1800})
                await operator.add_init_script(
                    f"localStorage.setItem('endpoint', {json.dumps(json.dumps(codec.endpoint))});"
                    "localStorage.setItem('overrideRemoteCodecConfiguration', 'true');")
                page = await operator.new_page()
                await page.goto(history, wait_until="load")
                # the newest event first: the last chunk's update, whose outcome holds its receipt
                # the outcome's code view renders only the lines in view, and the receipt's checksum is
                # below them: wait for the receipt's first bound field, the model revision
                shown = page.get_by_text(last.receipt.model_revision).filter(visible=True).first
                for attempt in range(3):  # a click before the page is interactive expands nothing: reload
                    if attempt:
                        await page.reload(wait_until="load")
                    row = page.get_by_text("Workflow Execution Update Completed").first
                    await row.wait_for(timeout=30_000)
                    await row.click()
                    try:
                        await shown.wait_for(timeout=15_000)
                        break
                    except pw.TimeoutError:
                        if attempt == 2:
                            raise
                body = await page.inner_text("body")
                await page.screenshot(path=str(SCREENSHOT))
                await browser.close()
            assert last.receipt.model_revision in body and last.receipt.stream_id in body, \
                "the decrypted receipt of the last chunk is on the page"
            assert f'"position": {last.position}' in body
            assert "what was the key?" in body and '"principal": "alice"' in body  # the decrypted request
            await streams.cancel(sid)
    finally:
        acts.close()
        server.stop()
        codec.stop()
