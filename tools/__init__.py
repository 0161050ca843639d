"""Developer tools run from a checkout (scripts; importable as ``tools.*`` from the repository root)."""
