"""Megatron-style training and serving of GPT and hybrid Mamba/attention models."""

__version__ = "0.1.0"
