"""Datasets: indexed binary token files, GPT samples over them, weighted blends, mock data,
built-in corpus.

Names are imported from their modules on first use, so that tools which only read or
write indexed files (tools/preprocess_data.py) do not pay for importing torch.
"""

import importlib

_EXPORTS = {
    "BUILTIN_DATA_PATH": "builtin_corpus",
    "build_builtin_corpus": "builtin_corpus",
    "builtin_documents": "builtin_corpus",
    "default_builtin_corpus_prefix": "builtin_corpus",
    "Blend": "blend",
    "parse_blend": "blend",
    "BlendedDataset": "blended_dataset",
    "blending_indices": "blended_dataset",
    "build_blended_gpt_datasets": "blended_dataset",
    "DatasetConfigError": "errors",
    "GPTDataset": "gpt_dataset",
    "build_gpt_datasets": "gpt_dataset",
    "make_sample": "gpt_dataset",
    "IndexedDataset": "indexed_dataset",
    "IndexedDatasetBuilder": "indexed_dataset",
    "IndexedDatasetError": "indexed_dataset",
    "optimal_dtype": "indexed_dataset",
    "MockGPTDataset": "mock_dataset",
    "build_mock_gpt_datasets": "mock_dataset",
    "parse_split": "split",
    "split_document_ranges": "split",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)


def __dir__():
    return __all__
