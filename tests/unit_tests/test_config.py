"""TransformerConfig.from_dict: records of this version load as written; unknown fields are
refused by name instead of being dropped."""

import dataclasses
import json
import re

import pytest
import torch
import torch.nn.functional as F

from megatron.core.config import ConfigError, TransformerConfig
from megatron.core.errors import MegatronConfigError

SMALL = {"num_layers": 2, "hidden_size": 8, "num_attention_heads": 2}


def test_unknown_fields_are_refused_by_name_with_the_accepted_ones():
    with pytest.raises(ConfigError) as err:
        TransformerConfig.from_dict({**SMALL, "hiden_size": 16, "moe_router_top_k": 2})
    accepted = [f.name for f in dataclasses.fields(TransformerConfig)]
    assert str(err.value) == (
        "unknown TransformerConfig field(s) 'hiden_size', 'moe_router_top_k'; accepted fields: " + ", ".join(accepted)
    )
    assert {"hidden_size", "num_layers", "activation_func", "extra"} <= set(accepted)
    assert isinstance(err.value, MegatronConfigError) and isinstance(err.value, ValueError)


def test_a_json_record_of_this_version_round_trips():
    config = TransformerConfig(
        **SMALL,
        num_query_groups=1,
        bf16=True,
        normalization="RMSNorm",
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        mtp_num_layers=1,
        recompute_granularity="full",
        recompute_method="block",
        recompute_num_layers=1,
        extra={"note": "kept"},
    )
    record = json.loads(json.dumps(config.to_dict()))  # what a checkpoint's model-config file holds
    assert record["params_dtype"] == "bfloat16" and record["activation_func"] == "silu"
    rebuilt = TransformerConfig.from_dict(record)
    assert rebuilt == config and rebuilt.params_dtype is torch.bfloat16


@pytest.mark.parametrize(
    "recompute, message",
    [
        (
            {"recompute_method": "uniform"},
            "recompute_method must be None, or 'uniform' or 'block' with recompute_granularity 'full'; "
            "got 'uniform' with None",
        ),
        (
            {"recompute_granularity": "full", "recompute_method": "layer"},
            "recompute_method must be None, or 'uniform' or 'block' with recompute_granularity 'full'; "
            "got 'layer' with 'full'",
        ),
        (
            {"recompute_granularity": "full", "recompute_num_layers": 0},
            "recompute_num_layers must be None, or >= 1 with recompute_granularity 'full'; got 0 with 'full'",
        ),
    ],
)
def test_recompute_method_and_count_need_full_recompute(recompute, message):
    with pytest.raises(ConfigError, match=f"^{re.escape(message)}$"):
        TransformerConfig(**SMALL, **recompute)
