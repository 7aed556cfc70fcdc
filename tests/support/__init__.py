"""Code the tests (and benches) use that is not part of the shipped package."""
