"""``megatron-convert --loader mcore``: the megatron-core 0.19.2 torch_dist fixture in tests/data
(written by tools/checkpoint/make_mcore_fixture.py, with the logits megatron-core gave) converts
to ours, and our model gives those logits; the reader refuses an index that names other classes."""

import json
import os
import pickle
import subprocess
import sys

import pytest
import torch

from megatron.core import parallel_state
from megatron.core.models import mcore_checkpoint
from megatron.core.models.model_record import load_model_weights, model_from_record, read_model_record
from tests.unit_tests.dist_harness import run_distributed

FIXTURE = os.path.join(os.path.dirname(__file__), "..", "..", "data", "mcore_gpt_tp1pp1")


def _logits(path, ids):
    pg = parallel_state.initialize_model_parallel()
    model = model_from_record(read_model_record(path), pg, parallel_output=False).eval()
    load_model_weights(model, path)
    with torch.no_grad():
        return model(ids)


def test_mcore_fixture_converts_and_gives_its_recorded_logits(tmp_path):
    ours = str(tmp_path / "ours")
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "megatron.core.models.checkpoint_converter",
            "--loader",
            "mcore",
            "--saver",
            "megatron",
            "--load-dir",
            os.path.join(FIXTURE, "checkpoint"),
            "--save-dir",
            ours,
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    with open(os.path.join(FIXTURE, "fixture.json")) as f:
        fixture = json.load(f)
    record = read_model_record(ours)
    assert (record.config.num_layers, record.config.num_query_groups, record.vocab_size) == (
        fixture["config"]["num_layers"],
        fixture["config"]["num_query_groups"],
        fixture["vocab_size"],
    )
    expected = torch.load(os.path.join(FIXTURE, "logits.pt"), weights_only=True)
    (got,) = run_distributed(_logits, 1, ours, torch.tensor(fixture["token_ids"]))
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-4)


def test_common_state_loads_as_megatron_lm_arguments():
    checkpoint = mcore_checkpoint.McoreCheckpoint(os.path.join(FIXTURE, "checkpoint"))
    common = checkpoint.common_state()
    assert common["iteration"] == 7 and common["args"].swiglu is True and common["args"].num_query_groups == 2


def test_an_index_naming_other_classes_is_refused(tmp_path):
    class Payload:
        def __reduce__(self):
            return (os.system, ("echo pwned",))

    (tmp_path / ".metadata").write_bytes(pickle.dumps(Payload()))
    with pytest.raises(mcore_checkpoint.McoreCheckpointError, match=r"names posix\.system, which is not a torch"):
        mcore_checkpoint.McoreCheckpoint(str(tmp_path))
