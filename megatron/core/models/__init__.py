"""Model definitions (GPT, hybrid Mamba/attention, MIMO) and HuggingFace mappings."""
