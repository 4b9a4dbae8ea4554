"""A model named by its HuggingFace hub id (`meta-llama/Llama-2-7b-hf`) as well as by a directory, as transformers and
vLLM take it:

    resolve("meta-llama/Llama-2-7b-hf", revision="main")   # -> the snapshot directory in the local hub cache
    resolve("~/models/Llama-2-7b-hf")                      # -> that directory, untouched

A path that exists wins (a directory named like an id is that directory). Otherwise a name that is a valid repo id
(`org/name` or `name`: letters, digits, `-`, `_`, `.`) is looked up with huggingface_hub's own `snapshot_download`:
from the local cache (`HF_HUB_CACHE`, else `HF_HOME/hub`, else ~/.cache/huggingface/hub), and where the hub can be
reached (not `HF_HUB_OFFLINE=1`) the files the cache lacks are downloaded, with huggingface_hub's progress bars on
stderr. Only what cullama reads comes down (MODEL_FILES: the top-level JSON files, safetensors and tokenizer.model
and chat templates), never `original/` (Meta's own consolidated weights in LLaMA-3 repos), PyTorch pickles nor
Mistral's consolidated.safetensors. `revision` is a branch, a tag or a commit id. Anything else is a local path, and
the errors a missing directory gets.

huggingface_hub is the optional `hub` extra (pip install 'cullama[hub]'), imported only for a name that is not a
path; without it, such a name is one line naming the extra. A repo that is missing, gated, private or not in the
cache while the hub cannot be reached, and a revision it does not have, are each one line naming the id (HubError).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from ..common.errors import ConfigError, OptionError, ResourceError
from ..common.untrusted import shown

# What cullama reads of a checkpoint (config, generation config, quantization configs, safetensors and their index,
# tokenizer.json / tokenizer.model / tokenizer_config.json / special_tokens_map.json, chat templates): top-level
# files only, so that original/ (Meta's weights), onnx/ and the like never come down.
MODEL_FILES = ("*.json", "*.safetensors", "tokenizer.model", "*.jinja")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "special_tokens_map.json",
                   "chat_template.json", "*.jinja")
IGNORED = ("*/*", "consolidated*", "*.bin", "*.pth", "*.pt", "*.gguf")
# huggingface_hub's rule for a repo id (utils.validate_repo_id), so that a path is never sent to the hub
REPO_ID = re.compile(r"^(?:[\w.-]+/)?[\w.-]{1,96}$")
EXTRA = "pip install 'cullama[hub]'"


class HubError(ConfigError):
    """A hub id that cannot be had: the repo is missing, gated or private, the revision is not in it, or it is not
    in the local cache while the hub cannot be reached."""


def is_repo_id(name: str) -> bool:
    """Whether `name` reads as a HuggingFace repo id (huggingface_hub's validate_repo_id, without importing it)."""
    return bool(REPO_ID.fullmatch(name)) and "--" not in name and ".." not in name and \
        not name.endswith(".git") and not any(part[:1] in "-." or part[-1:] in "-." for part in name.split("/"))


def is_hub_id(name) -> bool:
    """Whether `name` names a model on the hub: a str that is no existing path and reads as a repo id."""
    return isinstance(name, str) and not os.path.exists(os.path.expanduser(name)) and is_repo_id(name)


def resolve(name: str | os.PathLike, revision: str | None = None, files: tuple[str, ...] = MODEL_FILES,
            what: str = "model", revision_option: str = "revision") -> Path:
    """The local directory `name` stands for: itself where it is a path (or not a repo id: the caller's errors
    follow), else the hub snapshot of that id at `revision` (None: the default branch), its `files` downloaded where
    they are missing. `what` says in messages what the name is for; `revision_option` names the option that gave
    the revision."""
    if revision is not None and (not isinstance(revision, str) or not revision.strip()):
        raise OptionError(revision_option, f"must be a branch, a tag or a commit id, got {revision!r}")
    if not is_hub_id(name):
        if revision is not None:
            raise OptionError(revision_option, f"is for a HuggingFace hub id, and {shown(str(name), quote=True)} "
                                               "is a local path (a checkout of one revision)")
        return Path(name)
    return _download(name, revision, files, what)


def _download(repo: str, revision: str | None, files: tuple[str, ...], what: str) -> Path:
    try:
        import huggingface_hub
        from huggingface_hub import constants, errors
    except ImportError:
        raise HubError(f"{repo} is not a local directory; read as a HuggingFace hub id, it needs the hub extra "
                       f"({EXTRA})") from None
    at = f"{repo}" + (f" (revision {shown(revision, quote=True)})" if revision is not None else "")
    offline = bool(constants.HF_HUB_OFFLINE)
    try:
        return Path(huggingface_hub.snapshot_download(repo, revision=revision, allow_patterns=list(files),
                                                      ignore_patterns=list(IGNORED)))
    except errors.GatedRepoError:
        raise HubError(f"{repo} is a gated repo on the HuggingFace hub: accept its terms at "
                       f"https://huggingface.co/{repo}, then log in (`hf auth login`, or HF_TOKEN)") from None
    except errors.RepositoryNotFoundError:
        raise HubError(f"{repo} is neither a local directory nor a {what} repo on the HuggingFace hub (or it is "
                       "private: log in with `hf auth login`, or set HF_TOKEN)") from None
    except errors.RevisionNotFoundError:
        raise HubError(f"{repo} has no revision {shown(revision, quote=True)} on the HuggingFace hub (a branch, a "
                       "tag or a commit id)") from None
    except getattr(errors, "IncompleteSnapshotError", ()) as exc:  # huggingface_hub >= 1.x: some files missing
        raise HubError(f"{at}: {str(exc).split(' Re-run')[0].split(' The Hub')[0].split(' Outgoing')[0]} The hub "
                       "cannot be reached now: finish the download where it can") from None
    except errors.LocalEntryNotFoundError:
        cache = constants.HF_HUB_CACHE
        if offline:
            raise HubError(f"{at} is not a local directory, nor in the hub cache {cache}, and HF_HUB_OFFLINE is "
                           "set: download it first (unset HF_HUB_OFFLINE, or `hf download " f"{repo}`)") from None
        raise ResourceError(f"{at} is not a local directory, nor in the hub cache {cache}, and the HuggingFace hub "
                            "cannot be reached: check the network (or download it elsewhere into the cache)") from None
    except errors.HfHubHTTPError as exc:
        raise ResourceError(f"{at}: the HuggingFace hub answered {' '.join(str(exc).split())[:200]}") from None
    except OSError as exc:  # a full disk, a cache folder that cannot be written
        raise ResourceError(f"{at}: cannot write the hub cache ({exc.strerror or exc})") from None
