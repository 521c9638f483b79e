"""The vision engine: a vision-language model's requests under the same guard as text.

A VLM is two halves: a vision tower that turns an image's tiles into embeddings
(mlx-vlm's model and processor), and a text decoder that reads them among the
prompt's token embeddings. Only the first half is new here. The text half is
rebuilt as the mlx-lm model of its family, sharing the very arrays mlx-vlm
loaded (no second copy), so everything the text engine does holds for image
requests unchanged: the prefill line, chunks sized and checked by G1-G3, the
decode batch (an image request decodes beside text ones, a row like any other),
the prompt cache and its disk tier, aborts, reclaims and samples.

An image request differs in three places, each a hook of a few lines in the
text engine's rooms:

* **submit** (`VisionEngine.submit_generate`): the chat template marks each
  image; mlx-vlm's processor expands the marks into the image's tokens and its
  tiles into pixels. The request's `Media` holds them.
* **the vision turn** (`VisionPrefill.run`, from worker/prefill.py): before the
  first chunk that needs them, the tower runs once, on its own turn (decode
  steps of other requests go between it and the chunks), and gives the prompt's
  input embeddings; chunks then read their slice of them. G1 has counted the
  tower's peak (`extra_bytes`; worker/vision_cost.py) and G3 checks after it.
* **the prompt cache's key**: the prompt's image tokens are all one token id,
  so the key puts in their place a number derived from the images' content
  hashes (sha256 of the bytes, chained image by image): a later turn that
  repeats the same images reuses the cached prefix, skipping the tower too,
  and another image never matches. The key never holds a URL.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import io
import logging
import time
from pathlib import Path
from typing import Any, NamedTuple, cast

import mlx.core as mx
from mlx_lm.generate import generation_stream

from shared.modelinfo import context_length, read_config_json
from shared.protocol import Failed, Generate, ImageInput
from shared.weights import WeightsError, estimate_weight_bytes
from worker import own_memory, prompts, vision_cost
from worker.engine import Engine
from worker.folder_load import NO_TOKENIZER_LIMIT
from worker.loader import LoadMeter
from worker.prefill_cost import activation_width
from worker.request import ENGINE_ERROR, INVALID_REQUEST, EngineError, Seq
from worker.sampling import Settings

log = logging.getLogger("memvisor.worker.vision")

TEXT_FAMILIES = {"smolvlm": "llama", "idefics3": "llama"}  # the mlx-lm model of each family's text half
KEY_BITS = 62  # a key value is -(1 + h), h < 2**62: negative, so never a token id, and within int64


class Media:
    """An image request's inputs to its prefill, from submit until its last image token has run."""

    __slots__ = ("embed_bytes", "embeds", "ids", "images_end", "key", "mask", "pixels", "tiles")

    def __init__(self, ids: list[int], key: list[int], pixels: mx.array, mask: mx.array | None,
                 images_end: int, embed_bytes: int) -> None:
        self.ids = ids            # the prompt as the model reads it (image tokens the image token)
        self.key = key            # ... as the prompt cache keys it (image tokens their images' hash)
        self.pixels: mx.array | None = pixels  # the tiles, (1, tiles, channels, height, width)
        self.mask = mask
        self.tiles = int(pixels.shape[1])
        self.images_end = images_end  # the position after the last image token
        self.embeds: mx.array | None = None  # the prompt's input embeddings, once the tower ran
        self.embed_bytes = embed_bytes

    def pending(self, pos: int) -> bool:
        """Whether the tower must run before the chunk at `pos` (a cache hit past the images skips it,
        and its tiles go at once)."""
        if pos >= self.images_end:
            self.pixels = self.mask = None
        return self.embeds is None and pos < self.images_end

    def inputs(self, pos: int, n: int) -> dict[str, Any]:
        """The model's keyword arguments for the chunk of `n` tokens at `pos`: their embeddings up to
        the last image token, plain token ids after it (the embeddings then go)."""
        if pos >= self.images_end:
            self.embeds = self.pixels = None
            return {}
        assert self.embeds is not None, "the vision turn runs before the first chunk with image tokens"
        return {"input_embeddings": self.embeds[:, pos:pos + n]}


class VisionPrefill:
    """The vision turn and what G1 counts for it; the text engine's Prefill calls these."""

    def __init__(self, vlm: Any, config: dict[str, Any], width: int) -> None:
        self.vlm = vlm
        self.width = width  # bytes per activation (the embeddings' dtype)
        self.cost = vision_cost.prior(config, width)
        self.runs = 0

    def extra_bytes(self, seq: Seq, reused: int, lm_peak: int) -> int:
        """What an image request's prefill needs beyond its text estimate `lm_peak` (G1): its input
        embeddings, held through the chunks up to the last image, and the tower's peak where that is
        higher than the text's (they do not overlap: the tower's buffers are freed before the chunks)."""
        media = seq.media
        if media is None or not media.pending(reused):
            return 0
        return media.embed_bytes + max(0, vision_cost.peak(self.cost, media.tiles, media.embed_bytes) - lm_peak)

    def run(self, seq: Seq) -> None:
        """The tower over the request's tiles and the prompt's input embeddings (one turn; G3 follows
        in the caller); measured, so the next estimate follows what this one cost."""
        media = seq.media
        assert media is not None and media.pixels is not None
        own_memory.reset_peak()
        before = mx.get_active_memory()
        started = time.monotonic()
        with mx.stream(generation_stream):
            embeds = self.vlm.get_input_embeddings(mx.array(media.ids)[None], media.pixels,
                                                   pixel_attention_mask=media.mask).inputs_embeds
            mx.eval(embeds)
        grown = mx.get_peak_memory() - before
        media.embeds, media.pixels, media.mask = embeds, None, None
        self.cost = vision_cost.learn(self.cost, grown - media.embed_bytes, media.tiles)
        self.runs += 1
        log.debug("request %s: vision tower over %d tiles in %.2f s, peak %d bytes", seq.id, media.tiles,
                  time.monotonic() - started, grown)
        mx.clear_cache()


