"""Image decoding: webdataset's decoder names for samples (:mod:`.decoders`) and
:func:`decode_crop`, which decodes only what a sample's known crop needs (:mod:`.crop_decoder`,
choosing among the JPEG backends of :mod:`.jpeg_backends`)."""

from nnh_data.images.crop_decoder import decode_crop, jpeg_backend_names
from nnh_data.images.decoders import SampleDecoder

__all__ = ["SampleDecoder", "decode_crop", "jpeg_backend_names"]
