"""Images for the tests: encoded files, data URLs, and the wire's ImageInput as the front door makes it."""

from __future__ import annotations

import base64
import hashlib
import io

import numpy as np

from shared import protocol as p


def image_bytes(width: int = 96, height: int = 64, fmt: str = "PNG", seed: int = 0, flat: bool = False) -> bytes:
    """A noise image of this size (`flat`: one colour, a few bytes as PNG), encoded (PNG, JPEG, WEBP, GIF,
    BMP, TIFF ...)."""
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 255, (height, width, 3), dtype=np.uint8)
    if flat:
        pixels[:] = pixels[0, 0]
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, fmt)
    return out.getvalue()


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode()


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def checked(data: bytes) -> p.ImageInput:
    """The ImageInput the front door sends for `data` (its digest filled)."""
    from PIL import Image

    with Image.open(io.BytesIO(data)) as im:
        width, height, fmt = im.width, im.height, str(im.format)
    return p.ImageInput(data=data, digest=hashlib.sha256(data).hexdigest(), width=width, height=height, format=fmt)


def image_turn(text: str, images: int = 1, first: int = 0) -> p.ChatMessage:
    """A user turn: `images` images (indices from `first`), then the text."""
    parts = [p.MessagePart(image=first + i) for i in range(images)] + [p.MessagePart(text=text)]
    return p.ChatMessage(role="user", content=text, parts=parts)
