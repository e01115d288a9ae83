"""Where a served model's saved states and sampler weights live, and the ``tinker://`` paths that
name them: ``tinker://<model_id>/weights/<name>`` (``save_state``: the weights and AdamW's state,
layout-free, and the adapter) and ``tinker://<model_id>/sampler_weights/<name>``
(``save_weights_for_sampler``: the adapter as a peft folder, and the merged model), each a folder
under ``<run.output_dir>/tinker/`` with the model's record (``model.json``: its base model and LoRA
settings), so a server restarted on the same folder resolves every path it handed out. A path is the API key's
that saved it (a hash of the key in the record): another key can neither load, sample nor list it."""

from __future__ import annotations

import hashlib
import json
import re
import shutil
from pathlib import Path

from rltrain.serve.wire import BadRequest

KINDS = {
    "weights": "a saved state (save_state)",
    "sampler_weights": "sampler weights (save_weights_for_sampler)",
}
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
RECORD = "model.json"


def checkpoint_name(name: str) -> None:
    """A checkpoint's name is a plain file name; anything else raises :class:`BadRequest`."""
    if not NAME.fullmatch(name or ""):
        raise BadRequest(f"checkpoint name {name!r}: letters, digits, '.', '_' and '-' (128 at most)")


def key_owner(api_key: str) -> str:
    """What a record keeps of the API key that saved it (never the key itself)."""
    return hashlib.sha256(api_key.encode()).hexdigest()[:16]


class Checkpoints:
    def __init__(self, output_dir: Path):
        self.root = output_dir / "tinker"

    def new(
        self, model_id: str, kind: str, name: str, record: dict, overwrite: bool = True
    ) -> tuple[Path, str]:
        """An empty folder for ``name`` of ``kind`` and its ``tinker://`` path, the model's record
        written in it; a name that is no plain file name, or one taken without ``overwrite``, raises
        :class:`BadRequest`."""
        checkpoint_name(name)
        folder = self.root / model_id / kind / name
        if folder.exists():
            if not overwrite:
                raise BadRequest(f"tinker://{model_id}/{kind}/{name} exists (save with overwrite=True)")
            shutil.rmtree(folder)
        folder.mkdir(parents=True)
        (folder / RECORD).write_text(json.dumps(record, indent=2))
        return folder, f"tinker://{model_id}/{kind}/{name}"

    def resolve(self, path: str, kind: str, owner: str) -> tuple[Path, dict]:
        """The folder of a ``tinker://`` path of ``kind`` and its model's record; a path of another
        form or kind, one that names nothing saved here, or one another key (``owner``:
        :func:`key_owner`) saved, raises :class:`BadRequest`."""
        parts = path.removeprefix("tinker://").split("/") if path.startswith("tinker://") else []
        if len(parts) != 3 or parts[1] not in KINDS or not NAME.fullmatch(parts[2]) or "/" in parts[0]:
            raise BadRequest(f"{path!r} is no tinker://<model_id>/weights|sampler_weights/<name> path")
        if parts[1] != kind:
            raise BadRequest(f"{path!r} names {KINDS[parts[1]]}; this call takes {KINDS[kind]}")
        folder = self.root / parts[0] / parts[1] / parts[2]
        if parts[0] in ("", ".", "..") or not (folder / RECORD).is_file():
            raise BadRequest(f"{path!r}: nothing was saved there on this server (its folder: {self.root})")
        record = json.loads((folder / RECORD).read_text())
        if record.get("owner", owner) != owner:
            raise BadRequest(f"{path!r} belongs to another API key")
        return folder, record

    def listed(self, model_id: str, owner: str) -> list[dict]:
        """Every checkpoint of ``model_id`` that ``owner`` saved, as the SDK's ``Checkpoint``
        entries; a model whose checkpoints another key saved raises :class:`BadRequest`."""
        if "/" in model_id or model_id in ("", ".", ".."):
            raise BadRequest(f"no model {model_id!r}")
        out, others = [], 0
        for kind, type_ in (("weights", "training"), ("sampler_weights", "sampler")):
            for folder in sorted((self.root / model_id / kind).glob("*")):
                if (folder / RECORD).is_file():
                    if json.loads((folder / RECORD).read_text()).get("owner", owner) != owner:
                        others += 1
                        continue
                    stamp = folder.stat().st_mtime
                    out.append({"checkpoint_id": f"{kind}/{folder.name}", "checkpoint_type": type_,
                                "time": _iso(stamp), "tinker_path": f"tinker://{model_id}/{kind}/{folder.name}",
                                "size_bytes": sum(f.stat().st_size for f in folder.rglob("*") if f.is_file()),
                                "public": False})  # fmt: skip
        if others and not out:
            raise BadRequest(f"the checkpoints of model {model_id!r} belong to another API key")
        return out


def _iso(stamp: float) -> str:
    from datetime import datetime, timezone

    return datetime.fromtimestamp(stamp, tz=timezone.utc).isoformat()
