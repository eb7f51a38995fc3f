"""`mamba-stream keygen`: a 0600 signing key whose printed public key verifies its signatures."""

from __future__ import annotations

import json
import os
import stat

from mamba_stream.cli import main
from mamba_stream.state_codec.signing import PrincipalKeys, RequestSigner
from mamba_stream.workflows._models import AdvanceRequest


def test_keygen_writes_a_private_key_0600_and_prints_the_workers_entry(tmp_path, capsys):
    out = tmp_path / "alice.key"
    assert main(["keygen", "alice", "--out", str(out)]) == 0
    assert stat.S_IMODE(os.stat(out).st_mode) == 0o600
    printed = capsys.readouterr().out
    entry = json.loads(printed.strip().splitlines()[-1])
    keys = PrincipalKeys.from_mapping(entry)
    signer = RequestSigner.from_spec(str(out))
    req = AdvanceRequest(principal="alice", chunk_seq=1, text="hi")
    keys.verify("advance", "ms-x", req.claims(), signer.sign("advance", "ms-x", req.claims()))
    assert main(["keygen", "alice", "--out", str(out)]) == 1  # never overwrites a key
