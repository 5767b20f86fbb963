"""The Hub: a repo id that is not in the local HF cache is downloaded once, then every backend loads the folder.

The cache is asked first (no network when the snapshot is there); a download goes through huggingface_hub's own
`snapshot_download`, so the token (`token=`, `HF_TOKEN`, `hf auth login`), `HF_ENDPOINT`, `HF_HUB_CACHE` and
`HF_HUB_OFFLINE` mean what they mean everywhere else.
"""

import os
from dataclasses import dataclass
from pathlib import Path

from interp_engine.errors import InputTypeError, LoadError, fix
from interp_engine.progress import Silent

# Files a HF checkpoint never needs: the original training checkpoints and other frameworks' exports.
_NOT_NEEDED = ["original/*", "*.pth", "*.pt", "*.gguf", "*.onnx", "onnx/*", "*.msgpack", "*.h5", "*.ot",
               "*.tflite", "coreml/*", "*.mlmodel"]


@dataclass(frozen=True, slots=True)
class HubSource:
    """Where and how a repo id is fetched: `load_model`'s `revision=`, `cache_dir=`, `token=` and `progress=`."""

    revision: str | None = None
    cache_dir: str | None = None
    token: str | bool | None = None
    progress: bool = True

    def __post_init__(self):
        problems = [f"{name}={value!r} must be {kind}" for name, value, kind in (
            ("revision", self.revision, "a branch, tag or commit (str)"),
            ("cache_dir", self.cache_dir, "a folder path (str)"),
        ) if value is not None and not isinstance(value, str)]
        if self.token is not None and not isinstance(self.token, str | bool):
            problems.append(f"token={self.token!r} must be a str, True or False")
        if not isinstance(self.progress, bool):
            problems.append(f"progress={self.progress!r} must be True or False")
        if problems:
            raise InputTypeError(fix("; ".join(problems) + ".", "e.g. revision=\"main\", cache_dir=\"~/hf\", "
                                     "token=\"hf_...\", progress=False (or leave them out)."))

    @property
    def asked(self) -> list[str]:
        """The Hub-only keywords given, for refusing them on a local folder."""
        return [name for name in ("revision", "cache_dir", "token") if getattr(self, name) is not None]


def fetch(repo_id: str, hub: HubSource) -> Path:
    """The local snapshot folder of `repo_id`: from the cache, else downloaded."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import (GatedRepoError, HfHubHTTPError, LocalEntryNotFoundError,
                                        RepositoryNotFoundError, RevisionNotFoundError)

    where = dict(revision=hub.revision, cache_dir=os.path.expanduser(hub.cache_dir) if hub.cache_dir else None)
    try:
        return Path(snapshot_download(repo_id, local_files_only=True, **where))
    except ValueError:  # not even a valid repo id (HFValidationError)
        raise LoadError(fix(f"{repo_id!r} is neither a local folder nor a valid HF repo id.",
                            'pass a checkpoint folder that exists, or a repo id like "Qwen/Qwen3-8B".')) from None
    except OSError:  # not in the cache: download it
        pass
    at = f"revision {hub.revision!r} of {repo_id!r}" if hub.revision else repo_id
    if constants.is_offline_mode():
        raise LoadError(fix(f"{at!r} is not in the local HF cache and HF_HUB_OFFLINE=1 forbids downloading it.",
                            "unset HF_HUB_OFFLINE (or set it to 0) so load_model can download it, download it "
                            "where a network exists (hf download ...), or pass a local folder."))
    # Read at call time: huggingface_hub read HF_ENDPOINT once, when it was imported.
    endpoint = os.environ.get("HF_ENDPOINT", "").rstrip("/") or None
    try:
        return Path(snapshot_download(repo_id, token=hub.token, endpoint=endpoint, ignore_patterns=_NOT_NEEDED,
                                      tqdm_class=None if hub.progress else Silent, **where))
    except GatedRepoError:
        raise LoadError(fix(f"{repo_id!r} is gated: the Hub refused the download with this token.",
                            "accept its terms on the Hub, then pass token=\"hf_...\", set HF_TOKEN, or run "
                            "`hf auth login`.")) from None
    except RevisionNotFoundError:
        raise LoadError(fix(f"{repo_id!r} has no revision {hub.revision!r}.",
                            "pass a branch, tag or commit the repo has (revision=\"main\" is the default).")) from None
    except RepositoryNotFoundError:
        raise LoadError(fix(f"{repo_id!r} was not found on {endpoint or constants.ENDPOINT} (or is private).",
                            "check the spelling; for a private repo pass token=\"hf_...\", set HF_TOKEN, or run "
                            "`hf auth login`.")) from None
    except (HfHubHTTPError, LocalEntryNotFoundError, OSError) as e:  # the network, the server or the disk
        raise LoadError(fix(f"downloading {at!r} failed: {' '.join(str(e).split())[:300]}",
                            "check the connection (and HF_ENDPOINT) and retry; a finished download is reused "
                            "from the cache.")) from None
