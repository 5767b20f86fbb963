"""Hub downloads: huggingface_hub's real download code against a local HTTP server in the Hub's URL layout.

The server (127.0.0.1, started here) serves one tiny checkpoint the way huggingface.co does: the revision API
(`/api/models/{repo}/revision/{rev}`: the commit), the tree API (the files), and `/{repo}/resolve/{commit}/{file}`
with the headers huggingface_hub reads (ETag, X-Repo-Commit, Content-Length); an unknown repo is a 404 with
`X-Error-Code: RepoNotFound`. No test reaches the internet.
"""

import hashlib
import io
import json
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

import huggingface_hub
import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.skips import requires
from interp_engine import forward, load_model
from interp_engine.errors import InputTypeError, LoadError, SpecError

REPO = "tiny-org/tiny-llama"
COMMIT = hashlib.sha1(REPO.encode()).hexdigest()


class _Hub(BaseHTTPRequestHandler):
    folder: Path
    served: list

    def log_message(self, *args):  # the test's output is pytest's, not the server's access log
        pass

    def _files(self) -> dict[str, bytes]:
        return {p.relative_to(self.folder).as_posix(): p.read_bytes() for p in sorted(self.folder.rglob("*"))
                if p.is_file()}

    def _route(self) -> tuple[int, dict, bytes]:
        path = unquote(urlsplit(self.path).path)
        self.served.append(path)
        files = self._files()
        for prefix in (f"/api/models/{REPO}/revision/", f"/api/models/{REPO}/tree/"):
            if path.startswith(prefix):
                if "/revision/" in prefix:
                    body = {"id": REPO, "sha": COMMIT, "siblings": [{"rfilename": f} for f in files]}
                else:
                    body = [{"type": "file", "path": f, "size": len(data), "oid": hashlib.sha1(data).hexdigest()}
                            for f, data in files.items()]
                return 200, {"Content-Type": "application/json"}, json.dumps(body).encode()
        prefix = f"/{REPO}/resolve/{COMMIT}/"
        if path.startswith(prefix) and path[len(prefix):] in files:
            data = files[path[len(prefix):]]
            return 200, {"ETag": f'"{hashlib.sha1(data).hexdigest()}"', "X-Repo-Commit": COMMIT}, data
        return 404, {"X-Error-Code": "RepoNotFound", "X-Error-Message": "Repository not found"}, b"{}"

    def _answer(self, with_body: bool):
        status, headers, body = self._route()
        self.send_response(status)
        for key, value in {**headers, "Content-Length": str(len(body))}.items():
            self.send_header(key, value)
        self.end_headers()
        if with_body:
            self.wfile.write(body)

    def do_HEAD(self):
        self._answer(False)

    def do_GET(self):
        self._answer(True)


@pytest.fixture
def hub_server(tmp_path, monkeypatch, tiny_path):
    """(endpoint, requests served): an online hub on 127.0.0.1 serving the tiny llama as REPO, an empty cache."""
    handler = type("Hub", (_Hub,), {"folder": tiny_path("llama"), "served": []})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    endpoint = f"http://127.0.0.1:{server.server_port}"
    cache = tmp_path / "hub"
    monkeypatch.setenv("HF_ENDPOINT", endpoint)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf_home"))
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setenv("HF_TOKEN", "hf_test_token_never_leaves_the_machine")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    yield endpoint, handler.served
    server.shutdown()
    server.server_close()
    thread.join()


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_repo_id_not_in_the_cache_is_downloaded_then_loaded_from_the_snapshot(hub_server, tiny_path, tmp_path,
                                                                                  monkeypatch):
    endpoint, served = hub_server
    terminal = _Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)  # on a terminal, the download draws huggingface_hub's bars
    model = load_model(REPO, backend="eager", device="cpu", dtype="float32", cache_dir=str(tmp_path / "mine"))
    n_files = len([p for p in tiny_path("llama").iterdir() if p.is_file()])
    assert f"Fetching {n_files} files: 100%" in terminal.getvalue(), terminal.getvalue()
    terminal = _Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    load_model(REPO, backend="eager", cache_dir=str(tmp_path / "quiet"), progress=False)
    assert (tmp_path / "quiet" / "models--tiny-org--tiny-llama" / "snapshots" / COMMIT).is_dir()
    assert terminal.getvalue() == ""
    snapshot = tmp_path / "mine" / "models--tiny-org--tiny-llama" / "snapshots" / COMMIT
    assert Path(model.runtime.source) == snapshot
    assert sorted(p.name for p in snapshot.iterdir()) == sorted(p.name for p in tiny_path("llama").iterdir())
    assert f"/api/models/{REPO}/revision/main" in served
    assert f"/{REPO}/resolve/{COMMIT}/model.safetensors" in served
    # HF's own model from the original folder is the reference: the downloaded one computes the same logits.
    ids = torch.tensor([[1, 5, 9, 30, 2]])
    reference = AutoModelForCausalLM.from_pretrained(str(tiny_path("llama")), dtype=torch.float32).eval()
    with torch.no_grad():
        torch.testing.assert_close(forward(model, ids, progress=False), reference(ids).logits)

    served.clear()  # now cached: a second load never asks the server
    again = load_model(REPO, backend="eager", device="cpu", cache_dir=str(tmp_path / "mine"))
    assert Path(again.runtime.source) == snapshot and served == []


def test_a_missing_repo_and_offline_mode_are_refused_with_the_fix(hub_server, monkeypatch):
    with pytest.raises(LoadError) as info:
        load_model("tiny-org/no-such-model", backend="eager", progress=False)
    assert "'tiny-org/no-such-model' was not found on http://127.0.0.1" in str(info.value)
    assert "HF_TOKEN" in str(info.value)

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    endpoint, served = hub_server
    served.clear()
    with pytest.raises(LoadError) as info:
        load_model(REPO, backend="eager")
    assert "HF_HUB_OFFLINE=1 forbids downloading it" in str(info.value)
    assert "Fix: unset HF_HUB_OFFLINE" in str(info.value)
    assert served == []


def test_hub_keywords_on_a_local_folder_are_refused(tiny_path):
    with pytest.raises(SpecError, match="revision, token choose what to download"):
        load_model(str(tiny_path("llama")), backend="eager", revision="main", token="hf_x")
    with pytest.raises(InputTypeError, match=r"token=3 must be a str, True or False; progress='no' must be True"):
        load_model(REPO, backend="eager", token=3, progress="no")


@requires("vllm")
def test_vllm_handles_get_the_downloaded_snapshot_folder(hub_server, tmp_path):
    """Lazy: no engine starts. The engine is given the folder, never the repo id (it would ask the Hub itself)."""
    from interp_engine.backends.vllm.engine import settings

    model = load_model(REPO, backend="vllm", progress=False)
    snapshot = Path(huggingface_hub.constants.HF_HUB_CACHE) / "models--tiny-org--tiny-llama" / "snapshots" / COMMIT
    assert Path(model.runtime.source) == snapshot and not model.is_loaded
    assert settings(model.runtime)[0]["model"] == str(snapshot)
