"""The frontend's test kit (tiny tokenizer, scheduler-backed engine, harness)."""

from tests.frontend.conftest import harness, model_dir, tokenizer  # noqa: F401  (fixtures)
