"""The digest a megamoe manifest carries of its own content, so that an edit or damage that does not update
it is found when the manifest is read, as a damaged data file is.

``manifest_digest`` is ``{"xxh3_128": hex}`` of the manifest's canonical JSON (every field but the digest,
keys sorted, no whitespace; see :func:`digest_of`). Like the data files' checksums it catches damage and
silent hand edits, not tampering: whoever edits on purpose can recompute it, so every field is also
validated on load (:mod:`megamoe.checkpoint.manifest`, :mod:`megamoe.checkpoint.model_manifest`).
The supported way to change a checkpoint's config is ``megamoe-convert edit-config``, which rewrites the
digest (:func:`write_manifest`).

Manifests of format versions 1 and 2 were written before manifests carried a digest: they are read
without one (their fields are validated all the same). From version 3 on a manifest without its digest
is refused.
"""

from __future__ import annotations

import json
import os

from megamoe.checkpoint import checksums
from megamoe.checkpoint.errors import CheckpointError

__all__ = ["DIGEST_FIELD", "FIRST_DIGEST_VERSION", "digest_of", "seal", "check_digest", "manifest_text",
           "write_manifest"]

DIGEST_FIELD = "manifest_digest"
FIRST_DIGEST_VERSION = 3


def digest_of(manifest: dict) -> dict:
    """The digest entry of ``manifest`` (whatever digest it holds is left out)."""
    content = {key: value for key, value in manifest.items() if key != DIGEST_FIELD}
    canonical = json.dumps(content, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    hasher = checksums.new_hasher()
    hasher.update(canonical.encode())
    return {checksums.ALGORITHM: hasher.hexdigest()}


def seal(manifest: dict) -> dict:
    """``manifest`` with its digest (re)computed, in place; returned for convenience."""
    manifest[DIGEST_FIELD] = digest_of(manifest)
    return manifest


def check_digest(manifest_path: str, manifest: dict) -> None:
    """CheckpointError unless ``manifest`` (read from ``manifest_path``) holds its own digest; a manifest of
    a version older than :data:`FIRST_DIGEST_VERSION` may hold none."""
    recorded = manifest.get(DIGEST_FIELD)
    if recorded is None and manifest.get("format_version", FIRST_DIGEST_VERSION) < FIRST_DIGEST_VERSION:
        return
    actual = digest_of(manifest)
    if recorded != actual:
        shown = (f"{checksums.ALGORITHM} {recorded.get(checksums.ALGORITHM)}" if isinstance(recorded, dict)
                 else repr(recorded))
        raise CheckpointError(
            f"{manifest_path} was edited or damaged: its digest ({shown}) does not match its content "
            f"({checksums.ALGORITHM} {actual[checksums.ALGORITHM]}); use `megamoe-convert edit-config` to change a "
            "checkpoint's config")


def manifest_text(manifest: dict) -> str:
    """The text of ``manifest`` as the writers store it, sealed first."""
    return json.dumps(seal(manifest), indent=1, sort_keys=True)


def write_manifest(path: str, manifest: dict) -> None:
    """Write ``manifest`` (sealed) at ``path`` and force it to disk (``path`` is a new file in a directory
    not yet renamed into place: the caller makes the whole directory appear at once)."""
    text = manifest_text(manifest)          # json.dump writes piece by piece: slower
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
