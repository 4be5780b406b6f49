"""Image decoding: webdataset's decoder names for samples (:mod:`.decoders`) and
:func:`decode_crop`, which decodes only what a sample's known crop needs (:mod:`.crop_decoder`)."""

from nnh_data.images.crop_decoder import decode_crop
from nnh_data.images.decoders import SampleDecoder

__all__ = ["SampleDecoder", "decode_crop"]
