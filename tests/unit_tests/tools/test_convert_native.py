"""HF export of checkpoints trained here, all through the command line as subprocesses: a
Llama-style GPT, a GPT-2-style GPT, a DeepSeek-V3-style GPT (multi-latent attention with YaRN,
a dense layer then an MoE layer routed with an expert bias and groups, a shared expert) and a
hybrid (NemotronH) are trained for two iterations
(``python -m megatron.training.pretrain_*``), exported (``--loader megatron --saver hf``), and
the HF model ``from_pretrained`` gives our logits; that HF directory converted to ours and back
gives bit-identical tensors and the same config."""

import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM

from megatron.core import parallel_state
from megatron.core.models.model_record import load_model_weights, model_from_record, read_model_record
from tests.unit_tests.dist_harness import run_distributed

COMMON = [
    "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--ffn-hidden-size", "64",
    "--seq-length", "16", "--max-position-embeddings", "32", "--micro-batch-size", "2", "--global-batch-size", "2",
    "--train-iters", "2", "--lr", "1e-2", "--mock-data", "--vocab-size", "100", "--distributed-backend", "gloo",
    "--save-interval", "2", "--log-interval", "1", "--eval-iters", "0",  # the export reads the iteration-2 save
]  # fmt: skip
MODELS = {
    "llama": (
        "megatron.training.pretrain_gpt",
        ["--normalization", "RMSNorm", "--swiglu", "--position-embedding-type", "rope", "--disable-bias-linear",
         "--group-query-attention", "--num-query-groups", "2", "--untie-embeddings-and-output-weights"],
        "LlamaForCausalLM",
    ),
    "gpt2": ("megatron.training.pretrain_gpt", [], "GPT2LMHeadModel"),
    "deepseek_v3": (
        "megatron.training.pretrain_gpt",
        ["--normalization", "RMSNorm", "--swiglu", "--disable-bias-linear", "--untie-embeddings-and-output-weights",
         "--position-embedding-type", "rope", "--multi-latent-attention", "--q-lora-rank", "16", "--kv-lora-rank", "16",
         "--qk-head-dim", "8", "--qk-pos-emb-head-dim", "4", "--v-head-dim", "8", "--rotary-scaling-factor", "4",
         "--mscale", "1.3", "--mscale-all-dim", "0.7", "--yarn-original-max-position-embeddings", "8",
         "--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "16", "--moe-layer-freq", "[0,1]",
         "--moe-shared-expert-intermediate-size", "32", "--moe-router-score-function", "sigmoid",
         "--moe-router-enable-expert-bias", "--moe-router-bias-update-rate", "0.1", "--moe-router-num-groups", "2",
         "--moe-router-group-topk", "1", "--moe-router-topk-scaling-factor", "2.5",
         "--moe-router-load-balancing-type", "none"],
        "DeepseekV3ForCausalLM",
    ),
    "nemotron_h": (
        "megatron.training.pretrain_hybrid",
        ["--num-layers", "4", "--hybrid-layer-pattern", "M*-M", "--normalization", "RMSNorm", "--disable-bias-linear",
         "--group-query-attention", "--num-query-groups", "2", "--mamba-state-dim", "8", "--mamba-head-dim", "8",
         "--mamba-num-groups", "2", "--mamba-chunk-size", "4", "--untie-embeddings-and-output-weights"],
        "NemotronHForCausalLM",
    ),
}  # fmt: skip
CONVERT = [sys.executable, "-m", "megatron.core.models.checkpoint_converter"]
IDS = torch.randint(0, 100, (2, 12), generator=torch.Generator().manual_seed(3))


def _run_all(commands: dict) -> None:
    """Run one command per model at once (they are independent); each must succeed."""
    procs = {name: subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for name, cmd in commands.items()}  # fmt: skip
    for name, proc in procs.items():
        out, _ = proc.communicate(timeout=600)
        assert proc.returncode == 0, f"{name}: {commands[name]}\n{out[-3000:]}"


def _convert(loader, saver, load_dir, save_dir):
    return CONVERT + ["--loader", loader, "--saver", saver, "--load-dir", load_dir, "--save-dir", save_dir]


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    root = tmp_path_factory.mktemp("native")
    dirs = {name: {k: str(root / f"{name}_{k}") for k in ("ours", "hf", "ours2", "hf2")} for name in MODELS}
    env_train = {
        name: [sys.executable, "-m", module, *COMMON, *flags, "--save", dirs[name]["ours"]]
        for name, (module, flags, _) in MODELS.items()
    }
    _run_all(env_train)
    _run_all({name: _convert("megatron", "hf", d["ours"], d["hf"]) for name, d in dirs.items()})
    _run_all({name: _convert("hf", "megatron", d["hf"], d["ours2"]) for name, d in dirs.items()})
    _run_all({name: _convert("megatron", "hf", d["ours2"], d["hf2"]) for name, d in dirs.items()})
    return dirs


def _our_logits(path, ids):
    pg = parallel_state.initialize_model_parallel()
    model = model_from_record(read_model_record(path), pg, parallel_output=False).eval()
    load_model_weights(model, path)
    with torch.no_grad():
        return model(ids)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_exported_hf_model_gives_our_logits(exported, name):
    dirs = exported[name]
    hf = AutoModelForCausalLM.from_pretrained(dirs["hf"]).eval()
    assert type(hf).__name__ == MODELS[name][2]
    (ours,) = run_distributed(_our_logits, 1, dirs["ours"], IDS)
    with torch.no_grad():
        expected = hf(IDS).logits
    torch.testing.assert_close(ours[..., : expected.shape[-1]], expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_hf_to_ours_to_hf_round_trip_is_bit_identical(exported, name):
    dirs = exported[name]
    first, second = (
        load_file(os.path.join(dirs["hf"], "model.safetensors")),
        load_file(os.path.join(dirs["hf2"], "model.safetensors")),
    )
    assert first.keys() == second.keys() and all(torch.equal(first[k], second[k]) for k in first)
    configs = [AutoConfig.from_pretrained(dirs[k]).to_dict() for k in ("hf", "hf2")]
    assert [{k: v for k, v in c.items() if k != "_name_or_path"} for c in configs][0] == {
        k: v for k, v in configs[1].items() if k != "_name_or_path"
    }
