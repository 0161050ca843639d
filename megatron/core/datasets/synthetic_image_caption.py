"""Generated image + caption pairs: a colored shape on a black canvas, captioned with its
color and shape name (e.g. "a red circle"). Nothing is downloaded; sample ``i`` depends only
on ``(seed, split_id, i)``.

A sample's text is ``image_token_id`` repeated once per image patch, then the caption's
tokens and an end-of-document token, padded with end-of-document tokens to
``sequence_length + 1``; ``tokens``/``labels`` are that window shifted by one. ``loss_mask``
is 1 on the caption and its end-of-document label only.
"""

from __future__ import annotations

import numpy as np
import torch

from megatron.core.datasets.errors import DatasetConfigError

COLORS = {
    "red": (1.0, 0.0, 0.0),
    "green": (0.0, 1.0, 0.0),
    "blue": (0.0, 0.0, 1.0),
    "yellow": (1.0, 1.0, 0.0),
    "white": (1.0, 1.0, 1.0),
}
SHAPES = ("square", "circle", "triangle")


def draw_shape(
    shape: str, color: tuple[float, float, float], size: int, top: int, left: int, image_size: int
) -> np.ndarray:
    """A ``[3, image_size, image_size]`` float32 image with ``shape`` in ``color`` inside the
    box of side ``size`` at ``(top, left)``."""
    rows, cols = np.mgrid[0:image_size, 0:image_size]
    r, c = rows - top, cols - left
    inside = (r >= 0) & (r < size) & (c >= 0) & (c < size)
    if shape == "circle":
        center = (size - 1) / 2
        inside &= (r - center) ** 2 + (c - center) ** 2 <= (size / 2) ** 2
    elif shape == "triangle":
        center = (size - 1) / 2
        inside &= np.abs(c - center) <= (r + 1) / 2
    elif shape != "square":
        raise DatasetConfigError(f"unknown shape {shape!r}; known shapes: {', '.join(SHAPES)}")
    image = np.zeros((3, image_size, image_size), dtype=np.float32)
    for channel, value in enumerate(color):
        image[channel][inside] = value
    return image


class SyntheticImageCaptionDataset(torch.utils.data.Dataset):
    """``num_samples`` generated pairs; items are dicts with ``tokens``, ``labels``,
    ``loss_mask``, ``position_ids`` ([s]) and ``images`` ([3, image_size, image_size]).

    Args:
        tokenizer: gives ``tokenize(text)`` and ``eod``.
        image_token_id: the special id standing for one image embedding (outside the
            tokenizer's ids).
        num_image_tokens: embeddings the encoder yields per image (its number of patches).
    """

    def __init__(
        self,
        num_samples: int,
        sequence_length: int,
        image_size: int,
        num_image_tokens: int,
        tokenizer,
        image_token_id: int,
        seed: int,
        split_id: int = 0,
    ):
        if num_samples < 1:
            raise DatasetConfigError(f"num_samples must be >= 1, got {num_samples}")
        if image_size < 4:
            raise DatasetConfigError(f"image_size must be >= 4 pixels to draw a shape, got {image_size}")
        longest = max(len(tokenizer.tokenize(self.caption(c, s))) for c in COLORS for s in SHAPES)
        needed = num_image_tokens + longest + 1
        if sequence_length < needed:
            raise DatasetConfigError(
                f"--seq-length {sequence_length} is too short: {num_image_tokens} image tokens + the longest "
                f"caption ({longest} tokens) + end of document need {needed}"
            )
        self.num_samples, self.sequence_length = num_samples, sequence_length
        self.image_size, self.num_image_tokens = image_size, num_image_tokens
        self.tokenizer, self.image_token_id = tokenizer, image_token_id
        self.seed, self.split_id = seed, split_id

    @staticmethod
    def caption(color: str, shape: str) -> str:
        return f"a {color} {shape}"

    def __len__(self) -> int:
        return self.num_samples

    def image_and_caption(self, idx: int) -> tuple[np.ndarray, str]:
        """The image and caption of sample ``idx``."""
        if not 0 <= idx < self.num_samples:
            raise IndexError(f"sample index {idx} out of range for {self.num_samples} samples")
        rng = np.random.default_rng([self.seed, self.split_id, idx])
        color = list(COLORS)[int(rng.integers(len(COLORS)))]
        shape = SHAPES[int(rng.integers(len(SHAPES)))]
        size = int(rng.integers(self.image_size // 2, self.image_size + 1))
        top, left = (int(rng.integers(self.image_size - size + 1)) for _ in range(2))
        return draw_shape(shape, COLORS[color], size, top, left, self.image_size), self.caption(color, shape)

    def __getitem__(self, idx: int) -> dict:
        image, caption = self.image_and_caption(idx)
        caption_ids = self.tokenizer.tokenize(caption) + [self.tokenizer.eod]
        window = [self.image_token_id] * self.num_image_tokens + caption_ids
        window += [self.tokenizer.eod] * (self.sequence_length + 1 - len(window))
        window = torch.tensor(window, dtype=torch.int64)
        loss_mask = torch.zeros(self.sequence_length, dtype=torch.float32)
        first_caption_label = self.num_image_tokens - 1
        loss_mask[first_caption_label : first_caption_label + len(caption_ids)] = 1.0
        return {
            "tokens": window[:-1].clone(),
            "labels": window[1:].clone(),
            "loss_mask": loss_mask,
            "position_ids": torch.arange(self.sequence_length, dtype=torch.int64),
            "images": torch.from_numpy(image),
        }
