"""The smoke test's picture, for an engine whose recipe allows images (--limit-mm-per-prompt with
an image count above 0): a PNG drawn here (zlib and struct, no imaging library) of one solid
colour, so its right answer is known, asked in vLLM's OpenAI image message format: a text part
and an `image_url` part whose URL is the PNG as a base64 data URL (docs/field.md, "Images in a
chat request", cites vLLM's docs).

Kept out of prompts.py: the lab's chat model learns that file's prompts, and it takes no images.
"""

from __future__ import annotations

import base64
import struct
import zlib
from typing import Any

from sparkdeploy.steps.smoke_test.detectors import words_in

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
IMAGE_SIDE = 64  # pixels: a vision encoder's smallest tiles are about this size
IMAGE_COLOUR = "red"
IMAGE_RGB = (255, 0, 0)  # pure, so no model calls it orange or pink
IMAGE_QUESTION = "What colour is this image? Answer with the colour's name only."


def png_chunk(kind: bytes, data: bytes) -> bytes:
    """A PNG chunk: length, type, data, and the CRC-32 of type and data."""
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def solid_png(rgb: tuple[int, int, int], width: int, height: int) -> bytes:
    """A PNG of one colour: 8-bit RGB, each scanline with filter 0 (none)."""
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    scanline = b"\x00" + bytes(rgb) * width
    return (
        PNG_SIGNATURE
        + png_chunk(b"IHDR", header)
        + png_chunk(b"IDAT", zlib.compress(scanline * height))
        + png_chunk(b"IEND", b"")
    )


def data_url(png: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(png).decode("ascii")


def image_content(question: str, png: bytes) -> list[dict[str, Any]]:
    """A user message's content in vLLM's (OpenAI's) format: the question, then the picture."""
    return [
        {"type": "text", "text": question},
        {"type": "image_url", "image_url": {"url": data_url(png)}},
    ]


IMAGE_CONTENT = image_content(IMAGE_QUESTION, solid_png(IMAGE_RGB, IMAGE_SIDE, IMAGE_SIDE))


def names_the_colour(answer: str) -> bool:
    return IMAGE_COLOUR in (word.lower() for word in words_in(answer))
