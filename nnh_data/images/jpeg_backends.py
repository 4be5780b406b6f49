"""The JPEG decoders that :func:`~nnh_data.images.decode_crop` chooses among, per image, by cost.

Every decoder here is libjpeg-turbo under a different binding, and each gives the crop's pixels
bit-identical to a full decode's at the same DCT scale; they differ in what they can skip:

- ``simplejpeg`` and ``pillow``: the rows down to the crop's bottom only (the frame height
  rewritten, :mod:`~nnh_data.images.jpeg_frame`), at the largest DCT scale of 1/2, 1/4, 1/8 that
  leaves the crop at least ``size`` pixels each way (libjpeg's scaled IDCT: the IDCT, upsampling
  and colour conversion of 1/4 to 1/64 of the pixels). simplejpeg decodes straight into an array.
- ``nvimgcodec`` (NVIDIA nvImageCodec's CPU backend): the crop's box only (libjpeg-turbo's
  partial decode: no IDCT or colour conversion outside the box, nothing read below it), at full
  scale: its API has no DCT scale.

Which is cheapest depends on the image, the box and the scale. :meth:`JpegBackend.cost_ms` is a
linear model of one process's CPU time, fitted (non-negative least squares, per-image medians,
``tools/bench/images.py --fit``) on the two corpora of ``tools/bench/images.py``: a fixed cost,
the Huffman pass over the bytes read (the file's bytes times the share of rows read), the
pixels decoded at each scale, and the resize of the crop. Median error 7-8%. :func:`cheapest`
takes the backend of least modelled cost: on those corpora that came within 3% of the best
backend per image measured, and beat every margin for switching away from the first backend
that was tried (5-20%: each lost 1-3%). Pixel terms scale with the components' samples per
pixel over 4:2:0's 1.5. The choice is a pure function of the header, the parameters and the
installed set, so the same inputs give the same bytes for a given set of backends.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import io
import os
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
from PIL import Image

from nnh_data.augment.params import crop_box
from nnh_data.images.jpeg_frame import JpegFrame, read_frame, rows_for, with_height

__all__ = [
    "BACKEND_NAMES",
    "CropJob",
    "JpegBackend",
    "cheapest",
    "crop_job",
    "import_nvimgcodec",
    "installed_backends",
]

BACKEND_NAMES = ("simplejpeg", "nvimgcodec", "pillow")  # in order of preference on equal cost
SCALES = (8, 4, 2)  # libjpeg-turbo's fast scaled IDCTs; its 7/8 to 3/8 measured slower than 1/1
_REFERENCE_SAMPLES = 1.5  # the model's pixel terms were fitted on 4:2:0 files


@dataclass(frozen=True)
class CropJob:
    """One crop to decode: the file's frame, the crop's pixel ``box`` (left, top, right,
    bottom), the DCT ``scale`` (1, 2, 4 or 8), the frame height to decode (``rows``), the output
    ``size`` and the file's length in bytes."""

    frame: JpegFrame
    box: tuple[int, int, int, int]
    scale: int
    rows: int
    size: int
    nbytes: int


def crop_job(data: bytes, params: Mapping[str, Any], size: int) -> CropJob | None:
    """The job of ``data``'s crop, or None where only the plain decode serves (not a plain
    one- or three-component 8-bit JPEG, or not ending with its EOI marker)."""
    frame = read_frame(data)
    if frame is None or not frame.complete:
        return None
    box = crop_box(params, frame.width, frame.height)
    fits = min(box[2] - box[0], box[3] - box[1]) // size
    scale = next((s for s in SCALES if s <= fits), 1)
    return CropJob(frame, box, scale, rows_for(frame, box[3]), size, len(data))


@dataclass(frozen=True)
class JpegBackend:
    """A decoder and its cost model (milliseconds of CPU): ``fixed_ms`` a call,
    ``huffman_ms_per_mb`` of bytes read, ``pixel_ms_per_mpx`` of pixels decoded at the scales 1,
    2, 4 and 8, ``resize_ms_per_mpx`` of the crop's pixels at its scale. ``region``: it decodes
    the crop's box at full scale (else rows ``[0, job.rows)`` at the job's scale)."""

    name: str
    region: bool
    fixed_ms: float
    huffman_ms_per_mb: float
    pixel_ms_per_mpx: tuple[float, float, float, float]
    resize_ms_per_mpx: float
    decode: Callable[[bytes, CropJob], np.ndarray | None]

    def cost_ms(self, job: CropJob) -> float:
        """The modelled CPU milliseconds of decoding and resizing ``job``'s crop."""
        left, top, right, bottom = job.box
        crop = (right - left) * (bottom - top) / 1e6
        samples = job.frame.samples_per_pixel / _REFERENCE_SAMPLES
        if self.region:
            read, pixels, scale = bottom, crop, 1
        else:
            read, pixels, scale = job.rows, job.frame.width * job.rows / 1e6, job.scale
        return (
            self.fixed_ms
            + self.huffman_ms_per_mb * job.nbytes / 1e6 * read / job.frame.height
            + self.pixel_ms_per_mpx[(1, 2, 4, 8).index(scale)] * pixels * samples
            + self.resize_ms_per_mpx * crop / scale**2
        )


