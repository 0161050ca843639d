"""Every test file belongs to exactly one GPU bucket."""

import glob
import os

from tools.run_test_bucket import bucket_files, load_buckets

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_every_test_file_is_in_exactly_one_bucket():
    buckets = load_buckets()
    owners: dict[str, list[str]] = {}
    for name, bucket in buckets.items():
        assert bucket["gpus"] in (1, 2, 4, 8), name
        for path in bucket_files(bucket, ROOT):
            owners.setdefault(path, []).append(name)
    test_files = [
        os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "tests", "**", "test_*.py"), recursive=True)
    ]
    assert test_files
    for path in test_files:
        assert len(owners.get(path, [])) == 1, f"{path} is in buckets {owners.get(path, [])}; it needs exactly one"
