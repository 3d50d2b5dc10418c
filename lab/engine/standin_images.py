"""Pictures in a chat request, as vLLM's OpenAI API takes them: content parts
`{"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}}` (docs/field.md,
"Images in a chat request", cites vLLM's docs). The stand-in counts them against
`--limit-mm-per-prompt`'s image limit, refused as vLLM refuses them, decodes each PNG (standard
library: zlib and struct) and "sees" its mean colour. Pure functions.
"""

from __future__ import annotations

import base64
import binascii
import struct
import zlib
from collections.abc import Mapping, Sequence
from typing import Any

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
DATA_URL_PREFIXES = ("data:image/png;base64,",)
# Channels per pixel by PNG colour type (8 bits each): grey, RGB, grey + alpha, RGBA.
CHANNELS = {0: 1, 2: 3, 4: 2, 6: 4}
NAMED_COLOURS: dict[str, tuple[int, int, int]] = {
    "black": (0, 0, 0),
    "white": (255, 255, 255),
    "grey": (128, 128, 128),
    "red": (255, 0, 0),
    "green": (0, 160, 0),
    "blue": (0, 0, 255),
    "yellow": (255, 255, 0),
    "cyan": (0, 255, 255),
    "magenta": (255, 0, 255),
    "orange": (255, 140, 0),
    "purple": (128, 0, 128),
}


def image_limit(limit_mm_per_prompt: Any) -> int | None:
    """The images one prompt may carry by --limit-mm-per-prompt's parsed JSON (`{"image": 2}`,
    or `{"image": {"count": 2, ...}}` with profiling options); None without the flag: the
    stand-in's model then takes no image at all, as a text-only model."""
    if not isinstance(limit_mm_per_prompt, Mapping):
        return None
    image = limit_mm_per_prompt.get("image", 0)
    if isinstance(image, Mapping):
        image = image.get("count", 0)
    return image if isinstance(image, int) else 0


def image_urls(messages: Sequence[Any]) -> list[str]:
    """The URL of every image part of the messages, in their order."""
    urls = []
    for message in messages:
        content = message.get("content") if isinstance(message, Mapping) else None
        for part in content if isinstance(content, list) else ():
            if isinstance(part, Mapping) and part.get("type") == "image_url":
                image = part.get("image_url")
                url = image.get("url") if isinstance(image, Mapping) else image
                urls.append(str(url or ""))
    return urls


def limit_refusal(count: int, limit: int | None) -> str | None:
    """vLLM's refusal of a prompt with more images than allowed
    (vllm/multimodal/processing/context.py, BaseProcessingInfo.validate_num_items), or None.
    A model that takes images (the flag given) is told how to raise the limit; a text-only one
    (no flag) is not, as vLLM words the two."""
    allowed = 0 if limit is None else limit
    if count <= allowed:
        return None
    message = f"At most {allowed} image(s) may be provided in one prompt."
    if limit is not None:
        message += " Set `--limit-mm-per-prompt` to increase this limit."
    return message


def png_pixels(data: bytes) -> tuple[int, int, list[tuple[int, ...]]]:
    """Width, height and every pixel's channels of an 8-bit, non-interlaced PNG (grey, RGB,
    grey + alpha or RGBA, any of PNG's five row filters); ValueError for anything else."""
    if not data.startswith(PNG_SIGNATURE):
        raise ValueError("not a PNG (no PNG signature)")
    position, header, compressed = len(PNG_SIGNATURE), b"", b""
    while position + 8 <= len(data):
        length, kind = struct.unpack(">I4s", data[position : position + 8])
        body = data[position + 8 : position + 8 + length]
        if kind == b"IHDR":
            header = body
        elif kind == b"IDAT":
            compressed += body
        elif kind == b"IEND":
            break
        position += 12 + length
    if len(header) != 13:
        raise ValueError("a PNG without its IHDR header")
    width, height, depth, colour, _, _, interlace = struct.unpack(">IIBBBBB", header)
    if depth != 8 or colour not in CHANNELS or interlace:
        raise ValueError(
            f"a PNG of bit depth {depth}, colour type {colour}, interlace {interlace}: the "
            "stand-in reads 8-bit grey, RGB or RGBA PNGs without interlace"
        )
    channels = CHANNELS[colour]
    try:
        raw = zlib.decompress(compressed)
    except zlib.error as error:
        raise ValueError(f"the PNG's image data does not decompress: {error}") from None
    stride = width * channels
    if len(raw) != height * (stride + 1):
        raise ValueError(f"the PNG's image data has {len(raw)} bytes, not {height * (stride + 1)}")
    rows: list[bytearray] = []
    previous = bytearray(stride)
    for y in range(height):
        start = y * (stride + 1)
        row = _unfiltered(
            raw[start], bytearray(raw[start + 1 : start + 1 + stride]), previous, channels
        )
        rows.append(row)
        previous = row
    pixels = [tuple(row[x * channels : (x + 1) * channels]) for row in rows for x in range(width)]
    return width, height, pixels


def _unfiltered(kind: int, row: bytearray, above: bytearray, step: int) -> bytearray:
    """A scanline with its filter undone (PNG spec, section 9: None, Sub, Up, Average, Paeth)."""
    if kind > 4:
        raise ValueError(f"a PNG row filter {kind}: PNG has filters 0 to 4")
    for i, value in enumerate(row):
        left = row[i - step] if i >= step else 0
        up = above[i]
        corner = above[i - step] if i >= step else 0
        predicted = (0, left, up, (left + up) // 2, _paeth(left, up, corner))[kind]
        row[i] = (value + predicted) & 0xFF
    return row


def _paeth(left: int, up: int, corner: int) -> int:
    estimate = left + up - corner
    distances = (abs(estimate - left), abs(estimate - up), abs(estimate - corner))
    return (left, up, corner)[distances.index(min(distances))]


def colour_name(pixels: Sequence[tuple[int, ...]]) -> str:
    """The named colour nearest the pixels' mean (alpha ignored; grey as three equal channels)."""
    if not pixels:
        raise ValueError("a PNG without pixels")
    rgb = [(p[0], p[0], p[0]) if len(p) <= 2 else (p[0], p[1], p[2]) for p in pixels]
    mean = tuple(sum(channel) / len(rgb) for channel in zip(*rgb, strict=True))
    return min(
        NAMED_COLOURS,
        key=lambda name: sum((a - b) ** 2 for a, b in zip(mean, NAMED_COLOURS[name], strict=True)),
    )


def seen_colour(url: str) -> str:
    """What the picture at a data URL shows: its colour's name; ValueError naming why it cannot
    be read (the stand-in fetches no http URL: it has no network to fetch from)."""
    prefix = next((p for p in DATA_URL_PREFIXES if url.startswith(p)), None)
    if prefix is None:
        shown = url[:40] + ("..." if len(url) > 40 else "")
        raise ValueError(
            f"the stand-in reads images given as {DATA_URL_PREFIXES[0]}... URLs only, not {shown!r}"
        )
    try:
        data = base64.b64decode(url[len(prefix) :], validate=True)
    except binascii.Error as error:
        raise ValueError(f"the image's base64 does not decode: {error}") from None
    return colour_name(png_pixels(data)[2])
