import pytest

from .factories import make_hf_model


@pytest.fixture(scope="module")
def hf_models(tmp_path_factory):
    """kind -> (folder, transformers model); each tiny model is built once per module."""
    cache: dict = {}

    def get(kind: str):
        if kind not in cache:
            folder = tmp_path_factory.mktemp(kind)
            cache[kind] = (folder, make_hf_model(kind, folder))
        return cache[kind]

    return get
