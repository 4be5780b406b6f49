"""Image decoding: webdataset's decoder names for samples, or a decoder per field name
(:mod:`.decoders`), :func:`decode_crop`, which decodes only what a sample's known crop needs
(:mod:`.crop_decoder`, choosing among the JPEG backends of :mod:`.jpeg_backends`), and
:class:`GpuCropDecoder`, the same crops decoded on the GPU (:mod:`.gpu_decode`)."""

from nnh_data.images.crop_decoder import decode_crop, jpeg_backend_names
from nnh_data.images.decoders import SampleDecoder
from nnh_data.images.gpu_decode import GpuCropDecoder

__all__ = ["GpuCropDecoder", "SampleDecoder", "decode_crop", "jpeg_backend_names"]
