"""The frame header reader and the rows trick (a decoder stops at a row) against the full
decode."""

from __future__ import annotations

import io

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image

from nnh_data.images.jpeg_frame import JpegFrame, read_frame, rows_for, with_height
from tests.support import encoded, picture

LAYOUTS = {
    "baseline-420": {}, "progressive-420": {"progressive": True}, "444": {"subsampling": 0},
    "422": {"subsampling": 1}, "restarts": {"restart_marker_rows": 1},
}  # fmt: skip


def decoded(data: bytes, scale: int = 1) -> np.ndarray:
    with Image.open(io.BytesIO(data)) as image:
        if scale > 1:
            image.draft("RGB", (image.width // scale, image.height // scale))
        return np.asarray(image.convert("RGB"))


@pytest.mark.parametrize(("mode", "options", "sampling", "progressive"), [
    ("RGB", {}, ((2, 2), (1, 1), (1, 1)), False),
    ("RGB", {"subsampling": 0}, ((1, 1), (1, 1), (1, 1)), False),
    ("RGB", {"progressive": True}, ((2, 2), (1, 1), (1, 1)), True),
    ("L", {}, ((1, 1),), False),
])  # fmt: skip
def test_read_frame(mode, options, sampling, progressive):
    data = encoded(picture(131, 97, seed=1), mode=mode, **options)
    frame = read_frame(data)
    assert (frame.width, frame.height, frame.sampling) == (131, 97, sampling)
    assert frame.progressive is progressive and frame.complete
    assert data[frame.height_at : frame.height_at + 2] == (97).to_bytes(2, "big")


@pytest.mark.parametrize("data", [
    b"", b"not a jpeg", b"\xff\xd8\xff\xe0garbage", encoded(picture(40, 30), "PNG"),
    encoded(picture(40, 30), mode="CMYK"),
])  # fmt: skip
def test_what_the_fast_paths_do_not_serve_has_no_frame(data):
    assert read_frame(data) is None


def test_a_truncated_file_is_not_complete():
    data = encoded(picture(200, 150))
    assert not read_frame(data[: len(data) // 2]).complete


@pytest.mark.parametrize(("mcu", "height", "bottom", "rows"), [
    (16, 480, 1, 32), (16, 480, 16, 32), (16, 480, 17, 48), (16, 480, 464, 480),
    (16, 480, 480, 480), (8, 100, 50, 64), (8, 100, 93, 100),
])  # fmt: skip
def test_rows_for(mcu, height, bottom, rows):
    sampling = ((mcu // 8, mcu // 8), (1, 1), (1, 1))
    assert rows_for(JpegFrame(640, height, sampling, False, True, 0), bottom) == rows


@settings(max_examples=25, deadline=None)
@given(layout=st.sampled_from(sorted(LAYOUTS)), bottom=st.integers(1, 301),
       scale=st.sampled_from([1, 2, 4, 8]))  # fmt: skip
def test_the_rows_above_the_cut_are_the_full_decodes(layout, bottom, scale):
    """Every row above the crop's bottom is bit-identical to the full decode's, at each scale."""
    data = encoded(picture(219, 301, seed=2), **LAYOUTS[layout])
    frame = read_frame(data)
    rows = rows_for(frame, bottom)
    cut = decoded(with_height(data, frame, rows), scale)
    keep = -(-bottom // scale)
    np.testing.assert_array_equal(cut[:keep], decoded(data, scale)[:keep])