def cheapest(job: CropJob, backends: tuple[JpegBackend, ...]) -> JpegBackend:
    """The backend of least modelled cost for ``job`` (the first of ``backends`` on a tie)."""
    return min(backends, key=lambda backend: backend.cost_ms(job))


def _simplejpeg(data: bytes, job: CropJob) -> np.ndarray | None:
    """Rows ``[0, job.rows)`` at ``1 / job.scale`` (lenient: it skips the rows' remainder)."""
    import simplejpeg

    scale, width = job.scale, job.frame.width
    try:
        return simplejpeg.decode_jpeg(
            with_height(data, job.frame, job.rows), "RGB", strict=False,
            min_height=-(-job.rows // scale), min_width=-(-width // scale),
        )  # fmt: skip
    except ValueError:  # damaged for libjpeg-turbo: the plain path decides
        return None


def _pillow(data: bytes, job: CropJob) -> np.ndarray | None:
    """The same rows and scale by Pillow's ``draft``."""
    scale, width = job.scale, job.frame.width
    try:
        with Image.open(io.BytesIO(with_height(data, job.frame, job.rows))) as image:
            if scale > 1:  # draft picks the largest scale that keeps the size asked for
                image.draft("RGB", (width // scale, job.rows // scale))
            array = np.asarray(image.convert("RGB"))
    except OSError:
        return None
    return array if array.shape[1] == -(-width // scale) else None


def _nvimgcodec(data: bytes, job: CropJob) -> np.ndarray | None:
    """The crop's box at full scale, by nvImageCodec's CPU (libjpeg-turbo) decoder; EXIF
    orientation ignored, as by the reference."""
    nvimgcodec, decoder, params = _nv_decoder()
    left, top, right, bottom = job.box
    stream = nvimgcodec.CodeStream(data)
    region = stream.get_sub_code_stream(region=nvimgcodec.Region(top, left, bottom, right))
    image = decoder.decode(region, params=params)
    return None if image is None else np.asarray(image.cpu())


@functools.cache
def _nv_process_decoder(pid: int) -> tuple[Any, Any, Any]:
    """nvImageCodec's module, a CPU-only decoder on the calling thread's pool of one, and its
    decode parameters, made once per process (``pid``: a forked worker makes its own)."""
    nvimgcodec = import_nvimgcodec()
    decoder = nvimgcodec.Decoder(
        device_id=nvimgcodec.NVIMGCODEC_DEVICE_CPU_ONLY, max_num_cpu_threads=1,
        backends=[nvimgcodec.Backend(nvimgcodec.BackendKind.CPU_ONLY)],
    )  # fmt: skip
    params = nvimgcodec.DecodeParams(apply_exif_orientation=False, color_spec=nvimgcodec.SRGB)
    return nvimgcodec, decoder, params


def _nv_decoder() -> tuple[Any, Any, Any]:
    return _nv_process_decoder(os.getpid())


def import_nvimgcodec() -> Any:
    """``nvidia.nvimgcodec``, imported with the process's stderr muted: without CUDA's nvJPEG,
    nvTIFF and nvJPEG2000 it prints an error for each extension it cannot load, which says
    nothing about its CPU decoder."""
    with _stderr_muted():
        from nvidia import nvimgcodec
    return nvimgcodec


@contextlib.contextmanager
def _stderr_muted() -> Iterator[None]:
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as devnull:
            os.dup2(devnull.fileno(), 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


# coefficients from `tools/bench/images.py --rounds 4 --fit` (see the module docstring)
_BACKENDS = {
    "simplejpeg": JpegBackend("simplejpeg", False, 0.267, 9.251, (1.318, 1.069, 0.488, 0.0),
                              0.800, _simplejpeg),
    "nvimgcodec": JpegBackend("nvimgcodec", True, 0.367, 9.039, (2.550, 0.0, 0.0, 0.0),
                              0.0, _nvimgcodec),
    "pillow": JpegBackend("pillow", False, 0.561, 9.833, (2.595, 1.428, 0.510, 0.0), 1.595,
                          _pillow),
}  # fmt: skip
_MODULES = {"simplejpeg": "simplejpeg", "nvimgcodec": "nvidia.nvimgcodec", "pillow": "PIL"}


@functools.cache
def installed_backends() -> tuple[JpegBackend, ...]:
    """The backends whose packages are installed, in :data:`BACKEND_NAMES` order."""
    return tuple(_BACKENDS[name] for name in BACKEND_NAMES if _importable(_MODULES[name]))


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # a parent package (``nvidia``) is missing
        return False
