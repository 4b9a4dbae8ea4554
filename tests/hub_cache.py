"""A HuggingFace hub cache laid out in a temporary folder as huggingface_hub lays it, for the hub-id tests (no network):

    <cache>/models--<org>--<name>/blobs/<sha256>             the bytes
    <cache>/models--<org>--<name>/snapshots/<commit>/<path>  relative symbolic links to the blobs
    <cache>/models--<org>--<name>/refs/<branch or tag>       the commit id (no newline)

huggingface_hub's own snapshot_download finds a snapshot there offline, by branch, tag or commit id."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

REPO = "karpathy/stories260K"
MAIN = "0123456789abcdef0123456789abcdef01234567"  # 40 hex digits: a commit id
OLD = "89abcdef0123456789abcdef0123456789abcdef"  # an older commit, tagged v0


def add_snapshot(cache: Path, repo_id: str, files: dict[str, bytes], commit: str, refs: tuple[str, ...]) -> Path:
    """One commit of `repo_id` in the cache at `cache`, its `refs` (branches, tags) pointing at it; its folder."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    (repo / "refs").mkdir(exist_ok=True)
    snapshot = repo / "snapshots" / commit
    for rel, data in files.items():
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        link = snapshot / rel
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    for ref in refs:
        (repo / "refs" / ref).write_text(commit)
    return snapshot


def stories_cache(cache: Path, stories_dir: Path) -> dict[str, Path]:
    """karpathy/stories260K twice: `main` (the model as it is, with a Meta-style original/ folder beside it) and the
    tag `v0` (an older commit whose context is 64 tokens); {"main": its snapshot, "v0": its snapshot}."""
    files = {p.name: p.read_bytes() for p in stories_dir.iterdir() if p.is_file()}
    main = add_snapshot(cache, REPO, {**files, "original/consolidated.00.pth": b"never read"}, MAIN, ("main",))
    config = files["config.json"].decode().replace('"max_position_embeddings": 512', '"max_position_embeddings": 64')
    assert config != files["config.json"].decode(), "stories260K's config.json changed: update the fixture"
    old = add_snapshot(cache, REPO, {**files, "config.json": config.encode()}, OLD, ("v0",))
    return {"main": main, "v0": old}
