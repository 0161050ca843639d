"""Tests of the coordinator, engine endpoint and client."""
