"""The Qwen2.5-VL processor of an edit model (``QwenImageEditPipeline``'s): its text
template's image tokens expanded to the input image's patches, and the patches
themselves. Kept as the tokenizer's and image processor's files in the model's
``processor`` folder, which a stock ``Qwen2VLProcessor`` loads; built here for
images alone, since transformers 5 builds a stock one only where torchvision is
installed (it checks the class of the video processor, even an absent one, among
torchvision's). Imports transformers: only the edit family's code imports it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from transformers import AutoImageProcessor, AutoTokenizer, Qwen2VLProcessor


class ImageQwenVLProcessor(Qwen2VLProcessor):
    """A ``Qwen2VLProcessor`` without a video processor."""

    def check_argument_for_proper_class(self, argument_name: str, argument: Any) -> Any:
        if argument is None:
            return None  # the absent video processor: nothing to check
        return super().check_argument_for_proper_class(argument_name, argument)


def save_processor(path: Path, tokenizer: Any, image_processor: Any) -> None:
    """The processor's files at ``path``: the tokenizer's and the image processor's."""
    tokenizer.save_pretrained(path)
    image_processor.save_pretrained(path)


def load_processor(path: Path) -> ImageQwenVLProcessor:
    return ImageQwenVLProcessor(
        image_processor=AutoImageProcessor.from_pretrained(path), tokenizer=AutoTokenizer.from_pretrained(path)
    )
