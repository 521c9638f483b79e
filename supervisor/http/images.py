"""Images in requests, for every API: found in the body, fetched, decoded and checked here.

Why one module: four dialects carry images four ways (OpenAI chat's `image_url`
parts, Responses' `input_image`, Anthropic's `image` blocks, Ollama's `images`),
and every one of them must meet the same caps with the same clear 400 naming the
field. The dialect modules only point at their parts (`Found`); this module turns
them into the wire's `ImageInput`s, and before the request is sent
(`prepare`, from http/job.py) checks that the model reads images at all
(`model_lacks_vision`), fetches `http(s)` URLs when the operator allows it
(http/image_fetch.py), and decodes each image with Pillow off the loop: a file
that is not an image, a format the processors do not read, or more bytes or
pixels than `[supervisor]` allows is refused here, never in a worker. The
supervisor never runs a processor or a vision tower: the worker does
(worker/vision.py).

Each checked image carries the sha256 of its bytes: the worker's prompt cache
keys the image's tokens on it, never on a URL.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import threading
from collections.abc import Callable, Sequence
from typing import Any, Union

import msgspec

from shared import protocol as p
from shared.sizes import format_size
from shared.vocab import FailureCode
from supervisor.config import SupervisorConfig
from supervisor.doors.api import Supervisor
from supervisor.doors.refusals import ServeError
from supervisor.http.content import Part, part_text
from supervisor.http.errors import ApiError, from_serve_error
from supervisor.http.openai_types import BodyError
from supervisor.wiring.offloop import OffLoopTimeout, off_loop

# What transformers' image processors read (through Pillow, converted to RGB); an animated GIF
# or WebP gives its first frame.
FORMATS = ("PNG", "JPEG", "WEBP", "GIF")
DECODE_SECONDS = 30.0  # a decode within the pixel cap takes well under a second
DECODES_AT_ONCE = 2    # images decoded at the same time: each holds up to max_image_pixels x 4 bytes
_decoding = threading.BoundedSemaphore(DECODES_AT_ONCE)  # taken on the decoding thread, never on the loop

INVALID_IMAGE: FailureCode = "invalid_image"
LACKS_VISION: FailureCode = "model_lacks_vision"


def invalid(message: str, param: str) -> ApiError:
    return ApiError(400, message, code=INVALID_IMAGE, param=param)


# ---------------------------------------------------------------------------
# the dialects' images, in order


PartImage = Callable[[Any, str], Union[p.ImageInput, None]]  # a dialect's image part, or None for another part


class Found:
    """The images of one request, as the dialect meets them; `images` goes in its Generate."""

    def __init__(self) -> None:
        self.images: list[p.ImageInput] = []

    def part(self, image: p.ImageInput) -> p.MessagePart:
        self.images.append(image)
        return p.MessagePart(image=len(self.images) - 1)

    def content(self, content: Union[str, Sequence[Part], None], where: str, kinds: Sequence[str],
                image_of: PartImage, noun: str = "parts") -> tuple[str, list[p.MessagePart] | None]:
        """A message's content: its text joined, and its parts in order when an image is among them."""
        if content is None or isinstance(content, str):
            return content or "", None
        parts: list[p.MessagePart] = []
        for j, item in enumerate(content):
            image = image_of(item, f"{where}[{j}]")
            parts.append(self.part(image) if image is not None else
                         p.MessagePart(text=part_text(item, f"{where}[{j}]", kinds, noun)))
        text = "".join(part.text or "" for part in parts)
        return text, parts if any(part.image is not None for part in parts) else None

    def leading(self, encoded: Sequence[Any] | None, where: str, text: str) -> list[p.MessagePart] | None:
        """Ollama's `images` (base64 strings) of a turn: before its text, as Ollama's templates place them."""
        if not encoded:
            return None
        parts = [self.part(from_base64(item, f"{where}[{j}]")) for j, item in enumerate(encoded)]
        return [*parts, p.MessagePart(text=text)] if text else parts


