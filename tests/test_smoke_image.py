"""The smoke test's picture (issue 26.3): a PNG drawn with the standard library, sent in vLLM's
OpenAI image message format to an engine whose recipe allows images, and the engine stand-in
that reads it: counted against --limit-mm-per-prompt as vLLM counts, decoded, its colour named.
"""

from __future__ import annotations

import base64
import json
import struct
import zlib
from collections.abc import Iterator
from pathlib import Path

import pytest

from lab.engine.standin_images import image_limit, limit_refusal, png_pixels, seen_colour
from lab.testing.standin_process import SERVED, local_standin
from sparkdeploy.spec.cluster import load_cluster
from sparkdeploy.spec.plan import make_plan
from sparkdeploy.spec.recipe_loading import load_recipe
from sparkdeploy.steps.smoke_test import SmokeSettings, chat, run_smoke
from sparkdeploy.steps.smoke_test.image import (
    IMAGE_CONTENT,
    IMAGE_QUESTION,
    IMAGE_RGB,
    PNG_SIGNATURE,
    data_url,
    image_content,
    names_the_colour,
    png_chunk,
    solid_png,
)
from sparkdeploy.vllm.args import images_per_prompt

ROOT = Path(__file__).parent.parent
IMAGES_FLAG = ("--limit-mm-per-prompt", '{"image":2}')


def chunks(png: bytes) -> list[tuple[bytes, bytes]]:
    """Each chunk's type and data, its CRC checked."""
    found, position = [], len(PNG_SIGNATURE)
    while position < len(png):
        length, kind = struct.unpack(">I4s", png[position : position + 8])
        data = png[position + 8 : position + 8 + length]
        (crc,) = struct.unpack(">I", png[position + 8 + length : position + 12 + length])
        assert crc == zlib.crc32(kind + data)
        found.append((kind, data))
        position += 12 + length
    return found


def test_the_png_is_a_valid_solid_picture() -> None:
    png = solid_png((255, 0, 0), 64, 32)
    assert png.startswith(PNG_SIGNATURE)
    [(ihdr, header), (idat, data), (iend, _)] = chunks(png)
    assert (ihdr, idat, iend) == (b"IHDR", b"IDAT", b"IEND")
    assert struct.unpack(">IIBBBBB", header) == (64, 32, 8, 2, 0, 0, 0)
    assert zlib.decompress(data) == (b"\x00" + b"\xff\x00\x00" * 64) * 32
    width, height, pixels = png_pixels(png)
    assert (width, height, set(pixels)) == (64, 32, {(255, 0, 0)})


def test_the_message_is_vllms_openai_image_format() -> None:
    text, image = IMAGE_CONTENT
    assert text == {"type": "text", "text": IMAGE_QUESTION}
    assert image["type"] == "image_url"
    url = image["image_url"]["url"]
    assert url.startswith("data:image/png;base64,")
    assert base64.b64decode(url.split(",", 1)[1]) == solid_png(IMAGE_RGB, 64, 64)
    assert names_the_colour("Red.")
    assert names_the_colour("The image is red")
    assert not names_the_colour("reddish orange")
    assert not names_the_colour("")


