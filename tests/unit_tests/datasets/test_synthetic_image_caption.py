"""Generated image-caption pairs: the picture shows what the caption says."""

import numpy as np
import pytest
import torch

from megatron.core.datasets.errors import DatasetConfigError
from megatron.core.datasets.synthetic_image_caption import COLORS, SyntheticImageCaptionDataset, draw_shape
from megatron.core.tokenizers.byte_level import ByteLevelTokenizer

TOKENIZER = ByteLevelTokenizer()
IMAGE_TOKEN = TOKENIZER.vocab_size


def make(num_samples=40, seq=24, seed=0):
    return SyntheticImageCaptionDataset(num_samples, seq, 8, 4, TOKENIZER, IMAGE_TOKEN, seed)


def test_image_shows_the_captioned_color():
    data = make()
    for i in range(len(data)):
        image, caption = data.image_and_caption(i)
        _, color, _ = caption.split()
        lit = image.reshape(3, -1)[:, image.sum(axis=0).reshape(-1) > 0]
        assert lit.shape[1] > 0
        np.testing.assert_array_equal(lit, np.tile(np.array(COLORS[color])[:, None], (1, lit.shape[1])))


def test_shapes_by_hand():
    square = draw_shape("square", (1, 0, 0), 2, 1, 1, 4)[0]
    np.testing.assert_array_equal(square, [[0, 0, 0, 0], [0, 1, 1, 0], [0, 1, 1, 0], [0, 0, 0, 0]])
    triangle = draw_shape("triangle", (1, 0, 0), 3, 0, 0, 4)[0]
    np.testing.assert_array_equal(triangle, [[0, 1, 0, 0], [1, 1, 1, 0], [1, 1, 1, 0], [0, 0, 0, 0]])
    with pytest.raises(DatasetConfigError, match="unknown shape 'hexagon'; known shapes: square, circle, triangle"):
        draw_shape("hexagon", (1, 0, 0), 3, 0, 0, 4)


def test_sample_text_layout_and_loss_mask():
    data = make()
    sample = data[5]
    _, caption = data.image_and_caption(5)
    text = [IMAGE_TOKEN] * 4 + TOKENIZER.tokenize(caption) + [TOKENIZER.eod]
    window = text + [TOKENIZER.eod] * (25 - len(text))
    assert sample["tokens"].tolist() == window[:-1] and sample["labels"].tolist() == window[1:]
    expected_mask = [0.0] * 3 + [1.0] * (len(text) - 4) + [0.0] * (24 - len(text) + 1)
    assert sample["loss_mask"].tolist() == expected_mask
    assert sample["images"].shape == (3, 8, 8)
    torch.testing.assert_close(make()[5]["images"], sample["images"])  # deterministic


def test_too_short_sequence_names_what_is_needed():
    with pytest.raises(
        DatasetConfigError, match=r"--seq-length 12 is too short: 4 image tokens \+ the longest caption"
    ):
        make(seq=12)