def openai_image(part: Any, where: str) -> p.ImageInput | None:
    """Chat completions: `{"type": "image_url", "image_url": {"url": ..., "detail": ...}}`."""
    if part.type != "image_url":
        return None
    spec = part.image_url
    if not isinstance(spec, dict) or not isinstance(spec.get("url"), str):
        raise BodyError(f"{where}.image_url.url: required (a data: URL or an http(s) URL)",
                        param=f"{where}.image_url.url")
    return from_url(spec["url"], f"{where}.image_url.url")


def responses_image(part: Any, where: str) -> p.ImageInput | None:
    """Responses: `{"type": "input_image", "image_url": ..., "file_id": ..., "detail": ...}`."""
    if part.type != "input_image":
        return None
    if part.file_id is not None:
        raise invalid(f"{where}.file_id: this server has no files API; send the image as image_url "
                      "(a data: URL)", f"{where}.file_id")
    if not isinstance(part.image_url, str):
        raise BodyError(f"{where}.image_url: required (a data: URL or an http(s) URL)", param=f"{where}.image_url")
    return from_url(part.image_url, f"{where}.image_url")


def anthropic_image(block: Any, where: str) -> p.ImageInput | None:
    """Messages: `{"type": "image", "source": {"type": "base64", "media_type", "data"} | {"type": "url", "url"}}`."""
    if block.type != "image":
        return None
    source = block.source
    kind = source.get("type") if isinstance(source, dict) else None
    if kind == "base64" and isinstance(source.get("data"), str):
        return from_base64(source["data"], f"{where}.source.data")
    if kind == "url" and isinstance(source.get("url"), str):
        return from_url(source["url"], f"{where}.source.url")
    raise BodyError(f"{where}.source: an image source is {{\"type\": \"base64\", \"media_type\", \"data\"}} "
                    f"or {{\"type\": \"url\", \"url\"}} (got type {kind!r})", param=f"{where}.source")


def from_url(url: str, param: str) -> p.ImageInput:
    """A data: URL (decoded now) or an http(s) URL (fetched by `prepare`, when allowed)."""
    if url.startswith("data:"):
        header, comma, data = url.partition(",")
        if not comma or not header.endswith(";base64"):
            raise invalid(f"{param}: a data URL must be base64 (data:image/png;base64,...)", param)
        return from_base64(data, param)
    scheme = url.split(":", 1)[0].lower()
    if scheme not in ("http", "https"):
        raise invalid(f"{param}: an image URL is a data: URL or an http(s) URL (got {scheme!r})", param)
    return p.ImageInput(url=url, param=param)


def from_base64(data: Any, param: str) -> p.ImageInput:
    if not isinstance(data, str):
        raise invalid(f"{param}: an image is a base64 string", param)
    if data.startswith("data:"):  # Ollama's clients send raw base64, some a data URL
        return from_url(data, param)
    try:
        raw = base64.b64decode(data.encode("ascii", "strict"), validate=True)
    except (binascii.Error, UnicodeEncodeError, ValueError):
        raise invalid(f"{param}: not valid base64", param) from None
    return p.ImageInput(data=raw, param=param)


# ---------------------------------------------------------------------------
# before the request is sent


DATA_URL_HEAD = 64  # "data:image/png;base64," and the JSON around an image, counted with the image


def body_limit(config: SupervisorConfig) -> int:
    """The largest body a route that takes images reads: `max_body` plus every image's base64."""
    return int(config.max_body) + config.max_images * (_base64_size(int(config.max_image_bytes)) + DATA_URL_HEAD)


def within_body(body_bytes: int, gen: p.Generate, config: SupervisorConfig) -> None:
    """A route that takes images reads up to `body_limit`; what is not an image still has `max_body`
    (a 413 as any body over it, once the body shows how much of it its images are)."""
    images = sum(_base64_size(len(image.data)) + len(image.url) + DATA_URL_HEAD for image in gen.images)
    limit = int(config.max_body)
    if body_bytes - images > limit:
        raise ApiError(413, f"request body exceeds the limit of {format_size(limit)} ([supervisor] max_body; "
                            "its images aside)", code="request_too_large")