def filtered_png(rows: list[bytes], filters: list[int]) -> bytes:
    """An 8-bit RGB PNG whose scanlines use the given PNG filters (spec section 9)."""

    def paeth(a: int, b: int, c: int) -> int:
        p = a + b - c
        distances = (abs(p - a), abs(p - b), abs(p - c))
        return (a, b, c)[distances.index(min(distances))]

    raw, above = b"", bytes(len(rows[0]))
    for row, kind in zip(rows, filters, strict=True):
        out = bytearray()
        for i, value in enumerate(row):
            left = row[i - 3] if i >= 3 else 0
            corner = above[i - 3] if i >= 3 else 0
            predicted = (0, left, above[i], (left + above[i]) // 2, paeth(left, above[i], corner))
            out.append((value - predicted[kind]) & 0xFF)
        raw += bytes([kind]) + bytes(out)
        above = row

    header = struct.pack(">IIBBBBB", len(rows[0]) // 3, len(rows), 8, 2, 0, 0, 0)
    return (
        PNG_SIGNATURE
        + png_chunk(b"IHDR", header)
        + png_chunk(b"IDAT", zlib.compress(raw))
        + png_chunk(b"IEND", b"")
    )


def test_the_standin_reads_every_png_row_filter() -> None:
    rows = [bytes((x * 40 + y * 7) % 256 for x in range(12)) for y in range(5)]
    png = filtered_png(rows, [0, 1, 2, 3, 4])
    _, _, pixels = png_pixels(png)
    assert pixels == [tuple(row[i : i + 3]) for row in rows for i in range(0, 12, 3)]
    blue = filtered_png([bytes((0, 0, 250)) * 4] * 4, [4, 3, 2, 1])
    assert seen_colour(data_url(blue)) == "blue"
    with pytest.raises(ValueError, match="not a PNG"):
        png_pixels(b"GIF89a")
    with pytest.raises(ValueError, match="reads images given as data:image/png;base64"):
        seen_colour("https://example.com/cat.png")


def test_the_limit_and_its_refusal_are_vllms() -> None:
    assert image_limit({"image": 2}) == 2
    assert image_limit({"image": {"count": 1}}) == 1
    assert image_limit({"video": 1}) == 0
    assert image_limit(None) is None
    assert limit_refusal(2, 2) is None
    assert limit_refusal(1, None) == "At most 0 image(s) may be provided in one prompt."
    assert limit_refusal(3, 2) == (
        "At most 2 image(s) may be provided in one prompt. "
        "Set `--limit-mm-per-prompt` to increase this limit."
    )
    assert images_per_prompt(["vllm", "serve", "m", "--limit-mm-per-prompt", '{"image":2}']) == 2
    assert images_per_prompt(['--limit-mm-per-prompt={"image": {"count": 1}}']) == 1
    assert images_per_prompt(["--limit-mm-per-prompt", "image=3,video=0"]) == 3
    assert images_per_prompt(["--limit-mm-per-prompt", '{"image":0}']) == 0
    assert images_per_prompt(["vllm", "serve", "m"]) == 0


def test_a_recipe_that_allows_images_gets_the_image_check() -> None:
    cluster = load_cluster(ROOT / "clusters" / "dgx-spark-4.toml")
    dsv41 = load_recipe(ROOT / "recipes" / "lab-dsv41-3x" / "recipe.toml")
    plan = make_plan(dsv41, cluster, ["dgx1", "dgx2", "dgx3"])
    assert SmokeSettings.for_plan(plan).images
    single = make_plan(
        load_recipe(ROOT / "recipes" / "lab-single" / "recipe.toml"), cluster, ["dgx1"]
    )
    assert not SmokeSettings.for_plan(single).images


@pytest.fixture(scope="module")
def with_images() -> Iterator[str]:
    with local_standin(*IMAGES_FLAG) as endpoint:
        yield endpoint


def test_the_standin_answers_what_the_picture_shows(with_images: str) -> None:
    settings = SmokeSettings(with_images, SERVED)
    assert chat(settings, "one", IMAGE_CONTENT).content == "The image is red."
    blue = data_url(solid_png((0, 0, 255), 8, 8))
    two = [*IMAGE_CONTENT, {"type": "image_url", "image_url": {"url": blue}}]
    assert chat(settings, "two", two).content == "The images are red and blue."
    three = chat(settings, "three", [*two, IMAGE_CONTENT[1]])
    assert three.error is not None
    assert three.error.startswith("HTTP 400")
    assert "At most 2 image(s) may be provided in one prompt." in three.error
    broken = chat(settings, "broken", image_content("?", b"not a png"))
    assert broken.error is not None
    assert "Failed to load the image: not a PNG" in broken.error


def test_the_smoke_test_sends_the_picture_and_checks_the_answer(with_images: str) -> None:
    report = run_smoke(SmokeSettings(with_images, SERVED, images=True))
    assert report.passed, report.failed
    check = report.check("image")
    assert check.evidence == "saw the red picture: 'The image is red.'"
    without = run_smoke(SmokeSettings(with_images, SERVED))
    assert "image" not in {check.name for check in without.checks}


def test_a_wrong_or_refused_answer_fails_the_image_check() -> None:
    with local_standin(*IMAGES_FLAG, env={"STANDIN_FAULT": "garbled"}) as endpoint:
        garbled = run_smoke(SmokeSettings(endpoint, SERVED, images=True)).check("image")
    assert not garbled.passed
    assert garbled.evidence.startswith("wrong answer: a 64x64 red picture, got 'Teh")
    with local_standin() as endpoint:  # no --limit-mm-per-prompt: a text-only model
        refused = run_smoke(SmokeSettings(endpoint, SERVED, images=True)).check("image")
    assert not refused.passed
    body = json.loads(refused.evidence.removeprefix("HTTP 400: b'").removesuffix("'"))
    assert body["error"]["message"] == "At most 0 image(s) may be provided in one prompt."
