"""A JPEG's frame header, read without decoding, and the rows trick: a decoder stops at a row.

Huffman data is sequential, so no decoder can start below the top of a file, but any decoder
stops at the frame's last row: :func:`with_height` rewrites the frame (SOF) height to the rows a
crop needs, and libjpeg then decodes those rows and never reads the entropy-coded bytes below
them (a progressive file too: each scan stops at the frame's last row and the decoder skips to
the next marker). :func:`rows_for` keeps one MCU row past the crop's bottom, the context the
fancy upsampler reads, so every row of the crop is bit-identical to the full decode's, at every
DCT scale (``tests/nnh_data/images/test_jpeg_frame.py`` checks that on baseline, progressive,
4:2:0, 4:2:2, 4:4:4, grayscale, odd sizes and restart markers). The decoder then warns of the
bytes it skipped; a caller decodes the rewritten bytes leniently, so it only does so for files
that end with their EOI marker (a truncated file keeps the strict, whole-file path, which raises
as the reference does).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

__all__ = ["JpegFrame", "read_frame", "rows_for", "with_height"]

_SOF_DCT = {0xC0: False, 0xC1: False, 0xC2: True}  # baseline, extended, progressive (8-bit DCT)
_STANDALONE = set(range(0xD0, 0xDA)) | {0x01}  # RSTn, SOI, EOI, TEM: no length field
_EOI = b"\xff\xd9"


@dataclass(frozen=True)
class JpegFrame:
    """What a JPEG's frame header says: the size, the components' sampling factors
    ``((h, v), ...)``, whether it is progressive, whether the file ends with EOI, and where the
    height field lies (``height_at``, a byte offset)."""

    width: int
    height: int
    sampling: tuple[tuple[int, int], ...]
    progressive: bool
    complete: bool
    height_at: int

    @property
    def mcu_height(self) -> int:
        """Rows per MCU row: 8 times the largest vertical sampling factor."""
        return 8 * max(v for _, v in self.sampling)

    @property
    def samples_per_pixel(self) -> float:
        """Component samples per pixel: 1 for grayscale, 1.5 for 4:2:0, 3 for 4:4:4."""
        h_max, v_max = max(h for h, _ in self.sampling), max(v for _, v in self.sampling)
        return sum(h * v for h, v in self.sampling) / (h_max * v_max)


def read_frame(data: bytes) -> JpegFrame | None:
    """The frame of an 8-bit DCT JPEG (baseline, extended or progressive) with one or three
    components; None for anything else (CMYK, lossless, 12-bit, hierarchical, arithmetic,
    damaged headers), which the plain decoders handle.

    Example:
        >>> read_frame(b"not a jpeg") is None
        True
    """
    view = memoryview(data)
    at = 2
    while at + 4 <= len(view) and view[0] == 0xFF and view[1] == 0xD8:
        if view[at] != 0xFF:
            return None
        marker = view[at + 1]
        if marker == 0xFF:  # fill byte
            at += 1
            continue
        if marker in _STANDALONE:
            at += 2
            continue
        (length,) = struct.unpack_from(">H", view, at + 2)
        if marker == 0xDA:  # scan data before a frame
            return None
        if 0xC0 <= marker <= 0xCF and marker not in (0xC4, 0xC8, 0xCC):
            return _frame(view, at, marker, length)
        at += 2 + length
    return None


def _frame(view: memoryview, at: int, marker: int, length: int) -> JpegFrame | None:
    """The frame of the SOF segment at ``at``, or None where it is not one this module serves."""
    if marker not in _SOF_DCT or at + 2 + length > len(view) or view[at + 4] != 8:
        return None
    height, width, count = struct.unpack_from(">HHB", view, at + 5)
    if count not in (1, 3) or length != 8 + 3 * count or not (height and width):
        return None
    sampling = tuple(
        (view[at + 11 + 3 * k] >> 4, view[at + 11 + 3 * k] & 15) for k in range(count)
    )
    if not all(0 < h <= 4 and 0 < v <= 4 for h, v in sampling):
        return None
    complete = bytes(view[-2:]) == _EOI
    return JpegFrame(width, height, sampling, _SOF_DCT[marker], complete, at + 5)


def rows_for(frame: JpegFrame, bottom: int) -> int:
    """The frame height to decode so that rows ``[0, bottom)`` come out exactly: ``bottom``
    rounded up to the MCU height, plus one MCU row (the upsampler's context), at most the
    image's height.

    Example:
        >>> frame = JpegFrame(640, 480, ((2, 2), (1, 1), (1, 1)), False, True, 0)
        >>> rows_for(frame, 100), rows_for(frame, 470)
        (128, 480)
    """
    mcu = frame.mcu_height
    return min(frame.height, -(-bottom // mcu) * mcu + mcu)


def with_height(data: bytes, frame: JpegFrame, rows: int) -> bytes:
    """``data`` with its frame height set to ``rows`` (``data`` itself when that is its height)."""
    if rows == frame.height:
        return data
    at = frame.height_at
    return b"".join((data[:at], struct.pack(">H", rows), data[at + 2 :]))
