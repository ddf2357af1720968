"""A sweep of hub revisions fails fast, in one line, when the hub cannot be reached (instead of
the hub libraries' retries on every file), and is left alone in offline mode or when the hub
answers."""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, HTTPServer

import pytest
from huggingface_hub import constants

from peakprobe.checkpoints_index import OfflineError, check_hub_reachable
from peakprobe.cli import main


def _closed_port() -> int:
    import socket

    with socket.socket() as s:  # bound then closed: nothing listens there
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def dead_hub(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-hf-cache"))  # nothing cached
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    monkeypatch.setattr(constants, "ENDPOINT", f"http://127.0.0.1:{_closed_port()}")


def test_unreachable_hub_stops_the_sweep_before_anything_is_written(dead_hub, tmp_path, capsys):
    out = tmp_path / "run"
    text = tmp_path / "eval.txt"
    text.write_text("some text " * 100)
    assert main(["sweep", "pythia-70m", "--out", str(out), "--select", "2", "--data", str(text)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert "unreachable" in err and "EleutherAI/pythia-70m" in err and "HF_HUB_OFFLINE=1" in err
    assert not out.exists()


def test_offline_mode_skips_the_check(dead_hub, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    check_hub_reachable("EleutherAI/pythia-70m", timeout=1)  # no request, no error
    monkeypatch.delenv("HF_HUB_OFFLINE")
    with pytest.raises(OfflineError, match="unreachable"):
        check_hub_reachable("EleutherAI/pythia-70m", timeout=1)


def test_any_answer_counts_as_reachable(monkeypatch):
    class NotFound(BaseHTTPRequestHandler):
        def do_HEAD(self):  # noqa: N802 (the http.server API)
            self.send_response(404)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = HTTPServer(("127.0.0.1", 0), NotFound)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
        monkeypatch.setattr(constants, "ENDPOINT", f"http://127.0.0.1:{server.server_port}")
        check_hub_reachable("EleutherAI/pythia-70m", timeout=5)
    finally:
        server.shutdown()
        server.server_close()
