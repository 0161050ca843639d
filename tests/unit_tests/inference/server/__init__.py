"""Tests of the OpenAI-compatible HTTP server."""