def _base64_size(raw: int) -> int:
    return 4 * -(-raw // 3)


async def prepare(sup: Supervisor, model_id: str, gen: p.Generate) -> p.Generate:
    """`gen` with every image fetched and checked, ready for the worker; `gen` itself without images.

    The 400s, in the order a client meets them: the model reads no images
    (`model_lacks_vision`), images are off or too many, then per image (in
    order): a URL that may not or cannot be fetched, too many bytes, not an
    image, a format the processors do not read, too many pixels, a file that
    does not decode (`invalid_image`, each naming its field)."""
    if not gen.images:
        return gen
    config = sup.config.supervisor
    first = gen.images[0].param
    await _require_vision(sup, model_id, first)
    if config.max_images == 0:
        raise invalid(f"{first}: images are off on this server ([supervisor] max_images = 0)", first)
    if len(gen.images) > config.max_images:
        extra = gen.images[config.max_images].param
        raise invalid(f"{extra}: at most {config.max_images} images a request ([supervisor] max_images); "
                      f"this one has {len(gen.images)}", extra)
    checked = [await _checked(image, config) for image in gen.images]
    return msgspec.structs.replace(gen, images=checked)


async def _require_vision(sup: Supervisor, model_id: str, param: str) -> None:
    from supervisor.http.modelfacts import facts_of

    try:
        path = sup.model_config(model_id).path
    except ServeError as exc:
        raise from_serve_error(exc) from None
    if not (await facts_of([path]))[path].vision:
        raise ApiError(400, f"{param}: model {model_id!r} reads only text; send images to a vision model "
                            "(one whose /v1/models card lists the \"vision\" capability)",
                       code=LACKS_VISION, param=param)


async def _checked(image: p.ImageInput, config: SupervisorConfig) -> p.ImageInput:
    if image.url:
        if not config.fetch_image_urls:
            raise invalid(f"{image.param}: http(s) image URLs are not fetched on this server "
                          "([supervisor] fetch_image_urls = false); send the image as a data: URL or base64",
                          image.param)
        from supervisor.http.image_fetch import FetchError, fetch

        try:
            data = await fetch(image.url, int(config.max_image_bytes), config.image_fetch_timeout)
        except FetchError as exc:
            raise invalid(f"{image.param}: {exc}", image.param) from None
        image = p.ImageInput(data=data, param=image.param)
    def decode() -> p.ImageInput:
        with _decoding:
            return check(image, config)

    try:
        return await off_loop(decode, DECODE_SECONDS, "checking an image")
    except OffLoopTimeout:
        raise invalid(f"{image.param}: the image took too long to decode", image.param) from None


def check(image: p.ImageInput, config: SupervisorConfig) -> p.ImageInput:
    """One image decoded and measured (blocking: run it off the loop); ApiError 400 naming its field."""
    from PIL import Image, UnidentifiedImageError

    param, data = image.param, image.data
    limit = int(config.max_image_bytes)
    if len(data) > limit:
        raise invalid(f"{param}: the image is {format_size(len(data))}, over the {format_size(limit)} an image "
                      "may have ([supervisor] max_image_bytes)", param)
    try:
        with Image.open(io.BytesIO(data), formats=FORMATS) as im:
            width, height = im.size
            if width * height > config.max_image_pixels:
                raise invalid(f"{param}: the image is {width}x{height} pixels, over the {config.max_image_pixels} "
                              "an image may have ([supervisor] max_image_pixels)", param)
            fmt = str(im.format)
            im.load()  # the whole decode (the first frame of an animation): proves the file is whole
    except UnidentifiedImageError:
        raise invalid(f"{param}: {_not_readable(data)}", param) from None
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as exc:
        raise invalid(f"{param}: the {_sniff(data) or 'image'} file could not be decoded ({exc})", param) from None
    return p.ImageInput(data=data, digest=hashlib.sha256(data).hexdigest(), width=width, height=height,
                        format=fmt, param=param)


def _not_readable(data: bytes) -> str:
    """Why Pillow could not open it with the formats we read: another format, or no image at all."""
    other = _sniff(data)
    if other is None:
        return "not an image (expected PNG, JPEG, WebP or GIF)"
    return f"unsupported image format {other} (send PNG, JPEG, WebP or GIF)"


def _sniff(data: bytes) -> str | None:
    """The image format `data` says it is, from Pillow's header readers alone (no decode)."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(data)) as im:
            return str(im.format)
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError, Image.DecompressionBombError):
        return None