class VisionEngine(Engine):
    """The chat engine with images in (see module doc)."""

    vision: VisionPrefill
    processor: Any

    @classmethod
    def load(cls, path: str | Path, *, meter: LoadMeter | None = None, **kwargs) -> "VisionEngine":
        """A local VLM folder through mlx-vlm (never a download); its text half as mlx-lm's model.
        mlx-vlm reads the weights, the processor and the tokenizer in one call: one `read` phase (W3)."""
        with meter.phase("read") if meter is not None else contextlib.nullcontext():
            parts = load_parts(path)
        with meter.phase("build") if meter is not None else contextlib.nullcontext():
            return cls.build(parts, **kwargs)

    @classmethod
    def build(cls, parts: "Parts", **kwargs) -> "VisionEngine":
        """An engine on loaded parts (tests build several on one load)."""
        engine = cls(parts.text, parts.tokenizer, weight_bytes=parts.weight_bytes, **kwargs)
        engine.context_length = parts.context_length
        engine.processor = parts.processor
        engine.vision = VisionPrefill(parts.vlm, parts.config, activation_width(parts.text))
        engine.prefill.vision = engine.vision
        return engine

    def submit_generate(self, cmd: Generate) -> None:
        """A request without images goes as any; one with images through the processor first."""
        if not cmd.images:
            super().submit_generate(cmd)
            return
        try:
            media = self.media(cmd)
            self.submit(cmd.request_id, media.ids, cmd.max_tokens, stop=cmd.stop, constraint=cmd.constraint,
                        sampling=Settings.of(cmd), partition=cmd.partition, media=media)
        except EngineError as exc:
            self._outbox.append(Failed(request_id=cmd.request_id, code=exc.code, message=exc.message))
        except Exception as exc:  # noqa: BLE001 - as the text engine: this request fails, the worker lives
            log.exception("request %s could not be prepared", cmd.request_id)
            self._outbox.append(Failed(request_id=cmd.request_id, code=ENGINE_ERROR,
                                       message=f"the request could not be prepared: {exc!r}"))

    def media(self, cmd: Generate) -> Media:
        """The request's prompt ids, cache key and tiles, through the template and mlx-vlm's processor."""
        from mlx_vlm.utils import prepare_inputs

        if cmd.messages is None or cmd.prompt is not None:
            raise EngineError(INVALID_REQUEST, "images come with chat messages, not a raw prompt")
        pictures = [_picture(image, i) for i, image in enumerate(cmd.images)]
        text = prompts.render_chat(self.tokenizer, cmd.messages, cmd.tools)
        image_token = int(self.vision.vlm.config.image_token_index)
        try:
            inputs = prepare_inputs(self.processor, images=pictures, prompts=[text], image_token_index=image_token)
        except ValueError as exc:  # the processor's own checks (image marks against images, sizes)
            raise EngineError(INVALID_REQUEST, f"the images could not be prepared: {exc}") from None
        ids = [int(t) for t in inputs["input_ids"][0].tolist()]
        positions = [i for i, t in enumerate(ids) if t == image_token]
        if not positions:
            raise EngineError(INVALID_REQUEST, "the chat template placed no image in the prompt")
        counts = _tokens_per_image(self.processor, pictures)
        hidden = int(self.vision.vlm.config.text_config.hidden_size)
        return Media(ids, cache_key(ids, positions, [image.digest for image in cmd.images], counts),
                     inputs["pixel_values"], inputs.get("pixel_attention_mask"), positions[-1] + 1,
                     embed_bytes=len(ids) * hidden * self.vision.width)


class Parts(NamedTuple):
    """A VLM folder as loaded: mlx-vlm's model and processor, its text half as mlx-lm's, the tokenizer."""

    vlm: Any
    processor: Any
    text: Any
    tokenizer: Any
    config: dict[str, Any]
    weight_bytes: int
    context_length: int | None


