"""Images as rows, tools and gateway requests carry them: read, checked and kept as their encoded
bytes (no ray, no deepspeed). A problem raises :class:`ImageError` with one line saying where the
image came from and what is wrong (a missing file, bytes no image decoder reads, too many pixels).

Accepted forms, one image or a list of them: a file path (relative to ``base``, the data's folder),
a ``data:image/...;base64,`` URL or bare base64 text, raw bytes, a ``{"bytes": ..., "path": ...}``
mapping (a Hugging Face ``datasets`` Image column undecoded) or a PIL image (decoded). Remote
``http(s)://`` URLs are refused: nothing is fetched at training time.
"""

from __future__ import annotations

import base64
import binascii
import io
import re
from pathlib import Path
from typing import Any

DATA_URL = re.compile(r"data:image/[\w.+-]+;base64,(?P<payload>.*)", re.DOTALL)
BASE64 = re.compile(r"[A-Za-z0-9+/=\s]+")


class ImageError(ValueError):
    """An image that cannot be used; its message is one line naming where it came from."""


def image_bytes(value: Any, where: str, max_pixels: int, base: Path | None = None) -> bytes:
    """``value``'s encoded image, checked to decode with at most ``max_pixels`` pixels."""
    from PIL import Image

    if isinstance(value, Image.Image):
        buffer = io.BytesIO()
        value.save(buffer, format="PNG")
        data = buffer.getvalue()
    else:
        data = raw_bytes(value, where, base)
    try:
        with Image.open(io.BytesIO(data)) as image:
            width, height = image.size
            if width * height > max_pixels:
                raise ImageError(
                    f"{where}: the image is {width}x{height} ({width * height:,} pixels), over "
                    f"data.max_image_pixels={max_pixels:,}"
                )
            image.load()  # every byte decoded: a truncated file fails here, not in the engine
    except ImageError:
        raise
    except Exception as e:
        raise ImageError(f"{where}: cannot be decoded as an image ({type(e).__name__}: {e})") from None
    return data


def images_of(value: Any, where: str, max_pixels: int, base: Path | None = None) -> list[bytes]:
    """Each image of ``value`` (one or a list; None or an empty list: none), checked."""
    if value is None:
        return []
    values = value if isinstance(value, list | tuple) else [value]
    many = len(values) > 1
    return [
        image_bytes(v, f"{where}, image {i}" if many else where, max_pixels, base)
        for i, v in enumerate(values)
    ]


def decoded(data: bytes):
    """The PIL image of bytes :func:`image_bytes` returned, in RGB (what processors take)."""
    from PIL import Image

    with Image.open(io.BytesIO(data)) as image:
        return image.convert("RGB")


def raw_bytes(value: Any, where: str, base: Path | None = None) -> bytes:
    """``value``'s encoded image bytes as given, not decoded (:func:`image_bytes` checks them)."""
    if isinstance(value, bytes | bytearray):
        return bytes(value)
    if isinstance(value, dict):  # a datasets Image column's {"bytes", "path"}
        if value.get("bytes"):
            return bytes(value["bytes"])
        if value.get("path"):
            return _file(value["path"], where, base)
        raise ImageError(f"{where}: an image mapping needs 'bytes' or 'path', got keys {sorted(value)}")
    if not isinstance(value, str):
        raise ImageError(
            f"{where}: expected a path, base64 text, a data URL or bytes for an image, got {type(value).__name__}"
        )
    text = value.strip()
    if text.startswith(("http://", "https://")):
        raise ImageError(
            f"{where}: remote image URLs are not fetched ({text[:60]}); give a data URL or a file"
        )
    if match := DATA_URL.fullmatch(text):
        return _base64(match["payload"], where)
    if text.startswith("data:"):
        raise ImageError(f"{where}: a data URL for an image reads data:image/<format>;base64,<payload>")
    file = _path(text, base)
    if not file.is_file() and BASE64.fullmatch(text) and len("".join(text.split())) % 4 == 0:
        return _base64(text, where)  # bare base64 (a path has a '.' or names a file)
    return _file(text, where, base)


def _path(path: str, base: Path | None) -> Path:
    file = Path(path).expanduser()
    return base / file if not file.is_absolute() and base is not None else file


def _file(path: str, where: str, base: Path | None) -> bytes:
    file = _path(path, base)
    if not file.is_file():
        raise ImageError(f"{where}: image file {str(file)!r} does not exist")
    return file.read_bytes()


def _base64(payload: str, where: str) -> bytes:
    try:
        return base64.b64decode("".join(payload.split()), validate=True)
    except (binascii.Error, ValueError) as e:
        raise ImageError(f"{where}: the image's base64 does not decode ({e})") from None


def described(messages: list[dict]) -> list[dict]:
    """``messages`` as rollouts on disk and checkpoints keep them (JSON): each image part's bytes
    replaced by a line saying which image it was (its size, format and a digest)."""
    import hashlib

    def part(p: dict) -> dict:
        if p.get("type") != "image" or not isinstance(p.get("image"), bytes | bytearray):
            return p
        from PIL import Image

        with Image.open(io.BytesIO(p["image"])) as image:
            size = f"{image.width}x{image.height} {image.format}"
        return {"type": "image", "image": f"<image {size}, sha1 {hashlib.sha1(p['image']).hexdigest()[:12]}>"}

    return [{**m, "content": [part(p) for p in m["content"]]} if isinstance(m.get("content"), list) else m
            for m in messages]  # fmt: skip


IMAGE_PART_TYPES = ("image", "image_url")


def checked_message(message: dict, where: str, max_pixels: int) -> dict:
    """An environment's or a tool's ``message`` with each image part, ``{"type": "image", "image":
    ...}`` in any form :func:`image_bytes` takes or OpenAI's ``{"type": "image_url", "image_url":
    {"url": <data URL>}}``, as ``{"type": "image", "image": <bytes>}``, checked (an
    :class:`ImageError` names the part); a message without images as it is."""
    content = message.get("content")
    if not (isinstance(content, list) and any(_is_image_part(p) for p in content)):
        return message
    parts = []
    for p, part in enumerate(content):
        if _is_image_part(part):
            value = part.get("image") if part["type"] == "image" else part.get("image_url")
            value = value.get("url") if isinstance(value, dict) and "url" in value else value
            part = {"type": "image", "image": image_bytes(value, f"{where}, content part {p}", max_pixels)}
        parts.append(part)
    return {**message, "content": parts}


def _is_image_part(part: Any) -> bool:
    return isinstance(part, dict) and part.get("type") in IMAGE_PART_TYPES


def as_content(value: Any) -> Any:
    """A tool's return value as a message's content: a list of content parts (text and images) as
    it is, a PIL image as one image part; anything else as its text."""
    import sys

    pil = sys.modules.get("PIL.Image")  # (a tool that made a PIL image imported it)
    if pil is not None and isinstance(value, pil.Image):
        return [{"type": "image", "image": value}]
    if isinstance(value, list) and value and all(isinstance(p, dict) and "type" in p for p in value):
        return value
    return str(value)
