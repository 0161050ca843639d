"""Peak resident memory of ``megatron-convert --loader hf`` on a >= 2 GB HF model.

Writes a Llama (random weights, fp32, several safetensors shards) to a temporary directory,
then runs, each in its own subprocess, the converter and the anchor (transformers'
``from_pretrained`` of the same directory, which any converter built on an HF model needs at
least), and prints each one's peak RSS (``ru_maxrss`` of the child) next to the model's size::

    python benchmarks/hf_import_rss.py [--hidden-size 2048 --num-layers 10] [--json out.json]
"""

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time

import torch

from megatron.core.benchmark_report import finish

ANCHOR = (
    "import sys, torch; from transformers import AutoModelForCausalLM; "
    "m = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32); "
    "print(sum(p.numel() for p in m.parameters()))"
)


def write_model(directory: str, hidden_size: int, num_layers: int, shard_bytes: int = 512 << 20) -> int:
    """A random-weight LlamaForCausalLM in ``directory``; returns its size in bytes on disk."""
    from safetensors.torch import save_file
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=32000,
        hidden_size=hidden_size,
        intermediate_size=int(hidden_size * 2.75),
        num_hidden_layers=num_layers,
        num_attention_heads=hidden_size // 128,
        num_key_value_heads=hidden_size // 512,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
        architectures=["LlamaForCausalLM"],
    )
    config.save_pretrained(directory)
    with torch.device("meta"):
        shapes = {k: v.shape for k, v in LlamaForCausalLM(config).state_dict().items()}
    shard, shard_size, index, total, weight_map = {}, 0, 0, 0, {}
    for key, shape in shapes.items():
        shard[key] = torch.randn(shape) * 0.02
        shard_size += shard[key].numel() * 4
        if shard_size >= shard_bytes or key == list(shapes)[-1]:
            name = f"model-{index:05d}.safetensors"
            save_file(shard, os.path.join(directory, name), metadata={"format": "pt"})
            weight_map |= dict.fromkeys(shard, name)
            total, shard, shard_size, index = total + shard_size, {}, 0, index + 1
    with open(os.path.join(directory, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f)
    return total


def peak_rss_bytes(command: list[str]) -> tuple[int, float]:
    """Peak RSS of ``command`` run as a child (its own process: ru_maxrss of RUSAGE_CHILDREN is a max
    over children, so each measurement runs from a fresh intermediate process)."""
    probe = (
        "import resource, subprocess, sys, time; t = time.perf_counter(); "
        "subprocess.run(sys.argv[1:], check=True, stdout=subprocess.DEVNULL); "
        "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024, time.perf_counter() - t)"
    )
    out = subprocess.run([sys.executable, "-c", probe, *command], check=True, capture_output=True, text=True)
    rss, seconds = out.stdout.split()[-2:]
    return int(rss), float(seconds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden-size", type=int, default=2048)
    parser.add_argument("--num-layers", type=int, default=10)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    assert resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss >= 0
    with tempfile.TemporaryDirectory() as tmp:
        hf_dir, ours = os.path.join(tmp, "hf"), os.path.join(tmp, "ours")
        started = time.perf_counter()
        model_bytes = write_model(hf_dir, args.hidden_size, args.num_layers)
        print(
            f"model: {model_bytes / 2**30:.2f} GiB fp32 safetensors (written in {time.perf_counter() - started:.0f} s)"
        )
        convert = [sys.executable, "-m", "megatron.core.models.checkpoint_converter", "--loader", "hf", "--saver",
                   "megatron", "--load-dir", hf_dir, "--save-dir", ours]  # fmt: skip
        ours_rss, ours_s = peak_rss_bytes(convert)
        print(f"convert (HF -> ours): peak RSS {ours_rss / 2**30:.2f} GiB = {ours_rss / model_bytes:.2f} x model")
        anchor_rss, anchor_s = peak_rss_bytes([sys.executable, "-c", ANCHOR, hf_dir])
    result = {
        "model_bytes": model_bytes,
        "convert_peak_rss_bytes": ours_rss,
        "convert_s": ours_s,
        "from_pretrained_peak_rss_bytes": anchor_rss,
        "from_pretrained_s": anchor_s,
    }
    print(
        f"convert (HF -> ours): peak RSS {ours_rss / 2**30:.2f} GiB = {ours_rss / model_bytes:.2f} x model, "
        f"{ours_s:.0f} s\n"
        f"anchor from_pretrained: peak RSS {anchor_rss / 2**30:.2f} GiB = {anchor_rss / model_bytes:.2f} x model, "
        f"{anchor_s:.0f} s\nconvert / anchor peak RSS: {ours_rss / anchor_rss:.2f}"
    )
    finish(result, args.json)


if __name__ == "__main__":
    main()