def load_parts(path: str | Path) -> Parts:
    directory = Path(path)
    config = read_config_json(directory)
    if config is None:
        raise EngineError("load_failed", f"no model at {directory}: config.json not found or unreadable")
    try:
        import mlx_vlm
    except ImportError:
        raise EngineError("load_failed", "this is a vision model and mlx-vlm is not installed: "
                                         "pip install 'memvisor[vision]'") from None
    try:
        weight_bytes = estimate_weight_bytes(directory)
        vlm, processor = mlx_vlm.load(str(directory))
        text = text_model(vlm, config)
        tokenizer = _tokenizer(directory, config)
        # the engine bounds prompts by the context (config.json); the tokenizers' own limit only warns
        tokenizer.model_max_length = processor.tokenizer.model_max_length = NO_TOKENIZER_LIMIT
    except WeightsError as exc:
        raise EngineError("load_failed", str(exc)) from None
    except Exception as exc:  # noqa: BLE001 - any loader failure is a load error
        raise EngineError("load_failed", f"cannot load {directory}: {exc}") from exc
    return Parts(vlm, processor, text, tokenizer, config, weight_bytes, context_length(directory))


def text_model(vlm: Any, config: dict[str, Any]) -> Any:
    """mlx-lm's model of the VLM's text family, holding the arrays mlx-vlm loaded (shared, not copied).

    mlx-vlm's language model names its parameters as mlx-lm's inner model does
    (`embed_tokens`, `layers.N...`, `norm`) with the head beside them (`lm_head`);
    `load_weights(strict=True)` proves that every one found its place."""
    from mlx.utils import tree_flatten
    from mlx_lm.utils import _get_classes

    # mlx-vlm's parsed values (its family's defaults, e.g. SmolVLM's rope_theta) under config.json's own
    parsed = {k: v for k, v in dataclasses.asdict(vlm.config.text_config).items() if v is not None}
    text_config = {**parsed, **(config.get("text_config") or {})}
    if text_config.get("model_type") in TEXT_FAMILIES:  # a text config that names the VLM, not its decoder
        text_config["model_type"] = TEXT_FAMILIES[text_config["model_type"]]
    text_config["tie_word_embeddings"] = False  # mlx-vlm's language model keeps its own lm_head
    model_class, args_class = _get_classes(text_config)
    model = model_class(args_class.from_dict(text_config))
    # without `destination`, tree_flatten returns (name, leaf) pairs (its type says list or dict)
    flat = cast(list[tuple[str, mx.array]], tree_flatten(vlm.language_model.parameters()))
    weights = [(name if name.startswith("lm_head.") else "model." + name, value) for name, value in flat]
    model.load_weights(weights, strict=True)
    model.eval()
    return model


def _tokenizer(directory: Path, config: dict[str, Any]) -> Any:
    from mlx_lm.utils import load_tokenizer

    eos = config.get("eos_token_id")
    eos_ids = [eos] if isinstance(eos, int) else eos if isinstance(eos, list) else None
    return load_tokenizer(directory, eos_token_ids=eos_ids)


def _picture(image: ImageInput, index: int) -> Any:
    """The image as the processor takes it: mlx-vlm's own loading (EXIF orientation, RGB)."""
    from mlx_vlm.utils import load_image

    if not image.digest or not image.data:
        raise EngineError(INVALID_REQUEST, f"image {index} was not checked by the front door (no digest)")
    try:
        return load_image(io.BytesIO(image.data))
    except (ValueError, OSError) as exc:
        raise EngineError(INVALID_REQUEST, f"image {index} could not be read: {exc}") from None


def _tokens_per_image(processor: Any, pictures: list[Any]) -> list[int] | None:
    """How many image tokens each image becomes, from the processor's own sizing (SmolVLM/Idefics3:
    tiles x image_seq_len); None where the processor does not say."""
    image_processor = getattr(processor, "image_processor", None)
    per_tile = getattr(processor, "image_seq_len", None)
    count = getattr(image_processor, "get_number_of_image_patches", None)
    if count is None or not isinstance(per_tile, int):
        return None
    try:
        return [max(1, int(count(p.height, p.width)[0])) * per_tile for p in pictures]
    except Exception:  # noqa: BLE001 - a processor's sizing helper of another shape: no attribution
        return None


def cache_key(ids: list[int], positions: list[int], digests: list[str], counts: list[int] | None) -> list[int]:
    """The prompt as the prompt cache keys it: every image token replaced by a negative number derived
    from the content hashes of its image and every image before it.

    Why chained: a prefix is reusable only when every image in it is the same, in the same order.
    Where the processor says how many tokens each image became (`counts`), each image's tokens carry
    the chain up to it, so a turn that adds an image still reuses the prefix with the earlier ones;
    otherwise every image token carries the chain over all images (correct, reused less)."""
    key = list(ids)
    if counts is None or sum(counts) != len(positions) or len(counts) != len(digests):
        counts, digests = [len(positions)], ["".join(digests)]
    chain = b""
    start = 0
    for digest, count in zip(digests, counts):
        chain = hashlib.sha256(chain + digest.encode()).digest()
        value = -(1 + (int.from_bytes(chain[:8], "big") >> (64 - KEY_BITS)))
        for position in positions[start:start + count]:
            key[position] = value
        start += count
    return key


__all__ = ["Media", "Parts", "VisionEngine", "VisionPrefill", "cache_key", "load_parts", "text_model"]
