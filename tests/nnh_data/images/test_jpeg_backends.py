"""The cost model and the choice among the JPEG backends, as tables."""

from __future__ import annotations

import dataclasses

import pytest

from nnh_data.images.jpeg_backends import CropJob, cheapest, installed_backends
from nnh_data.images.jpeg_frame import JpegFrame, rows_for


def job(width, height, box, scale, nbytes, sampling=((2, 2), (1, 1), (1, 1))):
    frame = JpegFrame(width, height, sampling, False, True, 0)
    return CropJob(frame, box, scale, rows_for(frame, box[3]), 224, nbytes)


@pytest.mark.parametrize(("job_", "cheapest_name"), [
    (job(2400, 1800, (300, 200, 800, 700), 2, 1_400_000), "nvimgcodec"),  # small crop, 1/2
    (job(2400, 1800, (100, 100, 2300, 1700), 8, 1_400_000), "simplejpeg"),  # most of it, 1/8
    (job(500, 375, (50, 40, 450, 360), 1, 90_000), "simplejpeg"),  # ImageNet-sized, most of it
    (job(500, 375, (200, 0, 430, 230), 1, 90_000), "nvimgcodec"),  # ImageNet-sized, top corner
])  # fmt: skip
def test_the_cost_model_prefers(job_, cheapest_name):
    backends = {b.name: b for b in installed_backends()}
    if not {"simplejpeg", "nvimgcodec"} <= set(backends):
        pytest.skip("needs simplejpeg and nvimgcodec")
    costs = {name: b.cost_ms(job_) for name, b in backends.items()}
    assert cheapest(job_, tuple(backends.values())).name == cheapest_name, costs


def test_the_model_grows_with_what_is_read_and_decoded():
    (backend,) = installed_backends()[-1:]  # pillow: always installed
    base = backend.cost_ms(job(1000, 800, (0, 0, 500, 400), 1, 200_000))
    assert backend.cost_ms(job(1000, 800, (0, 0, 500, 700), 1, 200_000)) > base  # more rows
    assert backend.cost_ms(job(1000, 800, (0, 0, 500, 400), 1, 400_000)) > base  # more bytes
    gray = job(1000, 800, (0, 0, 500, 400), 1, 200_000, sampling=((1, 1),))
    assert backend.cost_ms(gray) < base  # fewer samples per pixel


def test_cheapest_takes_the_least_cost_and_the_first_on_a_tie():
    (pillow,) = installed_backends()[-1:]
    a, b, c = (dataclasses.replace(pillow, name=n, fixed_ms=f) for n, f in
               (("a", 1.0), ("b", 0.5), ("c", 0.5)))  # fmt: skip
    some = job(640, 480, (0, 0, 300, 300), 1, 50_000)
    assert cheapest(some, (a, b, c)).name == "b"
    assert cheapest(some, (a, c, b)).name == "c"
    assert cheapest(some, (a,)).name == "a"
