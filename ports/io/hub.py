"""Checkpoints by Hugging Face Hub id: "org/name" resolved to a local snapshot directory through `huggingface_hub`
(its cache, `HF_HUB_OFFLINE`, `local_files_only`, a `revision`), as transformers users expect; a local directory or
file passes through unchanged."""
from __future__ import annotations

import os

# what a checkpoint directory needs: config, weights, tokenizer / processor files, the chat template
CHECKPOINT_FILES = ("*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.tiktoken", "tokenizer*")


def is_repo_id(name: str) -> bool:
    """`org/name` (one slash, no path that exists here): a Hub repo id rather than a local path."""
    parts = str(name).split("/")
    return (len(parts) == 2 and all(parts) and not os.path.exists(name) and not name.startswith((".", "~"))
            and not name.endswith((".gguf", ".safetensors")))


def resolve(name: str, revision: str | None = None, *, local_files_only: bool | None = None,
            cache_dir: str | None = None, allow_patterns=CHECKPOINT_FILES) -> str:
    """The local directory of checkpoint `name`: an existing path as is, or the snapshot of Hub repo `org/name` at
    `revision` (default: main) from the Hub cache (`cache_dir`, default $HF_HUB_CACHE), downloading what is missing
    unless `local_files_only` or $HF_HUB_OFFLINE. Raises ValueError naming the repo and where it looked."""
    if os.path.exists(name) or not is_repo_id(name):
        if revision is not None:
            raise ValueError(f"revision={revision!r} applies to a Hub repo id, and {name!r} is a local path")
        return name
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError, RepositoryNotFoundError

    offline = bool(constants.HF_HUB_OFFLINE) or bool(local_files_only)
    where = cache_dir or constants.HF_HUB_CACHE
    try:
        return snapshot_download(name, revision=revision, cache_dir=cache_dir, local_files_only=offline,
                                 allow_patterns=list(allow_patterns))
    except (LocalEntryNotFoundError, FileNotFoundError) as e:
        how = "networking is off (HF_HUB_OFFLINE / local_files_only)" if offline else "it could not be downloaded"
        raise ValueError(f"no checkpoint {name!r}{'' if revision is None else f' at revision {revision!r}'}: it is "
                         f"not a local path, not in the Hugging Face cache {where}, and {how}") from e
    except (RepositoryNotFoundError, HfHubHTTPError) as e:
        raise ValueError(f"no checkpoint {name!r} on the Hugging Face Hub: {e}") from e


__all__ = ["CHECKPOINT_FILES", "is_repo_id", "resolve"]
