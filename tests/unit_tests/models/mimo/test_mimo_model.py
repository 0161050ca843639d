"""Placement of modality embeddings at special tokens and masking of their labels."""

import pytest
import torch

from megatron.core.models.mimo import MimoInputError, place_modality_embeddings
from tests.unit_tests.dist_harness import run_distributed
from tests.unit_tests.models.mimo.tiny import IMAGE_TOKEN, NUM_IMAGE_TOKENS, build_job, dataset


def test_embeddings_replace_special_positions_in_order():
    hidden = torch.arange(2 * 4 * 3, dtype=torch.float32).reshape(4, 2, 3)  # [s, b, h]
    ids = torch.tensor([[9, 1, 9, 2], [3, 9, 9, 4]])
    values = -torch.arange(1, 13, dtype=torch.float32).reshape(2, 2, 3)  # [b, n, h]
    expected = hidden.clone()
    expected[0, 0], expected[2, 0] = values[0, 0], values[0, 1]
    expected[1, 1], expected[2, 1] = values[1, 0], values[1, 1]
    torch.testing.assert_close(place_modality_embeddings(hidden, ids, 9, values), expected)


def test_wrong_number_of_special_tokens_names_the_sample():
    with pytest.raises(
        MimoInputError, match=r"sample\(s\) \[1\] hold \[1\] copies of special token 9; each sample needs exactly 2"
    ):
        place_modality_embeddings(torch.zeros(3, 2, 1), torch.tensor([[9, 9, 0], [9, 0, 0]]), 9, torch.zeros(2, 2, 1))


def _losses_and_embedding_gradient():
    _, _, model, _, _ = build_job({}, {})
    sample = dataset()[0]
    ids, labels = sample["tokens"][None], sample["labels"][None]
    images = sample["images"][None].requires_grad_()
    loss = model(ids, {"images": images}, labels=labels)
    loss.sum().backward()
    return loss.detach(), labels, images.grad


def test_special_labels_carry_no_loss_and_images_get_gradients():
    ((loss, labels, image_grad),) = run_distributed(_losses_and_embedding_gradient, 1)
    special = labels == IMAGE_TOKEN
    assert int(special.sum()) == NUM_IMAGE_TOKENS - 1
    assert torch.all(loss[special] == 0) and torch.all(loss[~special] > 0)
    assert image_grad.abs().sum() > 0
