"""Fault suite of issue 19: one file per item, each through real processes and sockets."""
