"""Images in: decoding and checking images, each family's processor (pixels and the
placeholder tokens an image becomes), and the inputs a request carries to the encoder.

The API process decodes an image (``images.py``), processes it with the model's processor
(``processors.py``: the checkpoint's own processor config, the same pixels as
transformers' PIL image processors) and sends the request's ``ImageInput``s with its token
ids; the model runner encodes each image once (``encoder_cache.py``) and splices its
embeddings in at the placeholders while the prompt is computed. Torch is not imported here
but by the encoder cache.
"""

from pagoda.multimodal.inputs import ImageError, ImageInput, MultiModalLimits

__all__ = ["ImageError", "ImageInput", "MultiModalLimits"]
