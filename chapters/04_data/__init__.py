"""04 · Data: from .bin/.idx to get_batch."""

from importlib import import_module

__pages__ = ["indexed", "preprocess", "gpt_indices", "gpt_dataset", "index_tables", "blended",
             "samplers", "distribute", "sft", "pipeline"]

# Megatron's names, importable from the package; loaded on first use so that the light
# modules (the preprocessing CLI, the .idx reader) do not pay for the rest.
_EXPORTS = {
    "IndexedDataset": "indexed", "IndexedDatasetBuilder": "indexed", "IndexedDatasetError": "indexed",
    "GPTDatasetConfig": "gpt_dataset", "GPTDataset": "gpt_dataset", "Split": "gpt_dataset",
    "BlendedDataset": "blended", "BlendedMegatronDatasetBuilder": "blended",
    "parse_data_path": "blended",
    "MegatronPretrainingSampler": "samplers", "MegatronPretrainingRandomSampler": "samplers",
    "build_pretraining_data_loader": "samplers", "cyclic_iter": "samplers",
    "get_batch": "distribute", "SFTDataset": "sft",
    "DataConfig": "pipeline", "build_train_valid_test_datasets": "pipeline",
    "build_data_iterators": "pipeline", "is_dataset_built_on_rank": "pipeline",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(import_module(f"tinytron.data.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module 'tinytron.data' has no attribute {name!r}")
