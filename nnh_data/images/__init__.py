"""Image decoding: webdataset's decoder names for samples (:mod:`.decoders`) and
:func:`decode_crop`, which decodes only what a sample's known crop needs (:mod:`.decode_crop`)."""

from nnh_data.images.decode_crop import decode_crop
from nnh_data.images.decoders import SampleDecoder

__all__ = ["SampleDecoder", "decode_crop"]
